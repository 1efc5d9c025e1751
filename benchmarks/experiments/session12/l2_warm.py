"""Session 12: does a decode GEMM run faster when its weights are in L2? One QuantLinear per shape,
M = 1, one-kernel graphs: cold (L2 flushed), warm (no flush: the previous replay's reads), and
flushed then prefetched (l2_prefetch on the same stream, with and without a spin between)."""
import json, statistics, sys
import torch
sys.path.insert(0, __import__("os").path.dirname(__file__))
import prefetch_step as ps
from mixgemm.bench import variants
from mixgemm.nn import QuantLinear

dev = ps.dev
ps.FUNC = ps.load_prefetch()
L2 = ps.L2
wbuf = torch.empty(2 * L2, dtype=torch.uint8, device=dev)
rbuf = torch.ones(2 * L2 // 4, dtype=torch.float32, device=dev)
sink = torch.empty((), dtype=torch.float32, device=dev)
def flush():
    wbuf.fill_(3); sink.copy_(rbuf.sum())

def time_graph(fn, pre, iters=50):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        pre(); g.replay()
    ev = []
    for _ in range(iters):
        pre()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); ev.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)

rows = []
for wt in sys.argv[2].split(","):
    for shape in ("4096x4096", "6144x4096", "4096x14336", "28672x4096"):
        n, k = map(int, shape.split("x"))
        w = torch.randn(n, k, device=dev) * 0.02
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        layer = QuantLinear.from_linear(lin, bits=int(wt[1]), group_size=128, symmetric=wt[0] == "s")
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ts = [t for t in (layer.qdata, layer.scales, layer.zeros, layer.zero_offsets) if t is not None]
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        pf = ps.Prefetcher(0, 4096, 16)
        def prefetch_same_stream():
            from cuda.bindings import driver as drv
            import ctypes
            r = ps.Ranges()
            for i, t in enumerate(ts):
                r.ptr[i], r.bytes[i], r.keep_lo[i], r.keep_hi[i] = t.data_ptr(), t.numel() * t.element_size(), 0, 8
            r.count, r.mode, r.chunk = len(ts), 0, 4096
            argv = (ctypes.c_void_p * 1)(ctypes.addressof(r))
            ps.check(drv.cuLaunchKernel(ps.FUNC, 16, 1, 1, 128, 1, 1, 0, drv.CUstream(torch.cuda.current_stream().cuda_stream),
                                        ctypes.addressof(argv), 0), "pf")
        with torch.no_grad():
            res = dict(weight=wt, shape=shape, mb=round(nbytes / 1e6, 2))
            res["cold"] = time_graph(lambda: layer(x), flush)
            res["warm"] = time_graph(lambda: layer(x), lambda: None)
            res["spin"] = time_graph(lambda: (torch.cuda._sleep(40000), layer(x)), flush)
            res["pf"] = time_graph(lambda: (prefetch_same_stream(), layer(x)), flush)
            res["pf+spin"] = time_graph(lambda: (prefetch_same_stream(), torch.cuda._sleep(40000), layer(x)), flush)
            res["pf+spin_only"] = time_graph(lambda: (prefetch_same_stream(), torch.cuda._sleep(40000)), flush)
        res = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}
        rows.append(res); print(json.dumps(res), flush=True)
open(sys.argv[1], "w").write(json.dumps(rows, indent=1))
