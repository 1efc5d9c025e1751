"""Sweep the decode kernel's free parameters on the GPU: split-K factor (forced through
gemm_with_spec(splits=)), stage size and ring depth, per layer shape, weight type and M, next to
cuBLAS. Feeds the split-K planner (decode_kernel.hpp Host::plan) and the DecodeConfig defaults
with measurements; the planner's own pick (splits=0) is timed in the same run.

    python tools/sweep_decode.py OUT.json [--shapes 28672x8192,...] [--m 1,16] [--weights u4,u2,s8]
        [--stage-bytes 1024,2048] [--stages 4] [--warps 8,4] [--splits 0,1,2,3,4,6,8] [--table T.json]

The committed table python/mixgemm/tuning/<gpu>.json comes from
    python tools/sweep_decode.py sweep.json --stage-bytes 1024 --warps 8 --table T.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import mixgemm
from mixgemm import bench, build, ops, tuning
from mixgemm.codegen import DecodeSpec
from mixgemm.types import ActType, WeightType


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="28672x8192,8192x28672,57344x8192,4096x4096,6144x4096,4096x14336")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--weights", default="u4,u2,s8")
    ap.add_argument("--stage-bytes", default="1024,2048")
    ap.add_argument("--stages", default="4")
    ap.add_argument("--warps", default="8,4")
    ap.add_argument("--splits", default=",".join(map(str, (0,) + tuning.SWEEP_SPLITS)),
                    help="split-K factors to force; 0 = the planner's pick")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--table", help="also write the measured split-K table (mixgemm.tuning) here")
    a = ap.parse_args(argv)
    shapes = bench.parse_shapes(a.shapes)
    ms = bench.parse_int_list(a.m)
    weights = [WeightType(w) for w in a.weights.split(",")]
    variants = [(sb, st, wp) for sb in bench.parse_int_list(a.stage_bytes) for st in bench.parse_int_list(a.stages)
                for wp in bench.parse_int_list(a.warps)]
    splits = tuple(int(v) for v in a.splits.split(","))   # 0: the planner's choice

    def spec_for(w, m, sb, st, wp):
        tokens = 8 if m <= 8 else 16 if m <= 16 else 32
        return DecodeSpec(ActType.BF16, w, tokens, wp, max(sb, 128 * w.bits), st)

    specs = sorted({spec_for(w, m, *v) for w in weights for m in ms for v in variants}, key=lambda s: s.name)
    build.build_many(specs, jobs=16)
    dev = torch.device("cuda")
    flush = bench.flush_size(torch.cuda.get_device_properties(dev).L2_cache_size)
    rows = []
    for n, k in shapes:
        w_float = torch.randn(n, k, device=dev) * 0.02
        x_all = torch.randn(max(ms), k, device=dev, dtype=torch.bfloat16)
        dense = w_float.to(torch.bfloat16)
        for m in ms:
            x = x_all[:m]
            cub = bench.time_cuda(lambda: torch.nn.functional.linear(x, dense), a.iters, 5, flush).median_us
            for wt in weights:
                packed = mixgemm.prepack(mixgemm.quantize(w_float, wt.bits, 128, symmetric=wt.signed, dtype=torch.bfloat16))
                nbytes = packed.nbytes
                for sb, st, wp in variants:
                    spec = spec_for(wt, m, sb, st, wp)
                    for s in splits:
                        try:
                            t = bench.time_cuda(lambda: ops.gemm_with_spec(x, packed, spec, splits=s), a.iters, 5, flush).median_us
                        except (ValueError, RuntimeError) as e:
                            print(f"  {spec.name} s={s}: {e}", file=sys.stderr)
                            continue
                        row = dict(n=n, k=k, m=m, weight=wt.value, stage_bytes=sb, stages=st, warps=wp, splits=s,
                                   us=t, cublas_us=cub, speedup=cub / t, gbps=nbytes / t / 1e3)
                        rows.append(row)
                        print(f"{n}x{k} M={m:<3} {wt.value} b{sb} s{st} w{wp} splits={s:<2} {t:8.2f} us  "
                              f"x{cub / t:5.2f}  {nbytes / t / 1e3:7.0f} GB/s", flush=True)
                del packed
        del w_float, dense
        torch.cuda.empty_cache()
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, a.out)
    if a.table:
        tuning.write_table(a.table, torch.cuda.get_device_name(dev), tuning.table_from_sweep(rows),
                           source="tools/sweep_decode.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
