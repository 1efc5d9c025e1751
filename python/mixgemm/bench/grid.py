"""The grid (``mixgemm bench``): every implementation of :mod:`.peers` on every (N, K) layer
shape and token count M, each point checked against a float64 reference, then timed
(:func:`.timing.time_cuda`); and the analysis that derives every reported number from the raw
measurements (bytes moved, GB/s, TFLOP/s, speedups over cuBLAS and the best peer, FAIL flags).

Everything but :func:`run_benchmark` is a pure function of its inputs, tested on the CPU.
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..dtypes import ActType
from ..ops.fp8 import dequantize_fp8, quantize_fp8_reference
from .peers import (BASELINE, E4M3, EXACT, FP8_SUFFIX, SCALED_MM, Impl, ImplUnavailable, MixgemmImpl, ScaledMmImpl,
                    activations_of, base_name, is_peer, kernel_is_cached, mixgemm_available, prebuild_kernels)
from .timing import FLUSH_L2_MULTIPLE, Clock, CudaEventClock, TimingStats, effective_gbps, flush_size, tflops, time_cuda

# ------------------------------------------------------------------------------------------
# Defaults (issue #4)
# ------------------------------------------------------------------------------------------

#: LLaMA-3 8B and 70B linear layers, (N, K) = (out_features, in_features).
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = (
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),      # 8B: qkv, o, gate+up, down
    (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672),     # 70B: qkv, o, gate+up, down
)
#: Token counts M.
DEFAULT_MS: tuple[int, ...] = (1, 4, 16, 32, 64, 128, 256, 1024, 4096, 16384)
#: The fewest timed runs per point, unless ``--quick``.
MIN_ITERS = 100
#: Timed runs per point with ``--quick`` (a smoke run, not a measurement).
QUICK_ITERS = 10
DEFAULT_WARMUP = 10
QUICK_WARMUP = 3
DEFAULT_GROUP_SIZE = 128
#: A mixgemm or cuBLAS point FAILs when ``||y - ref|| / ||ref||`` against the implementation's
#: own dequantized weight exceeds this (fp32 accumulation and a bf16 output give ~1e-3).
DEFAULT_MAX_ERROR = 1e-2
#: The same bar for the peers, looser: gemlite's split-K GEMV (M <= 4) adds partial sums with
#: bf16 atomics and was seen 1.0e-2 (K=4096) to 3.5e-2 (K=28672) off its own weight on an
#: H200, growing like sqrt(K); a wrong kernel (layout, nibble order, zero convention) is off
#: by >= 0.3.
DEFAULT_PEER_MAX_ERROR = 1e-1
#: The float32 scales ``_scaled_mm`` and the e4m3 quantizer keep: bytes per row of the weight
#: (scaled_mm) and per token (every e4m3 row).
SCALE_BYTES = 4
#: Rows of the output checked against the float64 reference (all rows when M is at most this).
DEFAULT_CHECK_ROWS = 1024
DEFAULT_SEED = 0
#: Standard deviation of the random float weight (about that of a trained LLM layer).
WEIGHT_STD = 0.02
#: Bytes per activation / output element (bf16 and fp16).
ACT_BYTES = 2
#: Point status values.
OK, FAIL, ERROR, UNAVAILABLE = "ok", "FAIL", "error", "n/a"


# ------------------------------------------------------------------------------------------
# Byte counting and correctness helpers (pure)
# ------------------------------------------------------------------------------------------
def expected_weight_bytes(impl: str, n: int, k: int, group_size: int) -> int:
    """Bytes of weight data (codes + scales + zeros) an implementation reads, by formula.

    * ``cublas``: the dense weight, ``2*N*K``.
    * ``torch_int4``: ``N*K/2`` packed codes + ``[K/g, N, 2]`` 16-bit scales-and-zeros.
    * ``gemlite-uB``: ``N*K*B/8`` packed codes + 16-bit scales and zeros ``[K/g, N]`` each.
    * ``mixgemm-<wt>`` (any ``@config``) and ``mixgemm-<wt>-fp8`` (the same packed weight): ``N*K*B/8``
      codes + 16-bit scales ``[K/g, N]``, + as many zeros for the asymmetric (``u``) types:
      :attr:`mixgemm.PackedWeight.nbytes`.
    * ``scaled_mm``: one e4m3 byte per weight, ``N*K``, + a float32 scale per row, ``4*N``.

    The harness reports the bytes of the tensors each implementation actually holds; this
    formula documents (and the tests check) what those are.
    """
    groups = k // group_size
    meta = groups * n * ACT_BYTES
    base = base_name(impl)
    if base == BASELINE:
        return ACT_BYTES * n * k
    if base == "torch_int4":
        return n * k // 2 + 2 * meta
    if base == SCALED_MM:
        return n * k + SCALE_BYTES * n
    m = re.fullmatch(r"(gemlite|mixgemm)-([su])([248])(" + re.escape(FP8_SUFFIX) + ")?", base)
    if not m:
        raise ValueError(f"unknown implementation {impl!r}")
    family, sign, bits = m[1], m[2], int(m[3])
    if family == "gemlite" and (sign == "s" or m[4]):
        raise ValueError(f"unknown implementation {impl!r}")
    return n * k * bits // 8 + meta * (2 if sign == "u" else 1)


def traffic_bytes(m: int, n: int, k: int, weight_bytes: int, act_bytes: int = ACT_BYTES, e4m3: bool = False) -> int:
    """Bytes a GEMM must move at least: the weight (with its scales and zeros), the
    activations ``[M, K]`` and the output ``[M, N]``; with ``e4m3`` (a row that quantizes x in the
    call: ``mixgemm-<wt>-fp8``, ``scaled_mm``) also the e4m3 codes ``[M, K]`` and float32 scales
    ``[M]`` that its quantizer writes and its GEMM reads back (twice ``M*K + 4*M``)."""
    codes = 2 * (m * k + SCALE_BYTES * m) if e4m3 else 0
    return weight_bytes + act_bytes * m * k + codes + act_bytes * m * n


def check_rows(m: int, limit: int) -> list[int]:
    """Rows of an ``[M, N]`` output compared with the float64 reference.

    All rows when ``M <= limit``. Else ``limit`` rows spread over M, one in each stretch of
    ``M/limit`` rows at an offset that cycles through the stretch (``7*i mod stride``), plus
    the last row, so that every position inside a tile of 16..128 rows gets checked somewhere.
    """
    if m <= limit:
        return list(range(m))
    stride = m // limit
    rows = {min(m - 1, i * stride + (7 * i) % stride) for i in range(limit)}
    rows.add(m - 1)
    return sorted(rows)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``||y - ref|| / ||ref||`` (Frobenius), computed in float64. NaN when ``y`` has NaNs."""
    ref = ref.double()
    return float((y.double() - ref).norm() / ref.norm())


