"""The benchmark harness (``mixgemm bench``): mixgemm against cuBLAS and its peers.

Every implementation runs in one process, on the same GPU, on the same random inputs:

* ``cublas``: ``torch.nn.functional.linear(x, W)`` on the dense weight (the float weight rounded
  to the activation dtype): the baseline every speedup is measured against. Always run.
* ``torch_int4``: PyTorch's tinygemm kernel (``aten._convert_weight_to_int4pack`` +
  ``aten._weight_int4pack_mm``), bf16 activations, asymmetric int4.
* ``gemlite-u4``, ``gemlite-u2``: gemlite's Triton kernels (``GemLiteLinearTriton`` through
  ``gemlite.helper.A16Wn``), asymmetric 4- and 2-bit.
* ``mixgemm-<wt>`` for wt in s8, u8, s4, u4, s2, u2: :func:`mixgemm.ops.gemm` (the heuristic's
  kernel); with ``--all-configs`` also ``mixgemm-<wt>@<label>``, one per
  :data:`mixgemm.codegen.TILE_CONFIGS` entry, through :func:`mixgemm.ops.gemm_with_spec`.

The quantized implementations share one quantization per bit width (mixgemm's
round-to-nearest, :func:`mixgemm.quantize`): torch_int4, gemlite-u4 and mixgemm-u4 multiply
the same integer codes with the same scales, each converted to the implementation's own
zero-point convention, so their errors against the float weight are comparable.

Timing (:func:`time_cuda`): CUDA events around each single run, the median of at least 100
runs after a warm-up; before every run the L2 cache is flushed by writing a buffer twice its
size, after a short GPU-side spin that lets the host queue the run ahead (so the events time
the kernel, not Python's launch overhead).

Everything that needs no GPU (byte counting, bandwidth, speedups, the best-peer choice, the
table, the JSON and the plot) is a pure function of the measurements, tested on the CPU.
"""
from __future__ import annotations

import abc
import argparse
import dataclasses
import datetime
import json
import os
import math
import platform
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

import torch

from ._version import __version__
from .codegen import TILE_CONFIGS
from .errors import BenchError, CliError
from .tuning import gpu_slug
from .types import ActType, PackedWeight, QuantizedWeight, WeightType

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
#: Rows of the output checked against the float64 reference (all rows when M is at most this).
DEFAULT_CHECK_ROWS = 1024
DEFAULT_SEED = 0
#: Standard deviation of the random float weight (about that of a trained LLM layer).
WEIGHT_STD = 0.02

#: The baseline implementation: always run, the denominator of "speedup over cuBLAS".
BASELINE = "cublas"
#: Names of the peer implementations (the "best peer" is the fastest of these at a point).
PEER_NAMES: tuple[str, ...] = ("torch_int4", "gemlite-u4", "gemlite-u2")
#: Weight types benchmarked for mixgemm, in table order.
MIXGEMM_TYPES: tuple[WeightType, ...] = (WeightType.S8, WeightType.U8, WeightType.S4,
                                         WeightType.U4, WeightType.S2, WeightType.U2)
#: Bytes per activation / output element (bf16 and fp16).
ACT_BYTES = 2
#: Multiple of the L2 size written to flush it before every timed run.
FLUSH_L2_MULTIPLE = 2
#: GPU clock cycles spun (``torch.cuda._sleep``) before every timed run, so that the host can
#: queue the run while the GPU is busy: ~0.5 ms at Hopper clocks.
HOST_LEAD_CYCLES = 1_000_000
#: Size of each buffer of the device-to-device copy that measures the memory bandwidth.
COPY_BYTES = 1 << 30
#: Size of the square bf16 matmul that measures the dense TFLOP/s.
DENSE_N = 8192
#: torch_int4 packs this many 16-wide k-tiles together (gpt-fast's and torchao's choice).
TORCH_INT4_INNER_K_TILES = 8
#: Group sizes tinygemm supports.
TORCH_INT4_GROUP_SIZES = (32, 64, 128, 256)
#: JSON schema tag.
JSON_SCHEMA = "mixgemm.bench/1"
#: Point status values.
OK, FAIL, ERROR, UNAVAILABLE = "ok", "FAIL", "error", "n/a"

NO_GPU_MESSAGE = ("no CUDA GPU is visible to PyTorch: `mixgemm bench` times kernels on an "
                  "NVIDIA GPU (mixgemm's own kernels need an sm_90 H100/H200)")


class ImplUnavailable(Exception):
    """An implementation cannot run this configuration (dtype, group size, shape); the
    message says why and is reported in place of its numbers."""


# ------------------------------------------------------------------------------------------
# Argument parsing helpers (pure)
# ------------------------------------------------------------------------------------------
_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """Parse ``"4096x4096,28672x8192"`` (NxK, comma separated) into ``((4096, 4096), ...)``.

    Raises
    ------
    argparse.ArgumentTypeError
        An entry is not ``NxK`` with positive integers, or the list is empty.
    """
    entries = [e for e in text.split(",") if e.strip()]
    if not entries:
        raise argparse.ArgumentTypeError("expected a comma-separated list of NxK shapes, "
                                         "e.g. 4096x4096,28672x8192; got an empty list")
    shapes = []
    for entry in entries:
        m = _SHAPE_RE.match(entry)
        if not m or int(m[1]) <= 0 or int(m[2]) <= 0:
            raise argparse.ArgumentTypeError(
                f"bad shape {entry.strip()!r}: expected NxK (out_features x in_features) with "
                f"positive integers, e.g. 4096x4096,28672x8192")
        shapes.append((int(m[1]), int(m[2])))
    return tuple(shapes)


def parse_int_list(text: str) -> tuple[int, ...]:
    """Parse ``"1,16,128"`` into ``(1, 16, 128)`` (positive integers).

    Raises
    ------
    argparse.ArgumentTypeError
        An entry is not a positive integer, or the list is empty.
    """
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers, "
                                         "e.g. 1,16,128; got an empty list")
    out = []
    for entry in entries:
        try:
            value = int(entry)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad value {entry!r}: expected a positive integer") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"bad value {entry!r}: expected a positive integer")
        out.append(value)
    return tuple(out)


def parse_name_list(text: str) -> tuple[str, ...]:
    """Parse ``"cublas,mixgemm-u4"`` into ``("cublas", "mixgemm-u4")``."""
    names = tuple(e.strip() for e in text.split(",") if e.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of implementation names "
                                         "or prefixes, e.g. mixgemm-u4,gemlite")
    return names


