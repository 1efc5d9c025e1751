"""The variants of ``mixgemm bench --model``: how one decoder layer's four linears are computed.

* ``bf16``: ``F.linear`` on the dense weights (cuBLAS), gate/up as one GEMM then
  ``silu(gate) * up`` in torch: the baseline.
* ``mixgemm-<wt>``: :class:`mixgemm.nn.QuantLinear` layers; gate and up fused with the swiglu
  epilogue (:meth:`QuantLinear.from_gate_up`: one launch), qkv with its bias for Qwen2. The
  ``--variants`` aliases ``int4``, ``int2`` and ``int8`` name u4, u2 (asymmetric) and s8
  (symmetric).
* ``torch-int4``: PyTorch's tinygemm (``aten._weight_int4pack_mm``), asymmetric int4 on
  mixgemm's round-to-nearest codes (:func:`.peer_formats.torch_int4_pack`); gate/up as one GEMM then
  ``silu * up`` in torch, the qkv bias added in torch.
* ``no-gemm``: no linear at all: each projection returns a broadcast view of its input's first
  column with the projection's output width (:class:`NoGemmProjections`: no GEMM, no weights,
  no bias, nothing ``torch.compile`` can fold). The step then times the layer's other kernels
  (norms, rotary, KV cache writes, attention, residual adds), which every variant pays alike:
  the base of the report's ``bound`` (:func:`.model.analyze_model`). Its output means nothing,
  so it is not checked against a reference.

Each quantized variant also gives its own dequantized weights as :class:`.decoder.DenseProjections`
(mixgemm: :func:`mixgemm.dequantize_reference`; torch-int4: tinygemm's formula,
:func:`.peer_formats.torch_int4_dequant`): the bf16 step on those is the reference its step is checked
against, so that the difference is the kernels' alone.
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
from ..jit.specs import Activation
from ..nn.linear import QuantLinear
from ..weights import quantize
from ..weights.quantize import deinterleave_rows, dequantize_reference
from ..weights.types import QuantizedWeight
from .decoder import DenseProjections, ModelPreset, Projections, dense_projections, float_weight, qkv_bias
from .peer_formats import TORCH_INT4_GROUP_SIZES, ImplUnavailable, torch_int4_dequant, torch_int4_mm, torch_int4_pack

#: Bytes per activation / norm / bias element (bf16).
ELEMENT_BYTES = 2


class VariantKind(enum.Enum):
    DENSE = "bf16"
    MIXGEMM = "mixgemm"
    TORCH_INT4 = "torch-int4"
    NO_GEMM = "no-gemm"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of computing the linears; ``weight_type`` for mixgemm only."""

    kind: VariantKind
    weight_type: Optional[WeightType] = None

    def __post_init__(self) -> None:
        if (self.kind is VariantKind.MIXGEMM) != (self.weight_type is not None):
            raise ValueError("a mixgemm variant has a weight type, the others have none")

    @property
    def name(self) -> str:
        """``bf16``, ``torch-int4`` or ``mixgemm-<wt>``: the name in tables and JSON."""
        if self.kind is VariantKind.MIXGEMM:
            return f"mixgemm-{self.weight_type.value}"
        return self.kind.value

    @property
    def quantized(self) -> bool:
        """Whether the variant computes the linears on quantized weights (and so is checked against
        the bf16 step on its own dequantized weights): mixgemm and torch-int4."""
        return self.kind in (VariantKind.MIXGEMM, VariantKind.TORCH_INT4)


BF16 = Variant(VariantKind.DENSE)
TORCH_INT4 = Variant(VariantKind.TORCH_INT4)
NO_GEMM = Variant(VariantKind.NO_GEMM)
#: ``--variants`` aliases: the bit widths, with their default weight types.
ALIASES = {"bf16": BF16, "torch-int4": TORCH_INT4, "no-gemm": NO_GEMM,
           "int4": Variant(VariantKind.MIXGEMM, WeightType.U4),
           "int2": Variant(VariantKind.MIXGEMM, WeightType.U2), "int8": Variant(VariantKind.MIXGEMM, WeightType.S8)}
#: ``--model``'s default variants (no-gemm is cheap: a step without GEMMs, the report's bound).
DEFAULT_VARIANTS = ("bf16", "int4", "int2", "int8", "torch-int4", "no-gemm")


