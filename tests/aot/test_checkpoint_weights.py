"""mixgemm.aot.checkpoint and ``mixgemm generate --for``: a checkpoint's weight uses, read
from its headers, must be what the importers (mixgemm.formats, mixgemm.load) and the loader's
gate/up fusion make of its tensors; then ``--for`` lists and builds exactly their kernels.

The tiny checkpoints are written here: random codes packed in each format's layout (the
importers accept any codes), a Llama-shaped layer naming, shards and config.json.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mixgemm import formats
from mixgemm.aot import prebuild
from mixgemm.aot.checkpoint import kernel_specs, weight_uses
from mixgemm.cli.main import main
from mixgemm.errors import UserError
from mixgemm.weights.io import save
from mixgemm.weights.layout import prepack, unpack
from mixgemm.nn import QuantLinear
from mixgemm.aot.prebuild import WeightUse, specs_for
from mixgemm.weights.quantize import interleave_gate_up, quantize
from mixgemm.jit.specs import Activation
from mixgemm.dtypes import ActType
from mixgemm.weights.types import PackedWeight, QuantizedWeight

from fake_nvcc import fake_env  # noqa: F401  (the fake nvcc and a private cache)

#: layer -> (N, K) of a tiny Llama decoder layer
LAYERS = {"self_attn.q_proj": (128, 256), "self_attn.k_proj": (64, 256), "self_attn.v_proj": (64, 256),
          "self_attn.o_proj": (256, 128), "mlp.gate_proj": (256, 256), "mlp.up_proj": (256, 256),
          "mlp.down_proj": (256, 256)}
PREFIX = "model.layers.0."


def _i32(shape, gen) -> torch.Tensor:
    return torch.randint(-2 ** 31, 2 ** 31, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def _scales(shape, dtype, gen) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) * 1e-2 + 1e-3).to(dtype)


def awq_layer(n, k, gs, gen, **_):
    return {"qweight": _i32((k, n // 8), gen), "qzeros": _i32((k // gs, n // 8), gen),
            "scales": _scales((k // gs, n), torch.float16, gen)}


def gptq_layer(n, k, gs, gen, bits=4, sym=True, act_order=False):
    g = k // gs
    if sym:   # v1 stores z - 1 = 2^(b-1) - 1 in every field
        word = sum(((1 << (bits - 1)) - 1) << (bits * j) for j in range(32 // bits))
        qzeros = torch.full((g, n * bits // 32), word, dtype=torch.int64).to(torch.int32)
    else:
        qzeros = _i32((g, n * bits // 32), gen)
    g_idx = torch.arange(k, dtype=torch.int32) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return {"qweight": _i32((k * bits // 32, n), gen), "qzeros": qzeros, "scales": _scales((g, n), torch.float16, gen),
            "g_idx": g_idx}


def ct_layer(n, k, gs, gen, bits=4, sym=False, act_order=False, placeholder=False):
    g = k // gs
    t = {"weight_packed": _i32((n, k * bits // 32), gen), "weight_scale": _scales((n, g), torch.bfloat16, gen),
         "weight_shape": torch.tensor([n, k])}
    if not sym:
        lo = -(1 << (bits - 1))
        t["weight_zero_point"] = torch.randint(lo, -lo, (n, g), generator=gen).to(torch.int8)
    if act_order:
        t["weight_g_idx"] = (torch.arange(k, dtype=torch.int32) // gs)[torch.randperm(k, generator=gen)]
    elif placeholder:
        t["weight_g_idx"] = torch.full((k,), -1, dtype=torch.int32)
    return t


WRITERS = {"awq": awq_layer, "gptq": gptq_layer, "compressed-tensors": ct_layer}


def config_for(method, bits, gs, sym):
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": False}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": bits, "group_size": gs, "symmetric": sym, "strategy": "group", "type": "int"}}}}


def write_hf(root: Path, method: str, bits=4, gs=64, sym=None, per_layer=None, seed=0) -> dict:
    """A model directory: config.json and two shards (attention, then the MLP with the plain
    tensors). Returns every tensor written."""
    gen = torch.Generator().manual_seed(seed)
    sym = {"awq": False, "gptq": True, "compressed-tensors": False}[method] if sym is None else sym
    root.mkdir(parents=True, exist_ok=True)
    shards = [{}, {"model.embed_tokens.weight": torch.randn(32, 256).to(torch.float16),
                   "model.norm.weight": torch.ones(256, dtype=torch.float16)}]
    for i, (layer, (n, k)) in enumerate(LAYERS.items()):
        opts = dict(bits=bits, sym=sym, **(per_layer or {}).get(layer, {}))
        tensors = WRITERS[method](n, k, gs, gen, **opts)
        shards[0 if layer.startswith("self_attn") else 1].update({f"{PREFIX}{layer}.{t}": v for t, v in tensors.items()})
    for i, shard in enumerate(shards):
        safetensors.torch.save_file(shard, str(root / f"model-0000{i + 1}-of-00002.safetensors"))
    dtype = "bfloat16" if method == "compressed-tensors" else "float16"     # the scales' dtype
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "torch_dtype": dtype,
                                                  "quantization_config": config_for(method, bits, gs, sym)}))
    return {k: v for shard in shards for k, v in shard.items()}


def imported_uses(method, tensors) -> tuple[dict, dict]:
    """What the importer makes of the tensors: {layer: PackedWeight}, {layer: perm}."""
    out = formats.import_checkpoint(method, tensors, checkpoint_format="gptq" if method == "gptq" else None)
    packed = {k[:-len(".weight")]: v for k, v in out.items() if isinstance(v, PackedWeight)}
    perms = {k[:-len(".perm")]: v for k, v in out.items() if k.endswith(".perm")}
    return packed, perms


def loader_model(packed: dict, perms: dict, fuse=True) -> torch.nn.Module:
    """The layers the loader builds: gate/up fused into a swiglu layer when they can be."""
    model = torch.nn.Module()
    gate, up = packed.get(PREFIX + "mlp.gate_proj"), packed.get(PREFIX + "mlp.up_proj")
    can_fuse = (fuse and gate is not None and up is not None
                and (gate.weight_type, gate.group_size, gate.n, gate.k, gate.dtype) ==
                (up.weight_type, up.group_size, up.n, up.k, up.dtype)
                and PREFIX + "mlp.gate_proj" not in perms and PREFIX + "mlp.up_proj" not in perms)
    for i, (name, w) in enumerate(sorted(packed.items())):
        if can_fuse and name in (PREFIX + "mlp.gate_proj", PREFIX + "mlp.up_proj"):
            continue
        model.add_module(f"l{i}", QuantLinear.from_packed(w, perm=perms.get(name)))
    if can_fuse:
        layer = QuantLinear.from_packed(prepack(interleave_gate_up(unpack(gate), unpack(up))))
        layer.activation, layer.out_features = "swiglu", gate.n
        model.add_module("gate_up", layer)
    return model


@pytest.mark.parametrize("method,bits,sym", [("awq", 4, False), ("gptq", 4, True), ("gptq", 8, False),
                                             ("gptq", 2, True), ("compressed-tensors", 4, False),
                                             ("compressed-tensors", 8, True)])
def test_hf_directory_matches_the_importer(tmp_path, method, bits, sym):
    tensors = write_hf(tmp_path / "model", method, bits=bits, sym=sym)
    packed, perms = imported_uses(method, tensors)
    assert not perms
    plain = weight_uses(tmp_path / "model", fuse_gate_up=False)
    assert [(u.name, u) for u in plain] == [(name, WeightUse.of_packed(w)) for name, w in sorted(packed.items())]
    assert {u.weight_type.signed for u in plain} == {sym}
    fused = weight_uses(tmp_path / "model")
    assert len(fused) == len(plain) - 1
    (gate_up,) = [u for u in fused if u.activation is Activation.SWIGLU]
    assert gate_up.name == PREFIX + "mlp.gate_up" and gate_up.n == 2 * LAYERS["mlp.gate_proj"][0]
    assert [s.name for s in specs_for(fused)] == [s.name for s in specs_for(loader_model(packed, perms))]
    # another activation dtype
    assert {u.act for u in weight_uses(tmp_path / "model", dtype="bf16")} == {ActType.BF16}


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_act_order_layers_are_not_fused(tmp_path, method):
    """An act-order gate (its groups are not runs of consecutive columns) imports with a
    permutation: the loader cannot fuse it with up, so neither does --for."""
    tensors = write_hf(tmp_path / "m", method, per_layer={"mlp.gate_proj": {"act_order": True}})
    packed, perms = imported_uses(method, tensors)
    assert set(perms) == {PREFIX + "mlp.gate_proj"}
    fused = weight_uses(tmp_path / "m")
    assert all(u.activation is Activation.NONE for u in fused) and len(fused) == len(LAYERS)
    assert [s.name for s in specs_for(fused)] == [s.name for s in specs_for(loader_model(packed, perms))]


def test_compressed_tensors_placeholder_g_idx_is_no_permutation(tmp_path):
    tensors = write_hf(tmp_path / "m", "compressed-tensors",
                       per_layer={"mlp.gate_proj": {"placeholder": True}, "mlp.up_proj": {"placeholder": True}})
    assert not imported_uses("compressed-tensors", tensors)[1]
    assert any(u.activation is Activation.SWIGLU for u in weight_uses(tmp_path / "m"))


def _packed(n, k, bits, gs, sym, seed, offsets=False):
    torch.manual_seed(seed)
    qw = quantize(torch.randn(n, k), bits, gs, symmetric=sym)
    if offsets:
        qw = QuantizedWeight(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size, qw.symmetric,
                             torch.zeros(qw.scales.shape))
    return prepack(qw)


def test_mixgemm_file_and_directory(tmp_path):
    weights = {f"{PREFIX}{layer}.weight": _packed(n, k, 4, 64, False, i) for i, (layer, (n, k)) in
               enumerate(LAYERS.items())}
    weights[f"{PREFIX}self_attn.o_proj.weight"] = _packed(256, 128, 4, 64, False, 9, offsets=True)
    extra = {"model.layers.1.mlp.gate_proj.weight": _packed(256, 256, 8, 128, True, 10),
             "model.layers.1.mlp.up_proj.weight": _packed(256, 256, 8, 128, True, 11),
             "model.layers.1.mlp.up_proj.perm": torch.randperm(256)}
    save(tmp_path / "a.safetensors", {**weights, "model.norm.weight": torch.ones(256)})
    uses = weight_uses(tmp_path / "a.safetensors")
    by_name = {u.name: u for u in uses}
    assert by_name[PREFIX + "self_attn.o_proj"].zero_offsets
    assert by_name[PREFIX + "mlp.gate_up"] == WeightUse(512, 256, weights[PREFIX + "mlp.gate_proj.weight"]
                                                             .weight_type, ActType.BF16, Activation.SWIGLU)
    assert len(uses) == len(LAYERS) - 1
    # a directory of mixgemm files (no config.json); layer 1's up has a permutation: not fused
    d = tmp_path / "dir"
    d.mkdir()
    save(d / "1.safetensors", weights)
    save(d / "2.safetensors", extra)
    uses = weight_uses(d)
    assert {u.name for u in uses} == set(by_name) | {"model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"}
    assert weight_uses(tmp_path / "a.safetensors", dtype="fp16")[0].act is ActType.FP16


def test_refusals(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        weight_uses(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no \\*.safetensors"):
        weight_uses(tmp_path / "empty")
    write_hf(tmp_path / "hqq", "awq")
    (tmp_path / "hqq" / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(UserError, match="quant_method 'hqq' is not supported"):
        weight_uses(tmp_path / "hqq")
    plain = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(16, 64)}, str(plain))
    with pytest.raises(UserError, match="not a mixgemm file"):
        weight_uses(plain)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        weight_uses(tmp_path / "junk.safetensors")
    write_hf(tmp_path / "ct", "compressed-tensors")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    cfg["quantization_config"]["format"] = "float-quantized"
    (tmp_path / "ct" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="'float-quantized'.*not supported"):
        weight_uses(tmp_path / "ct")
    (tmp_path / "ct" / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON"):
        weight_uses(tmp_path / "ct")


# ---------------------------------------------------------------------------------------------
# mixgemm generate --for
# ---------------------------------------------------------------------------------------------
def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_list_for(tmp_path, capsys):
    write_hf(tmp_path / "m", "gptq")
    rc, out, err = run(capsys, "generate", "--list", "--for", tmp_path / "m")
    assert rc == 0, err
    assert out.split() == [s.name for s in specs_for(weight_uses(tmp_path / "m"))]
    rc, out16, _ = run(capsys, "generate", "--list", "--for", tmp_path / "m", "--max-tokens", "16")
    assert out16.split() == [s.name for s in specs_for(weight_uses(tmp_path / "m"), max_tokens=16)]
    assert set(out16.split()) < set(out.split())
    rc, outp, _ = run(capsys, "generate", "--list", "--for", tmp_path / "m", "--no-fuse-gate-up")
    assert "swiglu" in out and "swiglu" not in outp


def test_generate_build_for(tmp_path, capsys, fake_env):  # noqa: F811
    write_hf(tmp_path / "m", "awq")
    rc, out, err = run(capsys, "generate", "--build", "--for", tmp_path / "m", "--max-tokens", "1", "-j", "2")
    assert rc == 0, err
    want = {s.name for s in specs_for(weight_uses(tmp_path / "m"), max_tokens=1)}
    assert f"{len(LAYERS) - 1} quantized layers -> {len(want)} kernels" in err
    cache = Path(os.environ["MIXGEMM_CACHE_DIR"])
    assert {p.name.rsplit("-", 1)[0] for p in (cache / "kernels").iterdir()} == want
    assert [p.name.split("-")[0] for p in (cache / "host").iterdir()] == ["launcher"]


@pytest.mark.parametrize("argv,rc,msg", [
    (["--for", "{tmp}/missing", "--list"], 1, "no such file or directory"),
    (["--max-tokens", "8", "--list"], 2, "go with --for"),
    (["--for", "{tmp}/m", "--max-tokens", "0"], 2, "positive integer"),
    (["--for", "{tmp}/m", "--list", "--kernels", "nomatch"], 1, "no kernel name matches"),
])
def test_generate_for_errors(tmp_path, capsys, argv, rc, msg):
    write_hf(tmp_path / "m", "awq")
    got, out, err = run(capsys, "generate", *[a.format(tmp=tmp_path) for a in argv])
    assert got == rc and msg in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------
# The real loader: what --for reads from the headers is what from_pretrained builds
# ---------------------------------------------------------------------------------------------
def _hf_loader():
    pytest.importorskip("transformers", reason="mixgemm.hf needs transformers")
    import hf_checkpoints as hc
    from mixgemm import hf
    return hc, hf


@pytest.mark.parametrize("kind", ["awq", "gptq-v1-sym", "gptq-v1-act-order", "gptq-v2-8bit-act-order",
                                  "gptq-v2-2bit-channel", "ct-sym", "ct-asym-act-order", "ct-8bit-channel",
                                  "ct-w4a8-int-token", "ct-w2a8-int-static", "mixgemm",
                                  "mixgemm-from-gptq-act-order"])
def test_the_loaded_model_asks_for_the_kernels_of_its_headers(tmp_path, kind):
    """For each tiny checkpoint of tests/hf_checkpoints.py: the kernels of weight_uses(dir) are
    the kernels of the model mixgemm.hf.from_pretrained builds from it (fused gate/up included);
    in the config's dtype, and with another one passed to both."""
    hc, hf = _hf_loader()
    hc.WRITERS[kind](tmp_path / kind)
    for dtype in (None, "bf16", "fp16"):
        model = hf.from_pretrained(tmp_path / kind, device="cpu", dtype=dtype, attn_implementation="eager")
        assert model.mixgemm_summary.fused, "the gated MLPs are fused"
        assert [s.name for s in kernel_specs(tmp_path / kind, dtype=dtype)] == \
            [s.name for s in specs_for(model)], (kind, dtype)
        # the GEMMs' kernels are the weight uses'; the rest is the RMSNorm kernel of the norms
        gemms = [s.name for s in specs_for(weight_uses(tmp_path / kind, dtype=dtype))]
        assert sorted(set(s.name for s in specs_for(model)) - set(gemms)) == \
            [f"mixgemm_rmsnorm_{'fp16' if model.dtype == torch.float16 else 'bf16'}"]
    plain = hf.from_pretrained(tmp_path / kind, device="cpu", fuse_gate_up=False, fuse_norms=False,
                               attn_implementation="eager")
    assert [s.name for s in kernel_specs(tmp_path / kind, fuse_gate_up=False, fuse_norms=False)] == \
        [s.name for s in specs_for(plain)]