def impl_names(all_configs: bool = False) -> list[str]:
    """Names of every implementation the harness knows, in table order.

    Parameters
    ----------
    all_configs : bool
        Also list ``mixgemm-<wt>@<label>`` for every tile config.
    """
    names = [BASELINE, *PEER_NAMES] + [f"mixgemm-{wt.value}" for wt in MIXGEMM_TYPES]
    if all_configs:
        names += [f"mixgemm-{wt.value}@{tc.label}" for wt in MIXGEMM_TYPES for tc in TILE_CONFIGS]
    return names


def select_impl_names(candidates: Sequence[str], patterns: Optional[Sequence[str]]) -> list[str]:
    """The candidates matching any pattern (an exact name or a name prefix), in candidate
    order, always with the baseline (``cublas``) first.

    Raises
    ------
    ValueError
        A pattern matches no candidate.
    """
    if not patterns:
        chosen = list(candidates)
    else:
        unmatched = [p for p in patterns if not any(c == p or c.startswith(p) for c in candidates)]
        if unmatched:
            hint = " (the @<config> variants need --all-configs)" if any("@" in p for p in unmatched) else ""
            raise ValueError(f"--impls: {', '.join(repr(p) for p in unmatched)} match no "
                             f"implementation{hint}; known: {', '.join(candidates)}")
        chosen = [c for c in candidates if any(c == p or c.startswith(p) for p in patterns)]
    if BASELINE in candidates and BASELINE not in chosen:
        chosen.insert(0, BASELINE)
    return chosen


#: A folder name for a GPU name: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``, the
#: same name the measured tuning tables use (mixgemm.tuning).
slugify = gpu_slug


def results_dir(root: Path, gpu_name: str) -> Path:
    """``<root>/<gpu-name-slug>``: where ``--save`` writes ``bench.json`` and ``bench.png``."""
    return Path(root) / slugify(gpu_name)


def default_results_root() -> Path:
    """``benchmarks/results`` of the source checkout this module lives in, else of the current
    directory."""
    repo = Path(__file__).resolve().parents[2]
    if (repo / "benchmarks").is_dir():
        return repo / "benchmarks" / "results"
    return Path.cwd() / "benchmarks" / "results"


# ------------------------------------------------------------------------------------------
# Byte counting and derived metrics (pure)
# ------------------------------------------------------------------------------------------
def _base_name(impl: str) -> str:
    return impl.split("@", 1)[0]


def expected_weight_bytes(impl: str, n: int, k: int, group_size: int) -> int:
    """Bytes of weight data (codes + scales + zeros) an implementation reads, by formula.

    * ``cublas``: the dense weight, ``2*N*K``.
    * ``torch_int4``: ``N*K/2`` packed codes + ``[K/g, N, 2]`` 16-bit scales-and-zeros.
    * ``gemlite-uB``: ``N*K*B/8`` packed codes + 16-bit scales and zeros ``[K/g, N]`` each.
    * ``mixgemm-<wt>`` (any ``@config``): ``N*K*B/8`` codes + 16-bit scales ``[K/g, N]``, + as
      many zeros for the asymmetric (``u``) types: :attr:`mixgemm.PackedWeight.nbytes`.

    The harness reports the bytes of the tensors each implementation actually holds; this
    formula documents (and the tests check) what those are.
    """
    groups = k // group_size
    meta = groups * n * ACT_BYTES
    base = _base_name(impl)
    if base == BASELINE:
        return ACT_BYTES * n * k
    if base == "torch_int4":
        return n * k // 2 + 2 * meta
    m = re.fullmatch(r"(gemlite|mixgemm)-([su])([248])", base)
    if not m:
        raise ValueError(f"unknown implementation {impl!r}")
    family, sign, bits = m[1], m[2], int(m[3])
    if family == "gemlite" and sign == "s":
        raise ValueError(f"unknown implementation {impl!r}")
    return n * k * bits // 8 + meta * (2 if sign == "u" else 1)


def traffic_bytes(m: int, n: int, k: int, weight_bytes: int, act_bytes: int = ACT_BYTES) -> int:
    """Bytes a GEMM must move at least: the weight (with its scales and zeros), the
    activations ``[M, K]`` and the output ``[M, N]``."""
    return weight_bytes + act_bytes * m * k + act_bytes * m * n


def effective_gbps(nbytes: int, time_us: float) -> float:
    """``nbytes`` moved in ``time_us`` microseconds, in GB/s (10^9 bytes per second)."""
    return nbytes / (time_us * 1e-6) / 1e9


def tflops(m: int, n: int, k: int, time_us: float) -> float:
    """``2*M*N*K`` floating-point operations in ``time_us`` microseconds, in TFLOP/s."""
    return 2.0 * m * n * k / (time_us * 1e-6) / 1e12


