"""FP8 (e4m3) activations: the quantizer (:func:`quantize_fp8`: a scale per token, or one static
scale given for every token), its torch definition (:func:`quantize_fp8_reference`) and inverse
(:func:`dequantize_fp8`), and the K order the e4m3 GEMMs read (:func:`k_permutation`).

The e4m3 GEMMs (:class:`mixgemm.jit.specs.Fp8GemmSpec`, ``mixgemm.gemm(..., act_format="fp8")``)
multiply e4m3 weights, converted exactly from 4- and 2-bit codes in the wgmma's 8-bit A-fragment
order, by e4m3 activations. That fragment holds the weight's columns permuted inside every block
of 32 (``converters/mixgemm/e4m3.hpp``):

    MMA column F = 16 p + 4 t + j  holds weight column  L = 8 j + 2 t + p

so the quantizer writes activation column ``L`` at position ``F`` (``xq[:, F] = q[:, L]``), and
the GEMM reads the activations as a plain K-major operand. docs/fp8.md has the whole design.
"""
from __future__ import annotations

import ctypes
import functools
import math
from typing import TYPE_CHECKING, Optional

import torch

from ..dispatch import checks, heuristic, plans, tuning
from ..dtypes import ActType, WeightType
from ..jit import driver, loader
from ..jit.catalog import FP8_TILE, FP8_TOKEN_TILES
from ..jit.specs import Activation, Epilogue, Fp8GemmSpec, QuantFp8Spec, Scheduler
from . import args

if TYPE_CHECKING:
    from ..weights.types import PackedWeight


__all__ = ["E4M3_MAX", "ACT_FORMATS", "unknown_act_format", "prefers_fp8", "layer_prefers_fp8", "resolve_act_format", "quantize_fp8", "quantize_fp8_reference", "dequantize_fp8", "k_permutation",
           "input_scale_problem", "check_input_scale_value",
           "mma_to_weight_col", "weight_to_mma_col", "quant_spec", "gemm_fp8", "gemm_quantized", "fp8_problem",
           "fp8_gemm_spec", "fp8_gemm_specs", "select_fp8_spec", "FP8_TILE"]

#: ``mixgemm.gemm``'s ``act_format`` values: exact bf16/fp16 activations, e4m3 ones, or per call
#: the one measured faster for the layer, its token count and the GPU (:func:`resolve_act_format`)
ACT_FORMATS = ("bf16", "fp8", "auto")


def unknown_act_format(act_format) -> Optional[str]:
    """Why ``act_format`` is not one of :data:`ACT_FORMATS`, or None."""
    if act_format not in ACT_FORMATS:
        return f"act_format must be one of {ACT_FORMATS}, got {act_format!r}"
    return None


def prefers_fp8(m, w: "PackedWeight", device: torch.device) -> bool:
    """Whether ``act_format="auto"`` computes ``m`` tokens of ``w`` on ``device`` with e4m3
    activations: the e4m3 kernels take w (:func:`fp8_problem`) and the GPU's tuning table
    measured them faster for this layer shape at this token count
    (:func:`mixgemm.dispatch.tuning.prefers_fp8`). False on a device without a table, for layer
    shapes it does not list, and off CUDA."""
    return layer_prefers_fp8(m, w.weight_type, w.group_size, w.zero_offsets is not None, w.n, w.k, device)


def layer_prefers_fp8(m: int, weight_type: WeightType, group_size: int, fractional_zeros: bool, n: int, k: int,
                      device: torch.device) -> bool:
    """:func:`prefers_fp8` from a weight's fields (a layer's forward makes no PackedWeight for it:
    this is on the eager path of every ``"auto"`` call): the conditions of :func:`fp8_problem`,
    then the tuning table."""
    if (device.type != "cuda" or weight_type.value not in Fp8GemmSpec.WEIGHTS or fractional_zeros
            or group_size % 32):
        return False
    return tuning.prefers_fp8(heuristic.gpu_name(device.index if device.index is not None else
                                                 torch.cuda.current_device()), weight_type, n, k, m)