def reference_matmul(x: torch.Tensor, w: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """``x.double() @ w.double().T`` computed in chunks of ``chunk`` rows of ``w`` (bounds the
    float64 copy of the weight)."""
    xd = x.double()
    out = torch.empty((xd.shape[0], w.shape[0]), dtype=torch.float64, device=x.device)
    for j in range(0, w.shape[0], chunk):
        out[:, j:j + chunk] = xd @ w[j:j + chunk].double().t()
    return out


def e4m3_activations(x: torch.Tensor) -> torch.Tensor:
    """The activations an e4m3 row multiplies, in float64 (exact): each token of ``x [M, K]``
    rounded to e4m3 with its own scale (:func:`mixgemm.ops.quantize_fp8_reference`, the
    quantizer's definition, bit for bit its kernel's), times that scale, in the natural column
    order (:func:`mixgemm.ops.dequantize_fp8`)."""
    return dequantize_fp8(*quantize_fp8_reference(x), dtype=torch.float64)


def reference_product(x: torch.Tensor, w: torch.Tensor, activations: str = EXACT,
                      col_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float64 reference of one implementation: ``x' @ w^T``, each column ``j`` times
    ``col_scale[j]`` when given (scaled_mm's weight scales), x' being ``x`` (:data:`.peers.EXACT`)
    or its e4m3 rounding per token (:data:`.peers.E4M3`, :func:`e4m3_activations`)."""
    xd = e4m3_activations(x) if activations == E4M3 else x
    out = reference_matmul(xd, w)
    return out if col_scale is None else out.mul_(col_scale.double())


def fp8_error_bar(k: int, dtype: str = "bf16") -> float:
    """The bar on ``err(own)`` of an e4m3 row (``mixgemm-<wt>-fp8``, ``scaled_mm``): the e4m3 GEMM
    tests' bound (tests/ops/test_gpu_fp8.py), ``4 u + 64 sqrt(K) 2^-24 + 2^-12`` with ``u`` the
    output's rounding (2^-9 for bf16, 2^-12 for fp16). Against the reference on the same
    e4m3-rounded activations and the implementation's own weight, the products are exact (both
    operands e4m3 values, the scales applied in float32), so what is left is the bf16 GEMMs'
    bound (four output roundings, the float32 accumulation over K) plus 2^-12 for the FP8 tensor
    cores' accumulation with fewer bits inside a k-tile. About 8.3e-3 for bf16 at K = 4096."""
    out_round = 2.0 ** -9 if dtype == "bf16" else 2.0 ** -12
    return 4 * out_round + 64 * math.sqrt(k) * 2.0 ** -24 + 2.0 ** -12


# ------------------------------------------------------------------------------------------
# Measurements and their analysis (pure)
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Measurement:
    """What was measured for one (implementation, N, K, M) point.

    ``timing`` is None when the point did not run: then ``error`` says why and
    ``unavailable`` tells an unsupported configuration from a failure.
    """

    impl: str
    n: int
    k: int
    m: int
    weight_bytes: Optional[int] = None
    timing: Optional[TimingStats] = None
    err_impl: Optional[float] = None
    err_float: Optional[float] = None
    output_finite: bool = True
    error: Optional[str] = None
    unavailable: bool = False


@dataclasses.dataclass(frozen=True)
class PointResult:
    """One row of the report: a :class:`Measurement` with everything derived from it.

    Attributes
    ----------
    status : str
        ``"ok"``; ``"FAIL"`` (wrong or non-finite result: its speedups are not reported);
        ``"error"`` (it raised); ``"n/a"`` (unsupported here).
    note : str
        Why, for any status but ok.
    time_us : float or None
        Median time of one run.
    bytes_moved : int or None
        Weight bytes (packed codes + scales + zeros; ``2*N*K`` for cuBLAS) + activations
        ``2*M*K`` + output ``2*M*N``.
    gbps : float or None
        ``bytes_moved / time``, GB/s; ``frac_copy_bw`` is its fraction of the measured
        device-to-device copy bandwidth.
    tflops : float or None
        ``2*M*N*K / time``.
    speedup_vs_cublas, speedup_vs_best_peer : float or None
        ``time(cublas) / time`` and ``time(best peer) / time``.
    best_peer : str or None
        The fastest ok peer at this (N, K, M) that multiplies the same kind of activations
        (torch_int4 and gemlite for the exact rows, scaled_mm for the e4m3 rows).
    err_impl, err_float : float or None
        ``||y - ref|| / ||ref||`` against ``x' @ W_impl^T`` (the implementation's own
        dequantized weight, and the activations it multiplies: x, or x rounded to e4m3 per token
        for the e4m3 rows) and against ``x @ W_float^T`` (exact x), both in float64. None when
        not measured or not finite (then status is FAIL).
    """

    impl: str
    n: int
    k: int
    m: int
    status: str
    note: str = ""
    time_us: Optional[float] = None
    min_us: Optional[float] = None
    p90_us: Optional[float] = None
    iters: Optional[int] = None
    weight_bytes: Optional[int] = None
    bytes_moved: Optional[int] = None
    gbps: Optional[float] = None
    frac_copy_bw: Optional[float] = None
    tflops: Optional[float] = None
    speedup_vs_cublas: Optional[float] = None
    speedup_vs_best_peer: Optional[float] = None
    best_peer: Optional[str] = None
    err_impl: Optional[float] = None
    err_float: Optional[float] = None


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def error_bar(impl: str, k: int, max_error: float = DEFAULT_MAX_ERROR,
              peer_max_error: float = DEFAULT_PEER_MAX_ERROR, fp8_max_error: Optional[float] = None,
              dtype: str = "bf16") -> float:
    """The bar on ``err(own)`` of ``impl``'s rows at K = ``k``: ``fp8_max_error`` (by default
    :func:`fp8_error_bar`) for the e4m3 rows, ``peer_max_error`` for the other peers,
    ``max_error`` for cuBLAS and mixgemm."""
    if activations_of(impl) == E4M3:
        return fp8_error_bar(k, dtype) if fp8_max_error is None else fp8_max_error
    return peer_max_error if is_peer(impl) else max_error


def classify(meas: Measurement, max_error: float,
             peer_max_error: float = DEFAULT_PEER_MAX_ERROR, fp8_max_error: Optional[float] = None,
             dtype: str = "bf16") -> tuple[str, str]:
    """The status and note of a measurement: see :class:`PointResult`. The error bar is
    :func:`error_bar`'s."""
    if meas.timing is None:
        return (UNAVAILABLE if meas.unavailable else ERROR), (meas.error or "did not run")
    problems = []
    if not meas.output_finite:
        problems.append("output has NaN/inf")
    for label, err in (("own weight", meas.err_impl), ("float weight", meas.err_float)):
        if err is None:
            problems.append(f"error vs {label} not measured")
        elif math.isnan(err):
            problems.append(f"error vs {label} is NaN")
        elif not math.isfinite(err):
            problems.append(f"error vs {label} is inf")
    bar = error_bar(meas.impl, meas.k, max_error, peer_max_error, fp8_max_error, dtype)
    if meas.err_impl is not None and math.isfinite(meas.err_impl) and meas.err_impl > bar:
        problems.append(f"error vs own weight {meas.err_impl:.2e} > {bar:.2g}" if activations_of(meas.impl) == E4M3
                        else f"error vs own weight {meas.err_impl:.2e} > {bar:.0e}")
    return (FAIL, "; ".join(problems)) if problems else (OK, "")


def analyze(measurements: Iterable[Measurement], copy_bw_gbps: Optional[float],
            max_error: float = DEFAULT_MAX_ERROR, group_size: int = DEFAULT_GROUP_SIZE,
            peer_max_error: float = DEFAULT_PEER_MAX_ERROR, fp8_max_error: Optional[float] = None,
            dtype: str = "bf16") -> list[PointResult]:
    """Derive every reported number from the raw measurements.

    Parameters
    ----------
    measurements : iterable of Measurement
        Any order; the result keeps it.
    copy_bw_gbps : float or None
        Measured device copy bandwidth (for ``frac_copy_bw``).
    max_error : float
        Error against the implementation's own weight above which a point FAILs.
    group_size : int
        For the weight bytes of a measurement that does not carry them (formula).
    peer_max_error : float
        ``max_error`` for the peers (torch_int4, gemlite).
    fp8_max_error : float, optional
        ``max_error`` for the e4m3 rows (``mixgemm-<wt>-fp8``, ``scaled_mm``); None:
        :func:`fp8_error_bar` of each point's K and ``dtype``.
    dtype : str
        The activation dtype of the run (``bf16`` or ``fp16``: the e4m3 rows' output rounding).

    Returns
    -------
    list of PointResult
        Speedups are given for ok points only, over an ok cuBLAS and the fastest ok peer of
        the same (N, K, M) that multiplies the same kind of activations
        (:func:`.peers.activations_of`): the e4m3 rows are compared with scaled_mm, the others
        with torch_int4 and gemlite.
    """
    meas = list(measurements)
    status = {id(m): classify(m, max_error, peer_max_error, fp8_max_error, dtype) for m in meas}
    # per (N, K, M): the median time of every ok implementation
    ok_time: dict[tuple[int, int, int], dict[str, float]] = {}
    for m in meas:
        if status[id(m)][0] == OK and m.timing is not None:
            ok_time.setdefault((m.n, m.k, m.m), {})[m.impl] = m.timing.median_us
    out = []
    for m in meas:
        st, note = status[id(m)]
        point = (m.n, m.k, m.m)
        res: dict[str, Any] = dict(impl=m.impl, n=m.n, k=m.k, m=m.m, status=st, note=note,
                                   err_impl=_finite(m.err_impl), err_float=_finite(m.err_float))
        times = ok_time.get(point, {})
        peers = {name: t for name, t in times.items()
                 if is_peer(name) and activations_of(name) == activations_of(m.impl)}
        best = min(peers, key=peers.__getitem__) if peers else None
        res["best_peer"] = best
        if m.timing is not None:
            t = m.timing.median_us
            wbytes = m.weight_bytes
            if wbytes is None:
                try:
                    wbytes = expected_weight_bytes(m.impl, m.n, m.k, group_size)
                except ValueError:
                    wbytes = None
            res.update(time_us=t, min_us=m.timing.min_us, p90_us=m.timing.p90_us,
                       iters=m.timing.iters, weight_bytes=wbytes,
                       tflops=tflops(m.m, m.n, m.k, t) if t > 0 else None)
            if wbytes is not None and t > 0:
                moved = traffic_bytes(m.m, m.n, m.k, wbytes, e4m3=activations_of(m.impl) == E4M3)
                res["bytes_moved"] = moved
                res["gbps"] = effective_gbps(moved, t)
                if copy_bw_gbps:
                    res["frac_copy_bw"] = res["gbps"] / copy_bw_gbps
            if st == OK and t > 0:
                base = times.get(BASELINE)
                res["speedup_vs_cublas"] = base / t if base is not None else None
                res["speedup_vs_best_peer"] = peers[best] / t if best is not None else None
        out.append(PointResult(**res))
    return out


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Validated options of one run."""

    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES
    ms: tuple[int, ...] = DEFAULT_MS
    impls: tuple[str, ...] = ()
    dtype: str = "bf16"
    group_size: int = DEFAULT_GROUP_SIZE
    iters: int = MIN_ITERS
    warmup: int = DEFAULT_WARMUP
    quick: bool = False
    all_configs: bool = False
    max_error: float = DEFAULT_MAX_ERROR
    peer_max_error: float = DEFAULT_PEER_MAX_ERROR
    #: None: the e4m3 rows' bar is fp8_error_bar(K, dtype)
    fp8_max_error: Optional[float] = None
    check_rows: int = DEFAULT_CHECK_ROWS
    seed: int = DEFAULT_SEED
    json_path: Optional[str] = None
    plot_path: Optional[str] = None
    save: bool = False
    results_root: Optional[str] = None
    gpu_name: Optional[str] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return ActType.parse(self.dtype).torch_dtype

    def to_json(self) -> dict:
        return {"shapes": [list(s) for s in self.shapes], "ms": list(self.ms),
                "impls": list(self.impls), "dtype": self.dtype, "group_size": self.group_size,
                "iters": self.iters, "warmup": self.warmup, "quick": self.quick,
                "all_configs": self.all_configs, "max_error": self.max_error,
                "peer_max_error": self.peer_max_error,
                "fp8_max_error": (self.fp8_max_error if self.fp8_max_error is not None
                                  else "4 u + 64 sqrt(K) 2^-24 + 2^-12 (u: the output's rounding)"),
                "check_rows": self.check_rows, "seed": self.seed,
                "weight": f"randn * {WEIGHT_STD} (float32)", "activations": "randn",
                "flush": f"{FLUSH_L2_MULTIPLE}x L2 written before every run"}


def _prebuild_mixgemm(impls: Sequence[Impl], dtype: torch.dtype,
                      log: Callable[[str], None], ms: Optional[Sequence[int]] = None) -> dict[str, str]:
    """Build every mixgemm kernel the run needs, in parallel, before timing anything (scaled_mm's
    activation quantizer where it is mixgemm's kernel: on an sm_90 GPU). Returns ``{impl name:
    reason}`` for the implementations whose kernels failed to build."""
    mix = [i for i in impls if isinstance(i, MixgemmImpl)
           or (isinstance(i, ScaledMmImpl) and mixgemm_available()[0])]
    if not mix:
        return {}
    failure = prebuild_kernels([s for i in mix for s in i.kernel_specs(dtype, ms)], log)
    if failure is None:
        return {}
    failed = {}
    for impl in mix:
        for spec in impl.kernel_specs(dtype, ms):
            ok, why = kernel_is_cached(spec)
            if not ok:
                failed[impl.name] = why
                break
    return failed


def run_benchmark(cfg: BenchConfig, impls: Sequence[Impl], device: torch.device,
                  log: Callable[[str], None] = print) -> list[Measurement]:
    """Prepare every implementation for every shape and measure every (shape, M) point.

    Each implementation's first run at a point is checked against the float64 references
    (on :func:`check_rows`' rows; the whole output for NaN/inf; :func:`reference_product` of the
    activations it multiplies and its own weight), then :func:`time_cuda` times it. Exceptions
    are recorded, never raised.
    """
    from tqdm import tqdm   # deferred: loaded only when a progress bar is shown

    dtype = cfg.torch_dtype
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    clock = CudaEventClock(flush_size(l2), device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)

    env_reason: dict[str, str] = {}
    for impl in impls:
        ok, why = impl.available()
        if not ok:
            env_reason[impl.name] = why
    env_reason.update(_prebuild_mixgemm([i for i in impls if i.name not in env_reason], dtype, log, cfg.ms))

    measurements: list[Measurement] = []
    bar = tqdm(total=len(cfg.shapes) * len(cfg.ms) * len(impls), desc="bench", unit="pt",
               file=sys.stderr, disable=None, dynamic_ncols=True)
    try:
        for n, k in cfg.shapes:
            w = torch.randn(n, k, device=device, generator=gen, dtype=torch.float32) * WEIGHT_STD
            why_not: dict[str, tuple[str, bool]] = {}
            for impl in impls:
                if impl.name in env_reason:
                    why_not[impl.name] = (env_reason[impl.name], True)
                    continue
                bar.set_postfix_str(f"N={n} K={k} prepare {impl.name}")
                try:
                    impl.prepare(w, dtype)
                except ImplUnavailable as e:
                    why_not[impl.name] = (str(e), True)
                except Exception as e:
                    why_not[impl.name] = (f"prepare failed: {type(e).__name__}: {e}", False)
            for m in cfg.ms:
                x = torch.randn(m, k, device=device, generator=gen, dtype=torch.float32).to(dtype)
                rows = torch.tensor(check_rows(m, cfg.check_rows), device=device)
                x_rows = x.index_select(0, rows)
                ref_float = reference_matmul(x_rows, w)
                refs: dict[int, torch.Tensor] = {}
                for impl in impls:
                    bar.set_postfix_str(f"N={n} K={k} M={m} {impl.name}")
                    reason, unavailable = why_not.get(impl.name, (impl.why_not_m(m), True))
                    if reason:
                        measurements.append(Measurement(impl.name, n, k, m, error=reason,
                                                        unavailable=unavailable))
                        bar.update(1)
                        continue
                    measurements.append(_measure_point(impl, x, rows, x_rows, ref_float, refs,
                                                       cfg, clock, n, k, m))
                    bar.update(1)
                del x, x_rows, ref_float, refs
            for impl in impls:
                impl.release()
            del w
            torch.cuda.empty_cache()
    finally:
        bar.close()
    return measurements


def _measure_point(impl: Impl, x: torch.Tensor, rows: torch.Tensor, x_rows: torch.Tensor,
                   ref_float: torch.Tensor, refs: dict, cfg: BenchConfig, clock: Clock,
                   n: int, k: int, m: int) -> Measurement:
    try:
        y = impl.run(x)
        torch.cuda.synchronize()
        if tuple(y.shape) != (m, n):
            raise RuntimeError(f"output has shape {tuple(y.shape)}, expected {(m, n)}")
        finite = bool(torch.isfinite(y).all())
        y_rows = y.index_select(0, rows)
        del y
        deq, scale = impl.dequantized, impl.col_scale
        key = (impl.activations, deq.data_ptr(), None if scale is None else scale.data_ptr())
        if key not in refs:
            refs[key] = reference_product(x_rows, deq, impl.activations, scale)
        err_impl = relative_error(y_rows, refs[key])
        err_float = relative_error(y_rows, ref_float)
        del y_rows
        stats = time_cuda(lambda: impl.run(x), cfg.iters, cfg.warmup, 0, clock=clock)
        return Measurement(impl.name, n, k, m, weight_bytes=impl.weight_bytes, timing=stats,
                           err_impl=err_impl, err_float=err_float, output_finite=finite)
    except Exception as e:
        try:  # after a kernel fault the context may be unusable: record, don't crash the run
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:
            pass
        return Measurement(impl.name, n, k, m, weight_bytes=impl.weight_bytes,
                           error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


__all__ = ["DEFAULT_SHAPES", "DEFAULT_MS", "MIN_ITERS", "QUICK_ITERS", "DEFAULT_WARMUP", "QUICK_WARMUP",
           "DEFAULT_GROUP_SIZE", "DEFAULT_MAX_ERROR", "DEFAULT_PEER_MAX_ERROR", "DEFAULT_CHECK_ROWS",
           "DEFAULT_SEED", "WEIGHT_STD", "ACT_BYTES", "OK", "FAIL", "ERROR", "UNAVAILABLE",
           "SCALE_BYTES", "expected_weight_bytes", "traffic_bytes", "check_rows", "relative_error", "reference_matmul",
           "e4m3_activations", "reference_product", "fp8_error_bar", "error_bar", "Measurement", "PointResult",
           "classify", "analyze", "BenchConfig", "run_benchmark"]
