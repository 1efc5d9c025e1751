"""Mid-M (32-256 tokens) sm90 GEMMs on the preset layers: cuBLAS, the heuristic's kernel and
forced specs, each as a one-launch CUDA graph after an L2 flush (median of --iters), the output
checked against float64 on the reference-dequantized weight; with --profile, the kernels and
memsets of each call as CUPTI sees them (torch.profiler), so a launch's kernel time and its
workspace memset are told apart.

    python midm.py OUT.json --shapes 4096x4096,6144x4096 --m 64,256 \
        --specs mixgemm_gemm_bf16_u4_t128x64x64_coop_streamk_biasact_s0,... [--splits 0,2,4] [--profile]
    python midm.py --once SPEC NxK M [--splits S]      # one warm call, then one call (for ncu)

Weights: u4 asymmetric g128 unless --weight says otherwise (s8, u2, ...), bf16 activations.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import mixgemm
from mixgemm import bench, ops
from mixgemm.bench.run_support import cuda_capture
from mixgemm.specs import parse_name
from mixgemm.types import WeightType


def _layer(n, k, wt, dev):
    torch.manual_seed(0)
    w = torch.randn(n, k, device=dev) * 0.02
    qw = mixgemm.quantize(w, wt.bits, 128, symmetric=wt.signed, dtype=torch.bfloat16)
    return mixgemm.prepack(qw), mixgemm.dequantize_reference(qw)


def _calls(x, packed, deq, specs, splits, heuristic=True):
    yield "cublas", 0, lambda: torch.nn.functional.linear(x, deq)
    if heuristic:
        yield "heuristic:" + ops.select_spec(x.shape[0], packed).name, 0, lambda: mixgemm.gemm(x, packed)
    for spec in specs:
        for s in splits:
            yield spec.name, s, (lambda spec=spec, s=s: ops.gemm_with_spec(x, packed, spec, splits=s))


def _profile(fn, reps=5):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name[:90]
        out.setdefault(name, []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    return {k: round(statistics.median(v), 2) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--shapes", default="4096x4096,6144x4096,4608x3584,7168x5120")
    ap.add_argument("--m", default="64,256")
    ap.add_argument("--specs", default="")
    ap.add_argument("--splits", default="0")
    ap.add_argument("--weight", default="u4")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-heuristic", action="store_true", help="leave out mixgemm.gemm's own pick")
    ap.add_argument("--once", nargs=3, metavar=("SPEC", "NxK", "M"))
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    wt = WeightType(a.weight)
    if a.once:
        spec = parse_name(a.once[0])
        (n, k), = bench.parse_shapes(a.once[1])
        m = int(a.once[2])
        packed, _ = _layer(n, k, wt, dev)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        s = int(a.splits.split(",")[0])
        for _ in range(3):
            ops.gemm_with_spec(x, packed, spec, splits=s)
        torch.cuda.synchronize()
        ops.gemm_with_spec(x, packed, spec, splits=s)
        torch.cuda.synchronize()
        return 0
    specs = [parse_name(s) for s in a.specs.split(",") if s]
    splits = [int(s) for s in a.splits.split(",")]
    flush = bench.flush_size(torch.cuda.get_device_properties(dev).L2_cache_size)
    rows = []
    for n, k in bench.parse_shapes(a.shapes):
        packed, deq = _layer(n, k, wt, dev)
        for m in bench.parse_int_list(a.m):
            torch.manual_seed(1)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.double() @ deq.double().T
            for name, s, fn in _calls(x, packed, deq, specs, splits, not a.no_heuristic):
                row = dict(n=n, k=k, m=m, weight=wt.value, impl=name, splits=s)
                try:
                    y = fn()
                    row["err"] = ((y.double() - ref).norm() / ref.norm()).item()
                    graph, _ = cuda_capture(fn)
                    row["us"] = bench.time_cuda(graph.replay, a.iters, 5, flush).median_us
                    if a.profile:
                        row["kernels"] = _profile(fn)
                    del graph
                except Exception as e:  # a spec that cannot run this problem
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                cub = next(r["us"] for r in rows if (r["n"], r["k"], r["m"], r["impl"]) == (n, k, m, "cublas"))
                t = row.get("us")
                msg = f"{t:8.1f} us x{cub / t:5.2f} err {row['err']:.1e}" if t else row["error"]
                print(f"{n}x{k} M={m:<4} {name[:70]:<70} s{s} {msg}", flush=True)
                if a.profile and "kernels" in row:
                    for kn, us in row["kernels"].items():
                        print(f"      {us:8.2f} us  {kn}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
