"""Session 17: where a decode GEMM's fixed cost goes. The decode kernel's phase trace
(decode_kernel.hpp, built with MIXGEMM_NVCC_FLAGS=-DMIXGEMM_DECODE_TRACE): for every CTA of every
launch in one CUDA-graph replay (L2 flushed before it), %globaltimer at entry, after the barrier
set-up, after the grid wait, when x and the scales have landed, after the x-sums, when warp 0's
stream ends, after the split-K reduction and at exit.

Cases: chains of 8 launches of each llama3-8b projection (u4, M = 1), and the 4-layer llama3-8b
decoder stack of bench --model (u4, batch 1). For each, the graph's time (median of the replays,
L2 flushed) and per launch: CTAs, SMs, the span from the first entry to the last exit, the gap
from the previous traced launch's last exit, and the phases per CTA (median, max).

usage: MIXGEMM_NVCC_FLAGS=-DMIXGEMM_DECODE_TRACE trace.py OUT.json [weight types, default u4]
(without the flag: the timings only, to check that the trace costs nothing)
"""
import collections, ctypes, json, os, statistics, sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "session12"))
from harness import DEV as dev, flush, read_gbps, time_graph  # noqa: E402

from mixgemm import runtime  # noqa: E402
from mixgemm.bench import decoder  # noqa: E402
from mixgemm.bench.variants import build_layer, parse_variant  # noqa: E402

PHASES = ("entry", "init", "scales_issued", "ring_issued", "grid_wait", "x_tile", "x_sum", "scales", "first_stage",
          "stream", "reduce", "exit")
NP = len(PHASES)
FIELDS = 3 + 2 * NP
TRACED = "-DMIXGEMM_DECODE_TRACE" in os.environ.get("MIXGEMM_NVCC_FLAGS", "")


def _drv():
    return runtime._driver()


def trace_buffers():
    """(kernel name, trace ptr, trace bytes, seq ptr, seq bytes) of every loaded decode kernel."""
    drv = _drv()
    out = []
    for (name, _), k in list(runtime.KERNELS._kernels.items()):
        if "decode" not in name:
            continue
        err, ptr, size = drv.cuModuleGetGlobal(k.module, b"mixgemm_decode_trace")
        if int(err) != 0:
            continue
        err2, sptr, ssize = drv.cuModuleGetGlobal(k.module, b"mixgemm_decode_trace_seq")
        out.append((name, int(ptr), int(size), int(sptr), int(ssize)))
    return out


def reset(bufs):
    torch.cuda.synchronize()
    drv = _drv()
    for _, p, n, sp, sn in bufs:
        runtime.check(drv.cuMemsetD8(p, 0, n), "memset")
        runtime.check(drv.cuMemsetD8(sp, 0, sn), "memset")
    torch.cuda.synchronize()


