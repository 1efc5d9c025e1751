"""Where a decode GEMM's fixed cost goes: the decode kernel's phase trace, read back (docs/decode.md).

Built with ``MIXGEMM_NVCC_FLAGS=-DMIXGEMM_DECODE_TRACE`` (cutlass_ext/mixgemm/decode_kernel.hpp; a
kernel cache entry of its own), thread 0 of every CTA of every decode launch records %globaltimer and
clock64 at entry, after the barrier set-up, after the grid wait, when x and the scales have landed,
after the x-sums, when warp 0's stream ends, after the split-K reduction and at exit. This tool
replays a CUDA graph once (L2 flushed before it) and reads the records back.

Cases: chains of 8 launches of each llama3-8b projection (M = 1), and the 4-layer llama3-8b decoder
stack of ``mixgemm bench --model`` (batch 1), for each weight type. For each, the graph's time
(median of the replays, L2 flushed) and per launch: CTAs, SMs, the span from the first entry to
the last exit, the gap from the previous traced launch's last exit, and the phases per CTA
(median, max).

    MIXGEMM_NVCC_FLAGS=-DMIXGEMM_DECODE_TRACE python tools/decode_trace.py OUT.json [u4,u2]   # on the GPU
    (without the flag: the timings only, to check that the trace costs nothing)
"""
import collections
import json
import os
import statistics
import sys

import numpy as np
import torch

from mixgemm.bench import decoder
from mixgemm.bench.variants import build_layer, parse_variant
from mixgemm.jit import driver
from mixgemm.jit.loader import KERNELS

PHASES = ("entry", "init", "scales_issued", "ring_issued", "grid_wait", "x_tile", "x_sum", "scales", "first_stage",
          "stream", "reduce", "exit")
NP = len(PHASES)
FIELDS = 3 + 2 * NP
TRACED = "-DMIXGEMM_DECODE_TRACE" in os.environ.get("MIXGEMM_NVCC_FLAGS", "")


# ---------------------------------------------------------------------------------------------
# Timing: a CUDA graph of fn replayed after an L2 flush (a 2x-L2 write and a 2x-L2 read before
# every replay), CUDA events, the median
# ---------------------------------------------------------------------------------------------
_flush_buffers: list = []


def flush(device: torch.device) -> None:
    if not _flush_buffers:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        _flush_buffers.extend((torch.empty(2 * l2, dtype=torch.uint8, device=device),
                               torch.ones(2 * l2 // 4, dtype=torch.float32, device=device),
                               torch.empty((), dtype=torch.float32, device=device)))
    dirty, clean, sink = _flush_buffers
    dirty.fill_(3)
    sink.copy_(clean.sum())


def time_graph(fn, device: torch.device, iters: int = 40) -> float:
    """Median us of one replay of a graph of ``fn`` (warmed up twice on a side stream first), the L2
    flushed before every replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        flush(device)
        g.replay()
    ev = []
    for _ in range(iters):
        flush(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        ev.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def read_gbps(device: torch.device) -> float:
    """The read bandwidth from a 1 GiB float32 sum, median of 10."""
    big = torch.ones(1 << 28, dtype=torch.float32, device=device)
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        big.sum()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return (1 << 30) / (statistics.median(ts) * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------
# The trace buffers
# ---------------------------------------------------------------------------------------------


def trace_buffers():
    """(kernel name, trace ptr, trace bytes, seq ptr, seq bytes) of every loaded decode kernel."""
    drv = driver.cuda_driver()
    out = []
    for (name, _), k in list(KERNELS._kernels.items()):
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
    drv = driver.cuda_driver()
    for _, p, n, sp, sn in bufs:
        driver.check(drv.cuMemsetD8(p, 0, n), "memset")
        driver.check(drv.cuMemsetD8(sp, 0, sn), "memset")
    torch.cuda.synchronize()


def read(bufs):
    torch.cuda.synchronize()
    drv = driver.cuda_driver()
    recs = []
    for name, p, n, _, _ in bufs:
        host = np.zeros(n // 8, dtype=np.uint64)
        try:
            driver.check(drv.cuMemcpyDtoH(host, p, n), "memcpy")
        except Exception:   # (cuda-python versions differ on the host pointer's type)
            driver.check(drv.cuMemcpyDtoH(host.ctypes.data, p, n), "memcpy")
        a = host.reshape(-1, FIELDS)
        a = a[a[:, 3] != 0]
        for r in a:
            recs.append((name, r))
    return recs


def launches(recs):
    """Group the CTA records ``(kernel name, record)`` into launches. A record holds FIELDS words:
    N | M << 32, the output pointer, SM | grid size << 32, then %globaltimer (ns) and clock64 at
    each of PHASES; zero entry time: no record. Launches are keyed (kernel, N and M, y, grid
    size), and the records of one key, sorted by entry time, split into chunks of the grid size
    (all CTAs of an earlier launch enter before a later one's). In time order."""
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
    """Per launch of :func:`launches`: its shape, CTAs, SMs, start, span and gap from the previous
    launch's end (us), the spread of entries and exits, the SM clock (from the CTAs' own
    entry-to-exit in both clocks), and each phase's time per CTA (median, max; us); ``raw``: every
    CTA's SM and phase ends."""
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


def run_case(name, fn, bufs_fn, device, iters=50, raw=False):
    t = time_graph(fn, device, iters=iters)
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
        flush(device)
        g.replay()
        recs = read(bufs)
        res["launches"] = summarize(launches(recs), raw)
        res["globaltimer_lsb_ns"] = int(np.gcd.reduce([int(r[3 + i]) for _, r in recs[:200] for i in range(NP)]))
    return res


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    out_path = argv[0]
    wts = argv[1].split(",") if len(argv) > 1 else ["u4"]
    dev = torch.device("cuda", 0)
    out = dict(traced=TRACED, read_gbps=read_gbps(dev), device=torch.cuda.get_device_name(dev), cases=[])
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
                case = run_case(f"{wt} chain8 {name}", lambda: [fns[i % 4](arg) for i in range(8)], trace_buffers,
                                dev)
                print(json.dumps({k: v for k, v in case.items() if k != "launches"}), flush=True)
                out["cases"].append(case)
            rot = decoder.Rotary(p.head_dim, p.rope_theta, 1100, torch.bfloat16, dev)
            states = [decoder.layer_state(p, l, 0, 1, 1025, dev, torch.bfloat16) for l in range(4)]
            stack = decoder.DecoderStack(p, projs, states, rot)
            xx = torch.randn(1, 1, p.hidden, device=dev, dtype=torch.bfloat16)
            case = run_case(f"{wt} stack4 b1", lambda: stack(xx, 1024), trace_buffers, dev, raw=True)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
