"""The implementations the grid times (``mixgemm bench``), each behind a small adapter
(:class:`Impl`): cuBLAS (the baseline), PyTorch's int4 kernel, gemlite, ``torch._scaled_mm``
(the W8A8-FP8 GEMM) and mixgemm, with exact or e4m3 activations (the conversions of mixgemm's
quantized weight to the peers' conventions are in :mod:`.peer_formats`).

The quantized implementations share one quantization per bit width (:class:`QuantCache`:
mixgemm's round-to-nearest, :func:`mixgemm.quantize`): torch_int4, gemlite-u4, mixgemm-u4 and
mixgemm-u4-fp8 multiply the same integer codes with the same scales, each converted to the
implementation's own zero-point convention, so their errors against the float weight are
comparable.

Two kinds of activations (:attr:`Impl.activations`): ``exact`` (x as given, bf16 or fp16:
cuBLAS, torch_int4, gemlite, ``mixgemm-<wt>``) and ``e4m3`` (x rounded to e4m3 with one scale per
token inside the timed call: ``mixgemm-<wt>-fp8``, ``mixgemm.gemm(x, w, act_format="fp8")``, and
``scaled_mm``). Each point's reference multiplies the activations the implementation
multiplies.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Optional, Sequence

import torch

from ..dtypes import ActType, WeightType
from ..jit.catalog import TILE_CONFIGS
from ..jit.specs import Fp8GemmSpec
from ..nn.linear import act_format_problem
from ..ops import dense as ops
from ..ops.dense import tile_labels
from ..ops.fp8 import BLOCK, fp8_gemm_specs, fp8_problem, quant_spec, quantize_fp8
from ..weights import quantize
from ..weights.layout import prepack
from ..weights.quantize import dequantize_reference
from ..weights.types import PackedWeight, QuantizedWeight
from .peer_formats import (TORCH_INT4_GROUP_SIZES, TORCH_INT4_INNER_K_TILES, ImplUnavailable,
                           gemlite_dequant, scaled_mm, scaled_mm_problem, scaled_mm_weight, torch_int4_dequant,
                           torch_int4_mm, torch_int4_pack, torch_int4_params)

#: The baseline implementation: always run, the denominator of "speedup over cuBLAS".
BASELINE = "cublas"
#: ``torch._scaled_mm`` e4m3 x e4m3, per-row scales on both (the W8A8-FP8 GEMM).
SCALED_MM = "scaled_mm"
#: Names of the peer implementations (the "best peer" of a row is the fastest of these with the
#: same kind of activations, :func:`activations_of`).
PEER_NAMES: tuple[str, ...] = ("torch_int4", "gemlite-u4", "gemlite-u2", SCALED_MM)
#: Weight types benchmarked for mixgemm, in table order.
MIXGEMM_TYPES: tuple[WeightType, ...] = (WeightType.S8, WeightType.U8, WeightType.S4,
                                         WeightType.U4, WeightType.S2, WeightType.U2)
#: The suffix of mixgemm's e4m3-activation rows: ``mixgemm-u4-fp8`` is ``mixgemm.gemm(x, w,
#: act_format="fp8")``.
FP8_SUFFIX = "-fp8"
#: The weight types of the e4m3 GEMM (their codes, minus integer zero points, are e4m3 values).
MIXGEMM_FP8_TYPES: tuple[WeightType, ...] = tuple(wt for wt in MIXGEMM_TYPES if wt.value in Fp8GemmSpec.WEIGHTS)
#: Names taken only when ``--impls`` names them exactly (never by default, nor by a prefix): the
#: 8-bit types with e4m3 activations, whose points are reported n/a with the reason.
NAMED_ONLY: tuple[str, ...] = tuple(f"mixgemm-{wt.value}{FP8_SUFFIX}" for wt in MIXGEMM_TYPES
                                    if wt not in MIXGEMM_FP8_TYPES)
#: :attr:`Impl.activations`: x multiplied as given, or rounded to e4m3 per token in the call.
EXACT, E4M3 = "exact", "e4m3"


def mixgemm_available() -> tuple[bool, str]:
    """Whether mixgemm's kernels can run here (an sm_90 GPU and an importable ``mixgemm.ops``);
    ``(False, reason)`` if not."""
    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return False, f"mixgemm's kernels need an sm_90 GPU, this one is sm_{cap[0]}{cap[1]}"
    try:
        from ..ops import dense as ops  # noqa: F401   # probed: the reason is reported when it cannot load
    except Exception as e:
        return False, f"mixgemm.ops is not importable: {type(e).__name__}: {e}"
    return True, ""


def torch_int4_available() -> tuple[bool, str]:
    """Whether PyTorch's tinygemm int4 kernel can run here; ``(False, reason)`` if not."""
    for op in ("_convert_weight_to_int4pack", "_weight_int4pack_mm"):
        if not hasattr(torch.ops.aten, op):
            return False, f"this PyTorch ({torch.__version__}) has no aten.{op}"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        return False, "tinygemm needs an sm_80+ GPU"
    return True, ""