def read(bufs):
    torch.cuda.synchronize()
    drv = _drv()
    recs = []
    for name, p, n, _, _ in bufs:
        host = np.zeros(n // 8, dtype=np.uint64)
        try:
            runtime.check(drv.cuMemcpyDtoH(host, p, n), "memcpy")
        except Exception:   # (cuda-python versions differ on the host pointer's type)
            runtime.check(drv.cuMemcpyDtoH(host.ctypes.data, p, n), "memcpy")
        a = host.reshape(-1, FIELDS)
        a = a[a[:, 3] != 0]
        for r in a:
            recs.append((name, r))
    return recs


def launches(recs):
    """Group the CTA records into launches: key (kernel, n, m, y, grid), then the k-th occurrence
    of that key on each CTA index in time order (all CTAs of an earlier launch enter before a
    later one's)."""
    by_key = collections.defaultdict(list)
    for name, r in recs:
        key = (name, int(r[0]), int(r[1]), int(r[2]) >> 32)
        by_key[key].append(r)
    out = []
    for key, rs in by_key.items():
        rs.sort(key=lambda r: int(r[3]))
        grid = key[3]
        # consecutive launches of the same key: split the time-sorted records into chunks of grid
        for i in range(0, len(rs), grid):
            chunk = rs[i:i + grid]
            out.append((key, np.stack(chunk)))
    out.sort(key=lambda kv: int(kv[1][:, 3].min()))
    return out


def summarize(ls, raw=False):
    rows = []
    prev_end = None
    t0 = int(ls[0][1][:, 3].min()) if ls else 0
    for key, a in ls:
        gt = a[:, 3:3 + NP].astype(np.int64)
        start, end = int(gt[:, 0].min()), int(gt[:, NP - 1].max())
        row = dict(kernel=key[0], n=key[1] & 0xFFFFFFFF, m=key[1] >> 32, ctas=len(a),
                   sms=len(set(int(x) & 0xFFFFFFFF for x in a[:, 2])),
                   t_start_us=round((start - t0) / 1e3, 2), span_us=round((end - start) / 1e3, 2),
                   gap_us=None if prev_end is None else round((start - prev_end) / 1e3, 2),
                   entry_spread_us=dict(p50=round(float(np.median(gt[:, 0] - start)) / 1e3, 2),
                                        max=round(float((gt[:, 0] - start).max()) / 1e3, 2)),
                   exit_spread_us=dict(p50=round(float(np.median(end - gt[:, NP - 1])) / 1e3, 2),
                                       max=round(float((end - gt[:, NP - 1]).max()) / 1e3, 2)))
        ck = a[:, 3 + NP:].astype(np.int64)
        # SM cycles -> ns from the CTAs' own entry-to-exit (globaltimer vs clock64)
        dg, dc = (gt[:, NP - 1] - gt[:, 0]).sum(), (ck[:, NP - 1] - ck[:, 0]).sum()
        ghz = dc / dg if dg > 0 else float("nan")
        row["sm_ghz"] = round(float(ghz), 3)
        phases = {}
        for i in range(1, NP):
            d = (ck[:, i] - ck[:, i - 1]) / ghz / 1e3
            phases[PHASES[i]] = dict(p50=round(float(np.median(d)), 3), max=round(float(d.max()), 3))
        row["phase_us"] = phases
        if raw:   # every CTA: the SM, then each phase's end (us after the launch's first entry)
            row["raw"] = [[int(sm) & 0xFFFFFFFF] + [round((int(v) - start) / 1e3, 3) for v in g]
                          for sm, g in zip(a[:, 2], gt)]
        # the grid wait's release, relative to the previous launch's end
        if prev_end is not None:
            gw = gt[:, PHASES.index("grid_wait")]
            row["grid_wait_release_after_prev_end_us"] = dict(
                min=round((int(gw.min()) - prev_end) / 1e3, 2), p50=round((float(np.median(gw)) - prev_end) / 1e3, 2))
        rows.append(row)
        prev_end = end
    return rows


def run_case(name, fn, bufs_fn, iters=50, raw=False):
    t = time_graph(fn, iters=iters)
    res = dict(case=name, graph_us=round(t, 2))
    if TRACED:
        # one more replay of the same graph, traced
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        bufs = bufs_fn()
        reset(bufs)
        flush()
        g.replay()
        recs = read(bufs)
        res["launches"] = summarize(launches(recs), raw)
        res["globaltimer_lsb_ns"] = int(np.gcd.reduce([int(r[3 + i]) for _, r in recs[:200] for i in range(NP)]))
    return res


def main():
    out_path = sys.argv[1]
    wts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["u4"]
    out = dict(traced=TRACED, read_gbps=read_gbps(), device=torch.cuda.get_device_name(), cases=[])
    p = decoder.PRESETS["llama3-8b"]
    for wt in wts:
        variant = parse_variant(wt)
        projs = [build_layer(p, variant, l, 0, dev, 128)[0] for l in range(4)]
        x = torch.randn(1, p.hidden, device=dev, dtype=torch.bfloat16)
        xi = torch.randn(1, p.intermediate, device=dev, dtype=torch.bfloat16)
        xq = torch.randn(1, p.q_size, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            for name, f, arg in (("qkv", "qkv", x), ("o", "o", xq), ("gate_up", "mlp_in", x), ("down", "down", xi)):
                fns = [getattr(pr, f) for pr in projs]
                case = run_case(f"{wt} chain8 {name}", lambda: [fns[i % 4](arg) for i in range(8)], trace_buffers)
                print(json.dumps({k: v for k, v in case.items() if k != "launches"}), flush=True)
                out["cases"].append(case)
            rot = decoder.Rotary(p.head_dim, p.rope_theta, 1100, torch.bfloat16, dev)
            states = [decoder.layer_state(p, l, 0, 1, 1025, dev, torch.bfloat16) for l in range(4)]
            stack = decoder.DecoderStack(p, projs, states, rot)
            xx = torch.randn(1, 1, p.hidden, device=dev, dtype=torch.bfloat16)
            case = run_case(f"{wt} stack4 b1", lambda: stack(xx, 1024), trace_buffers, raw=True)
            print(json.dumps({k: v for k, v in case.items() if k != "launches"}), flush=True)
            out["cases"].append(case)
        del projs, stack
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    if TRACED:
        for case in out["cases"]:
            print("==", case["case"], case["graph_us"], "us; globaltimer lsb", case.get("globaltimer_lsb_ns"))
            for r in case["launches"]:
                ph = " ".join(f"{k}={v['p50']:.2f}/{v['max']:.2f}" for k, v in r["phase_us"].items())
                print(f"  n={r['n']:6d} ctas={r['ctas']:4d} sms={r['sms']:3d} t={r['t_start_us']:7.2f} "
                      f"span={r['span_us']:6.2f} gap={r['gap_us']} entry={r['entry_spread_us']['max']:.2f} "
                      f"exit={r['exit_spread_us']['max']:.2f} ghz={r['sm_ghz']} | {ph}")


if __name__ == "__main__":
    main()
