"""A/B: the llama3-8b GEMM chain (4 layers x qkv, o, gate/up swiglu, down; one graph) and each GEMM alone,
with whatever mixgemm is on PYTHONPATH (old tree: session-8 decode kernel; new: weights before the grid wait)."""
import json, os, statistics, sys
import torch
import mixgemm
TAG = sys.argv[1]; OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)
L2 = torch.cuda.get_device_properties(dev).L2_cache_size
_w = torch.empty(2 * L2, dtype=torch.uint8, device=dev); _r = torch.ones(2 * L2 // 4, device=dev); _s = torch.empty((), device=dev)
def flush():
    torch.cuda._sleep(300_000); _w.fill_(3); _s.copy_(_r.sum())
def tg(fn, iters=40):
    fn(); torch.cuda.synchronize(); g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    for _ in range(3): flush(); g.replay()
    ev = []
    for _ in range(iters):
        flush(); a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); ev.append((a, b))
    torch.cuda.synchronize(); return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)
SH = [(6144, 4096, None), (4096, 4096, None), (28672, 4096, "swiglu"), (4096, 14336, None)]
res = {}
for rep in range(int(os.environ.get("REPS", "1"))):
  for bits, sym, name in ((4, False, "u4"), (2, False, "u2"), (8, True, "s8")):
    torch.manual_seed(0)
    layers = [[(mixgemm.prepack(mixgemm.quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16), bits, 128, symmetric=sym)), act)
               for n, k, act in SH] for _ in range(4)]
    xs = {k: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for k in (4096, 14336)}
    outs = {(n, a): torch.empty(1, n // 2 if a else n, device=dev, dtype=torch.bfloat16) for n, k, a in SH}
    def run():
        for lay in layers:
            for pw, act in lay: mixgemm.gemm(xs[pw.k], pw, out=outs[(pw.n, act)], activation=act)
    chain = tg(run, 30) / 4
    iso = [tg(lambda pw=pw, act=act: mixgemm.gemm(xs[pw.k], pw, out=outs[(pw.n, act)], activation=act)) for pw, act in layers[0]]
    r = res.setdefault(name, {"chain": [], "iso": []}); r["chain"].append(chain); r["iso"].append(iso)
    print(f"[{TAG}] rep {rep} {name}: chain {chain:6.1f} us/layer; alone " + ", ".join(f"{v:.1f}" for v in iso), flush=True)
    del layers; torch.cuda.empty_cache()
open(os.path.join(OUT, f"ab_{TAG}.json"), "w").write(json.dumps(res))
