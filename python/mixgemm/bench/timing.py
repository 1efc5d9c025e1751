"""Timing: CUDA events around single runs with the L2 flushed, the medians, and the machine's
own ceilings (copy and read bandwidth, dense bf16 rate) measured in the same process.

:func:`time_cuda` runs ``warmup`` untimed and ``iters`` timed calls; before every call the
:class:`Clock` flushes the L2 cache. Two clocks:

* :class:`CudaEventClock` (the default): the GPU first spins (``torch.cuda._sleep``) so that
  the host queues the flush, the events and the call while the GPU is busy: the events time
  the GPU work, not Python's launch overhead.
* ``CudaEventClock(..., idle_start=True)`` (:func:`eager_clock`): no spin, and a
  synchronization after the flush, so the GPU is idle when the start event is recorded and
  then waits on Python for every launch of the call: the time a user sees from eager code.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

#: Multiple of the L2 size written to flush it before every timed run.
FLUSH_L2_MULTIPLE = 2
#: GPU clock cycles spun (``torch.cuda._sleep``) before every timed run, so that the host can
#: queue the run while the GPU is busy: ~0.5 ms at Hopper clocks.
HOST_LEAD_CYCLES = 1_000_000
#: Size of each buffer of the device-to-device copy that measures the memory bandwidth, and of
#: the tensor summed to measure the read bandwidth.
COPY_BYTES = 1 << 30
#: Size of the square bf16 matmul that measures the dense TFLOP/s.
DENSE_N = 8192
#: Timed runs of the bandwidth and dense-rate measurements.
CEILING_ITERS = 100
CEILING_WARMUP = 10


@dataclasses.dataclass(frozen=True)
class TimingStats:
    """Summary of the per-run times of one point, in microseconds."""

    median_us: float
    mean_us: float
    min_us: float
    max_us: float
    p10_us: float
    p90_us: float
    iters: int


def summarize_times(samples_ms: Sequence[float]) -> TimingStats:
    """Summarize per-run times given in milliseconds (CUDA events' unit).

    The median is the middle value (the mean of the two middle ones for an even count); the
    10th/90th percentiles interpolate linearly between order statistics.

    Raises
    ------
    ValueError
        No samples, or a sample that is negative or not finite.
    """
    if not samples_ms:
        raise ValueError("no timing samples")
    us = [float(s) * 1e3 for s in samples_ms]
    if any(not math.isfinite(u) or u < 0 for u in us):
        raise ValueError(f"invalid timing samples: {samples_ms!r}")
    if len(us) == 1:
        p10 = p90 = us[0]
    else:
        deciles = statistics.quantiles(us, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    return TimingStats(median_us=statistics.median(us), mean_us=statistics.fmean(us),
                       min_us=min(us), max_us=max(us), p10_us=p10, p90_us=p90, iters=len(us))


def effective_gbps(nbytes: int, time_us: float) -> float:
    """``nbytes`` moved in ``time_us`` microseconds, in GB/s (10^9 bytes per second)."""
    return nbytes / (time_us * 1e-6) / 1e9


def floor_us(nbytes: int, read_bw_gbps: float) -> float:
    """Microseconds to read ``nbytes`` at ``read_bw_gbps`` (10^9 bytes per second)."""
    return nbytes / (read_bw_gbps * 1e9) * 1e6


def tflops(m: int, n: int, k: int, time_us: float) -> float:
    """``2*M*N*K`` floating-point operations in ``time_us`` microseconds, in TFLOP/s."""
    return 2.0 * m * n * k / (time_us * 1e-6) / 1e12


def flush_size(l2_bytes: int) -> int:
    """Bytes written to flush an L2 cache of ``l2_bytes``: :data:`FLUSH_L2_MULTIPLE` times it
    (at least 32 MiB when the size is unknown)."""
    return max(FLUSH_L2_MULTIPLE * int(l2_bytes), 32 << 20)


def device_flush_size(device: torch.device) -> int:
    """:func:`flush_size` of the L2 cache of ``device``."""
    return flush_size(int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)))


class Clock(Protocol):
    """What :func:`time_cuda` needs from a timer; :class:`CudaEventClock` on a GPU, a fake in
    the tests."""

    def flush(self) -> None:
        """Prepare a run: evict the L2 cache (and let the host get ahead of the GPU)."""

    def mark(self) -> Any:
        """Record a point in time on the stream (asynchronously); returns its handle."""

    def synchronize(self) -> None:
        """Wait until every recorded mark has happened."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks (after :meth:`synchronize`)."""


class CudaEventClock:
    """CUDA events on the current stream, with an L2 flush before each run.

    The flush rewrites a buffer (with a changing non-zero byte), then reads another buffer of
    the same size, so that the timed run finds the L2 full of clean lines, as it would after the
    previous layer's weight reads. (A write alone leaves the L2 full of dirty lines, whose
    write-back the timed kernel then pays for: on an H100 that made a 4096x4096 cuBLAS GEMV 15%
    slower, 22.3 against 18.8 us, docs/benchmarking.md.)

    Parameters
    ----------
    flush_bytes : int
        Size of each of the two flush buffers; 0 for no flush.
    device : torch.device
        The CUDA device.
    lead_cycles : int
        GPU cycles spun (``torch.cuda._sleep``) before each flush, so that the host queues the
        timed run while the GPU is still busy; 0 to disable. Ignored with ``idle_start``.
    idle_start : bool
        Synchronize after the flush, so that each run starts on an idle GPU that then waits
        for the host's launches (eager timing: Python's overhead is part of the time).
    """

    def __init__(self, flush_bytes: int, device: torch.device, lead_cycles: int = HOST_LEAD_CYCLES,
                 idle_start: bool = False):
        self._buffer = (torch.empty(int(flush_bytes), dtype=torch.uint8, device=device)
                        if flush_bytes > 0 else None)
        self._clean = (torch.ones(int(flush_bytes) // 4, dtype=torch.float32, device=device)
                       if flush_bytes > 0 else None)
        self._sink = torch.empty((), dtype=torch.float32, device=device) if flush_bytes > 0 else None
        self._value = 0
        self._idle_start = bool(idle_start)
        self._lead = 0 if idle_start or not hasattr(torch.cuda, "_sleep") else int(lead_cycles)

    def flush(self) -> None:
        if self._lead:
            torch.cuda._sleep(self._lead)
        if self._buffer is not None:
            self._value = self._value % 255 + 1
            self._buffer.fill_(self._value)
            self._sink.copy_(self._clean.sum())     # evicts the dirty lines: clean ones stay
        if self._idle_start:
            torch.cuda.synchronize()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))


