"""The timing harness of the session-12 experiment scripts: a CUDA graph of ``fn`` replayed after
an L2 flush (a 2x-L2 write and a 2x-L2 read before every replay), CUDA events, the median."""
import statistics

import torch

DEV = torch.device("cuda", 0)
L2 = torch.cuda.get_device_properties(DEV).L2_cache_size if torch.cuda.is_available() else 0
_wbuf = _rbuf = _sink = None


def flush() -> None:
    global _wbuf, _rbuf, _sink
    if _wbuf is None:
        _wbuf = torch.empty(2 * L2, dtype=torch.uint8, device=DEV)
        _rbuf = torch.ones(2 * L2 // 4, dtype=torch.float32, device=DEV)
        _sink = torch.empty((), dtype=torch.float32, device=DEV)
    _wbuf.fill_(3)
    _sink.copy_(_rbuf.sum())


def time_graph(fn, iters: int = 40, pre=flush) -> float:
    """Median us of one replay of a graph of ``fn`` (warmed up twice on a side stream first),
    ``pre()`` before every replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        pre()
        g.replay()
    ev = []
    for _ in range(iters):
        pre()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        ev.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def read_gbps() -> float:
    """The read bandwidth from a 1 GiB float32 sum, median of 10."""
    big = torch.ones(1 << 28, dtype=torch.float32, device=DEV)
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        big.sum()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return (1 << 30) / (statistics.median(ts) * 1e-3) / 1e9
