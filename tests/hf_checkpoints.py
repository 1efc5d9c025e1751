"""Tiny LLaMA-architecture checkpoints (random init, 2 layers, hidden 256) in each quantized format,
written offline the way each format's own tools write them, and the weights each format's own
formula gives back.

Each layer is quantized round-to-nearest in its format's convention (AutoAWQ's
``pseudo_quantize_tensor``: asymmetric, zero point ``-round(min / s)``; GPTQ's ``Quantizer``:
asymmetric, or symmetric with the zero point ``2^(b-1)``; compressed-tensors' ``calculate_qparams``:
signed codes, symmetric or with a signed zero point) and packed with tests/reference_packers.py's
independent reference packers (AutoAWQ GEMM order ``[0, 2, 4, 6, 1, 3, 5, 7]``, GPTQ v1 zeros
minus one and v2, act-order ``g_idx``, compressed-tensors' int32 bit stream). The reference
weights come from the same file's reference dequantizers, which evaluate each format's formula.
None of those packages (or mixgemm's importers) is used to write them.
"""
from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import save_file
from torch import nn

import mixgemm
from mixgemm import formats
from mixgemm.nn import QuantLinear
from mixgemm.weights.quantize import deinterleave_rows

import reference_packers as rp   # the formats' independent reference packers

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 2, 4, 2, 64, 512
#: the linear layers of one decoder layer: name -> (N, K) as a function of the intermediate size
PROJ = {"self_attn.q_proj": lambda i: (HEADS * HEAD_DIM, HIDDEN),
        "self_attn.k_proj": lambda i: (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj": lambda i: (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.o_proj": lambda i: (HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj": lambda i: (i, HIDDEN),
        "mlp.up_proj": lambda i: (i, HIDDEN),
        "mlp.down_proj": lambda i: (HIDDEN, i)}
#: layers that read the same input share an act-order permutation (the same Hessian in GPTQ)
INPUT_OF = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
            "self_attn.o_proj": "o", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down"}


def llama_config(intermediate: int = 512, tie: bool = False, dtype: str = "float16") -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": intermediate, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": tie, "hidden_act": "silu", "torch_dtype": dtype, "attention_bias": False,
            "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def linear_names(intermediate: int = 512):
    for layer in range(LAYERS):
        for proj, shape in PROJ.items():
            yield f"model.layers.{layer}.{proj}", shape(intermediate), proj


@dataclasses.dataclass
class Reference:
    """What a checkpoint holds, as its format defines it.

    config: the model's config.json less quantization_config; plain: every unquantized tensor as
    stored; linears: each quantized layer's weight [N, K] by the format's own formula, in the
    checkpoint's dtype; full_precision: the layers mixgemm must keep unquantized."""

    config: dict
    plain: Dict[str, torch.Tensor]
    linears: Dict[str, torch.Tensor]
    dtype: torch.dtype
    full_precision: frozenset = frozenset()


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _plain_tensors(config: dict, dtype: torch.dtype, g: torch.Generator) -> Dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.5,
           "model.norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=g)}
    for layer in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{layer}.{norm}.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g) * 0.05
    return {k: v.to(dtype) for k, v in out.items()}


def _float_weight(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=g) * (1.0 / k ** 0.5)


def rtn(w: torch.Tensor, bits: int, groups: torch.Tensor, num_groups: int, symmetric: bool,
        scale_dtype: torch.dtype):
    """Round-to-nearest with unsigned codes: (q [N, K], z [N, G], s [N, G] in scale_dtype), such that
    w ~ (q - z) * s; symmetric: z = 2^(b-1) and s = 2 * amax / (2^b - 1) (GPTQ's sym)."""
    maxq = (1 << bits) - 1
    n = w.shape[0]
    s = torch.empty(n, num_groups)
    z = torch.empty(n, num_groups, dtype=torch.int64)
    for j in range(num_groups):
        cols = w[:, groups == j]
        if symmetric:
            s[:, j] = (2 * cols.abs().amax(1) / maxq).clamp(min=1e-5)
            z[:, j] = 1 << (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s[:, j] = ((hi - lo) / maxq).clamp(min=1e-5)
            z[:, j] = (-torch.round(lo / s[:, j].to(scale_dtype).float())).clamp(0, maxq).long()
    s = s.to(scale_dtype)
    q = torch.clamp(torch.round(w / s.float()[:, groups]) + z[:, groups], 0, maxq).long()
    return q, z, s


def _groups(k: int, gs: int, act_order: bool, g: torch.Generator):
    """g_idx [K] (int32) and the number of groups: contiguous, or a GPTQ desc_act permutation."""
    gs = k if gs == -1 else gs
    g_idx = rp.random_act_order_g_idx(k, gs, g) if act_order else (torch.arange(k) // gs).to(torch.int32)
    return g_idx, -(-k // gs)


def _write(model_dir: Path, config: dict, quantization_config: dict, tensors: Dict[str, torch.Tensor],
           shards: int = 1) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    if shards == 1:
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = list(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ------------------------------------------------------------------------------------ writers


def write_awq(model_dir: Path, group_size: int = 64, tie: bool = False, shards: int = 2) -> Reference:
    """AutoAWQ GEMM, 4-bit, asymmetric, fp16 scales; two shards with an index."""
    config = llama_config(tie=tie)
    g = gen("awq", group_size, tie)
    tensors = _plain_tensors(config, torch.float16, g)
    linears = {}
    for name, (n, k), _ in linear_names():
        groups, num_groups = _groups(k, group_size, False, g)
        q, z, s = rtn(_float_weight(n, k, g), 4, groups.long(), num_groups, False, torch.float16)
        t = {"qweight": rp.awq_pack(q.t()), "qzeros": rp.awq_pack(z.t()), "scales": s.t().contiguous()}
        tensors.update({f"{name}.{key}": v for key, v in t.items()})
        linears[name] = rp.awq_reference_dequant(t["qweight"], t["qzeros"], t["scales"], group_size).contiguous()
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}
    _write(model_dir, config, qc, tensors, shards)
    return Reference(config, {k: v for k, v in tensors.items() if k in _plain_keys(config)}, linears, torch.float16)


def _plain_keys(config: dict):
    return set(_plain_tensors(config, torch.float32, torch.Generator().manual_seed(0)))


def gptq_layer(w: torch.Tensor, bits: int, group_size: int, symmetric: bool, fmt: str, g_idx: torch.Tensor,
               num_groups: int) -> Dict[str, torch.Tensor]:
    """A GPTQ layer's tensors (qweight, qzeros, scales, g_idx) from a float weight [N, K]."""
    q, z, s = rtn(w, bits, g_idx.long(), num_groups, symmetric, torch.float16)
    if fmt == "gptq":        # AutoGPTQ's packer stores z - 1 and cannot store a zero point of 0
        z1 = z.clamp(min=1)
        if not torch.equal(z1, z):
            q = torch.clamp(torch.round(w / s.float()[:, g_idx.long()]) + z1[:, g_idx.long()], 0, (1 << bits) - 1).long()
        z = z1
    return {"qweight": rp.gptq_pack(q.t(), bits, 0), "qzeros": rp.gptq_pack_zeros(z.t(), bits, fmt),
            "scales": s.t().contiguous(), "g_idx": g_idx.clone()}


def write_gptq(model_dir: Path, bits: int = 4, group_size: int = 64, symmetric: bool = False, fmt: str = "gptq",
               act_order: bool = False, intermediate: int = 512, tie: bool = False,
               separate_mlp_orders: bool = False) -> Reference:
    """GPTQ (v1 "gptq" or "gptq_v2"), fp16 scales, optional desc_act g_idx (one permutation per
    layer input, so gate and up share theirs unless ``separate_mlp_orders``). A down_proj whose K
    is not a multiple of 64 is a layer mixgemm must keep in full precision."""
    config = llama_config(intermediate, tie)
    g = gen("gptq", bits, group_size, symmetric, fmt, act_order, intermediate, tie, separate_mlp_orders)
    tensors = _plain_tensors(config, torch.float16, g)
    linears, full = {}, set()
    orders: Dict[tuple, tuple] = {}
    for name, (n, k), proj in linear_names(intermediate):
        layer = name.split(".")[2]
        role = (layer, proj if separate_mlp_orders else INPUT_OF[proj])
        if role not in orders:
            orders[role] = _groups(k, group_size, act_order, g)
        g_idx, num_groups = orders[role]
        t = gptq_layer(_float_weight(n, k, g), bits, group_size, symmetric, fmt, g_idx, num_groups)
        tensors.update({f"{name}.{key}": v for key, v in t.items()})
        linears[name] = rp.gptq_reference_dequant(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, fmt)
        if k % 64:
            full.add(name)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": symmetric,
          "checkpoint_format": fmt, "true_sequential": True, "damp_percent": 0.01}
    if fmt == "gptq" and not act_order:
        del qc["checkpoint_format"]          # AutoGPTQ's older configs: no checkpoint_format means v1
    _write(model_dir, config, qc, tensors)
    return Reference(config, {k: tensors[k] for k in _plain_keys(config)}, linears, torch.float16, frozenset(full))


def write_compressed_tensors(model_dir: Path, bits: int = 4, group_size: int = 64, symmetric: bool = True,
                             act_order: bool = False, tensor_strategy_o_proj: bool = False,
                             tie: bool = False, fp8_activations: Optional[str] = None,
                             layout: str = "pack-quantized") -> Reference:
    """compressed-tensors pack-quantized (``layout="int-quantized"``: the codes as an int8
    ``weight [N, K]`` and the zero points as int8 ``[N, G]``, no ``weight_shape``, as its
    NaiveQuantizationCompressor writes them), bf16 scales, strategy "group" (group_size=-1:
    "channel"), optional actorder "group" (weight_g_idx); with ``tensor_strategy_o_proj`` a second
    config group quantizes o_proj with one scale per tensor, which mixgemm cannot represent.
    ``fp8_activations``: the group also quantizes the input activations to fp8, ``"token"``
    (dynamic) or ``"tensor"`` (static: a bf16 ``input_scale`` per layer, as compressed-tensors
    stores it)."""
    config = llama_config(tie=tie, dtype="bfloat16")
    g = gen("ct", bits, group_size, symmetric, act_order, tensor_strategy_o_proj, tie)
    tensors = _plain_tensors(config, torch.bfloat16, g)
    linears, full = {}, set()
    offset = 1 << (bits - 1)
    orders: Dict[tuple, tuple] = {}
    for name, (n, k), proj in linear_names():
        w = _float_weight(n, k, g)
        prefix = {}
        if tensor_strategy_o_proj and proj == "self_attn.o_proj":
            s = (w.abs().max() / ((2 * offset - 1) / 2)).to(torch.bfloat16).reshape(1)
            q = torch.clamp(torch.round(w / s.float()), -offset, offset - 1).long()
            prefix = {"weight_packed": rp.ct_pack(q, bits), "weight_scale": s, "weight_shape": torch.tensor([n, k])}
            linears[name] = q.to(torch.bfloat16) * s          # compressed-tensors' _dequantize, one scale
            full.add(name)
        else:
            role = (name.split(".")[2], INPUT_OF[proj])
            if role not in orders:
                orders[role] = _groups(k, group_size, act_order, g)
            g_idx, num_groups = orders[role]
            q_u, z_u, s = rtn(w, bits, g_idx.long(), num_groups, symmetric, torch.bfloat16)
            prefix = {"weight_packed": rp.ct_pack(q_u - offset, bits), "weight_scale": s,
                      "weight_shape": torch.tensor([n, k])}
            if not symmetric:
                prefix["weight_zero_point"] = rp.ct_pack(z_u - offset, bits, 0)
            if act_order:
                prefix["weight_g_idx"] = g_idx.clone()
            linears[name] = rp.ct_reference_dequant(prefix["weight_packed"], s, prefix["weight_shape"], bits,
                                                    prefix.get("weight_zero_point"), prefix.get("weight_g_idx"))
            if layout == "int-quantized":
                prefix = {"weight": (q_u - offset).to(torch.int8), "weight_scale": s,
                          **({} if symmetric else {"weight_zero_point": (z_u - offset).to(torch.int8)}),
                          **({"weight_g_idx": g_idx.clone()} if act_order else {})}
        if fp8_activations == "tensor":
            prefix["input_scale"] = (torch.rand(1, generator=g) * 0.1 + 0.01).to(torch.bfloat16)
        tensors.update({f"{name}.{key}": v for key, v in prefix.items()})
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size,
               "actorder": "group" if act_order else None, "dynamic": False, "observer": "minmax"}
    acts = None if fp8_activations is None else {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": fp8_activations, "group_size": None,
        "dynamic": fp8_activations == "token"}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                          "output_activations": None}}
    if tensor_strategy_o_proj:   # listed first: the first matching group wins
        groups = {"group_1": {"targets": ["re:.*o_proj$"], "weights": {**weights, "strategy": "tensor",
                                                                        "group_size": None, "symmetric": True,
                                                                        "actorder": None},
                              "input_activations": None}, **groups}
    qc = {"quant_method": "compressed-tensors", "format": layout, "quantization_status": "compressed",
          "config_groups": groups, "ignore": ["lm_head"], "kv_cache_scheme": None}
    _write(model_dir, config, qc, tensors)
    return Reference(config, {k: tensors[k] for k in _plain_keys(config)}, linears, torch.bfloat16, frozenset(full))


