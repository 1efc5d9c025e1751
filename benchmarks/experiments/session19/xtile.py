"""Session 19: does the 16-token decode kernel lose to the 8-token one through its x tile?

At M = 16 a CTA holds x[:16, its k-range] in shared memory: 16 x 2 bytes per k against the 128 x
0.5 bytes per k of int4 weight it streams, so the x tile is half the size of the weights a CTA
reads, it bounds the CTAs per SM (ring 32 KB + x tile + scale rows), and the planner must split
K finely to fit. The kernel's instruction stream does not depend on M (rows past the last token
repeat it). So the same dec16 kernel at M = 2 (a 2-row x tile) against M = 16, at every split,
separates the x tile's cost from the 2 token tiles' MMAs. dec8 at M = 1 and 8 for reference.
Chains of 8 launches over 4 distinct weights in one graph, L2 flushed before it, us per launch.
usage: xtile.py OUT.json
"""
import json, os, sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV as dev, read_gbps, time_graph  # noqa: E402

import mixgemm  # noqa: E402
from mixgemm import build, ops  # noqa: E402
from mixgemm.specs import Activation, DecodeSpec  # noqa: E402
from mixgemm.types import ActType, WeightType  # noqa: E402

SHAPES = (("gate_up", 28672, 4096, Activation.SWIGLU), ("down", 4096, 14336, Activation.NONE),
          ("qkv", 6144, 4096, Activation.NONE), ("70b_gate_up", 57344, 8192, Activation.SWIGLU))
RUNS = ((8, 1), (8, 8), (16, 1), (16, 2), (16, 8), (16, 16))   # (token tile, M)


def spec(tokens, act):
    return DecodeSpec(ActType.BF16, WeightType.U4, tokens=tokens, activation=act)


def main():
    specs = [spec(t, a) for t in (8, 16) for a in (Activation.NONE, Activation.SWIGLU)]
    build.build_many(specs, jobs=16, progress=False)
    out = dict(read_gbps=read_gbps(), rows=[])
    for name, n, k, act in SHAPES:
        ws = [mixgemm.prepack(mixgemm.quantize(torch.randn(n, k, device=dev) * 0.02, 4, 128,
                                               dtype=torch.bfloat16)) for _ in range(4)]
        nbytes = sum(t.numel() * t.element_size() for t in (ws[0].qdata, ws[0].scales, ws[0].zeros))
        row = dict(layer=name, n=n, k=k, floor_us=nbytes / (out["read_gbps"] * 1e3), times={})
        for tokens, m in RUNS:
            s = spec(tokens, act)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = None
            for splits in (1, 2, 3, 4, 6, 8):
                key = f"t{tokens}m{m}s{splits}"
                try:
                    y = ops.gemm_with_spec(x, ws[0], s, splits=splits).float()
                except Exception as e:   # (a split the kernel refuses)
                    row["times"][key] = str(e)[:80]
                    continue
                ref = y if ref is None else ref   # (against the first split that runs)
                err = ((y - ref).norm() / ref.norm()).item()
                t = time_graph(lambda: [ops.gemm_with_spec(x, ws[i % 4], s, splits=splits) for i in range(8)]) / 8
                row["times"][key] = dict(us=round(t, 2), err=err)
            ok = [(v["us"], kk) for kk, v in row["times"].items() if kk.startswith(f"t{tokens}m{m}s") and isinstance(v, dict)]
            best = min(ok)
            row.setdefault("best", {})[f"t{tokens}m{m}"] = dict(us=best[0], at=best[1])
            print(name, f"t{tokens} m{m}", best, " ".join(f"{kk.split('s')[-1]}:{v['us']}" for kk, v in row["times"].items()
                                                     if kk.startswith(f"t{tokens}m{m}s") and isinstance(v, dict)),
                  f"floor {row['floor_us']:.1f}", flush=True)
        out["rows"].append(row)
        del ws
        torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