def test_the_config_dtype_decides_the_activation(tmp_path):
    """AWQ's scales are fp16; a bf16 config loads bf16 activations, so its kernels are bf16."""
    hc, hf = _hf_loader()
    hc.WRITERS["awq"](tmp_path / "m")
    hc.edit_config(tmp_path / "m", torch_dtype="bfloat16")
    assert {u.act for u in weight_uses(tmp_path / "m")} == {ActType.BF16}
    model = hf.from_pretrained(tmp_path / "m", device="cpu", attn_implementation="eager")
    assert [s.name for s in kernel_specs(tmp_path / "m")] == [s.name for s in specs_for(model)]
    assert "mixgemm_rmsnorm_bf16" in [s.name for s in kernel_specs(tmp_path / "m")]


def test_different_gate_and_up_permutations_are_not_fused(tmp_path):
    """Gate and up with different act-order permutations stay two layers in the loader, and in
    --for; a 3-bit layer (kept in full precision by the loader) needs no kernel."""
    hc, hf = _hf_loader()
    from safetensors.torch import load_file, save_file

    hc.WRITERS["gptq-v1-act-order"](tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    t = load_file(str(f))
    key = "model.layers.0.mlp.up_proj.g_idx"
    t[key] = t[key][torch.randperm(t[key].numel(), generator=torch.Generator().manual_seed(1))].contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    model = hf.from_pretrained(tmp_path / "m", device="cpu", attn_implementation="eager")
    assert model.mixgemm_summary.fused == ["model.layers.1.mlp"]
    uses = weight_uses(tmp_path / "m")
    assert [u.name for u in uses if u.activation is Activation.SWIGLU] == ["model.layers.1.mlp.gate_up"]
    assert [s.name for s in kernel_specs(tmp_path / "m")] == [s.name for s in specs_for(model)]


def test_generate_build_for_a_failed_build(tmp_path, capsys, fake_env, monkeypatch):  # noqa: F811
    """nvcc fails: exit status 1, one line, and no entry or temporary left in the cache."""
    write_hf(tmp_path / "m", "awq")
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    rc, out, err = run(capsys, "generate", "--build", "--for", tmp_path / "m", "--max-tokens", "1", "-j", "2")
    assert rc == 1 and err.strip().splitlines()[-1].startswith("mixgemm generate: error: "), err
    cache = Path(os.environ["MIXGEMM_CACHE_DIR"])
    assert not (cache / "kernels").exists() or not list((cache / "kernels").iterdir())
    assert not (cache / "tmp").exists() or not list((cache / "tmp").iterdir())