def write_mixgemm(model_dir: Path, from_gptq_act_order: bool = False, tie: bool = False,
                  k_proj_group_size: int = 64, attention_bias: bool = False) -> Reference:
    """A mixgemm checkpoint: config.json with {"quant_method": "mixgemm", "format_version": 1} and a
    mixgemm.save file. Natively quantized (u4/g64 attention and gate/up, s8/g128 down_proj, bf16; k_proj
    in groups of ``k_proj_group_size``; with ``attention_bias`` q, k, v and o have biases, as Qwen2's
    q/k/v do), or converted from a GPTQ act-order checkpoint by mixgemm.formats.import_checkpoint
    (perms saved)."""
    config = llama_config(tie=tie, dtype="float16" if from_gptq_act_order else "bfloat16")
    config["attention_bias"] = attention_bias
    g = gen("mixgemm", from_gptq_act_order, tie,
            *(() if (k_proj_group_size, attention_bias) == (64, False) else (k_proj_group_size, attention_bias)))
    dtype = torch.float16 if from_gptq_act_order else torch.bfloat16
    plain = _plain_tensors(config, dtype, g)
    out: Dict[str, object] = dict(plain)
    linears = {}
    if from_gptq_act_order:
        src_dir = model_dir.with_name(model_dir.name + "-gptq-source")
        src = write_gptq(src_dir, act_order=True, fmt="gptq_v2", tie=tie)
        from safetensors.torch import load_file
        tensors = load_file(str(src_dir / "model.safetensors"))
        out = dict(formats.import_checkpoint("gptq", tensors, checkpoint_format="gptq_v2"))
        plain, linears = src.plain, src.linears
    else:
        for name, (n, k), proj in linear_names():
            w = _float_weight(n, k, g)
            qw = (mixgemm.quantize(w, 8, 128, symmetric=True, dtype=dtype) if proj == "mlp.down_proj"
                  else mixgemm.quantize(w, 4, k_proj_group_size if proj == "self_attn.k_proj" else 64, dtype=dtype))
            out[f"{name}.weight"] = mixgemm.prepack(qw)
            linears[name] = mixgemm.dequantize_reference(qw)
            if attention_bias and proj.startswith("self_attn."):
                out[f"{name}.bias"] = plain[f"{name}.bias"] = (0.1 * torch.randn(n, generator=g)).to(dtype)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "mixgemm", "format_version": 1}}))
    mixgemm.save(str(model_dir / "model.safetensors"), out)
    return Reference(config, plain, linears, dtype)


