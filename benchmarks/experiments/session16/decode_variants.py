"""session 16: decode kernel variants x split-K on one H200, the 70B layer shapes at TP=1 and TP=2 (M=1):
is the H200's gap to the byte floor a split choice or the depth of the weight stream?"""
import sys, json, statistics
sys.path.insert(0, "tools")
import torch, mixgemm
from mixgemm import build, ops
from mixgemm.specs import DecodeSpec
from mixgemm.types import ActType, WeightType
from sweep_decode import Timer
dev = torch.device("cuda"); timer = Timer(dev)
shapes = [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672), (5120, 8192), (8192, 4096), (28672, 8192), (8192, 14336)]
weights = [WeightType(w) for w in sys.argv[2].split(",")]
variants = [dict(warps=8, stage_bytes=1024, stages=4), dict(warps=8, stage_bytes=1024, stages=8),
            dict(warps=8, stage_bytes=2048, stages=4), dict(warps=4, stage_bytes=1024, stages=8),
            dict(warps=16, stage_bytes=1024, stages=4)]
specs = {(w.value, i): DecodeSpec(ActType.BF16, w, tokens=8, **v) for w in weights for i, v in enumerate(variants)}
build.build_many(sorted(set(specs.values()), key=lambda s: s.name), progress=False, jobs=16)
big = torch.ones(1 << 28, device=dev); ts = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); big.sum(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
bw = (1 << 30) / statistics.median(ts[5:]) / 1e6
print(f"read GB/s {bw:.0f}", flush=True); del big
splits = [0, 1, 2, 3, 4, 6, 8, 12, 16]
rows = []
for n, k in shapes:
    wf = torch.randn(n, k, device=dev) * 0.02
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16); y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    for w in weights:
        packed = mixgemm.prepack(mixgemm.quantize(wf, w.bits, 128, symmetric=w.signed, dtype=torch.bfloat16))
        floor = packed.nbytes / bw / 1e3
        for i in range(len(variants)):
            spec = specs[(w.value, i)]
            res = {}
            for s in splits:
                try:
                    res[s] = min(timer.time(lambda: ops.gemm_with_spec(x, packed, spec, out=y, splits=s), 30) for _ in range(2))
                except (ValueError, RuntimeError) as e:
                    pass
            bs = min(res, key=res.get)
            rows.append(dict(n=n, k=k, weight=w.value, spec=spec.name, floor_us=floor, times=res))
            print(f"{n}x{k} {w.value} {spec.name}: floor {floor:.1f}  best s{bs} {res[bs]:.1f} ({floor/res[bs]:.0%})  planner {res.get(0, float('nan')):.1f}  " +
                  " ".join(f"s{s}:{t:.1f}" for s, t in res.items()), flush=True)
        del packed
json.dump(dict(read_gbps=bw, rows=rows), open(sys.argv[1], "w"), indent=1)
