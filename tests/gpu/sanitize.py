"""Run one kernel of every family (activation dtype x weight type), plus the dequantizers, on a
small problem; meant to run under `compute-sanitizer --tool memcheck --error-exitcode 1`.

Usage: compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/sanitize.py
"""
import sys

import torch

import mixgemm
from mixgemm.ops import dense as ops
from mixgemm.jit.catalog import ALL_ACTS, ALL_WEIGHTS, TILE_CONFIGS


def main() -> int:
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    ran = []
    for act in ALL_ACTS:
        for wt in ALL_WEIGHTS:
            # N = 272 and M = 37: partial tiles in both directions; K = 512 with group 64
            w = torch.randn(272, 512, device=dev) * 0.02
            packed = mixgemm.prepack(mixgemm.quantize(w, wt.bits, 64, symmetric=wt.signed, dtype=act.torch_dtype))
            x = torch.randn(37, 512, device=dev, dtype=act.torch_dtype)
            tc = TILE_CONFIGS[len(ran) % len(TILE_CONFIGS)]          # rotate tile configs across families
            spec = tc.spec(act, wt)
            y = ops.gemm_with_spec(x, packed, spec, bias=torch.randn(272, device=dev, dtype=act.torch_dtype))
            d = mixgemm.dequantize(packed)
            torch.cuda.synchronize()
            assert torch.isfinite(y).all() and torch.isfinite(d).all()
            ran.append(spec.name)
    print("sanitized kernels:", *ran, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