WRITERS = {
    "awq": lambda d: write_awq(d),
    "awq-tied": lambda d: write_awq(d, tie=True, shards=1),
    "gptq-v1-sym": lambda d: write_gptq(d, symmetric=True, fmt="gptq"),
    "gptq-v1-act-order": lambda d: write_gptq(d, bits=4, group_size=32, fmt="gptq", act_order=True),
    "gptq-v2-8bit-act-order": lambda d: write_gptq(d, bits=8, group_size=128, fmt="gptq_v2", act_order=True),
    "gptq-v2-2bit-channel": lambda d: write_gptq(d, bits=2, group_size=-1, fmt="gptq_v2"),
    "ct-sym": lambda d: write_compressed_tensors(d),
    "ct-asym-act-order": lambda d: write_compressed_tensors(d, bits=4, group_size=128, symmetric=False, act_order=True),
    "ct-8bit-channel": lambda d: write_compressed_tensors(d, bits=8, group_size=-1),
    "ct-w4a8-token": lambda d: write_compressed_tensors(d, fp8_activations="token"),
    "ct-w2a8-static": lambda d: write_compressed_tensors(d, bits=2, symmetric=False, fp8_activations="tensor"),
    "ct-w4a8-int-token": lambda d: write_compressed_tensors(d, fp8_activations="token", layout="int-quantized"),
    "ct-w2a8-int-static": lambda d: write_compressed_tensors(d, bits=2, symmetric=False, fp8_activations="tensor",
                                                             layout="int-quantized"),
    "mixgemm": lambda d: write_mixgemm(d),
    "mixgemm-from-gptq-act-order": lambda d: write_mixgemm(d, from_gptq_act_order=True),
}


