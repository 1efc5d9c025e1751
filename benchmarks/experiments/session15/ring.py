"""Session 15: the decode kernel's ring shape after the instruction cut (NOTES 19d).

Section 8c found the 4 x 1 KB ring within 1% of the best ring when the stage loop cost ~100
instructions per atom. Section 19a cut the per-atom work, so the per-stage work (barrier wait,
chunk loads, bulk-copy issue: ~33 instructions) is now a larger share, most for u4 (2 atoms per
1 KB stage) and u2 (4 atoms). This times the 8-token decode kernel with other rings: stage bytes
x stages, at every split factor of --splits, best of two passes; one-launch CUDA graphs after a
clean L2 flush (tools/sweep_decode.Timer); every output checked against the default ring's.

    python benchmarks/experiments/session15/ring.py OUT.json [--shapes ...] [--weights u4,u2]
        [--rings 1024x4,2048x4,2048x3,2048x2] [--splits 1,2,3,4,6,8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import read_gbps  # noqa: E402
from sweep_decode import Timer, _shapes  # noqa: E402

import mixgemm  # noqa: E402
from mixgemm import build, ops  # noqa: E402
from mixgemm.codegen import TILE_CONFIGS, DecodeConfig  # noqa: E402
from mixgemm.types import ActType, WeightType  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="57344x8192,28672x4096,8192x8192,4096x14336,6144x4096,4096x4096")
    ap.add_argument("--weights", default="u4,u2")
    ap.add_argument("--rings", default="1024x4,2048x4,2048x3,2048x2")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    timer = Timer(dev)
    base = next(tc for tc in TILE_CONFIGS if isinstance(tc, DecodeConfig) and tc.tokens == 8)
    rings = [tuple(int(v) for v in r.split("x")) for r in a.rings.split(",")]
    weights = [WeightType(w) for w in a.weights.split(",")]
    splits = [int(s) for s in a.splits.split(",")]
    specs = {(w, r): dataclasses.replace(base.spec(ActType.BF16, w), stage_bytes=r[0], stages=r[1])
             for w in weights for r in rings}
    build.build_many(sorted(set(specs.values()), key=lambda s: s.name), progress=False)
    best: dict[tuple, float] = {}
    worst_err = 0.0
    for p in range(2):
        for n, k in (_shapes(a.shapes) if p == 0 else _shapes(a.shapes)[::-1]):
            w_float = torch.randn(n, k, device=dev) * 0.02
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
            for wt in weights:
                packed = mixgemm.prepack(mixgemm.quantize(w_float, wt.bits, 128, symmetric=wt.signed,
                                                          dtype=torch.bfloat16))
                ref = ops.gemm_with_spec(x, packed, specs[(wt, rings[0])]).float()
                for r in rings:
                    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
                    for s in splits:
                        try:
                            t = timer.time(lambda w=packed, sp=specs[(wt, r)], y=y, s=s:
                                           ops.gemm_with_spec(x, w, sp, out=y, splits=s), a.iters)
                        except (ValueError, RuntimeError) as e:
                            print(f"  {specs[(wt, r)].name} s={s}: {e}", file=sys.stderr)
                            continue
                        err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                        worst_err = max(worst_err, err)
                        key = (n, k, wt.value, r[0], r[1], s)
                        best[key] = min(t, best.get(key, float("inf")))
                    line = " ".join(f"s{s}:{best.get((n, k, wt.value, *r, s), float('nan')):.1f}" for s in splits)
                    print(f"pass {p} {n}x{k} {wt.value} ring {r[0]}x{r[1]}: {line}", flush=True)
                del packed
            del w_float
            torch.cuda.empty_cache()
    rows = [dict(n=n, k=k, weight=w, stage_bytes=b, stages=st, splits=s, us=t)
            for (n, k, w, b, st, s), t in sorted(best.items())]
    doc = {"gpu": torch.cuda.get_device_name(dev), "read_gbps": read_gbps(), "worst_rel_err": worst_err,
           "rows": rows}
    with open(a.out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    print(f"worst relative difference to the default ring: {worst_err:.2e}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
