"""Session 14: the decode kernels' balanced schedule against the split schedule (NOTES 18).
The schedule was measured slower and reverted: this script runs at commit 6a4f1ce, where
``gemm_with_spec(balanced=)`` and the kernels' ``_balanced`` entries exist.

For each layer N x K, code type and M: the split schedule at the tuned / planned factor (what
mixgemm.gemm launches) and at factors 1, 2, 4, against the balanced schedule over C CTAs
(C = 132 x 2, 3, 6: one or two rounds of resident CTAs). One-launch CUDA graphs after a clean L2
flush (tools/sweep_decode.Timer), median of --iters, best of two passes; the read bandwidth of a
1 GiB sum in the same run. Every balanced output is checked against the split schedule's.

    python benchmarks/experiments/session14/balanced.py OUT.json [--shapes ...] [--m 1] [--weights u4,u2,s8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import read_gbps  # noqa: E402
from sweep_decode import Timer, _shapes  # noqa: E402

import mixgemm  # noqa: E402
from mixgemm import ops, tuning  # noqa: E402
from mixgemm.codegen import TILE_CONFIGS, DecodeConfig  # noqa: E402
from mixgemm.types import ActType, WeightType  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="57344x8192,53248x8192,50688x8192,28672x4096,27648x8192,"
                                        "8192x28672,4096x14336,14336x8192,6144x4096,4096x4096")
    ap.add_argument("--m", default="1")
    ap.add_argument("--weights", default="u4,u2,s8")
    ap.add_argument("--ctas", default="264,396,792")
    ap.add_argument("--splits", default="0,1,2,4")
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    timer = Timer(dev)
    bw = read_gbps()
    print(f"read bandwidth {bw:.0f} GB/s", flush=True)
    ctas_list = [int(c) for c in a.ctas.split(",")]
    splits_list = [int(s) for s in a.splits.split(",")]
    rows = []
    for n, k in _shapes(a.shapes):
        w_float = torch.randn(n, k, device=dev) * 0.02
        for wname in a.weights.split(","):
            wt = WeightType(wname)
            packed = mixgemm.prepack(mixgemm.quantize(w_float, wt.bits, 128, symmetric=wt.signed, dtype=torch.bfloat16))
            nbytes = packed.qdata.numel() * packed.qdata.element_size() + packed.scales.numel() * 2 + (
                0 if packed.zeros is None else packed.zeros.numel() * 2)
            for m in (int(v) for v in a.m.split(",")):
                tc = next(t for t in TILE_CONFIGS if isinstance(t, DecodeConfig) and m <= t.tokens)
                spec = tc.spec(ActType.BF16, wt)
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                tuned = tuning.decode_splits(torch.cuda.get_device_name(dev), n, k, spec.tokens, wt.bits)
                ref = ops.gemm_with_spec(x, packed, spec, splits=tuned).float()
                res = {}
                for p in range(2):
                    for s in splits_list:
                        f = (lambda s=s: ops.gemm_with_spec(x, packed, spec, out=y, splits=s if s else tuned))
                        res[f"s{s}" if s else "tuned"] = min(res.get(f"s{s}" if s else "tuned", 1e9), timer.time(f, a.iters))
                    for c in ctas_list:
                        f = (lambda c=c: ops.gemm_with_spec(x, packed, spec, out=y, balanced=c))
                        res[f"b{c}"] = min(res.get(f"b{c}", 1e9), timer.time(f, a.iters))
                errs = {}
                for c in ctas_list:
                    yb = ops.gemm_with_spec(x, packed, spec, balanced=c).float()
                    errs[c] = ((yb - ref).norm() / ref.norm()).item()
                floor = nbytes / bw / 1e3
                line = " ".join(f"{kk}:{v:.1f}({floor / v:.0%})" for kk, v in res.items())
                print(f"{n}x{k} {wname} M={m} floor {floor:.1f}us tuned=s{tuned}: {line} "
                      f"maxerr {max(errs.values()):.1e}", flush=True)
                rows.append(dict(n=n, k=k, weight=wname, m=m, bytes=nbytes, floor_us=floor, tuned_splits=tuned,
                                 us=res, rel_diff_vs_split=errs, read_gbps=bw))
            del packed
        del w_float
        torch.cuda.empty_cache()
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(dev), read_gbps=bw, rows=rows), f, indent=1)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
