"""Experiment (session 5): the gate/up projection with swiglu fused into the GEMM's gated epilogue,
against the path it replaces (the GEMM without activation, then silu(gate) * up in torch), the
GEMM alone, and bf16 (cuBLAS, then silu * up), at the token counts the GEMM kernels serve. Writes
one JSON line per point to $OUT/exp-swiglu.jsonl and prints a table."""
from __future__ import annotations

import json
import os

import torch

import mixgemm
from mixgemm import bench, ops
from mixgemm.quantize import deinterleave_rows, interleave_gate_up

dev = torch.device("cuda")
flush = bench.flush_size(torch.cuda.get_device_properties(dev).L2_cache_size)
ITERS = int(os.environ.get("EXP_ITERS", "100"))
SHAPES = ((14336, 4096), (28672, 8192))      # (intermediate I, hidden K): LLaMA-3 8B and 70B
MS = (16, 32, 64, 128, 256, 1024, 4096)


def t(fn):
    return bench.time_cuda(fn, ITERS, 10, flush, device=dev).median_us


out_path = os.path.join(os.environ.get("OUT", "."), "exp-swiglu.jsonl")
gen = torch.Generator(device=dev).manual_seed(0)
with open(out_path, "w") as log:
    for inter, k in SHAPES:
        qs = [mixgemm.quantize(torch.randn(inter, k, device=dev, generator=gen) * 0.02, 4, 128,
                               dtype=torch.bfloat16) for _ in range(2)]
        packed = mixgemm.prepack(interleave_gate_up(*qs))
        w = mixgemm.dequantize(packed)                  # [2I, K] interleaved
        wg, wu = deinterleave_rows(w)
        w_cat = torch.cat((wg, wu))                     # bf16: one GEMM for gate and up
        del w, wg, wu
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            spec = ops.select_spec(m, packed)           # the GEMM kernel without activation
            fused_spec = ops.select_spec(m, packed, "swiglu")

            def unfused():
                return ops._activate(ops.gemm_with_spec(x, packed, spec, _checked=True), "swiglu")

            def bf16():
                h = torch.nn.functional.linear(x, w_cat)
                return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]

            fused = lambda: mixgemm.gemm(x, packed, activation="swiglu")
            plain = lambda: ops.gemm_with_spec(x, packed, spec, _checked=True)
            ref = bf16().float()
            y = fused().float()
            err = ((y - ref).norm() / ref.norm()).item()
            row = {"I": inter, "K": k, "m": m, "kernel": fused_spec.name, "fused_us": t(fused),
                   "unfused_us": t(unfused), "gemm_only_us": t(plain), "bf16_us": t(bf16), "rel_err_vs_bf16": err}
            log.write(json.dumps(row) + "\n")
            print(f"I={inter} K={k} M={m:5d} fused {row['fused_us']:8.1f}  gemm+torch {row['unfused_us']:8.1f}  "
                  f"gemm only {row['gemm_only_us']:8.1f}  bf16 {row['bf16_us']:8.1f} us  "
                  f"x{row['bf16_us'] / row['fused_us']:.2f} vs bf16  err {err:.1e}", flush=True)
        del packed, w_cat
