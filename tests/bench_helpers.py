"""Helpers shared by the benchmark harness's tests (tests/bench/test_bench*.py): fake measurements,
a machine description, the standalone parser, and a CPU clock for the runs."""
from __future__ import annotations

from mixgemm import bench
from mixgemm.bench import MachineInfo, Measurement, summarize_times

# N = K = 4096, group 128: G = 32 groups, so one [G, N] table of 16-bit scales is 262,144 bytes.
N = K = 4096
G_TABLE = 32 * 4096 * 2


def stats(us: float, iters: int = 100) -> bench.TimingStats:
    return summarize_times([us / 1e3] * iters)


def meas(impl, us=None, m=16, n=N, k=K, err_impl=1e-3, err_float=0.05, **kw) -> Measurement:
    if us is None:
        return Measurement(impl, n, k, m, **kw)
    return Measurement(impl, n, k, m, weight_bytes=kw.pop("weight_bytes", None), timing=stats(us),
                       err_impl=err_impl, err_float=err_float, **kw)


def machine(**kw) -> MachineInfo:
    base = dict(gpu_name="NVIDIA H100 80GB HBM3", device_name="NVIDIA H100 80GB HBM3",
                compute_capability="9.0", sm_count=132, l2_cache_bytes=50 << 20,
                memory_bytes=80 << 30, torch_version="2.11.0+cu130", cuda_version="13.0",
                triton_version="3.6.0", gemlite_version="0.6.0.post2", mixgemm_version="0.1.0",
                python_version="3.12.3", copy_bw_gbps=3000.0, dense_bf16_tflops=790.0,
                timestamp="2026-01-01T00:00:00+00:00", read_bw_gbps=None)
    base.update(kw)
    return MachineInfo(**base)


def by_impl(results, m=16):
    return {r.impl: r for r in results if r.m == m}



def parse(*argv):
    """``mixgemm bench``'s options parsed by the standalone parser."""
    return bench.build_parser().parse_args(list(argv))



class WallClock:
    """A CPU stand-in for the CUDA clock (the run's logic, not its numbers, is under test)."""

    def flush(self):
        pass

    def mark(self):
        import time
        return time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_ms(self, start, end):
        return (end - start) * 1e3


class ReplayGraph:
    """A CPU stand-in for a captured CUDA graph: replay calls the captured function again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def generate_run_on_the_cpu(monkeypatch, run_module, host_us: float, gpu_loop_us: float) -> None:
    """Replace the CUDA-only parts of ``mixgemm.bench.generate_run`` (``run_module``): the cycle
    and flush probes, the CUDA-event clock, graph capture (:class:`ReplayGraph`) and the host-time
    measurement (``host_us`` / ``gpu_loop_us`` for every call)."""
    from mixgemm.bench.host import HostPoint

    monkeypatch.setattr(run_module, "measure_cycles_per_us", lambda device: 1000.0)
    monkeypatch.setattr(run_module, "device_flush_size", lambda device: 0)
    monkeypatch.setattr(run_module, "CudaEventClock", lambda flush, device: WallClock())
    monkeypatch.setattr(run_module, "cuda_capture", lambda fn: (ReplayGraph(fn), fn()))
    monkeypatch.setattr(run_module, "measure_host", lambda fn, impl, m, *a, **k: HostPoint(
        impl, m, 0, 0, bench.OK, host_us=host_us, gpu_loop_us=gpu_loop_us, queued=True))
