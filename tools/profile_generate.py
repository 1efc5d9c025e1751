"""Where the time of a decode token goes in transformers' ``generate()``: a torch profile of one
mode (``--mode``, as ``mixgemm bench --generate`` defines it: ``static``, generate()'s own compile;
``reduce-overhead``, the same with ``fullgraph=True``; ``eager``, no compile; ``compile``, ``model.forward =
torch.compile(model.forward, fullgraph=True)``; or ``graph``, the ceiling: one decode step of an
eager generate() captured whole in a CUDA graph and replayed
``--new-tokens`` times) for bf16 and mixgemm u4 (fused projections and ``fuse_layers=True``), the
ops sorted by GPU time or, with ``--sort cpu``, by the host time they take themselves, and
Dynamo's counters (graphs, recompiles); with ``--python``, a cProfile of the same call instead
(the Python functions by their own and their cumulative time)
(docs/compile-and-graphs.md). The kernels of ``static`` against those of ``graph`` show what the
compiled step runs that the hand-captured one does not::

    python tools/profile_generate.py --layers 8 --batch 16 [--variants bf16,u4-off,u4-on]
    python tools/profile_generate.py --mode compile --batch 1 --sort cpu
    python tools/profile_generate.py --mode graph --batch 1 --variants u4-off   (then --mode static)

A LLaMA-3-8B-shaped model with ``--layers`` layers and random weights, a 128-token prompt per
sequence and ``--new-tokens`` greedy tokens; three generate() calls warm the compile and the
CUDA graphs, the fourth is profiled. A kernel's calls divided by ``(new tokens - 1) * layers``
give its launches per layer and decode step (the prompt's GEMMs are other kernels).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LogitsProcessor, LogitsProcessorList

import mixgemm
from mixgemm.aot.prebuild import build_for
from mixgemm.bench.decoder import PRESETS
from mixgemm.bench.generate import generate_kwargs
from mixgemm.bench.generate_run import build_preset_model, mode_forward, pad_token_id, record_decode_step
from mixgemm.bench.run_support import cuda_capture

VARIANTS = ("bf16", "u4-off", "u4-on")


class StepClock(LogitsProcessor):
    """Records the host clock at each token's logits processing (once per generated token)."""

    def __init__(self, stamps: list):
        self.stamps = stamps

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores
MODES = ("eager", "static", "reduce-overhead", "compile", "graph")
SORTS = {"gpu": "self_device_time_total", "cpu": "self_cpu_time_total"}


def python_profile(call, rows: int) -> str:
    """cProfile of ``call()``: the Python functions by their own time, then by their cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    call()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def profile_variant(variant: str, layers: int, batch: int, new_tokens: int, rows: int, mode: str = "static",
                    sort: str = "gpu", python: bool = False) -> str:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build_preset_model(PRESETS["llama3-8b"], layers, torch.device("cuda"), 0)
    if variant != "bf16":
        mixgemm.nn.quantize_model(model, bits=4, group_size=128, progress=False, fuse_layers=variant == "u4-on")
        build_for(model, batch * 128, jobs=os.cpu_count(), progress=False)   # every kernel it reaches, in parallel, before timing
    ids = torch.randint(0, 1000, (batch, 128), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              attention_mask=torch.ones_like(ids), **generate_kwargs("static" if mode == "graph" else mode))
    if mode == "graph":
        with torch.no_grad():
            step = record_decode_step(model, ids, new_tokens, pad_token_id(model))
            graph, _ = cuda_capture(step.call(model))
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(new_tokens):
                    graph.replay()
                torch.cuda.synchronize()
        del graph
        table = prof.key_averages().table(sort_by=SORTS[sort], row_limit=rows, max_name_column_width=90)
    else:
        with torch.no_grad(), mode_forward(model, mode):
            for _ in range(3):
                model.generate(ids, **kw)
            torch.cuda.synchronize()
            if python:
                table = python_profile(lambda m=model: (m.generate(ids, **kw), torch.cuda.synchronize()), rows)
            else:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    model.generate(ids, **kw)
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by=SORTS[sort], row_limit=rows, max_name_column_width=90)
            stamps = []
            model.generate(ids, logits_processor=LogitsProcessorList([StepClock(stamps)]), **kw)
            torch.cuda.synchronize()
        steps = [round((b - a) * 1e3, 2) for a, b in zip(stamps, stamps[1:])]
        step_line = (f"\nms between tokens (an unprofiled call): median {statistics.median(steps):.2f}, "
                     f"min {min(steps):.2f}, max {max(steps):.2f}; first {steps[:6]}")
    tail = "" if mode == "graph" else step_line
    del model
    torch.cuda.empty_cache()
    counts = {group: dict(c) for group, c in torch._dynamo.utils.counters.items() if group in ("stats", "recompiles", "inductor") and c}
    return f"===== {variant}, {mode}: {layers} layers, batch {batch}, {new_tokens} new tokens\n{table}\ndynamo counters: {counts}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--rows", type=int, default=25, help="ops listed per variant")
    p.add_argument("--mode", choices=MODES, default="static", help="the generate() mode profiled")
    p.add_argument("--sort", choices=tuple(SORTS), default="gpu", help="order by GPU time or by the ops' own host time")
    p.add_argument("--python", action="store_true",
                   help="profile the Python functions (cProfile: own and cumulative time) instead of torch's ops")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.python and args.mode == "graph":
        p.error("--python profiles a generate() call; the graph mode replays a CUDA graph")
    for v in variants:
        print(profile_variant(v, args.layers, args.batch, args.new_tokens, args.rows, args.mode, args.sort,
                              args.python), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
