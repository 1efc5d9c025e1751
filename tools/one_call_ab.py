"""An eager decode step of the fused layers in one operator call per layer, against the same
model run part by part, in one process: the median host-clock time between tokens of an eager
``generate()`` (LLaMA-3-8B shapes, random weights, u4 g128, ``fuse_layers=True``, one sequence,
a 128-token prompt, 64 new tokens), each layer's ``one_call`` switched on and off in turn
(docs/compile-and-graphs.md)::

    python tools/one_call_ab.py [--layers 32] [--rounds 4]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
from transformers import LogitsProcessorList

import mixgemm
from mixgemm.aot.prebuild import build_for
from mixgemm.bench.decoder import PRESETS
from mixgemm.bench.generate_run import build_preset_model
from mixgemm.dispatch import plans
from profile_generate import StepClock   # (tools/, the folder of this script)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4, help="timed generate() calls per setting, alternating")
    args = p.parse_args(argv)
    model = build_preset_model(PRESETS["llama3-8b"], args.layers, torch.device("cuda"), 0)
    mixgemm.nn.quantize_model(model, bits=4, group_size=128, progress=False, fuse_layers=True)
    build_for(model, 128, jobs=os.cpu_count(), progress=False)
    ids = torch.randint(0, 1000, (1, 128), device="cuda")

    def run(one_call: bool) -> float:
        for layer in model.model.layers:
            layer.one_call = one_call
        stamps: list = []
        model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, attention_mask=torch.ones_like(ids),
                       disable_compile=True, logits_processor=LogitsProcessorList([StepClock(stamps)]))
        torch.cuda.synchronize()
        return statistics.median((b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:]))

    times: dict[bool, list] = {True: [], False: []}
    with torch.no_grad():
        for one_call in (True, False, True, False):   # warm-up: kernels, plans, the operator library
            run(one_call)
        for _ in range(args.rounds):
            for one_call in (True, False):
                times[one_call].append(run(one_call))
    lib = plans.OPERATORS.lib
    print(f"decode_layer calls taken by its C++ kernel: {lib.layer_calls() if lib is not None else 'no library'}")
    for one_call in (True, False):
        print(f"one_call={one_call}: ms between tokens per call {[round(t, 2) for t in times[one_call]]}, "
              f"median {statistics.median(times[one_call]):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
