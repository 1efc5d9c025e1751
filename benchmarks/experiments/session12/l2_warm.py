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
from harness import flush, time_graph

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
            res["cold"] = time_graph(lambda: layer(x), pre=flush)
            res["warm"] = time_graph(lambda: layer(x), pre=lambda: None)
            res["spin"] = time_graph(lambda: (torch.cuda._sleep(40000), layer(x)), pre=flush)
            res["pf"] = time_graph(lambda: (prefetch_same_stream(), layer(x)), pre=flush)
            res["pf+spin"] = time_graph(lambda: (prefetch_same_stream(), torch.cuda._sleep(40000), layer(x)), pre=flush)
            res["pf+spin_only"] = time_graph(lambda: (prefetch_same_stream(), torch.cuda._sleep(40000)), pre=flush)
        res = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}
        rows.append(res); print(json.dumps(res), flush=True)
open(sys.argv[1], "w").write(json.dumps(rows, indent=1))