# -------------------------------------------------------- the loaded model, without the kernels


def dequantized_linears(model: nn.Module) -> Dict[str, tuple]:
    """Each QuantLinear's weight, dequantized (mixgemm.dequantize_reference) and put back in the
    source's column order (act-order permutation undone) and row order (a fused gate/up layer split
    into ``gate_proj`` and ``up_proj``, a fused q/k/v layer into ``q_proj``, ``k_proj`` and
    ``v_proj``): name -> (weight [N, K], bias or None)."""
    from mixgemm.hf import FusedQKVAttention

    modules = dict(model.named_modules())
    out = {}
    for name, mod in modules.items():
        if not isinstance(mod, QuantLinear):
            continue
        w = mixgemm.dequantize_reference(mod.packed)
        if mod.perm is not None:
            src = torch.empty_like(w)
            src[:, mod.perm.cpu()] = w
            w = src
        bias = None if mod.bias is None else mod.bias.detach()
        parent = name.rpartition(".")[0]
        if mod.activation == "swiglu":
            (wg, wu), (bg, bu) = deinterleave_rows(w), (deinterleave_rows(bias) if bias is not None else (None, None))
            out[f"{parent}.gate_proj"], out[f"{parent}.up_proj"] = (wg, bg), (wu, bu)
        elif isinstance(modules.get(parent), FusedQKVAttention) and name.endswith(".qkv_proj"):
            sections = modules[parent].sections
            ws = w.split(sections)
            bs = bias.split(sections) if bias is not None else (None,) * 3
            for proj, wp, bp in zip(("q_proj", "k_proj", "v_proj"), ws, bs):
                out[f"{parent}.{proj}"] = (wp.contiguous(), bp)
        else:
            out[name] = (w, bias)
    return out