def flush_size(l2_bytes: int) -> int:
    """Bytes written to flush an L2 cache of ``l2_bytes``: :data:`FLUSH_L2_MULTIPLE` times it
    (at least 32 MiB when the size is unknown)."""
    return max(FLUSH_L2_MULTIPLE * int(l2_bytes), 32 << 20)


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


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------
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

    Parameters
    ----------
    flush_bytes : int
        Size of the buffer rewritten (with a changing non-zero byte) before each run; 0 for
        no flush.
    device : torch.device
        The CUDA device.
    lead_cycles : int
        GPU cycles spun (``torch.cuda._sleep``) before each flush, so that the host queues the
        timed run while the GPU is still busy; 0 to disable.
    """

    def __init__(self, flush_bytes: int, device: torch.device, lead_cycles: int = HOST_LEAD_CYCLES):
        self._buffer = (torch.empty(int(flush_bytes), dtype=torch.uint8, device=device)
                        if flush_bytes > 0 else None)
        self._value = 0
        self._lead = int(lead_cycles) if hasattr(torch.cuda, "_sleep") else 0

    def flush(self) -> None:
        if self._lead:
            torch.cuda._sleep(self._lead)
        if self._buffer is not None:
            self._value = self._value % 255 + 1
            self._buffer.fill_(self._value)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))


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


def measure_copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, iters: int = MIN_ITERS,
                           warmup: int = DEFAULT_WARMUP) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read and written
    (``2 * nbytes`` per copy), from the median of ``iters`` copies of an ``nbytes`` buffer."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    stats = time_cuda(lambda: dst.copy_(src), iters, warmup, 0, clock=CudaEventClock(0, device))
    return effective_gbps(2 * nbytes, stats.median_us)


def measure_dense_tflops(device: torch.device, n: int = DENSE_N, dtype: torch.dtype = torch.bfloat16,
                         iters: int = MIN_ITERS, warmup: int = DEFAULT_WARMUP) -> float:
    """Dense ``n x n x n`` matmul throughput on random data, in TFLOP/s (median of ``iters``)."""
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    stats = time_cuda(lambda: a @ b, iters, warmup, 0, clock=CudaEventClock(0, device))
    return tflops(n, n, n, stats.median_us)


# ------------------------------------------------------------------------------------------
# Implementations
# ------------------------------------------------------------------------------------------
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
        from .quantize import quantize

        return self._get(w, ("q", bits, symmetric, group_size, dtype),
                         lambda: quantize(w, bits, group_size, symmetric=symmetric, dtype=dtype))

    def packed(self, w: torch.Tensor, bits: int, symmetric: bool, group_size: int,
               dtype: torch.dtype) -> PackedWeight:
        """:func:`mixgemm.prepack` of the quantized ``w`` (cached)."""
        from .layout import prepack

        return self._get(w, ("p", bits, symmetric, group_size, dtype),
                         lambda: prepack(self.quantized(w, bits, symmetric, group_size, dtype)))

    def dequantized(self, w: torch.Tensor, bits: int, symmetric: bool, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """:func:`mixgemm.dequantize_reference` of the quantized ``w`` (cached)."""
        from .quantize import dequantize_reference

        return self._get(w, ("d", bits, symmetric, group_size, dtype),
                         lambda: dequantize_reference(self.quantized(w, bits, symmetric, group_size, dtype)))

    def clear(self) -> None:
        self._store.clear()
        self._weight_id = None


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
    dequantized : torch.Tensor or None
        After :meth:`prepare`: the ``[N, K]`` weight (activation dtype) this implementation
        multiplies by, reconstructed from its own quantization parameters: its results are
        compared with ``x @ dequantized^T`` in float64.
    weight_bytes : int or None
        After :meth:`prepare`: bytes of the weight tensors it reads (codes, scales, zeros).
    """

    name: str = ""
    kind: str = ""

    def __init__(self) -> None:
        self.dequantized: Optional[torch.Tensor] = None
        self.weight_bytes: Optional[int] = None

    def available(self) -> tuple[bool, str]:
        """Whether this implementation can run in this environment; ``(False, reason)`` if not."""
        return True, ""

    def why_not_m(self, m: int) -> Optional[str]:
        """Why this implementation does not take ``m`` tokens (None: it does)."""
        del m
        return None

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