def eager_clock(flush_bytes: int, device: torch.device) -> CudaEventClock:
    """The clock of eager timing: L2 flushed, then an idle GPU at the start of every run."""
    return CudaEventClock(flush_bytes, device, idle_start=True)


def time_cuda(fn: Callable[[], Any], iters: int, warmup: int, flush_bytes: int, *,
              clock: Optional[Clock] = None, device: Optional[torch.device] = None) -> TimingStats:
    """Time ``fn`` with CUDA events around each single run.

    ``warmup`` untimed runs, then ``iters`` timed ones; before every run (warm-up included)
    the clock flushes the L2 cache by writing a ``flush_bytes`` buffer. Each run is bracketed
    by its own pair of events; all are read after one final synchronization.

    Parameters
    ----------
    fn : callable
        The work, launched on the current stream.
    iters, warmup : int
        Timed and untimed runs (``iters >= 1``).
    flush_bytes : int
        Bytes written before every run (use :func:`flush_size` of the L2 size); 0: no flush.
    clock : Clock, optional
        Default: a :class:`CudaEventClock` on ``device`` with ``flush_bytes``.
    device : torch.device, optional
        Default: the current CUDA device.

    Returns
    -------
    TimingStats
        Median (the reported time), mean, min, max and percentiles, in microseconds.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if clock is None:
        dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        clock = CudaEventClock(flush_bytes, dev)
    for _ in range(max(0, warmup)):
        clock.flush()
        fn()
    marks = []
    for _ in range(iters):
        clock.flush()
        start = clock.mark()
        fn()
        marks.append((start, clock.mark()))
    clock.synchronize()
    return summarize_times([clock.elapsed_ms(a, b) for a, b in marks])


def budgeted_iters(single_us: float, iters: int, warmup: int, budget_s: float,
                   min_iters: int = 10) -> tuple[int, int]:
    """Timed and warm-up runs for a point whose one run takes ``single_us``: ``iters`` and
    ``warmup`` when they fit in ``budget_s`` seconds, else fewer (never fewer than
    ``min_iters`` timed runs, or ``iters`` if that is smaller, and at least one warm-up).

    A slow point (a 2048-token prefill through torch's int4 kernel takes about a second per
    70B-sized step) gets fewer runs instead of the whole time limit; its run count is reported.
    """
    if single_us <= 0 or not math.isfinite(single_us):
        return iters, warmup
    fit = int(budget_s * 1e6 / single_us)
    if fit >= iters + warmup:
        return iters, warmup
    fewer_warmup = max(1, min(warmup, fit // 5))
    fewer_iters = max(min(min_iters, iters), fit - fewer_warmup)
    return min(iters, fewer_iters), fewer_warmup


def measure_copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, iters: int = CEILING_ITERS,
                           warmup: int = CEILING_WARMUP) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read and written
    (``2 * nbytes`` per copy), from the median of ``iters`` copies of an ``nbytes`` buffer."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    stats = time_cuda(lambda: dst.copy_(src), iters, warmup, 0, clock=CudaEventClock(0, device))
    return effective_gbps(2 * nbytes, stats.median_us)


def measure_read_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, iters: int = CEILING_ITERS,
                           warmup: int = CEILING_WARMUP) -> float:
    """Read bandwidth in GB/s: the sum of an ``nbytes`` float32 tensor (a reduction reads every
    byte once and writes one value), counting ``nbytes`` per sum; median of ``iters`` sums.
    The ceiling of a weight-streaming (decode) step, which reads far more than it writes."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    stats = time_cuda(lambda: src.sum(), iters, warmup, 0, clock=CudaEventClock(0, device))
    return effective_gbps(src.numel() * 4, stats.median_us)


def measure_dense_tflops(device: torch.device, n: int = DENSE_N, dtype: torch.dtype = torch.bfloat16,
                         iters: int = CEILING_ITERS, warmup: int = CEILING_WARMUP) -> float:
    """Dense ``n x n x n`` matmul throughput on random data, in TFLOP/s (median of ``iters``)."""
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    stats = time_cuda(lambda: a @ b, iters, warmup, 0, clock=CudaEventClock(0, device))
    return tflops(n, n, n, stats.median_us)


__all__ = ["FLUSH_L2_MULTIPLE", "HOST_LEAD_CYCLES", "COPY_BYTES", "DENSE_N", "TimingStats",
           "summarize_times", "effective_gbps", "floor_us", "tflops", "flush_size", "device_flush_size", "Clock",
           "CudaEventClock", "eager_clock", "time_cuda", "budgeted_iters", "measure_copy_bandwidth",
           "measure_read_bandwidth", "measure_dense_tflops"]
