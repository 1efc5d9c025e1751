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
