"""The variants of ``mixgemm bench --model``: how one decoder layer's four linears are computed.

* ``bf16``: ``F.linear`` on the dense weights (cuBLAS), gate/up as one GEMM then
  ``silu(gate) * up`` in torch: the baseline.
* ``mixgemm-<wt>``: :class:`mixgemm.nn.QuantLinear` layers; gate and up fused with the swiglu
  epilogue (:meth:`QuantLinear.from_gate_up`: one launch), qkv with its bias for Qwen2. The
  ``--variants`` aliases ``int4``, ``int2`` and ``int8`` name u4, u2 (asymmetric) and s8
  (symmetric).
* ``mixgemm-<wt>-fp8`` (``int4-fp8``, ``int2-fp8``, ``<wt>-fp8``): the same layers with e4m3
  activations (:meth:`QuantLinear.set_act_format`, ``"fp8"``): each linear quantizes its input per
  token and runs the e4m3 GEMM (gate/up with the gated epilogue); u4, s4, u2 and s2 only.
* ``mixgemm-<wt>-auto`` (``<wt>-auto``): the layers with ``act_format="auto"``, each call on the
  e4m3 path where the GPU's tuning table measured it faster for its shape and token count, else
  exact (:func:`mixgemm.ops.fp8.resolve_act_format`). ``mixgemm bench --generate`` runs them;
  ``--model`` (:func:`parse_variants`) times the two formats apart and refuses them.
* ``torch-int4``: PyTorch's tinygemm (``aten._weight_int4pack_mm``), asymmetric int4 on
  mixgemm's round-to-nearest codes (:func:`.peer_formats.torch_int4_pack`); gate/up as one GEMM then
  ``silu * up`` in torch, the qkv bias added in torch.
* ``scaled-mm`` (or ``scaled_mm``): the W8A8-FP8 GEMM, ``torch._scaled_mm`` e4m3 x e4m3 with
  per-row scales on both: each weight quantized once (:func:`.peer_formats.scaled_mm_weight`), each
  linear's input quantized per token (:func:`mixgemm.ops.quantize_fp8`, one launch on an sm_90 GPU),
  bf16 out; gate/up as one GEMM then ``silu * up`` in torch, the qkv bias added in torch.
* ``no-gemm``: no linear at all: each projection returns a broadcast view of its input's first
  column with the projection's output width (:class:`NoGemmProjections`: no GEMM, no weights,
  no bias, nothing ``torch.compile`` can fold). The step then times the layer's other kernels
  (norms, rotary, KV cache writes, attention, residual adds), which every variant pays alike:
  the base of the report's ``bound`` (:func:`.model.analyze_model`). Its output means nothing,
  so it is not checked against a reference.

Each quantized variant also gives its own dequantized weights as :class:`.decoder.DenseProjections`
(mixgemm: :func:`mixgemm.dequantize_reference`; torch-int4: tinygemm's formula,
:func:`.peer_formats.torch_int4_dequant`; scaled-mm: its e4m3 codes times their row scales, rounded
to bf16): the bf16 step on those is the reference its step is checked against, so that the
difference is the kernels' alone, and for the e4m3 variants (:attr:`Variant.e4m3`) the rounding of
the activations to e4m3 too (:data:`.model.DEFAULT_MODEL_FP8_MAX_ERROR` says how much that is).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..dispatch.heuristic import configs_any_gpu
from ..dtypes import ActType, WeightType
from ..jit.catalog import layer_specs
from ..jit.specs import Activation, Fp8GemmSpec
from ..nn.linear import QuantLinear
from ..ops.fp8 import ACT_FORMATS, fp8_gemm_specs, fp8_problem, k_permutation, quant_spec, quantize_fp8
from ..weights import quantize
from ..weights.quantize import deinterleave_rows, dequantize_reference
from ..weights.types import QuantizedWeight
from .decoder import DenseProjections, ModelPreset, Projections, dense_projections, float_weight, qkv_bias
from .peer_formats import (TORCH_INT4_GROUP_SIZES, ImplUnavailable, e4m3_rows, scaled_mm, scaled_mm_weight,
                           torch_int4_dequant, torch_int4_mm, torch_int4_pack)

#: Bytes per activation / norm / bias element (bf16).
ELEMENT_BYTES = 2
#: Bytes of a float32 scale: scaled-mm's per weight row, the e4m3 quantizer's per token.
SCALE_BYTES = 4
#: The suffix of the e4m3-activation mixgemm variants (``mixgemm-u4-fp8``, ``int4-fp8``).
FP8_SUFFIX = "-fp8"
#: The suffix of the mixgemm variants whose layers choose the activation format per call
#: (``act_format="auto"``: ``mixgemm-u4-auto``, ``int4-auto``).
AUTO_SUFFIX = "-auto"
#: The name suffix of each ``act_format`` a mixgemm variant takes (``"bf16"``: none).
ACT_FORMAT_SUFFIXES = (("bf16", ""), ("fp8", FP8_SUFFIX), ("auto", AUTO_SUFFIX))
#: The weight types the e4m3 GEMM takes (4- and 2-bit codes: exact in e4m3 once the integer zero
#: point is subtracted); the others have no e4m3 path.
E4M3_WEIGHT_TYPES = tuple(WeightType(w) for w in Fp8GemmSpec.WEIGHTS)


class VariantKind(enum.Enum):
    DENSE = "bf16"
    MIXGEMM = "mixgemm"
    TORCH_INT4 = "torch-int4"
    SCALED_MM = "scaled-mm"
    NO_GEMM = "no-gemm"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of computing the linears; ``weight_type`` for mixgemm only; ``act_format``
    (``"bf16"``: exact activations, ``"fp8"``: e4m3 per token, or ``"auto"``: per call, the one the
    GPU's tuning table measured faster) for mixgemm only (scaled-mm's activations are e4m3 by
    definition)."""

    kind: VariantKind
    weight_type: Optional[WeightType] = None
    act_format: str = "bf16"

    def __post_init__(self) -> None:
        if (self.kind is VariantKind.MIXGEMM) != (self.weight_type is not None):
            raise ValueError("a mixgemm variant has a weight type, the others have none")
        if self.act_format not in ACT_FORMATS:
            raise ValueError(f"act_format must be one of {ACT_FORMATS}, got {self.act_format!r}")
        if self.act_format != "bf16" and self.kind is not VariantKind.MIXGEMM:
            raise ValueError(f"only a mixgemm variant takes act_format={self.act_format!r}")

    @property
    def name(self) -> str:
        """``bf16``, ``torch-int4``, ``scaled-mm``, ``no-gemm``, ``mixgemm-<wt>``,
        ``mixgemm-<wt>-fp8`` or ``mixgemm-<wt>-auto``: the name in tables and JSON."""
        if self.kind is VariantKind.MIXGEMM:
            return f"mixgemm-{self.weight_type.value}" + dict(ACT_FORMAT_SUFFIXES)[self.act_format]
        return self.kind.value

    @property
    def quantized(self) -> bool:
        """Whether the variant computes the linears on quantized weights (and so is checked against
        the bf16 step on its own dequantized weights): mixgemm, torch-int4 and scaled-mm."""
        return self.kind in (VariantKind.MIXGEMM, VariantKind.TORCH_INT4, VariantKind.SCALED_MM)

    @property
    def e4m3(self) -> bool:
        """Whether the linears round their inputs to e4m3 (``mixgemm-<wt>-fp8``, ``scaled-mm``) or
        may, at the token counts the GPU's tuning table sends to the e4m3 path
        (``mixgemm-<wt>-auto``): a step is held to the e4m3 bar
        (:data:`.model.DEFAULT_MODEL_FP8_MAX_ERROR`)."""
        return self.act_format != "bf16" or self.kind is VariantKind.SCALED_MM

    @property
    def e4m3_problem(self) -> Optional[str]:
        """Why this variant's e4m3 activations have no kernel (an 8-bit mixgemm weight type with
        ``-fp8`` or ``-auto``), in one line; None for every other variant."""
        if self.act_format == "bf16" or self.weight_type in E4M3_WEIGHT_TYPES:
            return None
        wt = self.weight_type.value
        types = [w.value for w in E4M3_WEIGHT_TYPES]
        return (f"{wt} weights have no e4m3 kernel (the e4m3 GEMM takes {', '.join(types[:-1])} and {types[-1]} "
                f"codes): {wt} runs with exact activations only")


