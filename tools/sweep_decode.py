"""Sweep the decode kernels' split-K factor on the GPU, per layer shape, weight type and M, and
write the measured table that mixgemm.dispatch.tuning reads.

Each point is one kernel launch captured in a CUDA graph and replayed after a clean L2 flush
(a write of 2x L2, then a read of another 2x L2, so that the timed kernel finds clean lines as it
would after the previous layer's reads and does not pay for write-backs), median of --iters
replays; the whole sweep runs --passes times in alternating orders and each point keeps its
fastest pass (drift between early and late points was up to 16% in one pass; docs/dispatch.md). The kernel
is the heuristic's (`TILE_CONFIGS`' dec8 / dec16 / dec32 for the type), forced to each factor
(gemm_with_spec(splits=)); splits=0 is the kernel's own planner.

    python tools/sweep_decode.py OUT.json [--shapes 28672x8192,...|presets] [--m 1,16] [--weights u4,u2,s8]
        [--splits 0,1,2,3,4,6,8,12,16] [--iters 30] [--passes 2] [--table T.json [--merge-into OLD.json]]

The committed tables python/mixgemm/dispatch/configs/<gpu>.json come from `--table`; `--merge-into` the
committed table keeps its entries of the shapes this sweep did not measure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import mixgemm
from mixgemm.jit import build
from mixgemm.ops import dense as ops
from mixgemm.dispatch import tuning
from mixgemm.jit.catalog import TILE_CONFIGS, DecodeConfig
from mixgemm.dtypes import ActType, WeightType

#: the decoder-layer GEMM shapes (N x K) of llama3-8b, llama3-70b, qwen2.5-7b, qwen2.5-32b
#: (qkv, o, gate+up, down)
PRESET_SHAPES = ("6144x4096,4096x4096,28672x4096,4096x14336,"
                 "10240x8192,8192x8192,57344x8192,8192x28672,"
                 "4608x3584,3584x3584,37888x3584,3584x18944,"
                 "7168x5120,5120x5120,55296x5120,5120x27648")


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in (PRESET_SHAPES if text == "presets" else text).split(","):
        n, k = item.lower().split("x")
        out.append((int(n), int(k)))
    return out


class Timer:
    """One-launch CUDA graphs, timed with events after a clean L2 flush."""

    def __init__(self, device: torch.device):
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self._dirty = torch.empty(2 * l2, dtype=torch.uint8, device=device)
        self._clean = torch.ones(2 * l2 // 4, dtype=torch.float32, device=device)
        self._sink = torch.empty((), dtype=torch.float32, device=device)

    def flush(self) -> None:
        torch.cuda._sleep(300_000)              # lets the host queue the replay ahead
        self._dirty.fill_(1)
        self._sink.copy_(self._clean.sum())     # evicts the dirty lines: the L2 holds clean ones

    def time(self, fn, iters: int) -> float:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            self.flush()
            graph.replay()
        marks = []
        for _ in range(iters):
            self.flush()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            marks.append((a, b))
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in marks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="presets", help="NxK,... or 'presets' (the bench --model layers)")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--weights", default="u4,u2,s8")
    ap.add_argument("--splits", default=",".join(map(str, (0,) + tuning.SWEEP_SPLITS)),
                    help="split-K factors to force; 0 = the planner's pick")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--table", help="also write the measured split-K table (mixgemm.dispatch.tuning) here")
    ap.add_argument("--merge-into", metavar="TABLE",
                    help="with --table: start from this table (the committed one) and replace only the "
                         "entries of the shapes, tiles and code widths swept here")
    a = ap.parse_args(argv)
    shapes = _shapes(a.shapes)
    ms = [int(v) for v in a.m.split(",")]
    weights = [WeightType(w) for w in a.weights.split(",")]
    splits = [int(v) for v in a.splits.split(",")]
    dev = torch.device("cuda")
    timer = Timer(dev)

    def config(m: int) -> DecodeConfig:
        return next(tc for tc in TILE_CONFIGS if isinstance(tc, DecodeConfig) and m <= tc.tokens)

    specs = {(w, m): config(m).spec(ActType.BF16, w) for w in weights for m in ms}
    build.build_many(sorted(set(specs.values()), key=lambda s: s.name), progress=False)
    best: dict[tuple, float] = {}
    for p in range(a.passes):
        order = shapes if p % 2 == 0 else shapes[::-1]
        for n, k in order:
            w_float = torch.randn(n, k, device=dev) * 0.02
            x_all = torch.randn(max(ms), k, device=dev, dtype=torch.bfloat16)
            for wt in weights:
                packed = mixgemm.prepack(mixgemm.quantize(w_float, wt.bits, 128, symmetric=wt.signed,
                                                          dtype=torch.bfloat16))
                for m in ms:
                    x = x_all[:m]
                    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                    spec = specs[(wt, m)]
                    for s in (splits if p % 2 == 0 else splits[::-1]):
                        try:
                            t = timer.time(lambda: ops.gemm_with_spec(x, packed, spec, out=y, splits=s), a.iters)
                        except (ValueError, RuntimeError) as e:
                            print(f"  {spec.name} s={s}: {e}", file=sys.stderr)
                            continue
                        key = (n, k, m, wt.value, s)
                        best[key] = min(t, best.get(key, float("inf")))
                    print(f"pass {p} {n}x{k} M={m:<3} {wt.value}: " + " ".join(
                        f"s{s}:{best.get((n, k, m, wt.value, s), float('nan')):.1f}" for s in splits), flush=True)
                del packed
            del w_float
            torch.cuda.empty_cache()
    rows = [dict(n=n, k=k, m=m, weight=w, splits=s, us=t, kernel=specs[(WeightType(w), m)].name,
                 stage_bytes=specs[(WeightType(w), m)].stage_bytes, stages=specs[(WeightType(w), m)].stages,
                 warps=specs[(WeightType(w), m)].warps)
            for (n, k, m, w, s), t in sorted(best.items())]
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, a.out)
    if a.table:
        entries = tuning.table_from_sweep(rows, stage_bytes=None)
        # the command, with a path given whole shortened to its file name: the table names no machine's folders
        command = "python tools/sweep_decode.py " + " ".join(os.path.basename(x) if os.path.isabs(x) else x
                                                             for x in sys.argv[1:])
        if a.merge_into:
            with open(a.merge_into) as f:
                old = json.load(f)
            entries = tuning.merge_entries(old["decode_splits"], entries, tuning.swept_keys(rows, stage_bytes=None))
        tuning.write_table(a.table, torch.cuda.get_device_name(dev), entries, command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
