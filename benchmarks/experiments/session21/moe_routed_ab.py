"""Session 21: fused_moe at the routed decode points, routed and four-launch paths, and the two
grouped launches alone, in one CUDA graph each (L2 flushed before every replay, median of 40).
For A/B runs of two builds of the grouped kernel in one GPU call (one process per build).
usage: moe_routed_ab.py OUT.json
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV as dev, time_graph  # noqa: E402

from mixgemm import moe, moe_layer  # noqa: E402
from mixgemm.bench.moe import MOE_PRESETS, make_routing  # noqa: E402
from mixgemm.bench.moe_run import MixgemmLayer, base_weights  # noqa: E402
from mixgemm.bench.variants import parse_variant  # noqa: E402

POINTS = [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 4), ("mixtral-8x7b", 1)]


def main():
    out = dict(rows=[])
    for pname in ("qwen3-30b-a3b", "mixtral-8x7b"):
        p = MOE_PRESETS[pname]
        w13b, w2b = base_weights(p, 0, dev)
        for wname in ("u4", "u2"):
            layer = MixgemmLayer(w13b, w2b, parse_variant(wname), 128)
            for t in [t for n, t in POINTS if n == pname]:
                ids, tw = make_routing(p.experts, p.topk, t, "uniform", 0)
                ids, tw = ids.to(dev), tw.to(dev)
                x = (torch.randn(t, p.hidden, device=dev) * 0.5).to(torch.bfloat16)

                def four():
                    keep = moe_layer.routed_plan
                    moe_layer.routed_plan = lambda *a: False
                    try:
                        return moe.fused_moe(x, layer.w13, layer.w2, tw, ids)
                    finally:
                        moe_layer.routed_plan = keep

                routed = moe.fused_moe(x, layer.w13, layer.w2, tw, ids)
                row = dict(preset=pname, weight=wname, tokens=t, same_bits=bool(torch.equal(routed, four())),
                           routed=time_graph(lambda: moe.fused_moe(x, layer.w13, layer.w2, tw, ids)),
                           four=time_graph(four))
                row["routed2"] = time_graph(lambda: moe.fused_moe(x, layer.w13, layer.w2, tw, ids))
                out["rows"].append(row)
                print(pname, wname, t, {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()
                                        if k not in ("preset", "weight", "tokens")}, flush=True)
            del layer
            torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