def parse_variant(text: str) -> Variant:
    """``bf16``, ``torch-int4``, ``no-gemm``, ``int4`` / ``int2`` / ``int8`` (u4, u2, s8) or
    ``mixgemm-<wt>`` / ``<wt>`` for any mixgemm weight type (``mixgemm-s4``, ``u8``, ...).

    Raises
    ------
    ValueError
        Not one of those.
    """
    key = text.strip().lower()
    if key in ALIASES:
        return ALIASES[key]
    wt = key[len("mixgemm-"):] if key.startswith("mixgemm-") else key
    try:
        return Variant(VariantKind.MIXGEMM, WeightType(wt))
    except ValueError:
        raise ValueError(f"unknown variant {text.strip()!r}: expected bf16, torch-int4, no-gemm, int4, int2, "
                         f"int8 or mixgemm-<type> with a type of {', '.join(w.value for w in WeightType)}") from None


def parse_variants(texts: Sequence[str]) -> tuple[Variant, ...]:
    """The variants named (see :func:`parse_variant`), without repeats, ``bf16`` first (always
    run: the baseline of every speedup and the check's reference).

    Raises
    ------
    ValueError
        An unknown name.
    """
    out = [BF16]
    for text in texts:
        v = parse_variant(text)
        if v not in out:
            out.append(v)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Bytes (formulas; the run reports the bytes of the tensors it holds, which the tests compare)
# ---------------------------------------------------------------------------------------------
def projection_weight_bytes(n: int, k: int, variant: Variant, group_size: int) -> int:
    """Bytes of one ``[N, K]`` linear's weight as ``variant`` stores it (no bias):

    * bf16: ``2 N K``;
    * mixgemm: ``N K b / 8`` codes + 16-bit scales ``[K/g, N]`` (+ as many zeros when asymmetric),
      :attr:`mixgemm.PackedWeight.nbytes`;
    * torch-int4: ``N K / 2`` packed codes + ``[K/g, N, 2]`` 16-bit scales and zeros;
    * no-gemm: none.
    """
    groups = k // group_size
    if variant.kind is VariantKind.NO_GEMM:
        return 0
    if variant.kind is VariantKind.DENSE:
        return ELEMENT_BYTES * n * k
    if variant.kind is VariantKind.TORCH_INT4:
        return n * k // 2 + 2 * groups * n * ELEMENT_BYTES
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
                  group_size: int, dtype: torch.dtype = torch.bfloat16) -> tuple[MixgemmProjections, DenseProjections]:
    """``layer``'s mixgemm projections (quantized with :func:`mixgemm.quantize`, on ``device``)
    and the dense projections of their dequantized weights (the reference)."""

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


def build_layer(preset: ModelPreset, variant: Variant, layer: int, seed: int, device: torch.device,
                group_size: int) -> tuple[Projections, Optional[DenseProjections]]:
    """``layer``'s projections for ``variant`` and, for a quantized variant, the reference
    (its dequantized weights, dense); None for bf16 and no-gemm."""
    if variant.kind is VariantKind.NO_GEMM:
        return NoGemmProjections(preset), None
    if variant.kind is VariantKind.DENSE:
        return dense_projections(preset, layer, seed, device), None
    if variant.kind is VariantKind.MIXGEMM:
        return mixgemm_layer(preset, layer, seed, device, variant.weight_type, group_size)
    return torch_int4_layer(preset, layer, seed, device, group_size)


def kernel_specs(preset: ModelPreset, variant: Variant, ms: Sequence[int], act: ActType = ActType.BF16) -> list:
    """The mixgemm kernels a ``variant`` step of ``m`` tokens launches, for every ``m`` in ``ms``
    (the heuristic's choices on any GPU, :func:`mixgemm.dispatch.heuristic.configs_any_gpu`, per linear;
    the gate/up linear with the swiglu epilogue), and the RMSNorm and rotary / KV-cache kernels of the layer (every
    variant's layer launches them on an sm_90 GPU; built with the mixgemm variants'). Empty for the
    other variants."""

    if variant.kind is not VariantKind.MIXGEMM:
        return []
    specs = {}
    for name, (n, k) in preset.projection_shapes().items():
        activation = Activation.SWIGLU if name == "gate_up" else Activation.NONE
        for m in ms:
            specs.update((spec.name, spec) for spec in (tc.spec(act, variant.weight_type, activation)
                                                        for tc in configs_any_gpu(m, n, k)))
    specs.update((s.name, s) for s in layer_specs([act]))
    return list(specs.values())


__all__ = ["ELEMENT_BYTES", "VariantKind", "Variant", "BF16", "TORCH_INT4", "NO_GEMM", "ALIASES",
           "DEFAULT_VARIANTS", "parse_variant", "parse_variants", "projection_weight_bytes", "layer_weight_bytes", "MixgemmProjections",
           "TorchInt4Projections", "NoGemmProjections", "mixgemm_layer", "torch_int4_layer", "build_layer", "kernel_specs"]
