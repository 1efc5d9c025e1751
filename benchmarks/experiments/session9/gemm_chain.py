"""Session-9 experiment 3: (a) the timing method's own floor (empty graph, pure reads), (b) the
llama3-8b GEMM chain (4 layers x qkv, o, gate/up swiglu, down) per config, with the kernels'
in-chain durations from torch.profiler. Run twice: with and without MIXGEMM_NVCC_FLAGS=
-DMIXGEMM_DECODE_EARLY_TRIGGER=1. Appends to $OUT/chain3.jsonl."""
import json, os, statistics, sys
import torch
import mixgemm
from mixgemm import ops
from mixgemm.specs import Activation, DecodeSpec
from mixgemm.types import ActType, WeightType
OUT = os.environ.get("OUT", "/tmp"); TAG = sys.argv[1]
dev = torch.device("cuda", 0)
L2 = torch.cuda.get_device_properties(dev).L2_cache_size
_wbuf = torch.empty(2 * L2, dtype=torch.uint8, device=dev)
_rbuf = torch.ones(2 * L2 // 4, dtype=torch.float32, device=dev)
_sink = torch.empty((), dtype=torch.float32, device=dev)
def flush(mode="rflush"):
    torch.cuda._sleep(300_000)
    if mode != "none":
        _wbuf.fill_(3); _sink.copy_(_rbuf.sum())
def time_graph(fn, iters=40, mode="rflush", prof=False):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        flush(mode); g.replay()
    ev = []
    for _ in range(iters):
        flush(mode)
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); ev.append((a, b))
    torch.cuda.synchronize()
    t = statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)
    kern = None
    if prof:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(10):
                flush(mode); g.replay()
            torch.cuda.synchronize()
        evs = sorted([e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA and "mixgemm" in e.name],
                     key=lambda e: e.time_range.start)
        kern = {}
        for e in evs:
            kern.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
        kern = {k_: statistics.median(v) for k_, v in kern.items()}
    return t, kern
out = open(os.path.join(OUT, "chain3.jsonl"), "a")
if TAG == "off":
    x1 = torch.zeros(1, device=dev)
    base = {"empty": time_graph(lambda: x1.add_(1))[0]}
    for mb in (9, 33, 62, 120):
        buf = torch.ones(mb * (1 << 20) // 4, device=dev)
        base[f"sum{mb}MB"] = time_graph(lambda: _sink.copy_(buf.sum()))[0]
    print("timing baselines (us):", {k: round(v, 2) for k, v in base.items()}, flush=True)
    out.write(json.dumps({"baselines": base}) + "\n")
SH = [(6144, 4096, None), (4096, 4096, None), (28672, 4096, "swiglu"), (4096, 14336, None)]
BEST = {  # sweep2's best (ks, splits) per (m, weight, shape)
    (1, "u4"): [(2, 2), (4, 1), (1, 1), (1, 6)], (1, "u2"): [(4, 0), (4, 2), (1, 1), (1, 6)],
    (1, "s8"): [(8, 1), (8, 1), (8, 1), (8, 0)],
    (16, "u4"): [(1, 4), (1, 3), (1, 2), (1, 16)], (16, "s8"): [(1, 4), (2, 2), (1, 0), (1, 0)]}
for m, wname in ((1, "u4"), (1, "u2"), (1, "s8"), (16, "u4")):
    wt = WeightType(wname); tok = 8 if m <= 8 else 16
    layers = []
    torch.manual_seed(0)
    for _ in range(4):
        layers.append([(mixgemm.prepack(mixgemm.quantize((torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16),
                                                          wt.bits, 128, symmetric=wt.signed)), act) for n, k, act in SH])
    xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in (4096, 14336)}
    outs = {(n, act): torch.empty(m, n // 2 if act else n, device=dev, dtype=torch.bfloat16) for n, k, act in SH}
    def run(cfg):
        for lay in layers:
            for i, (pw, act) in enumerate(lay):
                x, y = xs[pw.k], outs[(pw.n, act)]
                if cfg is None:
                    mixgemm.gemm(x, pw, out=y, activation=act)
                else:
                    ks, s = cfg[i]
                    spec = DecodeSpec(ActType.BF16, wt, tok, 8, max(1024, 128 * wt.bits), 4, Activation(act or "none"), ks)
                    ops.gemm_with_spec(x, pw, spec, out=y, activation=act, splits=s)
    floor = sum(pw.nbytes for pw, _ in layers[0]) / 3.04e3
    for name, cfg in (("default", None), ("best", BEST[(m, wname)])):
        t, kern = time_graph(lambda: run(cfg), iters=30, prof=True)
        print(f"[{TAG}] chain M={m} {wname} {name:8s}: {t / 4:6.1f} us/layer (floor {floor:5.1f}); in-chain kernel durations (us): "
              + ", ".join(f"{k_.split('_')[3]}:{v:5.1f}" for k_, v in kern.items()), flush=True)
        # isolated (one kernel per graph) for comparison
        out.write(json.dumps({"tag": TAG, "m": m, "weight": wname, "cfg": name, "us_per_layer": t / 4, "floor": floor,
                              "kernels": kern}) + "\n")
    # each GEMM alone: no PDL predecessor
    iso = []
    for i, (pw, act) in enumerate(layers[0]):
        ks, s = BEST[(m, wname)][i]
        spec = DecodeSpec(ActType.BF16, wt, tok, 8, max(1024, 128 * wt.bits), 4, Activation(act or "none"), ks)
        iso.append(time_graph(lambda: ops.gemm_with_spec(xs[pw.k], pw, spec, out=outs[(pw.n, act)], activation=act, splits=s))[0])
    print(f"[{TAG}]   isolated best: " + ", ".join(f"{v:.2f}" for v in iso), flush=True)
    del layers; torch.cuda.empty_cache()
