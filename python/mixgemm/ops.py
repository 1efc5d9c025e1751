"""The GEMM and dequantize calls: validation, kernel choice, launch.

Every check here runs before anything is launched: a bad input raises a Python error naming the
problem, never a CUDA fault or a silently wrong result.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:  # codegen and specs are imported lazily: `import mixgemm` stays cheap
    from .codegen import DecodeConfig, TileConfig
    from .specs import DecodeSpec, GemmSpec, Raster

from . import plans
from .types import LAYOUT_VERSION, SUPPORTED_ARCHS, PackedWeight, WeightType

#: 16 < M <= 32 on a layer of at most this many weights (N x K) goes to the 32-token decode
#: kernel ("dec32") instead of "mid". Measured on H100 at M = 32 (sweep-decode-m32.json against
#: bench-m32.json, benchmarks/NOTES.md section 6c): dec32 at its best split factor took 0.75-0.84x
#: the time of "mid" on 4096x4096 and 6144x4096 (u4, u2, s8), but 1.03-1.25x on every layer of
#: 58M weights or more (4096x14336 up), where the GEMM's wide tiles stream better.
_DEC32_MAX_WEIGHTS = 1 << 25
#: 32 < M <= 128 (and 16 < M <= 32 above the dec32 bound): the 256-row stream-K tiles ("tall",
#: 256x64, and "tall128", 256x128) on large layers, "mid" (128x64) on small ones. Measured on H200
#: (NOTES 8a, sweep-gemm256*.json, u4 and u2, 9 layers): a 256-row weight tile converts each weight
#: once per 64 (128) tokens for twice the tensor-core work of a 128-row one.
#:   M <= 64: "tall" 1.17-1.35x faster than "mid" on every layer above 2**26 weights (10240x8192,
#:            28672x4096, 8192x28672, 57344x8192); "mid" up to 1.2x faster at or below it
#:            (4096x4096, 6144x4096, 4096x14336, 8192x8192).
#:   M <= 128: "tall128" 1.35-1.8x faster than "mid" on 8192x8192 and above; "tall" on 4096x14336
#:            (58.7M weights: 52 us against 59 for "mid" and 64 for "tall128"); "mid" on 2**25
#:            weights or fewer.
_MID_M64_MAX_WEIGHTS = 1 << 26
_MID_M128_MAX_WEIGHTS = 1 << 25
_TALL_M128_MAX_WEIGHTS = 60_000_000   # between 4096x14336 (58.7M) and 8192x8192 (67.1M)
#: Above M = 128 the 128x256 stream-K tile ("xl"): measured on H100 (NOTES 7b,
#: exp-gemm-sched.json) 1.04-1.6x faster than the persistent 128x128 and 128x256 tiles at
#: M = 256 on layers that make few 128x256 tiles (stream-K spreads them over every SM), within 4.5%
#: of the best 128x256 variant (persistent or stream-K, any raster / swizzle) at every M from 128 to
#: 16384, and 8% slower than 128x128 only on 6144x4096 at M = 256. The 256-row tiles lose there
#: (NOTES 8a: up to 1.7x slower at M = 192-256).
#: Except up to M = 256 on small layers: the persistent 128x128 tile ("large") was 3-18% faster than
#: "xl" at M = 256 on the 6 preset layers of at most 36.7M weights (3584x3584 .. 7168x5120: e.g.
#: 4608x3584 33.9 against 40.8 us, 6144x4096 37.5 against 42.8; H100, NOTES 9g,
#: s9-tiles-small.json), and slower from 4096x14336 (58.7M weights: 107.9 against 67.8) up.
_LARGE_M256_MAX_WEIGHTS = 48_000_000   # between 7168x5120 (36.7M) and 4096x14336 (58.7M)
#: Above M = 512 the same 128x256 tile, persistent, in 2x1 clusters that multicast the activation
#: tile ("xlp"): measured on H100 (NOTES 30c, s24-xlp-boundary-*.json, s24-xl-*.json) 3-12% faster
#: than "xl" at every M from 640 to 2048 on 3584x3584, 4096x4096, 6144x4096 and 4096x14336, 2-5%
#: at M = 4096 (also 28672x4096, u4 and s8); at M = 384-512 it lost on 4096x4096 (+5%) and
#: 4096x14336 (+32-43%: 64 tiles of 224 k-tiles, half the SMs idle), where stream-K spreads the
#: k-tiles. Above M = 512 a layer of N >= 3584 rows has at least 84 tiles of 128x256.
#: Also from M = 257 on layers of at least 16384 rows (>= 256 tiles): 2-26% faster than "xl" at
#: M = 384 and 512 on 28672x4096, 37888x3584, 55296x5120 and 57344x8192 (s24-xlp-large-n-*.json;
#: at M = 384 "xl" runs 2 token tiles, the second half empty, 21-26% slower on the first two);
#: on 10240x8192 (160 tiles) it lost 12-26%, on 8192x28672 it won 2%. At M = 192-256 the same
#: layers were mixed (28672x4096 -7%, 57344x8192 +5%), so "xl" stays there.
_XLP_M512_MIN_ROWS = 16384
#: Kernel config labels, first match wins: (upper bound of M, upper bound of N x K or None, label,
#: lower bound of N or None); see select_tile.
_HEURISTIC = ((8, None, "dec8", None), (16, None, "dec16", None), (32, _DEC32_MAX_WEIGHTS, "dec32", None),
              (64, _MID_M64_MAX_WEIGHTS, "mid", None), (64, None, "tall", None),
              (128, _MID_M128_MAX_WEIGHTS, "mid", None), (128, _TALL_M128_MAX_WEIGHTS, "tall", None),
              (128, None, "tall128", None),
              (256, _LARGE_M256_MAX_WEIGHTS, "large", None), (256, None, "xl", None),
              (512, None, "xlp", _XLP_M512_MIN_ROWS), (512, None, "xl", None), (None, None, "xlp", None))


def select_tile(m: int, n: int, k: int) -> "TileConfig | DecodeConfig":
    """The heuristic: which kernel config runs a problem of ``m`` tokens, ``n`` output features
    and ``k`` input features.

    * ``m <= 8, 16``     -> "dec8" / "dec16": the decode kernel with that token tile (one warp
      per 16-row weight band, weights streamed by bulk copies, split-K from the measured table
      of :mod:`mixgemm.tuning` or the kernel's planner, so that every SM streams weights);
    * ``m <= 32`` and ``n * k <= 2**25`` -> "dec32": the decode kernel with a 32-token tile (on
      small layers; measured slower than "mid" on larger ones);
    * ``m <= 64``        -> "mid": sm90 GEMM, 128x64x64 tiles, stream-K, on layers of at most
      2**26 weights; "tall" (256x64x64, stream-K) on larger ones;
    * ``m <= 128``       -> "mid" on layers of at most 2**25 weights, "tall" below 60M weights,
      "tall128" (256x128x64, stream-K) above;
    * ``m <= 256``       -> "large" (128x128x64, persistent) on layers of at most 48M weights,
      else "xl": sm90 GEMM, 128x256x64 tiles, stream-K, walked along the weight rows with
      swizzle 2;
    * ``m <= 512``       -> "xlp" on layers of at least 16384 rows: the same tile, persistent,
      in clusters of two weight tiles that share (multicast) each activation tile; else "xl";
    * else               -> "xlp".

    ``k`` matters only through the layer's size ``n * k``, ``n`` also through its own bound.
    """
    from .codegen import TILE_CONFIGS

    label = next(lab for m_max, size_max, lab, rows_min in _HEURISTIC
                 if (m_max is None or m <= m_max) and (size_max is None or n * k <= size_max)
                 and (rows_min is None or n >= rows_min))
    return next(tc for tc in TILE_CONFIGS if tc.label == label)


def tile_labels(m: int) -> set:
    """Every config label :func:`select_tile` may choose for ``m`` tokens on some layer: the
    choice depends on the layer through its size ``n * k`` and its rows ``n``, so the layers at
    and just past each bound of the table (as 1-column and as square-ish layers) cover every case."""
    sizes = {1} | {b + d for _, b, _, _ in _HEURISTIC if b is not None for d in (0, 1)}
    rows = {r + d for _, _, _, r in _HEURISTIC if r is not None for d in (-1, 0)}
    layers = {(s, 1) for s in sizes} | {(r, max(1, s // r)) for r in rows for s in sizes}
    return {select_tile(m, n, k).label for n, k in layers}


def _token_buckets() -> tuple[int, ...]:
    """M -> the index of the heuristic's token-count bucket, for M up to one past its largest
    bound (the last entry stands for every larger M). Every M of a bucket gets the same kernel
    config from :func:`select_tile` on any layer: the table's rows match on ``m <= bound``."""
    bounds = sorted({m_max for m_max, _, _, _ in _HEURISTIC if m_max is not None})
    return tuple(bisect.bisect_left(bounds, m) for m in range(bounds[-1] + 2))


#: see _token_buckets (the launch plans are cached per bucket)
TOKEN_BUCKETS = _token_buckets()


def token_bucket(m: int) -> int:
    """The heuristic's token-count bucket of ``m`` (0 for M <= 8, 1 for M <= 16, ...): the plan
    cache's M key (:mod:`mixgemm.plans`)."""
    return TOKEN_BUCKETS[m] if m < len(TOKEN_BUCKETS) else TOKEN_BUCKETS[-1]


def select_spec(m: int, w: PackedWeight, activation: Optional[str] = None) -> "GemmSpec | DecodeSpec":
    """The kernel :func:`gemm` runs. The decode kernels fix their activation at compile time (so
    the spec names it); the sm90 GEMM kernels take none / silu / gelu per call, and swiglu has
    GEMM kernels of its own (the gated epilogue)."""
    from .specs import Activation

    tc = select_tile(m, w.n, w.k)
    return tc.spec(w.act_type, w.weight_type, Activation(activation or "none"))


#: gemm's ``activation`` values
ACTIVATIONS = ("silu", "gelu", "swiglu")


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _gpu_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def _tuned_splits(spec, w: PackedWeight, device: torch.device) -> int:
    """The measured split-K factor of a decode launch (mixgemm.tuning), else 0: the planner's."""
    from . import tuning

    if spec.max_tokens is None:
        return 0
    return tuning.decode_splits(_gpu_name(device.index), w.n, w.k, spec.tokens, spec.weight.bits)


def _device_ok(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"mixgemm kernels run on CUDA tensors, got a tensor on {device}"
    if device.index is None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        device = torch.device("cuda", torch.cuda.current_device())
    return _cuda_device_problem(device.index)


@functools.lru_cache(maxsize=None)
def _cuda_device_problem(index: int) -> Optional[str]:
    """:func:`_device_ok` of CUDA device ``index``, once per process (torch's capability query
    took ~20 us of every eager launch's host time on the GPU machine, NOTES 28e)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cap = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        return f"mixgemm's kernels need an sm_90 (Hopper) GPU; cuda:{index} is sm_{cap[0]}{cap[1]}"
    return None


def _weight_problem(w) -> Optional[str]:
    if not isinstance(w, PackedWeight):
        return f"w must be a mixgemm.PackedWeight (see mixgemm.prepack), got {type(w).__name__}"
    if w.arch not in SUPPORTED_ARCHS:
        return f"w is packed for {w.arch}, this mixgemm runs {SUPPORTED_ARCHS}"
    if w.layout_version != LAYOUT_VERSION:
        return f"w has layout version {w.layout_version}, this mixgemm reads {LAYOUT_VERSION}"
    for name, t in (("qdata", w.qdata), ("scales", w.scales), ("zeros", w.zeros)):
        if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
            return f"w.{name} must be contiguous and 16-byte aligned"
    if w.n % 8:
        return f"N={w.n} must be a multiple of 8"
    return None


def supports(x_shape: Sequence[int], w: PackedWeight, dtype: Optional[torch.dtype] = None) -> tuple[bool, str]:
    """Whether ``gemm(x, w)`` can run for an ``x`` of shape ``x_shape``; the reason if not.

    Parameters
    ----------
    x_shape : sequence of int
        Shape of the activations ``[..., K]``.
    w : PackedWeight
        The prepacked weight.
    dtype : torch.dtype, optional
        dtype of x; defaults to w's activation dtype.

    Returns
    -------
    (bool, str)
        ``(True, "")`` or ``(False, reason)``.
    """
    why = _weight_problem(w)
    if why:
        return False, why
    if len(x_shape) < 1:
        return False, "x must have at least one dimension [..., K]"
    if x_shape[-1] != w.k:
        return False, f"x has K={x_shape[-1]} but w has K={w.k}"
    if dtype is not None and dtype != w.dtype:
        return False, f"x is {dtype} but w was packed for {w.dtype}"
    m = math.prod(x_shape[:-1])
    if m >= 2 ** 31:
        return False, f"M={m} tokens is too many for one call"
    why = _device_ok(w.device)
    if why:
        return False, why
    return True, ""


def _check_gemm_inputs(x: torch.Tensor, w: PackedWeight, bias, out, activation: Optional[str] = None) -> None:
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    if activation == "swiglu" and w.n % 16:
        raise ValueError(f"activation='swiglu' needs a gate/up interleaved weight with N % 16 == 0, got N={w.n}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, PackedWeight):
        raise TypeError(f"w must be a mixgemm.PackedWeight (see mixgemm.prepack), got {type(w).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bfloat16 or float16, got {x.dtype}")
    if x.dtype != w.dtype:
        raise TypeError(f"x is {x.dtype} but w was packed for {w.dtype}")
    ok, why = supports(tuple(x.shape), w, x.dtype)
    if not ok:
        raise ValueError(why)
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but w is on {w.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (w.n,) or bias.dtype != x.dtype:
            raise ValueError(f"bias must be a {x.dtype} tensor of shape [{w.n}]")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
        if not bias.is_contiguous():
            raise ValueError("bias must be contiguous")
    if out is not None:
        want = (*x.shape[:-1], w.n // 2 if activation == "swiglu" else w.n)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != x.dtype:
            raise ValueError(f"out must be a {x.dtype} tensor of shape {list(want)}")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x is on {x.device}")
        if not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError("out must be contiguous and 16-byte aligned")


def gemm(x: torch.Tensor, w: PackedWeight, bias: Optional[torch.Tensor] = None,
         out: Optional[torch.Tensor] = None, activation: Optional[str] = None) -> torch.Tensor:
    """``y = act(x @ dequant(w).T (+ bias))`` with the dequantization fused into the GEMM.

    Parameters
    ----------
    x : torch.Tensor
        Activations, bfloat16 or float16, shape ``[..., K]``, on an sm_90 CUDA device. A
        non-contiguous or non-16-byte-aligned x is copied first (``x.contiguous()``).
    w : PackedWeight
        Weight ``[N, K]`` prepacked by :func:`mixgemm.prepack` for the same dtype and device.
        ``dequant(w)`` is ``q*s`` (symmetric) or ``(q - z)*s`` (asymmetric), group-wise along K;
        a weight with ``zero_offsets`` (fractional zero points, HQQ) adds them after the
        kernel, ``y += xsum_per_group @ zero_offsets`` in float32, and then applies the
        activation in torch.
    bias : torch.Tensor, optional
        Shape ``[N]``, x's dtype.
    out : torch.Tensor, optional
        Preallocated output ``[..., N]`` (``[..., N/2]`` for swiglu), x's dtype, contiguous and
        16-byte aligned.
    activation : {None, "silu", "gelu", "swiglu"}, optional
        Applied in float32 to ``acc + bias`` before the one rounding to x's dtype. ``"swiglu"``
        takes a weight built by :func:`mixgemm.quantize.interleave_gate_up` (gate and up 8-row
        stripes alternating, ``N = 2I``) and returns ``silu(gate) * up``, ``[..., I]`` (a bias
        must be interleaved the same way). Every activation is fused into every kernel's
        epilogue: one launch, at any M (swiglu by a GEMM kernel with the gated epilogue).

    Returns
    -------
    torch.Tensor
        ``[..., N]`` (``[..., N/2]`` for swiglu) in x's dtype, contiguous.

    Notes
    -----
    The kernel is chosen by :func:`select_tile` from the number of tokens ``M = prod(x.shape[:-1])``;
    a decode kernel's split-K factor comes from the measured table of :mod:`mixgemm.tuning` for
    the layer shapes it lists, else from the kernel's own planner.
    Accumulation is in float32; the result is rounded once to x's dtype.

    The first call for a weight, token-count bucket (:func:`token_bucket`), activation, dtype,
    device and graph-capture state validates everything and makes a launch plan
    (:mod:`mixgemm.plans`); later calls check themselves against it with a few attribute reads
    and launch it (one C call), and anything unusual takes the full path again.

    The decode kernels (M <= 16) use programmatic dependent launch: they may start while the
    kernels queued just before them finish, and they request the weight's tensors (``qdata``,
    ``scales``, ``zeros``) before waiting for those kernels; only x, the bias and the output wait.
    So write a packed weight's tensors in place (``copy_``) at load time, not in the last two
    launches before a call that reads them on the same stream.
    """
    if type(w) is PackedWeight:
        y = plans.run(x, w.qdata, w.scales, w.zeros, w.zero_offsets, bias, out, w.weight_type, w.group_size,
                      w.n, w.k, activation, TOKEN_BUCKETS)
        if y is not None:
            return y
    return _gemm_planned(x, w, bias, out, activation)


def gemm_tensors(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 zero_offsets: Optional[torch.Tensor], bias: Optional[torch.Tensor], weight_type: WeightType,
                 group_size: int, n: int, k: int, activation: Optional[str] = None) -> torch.Tensor:
    """:func:`gemm` of a weight given as its tensors and fields (the custom op and
    :class:`mixgemm.nn.QuantLinear`): a :class:`PackedWeight` is built (and checked) only when the
    call misses its plan."""
    y = plans.run(x, qdata, scales, zeros, zero_offsets, bias, None, weight_type, group_size, n, k, activation,
                  TOKEN_BUCKETS)
    if y is not None:
        return y
    return gemm_tensors_full(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k, activation)


def gemm_tensors_full(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k,
                      activation=None) -> torch.Tensor:
    """:func:`gemm_tensors` without trying the cached plan first (its caller did)."""
    w = PackedWeight(qdata, scales, zeros, weight_type, group_size, n, k, zero_offsets=zero_offsets)
    return _gemm_planned(x, w, bias, None, activation)


def _gemm_planned(x: torch.Tensor, w: PackedWeight, bias, out, activation: Optional[str]) -> torch.Tensor:
    """The full path of :func:`gemm`: every check, the kernel choice, and a launch plan that the
    next calls reuse."""
    _check_gemm_inputs(x, w, bias, out, activation)
    lead = x.shape[:-1]
    m = math.prod(lead)
    # zero offsets (fractional zero points) are added after the kernel, so the activation too
    fused = w.zero_offsets is None
    spec = select_spec(m, w, activation if fused else None)
    splits = _tuned_splits(spec, w, x.device)
    if activation is not None and not fused:
        return _gemm_then_activate(x, w, spec, bias, out, activation, splits)
    if m == 0:
        n_out = w.n // 2 if activation == "swiglu" else w.n
        return out if out is not None else torch.empty((*lead, n_out), dtype=x.dtype, device=x.device)
    from . import runtime
    from .codegen import launch_order

    capturing = plans.capturing()
    key = plans.plan_key(w.qdata, token_bucket(m), activation, x.dtype, x.device)
    plan = plans.PLANS.get(key, capturing)
    if plan is None or not plan.made_for(w, spec, splits):   # new, or the weight's tensors changed
        raster, swizzle = launch_order(spec)
        kernel = runtime.KERNELS.get(spec, x.device)   # the activation fused in the kernel
        plan = plans.make_plan(spec, kernel, w, dtype=x.dtype, device=x.device, activation=activation,
                               splits=splits, raster=raster, swizzle=swizzle, sm_count=_sm_count(x.device.index),
                               capturing=capturing, key=key)
        plans.PLANS.put(plan)
    return plans.execute(plan, x, m, (*lead, plan.n_out), bias, out, w.zero_offsets)


def _gemm_then_activate(x, w, spec, bias, out, activation, splits) -> torch.Tensor:
    """The kernel without an activation, then ``activation`` in torch (:func:`_activate`), into
    ``out`` if given: the unfused path of :func:`gemm` and :func:`gemm_with_spec`."""
    r = _activate(gemm_with_spec(x, w, spec, bias=bias, splits=splits, _checked=True), activation)
    if out is None:
        return r
    out.copy_(r)
    return out


def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """The epilogue functions in torch, in float32 with one rounding (for the unfused paths);
    swiglu pairs the stripes of a gate/up interleaved weight."""
    from .quantize import GATE_UP_STRIPE as S

    if activation is None:
        return y
    if activation == "swiglu":
        pairs = y.view(*y.shape[:-1], y.shape[-1] // (2 * S), 2, S)
        r = (torch.nn.functional.silu(pairs[..., 0, :].float()) * pairs[..., 1, :].float()).to(y.dtype)
        return r.reshape(*y.shape[:-1], y.shape[-1] // 2)
    fn = torch.nn.functional.silu if activation == "silu" else torch.nn.functional.gelu
    return fn(y.float()).to(y.dtype)


def gemm_with_spec(x: torch.Tensor, w: PackedWeight, spec: "GemmSpec | DecodeSpec", bias: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None, *, activation: Optional[str] = None, splits: int = 0,
                   raster: "Raster | None" = None, swizzle: Optional[int] = None,
                   _checked: bool = False) -> torch.Tensor:
    """:func:`gemm` with an explicit kernel (tests and benchmarks use it to run every kernel).

    ``activation``: a decode spec, and a GEMM spec with the gated (swiglu) epilogue, fix their
    own (None means the spec's; another value is an error); the other GEMM specs apply none /
    silu / gelu per call. ``splits``: 0 lets the kernel choose; ``>= 1`` forces a decode
    kernel's split-K factor, ``> 1`` a stream-K GEMM's. ``raster`` (a :class:`specs.Raster`)
    and ``swizzle`` (one of ``specs.SWIZZLES``) override a GEMM kernel's tile order (default:
    its tile config's, :func:`codegen.launch_order`); the decode kernels ignore them."""
    from . import runtime
    from .codegen import launch_order
    from .specs import GEMM_KINDS, SWIZZLES, Activation, Epilogue, Raster

    if not isinstance(spec, GEMM_KINDS):
        raise TypeError(f"spec must be a GemmSpec or DecodeSpec, got {type(spec).__name__}")
    own_raster, own_swizzle = launch_order(spec)
    raster = own_raster if raster is None else raster
    swizzle = own_swizzle if swizzle is None else swizzle
    if not isinstance(raster, Raster):
        raise TypeError(f"raster must be a mixgemm.specs.Raster, got {raster!r}")
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES}, got {swizzle!r}")
    fixed = spec.fixed_activation   # None: chosen per call
    if fixed is not None:
        own = None if fixed is Activation.NONE else fixed.value
        if activation is not None and activation != own:
            raise ValueError(f"kernel {spec.name} fuses activation {fixed.value!r}, not {activation!r}")
        activation = own
    elif activation == "swiglu":
        raise ValueError(f"kernel {spec.name} does not fuse swiglu; the same tile with the gated "
                         f"epilogue does ({dataclasses.replace(spec, epilogue=Epilogue.SWIGLU).name})")
    kernel_activation = activation
    if w.zero_offsets is not None and activation is not None:
        if fixed is not None:
            raise ValueError(f"kernel {spec.name} fuses {activation!r}, but w's zero offsets must be "
                             f"added before it: use the spec without activation, or mixgemm.gemm")
        kernel_activation = None     # applied in torch after the offsets
    if not _checked:
        _check_gemm_inputs(x, w, bias, out, activation)
    if spec.act is not w.act_type or spec.weight is not w.weight_type:
        raise ValueError(f"kernel {spec.name} is for {spec.act.value} x {spec.weight.value}, "
                         f"w is {w.act_type.value} x {w.weight_type.value}")
    lead = x.shape[:-1]
    m = math.prod(lead)
    if spec.max_tokens is not None and m > spec.max_tokens:
        raise ValueError(f"kernel {spec.name} takes at most {spec.max_tokens} tokens, x has M={m}")
    n_out = w.n // 2 if kernel_activation == "swiglu" else w.n
    if kernel_activation != activation:       # zero offsets, then the activation in torch
        return _gemm_then_activate(x, w, spec, bias, out, activation, splits)
    y = out if out is not None else torch.empty((*lead, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # a launch plan like gemm's, cached under the caller's choice of kernel and launch order in
    # the place of the token bucket; the helper checks the problem before anything launches
    splits = max(0, int(splits))
    capturing = plans.capturing()
    key = plans.plan_key(w.qdata, ("spec", spec, splits, raster, swizzle), activation, x.dtype, x.device)
    plan = plans.PLANS.get(key, capturing)
    if plan is None or not plan.made_for(w, spec, splits):
        kernel = runtime.KERNELS.get(spec, x.device)
        plan = plans.make_plan(spec, kernel, w, dtype=x.dtype, device=x.device, activation=activation,
                               splits=splits, raster=raster, swizzle=swizzle, sm_count=_sm_count(x.device.index),
                               capturing=capturing, key=key)
        plans.PLANS.put(plan)
    return plans.execute(plan, x, m, (*lead, n_out), bias, y, w.zero_offsets)


def dequantize(w: PackedWeight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Dequantize a prepacked weight on the GPU with the kernels' own converters.

    Parameters
    ----------
    w : PackedWeight
        On an sm_90 CUDA device.
    dtype : torch.dtype, optional
        Must equal w's activation dtype (the converters produce it directly, no float32 round
        trip); defaults to it.

    Returns
    -------
    torch.Tensor
        ``[N, K]`` in w's dtype: exactly :func:`mixgemm.dequantize_reference` of ``w``.
    """
    from . import runtime
    from .specs import DequantSpec

    why = _weight_problem(w) or _device_ok(w.device)
    if why:
        raise ValueError(why)
    if dtype is not None and dtype != w.dtype:
        raise TypeError(f"w dequantizes to {w.dtype} (its scales' dtype), not {dtype}")
    out = torch.empty((w.n, w.k), dtype=w.dtype, device=w.device)
    kernel = runtime.KERNELS.get(DequantSpec(w.act_type, w.weight_type), w.device)
    runtime.launch_dequant(kernel, w.qdata.data_ptr(), w.scales.data_ptr(),
                           0 if w.zeros is None else w.zeros.data_ptr(), out.data_ptr(),
                           w.n, w.k, w.group_size)
    if w.zero_offsets is not None:   # as dequantize_reference: float32 sum, one more rounding
        out = (out.float() + w.zero_offsets.t().repeat_interleave(w.group_size, dim=1)).to(w.dtype)
    return out


__all__ = ["gemm", "gemm_with_spec", "dequantize", "supports", "select_tile", "select_spec"]