def torch_int4_params(q: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert mixgemm's asymmetric 4-bit weight to tinygemm's inputs.

    mixgemm: ``w = (q - z) * s`` with ``q, z`` in ``[0, 15]``. tinygemm: ``w = (q - 8) * s + zf``,
    so ``zf = (8 - z) * s`` (rounded once to the scales' dtype).

    Parameters
    ----------
    q : torch.Tensor
        uint8 codes ``[N, K]`` in ``[0, 15]``.
    scales, zeros : torch.Tensor
        ``[N, K/g]``, bf16 (zeros integer-valued).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``packed`` uint8 ``[N, K/2]`` (element ``2i`` in the high nibble of byte ``i``, the
        input ``aten._convert_weight_to_int4pack`` takes since PyTorch 2.5) and
        ``scale_and_zeros`` ``[K/g, N, 2]`` (``[..., 0]`` scale, ``[..., 1]`` zero).
    """
    if q.shape[1] % 2:
        raise ValueError(f"K={q.shape[1]} must be even for int4 packing")
    qi = q.to(torch.uint8)
    packed = ((qi[:, ::2] << 4) | qi[:, 1::2]).contiguous()
    zero_f = ((8.0 - zeros.double()) * scales.double()).to(scales.dtype)
    scale_and_zeros = torch.stack([scales, zero_f], dim=-1).transpose(0, 1).contiguous()
    return packed, scale_and_zeros


def torch_int4_dequant(q: torch.Tensor, scale_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """tinygemm's weight: ``fl((q - 8) * scale + zero)`` (one rounding, as its bf16 ``fma``),
    from the codes ``q [N, K]`` and ``scale_and_zeros [K/g, N, 2]``; ``[N, K]`` in the scales'
    dtype."""
    s = scale_and_zeros[..., 0].t().double().repeat_interleave(group_size, dim=1)
    z = scale_and_zeros[..., 1].t().double().repeat_interleave(group_size, dim=1)
    return ((q.double() - 8.0) * s + z).to(scale_and_zeros.dtype)


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
        for op in ("_convert_weight_to_int4pack", "_weight_int4pack_mm"):
            if not hasattr(torch.ops.aten, op):
                return False, f"this PyTorch ({torch.__version__}) has no aten.{op}"
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
            return False, "tinygemm needs an sm_80+ GPU"
        return True, ""

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
        packed_u8, sz = torch_int4_params(qw.qweight, qw.scales, qw.zeros)
        try:  # PyTorch >= 2.5: uint8 [N, K/2]
            packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, self.inner_k_tiles)
        except RuntimeError as first:
            try:  # older PyTorch: int32 [N, K] codes
                packed = torch.ops.aten._convert_weight_to_int4pack(
                    qw.qweight.to(torch.int32).contiguous(), self.inner_k_tiles)
            except RuntimeError:
                raise ImplUnavailable(f"aten._convert_weight_to_int4pack failed: {first}") from None
        self._packed, self._sz = packed, sz
        self.dequantized = torch_int4_dequant(qw.qweight, sz, self.group_size)
        self.weight_bytes = _tensor_bytes(packed, sz)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(x, self._packed, self.group_size, self._sz)

    def release(self) -> None:
        super().release()
        self._packed = self._sz = None


def gemlite_dequant(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    mode: int, dtype: torch.dtype) -> torch.Tensor:
    """gemlite's weight from its own parameters, as its Triton ``dequantize`` computes it.

    Parameters
    ----------
    q : torch.Tensor
        Codes ``[N, K]`` (unsigned).
    scales, zeros : torch.Tensor
        ``[N, K/g]``: gemlite's stored ``scales`` and ``zeros``, transposed back.
    group_size : int
        K elements per group.
    mode : int
        gemlite's ``W_group_mode``: 4 (``fma(q, s, zeros)``, its default for asymmetric groups,
        with ``zeros = -z*s``) or 3 (``(q - zeros) * s``).
    dtype : torch.dtype
        The activation dtype (one final rounding).
    """
    s = scales.double().repeat_interleave(group_size, dim=1)
    z = zeros.double().repeat_interleave(group_size, dim=1)
    if mode == 4:
        return (q.double() * s + z).to(dtype)
    if mode == 3:
        return (q.double() - z).to(dtype).double().mul(s).to(dtype)
    raise ValueError(f"unsupported gemlite W_group_mode {mode} (expected 3 or 4)")


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
        from gemlite.helper import A16Wn

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


class MixgemmImpl(Impl):
    """:func:`mixgemm.ops.gemm` (heuristic kernel), or one tile config through
    :func:`mixgemm.ops.gemm_with_spec` when ``tile_label`` is given."""

    kind = "mixgemm"

    def __init__(self, weight_type: WeightType, group_size: int, cache: QuantCache,
                 tile_label: Optional[str] = None) -> None:
        super().__init__()
        self.weight_type = weight_type
        self.group_size = group_size
        self.tile_label = tile_label
        self.name = f"mixgemm-{weight_type.value}" + (f"@{tile_label}" if tile_label else "")
        self._cache = cache
        self._packed: Optional[PackedWeight] = None
        self._spec: Any = None

    def available(self) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "needs a CUDA GPU"
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return False, f"mixgemm's kernels need an sm_90 GPU, this one is sm_{cap[0]}{cap[1]}"
        try:
            from . import ops  # noqa: F401
        except Exception as e:
            return False, f"mixgemm.ops is not importable: {type(e).__name__}: {e}"
        return True, ""

    def why_not_m(self, m: int) -> Optional[str]:
        if self.tile_label is None:
            return None
        tc = next(tc for tc in TILE_CONFIGS if tc.label == self.tile_label)
        if tc.max_tokens is not None and m > tc.max_tokens:
            return f"the {tc.label} kernels take at most {tc.max_tokens} tokens"
        return None

    def kernel_specs(self, x_dtype: torch.dtype, ms: Optional[Sequence[int]] = None) -> list:
        """The GEMM kernel specs this implementation may launch for ``ms`` tokens (all token
        counts if None), to build them up front."""
        from .ops import tile_labels

        act = ActType.from_torch(x_dtype)
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
        self.dequantized = self._cache.dequantized(w_float, bits, sym, self.group_size, x_dtype)
        self.weight_bytes = self._packed.nbytes
        if self.tile_label is not None:
            self._spec = self.kernel_specs(x_dtype)[0]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        from . import ops

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
        elif base in ("gemlite-u4", "gemlite-u2") and not label:
            out.append(GemliteImpl(int(base[-1]), group_size, cache))
        elif base.startswith("mixgemm-") and (not label or label in labels):
            out.append(MixgemmImpl(WeightType(base[len("mixgemm-"):]), group_size, cache, label or None))
        else:
            raise ValueError(f"unknown implementation {name!r}")
    return out


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
        The fastest ok peer at this (N, K, M).
    err_impl, err_float : float or None
        ``||y - ref|| / ||ref||`` against ``x @ W_impl^T`` (the implementation's own
        dequantized weight) and against ``x @ W_float^T``, both in float64. None when not
        measured or not finite (then status is FAIL).
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


def is_peer(impl: str) -> bool:
    """Whether ``impl`` is one of the peers (torch_int4, gemlite-*)."""
    return impl in PEER_NAMES or impl.startswith("gemlite")


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def classify(meas: Measurement, max_error: float,
             peer_max_error: float = DEFAULT_PEER_MAX_ERROR) -> tuple[str, str]:
    """The status and note of a measurement: see :class:`PointResult`. The error bar is
    ``peer_max_error`` for the peers, ``max_error`` for the others."""
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
    bar = peer_max_error if is_peer(meas.impl) else max_error
    if meas.err_impl is not None and math.isfinite(meas.err_impl) and meas.err_impl > bar:
        problems.append(f"error vs own weight {meas.err_impl:.2e} > {bar:.0e}")
    return (FAIL, "; ".join(problems)) if problems else (OK, "")


def analyze(measurements: Iterable[Measurement], copy_bw_gbps: Optional[float],
            max_error: float = DEFAULT_MAX_ERROR, group_size: int = DEFAULT_GROUP_SIZE,
            peer_max_error: float = DEFAULT_PEER_MAX_ERROR) -> list[PointResult]:
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

    Returns
    -------
    list of PointResult
        Speedups are given for ok points only, over an ok cuBLAS and the fastest ok peer of
        the same (N, K, M).
    """
    meas = list(measurements)
    status = {id(m): classify(m, max_error, peer_max_error) for m in meas}
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
        peers = {name: t for name, t in times.items() if is_peer(name)}
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
                moved = traffic_bytes(m.m, m.n, m.k, wbytes)
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
# Machine info, report, JSON, table, plot (pure except machine_info)
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MachineInfo:
    """Where the numbers come from."""

    gpu_name: str
    device_name: str
    compute_capability: str
    sm_count: int
    l2_cache_bytes: int
    memory_bytes: int
    torch_version: str
    cuda_version: Optional[str]
    triton_version: Optional[str]
    gemlite_version: Optional[str]
    mixgemm_version: str
    python_version: str
    copy_bw_gbps: Optional[float]
    dense_bf16_tflops: Optional[float]
    timestamp: str


def _module_version(name: str) -> Optional[str]:
    try:
        module = __import__(name)
    except Exception:
        return None
    return str(getattr(module, "__version__", "unknown"))


def machine_info(device: torch.device, gpu_name: Optional[str], copy_bw_gbps: Optional[float],
                 dense_tflops: Optional[float]) -> MachineInfo:
    """Describe the GPU and the software stack (``gpu_name`` overrides the reported name)."""
    props = torch.cuda.get_device_properties(device)
    return MachineInfo(
        gpu_name=gpu_name or props.name, device_name=props.name,
        compute_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
        l2_cache_bytes=int(getattr(props, "L2_cache_size", 0)), memory_bytes=int(props.total_memory),
        torch_version=torch.__version__, cuda_version=torch.version.cuda,
        triton_version=_module_version("triton"), gemlite_version=_module_version("gemlite"),
        mixgemm_version=__version__, python_version=platform.python_version(),
        copy_bw_gbps=copy_bw_gbps, dense_bf16_tflops=dense_tflops,
        timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


@dataclasses.dataclass(frozen=True)
class BenchReport:
    """A whole run: where, how, and every point."""

    machine: MachineInfo
    config: dict
    results: list


def report_to_dict(report: BenchReport) -> dict:
    """The JSON document of a report (only standard JSON values: no NaN)."""
    return {"schema": JSON_SCHEMA, "machine": dataclasses.asdict(report.machine),
            "config": dict(report.config),
            "points": [dataclasses.asdict(r) for r in report.results]}


def report_from_dict(data: Mapping[str, Any]) -> BenchReport:
    """Inverse of :func:`report_to_dict`."""
    if data.get("schema") != JSON_SCHEMA:
        raise ValueError(f"not a {JSON_SCHEMA} document (schema {data.get('schema')!r})")
    return BenchReport(machine=MachineInfo(**data["machine"]), config=dict(data["config"]),
                       results=[PointResult(**p) for p in data["points"]])


def _atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_json(path: Path, report: BenchReport) -> Path:
    """Write the report as JSON (creating the folder, atomically); returns the path."""
    return _atomic_write_text(path, json.dumps(report_to_dict(report), indent=1, allow_nan=False))


def read_json(path: Path) -> BenchReport:
    """Read a report written by :func:`write_json`."""
    return report_from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def merge_reports(reports: Sequence[BenchReport]) -> BenchReport:
    """One report from runs that split a grid across processes (``--m`` or ``--shapes`` parts,
    to fit a per-process time limit) on the same GPU, dtype and group size.

    Each point keeps what its own run measured (its speedups are against the cuBLAS and peers
    of that run); the config lists the union of shapes, M and implementations, and
    ``config["runs"]`` each run's timestamp, copy bandwidth, dense rate and grid. The machine
    entry is the first run's.

    Raises
    ------
    ValueError
        No reports; runs on different GPUs, dtypes or group sizes; a point measured twice.
    """
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0]
    for r in reports[1:]:
        if r.machine.gpu_name != first.machine.gpu_name:
            raise ValueError(f"runs on different GPUs: {first.machine.gpu_name!r} and {r.machine.gpu_name!r}")
        for key in ("dtype", "group_size"):
            if r.config.get(key) != first.config.get(key):
                raise ValueError(f"runs with different {key}: {first.config.get(key)!r} and {r.config.get(key)!r}")
    seen: set[tuple[str, int, int, int]] = set()
    results: list = []
    for r in reports:
        for p in r.results:
            key = (p.impl, p.n, p.k, p.m)
            if key in seen:
                raise ValueError(f"{p.impl} at N={p.n} K={p.k} M={p.m} is in more than one run")
            seen.add(key)
            results.append(p)

    def union(key: str) -> list:
        out: list = []
        for r in reports:
            for v in r.config.get(key, []):
                if v not in out:
                    out.append(v)
        return out

    config = dict(first.config)
    config.update(shapes=union("shapes"), ms=sorted(union("ms")), impls=union("impls"),
                  runs=[{"timestamp": r.machine.timestamp, "copy_bw_gbps": r.machine.copy_bw_gbps,
                         "dense_bf16_tflops": r.machine.dense_bf16_tflops,
                         "ms": list(r.config.get("ms", [])), "impls": list(r.config.get("impls", []))}
                        for r in reports])
    return BenchReport(machine=first.machine, config=config, results=results)


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _align(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if r else cell.ljust(w)
                      for cell, w, r in zip(row, widths, right)).rstrip() for row in rows]


