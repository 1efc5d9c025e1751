"""Run the heuristic's kernels on one LLaMA-70B layer for profiling (ncu / compute-sanitizer):
three warm-up calls then one profiled call per M. Usage: python tools/profile_kernels.py M [M ...]"""
import sys

import torch

import mixgemm

n, k = 28672, 8192
w = torch.randn(n, k, device="cuda") * 0.02
packed = mixgemm.prepack(mixgemm.quantize(w, 4, 128, dtype=torch.bfloat16))
for m in [int(a) for a in sys.argv[1:]] or [1]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        y = mixgemm.gemm(x, packed)
    torch.cuda.synchronize()
    print(m, mixgemm.ops.dense.select_spec(m, packed).name, float(y.float().norm()))