def resolve_act_format(act_format: str, m, w: "PackedWeight", device: torch.device) -> str:
    """``"bf16"`` or ``"fp8"``: ``act_format`` itself, or for ``"auto"`` the format
    :func:`prefers_fp8` picks for ``m`` tokens (so the numerics of ``"auto"`` change with M: e4m3
    rounding where the e4m3 path is faster, exact activations elsewhere)."""
    if act_format != "auto":
        return act_format
    return "fp8" if prefers_fp8(m, w, device) else "bf16"

#: The largest finite e4m3 (float8_e4m3fn) value: a token's scale is its amax over this.
E4M3_MAX = 448.0
#: The quantizer's block of columns (the K permutation's period); K must be a multiple of it.
BLOCK = 32
_THREADS = 128   # quant_fp8_kernel.hpp's kQuantThreads


def mma_to_weight_col(f: int) -> int:
    """The weight (and activation) column that MMA column ``f`` holds (e4m3.hpp's function of
    the same name)."""
    return (f & ~31) + 8 * (f % 4) + 2 * ((f // 4) % 4) + (f % 32) // 16


def weight_to_mma_col(col: int) -> int:
    """The MMA column that holds weight column ``col``: the inverse of :func:`mma_to_weight_col`."""
    return (col & ~31) + 16 * (col % 2) + 4 * ((col // 2) % 4) + (col % 32) // 8


@functools.lru_cache(maxsize=None)
def _permutation(k: int) -> tuple[int, ...]:
    return tuple(mma_to_weight_col(f) for f in range(k))


def k_permutation(k: int, device: "torch.device | str | None" = None) -> torch.Tensor:
    """``perm`` (int64, ``[k]``) with ``xq[:, f] = q[:, perm[f]]``: the MMA order of ``k``
    columns (``k % 32 == 0``). Its inverse is ``argsort(perm)``."""
    if k % BLOCK:
        raise ValueError(f"K={k} must be a multiple of {BLOCK}")
    return torch.tensor(_permutation(k), dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=None)
def quant_spec(dtype: torch.dtype) -> QuantFp8Spec:
    """The quantizer kernel for rows of ``dtype`` (bf16 or fp16)."""
    return QuantFp8Spec(ActType.from_torch(dtype))


def _check(x, input_scale=None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    if x.shape[-1] % BLOCK:
        raise ValueError(f"x has K={x.shape[-1]}: the FP8 quantizer needs K % {BLOCK} == 0")
    if input_scale is not None:
        why = input_scale_problem(input_scale, x.device)
        if why:
            raise ValueError(why)


def input_scale_problem(input_scale, device: "torch.device | None" = None) -> Optional[str]:
    """Why ``input_scale`` is not a static activation scale that the quantizer takes (on
    ``device``), or None. Its value is not read (that would synchronize with the GPU): see
    :func:`check_input_scale_value`."""
    if (not isinstance(input_scale, torch.Tensor) or input_scale.dtype != torch.float32
            or input_scale.numel() != 1 or input_scale.dim() > 1):
        what = (f"a {input_scale.dtype} tensor of shape {list(input_scale.shape)}"
                if isinstance(input_scale, torch.Tensor) else type(input_scale).__name__)
        return (f"input_scale must be a float32 tensor of one element (shape [] or [1]), got {what}"
                + (" (convert it with .float())" if isinstance(input_scale, torch.Tensor)
                   and input_scale.numel() == 1 and input_scale.dim() <= 1 else ""))
    if device is not None and input_scale.device != device:
        return f"input_scale is on {input_scale.device} but x is on {device}"
    return None


def check_input_scale_value(input_scale: torch.Tensor, name: str = "input_scale") -> None:
    """Raise ValueError unless the one value of ``input_scale`` is positive and finite (reads
    it: call it where the scale is set, not per call)."""
    v = float(input_scale.detach().reshape(()).to("cpu", torch.float64))
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be positive and finite, got {v!r}")


def quantize_fp8_reference(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of :func:`quantize_fp8` in torch (any device), bit for bit the kernel's.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]``, bfloat16 or float16, ``K % 32 == 0``.
    input_scale : torch.Tensor, optional
        A static scale: float32, one element, on x's device, positive and finite (not
        checked here). None: a scale per token.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``xq``: ``torch.float8_e4m3fn`` ``[..., K]``, the codes in the MMA's K order; ``scales``:
        float32 ``[...]``, one per token (row of x; each ``input_scale`` when given), such that
        ``xq * scales`` (in the natural order, :func:`dequantize_fp8`) approximates x.

    Notes
    -----
    In float32, per row: ``amax = max |x|``; ``s = amax / 448`` (or 1 for a row of zeros), or
    ``s = input_scale``; ``q = (x / s).clamp(-448, 448).to(float8_e4m3fn)`` (round to nearest
    even; with a static scale the clamp saturates values beyond ``448 s``); then
    ``xq[:, f] = q[:, perm[f]]`` with :func:`k_permutation`. Each step is one correctly rounded
    float32 operation, which the kernel performs in the same order.
    """
    _check(x, input_scale)
    xf = x.float()
    if input_scale is None:
        amax = xf.abs().amax(dim=-1)
        # (a tensor divisor: torch's CUDA division by a Python number multiplies by its reciprocal,
        # which is not the correctly rounded quotient the kernel computes)
        s = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    else:
        s = input_scale.reshape(()).expand(x.shape[:-1]).contiguous()
    q = (xf / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    perm = k_permutation(x.shape[-1], x.device)
    return q.index_select(-1, perm).contiguous(), s


def dequantize_fp8(xq: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``xq * scales`` in the natural column order: the activations an e4m3 GEMM multiplies.

    Parameters
    ----------
    xq : torch.Tensor
        ``torch.float8_e4m3fn`` (or its bytes as ``torch.uint8``) ``[..., K]`` in the MMA's K
        order, as :func:`quantize_fp8` returns it.
    scales : torch.Tensor
        float32 ``[...]``.
    dtype : torch.dtype
        Of the result (float32 or float64 hold every product exactly).
    """
    if xq.dtype == torch.uint8:
        xq = xq.view(torch.float8_e4m3fn)
    inv = torch.argsort(k_permutation(xq.shape[-1], xq.device))
    return xq.index_select(-1, inv).to(dtype) * scales.to(dtype).unsqueeze(-1)


def _kernel_takes(x: torch.Tensor) -> bool:
    return checks.device_problem(x.device) is None


#: the argument types of MIXGEMM_QUANT_FP8_ENTRY: x, xq, scales, static_scale, ldx_vecs, ldq_vecs, blocks
_ARG_TYPES = (ctypes.c_void_p,) * 4 + (ctypes.c_int64, ctypes.c_int64, ctypes.c_int)


def _launch(x: torch.Tensor, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
            input_scale: Optional[torch.Tensor] = None):
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.stride(0) * x2.element_size()) % 16 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
        if x2.data_ptr() % 16:
            x2 = x2.clone()
    rows = x2.shape[0]
    if out is None:
        xq = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty((rows,), dtype=torch.float32, device=x.device)
    else:
        xq, scales = out
    if rows:
        launch = loader.KERNELS.plain_launch(quant_spec(x.dtype), x.device, _ARG_TYPES, _THREADS)
        static = 0 if input_scale is None else input_scale.data_ptr()
        launch(rows, driver.current_stream(x.device.index), x2.data_ptr(), xq.data_ptr(), scales.data_ptr(),
               static, x2.stride(0) // 8, xq.stride(0) // 16, k // BLOCK)
    return xq.view(*x.shape), scales.view(x.shape[:-1])


def quantize_fp8(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to e4m3 with one scale per token, or with one static scale for
    every token, in the e4m3 GEMMs' K order.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]``, bfloat16 or float16, ``K % 32 == 0``. Any strides (a row stride that is
        not a multiple of 16 bytes is copied first).
    input_scale : torch.Tensor, optional
        A static per-tensor scale (as W4A8 checkpoints carry per layer): float32, one element
        (shape ``[]`` or ``[1]``), on x's device. Every token is quantized as
        ``e4m3(clamp(x / input_scale, -448, 448))``. Its value must be positive and finite; it
        is not read here (:func:`check_input_scale_value` checks it where it is set). None (the
        default): a scale per token, ``amax / 448``.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``(xq, scales)``: ``torch.float8_e4m3fn`` ``[..., K]`` (contiguous, columns permuted
        inside every block of 32: :func:`k_permutation`) and float32 ``[...]`` (``input_scale``
        repeated when given); exactly :func:`quantize_fp8_reference` of x.

    Notes
    -----
    On an sm_90 GPU this is one launch of :class:`mixgemm.jit.specs.QuantFp8Spec`'s kernel (one
    CTA per token; with ``input_scale`` the kernel reads the scale instead of taking the row's
    max); elsewhere it runs :func:`quantize_fp8_reference`.
    """
    _check(x, input_scale)
    if _kernel_takes(x):
        return _launch(x, input_scale=input_scale)
    return quantize_fp8_reference(x, input_scale)


# ---------------------------------------------------------------------------------------------
# The e4m3 GEMM
# ---------------------------------------------------------------------------------------------
#: the activations gemm_fp8 fuses (swiglu through the gated e4m3 kernel)
_FP8_ACTIVATIONS = (None, "silu", "gelu", "swiglu")


def fp8_problem(w: "PackedWeight") -> Optional[str]:
    """Why ``w`` cannot run with e4m3 activations (``act_format="fp8"``), or None if it can."""
    if w.weight_type.value not in Fp8GemmSpec.WEIGHTS:
        return (f"act_format='fp8' takes u4, s4, u2 and s2 weights (their codes, minus integer zero points, are "
                f"exact in e4m3); w is {w.weight_type.value}: use act_format='bf16'")
    if w.zero_offsets is not None:
        return ("act_format='fp8' needs integer zero points; w has fractional ones (zero_offsets): "
                "use act_format='bf16'")
    if w.group_size % 32:
        return f"act_format='fp8' needs a group size that is a multiple of 32, w has {w.group_size}"
    return None


@functools.lru_cache(maxsize=None)   # (few kernels; asked on every e4m3 call)
def fp8_gemm_spec(act: ActType, weight_type: WeightType, activation: Optional[str] = None,
                  tile_n: int = FP8_TOKEN_TILES[0], splits: int = 1) -> Fp8GemmSpec:
    """The e4m3 GEMM kernel for ``act`` outputs (and scales), ``weight_type`` codes, a token
    tile of ``tile_n`` (:data:`mixgemm.jit.catalog.FP8_TOKEN_TILES`; default the widest) and a
    launch of ``splits`` split-K units per output tile, without a weight at hand (a benchmark's
    or a prebuild's kernel list): the gated epilogue for ``activation="swiglu"``, else bias +
    activation; the stream-K scheduler for split launches, else the persistent one."""
    epilogue = Epilogue.SWIGLU if activation == "swiglu" else Epilogue.BIAS_ACT
    scheduler = Scheduler.STREAMK if splits > 1 else Scheduler.PERSISTENT
    return Fp8GemmSpec(act, weight_type, FP8_TILE[0], tile_n, FP8_TILE[2], epilogue=epilogue, scheduler=scheduler)


def fp8_gemm_specs(act: ActType, weight_type: WeightType, activation: Optional[str] = None) -> list[Fp8GemmSpec]:
    """Every e4m3 GEMM kernel :func:`select_fp8_launch` may pick for these types and ``activation``,
    at any token count and on any GPU: per token tile, the whole-tile and the split-K kernel
    (what a prebuild builds)."""
    return [fp8_gemm_spec(act, weight_type, activation, tile_n, splits)
            for splits in (1, 2) for tile_n in FP8_TOKEN_TILES]


def select_fp8_launch(m: int, w: "PackedWeight", activation: Optional[str] = None,
                      sm_count: int = heuristic.DEFAULT_SM_COUNT) -> tuple[Fp8GemmSpec, int]:
    """The e4m3 GEMM kernel :func:`gemm_fp8` runs for ``m`` tokens on a GPU of ``sm_count`` SMs,
    and its split-K factor: the token tile and splits of :func:`mixgemm.dispatch.heuristic.fp8_launch`
    (narrower tiles or splits of the k-loop where whole tiles would leave SMs idle), the gated
    epilogue for ``activation="swiglu"`` (:func:`fp8_gemm_spec`)."""
    tile_n, splits = heuristic.fp8_launch(m, w.n, w.k, sm_count)
    return fp8_gemm_spec(w.act_type, w.weight_type, activation, tile_n, splits), splits


def select_fp8_spec(m: int, w: "PackedWeight", activation: Optional[str] = None,
                    sm_count: int = heuristic.DEFAULT_SM_COUNT) -> Fp8GemmSpec:
    """The kernel of :func:`select_fp8_launch`."""
    return select_fp8_launch(m, w, activation, sm_count)[0]


def gemm_fp8(x: torch.Tensor, w: "PackedWeight", bias: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None, activation: Optional[str] = None,
             spec: Optional[Fp8GemmSpec] = None, input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``mixgemm.gemm(x, w, ..., act_format="fp8")``: x quantized to e4m3 per token, or with a
    static scale (:func:`quantize_fp8`), then one e4m3 GEMM launch.

    Parameters
    ----------
    x, w, bias, out, activation
        As :func:`mixgemm.gemm`; ``w`` is u4, s4, u2 or s2 with integer zero points, and
        ``activation`` is None, ``"silu"``, ``"gelu"`` or ``"swiglu"`` (a gate/up weight of
        :func:`mixgemm.weights.quantize.interleave_gate_up`, ``[..., N/2]`` out).
    spec : Fp8GemmSpec, optional
        The kernel (default: :func:`select_fp8_spec`); its types must be w's.
    input_scale : torch.Tensor, optional
        A static per-tensor activation scale, as for :func:`quantize_fp8`; None: per token.

    Returns
    -------
    torch.Tensor
        ``act(s_x * (xq @ (q - z)^T) * s_w + bias)`` rounded once to x's dtype, ``[..., N]``:
        the product of the e4m3-rounded activations (:func:`dequantize_fp8` of
        :func:`quantize_fp8`) with exactly the dequantized weight ``(q - z) * s``, accumulated in
        float32 (docs/fp8.md).
    """
    args.check_gemm_inputs(x, w, bias, out, activation)
    why = fp8_problem(w) or (None if input_scale is None else input_scale_problem(input_scale, x.device))
    if why:
        raise ValueError(why)
    if activation not in _FP8_ACTIVATIONS:
        raise ValueError(f"act_format='fp8' fuses activation None, 'silu', 'gelu' or 'swiglu', not {activation!r}")
    lead = x.shape[:-1]
    m = math.prod(lead)
    spec, splits = _checked_launch(spec, None, w, activation, m, x.get_device())
    y = out if out is not None else torch.empty((*lead, _n_out(w, activation)), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    xq, xs = _launch(x.reshape(m, w.k), input_scale=input_scale)
    _launch_gemm(spec, splits, w, xq, xs, bias, y, activation)
    # xq and xs go back to torch's allocator, which reuses them only after this stream's work
    return y


def gemm_quantized(xq: torch.Tensor, x_scales: torch.Tensor, w: "PackedWeight", bias: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                   spec: Optional[Fp8GemmSpec] = None, splits: Optional[int] = None) -> torch.Tensor:
    """The e4m3 GEMM alone, on activations already quantized by :func:`quantize_fp8` (a producer
    that writes them itself, or a benchmark that times the GEMM apart).

    Parameters
    ----------
    xq : torch.Tensor
        ``torch.float8_e4m3fn`` ``[M, K]``, contiguous, in the MMA's K order.
    x_scales : torch.Tensor
        float32 ``[M]``, contiguous.
    w, bias, out, activation, spec
        As :func:`gemm_fp8`; the output is in w's dtype.
    splits : int, optional
        The split-K factor, 1 to :data:`mixgemm.dispatch.heuristic.FP8_MAX_SPLITS` (1: whole
        output tiles); more than 1 needs a stream-K kernel (``fp8_gemm_spec(..., splits=...)``).
        Default: the heuristic's (:func:`mixgemm.dispatch.heuristic.fp8_launch`) with ``spec``
        None; 1 for a persistent ``spec``; for a stream-K one, the heuristic's split for its token
        tile. The splits' partial sums are added in k order, so a given launch gives the same
        result every time; another split factor may round differently.

    Returns
    -------
    torch.Tensor
        ``[M, N]``.
    """
    if not isinstance(xq, torch.Tensor) or xq.dtype != torch.float8_e4m3fn or xq.dim() != 2:
        raise TypeError("xq must be a 2-D torch.float8_e4m3fn tensor [M, K] (mixgemm.ops.quantize_fp8)")
    m, k = xq.shape
    if k != w.k or not xq.is_contiguous():
        raise ValueError(f"xq must be contiguous [M, K={w.k}], got {list(xq.shape)}")
    if (not isinstance(x_scales, torch.Tensor) or x_scales.dtype != torch.float32 or tuple(x_scales.shape) != (m,)
            or not x_scales.is_contiguous()):
        raise ValueError(f"x_scales must be a contiguous float32 tensor of shape [{m}]")
    why = args.weight_problem(w) or fp8_problem(w)
    if why:
        raise ValueError(why)
    if xq.device != w.device or x_scales.device != w.device:
        raise ValueError(f"xq and x_scales must be on w's device {w.device}")
    if activation not in _FP8_ACTIVATIONS:
        raise ValueError(f"act_format='fp8' fuses activation None, 'silu', 'gelu' or 'swiglu', not {activation!r}")
    for name, t, shape in (("bias", bias, (w.n,)), ("out", out, (m, _n_out(w, activation)))):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != w.dtype
                              or t.device != w.device or not t.is_contiguous() or t.data_ptr() % 16):
            raise ValueError(f"{name} must be a contiguous, 16-byte aligned {w.dtype} tensor of shape "
                             f"{list(shape)} on {w.device}")
    spec, splits = _checked_launch(spec, splits, w, activation, m, xq.get_device())
    y = out if out is not None else torch.empty((m, _n_out(w, activation)), dtype=w.dtype, device=xq.device)
    if m:
        _launch_gemm(spec, splits, w, xq, x_scales, bias, y, activation)
    return y


def _n_out(w: "PackedWeight", activation: Optional[str]) -> int:
    return w.n // 2 if activation == "swiglu" else w.n


def _checked_launch(spec: Optional[Fp8GemmSpec], splits: Optional[int], w: "PackedWeight",
                    activation: Optional[str], m: int, device_index: int) -> tuple[Fp8GemmSpec, int]:
    """The kernel and split factor of a call: the ones given, checked, or the heuristic's."""
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                               or not 1 <= splits <= heuristic.FP8_MAX_SPLITS):
        raise ValueError(f"splits must be an int from 1 to {heuristic.FP8_MAX_SPLITS}, got {splits!r}")
    if spec is None:
        picked, best = select_fp8_launch(m, w, activation, heuristic.sm_count(device_index))
        if splits is None:
            return picked, best
        return fp8_gemm_spec(w.act_type, w.weight_type, activation, picked.tile_n, splits), splits
    spec = _checked_spec(spec, w, activation)
    if spec.scheduler is not Scheduler.STREAMK:
        if splits is not None and splits > 1:
            raise ValueError(f"kernel {spec.name} launches whole output tiles; splits={splits} takes the "
                             f"stream-K kernel (fp8_gemm_spec(..., splits={splits}))")
        return spec, 1
    if splits is None:
        splits = heuristic.fp8_launch(m, w.n, w.k, heuristic.sm_count(device_index), (spec.tile_n,))[1]
    return spec, splits


def _checked_spec(spec: Fp8GemmSpec, w: "PackedWeight", activation: Optional[str]) -> Fp8GemmSpec:
    if not isinstance(spec, Fp8GemmSpec):
        raise TypeError(f"spec must be an Fp8GemmSpec, got {type(spec).__name__}")
    if spec.act is not w.act_type or spec.weight is not w.weight_type:
        raise ValueError(f"kernel {spec.name} is for {spec.act.value} x {spec.weight.value}, "
                         f"w is {w.act_type.value} x {w.weight_type.value}")
    if (spec.epilogue is Epilogue.SWIGLU) != (activation == "swiglu"):
        raise ValueError(f"kernel {spec.name} computes {'swiglu' if spec.epilogue is Epilogue.SWIGLU else 'none / silu / gelu'}, "
                         f"the call asks for {activation or 'none'}")
    return spec


def _launch_gemm(spec: Fp8GemmSpec, splits: int, w: "PackedWeight", xq: torch.Tensor, xs: torch.Tensor,
                 bias: Optional[torch.Tensor], y: torch.Tensor, activation: Optional[str]) -> None:
    """One launch of ``spec`` with ``splits``: a split launch takes its workspace and zeroed locks
    from the stream's buffers (:data:`mixgemm.dispatch.plans.WORKSPACES`, :data:`~mixgemm.dispatch.plans.LOCKS`),
    or under a CUDA-graph capture from the graph's pool for this launch only."""
    m = xq.shape[0]
    kernel = loader.KERNELS.get(spec, xq.device)
    args = driver.Fp8GemmArgs()
    a = args.gemm
    a.abi_version = driver.ABI_VERSION
    a.m, a.n, a.k, a.group_size = m, w.n, w.k, w.group_size
    index = xq.get_device()
    a.sm_count = heuristic.sm_count(index)
    a.splits, a.raster, a.swizzle = splits, 0, 1
    a.activation = Activation(activation or "none").abi
    a.weight, a.scales = w.qdata.data_ptr(), w.scales.data_ptr()
    a.zeros = 0 if w.zeros is None else w.zeros.data_ptr()
    a.x, a.ldx = xq.data_ptr(), w.k
    a.bias = 0 if bias is None else bias.data_ptr()
    a.y, a.ldy = y.data_ptr(), _n_out(w, activation)
    args.x_scales = xs.data_ptr()
    stream = driver.current_stream(index)
    held: list = []
    if spec.scheduler is Scheduler.STREAMK:   # (a whole-tile kernel needs neither)
        ws_bytes, lock_bytes = kernel.helper.memory_fp8(args)
        capturing = driver.capturing()
        if ws_bytes:
            a.workspace = plans.launch_memory(plans.WORKSPACES, xq.device, index, stream, ws_bytes, capturing, held)[0]
        if lock_bytes:
            a.locks = plans.launch_memory(plans.LOCKS, xq.device, index, stream, lock_bytes, capturing, held)[0]
    params, launch = kernel.helper.prepare_fp8(args)
    loader.launch_prepared(kernel, params, launch, stream)
    # `held` may go now: torch's allocator reuses its memory only in stream order