class _MLP(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _linear(w, b):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    lin.weight = nn.Parameter(w.float(), requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(b.float(), requires_grad=False)
    return lin


def to_float32(model: nn.Module) -> nn.Module:
    """The loaded model in float32 on the CPU, each QuantLinear replaced by an nn.Linear holding its
    dequantized weight (a GatedMLP by a plain gated MLP; a FusedQKVAttention keeps its module, its
    ``qkv_proj`` an nn.Linear of the stacked q, k and v weights): the loading path, without the GPU
    kernels."""
    from mixgemm.hf import FusedQKVAttention, GatedMLP

    weights = dequantized_linears(model)
    for name, mod in list(model.named_modules()):
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if isinstance(mod, FusedQKVAttention) and isinstance(mod.qkv_proj, QuantLinear):
            parts = [weights[f"{name}.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
            bias = None if parts[0][1] is None else torch.cat([b for _, b in parts])
            mod.qkv_proj = _linear(torch.cat([w for w, _ in parts]), bias)
        elif isinstance(mod, GatedMLP):
            down = mod.down_proj
            if isinstance(down, QuantLinear):
                down = _linear(*weights[f"{name}.down_proj"])
            setattr(owner, attr, _MLP(_linear(*weights[f"{name}.gate_proj"]), _linear(*weights[f"{name}.up_proj"]),
                                      down))
        elif isinstance(mod, QuantLinear) and mod.activation != "swiglu" and name in weights:
            setattr(owner, attr, _linear(*weights[name]))
    return model.to("cpu").float()


def reference_model(ref: Reference, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    """The checkpoint's model in float32 (or ``dtype``) with every quantized layer's weight from its
    format's formula."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{k: v for k, v in ref.config.items() if k not in ("architectures", "torch_dtype")})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    state = {k: v.float() for k, v in ref.plain.items()}
    state.update({f"{k}.weight": v.float() for k, v in ref.linears.items()})
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def input_ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def checkpoint_keys(model_dir: Path) -> Dict[str, str]:
    """tensor name -> shard file name."""
    from safetensors import safe_open

    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: path.name for k in f.keys()})
    return out


def rewrite(model_dir: Path, change, update_index: bool = True) -> None:
    """Apply ``change(tensors)`` (in place on a dict) to every shard of a checkpoint, and make its
    index (if any) list what the shards then hold, unless ``update_index`` is False."""
    from safetensors.torch import load_file

    weight_map = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path), metadata={"format": "pt"})
        weight_map.update({k: path.name for k in tensors})
    index = model_dir / "model.safetensors.index.json"
    if update_index and index.is_file():
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        elif key == "quantization_config":
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    path.write_text(json.dumps(config))

