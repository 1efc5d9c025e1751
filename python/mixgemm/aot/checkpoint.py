"""The quantized weights a checkpoint holds, read from its headers only (no tensor data), as the
:class:`~mixgemm.dispatch.uses.WeightUse` list that decides its kernels (``mixgemm generate --build
--for PATH``); a mixgemm file's stacked experts (``<prefix>.w13`` / ``<prefix>.w2``, as
``mixgemm prepack`` writes a MoE checkpoint) are one :class:`~mixgemm.dispatch.uses.ExpertsUse` each.

Two kinds of checkpoint are read:

* a **mixgemm file** (:func:`mixgemm.save`, ``mixgemm prepack``), or a directory of them: every
  packed weight's type, group size, N, K and dtype come from its header entry
  (:func:`mixgemm.weights.io.check_metadata`); a ``<name>.zero_offsets`` tensor marks zero offsets and
  a ``<layer>.perm`` tensor an act-order permutation;
* a **Hugging Face model directory** whose ``config.json`` has a ``quantization_config``
  (``quant_method`` ``awq``, ``gptq``, ``compressed-tensors`` or ``mixgemm``, parsed by
  :func:`mixgemm.formats.config.parse_quantization_config`, as :func:`mixgemm.hf.from_pretrained`
  parses it: per-layer bits, GPTQ ``dynamic`` overrides, ignored modules) and ``*.safetensors``
  shards: the layers are found by their tensor names, their shapes from the safetensors
  headers:

  ===================  ===============================  ======================================
  format               N, K                             bits / symmetric
  ===================  ===============================  ======================================
  AWQ (GEMM)           ``scales[1]``, ``qweight[0]``    4; asymmetric unless ``zero_point`` is
                                                        false
  GPTQ                 ``scales[1]``,                   the layer's ``bits`` (else from
                       ``qweight[0] * 32 / bits``       ``qzeros``); ``sym`` (default true)
  compressed-tensors   ``weight_packed[0]``,            the layer's ``num_bits``; symmetric
  (pack-quantized)     ``weight_packed[1] * 32 / bits`` iff there is no ``weight_zero_point``
  compressed-tensors   ``weight[0]``, ``weight[1]``     the same
  (int-quantized)      (the int8 codes)
  ===================  ===============================  ======================================

  Each row is its format's ``header_layer`` (in :mod:`mixgemm.formats.awq`,
  :mod:`~mixgemm.formats.gptq`, :mod:`~mixgemm.formats.compressed_tensors`; through
  :data:`mixgemm.formats.handlers.HANDLERS`).

  The one tensor read is the small group index (GPTQ ``g_idx``, compressed-tensors
  ``weight_g_idx``, ``K`` integers) where there is one: a layer whose groups are not runs of
  ``group_size`` consecutive columns imports with an act-order permutation (as
  :mod:`mixgemm.formats` decides).

  What the headers cannot tell, the importers decide from the zero points: a GPTQ
  ``sym=False`` or AWQ layer whose zero points all happen to be ``2^(b-1)`` (a compressed-tensors
  one whose zero points are all 0) imports as symmetric. Real checkpoints do not do that; if
  one did, its layer would compile its kernels on first use.

The activation dtype is ``dtype`` if given; else, for a model directory with a config.json,
the one :func:`mixgemm.hf.from_pretrained` uses (the config's ``torch_dtype`` if bf16 or fp16,
else bf16: every layer's scales are converted to it); for mixgemm files without a config, each
weight's scales' dtype (what :func:`mixgemm.load` gives).

A layer the kernels cannot take (bits other than 2, 4, 8; N not a multiple of 16 or K of 64)
is kept in full precision by the loader: it needs no kernel, and is left out with a
warning.

Gate/up fusion: the Hugging Face loader fuses a Llama-style MLP's ``<p>.gate_proj`` and
``<p>.up_proj`` into one swiglu layer (:class:`mixgemm.hf.GatedMLP`: ``N = 2I``, the gated
epilogue) when both have the same type, group size, shape and dtype, both or neither have zero
offsets and a bias, and the same act-order permutation (or none); those pairs give one swiglu
weight use, every other weight a plain one. The MLP must have a ``down_proj`` too, and the
config's ``hidden_act`` (if any) must be SiLU. ``fuse_gate_up=False`` reads every weight as a
plain one.

q/k/v fusion: in a model directory whose ``config.json`` has a ``model_type`` of a family whose
attention the loader recognizes (:data:`LLAMA_STYLE_MODEL_TYPES`, the families of
:data:`mixgemm.nn.blocks.ATTENTIONS`), an attention's ``<p>.q_proj``, ``<p>.k_proj`` and
``<p>.v_proj`` give one weight use of their stacked rows (:class:`mixgemm.hf.FusedQKVAttention`:
``N = N_q + N_k + N_v``) when they have the same type, group size, K and dtype, all or none have
zero offsets and a bias, and the same act-order permutation (or none). ``fuse_projections=False``
reads them as three (and, unless ``fuse_gate_up`` says otherwise, gate and up as two), as
:func:`mixgemm.hf.from_pretrained` does.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Dict, Optional, Union

import torch
from safetensors import safe_open

from ..dispatch.uses import ExpertsUse, WeightUse
from ..dtypes import ActType, WeightType
from ..errors import CheckpointError, UserError
from ..formats import Format
from ..formats.compressed_tensors import stores_int_codes
from ..formats.config import parse_quantization_config, resolve_dtype
from ..formats.handlers import HANDLERS
from ..formats.rules import SkipLayer
from ..jit.specs import Activation
from ..ops.norm import norm_spec
from ..weights import io as mio
from ..weights.quantize import GATE_UP_STRIPE
from .prebuild import specs_for

__all__ = ["weight_uses"]

_GATE_UP = re.compile(r"^(?P<prefix>.*)\.(?P<which>gate_proj|up_proj)$")
_QKV = re.compile(r"^(?P<prefix>.*)\.(?P<which>q_proj|k_proj|v_proj)$")


class _Layer:
    """One quantized layer found in a checkpoint (the fields of a WeightUse, plus what fusion
    needs: group size, bias, and the act-order permutation's identity)."""

    def __init__(self, name: str, n: int, k: int, wt: WeightType, act: ActType, group_size: Optional[int],
                 zero_offsets: bool = False, perm: Optional[bytes] = None, bias: bool = False,
                 experts: Optional[int] = None):
        self.name, self.n, self.k, self.wt, self.act = name, n, k, wt, act
        self.group_size, self.zero_offsets, self.perm, self.bias = group_size, zero_offsets, perm, bias
        self.experts = experts      # stacked experts (mixgemm.weights.experts.PackedExperts): E; else None

    def use(self, activation: Activation = Activation.NONE, n: Optional[int] = None) -> WeightUse:
        return WeightUse(self.n if n is None else n, self.k, self.wt, self.act, activation, self.zero_offsets,
                         self.name)

    def fusable_with(self, other: "_Layer") -> bool:
        """As :func:`mixgemm.hf.plan` decides (``_fuse_reason``)."""
        return ((self.n, self.k, self.wt, self.act, self.group_size, self.zero_offsets, self.bias, self.perm) ==
                (other.n, other.k, other.wt, other.act, other.group_size, other.zero_offsets, other.bias, other.perm)
                and self.n % GATE_UP_STRIPE == 0)

    def stackable_with(self, other: "_Layer") -> bool:
        """Whether the two can be rows of one layer, as :func:`mixgemm.hf.plan` decides
        (``_stack_reason``)."""
        return ((self.k, self.wt, self.act, self.group_size, self.zero_offsets, self.bias, self.perm) ==
                (other.k, other.wt, other.act, other.group_size, other.zero_offsets, other.bias, other.perm))


def weight_uses(path: Union[str, os.PathLike], dtype: Optional[str] = None,
                fuse_gate_up: Optional[bool] = None, fuse_projections: bool = True) -> list:
    """The weight uses of a checkpoint, from its headers.

    Parameters
    ----------
    path : str or os.PathLike
        A mixgemm file, a directory of mixgemm files, or a Hugging Face model directory with a
        ``quantization_config`` (see the module docstring).
    dtype : {"bf16", "fp16"}, optional
        Activation dtype; default as :func:`mixgemm.hf.from_pretrained` (a model directory) or
        each weight's scales' dtype (mixgemm files).
    fuse_gate_up : bool, optional
        Pair ``gate_proj`` / ``up_proj`` into swiglu uses (as the loader fuses them); None:
        ``fuse_projections``.
    fuse_projections : bool
        Stack an attention's ``q_proj`` / ``k_proj`` / ``v_proj`` into one use (as the loader
        fuses them; see the module docstring), and the default of ``fuse_gate_up``.

    Returns
    -------
    list of WeightUse and ExpertsUse
        One WeightUse per (fused) layer, in name order, then one
        :class:`~mixgemm.dispatch.uses.ExpertsUse` per MoE layer of stacked experts.

    Raises
    ------
    mixgemm.errors.UserError
        No such path, unreadable files, an unsupported quantization method or variant, a
        layer whose tensors do not fit together.

    Warns
    -----
    UserWarning
        For each layer left out (kept in full precision by the loader).
    """
    act = ActType.parse(dtype) if dtype is not None else None
    path = Path(path)
    silu, qkv = True, False
    fuse_gate_up = fuse_projections if fuse_gate_up is None else fuse_gate_up
    if path.is_file():
        layers = _mixgemm_layers([path], act)
    elif path.is_dir():
        config = path / "config.json"
        raw = _read_json(config) if config.is_file() else {}
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise UserError(f"{path} holds no *.safetensors file")
        silu = str(raw.get("hidden_act", "silu")) in ("silu", "swish")
        if "quantization_config" in raw:
            try:
                qconfig = parse_quantization_config(raw["quantization_config"], str(config))
            except CheckpointError as e:
                raise UserError(str(e)) from None
            act = ActType.from_torch(resolve_dtype(dtype, raw))
            qkv = fuse_projections and str(raw.get("model_type", "")) in LLAMA_STYLE_MODEL_TYPES
            if qconfig.method is Format.MIXGEMM:
                layers = _mixgemm_layers(shards, act)
            else:
                layers = _hf_layers(shards, qconfig, act)
        else:
            layers = _mixgemm_layers(shards, act)
    else:
        raise UserError(f"{path}: no such file or directory")
    if not layers:
        raise UserError(f"{path}: no quantized weight found")
    stacked = {name: layer for name, layer in layers.items() if layer.experts is not None}
    layers = {name: layer for name, layer in layers.items() if layer.experts is None}
    dense = _fuse(layers, fuse_gate_up and silu, qkv)
    return dense + _experts_uses(stacked, path)


#: transformers' model types whose RMSNorm modules are LLaMA's (mixgemm.ops.norm.LLAMA_STYLE_NORMS):
#: what mixgemm.hf.from_pretrained(fuse_norms=True) replaces
LLAMA_STYLE_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def norm_specs(path: Union[str, os.PathLike], dtype: Optional[str] = None) -> list:
    """The RMSNorm kernel :func:`mixgemm.hf.from_pretrained` (``fuse_norms=True``) makes a Hugging
    Face model directory's norms launch (:class:`mixgemm.nn.RMSNorm`), from its ``config.json``:
    one :class:`~mixgemm.jit.specs.NormSpec` of the activation dtype for a LLaMA-style model type
    (:data:`LLAMA_STYLE_MODEL_TYPES`) with a ``quantization_config``; none otherwise (a mixgemm
    file, another architecture)."""
    path = Path(path)
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        return []
    raw = _read_json(config)
    if "quantization_config" not in raw or str(raw.get("model_type", "")) not in LLAMA_STYLE_MODEL_TYPES:
        return []

    return [norm_spec(resolve_dtype(dtype, raw), False)]


def kernel_specs(path: Union[str, os.PathLike], dtype: Optional[str] = None, fuse_gate_up: Optional[bool] = None,
                 fuse_norms: bool = True, max_tokens: Optional[int] = None, fuse_projections: bool = True) -> list:
    """Every kernel the model of ``path`` launches once loaded (``mixgemm generate --for``): its
    GEMMs' (:func:`mixgemm.aot.prebuild.specs_for` of :func:`weight_uses`, up to ``max_tokens`` tokens
    per call) and, with ``fuse_norms``, its RMSNorm kernel (:func:`norm_specs`); sorted by name.
    ``dtype``, ``fuse_gate_up`` and ``fuse_projections`` as for :func:`weight_uses`."""
    specs = specs_for(weight_uses(path, dtype=dtype, fuse_gate_up=fuse_gate_up, fuse_projections=fuse_projections),
                      max_tokens=max_tokens)
    if fuse_norms:
        specs += norm_specs(path, dtype=dtype)
    return sorted(specs, key=lambda s: s.name)


def _experts_uses(stacked: Dict[str, _Layer], path) -> list:
    """One :class:`~mixgemm.dispatch.uses.ExpertsUse` per MoE layer: its stacked ``<prefix>.w13``
    (gate/up interleaved, ``[2I, H]``) and ``<prefix>.w2`` (``[H, I]``), as ``mixgemm prepack``
    writes them and :func:`mixgemm.moe.fused_moe` takes them."""
    out = []
    for name in sorted(stacked):
        prefix, _, part = name.rpartition(".")
        if part == "w2" and f"{prefix}.w13" in stacked:
            continue
        w13, w2 = stacked.get(f"{prefix}.w13"), stacked.get(f"{prefix}.w2")
        if part != "w13" or w2 is None:
            raise UserError(f"{path}: stacked experts {name!r} have no partner: a MoE layer's experts are "
                            f"'<prefix>.w13' (gate/up) and '<prefix>.w2' (down), as mixgemm prepack writes them")
        if (w13.experts, w13.wt, w13.act, w13.k, w13.n) != (w2.experts, w2.wt, w2.act, w2.n, 2 * w2.k):
            raise UserError(f"{path}: {prefix}.w13 ({w13.experts} x [{w13.n}, {w13.k}], {w13.wt.value}) and "
                            f"{prefix}.w2 ({w2.experts} x [{w2.n}, {w2.k}], {w2.wt.value}) do not make one MoE "
                            f"layer (want E x [2I, H] and E x [H, I] of one type)")
        out.append(ExpertsUse(w13.experts, w13.k, w2.k, w13.wt, w13.act, prefix))
    return out


def _read_json(config: Path) -> dict:
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{config}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{config}: must hold a JSON object")
    return data


def _fuse(layers: Dict[str, _Layer], gate_up: bool = True, qkv: bool = False) -> list[WeightUse]:
    out = []
    done = set()
    for name in sorted(layers):
        if name in done:
            continue
        m = _QKV.match(name) if qkv else None
        if m:
            prefix = m["prefix"]
            parts = [layers.get(f"{prefix}.{p}") for p in ("q_proj", "k_proj", "v_proj")]
            if all(p is not None for p in parts) and all(parts[0].stackable_with(p) for p in parts[1:]):
                fused = _Layer(f"{prefix}.qkv_proj", sum(p.n for p in parts), parts[0].k, parts[0].wt, parts[0].act,
                               parts[0].group_size, parts[0].zero_offsets)
                out.append(fused.use())
                done.update(p.name for p in parts)
                continue
        m = _GATE_UP.match(name) if gate_up else None
        if m:
            prefix = m["prefix"]
            gate, up = layers.get(f"{prefix}.gate_proj"), layers.get(f"{prefix}.up_proj")
            if gate is not None and up is not None and f"{prefix}.down_proj" in layers and gate.fusable_with(up):
                fused = _Layer(f"{prefix}.gate_up", 2 * gate.n, gate.k, gate.wt, gate.act, gate.group_size,
                               gate.zero_offsets)
                out.append(fused.use(Activation.SWIGLU))
                done.update((gate.name, up.name))
                continue
        out.append(layers[name].use())
        done.add(name)
    return out


def _kept(layers: Dict[str, _Layer], layer: _Layer) -> None:
    """Add ``layer`` unless the kernels cannot take it (then warn: the loader keeps it in full
    precision)."""
    try:
        layer.use()
    except ValueError as e:
        warnings.warn(f"mixgemm: {layer.name} needs no kernel (kept in full precision: {e})", stacklevel=4)
        return
    layers[layer.name] = layer


# ---------------------------------------------------------------------------------------------
# Headers
# ---------------------------------------------------------------------------------------------
def _headers(path: Path) -> tuple[dict, dict]:
    """(header metadata, {tensor name: (shape, safetensors dtype)}) without reading tensor data."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
            tensors = {}
            for key in f.keys():
                sl = f.get_slice(key)
                tensors[key] = (tuple(sl.get_shape()), sl.get_dtype())
    except Exception as e:   # safetensors raises its own error types for corrupt files
        raise UserError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    return meta, tensors


def _strip(name: str, suffix: str) -> str:
    return name[:-len(suffix) - 1] if name.endswith("." + suffix) else name


def _mixgemm_layers(files: list, act: Optional[ActType]) -> Dict[str, _Layer]:

    layers: Dict[str, _Layer] = {}
    for f in files:
        meta, tensors = _headers(f)
        try:
            specs = mio.check_metadata(meta, f)
        except mio.MixgemmFormatError as e:
            raise UserError(str(e)) from None
        if not specs:
            raise UserError(f"{f} is not a mixgemm file (no packed weight in its header) and has no config.json "
                            f"with a quantization_config beside it: prepack it first, or pass the model directory")
        for name, spec in specs.items():
            layer = _strip(name, "weight")
            perm = None
            if f"{layer}.perm" in tensors:
                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    perm = sf.get_tensor(f"{layer}.perm").numpy().tobytes()
            _kept(layers, _Layer(layer, spec["n"], spec["k"], spec["weight_type"],
                                 act or ActType.from_torch(spec["dtype"]), spec["group_size"],
                                 zero_offsets=f"{name}.zero_offsets" in tensors, perm=perm,
                                 bias=f"{layer}.bias" in tensors, experts=spec.get("experts")))
    return layers


def _hf_layers(files: list, qconfig, act: ActType) -> Dict[str, _Layer]:
    tensors: dict = {}
    where: dict = {}
    for f in files:
        found = _headers(f)[1]
        tensors.update(found)
        where.update(dict.fromkeys(found, f))
    method = qconfig.method
    layers: Dict[str, _Layer] = {}
    for key in sorted(tensors):
        prefix, _, last = key.rpartition(".")
        if last != method.primary and not (last == "weight" and stores_int_codes(
                qconfig, prefix, has=lambda suffix: f"{prefix}.{suffix}" in tensors)):
            continue
        scheme = qconfig.scheme_for(prefix)
        if not scheme.quantized:
            raise UserError(f"layer {prefix!r} holds quantized tensors, but the quantization_config says it is "
                            f"not quantized")
        try:
            found = HANDLERS[method].header_layer(prefix, tensors, qconfig, scheme)
        except SkipLayer as e:
            warnings.warn(f"mixgemm: {prefix} needs no kernel (kept in full precision: {e})", stacklevel=3)
            continue
        layer = _Layer(prefix, found.n, found.k, found.weight_type, act, found.group_size)
        g_idx = f"{prefix}.{method.spec.g_idx}"
        if g_idx in tensors:
            layer.perm = _perm_of(where[g_idx], g_idx, layer.k, layer.group_size)
        layer.bias = f"{prefix}.bias" in tensors
        _kept(layers, layer)
    return layers


def _perm_of(path: Path, key: str, k: int, group_size: Optional[int]) -> Optional[bytes]:
    """The identity of the act-order permutation a group index gives (the index itself), or None
    when its groups are runs of ``group_size`` consecutive columns (then the import permutes
    nothing). ``-1`` entries are compressed-tensors' "no act-order" placeholder."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        g_idx = f.get_tensor(key).flatten()
    if g_idx.numel() != k:
        raise UserError(f"{key}: {g_idx.numel()} entries for K={k}")
    if bool((g_idx == -1).any()) or not group_size or group_size < 0 or k % group_size:
        return None
    runs = g_idx.view(-1, group_size)
    if bool((runs == runs[:, :1]).all()):
        return None
    return g_idx.to(torch.int64).numpy().tobytes()
