"""Session 22: where a decode fused_moe call's time goes, inside its launches (#19).

The decode kernel's phase trace (session 17's, decode_kernel.hpp; built with
MIXGEMM_NVCC_FLAGS=-DMIXGEMM_DECODE_TRACE), now indexed by the whole grid (the grouped kernel's z
ranks) and with two marks of the grouped kernel before run(): its entry and its grid wait. run()'s
own entry comes after the expert's ranking.

For each preset, code and token count (uniform routing, bench --moe's weights): fused_moe's graph
time (median of 40 replays, L2 flushed before each), then one traced replay. Per grouped launch:
the CTAs launched and those that ran an expert, SMs, the launch's span (first entry to last
exit), the gap after the previous traced launch, and per CTA (p50 / max, us): entry to grid wait,
wait to run() (the ranking), and run()'s phases. The combine launch is not traced: the graph's
time less the two spans and the gaps is its share with the graph's edges.

usage: MIXGEMM_NVCC_FLAGS=-DMIXGEMM_DECODE_TRACE moe_trace.py OUT.json [T,..] [u4,u2] [presets]
"""
import importlib.util
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "session12"))
from harness import DEV as dev, flush, read_gbps, time_graph  # noqa: E402

_spec = importlib.util.spec_from_file_location("s17trace", os.path.join(HERE, "..", "session17", "trace.py"))
s17 = importlib.util.module_from_spec(_spec)   # (not "trace": the standard library has one)
_spec.loader.exec_module(s17)
NP, PHASES, TRACED, read, reset, trace_buffers = s17.NP, s17.PHASES, s17.TRACED, s17.read, s17.reset, s17.trace_buffers

from mixgemm import moe, runtime  # noqa: E402
from moe_point import point_inputs, preset_weights, quantized  # noqa: E402

SLOTS, CTAS = 32, 2048