TABLE_HEADER = ("M", "impl", "time us", "GB/s", "%copyBW", "TFLOP/s", "x cuBLAS", "x peer",
                "best peer", "err(own)", "err(float)", "status")


def format_table(results: Sequence[PointResult], machine: Optional[MachineInfo] = None,
                 config: Optional[Mapping[str, Any]] = None) -> str:
    """The report as plain aligned text: one block per (N, K), rows by M then implementation.

    Unavailable and failed implementations appear as rows with ``-`` numbers; the reasons
    are listed once under each block.
    """
    lines: list[str] = []
    if machine is not None:
        lines.append(f"GPU: {machine.gpu_name} (sm_{machine.compute_capability.replace('.', '')}, "
                     f"{machine.sm_count} SMs, L2 {machine.l2_cache_bytes / 2**20:.0f} MiB)  "
                     f"torch {machine.torch_version} CUDA {machine.cuda_version} "
                     f"triton {machine.triton_version} gemlite {machine.gemlite_version}")
        lines.append(f"measured: device copy {_fmt(machine.copy_bw_gbps, '.0f', ' GB/s')} "
                     f"(read+write), dense bf16 {_fmt(machine.dense_bf16_tflops, '.0f', ' TFLOP/s')}")
    if config:
        quick = "  QUICK RUN (fewer iterations: not a measurement)" if config.get("quick") else ""
        lines.append(f"dtype {config.get('dtype')}, group size {config.get('group_size')}, "
                     f"median of {config.get('iters')} runs (L2 flushed before each){quick}")
    order: dict[str, int] = {}
    for r in results:
        order.setdefault(r.impl, len(order))
    shapes: dict[tuple[int, int], list[PointResult]] = {}
    for r in results:
        shapes.setdefault((r.n, r.k), []).append(r)
    for (n, k), rs in shapes.items():
        lines.append("")
        lines.append(f"N={n} K={k}")
        rows = [list(TABLE_HEADER)]
        notes: dict[str, str] = {}
        for r in sorted(rs, key=lambda r: (r.m, order[r.impl])):
            rows.append([
                str(r.m), r.impl, _fmt(r.time_us, ".1f"), _fmt(r.gbps, ".0f"),
                _fmt(None if r.frac_copy_bw is None else 100 * r.frac_copy_bw, ".0f", "%"),
                _fmt(r.tflops, ".1f"), _fmt(r.speedup_vs_cublas, ".2f", "x"),
                _fmt(r.speedup_vs_best_peer, ".2f", "x"), r.best_peer or "-",
                _fmt(r.err_impl, ".1e"), _fmt(r.err_float, ".1e"), r.status])
            if r.status != OK and r.note:
                key = r.impl if r.status == UNAVAILABLE else f"{r.impl} M={r.m}"
                notes.setdefault(key, f"{r.status}: {r.note}")
        right = [True, False, True, True, True, True, True, True, False, True, True, False]
        lines.extend(_align(rows, right))
        for key, note in notes.items():
            lines.append(f"  {key}: {note}")
    return "\n".join(lines)


