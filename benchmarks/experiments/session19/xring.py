"""Session 19: the decode kernel with an x ring (DecodeSpec.x_stages) against the resident x tile.

xtile.py found the 16-token kernel ~25-30% slower at M = 16 than at M = 2 on the large layers:
its x tile (16 rows x the CTA's k-range) bounds the CTAs per SM and the splits of K. The x-ring
kernel streams x in TMA boxes of 2-4 atoms through x_stages slots instead (and subtracts the
zero point in registers: no x sums). Here, per layer and M: every kernel's output against a
float64 reference on the same dequantized weight (relative error of the norm), then us per launch
at splits 1-8 (chains of 8 launches over 4 weights in one graph, L2 flushed before it).
usage: xring.py OUT.json
"""
import json, os, sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV as dev, read_gbps, time_graph  # noqa: E402

import mixgemm  # noqa: E402
from mixgemm import build, ops  # noqa: E402
from mixgemm.quantize import dequantize_reference  # noqa: E402
from mixgemm.specs import Activation, DecodeSpec  # noqa: E402
from mixgemm.types import ActType, WeightType  # noqa: E402

SHAPES = (("gate_up", 28672, 4096, Activation.SWIGLU), ("down", 4096, 14336, Activation.NONE),
          ("qkv", 6144, 4096, Activation.NONE), ("o", 4096, 4096, Activation.NONE),
          ("70b_gate_up", 57344, 8192, Activation.SWIGLU))
WEIGHTS = {"u4": WeightType.U4, "u2": WeightType.U2, "s8": WeightType.S8}
# (label, token tile, x_stages, M values)
KERNELS = (("dec16", 16, 0, (9, 16)), ("dec16x4", 16, 4, (9, 16)), ("dec16x3", 16, 3, (16,)),
           ("dec8", 8, 0, (4, 8)), ("dec8x4", 8, 4, (4, 8)))


def spec(tokens, xs, wt, act):
    return DecodeSpec(ActType.BF16, wt, tokens, stage_bytes=max(1024, 128 * wt.bits), activation=act, x_stages=xs)


def reference(x, w, act):
    y = x.double() @ w.double().t()
    if act is Activation.SWIGLU:   # gate/up interleaved in 8-row stripes
        y = y.reshape(y.shape[0], -1, 2, 8)
        y = torch.nn.functional.silu(y[:, :, 0]) * y[:, :, 1]
        y = y.reshape(y.shape[0], -1)
    return y


def main():
    weights = sys.argv[2].split(",") if len(sys.argv) > 2 else ["u4"]
    specs = [spec(t, xs, WEIGHTS[w], a) for w in weights for _, t, xs, _ in KERNELS
             for a in (Activation.NONE, Activation.SWIGLU)]
    build.build_many(specs, jobs=16, progress=False)
    out = dict(read_gbps=read_gbps(), rows=[])
    for wname in weights:
        wt = WEIGHTS[wname]
        for name, n, k, act in SHAPES:
            if name == "70b_gate_up" and wname != "u4":
                continue
            qs = [mixgemm.quantize(torch.randn(n, k, device=dev) * 0.02, wt.bits, 128, symmetric=wt.signed,
                                   dtype=torch.bfloat16) for _ in range(4)]
            ws = [mixgemm.prepack(q) for q in qs]
            wref = dequantize_reference(qs[0]).to(dev)
            del qs
            nbytes = sum(t.numel() * t.element_size() for t in (ws[0].qdata, ws[0].scales, ws[0].zeros) if t is not None)
            row = dict(weight=wname, layer=name, n=n, k=k, floor_us=nbytes / (out["read_gbps"] * 1e3), runs={})
            for label, tokens, xs, ms in KERNELS:
                s = spec(tokens, xs, wt, act)
                for m in ms:
                    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    ref = reference(x, wref, act)
                    res = {}
                    for splits in (1, 2, 3, 4, 6, 8):
                        try:
                            y = ops.gemm_with_spec(x, ws[0], s, splits=splits)
                        except Exception as e:   # (a split the kernel refuses)
                            res[splits] = str(e)[:60]
                            continue
                        err = ((y.double() - ref).norm() / ref.norm()).item()
                        t = time_graph(lambda: [ops.gemm_with_spec(x, ws[i % 4], s, splits=splits) for i in range(8)]) / 8
                        res[splits] = dict(us=round(t, 2), err=float(f"{err:.2e}"))
                    ok = {sp: v for sp, v in res.items() if isinstance(v, dict)}
                    best = min(ok.items(), key=lambda kv: kv[1]["us"])
                    worst_err = max(v["err"] for v in ok.values())
                    row["runs"][f"{label}/m{m}"] = dict(best_us=best[1]["us"], best_split=best[0], max_err=worst_err,
                                                         splits=res)
                    print(wname, name, f"{label} m{m}", f"best {best[1]['us']} @s{best[0]}", f"err {worst_err:.1e}",
                          " ".join(f"{sp}:{v['us']}" for sp, v in ok.items()), f"floor {row['floor_us']:.1f}", flush=True)
            out["rows"].append(row)
            del ws, wref
            torch.cuda.empty_cache()
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
