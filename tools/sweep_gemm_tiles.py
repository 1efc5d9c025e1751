"""Time candidate sm90 GEMM tile configs against the heuristic's and cuBLAS (GPU), with the
result checked against float64: the measurements behind a change of TILE_CONFIGS. Each weight
type among the specs is quantized (g128; asymmetric for u*, symmetric for s*) and timed with its
own specs and the heuristic's pick for it.

    python tools/sweep_gemm_tiles.py OUT.json SPEC_NAME [SPEC_NAME ...] [--shapes ...] [--m ...]
        [--swizzle 1,4,8] [--raster heuristic,weight_rows,tokens]

Every spec runs at every (swizzle, raster) pair; the heuristic's spec at the defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import mixgemm
from mixgemm import bench
from mixgemm.ops import dense as ops
from mixgemm.jit.specs import Raster, parse_name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--shapes", default="28672x8192,8192x8192,4096x14336")
    ap.add_argument("--m", default="256,1024,4096")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--swizzle", default="1")
    ap.add_argument("--raster", default="heuristic")
    a = ap.parse_args(argv)
    specs = [parse_name(s) for s in a.specs]
    orders = [(int(z), Raster(r)) for z in a.swizzle.split(",") for r in a.raster.split(",")]
    dev = torch.device("cuda")
    flush = bench.flush_size(torch.cuda.get_device_properties(dev).L2_cache_size)
    rows = []
    for n, k in bench.parse_shapes(a.shapes):
        w = torch.randn(n, k, device=dev) * 0.02
        for wt in sorted({s.weight for s in specs}, key=lambda t: t.value):
            qw = mixgemm.quantize(w, wt.bits, 128, symmetric=wt.signed, dtype=torch.bfloat16)
            packed = mixgemm.prepack(qw)
            deq = mixgemm.dequantize_reference(qw)
            for m in bench.parse_int_list(a.m):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = (x.double() @ deq.double().T)
                cub = bench.time_cuda(lambda: torch.nn.functional.linear(x, deq), a.iters, 3, flush).median_us
                heur = ops.select_spec(m, packed)
                runs = [(heur, 1, Raster.HEURISTIC)] + [(s, z, r) for s in specs if s.weight is wt for z, r in orders]
                for spec, z, r in runs:
                    def call():
                        return ops.gemm_with_spec(x, packed, spec, swizzle=z, raster=r)
                    y = call()
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                    t = bench.time_cuda(call, a.iters, 3, flush).median_us
                    rows.append(dict(n=n, k=k, m=m, weight=wt.value, spec=spec.name, swizzle=z, raster=r.value,
                                     us=t, cublas_us=cub, err=err))
                    print(f"{n}x{k} M={m:<5} {spec.name:<58} z{z} {r.value:<11} {t:9.1f} us  x{cub / t:5.2f}"
                          f"  err {err:.1e}", flush=True)
            del qw, packed, deq
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