BF16 = Variant(VariantKind.DENSE)
TORCH_INT4 = Variant(VariantKind.TORCH_INT4)
SCALED_MM = Variant(VariantKind.SCALED_MM)
NO_GEMM = Variant(VariantKind.NO_GEMM)
#: ``--variants`` aliases: the bit widths, with their default weight types (``<alias>-fp8``: with
#: e4m3 activations, ``<alias>-auto``: with ``act_format="auto"``, :func:`parse_variant`).
ALIASES = {"bf16": BF16, "torch-int4": TORCH_INT4, "no-gemm": NO_GEMM, "scaled-mm": SCALED_MM, "scaled_mm": SCALED_MM,
           "int4": Variant(VariantKind.MIXGEMM, WeightType.U4),
           "int2": Variant(VariantKind.MIXGEMM, WeightType.U2), "int8": Variant(VariantKind.MIXGEMM, WeightType.S8)}
#: ``--model``'s default variants (no-gemm is cheap: a step without GEMMs, the report's bound).
DEFAULT_VARIANTS = ("bf16", "int4", "int2", "int8", "torch-int4", "no-gemm")


def parse_variant(text: str) -> Variant:
    """``bf16``, ``torch-int4``, ``scaled-mm`` (or ``scaled_mm``), ``no-gemm``, ``int4`` / ``int2`` /
    ``int8`` (u4, u2, s8) or ``mixgemm-<wt>`` / ``<wt>`` for any mixgemm weight type
    (``mixgemm-s4``, ``u8``, ...); any of the mixgemm names with ``-fp8`` appended for e4m3
    activations (``int4-fp8``, ``mixgemm-s2-fp8``, ``u2-fp8``) or ``-auto`` for ``act_format="auto"``
    (``u4-auto``, ``mixgemm-u2-auto``). An 8-bit type with either suffix parses
    (:attr:`Variant.e4m3_problem` says why it has no e4m3 kernel: ``--model`` reports its points
    n/a with the reason, ``--generate`` refuses it).

    Raises
    ------
    ValueError
        Not one of those.
    """
    key = text.strip().lower()
    if key in ALIASES:
        return ALIASES[key]
    act_format, base = "bf16", key
    for fmt, suffix in ACT_FORMAT_SUFFIXES:
        if suffix and key.endswith(suffix):
            act_format, base = fmt, key[:-len(suffix)]
            break
    if base in ALIASES:
        variant = ALIASES[base]
    else:
        wt = base[len("mixgemm-"):] if base.startswith("mixgemm-") else base
        try:
            variant = Variant(VariantKind.MIXGEMM, WeightType(wt))
        except ValueError:
            variant = None
    if variant is None or (act_format != "bf16" and variant.kind is not VariantKind.MIXGEMM):
        raise ValueError(f"unknown variant {text.strip()!r}: expected bf16, torch-int4, scaled-mm, no-gemm, int4, "
                         f"int2, int8 or mixgemm-<type> with a type of {', '.join(w.value for w in WeightType)}, "
                         f"the mixgemm ones with -fp8 for e4m3 activations (int4-fp8, mixgemm-u2-fp8) or -auto "
                         f"for act_format='auto' (u4-auto)")
    return dataclasses.replace(variant, act_format=act_format)