def scaled_mm_available() -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` e4m3 x e4m3 can run here (:func:`.peer_formats.scaled_mm_problem`);
    ``(False, reason)`` if not."""
    why = scaled_mm_problem()
    return (False, why) if why else (True, "")


def impl_names(all_configs: bool = False) -> list[str]:
    """Names of every implementation the harness runs by default, in table order: cuBLAS, the
    peers, ``mixgemm-<wt>`` for every weight type, then ``mixgemm-<wt>-fp8`` for the e4m3 GEMM's
    (:data:`NAMED_ONLY` are known too, but only when named).

    Parameters
    ----------
    all_configs : bool
        Also list ``mixgemm-<wt>@<label>`` for every tile config (exact activations).
    """
    names = [BASELINE, *PEER_NAMES] + [f"mixgemm-{wt.value}" for wt in MIXGEMM_TYPES]
    names += [f"mixgemm-{wt.value}{FP8_SUFFIX}" for wt in MIXGEMM_FP8_TYPES]
    if all_configs:
        names += [f"mixgemm-{wt.value}@{tc.label}" for wt in MIXGEMM_TYPES for tc in TILE_CONFIGS]
    return names


def select_impl_names(candidates: Sequence[str], patterns: Optional[Sequence[str]]) -> list[str]:
    """The candidates matching any pattern, in candidate order, always with the baseline
    (``cublas``) first.

    A pattern that is a candidate's name selects that candidate and its ``@<config>`` variants
    (``mixgemm-u4``: not ``mixgemm-u4-fp8``); any other pattern selects the candidates whose
    names start with it (``gemlite``, ``mixgemm-s``). A name of :data:`NAMED_ONLY` is taken when
    given exactly, after the candidates.

    Raises
    ------
    ValueError
        A pattern matches no candidate.
    """
    def matches(name: str, pattern: str) -> bool:
        if pattern in candidates:
            return name == pattern or name.startswith(pattern + "@")
        return name.startswith(pattern)

    if not patterns:
        chosen = list(candidates)
    else:
        unmatched = [p for p in patterns if p not in NAMED_ONLY and not any(matches(c, p) for c in candidates)]
        if unmatched:
            hint = " (the @<config> variants need --all-configs)" if any("@" in p for p in unmatched) else ""
            raise ValueError(f"--impls: {', '.join(repr(p) for p in unmatched)} match no "
                             f"implementation{hint}; known: {', '.join(candidates)}")
        chosen = [c for c in candidates if any(matches(c, p) for p in patterns)]
        chosen += [p for p in dict.fromkeys(patterns) if p in NAMED_ONLY and p not in chosen]
    if BASELINE in candidates and BASELINE not in chosen:
        chosen.insert(0, BASELINE)
    return chosen


def is_peer(impl: str) -> bool:
    """Whether ``impl`` is one of the peers (torch_int4, gemlite-*, scaled_mm)."""
    return impl in PEER_NAMES or impl.startswith("gemlite")


def base_name(impl: str) -> str:
    """``"mixgemm-u4@dec8"`` -> ``"mixgemm-u4"``."""
    return impl.split("@", 1)[0]


def activations_of(impl: str) -> str:
    """:data:`E4M3` for the rows that round x to e4m3 in the call (``mixgemm-<wt>-fp8``,
    ``scaled_mm``), else :data:`EXACT`."""
    return E4M3 if impl == SCALED_MM or base_name(impl).endswith(FP8_SUFFIX) else EXACT


class QuantCache:
    """The quantizations of the current float weight, shared by the implementations that use
    the same bit width and convention (so that e.g. torch_int4, gemlite-u4 and mixgemm-u4
    multiply the same codes). Switching to another weight drops everything."""

    def __init__(self) -> None:
        self._weight_id: Optional[tuple] = None
        self._store: dict[tuple, Any] = {}

    def _get(self, w: torch.Tensor, key: tuple, make: Callable[[], Any]) -> Any:
        wid = (w.data_ptr(), tuple(w.shape), w.dtype, str(w.device))
        if wid != self._weight_id:
            self.clear()
            self._weight_id = wid
        if key not in self._store:
            self._store[key] = make()
        return self._store[key]

    def quantized(self, w: torch.Tensor, bits: int, symmetric: bool, group_size: int,
                  dtype: torch.dtype) -> QuantizedWeight:
        """:func:`mixgemm.quantize` of ``w`` (cached)."""
        return self._get(w, ("q", bits, symmetric, group_size, dtype),
                         lambda: quantize.quantize(w, bits, group_size, symmetric=symmetric, dtype=dtype))

    def packed(self, w: torch.Tensor, bits: int, symmetric: bool, group_size: int,
               dtype: torch.dtype) -> PackedWeight:
        """:func:`mixgemm.prepack` of the quantized ``w`` (cached)."""
        return self._get(w, ("p", bits, symmetric, group_size, dtype),
                         lambda: prepack(self.quantized(w, bits, symmetric, group_size, dtype)))

    def dequantized(self, w: torch.Tensor, bits: int, symmetric: bool, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """:func:`mixgemm.dequantize_reference` of the quantized ``w`` (cached)."""
        return self._get(w, ("d", bits, symmetric, group_size, dtype),
                         lambda: dequantize_reference(self.quantized(w, bits, symmetric, group_size, dtype)))

    def exact(self, w: torch.Tensor, bits: int, symmetric: bool, group_size: int,
              dtype: torch.dtype) -> torch.Tensor:
        """:func:`exact_weight` of the quantized ``w`` (cached)."""
        return self._get(w, ("e", bits, symmetric, group_size, dtype),
                         lambda: exact_weight(self.quantized(w, bits, symmetric, group_size, dtype)))

    def clear(self) -> None:
        self._store.clear()
        self._weight_id = None


def exact_weight(qw: QuantizedWeight) -> torch.Tensor:
    """``(q - z) * s`` in float32, ``[N, K]``: the weight the e4m3 GEMMs multiply, which they apply
    exactly (each code minus its integer zero point enters the MMA unrounded and the group scale
    multiplies the float32 sum), unlike :func:`mixgemm.dequantize_reference`'s bf16 rounding. Every
    value is exact in float32: an integer of at most 8 bits times a 16-bit float's 11-bit
    significand."""
    g = qw.group_size
    codes = qw.qweight.float()
    if qw.zeros is not None:
        codes = codes - qw.zeros.float().repeat_interleave(g, dim=1)
    return codes * qw.scales.float().repeat_interleave(g, dim=1)


def _tensor_bytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Impl(abc.ABC):
    """One implementation of ``y = x @ W^T``, behind a small adapter.

    Attributes
    ----------
    name : str
        Its name in tables, JSON and ``--impls``.
    kind : str
        ``"baseline"``, ``"peer"`` or ``"mixgemm"``.
    activations : str
        :data:`EXACT` (x multiplied as given) or :data:`E4M3` (x rounded to e4m3 per token, as
        :func:`mixgemm.ops.quantize_fp8_reference` defines it, inside the timed call).
    dequantized : torch.Tensor or None
        After :meth:`prepare`: the ``[N, K]`` weight this implementation multiplies by,
        reconstructed from its own quantization parameters (any float dtype that holds it
        exactly): its results are compared with ``x' @ (dequantized * col_scale[:, None])^T`` in
        float64, x' the activations it multiplies (:attr:`activations`).
    col_scale : torch.Tensor or None
        After :meth:`prepare`: float32 ``[N]``, a scale per weight row applied to the product
        (scaled_mm's), or None.
    weight_bytes : int or None
        After :meth:`prepare`: bytes of the weight tensors it reads (codes, scales, zeros).
    """

    name: str = ""
    kind: str = ""
    activations: str = EXACT

    def __init__(self) -> None:
        self.dequantized: Optional[torch.Tensor] = None
        self.col_scale: Optional[torch.Tensor] = None
        self.weight_bytes: Optional[int] = None

    def available(self) -> tuple[bool, str]:
        """Whether this implementation can run in this environment; ``(False, reason)`` if not."""
        return True, ""

    def why_not_m(self, m: int) -> Optional[str]:
        """Why this implementation does not take ``m`` tokens (None: it does)."""
        del m
        return None

    def kernel_specs(self, x_dtype: torch.dtype, ms: Optional[Sequence[int]] = None) -> list:
        """The mixgemm kernels this implementation launches on an sm_90 GPU for ``ms`` tokens (all
        token counts if None), to build them up front: none."""
        del x_dtype, ms
        return []

    @abc.abstractmethod
    def prepare(self, w_float: torch.Tensor, x_dtype: torch.dtype) -> None:
        """Quantize and pack ``w_float [N, K]`` (not timed); raise :class:`ImplUnavailable` for
        a configuration this implementation does not support."""

    @abc.abstractmethod
    def run(self, x: torch.Tensor) -> torch.Tensor:
        """``y [M, N] = x [M, K] @ W^T``: the timed call."""

    def release(self) -> None:
        """Drop the prepared weight."""
        self.dequantized = None
        self.col_scale = None
        self.weight_bytes = None


class CublasImpl(Impl):
    """``F.linear(x, W)`` with the dense weight in the activation dtype (cuBLAS)."""

    name = BASELINE
    kind = "baseline"

    def __init__(self) -> None:
        super().__init__()
        self._w: Optional[torch.Tensor] = None

    def prepare(self, w_float: torch.Tensor, x_dtype: torch.dtype) -> None:
        self._w = w_float.to(x_dtype).contiguous()
        self.dequantized = self._w
        self.weight_bytes = _tensor_bytes(self._w)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self._w)

    def release(self) -> None:
        super().release()
        self._w = None


class TorchInt4Impl(Impl):
    """PyTorch's tinygemm int4 kernel: asymmetric 4-bit, bf16 activations only."""

    name = "torch_int4"
    kind = "peer"

    def __init__(self, group_size: int, cache: QuantCache,
                 inner_k_tiles: int = TORCH_INT4_INNER_K_TILES) -> None:
        super().__init__()
        self.group_size = group_size
        self.inner_k_tiles = inner_k_tiles
        self._cache = cache
        self._packed: Optional[torch.Tensor] = None
        self._sz: Optional[torch.Tensor] = None

    def available(self) -> tuple[bool, str]:
        return torch_int4_available()

    def prepare(self, w_float: torch.Tensor, x_dtype: torch.dtype) -> None:
        if x_dtype != torch.bfloat16:
            raise ImplUnavailable("_weight_int4pack_mm takes bf16 activations only")
        if self.group_size not in TORCH_INT4_GROUP_SIZES:
            raise ImplUnavailable(f"tinygemm supports group sizes {TORCH_INT4_GROUP_SIZES}, "
                                  f"not {self.group_size}")
        n, k = w_float.shape
        if n % 8 or k % (self.inner_k_tiles * 16):
            raise ImplUnavailable(f"tinygemm needs N % 8 == 0 and K % {self.inner_k_tiles * 16} == 0")
        qw = self._cache.quantized(w_float, 4, False, self.group_size, x_dtype)
        packed, sz = torch_int4_pack(qw, self.inner_k_tiles)
        self._packed, self._sz = packed, sz
        self.dequantized = torch_int4_dequant(qw.qweight, sz, self.group_size)
        self.weight_bytes = _tensor_bytes(packed, sz)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch_int4_mm(x, self._packed, self.group_size, self._sz)

    def release(self) -> None:
        super().release()
        self._packed = self._sz = None


class GemliteImpl(Impl):
    """gemlite's Triton kernels (``GemLiteLinearTriton`` via ``gemlite.helper.A16Wn``),
    asymmetric ``bits``-bit with group-wise scales and zeros."""

    kind = "peer"

    def __init__(self, bits: int, group_size: int, cache: QuantCache) -> None:
        super().__init__()
        self.bits = bits
        self.group_size = group_size
        self.name = f"gemlite-u{bits}"
        self._cache = cache
        self._layer: Any = None

    def available(self) -> tuple[bool, str]:
        try:
            import gemlite  # noqa: F401
            from gemlite.helper import A16Wn  # noqa: F401
        except Exception as e:  # ImportError, or its import-time GPU probing failing
            return False, f"gemlite is not importable: {type(e).__name__}: {e}"
        return True, ""

    def prepare(self, w_float: torch.Tensor, x_dtype: torch.dtype) -> None:
        from gemlite.helper import A16Wn   # deferred: optional dependency (a peer to measure against)

        qw = self._cache.quantized(w_float, self.bits, False, self.group_size, x_dtype)
        try:
            layer = A16Wn(device=str(w_float.device), dtype=x_dtype).from_weights(
                qw.qweight, qw.scales, qw.zeros, W_nbits=self.bits, group_size=self.group_size)
        except (AssertionError, NotImplementedError, ValueError) as e:
            raise ImplUnavailable(f"gemlite cannot pack this weight: {type(e).__name__}: {e}") from None
        mode = int(layer.W_group_mode)
        self.dequantized = gemlite_dequant(qw.qweight, layer.scales.t(), layer.zeros.t(),
                                           self.group_size, mode, x_dtype)
        self.weight_bytes = _tensor_bytes(layer.W_q, layer.scales, layer.zeros)
        self._layer = layer

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self._layer(x)

    def release(self) -> None:
        super().release()
        self._layer = None


class ScaledMmImpl(Impl):
    """``torch._scaled_mm`` e4m3 x e4m3 with per-row scales on both operands and a bf16 output:
    the W8A8-FP8 GEMM (as vLLM runs an fp8 checkpoint with per-channel weight scales and dynamic
    per-token activation scales).

    The weight is quantized once (:func:`.peer_formats.scaled_mm_weight`, from the bf16 weight);
    the timed call quantizes x per token, then multiplies. The quantizer is
    :func:`mixgemm.ops.quantize_fp8` (one launch on an sm_90 GPU, the kernel that
    ``mixgemm-<wt>-fp8`` launches too; elsewhere its torch definition), so both e4m3 rows pay
    the same quantization and differ by their GEMMs alone. It writes each token's columns permuted
    inside blocks of 32, so the weight's columns are permuted alike (the sum is the same).
    """

    name = SCALED_MM
    kind = "peer"
    activations = E4M3

    def __init__(self) -> None:
        super().__init__()
        self._codes: Optional[torch.Tensor] = None
        self._scales: Optional[torch.Tensor] = None

    def available(self) -> tuple[bool, str]:
        return scaled_mm_available()

    def kernel_specs(self, x_dtype: torch.dtype, ms: Optional[Sequence[int]] = None) -> list:
        """The activation quantizer (:func:`mixgemm.ops.fp8.quant_spec`)."""
        del ms
        return [quant_spec(x_dtype)]

    def prepare(self, w_float: torch.Tensor, x_dtype: torch.dtype) -> None:
        if x_dtype != torch.bfloat16:
            raise ImplUnavailable("the W8A8-FP8 GEMM runs with bf16 activations and output (--dtype bf16)")
        n, k = w_float.shape
        if k % BLOCK or n % 16:
            raise ImplUnavailable(f"needs K % {BLOCK} == 0 (the per-token quantizer) and N % 16 == 0 "
                                  f"(torch._scaled_mm), got N={n} K={k}")
        codes, gemm_codes, scales = scaled_mm_weight(w_float.to(x_dtype))
        self._codes, self._scales = gemm_codes, scales
        self.dequantized, self.col_scale = codes, scales
        self.weight_bytes = _tensor_bytes(gemm_codes, scales)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_fp8(x)
        return scaled_mm(xq, xs, self._codes, self._scales, x.dtype)

    def release(self) -> None:
        super().release()
        self._codes = self._scales = None


class MixgemmImpl(Impl):
    """:func:`mixgemm.ops.gemm` (heuristic kernel), or one tile config through
    :func:`mixgemm.ops.gemm_with_spec` when ``tile_label`` is given; with ``act_format="fp8"``,
    ``mixgemm.gemm(x, w, act_format="fp8")``: the per-token e4m3 quantizer and the e4m3 GEMM
    (``mixgemm-<wt>-fp8``), checked against the e4m3-rounded activations and the exact weight
    ``(q - z) * s`` (:func:`exact_weight`)."""

    kind = "mixgemm"

    def __init__(self, weight_type: WeightType, group_size: int, cache: QuantCache,
                 tile_label: Optional[str] = None, act_format: str = "bf16") -> None:
        super().__init__()
        if act_format not in ("bf16", "fp8"):
            raise ValueError(f"act_format must be bf16 or fp8, got {act_format!r}")
        if act_format == "fp8" and tile_label is not None:
            raise ValueError("the e4m3 GEMM chooses its token tile and split per call (mixgemm.dispatch.heuristic.fp8_launch): "
                             "no @<config> rows")
        self.weight_type = weight_type
        self.group_size = group_size
        self.tile_label = tile_label
        self.act_format = act_format
        self.activations = E4M3 if act_format == "fp8" else EXACT
        self.name = (f"mixgemm-{weight_type.value}" + (FP8_SUFFIX if act_format == "fp8" else "")
                     + (f"@{tile_label}" if tile_label else ""))
        self._cache = cache
        self._packed: Optional[PackedWeight] = None
        self._spec: Any = None

    def available(self) -> tuple[bool, str]:
        if self.act_format == "fp8":
            why = act_format_problem("fp8", self.weight_type)
            if why:
                return False, why
        return mixgemm_available()

    def why_not_m(self, m: int) -> Optional[str]:
        if self.tile_label is None:
            return None
        tc = next(tc for tc in TILE_CONFIGS if tc.label == self.tile_label)
        if tc.max_tokens is not None and m > tc.max_tokens:
            return f"the {tc.label} kernels take at most {tc.max_tokens} tokens"
        return None

    def kernel_specs(self, x_dtype: torch.dtype, ms: Optional[Sequence[int]] = None) -> list:
        """The GEMM kernel specs this implementation may launch for ``ms`` tokens (all token
        counts if None), to build them up front (with e4m3 activations: the quantizer and the
        e4m3 GEMM of every token tile)."""
        act = ActType.from_torch(x_dtype)
        if self.act_format == "fp8":
            return [quant_spec(x_dtype), *fp8_gemm_specs(act, self.weight_type)]
        if self.tile_label is None and ms is not None:
            labels = set().union(*(tile_labels(m) for m in ms))   # the choice also depends on the layer's size
        else:
            labels = {tc.label for tc in TILE_CONFIGS}
        return [tc.spec(act, self.weight_type) for tc in TILE_CONFIGS
                if tc.label in labels and (self.tile_label is None or tc.label == self.tile_label)]

    def prepare(self, w_float: torch.Tensor, x_dtype: torch.dtype) -> None:
        bits, sym = self.weight_type.bits, self.weight_type.signed
        try:
            self._packed = self._cache.packed(w_float, bits, sym, self.group_size, x_dtype)
        except ValueError as e:
            raise ImplUnavailable(f"cannot quantize/prepack this weight: {e}") from None
        if self.act_format == "fp8":
            why = fp8_problem(self._packed)
            if why:
                self._packed = None
                raise ImplUnavailable(why)
            self.dequantized = self._cache.exact(w_float, bits, sym, self.group_size, x_dtype)
        else:
            self.dequantized = self._cache.dequantized(w_float, bits, sym, self.group_size, x_dtype)
        self.weight_bytes = self._packed.nbytes
        if self.tile_label is not None:
            self._spec = self.kernel_specs(x_dtype)[0]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_format == "fp8":
            return ops.gemm(x, self._packed, act_format="fp8")
        if self._spec is None:
            return ops.gemm(x, self._packed)
        return ops.gemm_with_spec(x, self._packed, self._spec)

    def release(self) -> None:
        super().release()
        self._packed = None
        self._spec = None


def make_impls(names: Sequence[str], group_size: int, cache: QuantCache) -> list[Impl]:
    """The adapters for ``names`` (from :func:`impl_names`), in that order."""
    out: list[Impl] = []
    labels = {tc.label for tc in TILE_CONFIGS}
    for name in names:
        base, _, label = name.partition("@")
        if name == BASELINE:
            out.append(CublasImpl())
        elif name == "torch_int4":
            out.append(TorchInt4Impl(group_size, cache))
        elif name == SCALED_MM:
            out.append(ScaledMmImpl())
        elif base in ("gemlite-u4", "gemlite-u2") and not label:
            out.append(GemliteImpl(int(base[-1]), group_size, cache))
        elif base.startswith("mixgemm-") and (not label or label in labels):
            wt = base[len("mixgemm-"):]
            fp8 = wt.endswith(FP8_SUFFIX)
            if fp8 and label:
                raise ValueError(f"unknown implementation {name!r} (the e4m3 GEMM has no @<config> rows)")
            try:
                weight_type = WeightType(wt[:-len(FP8_SUFFIX)] if fp8 else wt)
            except ValueError:
                raise ValueError(f"unknown implementation {name!r}") from None
            out.append(MixgemmImpl(weight_type, group_size, cache, label or None, "fp8" if fp8 else "bf16"))
        else:
            raise ValueError(f"unknown implementation {name!r}")
    return out


def prebuild_kernels(specs: Sequence[Any], log: Callable[[str], None]) -> Optional[str]:
    """Build the mixgemm kernels ``specs`` in parallel, before anything is timed (a no-op for
    the cached ones). Returns None, or why the build failed (the failures are logged)."""
    specs = list({s.name: s for s in specs}.values())
    if not specs:
        return None
    try:
        from ..jit import build   # deferred: probed, a run without a usable build still reports its peers
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"mixgemm.jit.build is not importable: {e}"
    try:
        build.build_many(specs, progress=True)
        return None
    except Exception as e:
        log(f"mixgemm kernels failed to build: {type(e).__name__}: {str(e)[:2000]}")
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def kernel_is_cached(spec: Any) -> tuple[bool, str]:
    """Whether ``spec`` is in the kernel cache; ``(False, reason)`` when it is not or the check
    fails."""
    try:
        from ..jit import build   # deferred: probed, a run without a usable build still reports its peers
        if build.is_cached(spec):
            return True, ""
        return False, f"kernel {spec.name} failed to build (see the log above)"
    except Exception as e:
        return False, f"cannot check kernel {spec.name}: {e}"


__all__ = ["BASELINE", "SCALED_MM", "PEER_NAMES", "MIXGEMM_TYPES", "FP8_SUFFIX", "MIXGEMM_FP8_TYPES", "NAMED_ONLY",
           "EXACT", "E4M3", "TORCH_INT4_INNER_K_TILES", "TORCH_INT4_GROUP_SIZES",
           "ImplUnavailable", "mixgemm_available", "torch_int4_available", "scaled_mm_available", "impl_names",
           "select_impl_names", "is_peer", "base_name", "activations_of", "QuantCache", "exact_weight", "Impl",
           "CublasImpl", "torch_int4_params", "torch_int4_dequant", "torch_int4_pack", "torch_int4_mm", "TorchInt4Impl",
           "gemlite_dequant", "GemliteImpl", "ScaledMmImpl", "MixgemmImpl", "make_impls", "prebuild_kernels",
           "kernel_is_cached"]