def write_plot(results: Sequence[PointResult], path: Path, title: str = "") -> tuple[bool, str]:
    """Plot speedup over cuBLAS against M (log2 axis): one panel per (N, K), one line per
    implementation (ok points only; peers dashed, mixgemm solid, its ``@config`` variants
    dotted in the colour of their weight type). Needs matplotlib (optional).

    Returns
    -------
    (bool, str)
        ``(True, path)`` when written, ``(False, reason)`` when matplotlib is missing or
        nothing can be plotted.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False, "matplotlib is not installed (pip install matplotlib): no plot"
    shapes: list[tuple[int, int]] = []
    impls: list[str] = []
    for r in results:
        if (r.n, r.k) not in shapes:
            shapes.append((r.n, r.k))
        if r.impl not in impls and r.impl != BASELINE:
            impls.append(r.impl)
    if not shapes:
        return False, "no results to plot"
    ncols = min(4, len(shapes))
    nrows = math.ceil(len(shapes) / ncols)
    width = max(4.2 * ncols, 8.0)
    fig = Figure(figsize=(width, 3.4 * nrows + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    # colour by base implementation, marker (and a dotted line) by mixgemm tile config
    bases = list(dict.fromkeys(_base_name(name) for name in impls))
    config_markers = {tc.label: mk for tc, mk in zip(TILE_CONFIGS, "vs^DPX*")}
    colors = {name: f"C{bases.index(_base_name(name)) % 10}" for name in impls}
    markers = {name: config_markers.get(name.partition("@")[2], "o") for name in impls}
    styles = {name: (":" if "@" in name else "-" if name.startswith("mixgemm") else "--")
              for name in impls}
    all_ms = sorted({r.m for r in results})
    for ax, (n, k) in zip(axes.flat, shapes):
        ax.axhline(1.0, color="black", lw=0.8, ls=":", label="cuBLAS (bf16/fp16 weight)")
        for name in impls:
            pts = sorted((r.m, r.speedup_vs_cublas) for r in results
                         if r.impl == name and (r.n, r.k) == (n, k) and r.status == OK
                         and r.speedup_vs_cublas is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[name], ms=3, lw=1.2,
                        ls=styles[name], color=colors[name], label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ms)
        ax.set_xticklabels([str(m) for m in all_ms], rotation=45, fontsize=7)
        ax.set_title(f"N={n} K={k}", fontsize=9)
        ax.set_xlabel("M (tokens)", fontsize=8)
        ax.set_ylabel("speedup over cuBLAS", fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    for ax in list(axes.flat)[len(shapes):]:
        ax.set_visible(False)
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, loc="outside lower center",
               ncol=max(1, min(len(labels), int(width / 2.3))), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True, str(path)


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
                "check_rows": self.check_rows, "seed": self.seed,
                "weight": f"randn * {WEIGHT_STD} (float32)", "activations": "randn",
                "flush": f"{FLUSH_L2_MULTIPLE}x L2 written before every run"}


def _prebuild_mixgemm(impls: Sequence[Impl], dtype: torch.dtype,
                      log: Callable[[str], None], ms: Optional[Sequence[int]] = None) -> dict[str, str]:
    """Build every mixgemm kernel the run needs, in parallel, before timing anything.
    Returns ``{impl name: reason}`` for the implementations whose kernels failed to build."""
    mix = [i for i in impls if isinstance(i, MixgemmImpl)]
    if not mix:
        return {}
    specs = list({s.name: s for i in mix for s in i.kernel_specs(dtype, ms)}.values())
    try:
        from . import build
    except Exception as e:  # pragma: no cover - depends on the environment
        return {i.name: f"mixgemm.build is not importable: {e}" for i in mix}
    try:
        build.build_many(specs, progress=True)
        return {}
    except Exception as e:
        log(f"mixgemm kernels failed to build: {type(e).__name__}: {str(e)[:2000]}")
        failed = {}
        for impl in mix:
            for spec in impl.kernel_specs(dtype, ms):
                try:
                    if not build.is_cached(spec):
                        failed[impl.name] = f"kernel {spec.name} failed to build (see the log above)"
                        break
                except Exception as e2:
                    failed[impl.name] = f"cannot check kernel {spec.name}: {e2}"
                    break
        return failed


def run_benchmark(cfg: BenchConfig, impls: Sequence[Impl], device: torch.device,
                  log: Callable[[str], None] = print) -> list[Measurement]:
    """Prepare every implementation for every shape and measure every (shape, M) point.

    Each implementation's first run at a point is checked against the float64 references
    (on :func:`check_rows`' rows; the whole output for NaN/inf), then :func:`time_cuda`
    times it. Exceptions are recorded, never raised.
    """
    from tqdm import tqdm

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
        deq = impl.dequantized
        key = deq.data_ptr()
        if key not in refs:
            refs[key] = reference_matmul(x_rows, deq)
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


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``mixgemm bench`` options to ``parser`` (the caller sets ``func=run_cli``)."""
    shapes = ",".join(f"{n}x{k}" for n, k in DEFAULT_SHAPES)
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES, metavar="NxK,...",
                        help=f"weight shapes N x K (out x in features), comma separated "
                             f"(default: LLaMA-3 8B/70B layers {shapes})")
    parser.add_argument("--m", type=parse_int_list, default=DEFAULT_MS, metavar="M,...", dest="m",
                        help=f"token counts (default {','.join(map(str, DEFAULT_MS))})")
    parser.add_argument("--impls", type=parse_name_list, default=None, metavar="NAME,...",
                        help=f"implementations to run: names or prefixes, comma separated "
                             f"(default all: {', '.join(impl_names())}); {BASELINE} always runs")
    parser.add_argument("--all-configs", action="store_true",
                        help="also time every mixgemm tile config (mixgemm-<wt>@<label>), to "
                             "tune the heuristic")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                        help="activation dtype (default bf16; torch_int4 needs bf16)")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128, 256),
                        default=DEFAULT_GROUP_SIZE, help="quantization group size (default 128)")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed runs per point, the median is reported (default "
                             f"{MIN_ITERS}, at least {MIN_ITERS} unless --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed runs before timing (default {DEFAULT_WARMUP})")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_ITERS} iterations by default and no minimum "
                             f"(the numbers are not measurements)")
    parser.add_argument("--max-error", type=float, default=DEFAULT_MAX_ERROR,
                        help=f"relative error vs the implementation's own weight above which a "
                             f"mixgemm or cuBLAS point FAILs (default {DEFAULT_MAX_ERROR:g})")
    parser.add_argument("--peer-max-error", type=float, default=DEFAULT_PEER_MAX_ERROR,
                        help=f"the same for torch_int4 and gemlite (default "
                             f"{DEFAULT_PEER_MAX_ERROR:g}: gemlite's GEMV accumulates in bf16)")
    parser.add_argument("--check-rows", type=int, default=DEFAULT_CHECK_ROWS,
                        help=f"output rows compared with the float64 reference (all when M is "
                             f"at most this; default {DEFAULT_CHECK_ROWS})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (default 0)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="write the speedup plot as PNG (needs matplotlib)")
    parser.add_argument("--save", action="store_true",
                        help="write bench.json and bench.png to <results-dir>/<gpu-name-slug>/")
    parser.add_argument("--results-dir", metavar="DIR", default=None,
                        help="root of --save's folders (default benchmarks/results)")
    parser.add_argument("--block", action="store_true",
                        help="instead of the layer grid: a LLaMA-style MLP block (hidden "
                             f"{BLOCK_HIDDEN}, intermediate {BLOCK_INTERMEDIATE}, int4 g128 "
                             "asymmetric) at batch 1 (or --m), bf16 vs mixgemm, both under CUDA "
                             "graphs")
    parser.add_argument("--merge", metavar="JSON", nargs="+", default=None,
                        help="no GPU run: merge the JSON reports of runs that split one grid "
                             "(same GPU, dtype and group size) into one, then write --json / "
                             "--plot / --save from it")
    parser.add_argument("--gpu-name", metavar="NAME", default=None,
                        help="GPU name for the report and the results folder (default: "
                             "the device's name)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m mixgemm.bench``)."""
    parser = argparse.ArgumentParser(
        prog="mixgemm bench",
        description="Time mixgemm's GEMMs against cuBLAS, torch's int4 kernel and gemlite on "
                    "LLaMA-3 layer shapes (see benchmarks/README.md).")
    return add_arguments(parser)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validate parsed options into a :class:`BenchConfig`.

    Raises
    ------
    BenchError
        Too few iterations without ``--quick``, a negative warm-up, a bad ``--impls``,
        ``--check-rows`` below 1 or a non-positive ``--max-error`` / ``--peer-max-error``.
    """
    quick = bool(args.quick)
    iters = args.iters if args.iters is not None else (QUICK_ITERS if quick else MIN_ITERS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if quick else DEFAULT_WARMUP)
    if iters < 1:
        raise BenchError(f"--iters must be at least 1, got {iters}")
    if iters < MIN_ITERS and not quick:
        raise BenchError(f"--iters {iters} is below the minimum of {MIN_ITERS} timed runs per "
                         f"point; pass --quick for a smoke run with fewer")
    if warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {warmup}")
    if args.check_rows < 1:
        raise BenchError(f"--check-rows must be at least 1, got {args.check_rows}")
    if not args.max_error > 0:
        raise BenchError(f"--max-error must be positive, got {args.max_error}")
    if not args.peer_max_error > 0:
        raise BenchError(f"--peer-max-error must be positive, got {args.peer_max_error}")
    try:
        names = select_impl_names(impl_names(args.all_configs), args.impls)
    except ValueError as e:
        raise BenchError(str(e)) from None
    return BenchConfig(
        shapes=tuple(args.shapes), ms=tuple(args.m), impls=tuple(names), dtype=args.dtype,
        group_size=args.group_size, iters=iters, warmup=warmup, quick=quick,
        all_configs=bool(args.all_configs), max_error=float(args.max_error),
        peer_max_error=float(args.peer_max_error),
        check_rows=int(args.check_rows), seed=int(args.seed), json_path=args.json,
        plot_path=args.plot, save=bool(args.save), results_root=args.results_dir,
        gpu_name=args.gpu_name)


def require_cuda() -> torch.device:
    """The current CUDA device; :class:`BenchError` with a clear message when there is none."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise BenchError(NO_GPU_MESSAGE)
    return torch.device("cuda", torch.cuda.current_device())


def _user_error(message: str) -> Exception:
    """A :class:`mixgemm.errors.CliError`, which ``mixgemm`` prints as one line."""
    return CliError(message)


def write_outputs(report: BenchReport, cfg: BenchConfig, log: Callable[[str], None] = print) -> list[Path]:
    """Write the JSON and plot files that ``cfg`` asks for; returns the paths written."""
    written: list[Path] = []
    targets_json = [Path(cfg.json_path)] if cfg.json_path else []
    targets_plot = [Path(cfg.plot_path)] if cfg.plot_path else []
    if cfg.save:
        folder = results_dir(Path(cfg.results_root) if cfg.results_root else default_results_root(),
                             report.machine.gpu_name)
        targets_json.append(folder / "bench.json")
        targets_plot.append(folder / "bench.png")
    for path in targets_json:
        written.append(write_json(path, report))
        log(f"wrote {path}")
    title = (f"{report.machine.gpu_name}: speedup over cuBLAS ({report.config.get('dtype')}, "
             f"group {report.config.get('group_size')})")
    for path in targets_plot:
        ok, what = write_plot(report.results, path, title=title)
        if ok:
            written.append(Path(what))
            log(f"wrote {what}")
        else:
            log(f"plot not written: {what}")
    return written


# ---------------------------------------------------------------------------------------------
# --block: a decoder MLP block, bf16 against mixgemm (fused gate+up with swiglu, then down)
# ---------------------------------------------------------------------------------------------
BLOCK_HIDDEN = 4096
BLOCK_INTERMEDIATE = 14336


@dataclasses.dataclass(frozen=True)
class BlockResult:
    m: int
    bf16_us: float
    mixgemm_us: float
    rel_err: float          # mixgemm block vs the bf16 block on the same dequantized weights

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.mixgemm_us


def bench_block(device: torch.device, ms: Sequence[int], iters: int, warmup: int,
                hidden: int = BLOCK_HIDDEN, intermediate: int = BLOCK_INTERMEDIATE,
                group_size: int = 128, seed: int = 0) -> list[BlockResult]:
    """Time ``down(silu(gate(x)) * up(x))`` in bf16 (three cuBLAS GEMMs and the elementwise op)
    and with mixgemm (:meth:`QuantLinear.from_gate_up`: one launch for gate, up and swiglu, then
    down: two launches at any M), each captured in a CUDA graph and replayed, L2 flushed before
    every replay. The bf16 block uses the very weights mixgemm dequantizes to, so the error is the
    kernels' alone."""
    from torch import nn

    from .nn import QuantLinear
    from .quantize import deinterleave_rows, dequantize_reference

    torch.manual_seed(seed)
    dtype = torch.bfloat16
    gate = nn.Linear(hidden, intermediate, bias=False).to(device, dtype)
    up = nn.Linear(hidden, intermediate, bias=False).to(device, dtype)
    down = nn.Linear(intermediate, hidden, bias=False).to(device, dtype)
    for lin in (gate, up, down):
        lin.weight.data.normal_(0, WEIGHT_STD)
    q_gu = QuantLinear.from_gate_up(gate, up, bits=4, group_size=group_size)
    q_down = QuantLinear.from_linear(down, bits=4, group_size=group_size)
    # the bf16 block on the dequantized weights
    deq_gate, deq_up = deinterleave_rows(dequantize_reference(q_gu.packed))
    gate.weight.data.copy_(deq_gate)
    up.weight.data.copy_(deq_up)
    down.weight.data.copy_(dequantize_reference(q_down.packed))
    del deq_gate, deq_up

    def bf16_block(x):
        return down(torch.nn.functional.silu(gate(x)) * up(x))

    def mixgemm_block(x):
        return q_down(q_gu(x))

    flush = flush_size(torch.cuda.get_device_properties(device).L2_cache_size)
    out: list[BlockResult] = []
    for m in ms:
        x = torch.randn(m, hidden, device=device, dtype=dtype)
        times = {}
        outputs = {}
        with torch.no_grad():
            for name, fn in (("bf16", bf16_block), ("mixgemm", mixgemm_block)):
                fn(x)                                     # warm-up: loads the kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = fn(x)
                stats = time_cuda(graph.replay, iters, warmup, flush, device=device)
                times[name] = stats.median_us
                outputs[name] = y.clone()
                del graph
        err = relative_error(outputs["mixgemm"].float(), outputs["bf16"].double())
        out.append(BlockResult(m, times["bf16"], times["mixgemm"], err))
    return out


def run_block_cli(cfg: "BenchConfig", device: torch.device, log: Callable[[str], None]) -> int:
    ms = cfg.ms if tuple(cfg.ms) != tuple(DEFAULT_MS) else (1,)
    props = torch.cuda.get_device_properties(device)
    log(f"mixgemm bench --block on {props.name}: LLaMA MLP hidden {BLOCK_HIDDEN}, intermediate "
        f"{BLOCK_INTERMEDIATE}, int4 g{cfg.group_size} asymmetric, CUDA graphs, median of {cfg.iters} replays")
    results = bench_block(device, ms, cfg.iters, cfg.warmup, group_size=cfg.group_size, seed=cfg.seed)
    rows = [("M", "bf16 us", "mixgemm us", "speedup", "rel err")]
    rows += [(str(r.m), f"{r.bf16_us:.1f}", f"{r.mixgemm_us:.1f}", f"{r.speedup:.2f}x", f"{r.rel_err:.1e}")
             for r in results]
    for line in _align(rows, [True] * 5):
        log(line)
    if cfg.json_path:
        payload = {"gpu": props.name, "block": {"hidden": BLOCK_HIDDEN, "intermediate": BLOCK_INTERMEDIATE,
                                                 "bits": 4, "group_size": cfg.group_size},
                   "results": [dict(dataclasses.asdict(r), speedup=r.speedup) for r in results]}
        _atomic_write_text(Path(cfg.json_path), json.dumps(payload, indent=1))
        log(f"wrote {cfg.json_path}")
    bad = [r for r in results if not r.rel_err < 5e-2]
    return 1 if bad else 0


def _merge_cli(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """``mixgemm bench --merge A.json B.json ...``: one report from split runs."""
    try:
        report = merge_reports([read_json(Path(p)) for p in args.merge])
    except (OSError, ValueError, TypeError) as e:
        raise _user_error(f"--merge: {e}") from None
    if not (args.json or args.plot or args.save):
        raise _user_error("--merge needs --json, --plot or --save")
    cfg = BenchConfig(json_path=args.json, plot_path=args.plot, save=args.save,
                      results_root=args.results_dir)
    log(format_table(report.results, report.machine, report.config))
    write_outputs(report, cfg, log=log)
    return 1 if any(r.status == FAIL for r in report.results) else 0


def run_cli(args: argparse.Namespace) -> int:
    """Run ``mixgemm bench`` with parsed ``args``; the exit status.

    Returns 0 when every point that ran is correct, 1 when any point FAILed (a wrong or
    non-finite result). User errors (no GPU, bad options) raise ``mixgemm.cli.CliError``.
    """
    if getattr(args, "merge", None):
        return _merge_cli(args, print)
    try:
        device = require_cuda()
        cfg = config_from_args(args)
    except BenchError as e:
        raise _user_error(str(e)) from None
    torch.cuda.set_device(device)
    log = print
    if getattr(args, "block", False):
        return run_block_cli(cfg, device, log)
    props = torch.cuda.get_device_properties(device)
    log(f"mixgemm bench on {props.name}: {len(cfg.shapes)} shapes x {len(cfg.ms)} M x "
        f"{len(cfg.impls)} implementations, {cfg.dtype}, group {cfg.group_size}, "
        f"median of {cfg.iters} runs{' (QUICK)' if cfg.quick else ''}")
    log("measuring the device copy bandwidth and the dense bf16 matmul rate ...")
    copy_bw = measure_copy_bandwidth(device, iters=cfg.iters, warmup=cfg.warmup)
    dense = measure_dense_tflops(device, iters=cfg.iters, warmup=cfg.warmup)
    machine = machine_info(device, cfg.gpu_name, copy_bw, dense)
    log(f"device copy {copy_bw:.0f} GB/s (read+write), dense bf16 {dense:.0f} TFLOP/s")

    cache = QuantCache()
    impls = make_impls(cfg.impls, cfg.group_size, cache)
    measurements = run_benchmark(cfg, impls, device, log=log)
    cache.clear()
    results = analyze(measurements, copy_bw, cfg.max_error, cfg.group_size, cfg.peer_max_error)
    report = BenchReport(machine=machine, config=cfg.to_json(), results=results)
    log(format_table(results, machine, report.config))
    write_outputs(report, cfg, log=log)
    failed = [r for r in results if r.status == FAIL]
    if failed:
        print(f"mixgemm bench: {len(failed)} point(s) FAILED (wrong or non-finite results): "
              + ", ".join(sorted({r.impl for r in failed})), file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mixgemm.bench [options]``: parse, run, return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    try:
        return run_cli(args)
    except CliError as e:   # BenchError is one
        print(f"mixgemm bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mixgemm bench: interrupted", file=sys.stderr)
        return 130


__all__ = [
    "DEFAULT_SHAPES", "DEFAULT_MS", "MIN_ITERS", "BenchConfig", "BenchReport", "MachineInfo",
    "Measurement", "PointResult", "TimingStats", "Impl", "CublasImpl", "TorchInt4Impl",
    "GemliteImpl", "MixgemmImpl", "QuantCache", "add_arguments", "analyze", "check_rows",
    "effective_gbps", "expected_weight_bytes", "flush_size", "format_table", "impl_names",
    "make_impls", "parse_shapes", "read_json", "run_benchmark", "run_cli", "select_impl_names",
    "summarize_times", "tflops", "time_cuda", "torch_int4_dequant", "torch_int4_params",
    "traffic_bytes", "write_json", "write_plot",
]

if __name__ == "__main__":
    sys.exit(main())