def grouped_marks():
    """{kernel name: [CTAS, 2] globaltimer of the grouped entry and grid-wait marks (slot 0)}."""
    drv = runtime._driver()
    out = {}
    for (name, _), k in list(runtime.KERNELS._kernels.items()):
        if "gdecode" not in name:
            continue
        err, ptr, size = drv.cuModuleGetGlobal(k.module, b"mixgemm_grouped_trace")
        if int(err) != 0:
            continue
        host = np.zeros(size // 8, dtype=np.uint64)
        try:
            runtime.check(drv.cuMemcpyDtoH(host, ptr, size), "memcpy")
        except Exception:
            runtime.check(drv.cuMemcpyDtoH(host.ctypes.data, ptr, size), "memcpy")
        out[name] = host.reshape(SLOTS, CTAS, 2)[0]
    return out


def reset_grouped():
    drv = runtime._driver()
    for (name, _), k in list(runtime.KERNELS._kernels.items()):
        if "gdecode" not in name:
            continue
        for sym in (b"mixgemm_grouped_trace", b"mixgemm_grouped_trace_seq"):
            err, ptr, size = drv.cuModuleGetGlobal(k.module, sym)
            if int(err) == 0:
                runtime.check(drv.cuMemsetD8(ptr, 0, size), "memset")
    torch.cuda.synchronize()


def pct(a):
    a = np.asarray(a, dtype=np.float64)
    return dict(p50=round(float(np.median(a)), 3), max=round(float(a.max()), 3)) if a.size else None


def summarize(recs, marks):
    """One row per traced kernel (each runs once per fused_moe call), in start order."""
    by_name = {}
    for name, r in recs:
        by_name.setdefault(name, []).append(r)
    rows = []
    for name, rs in by_name.items():
        a = np.stack(rs)
        gt = a[:, 3:3 + NP].astype(np.int64)
        ck = a[:, 3 + NP:].astype(np.int64)
        row = dict(kernel=name, ran=len(a), sms=len(set(int(x) & 0xFFFFFFFF for x in a[:, 2])),
                   grid=int(a[0, 2]) >> 32)
        m = marks.get(name)
        if m is not None:
            launched = m[:, 0] != 0
            ent, wt = m[launched, 0].astype(np.int64), m[launched, 1].astype(np.int64)
            start = int(ent.min())
            row["launched"] = int(launched.sum())
            row["entry_spread_us"] = pct((ent - start) / 1e3)
            row["entry_to_wait_us"] = pct((wt - ent) / 1e3)
            row["wait_after_start_us"] = pct((wt - start) / 1e3)
        else:
            start = int(gt[:, 0].min())
        end = int(gt[:, NP - 1].max())
        row["start_ns"] = start
        row["end_ns"] = end
        row["span_us"] = round((end - start) / 1e3, 2)
        row["run_entry_after_start_us"] = pct((gt[:, 0] - start) / 1e3)
        row["exit_after_start_us"] = pct((gt[:, NP - 1] - start) / 1e3)
        dg, dc = (gt[:, NP - 1] - gt[:, 0]).sum(), (ck[:, NP - 1] - ck[:, 0]).sum()
        ghz = dc / dg if dg > 0 else float("nan")
        row["sm_ghz"] = round(float(ghz), 3)
        row["phase_us"] = {PHASES[i]: pct((ck[:, i] - ck[:, i - 1]) / ghz / 1e3) for i in range(1, NP)}
        rows.append(row)
    rows.sort(key=lambda r: r["start_ns"])
    t0 = rows[0]["start_ns"] if rows else 0
    prev = None
    for r in rows:
        r["t_start_us"] = round((r["start_ns"] - t0) / 1e3, 2)
        r["gap_us"] = None if prev is None else round((r["start_ns"] - prev) / 1e3, 2)
        prev = r["end_ns"]
    return rows


def traced_replay(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    bufs = trace_buffers()
    reset(bufs)
    reset_grouped()
    flush()
    g.replay()
    return read(bufs), grouped_marks()


def main():
    out_path = sys.argv[1]
    tokens = [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,4").split(",")]
    weights = (sys.argv[3] if len(sys.argv) > 3 else "u4,u2").split(",")
    presets = (sys.argv[4] if len(sys.argv) > 4 else "qwen3-30b-a3b,mixtral-8x7b").split(",")
    out = dict(traced=TRACED, read_gbps=read_gbps(), device=torch.cuda.get_device_name(), cases=[])
    for pname in presets:
        p, w13b, w2b = preset_weights(pname, dev)
        for wname in weights:
            layer = quantized(w13b, w2b, wname)
            w13, w2 = layer.w13, layer.w2
            for t in tokens:
                x, tw, ids = point_inputs(p, t, "uniform", dev)

                def fn():
                    return moe.fused_moe(x, w13, w2, tw, ids)

                case = dict(preset=pname, weight=wname, tokens=t, graph_us=round(time_graph(fn), 2))
                if TRACED:
                    recs, marks = traced_replay(fn)
                    case["launches"] = summarize(recs, marks)
                out["cases"].append(case)
                print(f"== {pname} {wname} T={t}: graph {case['graph_us']} us", flush=True)
                for r in case.get("launches", []):
                    ph = " ".join(f"{k}={v['p50']:.2f}/{v['max']:.2f}" for k, v in r["phase_us"].items() if v)
                    pre = ""
                    if "launched" in r:
                        pre = (f"launched={r['launched']} entry_spread={r['entry_spread_us']['max']:.2f} "
                               f"entry->wait={r['entry_to_wait_us']['p50']:.2f}/{r['entry_to_wait_us']['max']:.2f} "
                               f"wait@={r['wait_after_start_us']['p50']:.2f}/{r['wait_after_start_us']['max']:.2f} ")
                    print(f"  {r['kernel'][16:]} ran={r['ran']} sms={r['sms']} t={r['t_start_us']} span={r['span_us']} "
                          f"gap={r['gap_us']} {pre}run@={r['run_entry_after_start_us']['p50']:.2f}/"
                          f"{r['run_entry_after_start_us']['max']:.2f} exit@={r['exit_after_start_us']['p50']:.2f}/"
                          f"{r['exit_after_start_us']['max']:.2f} | {ph}", flush=True)
            del layer
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
