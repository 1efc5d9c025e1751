"""Session 17: CTAs of 7 or 6 warps (112 / 96 weight rows) against 8 (128), for the grid's balance.

NOTES 21a: gate/up (28672x4096) runs 224 CTAs of 8 warps on 132 SMs, two on 93 SMs and one on 38,
and the CTAs alone on an SM finish ~3 us before those that share one. With 7 warps the grid is
256 CTAs (two on 124 SMs). Here: the four llama3-8b projections, u4, M = 1, in chains of 8
launches over 4 distinct weights (one graph, L2 flushed before it), every split factor, warps 8 /
7 / 6; us per launch; each kernel's output checked against the 8-warp kernel's.
usage: warps.py OUT.json
"""
import json, os, sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV as dev, read_gbps, time_graph  # noqa: E402

import mixgemm  # noqa: E402
from mixgemm import build, ops  # noqa: E402
from mixgemm.specs import Activation, DecodeSpec  # noqa: E402
from mixgemm.types import ActType, WeightType  # noqa: E402

SHAPES = (("qkv", 6144, 4096, Activation.NONE), ("o", 4096, 4096, Activation.NONE),
          ("gate_up", 28672, 4096, Activation.SWIGLU), ("down", 4096, 14336, Activation.NONE))
WARPS = (8, 7, 6)


def spec(w, act):
    return DecodeSpec(ActType.BF16, WeightType.U4, tokens=8, warps=w, activation=act)


def main():
    specs = [spec(w, a) for w in WARPS for a in (Activation.NONE, Activation.SWIGLU)]
    build.build_many(specs, jobs=16, progress=False)
    out = dict(read_gbps=read_gbps(), rows=[])
    for name, n, k, act in SHAPES:
        ws = [mixgemm.prepack(mixgemm.quantize(torch.randn(n, k, device=dev) * 0.02, 4, 128,
                                               dtype=torch.bfloat16)) for _ in range(4)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = ops.gemm_with_spec(x, ws[0], spec(8, act), splits=1).float()
        nbytes = sum(t.numel() * t.element_size() for t in (ws[0].qdata, ws[0].scales, ws[0].zeros))
        row = dict(layer=name, n=n, k=k, floor_us=nbytes / (out["read_gbps"] * 1e3), times={})
        for w in WARPS:
            s = spec(w, act)
            for splits in range(1, 9):
                try:
                    y = ops.gemm_with_spec(x, ws[0], s, splits=splits).float()
                except Exception as e:   # (a split the kernel refuses)
                    row["times"][f"w{w}s{splits}"] = str(e)[:80]
                    continue
                err = ((y - ref).norm() / ref.norm()).item()
                t = time_graph(lambda: [ops.gemm_with_spec(x, ws[i % 4], s, splits=splits) for i in range(8)]) / 8
                row["times"][f"w{w}s{splits}"] = dict(us=round(t, 2), err=err)
        best = {w: min((v["us"], kk) for kk, v in row["times"].items() if kk.startswith(f"w{w}s") and isinstance(v, dict))
                for w in WARPS}
        row["best"] = {f"w{w}": dict(us=b[0], at=b[1]) for w, b in best.items()}
        print(name, {kk: v for kk, v in row["best"].items()}, f"floor {row['floor_us']:.1f}", flush=True)
        out["rows"].append(row)
        del ws
        torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
