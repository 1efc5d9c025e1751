"""Session 22: fused_moe at decode points (its own plan: routed where routed_plan says so) and its
four-launch path, in one CUDA graph each (L2 flushed before every replay, median of 40), uniform
and Zipf routing. For A/B runs of two builds of the grouped decode kernel in one GPU call (one
process per build; session21/ab_trees.sh's alternation).
usage: moe_ab.py OUT.json [preset:T,T;preset:T] [u4,u2]
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV as dev, time_graph  # noqa: E402

from mixgemm import moe, moe_layer  # noqa: E402
from moe_point import point_inputs, preset_weights, quantized  # noqa: E402

DEFAULT = "qwen3-30b-a3b:1,4,16;mixtral-8x7b:1,4,16"


def main():
    points = [(p.split(":")[0], [int(t) for t in p.split(":")[1].split(",")])
              for p in (sys.argv[2] if len(sys.argv) > 2 else DEFAULT).split(";")]
    weights = (sys.argv[3] if len(sys.argv) > 3 else "u4,u2").split(",")
    out = {"rows": []}
    for pname, tokens in points:
        p, w13b, w2b = preset_weights(pname, dev)
        for wname in weights:
            layer = quantized(w13b, w2b, wname)
            for t in tokens:
                for routing in ("uniform", "zipf"):
                    x, tw, ids = point_inputs(p, t, routing, dev)

                    def full(x=x, tw=tw, ids=ids):
                        return moe.fused_moe(x, layer.w13, layer.w2, tw, ids)

                    def four(x=x, tw=tw, ids=ids):
                        keep = moe_layer.routed_plan
                        moe_layer.routed_plan = lambda *a: False
                        try:
                            return moe.fused_moe(x, layer.w13, layer.w2, tw, ids)
                        finally:
                            moe_layer.routed_plan = keep

                    routed = routed_plan_taken = moe_layer.routed_plan(
                        moe_layer.plan_fused_moe(ids.numel(), layer.w13.act_type, layer.w13.weight_type,
                                                 p.experts, p.hidden, p.intermediate), layer.w13, layer.w2, x, ids)
                    row = {"preset": pname, "weight": wname, "tokens": t, "routing": routing,
                           "routed": bool(routed_plan_taken), "same_bits": bool(torch.equal(full(), four())),
                           "full": time_graph(full), "four": time_graph(four) if routed else None}
                    row["full2"] = time_graph(full)
                    out["rows"].append(row)
                    print(pname, wname, t, routing, {k: (round(v, 2) if isinstance(v, float) else v)
                                                     for k, v in row.items()
                                                     if k not in ("preset", "weight", "tokens", "routing")},
                          flush=True)
            del layer
            torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