def is_e4m3(name: str) -> bool:
    """Whether the variant named ``name`` rounds its activations to e4m3 (:attr:`Variant.e4m3`);
    False for a name that does not parse."""
    try:
        return parse_variant(name).e4m3
    except ValueError:
        return False


def parse_variants(texts: Sequence[str]) -> tuple[Variant, ...]:
    """``--variants``: the variants named (see :func:`parse_variant`), without repeats, ``bf16``
    first (always run: the baseline of every speedup and the check's reference). The ``-auto``
    variants are refused: a ``--model`` point times one token count, where ``act_format="auto"``
    runs one of ``mixgemm-<wt>`` and ``mixgemm-<wt>-fp8``, which it times apart.

    Raises
    ------
    ValueError
        An unknown name, or a ``-auto`` one.
    """
    out = [BF16]
    for text in texts:
        v = parse_variant(text)
        if v.act_format == "auto":
            wt = v.weight_type.value
            raise ValueError(f"{text.strip()!r}: act_format='auto' is a --generate type (--types {wt}-auto); "
                             f"--variants times its two paths apart: mixgemm-{wt},mixgemm-{wt}-fp8")
        if v not in out:
            out.append(v)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Bytes (formulas; the run reports the bytes of the tensors it holds, which the tests compare)
# ---------------------------------------------------------------------------------------------
def projection_weight_bytes(n: int, k: int, variant: Variant, group_size: int) -> int:
    """Bytes of one ``[N, K]`` linear's weight as ``variant`` stores it (no bias):

    * bf16: ``2 N K``;
    * mixgemm (exact or e4m3 activations: the same packed weight): ``N K b / 8`` codes + 16-bit
      scales ``[K/g, N]`` (+ as many zeros when asymmetric), :attr:`mixgemm.PackedWeight.nbytes`;
    * torch-int4: ``N K / 2`` packed codes + ``[K/g, N, 2]`` 16-bit scales and zeros;
    * scaled-mm: one e4m3 byte per weight, ``N K``, + a float32 scale per row, ``4 N``;
    * no-gemm: none.
    """
    groups = k // group_size
    if variant.kind is VariantKind.NO_GEMM:
        return 0
    if variant.kind is VariantKind.DENSE:
        return ELEMENT_BYTES * n * k
    if variant.kind is VariantKind.TORCH_INT4:
        return n * k // 2 + 2 * groups * n * ELEMENT_BYTES
    if variant.kind is VariantKind.SCALED_MM:
        return n * k + SCALE_BYTES * n
    wt = variant.weight_type
    return n * k * wt.bits // 8 + groups * n * ELEMENT_BYTES * (2 if wt.has_zero else 1)


