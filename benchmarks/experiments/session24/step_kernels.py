"""Session 24: where a decoder step's time goes, kernel by kernel, inside the CUDA graph.

bench --model's decoder stack (its layers, norms, rotary / KV-cache kernel and SDPA; random
weights) for each variant and batch: the step captured in a CUDA graph, timed as bench --model
times it (L2 flushed before each replay, CUDA events, median), then replayed under
torch.profiler (CUPTI) with the same flush before each replay. Per replay the kernels (and
memsets) between two flushes are the step's; for every position in the layer's sequence this
reports the median duration and the median idle gap before it, and per layer the sum of each
family's durations, the sum of the gaps, and the span from the first kernel's start to the last
one's end.

usage: step_kernels.py OUT.json [--preset llama3-8b] [--layers 4] [--batches 1,16,64,256]
       [--variants bf16,int4,int2,no-gemm] [--replays 20]
"""
import argparse
import json
import os
import statistics
import sys

import torch

from mixgemm.bench.decoder import PRESETS, DecoderStack, Rotary, layer_state, random_tensor, tensor_seed
from mixgemm.bench.run_support import cuda_capture, free
from mixgemm.bench.variants import build_layer, parse_variant

# the session-12 harness: the L2 flush, and a graph of a function timed after a flush per replay
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV, flush, time_graph  # noqa: E402


def family(name: str) -> str:
    # (the JSON of the session-24 run, s24-step-kernels.json, was written by an earlier version
    # that tested for "mixgemm" first and so counted the norm and rope kernels as "gemm"; its
    # per-kernel rows are right)
    n = name.lower()
    if "rmsnorm" in n:
        return "norm"
    if "rope" in n:
        return "rope"
    if "memset" in n:
        return "memset"
    if "mixgemm_decode" in n or "mixgemm_gemm" in n:
        return "gemm"
    if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "attn")):
        return "attention"
    if any(s in n for s in ("gemv", "gemm", "nvjet", "xmma", "cutlass", "cublas", "tinygemm", "int4")):
        return "gemm"
    return "other"


def profile(graph, replays):
    """The step's kernels per replay: those between two spin-kernel markers around the replay
    (the flush before it runs outside the markers)."""
    from torch.profiler import ProfilerActivity, profile as tprof
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush()
            torch.cuda._sleep(10)
            graph.replay()
            torch.cuda._sleep(10)
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    segs, cur, inside = [], [], False
    for e in evs:
        if "spin_kernel" in e.name:
            if inside:
                segs.append(cur)
            cur, inside = [], not inside
            continue
        if inside:
            cur.append((e.name, e.time_range.start, e.time_range.end))
    counts = {}
    for s in segs:
        counts[len(s)] = counts.get(len(s), 0) + 1
    n = max(counts, key=counts.get)
    return [s for s in segs if len(s) == n]


def summarize(segs, layers):
    n = len(segs[0])
    rows = []
    for i in range(n):
        name = segs[0][i][0]
        dur = statistics.median(s[i][2] - s[i][1] for s in segs)
        gap = statistics.median((s[i][1] - s[i - 1][2]) if i else 0.0 for s in segs)
        rows.append({"pos": i, "name": name[:120], "family": family(name), "us": dur, "gap_before_us": gap})
    span = statistics.median(s[-1][2] - s[0][1] for s in segs)
    fam = {}
    for r in rows:
        fam[r["family"]] = fam.get(r["family"], 0.0) + r["us"] / layers
    gaps = sum(r["gap_before_us"] for r in rows) / layers
    return rows, span / layers, fam, gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--variants", default="bf16,int4,int2,no-gemm")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--context", type=int, default=1024)
    a = ap.parse_args()
    preset = PRESETS[a.preset]
    batches = [int(b) for b in a.batches.split(",")]
    dtype = torch.bfloat16
    seed = 0
    states = [layer_state(preset, i, seed, max(batches), a.context + 1, DEV, dtype) for i in range(a.layers)]
    rotary = Rotary(preset.head_dim, preset.rope_theta, a.context + 1, dtype, DEV)
    results = []
    for vname in a.variants.split(","):
        variant = parse_variant(vname)
        projections = [build_layer(preset, variant, i, seed, DEV, 128)[0] for i in range(a.layers)]
        stack = DecoderStack(preset, projections, states, rotary)
        for b in batches:
            x = random_tensor((b, 1, preset.hidden), tensor_seed(seed, 10_000 + b, 0), DEV).to(dtype)
            with torch.no_grad():
                t = time_graph(lambda: stack(x, a.context)) / a.layers
                graph, y = cuda_capture(lambda: stack(x, a.context))
                segs = profile(graph, a.replays)
            rows, span, fam, gaps = summarize(segs, a.layers)
            per_layer = len(rows) // a.layers
            print(f"\n{a.preset} {variant.name} batch {b}: graph {t:.1f} us/layer; in the profile: span {span:.1f}, "
                  f"kernels {sum(fam.values()):.1f}, gaps {gaps:.1f} ({len(segs)} replays, {len(rows)} kernels)")
            print("   families us/layer: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(fam.items(), key=lambda kv: -kv[1])))
            # the second layer's sequence (the first follows the flush)
            for r in rows[per_layer:2 * per_layer]:
                print(f"   {r['us']:7.2f} us  gap {r['gap_before_us']:5.2f}  {r['family']:9s} {r['name'][:100]}")
            results.append({"preset": a.preset, "variant": variant.name, "batch": b, "graph_us_per_layer": t,
                            "span_us_per_layer": span, "gaps_us_per_layer": gaps, "families_us_per_layer": fam,
                            "kernels": rows, "replays": len(segs)})
            del graph, y
        del projections, stack
        free()
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    sys.exit(main())
