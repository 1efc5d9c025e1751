"""Session 12 experiment: a decode step's weights prefetched into L2 from a side stream.

Hypothesis (NOTES 14): in a decode step at batch 1 the DRAM is idle during the ~40-50 us per
layer of latency-bound kernels (norms, rotary, cache writes, attention, residual adds) and the
small decode GEMMs are latency-bound too (NOTES 9b/9d). If the o projection's weights (and the
next layer's qkv, and part of gate/up) are prefetched into the 50 MB L2 during those kernels, the
GEMMs read them from L2 and the step approaches max(DRAM time, latency chain).

The prefetch kernel (l2_prefetch.cu, built here with nvcc) only issues cp.async.bulk.prefetch.L2
(or prefetch.global.L2 per line) and exits; it runs on a side stream forked from the main stream
at chosen points of the layer, so in the captured graph it is a parallel branch.

usage: prefetch_step.py OUT.json [--layers 4] [--batch 1,16] [--variants bf16,int4,int2,int8,torch-int4]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from mixgemm.bench import decoder, variants
from mixgemm.bench.decoder import attention, rms_norm
from mixgemm.runtime import _ensure_context, check

HERE = Path(__file__).resolve().parent
dev = torch.device("cuda", 0)


class Ranges(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_uint64 * 8), ("bytes", ctypes.c_uint64 * 8), ("keep_lo", ctypes.c_uint32 * 8),
                ("keep_hi", ctypes.c_uint32 * 8), ("count", ctypes.c_int32), ("mode", ctypes.c_int32),
                ("chunk", ctypes.c_uint32)]


def load_prefetch():
    from cuda.bindings import driver as drv
    cubin = Path("/tmp/l2_prefetch.cubin")
    subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-cubin", "-o", str(cubin),
                    str(HERE / "l2_prefetch.cu")], check=True)
    _ensure_context(dev)
    mod = check(drv.cuModuleLoadData(cubin.read_bytes()), "load")
    return check(drv.cuModuleGetFunction(mod, b"l2_prefetch"), "function")


FUNC = None


class Prefetcher:
    """Forks a side stream at a point of the layer and prefetches [(tensor, lo, hi)] there."""

    def __init__(self, mode: int, chunk: int, grid: int, block: int = 128):
        self.mode, self.chunk, self.grid, self.block = mode, chunk, grid, block
        self.side = torch.cuda.Stream(dev)
        self.forked = False

    def __call__(self, items):
        from cuda.bindings import driver as drv
        if not items:
            return
        r = Ranges()
        for i, (t, lo, hi) in enumerate(items):
            r.ptr[i], r.bytes[i] = t.data_ptr(), t.numel() * t.element_size()
            r.keep_lo[i], r.keep_hi[i] = lo, hi
        r.count, r.mode, r.chunk = len(items), self.mode, self.chunk
        main = torch.cuda.current_stream(dev)
        self.side.wait_stream(main)
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(r))
        check(drv.cuLaunchKernel(FUNC, self.grid, 1, 1, self.block, 1, 1, 0, drv.CUstream(self.side.cuda_stream),
                                 ctypes.addressof(argv), 0), "launch prefetch")
        self.forked = True

    def join(self):
        if self.forked:
            torch.cuda.current_stream(dev).wait_stream(self.side)
            self.forked = False


def tensors_of(proj, name):
    if isinstance(proj, variants.MixgemmProjections):
        l = proj.layers[name]
        return [t for t in (l.qdata, l.scales, l.zeros, l.zero_offsets) if t is not None]
    if isinstance(proj, variants.TorchInt4Projections):
        return list(proj.packs[name])
    w = {"qkv": proj.w_qkv, "o": proj.w_o, "gate_up": proj.w_gate_up, "down": proj.w_down}[name]
    return [w]


#: plan: point -> [(which layer: "cur" | "next", projection, keep_lo, keep_hi)]
PLANS = {
    "none": {},
    "o": {"qkv": [("cur", "o", 0, 8)]},
    "o+qkv": {"qkv": [("cur", "o", 0, 8)], "down": [("next", "qkv", 0, 8)]},
    "o+qkv+gu2": {"qkv": [("cur", "o", 0, 8), ("cur", "gate_up", 0, 2)], "down": [("next", "qkv", 0, 8)]},
    "o+qkv+gu3": {"qkv": [("cur", "o", 0, 8), ("cur", "gate_up", 0, 3)], "down": [("next", "qkv", 0, 8)]},
    "o+qkv+gu2+1": {"qkv": [("cur", "o", 0, 8), ("cur", "gate_up", 0, 2)], "o": [("cur", "gate_up", 2, 3)],
                    "down": [("next", "qkv", 0, 8)]},
    "o+qkv+gu4": {"qkv": [("cur", "o", 0, 8), ("cur", "gate_up", 0, 4)], "down": [("next", "qkv", 0, 8)]},
}


def layer(x, pos, p, proj, st, rot, pf, plan, nxt):
    def at(point):
        items = []
        for which, name, lo, hi in plan.get(point, []):
            src = proj if which == "cur" else nxt
            if src is not None:
                items += [(t, lo, hi) for t in tensors_of(src, name)]
        pf(items)

    b, t, hidden = x.shape
    d = p.head_dim
    h = rms_norm(x, st.attn_norm, p.rms_eps)
    qkv = proj.qkv(h.reshape(b * t, hidden))
    at("qkv")
    qk, v = qkv.split((p.q_size + p.kv_size, p.kv_size), dim=-1)
    qk = rot(qk.reshape(b, t, p.heads + p.kv_heads, d), pos)
    q, k = qk[:, :, :p.heads], qk[:, :, p.heads:]
    kc, vc = st.k_cache[:b], st.v_cache[:b]
    kc[:, :, pos:pos + t] = k.transpose(1, 2)
    vc[:, :, pos:pos + t] = v.reshape(b, t, p.kv_heads, d).transpose(1, 2)
    a = attention(q.transpose(1, 2), kc[:, :, :pos + t], vc[:, :, :pos + t], pos)
    x = x + proj.o(a.transpose(1, 2).reshape(b * t, p.q_size)).reshape(b, t, hidden)
    at("o")
    h = rms_norm(x, st.mlp_norm, p.rms_eps)
    m = proj.mlp_in(h.reshape(b * t, hidden))
    at("gate_up")
    y = proj.down(m)
    at("down")
    return x + y.reshape(b, t, hidden)


def run_stack(x, pos, p, projs, states, rot, pf, plan):
    for i, (proj, st) in enumerate(zip(projs, states)):
        nxt = projs[i + 1] if i + 1 < len(projs) else None
        x = layer(x, pos, p, proj, st, rot, pf, plan, nxt)
    pf.join()
    return x


L2 = torch.cuda.get_device_properties(dev).L2_cache_size if torch.cuda.is_available() else 0


def main():
    global FUNC
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--variants", default="bf16,int4,int2,int8,torch-int4")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--modes", default="0")
    ap.add_argument("--chunks", default="4096")
    ap.add_argument("--grids", default="16")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    FUNC = load_prefetch()
    p = decoder.PRESETS["llama3-8b"]
    rot = decoder.Rotary(p.head_dim, p.rope_theta, 1100, torch.bfloat16, dev)
    wbuf = torch.empty(2 * L2, dtype=torch.uint8, device=dev)
    rbuf = torch.ones(2 * L2 // 4, dtype=torch.float32, device=dev)
    sink = torch.empty((), dtype=torch.float32, device=dev)
    # the read bandwidth in the same run (1 GiB sum)
    big = torch.ones(1 << 28, dtype=torch.float32, device=dev)
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); big.sum(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    bw = (1 << 30) / (statistics.median(ts) * 1e-3) / 1e9
    del big
    print(f"read bandwidth {bw:.0f} GB/s, L2 {L2 >> 20} MiB", flush=True)

    def flush():
        wbuf.fill_(3); sink.copy_(rbuf.sum())

    results = []
    for vname in a.variants.split(","):
        v = variants.parse_variant(vname)
        projs = [variants.build_layer(p, v, l, 0, dev, 128)[0] for l in range(a.layers)]
        wbytes = sum(pr.weight_bytes() for pr in projs) / a.layers
        for b in (int(s) for s in a.batch.split(",")):
            states = [decoder.layer_state(p, l, 0, b, 1025, dev, torch.bfloat16) for l in range(a.layers)]
            x = torch.randn(b, 1, p.hidden, device=dev, dtype=torch.bfloat16)
            ref = None
            for mode in (int(s) for s in a.modes.split(",")):
                for chunk in (int(s) for s in a.chunks.split(",")):
                    for grid in (int(s) for s in a.grids.split(",")):
                        for pname in a.plans.split(","):
                            if pname == "none" and (mode, chunk, grid) != (int(a.modes.split(",")[0]), int(a.chunks.split(",")[0]), int(a.grids.split(",")[0])):
                                continue
                            pf = Prefetcher(mode, chunk, grid)
                            plan = PLANS[pname]
                            with torch.no_grad():
                                fn = lambda: run_stack(x, 1024, p, projs, states, rot, pf, plan)
                                y = fn(); torch.cuda.synchronize()
                                g = torch.cuda.CUDAGraph()
                                with torch.cuda.graph(g):
                                    yg = fn()
                                g.replay(); torch.cuda.synchronize()
                                if ref is None:
                                    ref = yg.clone()
                                same = bool(torch.equal(yg, ref))
                                for _ in range(3):
                                    flush(); g.replay()
                                ev = []
                                for _ in range(a.iters):
                                    flush()
                                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                                    e0.record(); g.replay(); e1.record(); ev.append((e0, e1))
                                torch.cuda.synchronize()
                                us = statistics.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in ev) / a.layers
                                kern = None
                                if a.profile and b == 1:
                                    from torch.profiler import ProfilerActivity, profile
                                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                                        for _ in range(5):
                                            flush(); g.replay()
                                        torch.cuda.synchronize()
                                    tot = {}
                                    for e in prof.events():
                                        if e.device_type == torch.autograd.DeviceType.CUDA:
                                            key = e.name[:60]
                                            tot[key] = tot.get(key, 0.0) + e.device_time_total / 5 / a.layers
                                    kern = {k: round(t, 2) for k, t in sorted(tot.items(), key=lambda kv: -kv[1])[:16]}
                            floor = (wbytes + 2 * b * 1025 * p.kv_size * 2) / (bw * 1e3)
                            row = dict(variant=vname, batch=b, plan=pname, mode=mode, chunk=chunk, grid=grid,
                                       us_per_layer=round(us, 2), floor_us=round(floor, 2), same_output=same,
                                       kernels=kern)
                            results.append(row)
                            print(json.dumps(row), flush=True)
                            del g
            del states
        del projs
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(dict(read_gbps=bw, l2_bytes=L2, rows=results), indent=1))


if __name__ == "__main__":
    main()
