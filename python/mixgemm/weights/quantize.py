r"""Group-wise round-to-nearest quantization, and the reference dequantizer.

:func:`quantize` turns a float weight ``w[N, K]`` (nn.Linear's ``[out_features, in_features]``)
into a :class:`~mixgemm.weights.types.QuantizedWeight`; :func:`dequantize_reference` turns it back
into a float tensor, in the activation dtype, exactly as the kernels do. Neither needs a GPU.

The formulas
------------
For each row ``n`` and group ``g`` (the ``group_size`` consecutive K elements
``k = g*group_size .. (g+1)*group_size - 1``), with ``b`` bits and ``w_g`` the group's values::

    asymmetric (default, unsigned codes, with zero point):
        xmin = min(min(w_g), 0)        xmax = max(max(w_g), 0)
        s    = (xmax - xmin) / (2^b - 1)                      (s = 1 if s == 0)
        s_r  = round_up(s)                                    smallest act-dtype value >= s
        z    = clamp(round(-xmin / s_r), 0, 2^b - 1)          integer, stored in the act dtype
        q    = clamp(round(w / s_r) + z, 0, 2^b - 1)          uint8
        deq  = fl((q - z) * s_r)

    symmetric (GPTQ-style full range, signed codes, no zero point):
        amax = max(|w_g|)
        s    = 2 * amax / (2^b - 1)                           (s = 1 if amax == 0)
        s_r  = round_up(s)
        q    = clamp(round(w / s_r), -2^(b-1), 2^(b-1) - 1)   int8
        deq  = fl(q * s_r)

``round`` is round-half-to-even, ``fl`` rounds to the activation dtype (nearest-even), once.
Rounding the scale *up* (``s_r >= s``) makes the grid ``{(q - z) * s_r}`` cover the whole
group, so no code clamps by more than half a step and

    |w - deq| <= s_r / 2 + ulp(deq) / 2

holds for every element (``ulp`` of the activation dtype at ``deq``). Precision of the
computation: ``w`` is converted to float32 (float64 if it is float64), which is exact, and
the group minimum/maximum are exact. ``s`` and ``z`` are computed from them in float64, where
``2 * amax`` and (unless the group's minimum and maximum differ in magnitude by more than
2^29) ``xmax - xmin`` are exact. The quotient ``w / s_r`` is computed in float32 (float64),
correctly rounded; it rounds to the same integer as the exact quotient, because an exact
quotient ``x`` that is not itself a tie lies more than ``x * 2^-24`` (``x * 2^-53``) away from
every tie (``w`` has at most 24 (53) significant bits), more than the division's rounding
error. So for fp16/bf16/fp32 inputs the scales, zeros and codes are those of the formulas
above evaluated in exact arithmetic (but for the float64 rounding of ``xmax - xmin`` noted),
and the bound holds without exception.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..dtypes import ActType, WeightType
from ..errors import OverflowQuantizeError
from .layout import unpack
from .types import SUPPORTED_BITS, PackedWeight, QuantizedWeight, check_group_size

__all__ = ["quantize", "dequantize_reference", "round_up_to_dtype", "interleave_gate_up", "interleave_rows",
           "deinterleave_rows", "GATE_UP_STRIPE"]

#: Elements of ``w`` processed at a time (bounds the float32/float64 temporaries).
_CHUNK_ELEMS = 1 << 22

DTypeLike = Union[torch.dtype, ActType, str]


def round_up_to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round non-negative values up to the nearest value representable in ``dtype``.

    Parameters
    ----------
    x : torch.Tensor
        float32 or float64, any shape, values ``>= 0`` (not NaN).
    dtype : torch.dtype
        ``torch.bfloat16`` or ``torch.float16``.

    Returns
    -------
    torch.Tensor
        Same shape and device as ``x``, dtype ``dtype``: the smallest ``dtype`` value
        ``>= x`` (``+inf`` where ``x`` exceeds the largest finite value).
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    r = x.to(dtype)  # nearest (possibly via float32: either neighbour); fixed up below
    below = r.to(x.dtype) < x
    # For non-negative finite values, the next representable value up is the next bit pattern.
    bumped = (r.view(torch.int16) + 1).view(dtype)
    return torch.where(below, bumped, r)


def _overflow(what: str, act: torch.dtype, peak: float) -> OverflowQuantizeError:
    """The error for ``what`` (scales, dequantized weights) overflowing ``act``, with the remedy
    that applies: bf16 for an fp16 overflow, smaller weights for a bf16 one."""
    if act == torch.float16:
        hint = "quantize for bfloat16 instead (dtype=torch.bfloat16), whose range is float32's"
    else:
        hint = (f"no activation dtype holds them (bfloat16's largest value is "
                f"{torch.finfo(torch.bfloat16).max:.6g}); scale the weight down first")
    return OverflowQuantizeError(what, act, peak, hint)


#: Float8 dtypes torch knows (e4m3/e5m2 and their variants): refused by name by quantize.
FLOAT8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                                         "float8_e5m2fnuz", "float8_e8m0fnu")
                      if hasattr(torch, name))


def _resolve_act_dtype(dtype: Optional[DTypeLike], w_dtype: torch.dtype) -> torch.dtype:
    if dtype is None:
        return w_dtype if w_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    try:
        return ActType.parse(dtype).torch_dtype
    except (TypeError, ValueError) as e:
        raise ValueError(f"dtype (the activation dtype of scales and zeros) must be bf16 or "
                         f"fp16: {e}") from None


def quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = False,
             dtype: Optional[DTypeLike] = None) -> QuantizedWeight:
    """Quantize a float weight group-wise along K with round-to-nearest(-even).

    See the module docstring for the exact formulas.

    Parameters
    ----------
    w : torch.Tensor
        Shape ``[N, K]`` (nn.Linear's ``[out_features, in_features]``), any floating dtype
        (fp16, bf16, fp32, fp64, ...), CPU or CUDA, any strides. All values must be finite.
    bits : int
        Bits per code: 8, 4 or 2.
    group_size : int
        Consecutive K elements sharing a scale (and zero): 32, 64, 128, 256, or ``K`` for
        per-channel scales. Must divide K.
    symmetric : bool, default False
        False: unsigned codes in ``[0, 2^b-1]`` with a zero point per group.
        True: signed codes in ``[-2^(b-1), 2^(b-1)-1]``, no zero point.
    dtype : torch.dtype or ActType or str, optional
        Activation dtype (bf16 or fp16) the scales and zeros are stored in, and in which the
        kernels dequantize. Default: ``w.dtype`` if it is bf16/fp16, else bf16.

    Returns
    -------
    QuantizedWeight
        On ``w``'s device: ``qweight`` ``[N, K]`` (uint8 asymmetric / int8 symmetric),
        ``scales`` ``[N, K // group_size]`` in ``dtype``, positive, rounded up from the
        float scale; ``zeros`` ``[N, K // group_size]`` in ``dtype``, integer-valued
        (asymmetric) or ``None`` (symmetric).

    Raises
    ------
    TypeError
        ``w`` is not a floating-point tensor, is fp8 (:data:`FLOAT8_DTYPES`: its values mean
        nothing without the checkpoint's scale, so it is refused by name), or an argument has
        the wrong type.
    ValueError
        ``w`` is not 2-D, is empty or has NaN/inf values; unsupported ``bits`` or
        ``group_size``; ``dtype`` not bf16/fp16.
    mixgemm.errors.OverflowQuantizeError
        (a ValueError) The scales or dequantized values would overflow ``dtype`` (possible
        with fp16 and ``|w|`` near 65504: use bf16).
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() == 3:
        raise ValueError(f"w must be 2-D [N, K]; for stacked expert weights [E, N, K] (shape {tuple(w.shape)}) "
                         f"use mixgemm.moe.PackedExperts.quantize(w, bits, group_size, symmetric), which "
                         f"quantizes and prepacks them expert by expert")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [N, K] (out_features, in_features), got shape "
                         f"{tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got {w.dtype}")
    if w.dtype in FLOAT8_DTYPES:
        raise TypeError(f"w is {w.dtype}: fp8 values mean nothing without the checkpoint's scale "
                        f"(weight_scale); dequantize first (w.float() * scale) and quantize that")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"w must not be empty, got shape {tuple(w.shape)}")
    check_group_size(group_size, k)
    act = _resolve_act_dtype(dtype, w.dtype)
    finite = torch.isfinite(w)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise ValueError(f"w contains non-finite values (NaN or inf), e.g. w[{bad[0]}, {bad[1]}] "
                         f"= {w[bad[0], bad[1]].item()}")
    del finite

    wt = WeightType.of(bits, symmetric)
    g = k // group_size
    levels = float((1 << bits) - 1)
    qweight = torch.empty((n, k), dtype=torch.int8 if wt.signed else torch.uint8, device=w.device)
    scales = torch.empty((n, g), dtype=act, device=w.device)
    zeros = None if wt.signed else torch.empty((n, g), dtype=act, device=w.device)

    # float32 (float64 for float64 input) holds w exactly, and its correctly rounded quotient
    # w / s_r is never on the wrong side of a rounding tie (see the module docstring).
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    rows = max(1, _CHUNK_ELEMS // k)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        wc = w[r0:r1].to(work).reshape(r1 - r0, g, group_size)
        if wt.signed:
            s = 2.0 * wc.abs().amax(dim=-1).to(torch.float64) / levels
        else:
            xmin = wc.amin(dim=-1).to(torch.float64).clamp(max=0.0)
            xmax = wc.amax(dim=-1).to(torch.float64).clamp(min=0.0)
            s = (xmax - xmin) / levels
        s = torch.where(s == 0, torch.ones_like(s), s)
        s_r = round_up_to_dtype(s, act)
        if not bool(torch.isfinite(s_r).all()):
            raise _overflow("scales", act, wc.abs().max().item())
        s64 = s_r.to(torch.float64)
        q = torch.round(wc / s_r.to(work).unsqueeze(-1))
        if wt.signed:
            q.clamp_(wt.qmin, wt.qmax)
            offset = q.abs().amax(dim=-1)
        else:
            z = torch.round(-xmin / s64).clamp_(0.0, levels)
            q.add_(z.to(work).unsqueeze(-1)).clamp_(0.0, levels)
            zw = z.to(work)
            offset = torch.maximum(q.amax(dim=-1) - zw, zw - q.amin(dim=-1))  # max |q - z|
            zeros[r0:r1] = z.to(act)
        # |q - z| * s_r is exact in float64; rounding it to act is finite iff every deq is.
        peak = offset.to(torch.float64) * s64
        if not bool(torch.isfinite(peak.to(act)).all()):
            raise _overflow("dequantized weights", act, wc.abs().max().item())
        qweight[r0:r1] = q.reshape(r1 - r0, k).to(qweight.dtype)
        scales[r0:r1] = s_r
    return QuantizedWeight(qweight=qweight, scales=scales, zeros=zeros, bits=bits,
                           group_size=group_size, symmetric=symmetric)


def dequantize_reference(qw: Union[QuantizedWeight, PackedWeight],
                         dtype: Optional[DTypeLike] = None) -> torch.Tensor:
    """Dequantize with plain torch ops, exactly as the kernels do.

    ::

        symmetric:   w = q.to(dtype) * s                       (s expanded along K)
        asymmetric:  w = (q.int16 - z.int16).to(dtype) * s

    ``q - z`` is an exact small integer (exact in bf16 and fp16), so the only rounding is the
    product, rounded to nearest-even in ``dtype`` once. A weight with ``zero_offsets``
    (fractional zero points) adds them in float32 and rounds once more:
    ``w = (float32((q - z).to(dtype) * s) + o).to(dtype)``.

    Parameters
    ----------
    qw : QuantizedWeight or PackedWeight
        The weight; a PackedWeight is unpacked first (:func:`mixgemm.weights.layout.unpack`).
    dtype : torch.dtype or ActType or str, optional
        bf16 or fp16; default the scales' dtype. A different dtype converts the scales
        (rounding them) before the product.

    Returns
    -------
    torch.Tensor
        ``[N, K]`` in ``dtype``, contiguous, on ``qw``'s device.

    Raises
    ------
    TypeError
        ``qw`` is neither a QuantizedWeight nor a PackedWeight.
    ValueError
        Codes outside the weight type's range, or zeros that are not integers in
        ``[0, 2^b-1]``.
    """
    if isinstance(qw, PackedWeight):
        qw = unpack(qw)
    elif not isinstance(qw, QuantizedWeight):
        raise TypeError(f"dequantize_reference expects a QuantizedWeight or PackedWeight, got "
                        f"{type(qw).__name__}")
    act = qw.dtype if dtype is None else _resolve_act_dtype(dtype, qw.dtype)
    wt = qw.weight_type
    q = qw.qweight
    if q.numel() and (int(q.min()) < wt.qmin or int(q.max()) > wt.qmax):
        raise ValueError(f"codes out of range for {wt.value}: [{int(q.min())}, {int(q.max())}] "
                         f"not within [{wt.qmin}, {wt.qmax}]")
    s = qw.scales.to(act).repeat_interleave(qw.group_size, dim=1)
    if wt.signed:
        return q.to(act) * s
    z = qw.zeros
    if z.numel() and not bool(((z == z.round()) & (z >= 0) & (z <= wt.qmax)).all()):
        raise ValueError(f"zeros must be integers in [0, {wt.qmax}]")
    z16 = z.to(torch.int16).repeat_interleave(qw.group_size, dim=1)
    w = (q.to(torch.int16) - z16).to(act) * s
    if qw.zero_offsets is None:
        return w
    # fractional zero points: the float32 offset o = (z - z_float) * s, then one more rounding
    return (w.float() + qw.zero_offsets.repeat_interleave(qw.group_size, dim=1)).to(act)


#: Rows per stripe of a gate/up interleaved weight: half the prepacked atom's 16 rows, so that
#: the thread that accumulates gate row r (r % 16 < 8) also accumulates up row r + 8 (the
#: mma.sync and wgmma accumulator layouts give a thread rows g and g + 8 of its warp's 16-row
#: band): every kernel computes silu(gate) * up in registers. (mixgemm 0.1 used 16-row stripes;
#: QuantLinear re-stripes such state dicts on load.)
GATE_UP_STRIPE = 8


def interleave_gate_up(gate: QuantizedWeight, up: QuantizedWeight) -> QuantizedWeight:
    """One weight for a gated MLP's two input projections, for ``gemm(..., activation="swiglu")``.

    Parameters
    ----------
    gate, up : QuantizedWeight
        ``[I, K]`` each, same bits, group size, symmetry and dtypes; ``I % 8 == 0``.

    Returns
    -------
    QuantizedWeight
        ``[2I, K]`` whose 8-row stripes alternate: rows ``16j .. 16j+7`` are gate rows
        ``8j .. 8j+7`` and rows ``16j+8 .. 16j+15`` are up rows ``8j .. 8j+7`` (scales,
        zeros and zero offsets follow their rows). ``gemm(x, prepack(result), activation="swiglu")`` returns
        ``silu(x @ gate.T) * (x @ up.T)``, ``[..., I]``. Interleave a bias ``[2I]`` the same way
        with :func:`interleave_rows`.
    """
    if not isinstance(gate, QuantizedWeight) or not isinstance(up, QuantizedWeight):
        raise TypeError("gate and up must be QuantizedWeight")
    if (gate.qweight.shape != up.qweight.shape or gate.bits != up.bits or gate.group_size != up.group_size
            or gate.symmetric != up.symmetric or gate.scales.dtype != up.scales.dtype):
        raise ValueError("gate and up must have the same shape, bits, group size, symmetry and dtype")
    if gate.qweight.shape[0] % GATE_UP_STRIPE:
        raise ValueError(f"gate/up rows must be a multiple of {GATE_UP_STRIPE}, got {gate.qweight.shape[0]}")
    zeros = None if gate.zeros is None else interleave_rows(gate.zeros, up.zeros)
    if (gate.zero_offsets is None) != (up.zero_offsets is None):
        raise ValueError("gate and up must both have zero_offsets or neither")
    offsets = None if gate.zero_offsets is None else interleave_rows(gate.zero_offsets, up.zero_offsets)
    return QuantizedWeight(interleave_rows(gate.qweight, up.qweight), interleave_rows(gate.scales, up.scales),
                           zeros, gate.bits, gate.group_size, gate.symmetric, offsets)


def interleave_rows(a: torch.Tensor, b: torch.Tensor, stripe: int = GATE_UP_STRIPE) -> torch.Tensor:
    """Rows of ``a`` and ``b`` (``[I, ...]`` each) alternating in stripes of ``stripe`` rows:
    ``[2I, ...]``."""
    if a.shape != b.shape or a.shape[0] % stripe:
        raise ValueError(f"need equal shapes with a multiple of {stripe} rows, got {list(a.shape)}, {list(b.shape)}")
    rest = a.shape[1:]
    return torch.stack((a.reshape(-1, stripe, *rest), b.reshape(-1, stripe, *rest)), dim=1).reshape(-1, *rest)


def deinterleave_rows(t: torch.Tensor, stripe: int = GATE_UP_STRIPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`interleave_rows`: ``[2I, ...]`` -> (``a``, ``b``), ``[I, ...]`` each."""
    if t.shape[0] % (2 * stripe):
        raise ValueError(f"need a multiple of {2 * stripe} rows, got {list(t.shape)}")
    pairs = t.reshape(-1, 2, stripe, *t.shape[1:])
    return pairs[:, 0].reshape(-1, *t.shape[1:]), pairs[:, 1].reshape(-1, *t.shape[1:])