def layer_weight_bytes(preset: ModelPreset, variant: Variant, group_size: int) -> int:
    """Every weight byte one layer of ``variant`` reads: the four linears (qkv, o, gate/up,
    down), the qkv bias (Qwen2) and the two RMSNorm weights. no-gemm reads the norms only (no
    linear, no bias)."""
    linears = sum(projection_weight_bytes(n, k, variant, group_size) for n, k in preset.projection_shapes().values())
    bias = ELEMENT_BYTES * preset.qkv_rows if preset.qkv_bias and variant.kind is not VariantKind.NO_GEMM else 0
    return linears + bias + 2 * ELEMENT_BYTES * preset.hidden


# ---------------------------------------------------------------------------------------------
# The projections of each variant
# ---------------------------------------------------------------------------------------------
def _linear(w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> nn.Linear:
    """An ``nn.Linear`` holding ``w`` (and ``bias``) without copying or initializing anything."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


class MixgemmProjections(Projections):
    """:class:`mixgemm.nn.QuantLinear` layers (``gate_up``: the swiglu layer of
    :meth:`QuantLinear.from_gate_up`)."""

    def __init__(self, qkv: nn.Module, o: nn.Module, gate_up: nn.Module, down: nn.Module):
        if getattr(gate_up, "activation", None) != "swiglu":
            raise ValueError("gate_up must be a swiglu QuantLinear (QuantLinear.from_gate_up)")
        self.layers = {"qkv": qkv, "o": o, "gate_up": gate_up, "down": down}

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["qkv"](x)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["o"](x)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["gate_up"](x)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["down"](x)

    def weight_tensors(self) -> list[torch.Tensor]:
        out = []
        for layer in self.layers.values():
            out += [t for t in (layer.qdata, layer.scales, layer.zeros, layer.zero_offsets, layer.bias)
                    if t is not None]
        return out

    def packed(self) -> dict:
        """``{name: PackedWeight}`` of the four layers (for the kernel list)."""
        return {name: layer.packed for name, layer in self.layers.items()}


class TorchInt4Projections(Projections):
    """tinygemm linears: ``packs[name] = (packed, scale_and_zeros)`` from :func:`.peer_formats.torch_int4_pack`;
    ``gate_up`` holds the gate's rows then the up projection's."""

    def __init__(self, packs: dict, intermediate: int, group_size: int, qkv_bias: Optional[torch.Tensor] = None):
        self.packs, self.intermediate, self.group_size, self.b_qkv = packs, intermediate, group_size, qkv_bias

    def _mm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        packed, sz = self.packs[name]
        return torch_int4_mm(x, packed, self.group_size, sz)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm("qkv", x)
        return y if self.b_qkv is None else y + self.b_qkv

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm("o", x)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        h = self._mm("gate_up", x)
        return F.silu(h[..., :self.intermediate]) * h[..., self.intermediate:]

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm("down", x)

    def weight_tensors(self) -> list[torch.Tensor]:
        out = [t for pair in self.packs.values() for t in pair]
        return out + ([self.b_qkv] if self.b_qkv is not None else [])


class ScaledMmProjections(Projections):
    """``torch._scaled_mm`` linears (:func:`.peer_formats.scaled_mm`): ``weights[name] = (codes,
    scales)`` from :func:`.peer_formats.scaled_mm_weight` (the e4m3 codes ``[N, K]`` in the
    quantizer's column order, float32 ``[N]``); each call quantizes its input per token
    (:func:`mixgemm.ops.quantize_fp8`), then one ``_scaled_mm`` with a bf16 output. ``gate_up``
    holds the gate's rows then the up projection's.

    Under torch.compile the quantizer is its definition in torch ops (:func:`.peer_formats.e4m3_rows`,
    then the columns in the quantizer's order, :func:`mixgemm.ops.quantize_fp8_reference`'s result
    bit for bit), which inductor fuses; the order is a table made here, once per input width."""

    def __init__(self, weights: dict, intermediate: int, qkv_bias: Optional[torch.Tensor] = None):
        self.weights, self.intermediate, self.b_qkv = weights, intermediate, qkv_bias
        self.orders = {}
        for codes, _ in weights.values():
            if codes.shape[1] not in self.orders:
                self.orders[codes.shape[1]] = k_permutation(codes.shape[1], codes.device)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [M, K]`` as e4m3 codes in the quantizer's column order and float32 scales ``[M]``."""
        if torch.compiler.is_compiling():
            codes, scales = e4m3_rows(x)
            return codes.index_select(1, self.orders[x.shape[1]]), scales
        return quantize_fp8(x)

    def _mm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        codes, scales = self.weights[name]
        xq, xs = self.quantize(x)
        return scaled_mm(xq, xs, codes, scales, x.dtype)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm("qkv", x)
        return y if self.b_qkv is None else y + self.b_qkv

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm("o", x)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        h = self._mm("gate_up", x)
        return F.silu(h[..., :self.intermediate]) * h[..., self.intermediate:]

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm("down", x)

    def weight_tensors(self) -> list[torch.Tensor]:
        out = [t for pair in self.weights.values() for t in pair]
        return out + ([self.b_qkv] if self.b_qkv is not None else [])


class NoGemmProjections(Projections):
    """No linear: each projection returns ``x[:, :1].expand(M, N_out)``, a broadcast view of its
    input ``[M, K]``'s first column with the projection's output width (qkv: ``q + 2 kv``, o and
    down: ``hidden``, mlp_in: ``intermediate``). No kernel runs, no weight is read, and the
    layer's other kernels still see data that depends on the input (so ``torch.compile`` cannot
    fold them into constants, as it folds projections that return preallocated tensors)."""

    def __init__(self, preset: ModelPreset):
        self.widths = {"qkv": preset.qkv_rows, "o": preset.hidden, "mlp_in": preset.intermediate,
                       "down": preset.hidden}

    def _view(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x[:, :1].expand(x.shape[0], self.widths[name])

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self._view(x, "qkv")

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._view(x, "o")

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return self._view(x, "mlp_in")

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return self._view(x, "down")

    def weight_tensors(self) -> list[torch.Tensor]:
        return []


def _floats(preset: ModelPreset, layer: int, seed: int, device: torch.device, *names: str) -> torch.Tensor:
    return torch.cat([float_weight(preset, n, layer, seed, device) for n in names])


def mixgemm_layer(preset: ModelPreset, layer: int, seed: int, device: torch.device, weight_type: WeightType,
                  group_size: int, dtype: torch.dtype = torch.bfloat16,
                  act_format: str = "bf16") -> tuple[MixgemmProjections, DenseProjections]:
    """``layer``'s mixgemm projections (quantized with :func:`mixgemm.quantize`, on ``device``;
    with ``act_format="fp8"`` each layer then takes e4m3 activations) and the dense projections of
    their dequantized weights (the reference).

    Raises
    ------
    ImplUnavailable
        ``act_format="fp8"`` for a weight the e4m3 kernels do not take; ``act_format="auto"``
        (a ``--generate`` variant, :func:`parse_variants`).
    """
    if act_format == "auto":
        raise ImplUnavailable("act_format='auto' is a --generate variant: --model times mixgemm-<wt> and "
                              "mixgemm-<wt>-fp8 apart")

    bits, sym = weight_type.bits, weight_type.signed
    bias = qkv_bias(preset, layer, seed, device, dtype)
    layers = {}
    for name, parts in (("qkv", ("q", "k", "v")), ("o", ("o",)), ("down", ("down",))):
        w = _floats(preset, layer, seed, device, *parts)
        layers[name] = QuantLinear.from_linear(_linear(w, bias if name == "qkv" else None), bits=bits,
                                               group_size=group_size, symmetric=sym, dtype=dtype)
        del w
    gate, up = (_linear(float_weight(preset, n, layer, seed, device)) for n in ("gate", "up"))
    layers["gate_up"] = QuantLinear.from_gate_up(gate, up, bits=bits, group_size=group_size, symmetric=sym,
                                                 dtype=dtype)
    del gate, up
    if act_format == "fp8":
        for q in layers.values():
            why = fp8_problem(q.packed)
            if why:
                raise ImplUnavailable(why)
            q.set_act_format(act_format)
    deq_gate, deq_up = deinterleave_rows(dequantize_reference(layers["gate_up"].packed))
    reference = DenseProjections(dequantize_reference(layers["qkv"].packed), dequantize_reference(layers["o"].packed),
                                 torch.cat((deq_gate, deq_up)), dequantize_reference(layers["down"].packed),
                                 layers["qkv"].bias.detach() if bias is not None else None)
    return MixgemmProjections(layers["qkv"], layers["o"], layers["gate_up"], layers["down"]), reference


def torch_int4_layer(preset: ModelPreset, layer: int, seed: int, device: torch.device, group_size: int,
                     dtype: torch.dtype = torch.bfloat16) -> tuple[TorchInt4Projections, DenseProjections]:
    """``layer``'s tinygemm projections (asymmetric int4, mixgemm's round-to-nearest codes) and
    the dense projections of tinygemm's own dequantized weights (the reference)."""

    if dtype != torch.bfloat16:
        raise ImplUnavailable("_weight_int4pack_mm takes bf16 activations only")
    if group_size not in TORCH_INT4_GROUP_SIZES:
        raise ImplUnavailable(f"tinygemm supports group sizes {TORCH_INT4_GROUP_SIZES}, not {group_size}")
    packs, deq = {}, {}
    for name, parts in (("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",))):
        # each projection quantized alone (gate and up too), then stacked: the codes mixgemm has
        qs = [quantize.quantize(float_weight(preset, p, layer, seed, device), 4, group_size, symmetric=False, dtype=dtype)
              for p in parts]
        qw = qs[0] if len(qs) == 1 else QuantizedWeight(
            torch.cat([q.qweight for q in qs]), torch.cat([q.scales for q in qs]), torch.cat([q.zeros for q in qs]),
            4, group_size, False)
        del qs
        packs[name] = torch_int4_pack(qw)
        deq[name] = torch_int4_dequant(qw.qweight, packs[name][1], group_size)
        del qw
    bias = qkv_bias(preset, layer, seed, device, dtype)
    reference = DenseProjections(deq["qkv"], deq["o"], deq["gate_up"], deq["down"], bias)
    return TorchInt4Projections(packs, preset.intermediate, group_size, bias), reference


def scaled_mm_layer(preset: ModelPreset, layer: int, seed: int, device: torch.device,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[ScaledMmProjections, DenseProjections]:
    """``layer``'s scaled-mm projections (each weight rounded to ``dtype``, as a checkpoint holds it,
    then to e4m3 with a float32 scale per row, :func:`.peer_formats.scaled_mm_weight`) and the
    dense projections of their own weights, the codes times their scales rounded to ``dtype`` (the
    reference)."""

    if dtype != torch.bfloat16:
        raise ImplUnavailable("the W8A8-FP8 GEMM runs with bf16 activations and output")
    weights, deq = {}, {}
    for name, parts in (("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",))):
        codes, gemm_codes, scales = scaled_mm_weight(_floats(preset, layer, seed, device, *parts).to(dtype))
        weights[name] = (gemm_codes, scales)
        deq[name] = (codes.float() * scales.unsqueeze(1)).to(dtype)
        del codes
    bias = qkv_bias(preset, layer, seed, device, dtype)
    reference = DenseProjections(deq["qkv"], deq["o"], deq["gate_up"], deq["down"], bias)
    return ScaledMmProjections(weights, preset.intermediate, bias), reference


def build_layer(preset: ModelPreset, variant: Variant, layer: int, seed: int, device: torch.device,
                group_size: int) -> tuple[Projections, Optional[DenseProjections]]:
    """``layer``'s projections for ``variant`` and, for a quantized variant, the reference
    (its dequantized weights, dense); None for bf16 and no-gemm."""
    if variant.kind is VariantKind.NO_GEMM:
        return NoGemmProjections(preset), None
    if variant.kind is VariantKind.DENSE:
        return dense_projections(preset, layer, seed, device), None
    if variant.kind is VariantKind.MIXGEMM:
        return mixgemm_layer(preset, layer, seed, device, variant.weight_type, group_size,
                             act_format=variant.act_format)
    if variant.kind is VariantKind.SCALED_MM:
        return scaled_mm_layer(preset, layer, seed, device)
    return torch_int4_layer(preset, layer, seed, device, group_size)


def kernel_specs(preset: ModelPreset, variant: Variant, ms: Sequence[int], act: ActType = ActType.BF16) -> list:
    """The mixgemm kernels a ``variant`` step of ``m`` tokens launches, for every ``m`` in ``ms``
    (the heuristic's choices on any GPU, :func:`mixgemm.dispatch.heuristic.configs_any_gpu`, per linear;
    the gate/up linear with the swiglu epilogue), and the RMSNorm and rotary / KV-cache kernels of the layer (every
    variant's layer launches them on an sm_90 GPU; built with the mixgemm variants'). With e4m3
    activations: the activation quantizer and the e4m3 GEMM (every token tile; gate/up with the
    gated epilogue); scaled-mm: the quantizer (mixgemm's kernel on an sm_90 GPU) and the layer's
    kernels. Empty for the other variants."""

    if variant.kind is VariantKind.SCALED_MM:
        return [quant_spec(act.torch_dtype), *layer_specs([act])]
    if variant.kind is not VariantKind.MIXGEMM:
        return []
    if variant.act_format == "fp8":
        specs = {quant_spec(act.torch_dtype).name: quant_spec(act.torch_dtype)}
        for activation in (None, "swiglu"):
            specs.update((spec.name, spec) for spec in fp8_gemm_specs(act, variant.weight_type, activation))
        specs.update((s.name, s) for s in layer_specs([act]))
        return list(specs.values())
    specs = {}
    for name, (n, k) in preset.projection_shapes().items():
        activation = Activation.SWIGLU if name == "gate_up" else Activation.NONE
        for m in ms:
            specs.update((spec.name, spec) for spec in (tc.spec(act, variant.weight_type, activation)
                                                        for tc in configs_any_gpu(m, n, k)))
    specs.update((s.name, s) for s in layer_specs([act]))
    return list(specs.values())


__all__ = ["ELEMENT_BYTES", "SCALE_BYTES", "FP8_SUFFIX", "AUTO_SUFFIX", "ACT_FORMAT_SUFFIXES", "E4M3_WEIGHT_TYPES",
           "VariantKind", "Variant", "BF16", "TORCH_INT4", "SCALED_MM",
           "NO_GEMM", "ALIASES", "DEFAULT_VARIANTS", "parse_variant", "parse_variants", "is_e4m3",
           "projection_weight_bytes", "layer_weight_bytes", "MixgemmProjections", "TorchInt4Projections",
           "ScaledMmProjections", "NoGemmProjections", "mixgemm_layer", "torch_int4_layer", "scaled_mm_layer",
           "build_layer", "kernel_specs"]
