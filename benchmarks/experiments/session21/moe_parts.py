"""Session 21: where a decode fused_moe call's time goes, by launches (#19).

fused_moe at decode is four launches: route+gather, grouped gate/up (swiglu), grouped down,
combine. Per preset, code and token count (uniform routing, bench --moe's weights), this times
in one CUDA graph each (L2 flushed before every replay, median of 40): the whole call (and the
whole call with its routed decode path off: four launches); the
call without the routing launch (its outputs precomputed); without the combine launch; the two
grouped launches alone; and each launch alone. What fusing the routing into gate/up and the
combine into down could save is bounded by the differences.
usage: moe_parts.py OUT.json [T,T,..] [u4,u2]
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV as dev, read_gbps, time_graph  # noqa: E402

from mixgemm import moe, moe_layer  # noqa: E402
from mixgemm.bench.moe import MOE_PRESETS, make_routing  # noqa: E402
from mixgemm.bench.moe_run import MixgemmLayer, base_weights  # noqa: E402
from mixgemm.bench.variants import parse_variant  # noqa: E402
from mixgemm.moe_grouped import decode_spec_for, grouped_gemm_with_spec  # noqa: E402
from mixgemm.moe_routing import combine, route_and_gather  # noqa: E402


def main():
    out_path = sys.argv[1]
    tokens = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,4,16").split(",")]
    weights = (sys.argv[3] if len(sys.argv) > 3 else "u4,u2").split(",")
    presets = (sys.argv[4] if len(sys.argv) > 4 else "qwen3-30b-a3b,mixtral-8x7b").split(",")
    out = dict(read_gbps=read_gbps(), rows=[])
    for pname in presets:
        p = MOE_PRESETS[pname]
        w13b, w2b = base_weights(p, 0, dev)
        for wname in weights:
            layer = MixgemmLayer(w13b, w2b, parse_variant(wname), 128)
            w13, w2 = layer.w13, layer.w2
            for t in tokens:
                ids, tw = make_routing(p.experts, p.topk, t, "uniform", 0)
                ids, tw = ids.to(dev), tw.to(dev)
                x = (torch.randn(t, p.hidden, device=dev) * 0.5).to(torch.bfloat16)
                routing, xs = route_and_gather(x, ids, p.experts)
                offs = routing.expert_offsets
                rows = xs.shape[0]
                s1 = decode_spec_for(rows, w13.act_type, w13.weight_type, "swiglu", p.experts)
                s2 = decode_spec_for(rows, w2.act_type, w2.weight_type, None, p.experts)
                h = grouped_gemm_with_spec(xs, w13, offs, s1, activation="swiglu")
                y = grouped_gemm_with_spec(h, w2, offs, s2)
                o = combine(y, routing, tw)

                def gu():
                    grouped_gemm_with_spec(xs, w13, offs, s1, out=h, activation="swiglu")

                def dn():
                    grouped_gemm_with_spec(h, w2, offs, s2, out=y)

                def rt():
                    route_and_gather(x, ids, p.experts)

                def cb():
                    combine(y, routing, tw)

                def four_launches():   # fused_moe with its routed decode path off
                    keep = moe_layer.routed_plan
                    moe_layer.routed_plan = lambda *a: False
                    try:
                        return moe.fused_moe(x, w13, w2, tw, ids)
                    finally:
                        moe_layer.routed_plan = keep

                parts = dict(
                    full=lambda: moe.fused_moe(x, w13, w2, tw, ids),
                    full_4launch=four_launches,
                    no_route=lambda: (gu(), dn(), cb()),
                    no_combine=lambda: (rt(), gu(), dn()),
                    gemms=lambda: (gu(), dn()),
                    route=rt, gate_up=gu, down=dn, combine=cb,
                    route_gate_up=lambda: (rt(), gu()),
                    down_combine=lambda: (dn(), cb()),
                )
                row = dict(preset=pname, weight=wname, tokens=t, rows=rows, specs=[s1.name, s2.name])
                for k, fn in parts.items():
                    row[k] = time_graph(fn)
                ref = moe.fused_moe(x, w13, w2, tw, ids)
                row["check"] = ((ref.float() - o.float()).norm() / ref.float().norm()).item()
                row["same_bits"] = bool(torch.equal(ref, four_launches()))
                out["rows"].append(row)
                print(pname, wname, t, " ".join(f"{k}={row[k]:.1f}" for k in parts), f"err={row['check']:.1e} same_bits={row['same_bits']}",
                      flush=True)
            del layer
            torch.cuda.empty_cache()
    json.dump(out, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
