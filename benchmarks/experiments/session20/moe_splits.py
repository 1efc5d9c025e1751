"""Session 20: the grouped decode kernel's split-K factor at decode (#19).

The grouped decode kernel splits K by a rule of its own (grouped_decode_kernel.hpp `plan`: enough
CTAs for every SM over min(E, rows) experts, up to 8), not the dense planner. Per preset (mixtral-8x7b,
qwen3-30b-a3b), tokens and code (uniform routing, bench --moe's weights and routing), this times
fused_moe's two grouped launches with the kernel's own factor (0) and every forced factor 1-8, and
the whole fused_moe, one launch per CUDA graph after an L2 flush (median of 40); each forced
factor's output is checked against the kernel's own (relative error).
usage: moe_splits.py OUT.json [T,T,..] [u4,u2]
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV as dev, read_gbps, time_graph  # noqa: E402

from mixgemm import moe  # noqa: E402
from mixgemm.bench.moe import MOE_PRESETS, make_routing  # noqa: E402
from mixgemm.bench.moe_run import MixgemmLayer, base_weights  # noqa: E402
from mixgemm.bench.variants import parse_variant  # noqa: E402
from mixgemm.moe_grouped import decode_spec_for, grouped_gemm_with_spec  # noqa: E402
from mixgemm.moe_routing import route_and_gather  # noqa: E402


def main():
    out_path = sys.argv[1]
    tokens = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,4,16").split(",")]
    weights = (sys.argv[3] if len(sys.argv) > 3 else "u4,u2").split(",")
    out = dict(read_gbps=read_gbps(), rows=[])
    for pname in ("mixtral-8x7b", "qwen3-30b-a3b"):
        p = MOE_PRESETS[pname]
        w13b, w2b = base_weights(p, 0, dev)
        for wname in weights:
            variant = parse_variant(wname)
            layer = MixgemmLayer(w13b, w2b, variant, 128)
            for t in tokens:
                ids, tw = make_routing(p.experts, p.topk, t, "uniform", 0)
                ids, tw = ids.to(dev), tw.to(dev)
                x = (torch.randn(t, p.hidden, device=dev) * 0.5).to(torch.bfloat16)
                routing, xs = route_and_gather(x, ids, p.experts)
                offs = routing.expert_offsets
                rows = xs.shape[0]
                row = dict(preset=pname, weight=wname, tokens=t, rows=rows, gate_up={}, down={})
                spec1 = decode_spec_for(rows, layer.w13.act_type, layer.w13.weight_type, "swiglu", p.experts)
                spec2 = decode_spec_for(rows, layer.w2.act_type, layer.w2.weight_type, None, p.experts)
                row["specs"] = [spec1.name, spec2.name]
                h = grouped_gemm_with_spec(xs, layer.w13, offs, spec1, activation="swiglu")
                y = grouped_gemm_with_spec(h, layer.w2, offs, spec2)
                for name, fn_of, ref in (
                        ("gate_up", lambda s: (lambda: grouped_gemm_with_spec(xs, layer.w13, offs, spec1, out=hb,
                                                                              activation="swiglu", splits=s)), h),
                        ("down", lambda s: (lambda: grouped_gemm_with_spec(h, layer.w2, offs, spec2, out=yb,
                                                                           splits=s)), y)):
                    hb, yb = torch.empty_like(h), torch.empty_like(y)
                    for s in range(0, 9):
                        try:
                            fn = fn_of(s)
                            fn()
                            got = hb if name == "gate_up" else yb
                            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                            row[name][s] = dict(us=time_graph(fn), err=err)
                        except Exception as e:   # a factor that does not fit shared memory
                            row[name][s] = dict(error=str(e)[:200])
                row["fused_moe_us"] = time_graph(lambda: moe.fused_moe(x, layer.w13, layer.w2, tw, ids))
                out["rows"].append(row)
                fmt = lambda d: " ".join(f"{s}:{v['us']:.1f}" if "us" in v else f"{s}:x" for s, v in d.items())  # noqa: E731
                print(pname, wname, t, "rows", rows, "| gate/up", fmt(row["gate_up"]), "| down", fmt(row["down"]),
                      f"| fused {row['fused_moe_us']:.1f}", flush=True)
            del layer
            torch.cuda.empty_cache()
    json.dump(out, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
