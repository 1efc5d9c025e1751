"""Experiment (session 4): the decode kernels with and without programmatic dependent launch, back
to back in a CUDA graph (8 launches of one layer) and in the MLP block. Prints one line per point."""
from __future__ import annotations

import torch

import mixgemm
from mixgemm import bench, ops
from mixgemm.specs import DecodeSpec
from mixgemm.types import ActType, WeightType

dev = torch.device("cuda")
flush = bench.flush_size(torch.cuda.get_device_properties(dev).L2_cache_size)
ITERS = 200


def t(fn, fl=flush):
    return bench.time_cuda(fn, ITERS, 20, fl, device=dev).median_us


def quant(n, k, gen):
    w = torch.randn(n, k, device=dev, generator=gen) * 0.02
    return mixgemm.quantize(w, 4, 128, symmetric=False, dtype=torch.bfloat16)


gen = torch.Generator(device=dev).manual_seed(0)
# back to back, no flush: 8 launches of the down layer in a graph
packed = mixgemm.prepack(quant(4096, 14336, gen))
x = torch.randn(1, 14336, device=dev, dtype=torch.bfloat16)
for pdl in (True, False):
    DecodeSpec.programmatic_launch = pdl
    spec = DecodeSpec(ActType.BF16, WeightType.U4, 8)
    for splits in (0, 1, 4, 8):
        ops.gemm_with_spec(x, packed, spec, splits=splits)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(8):
                ops.gemm_with_spec(x, packed, spec, splits=splits)
        us = t(g.replay)
        print(f"graph 8x down pdl={pdl} splits={splits}: {us:.1f} us ({us / 8:.1f} per launch)", flush=True)
        del g
DecodeSpec.programmatic_launch = True
for pdl in (False,):   # `mixgemm bench --block` gives the default (PDL on)
    DecodeSpec.programmatic_launch = pdl
    res = bench.bench_block(dev, (1, 16), ITERS, 20)
    for r in res:
        print(f"block pdl={pdl}: {r}", flush=True)
