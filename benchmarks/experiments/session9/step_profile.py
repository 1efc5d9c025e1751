"""Session-9 experiment 1 (H100): where does a decode step's time go?

A. Single GEMMs at M=1 (llama3-8b layers) under three L2 states before each timed run:
   'wflush' (write 2xL2: the harness's flush, leaves dirty lines that the timed kernel must
   write back), 'rflush' (read 2xL2 of a clean buffer: L2 holds clean lines), 'warm' (no flush).
B. A stack of llama3-8b decoder layers, one decode step in a CUDA graph, per variant: replay
   time (rflush / wflush) and a torch.profiler breakdown of the GPU time per kernel family.
Writes $OUT/exp1.json and prints tables.
"""
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import mixgemm
from mixgemm.nn import QuantLinear
from mixgemm.bench import torch_int4_params

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda", 0)
torch.manual_seed(0)
props = torch.cuda.get_device_properties(dev)
L2 = props.L2_cache_size
print(f"{props.name} sms={props.multi_processor_count} L2={L2 >> 20} MiB", flush=True)

# ----------------------------------------------------------------------------------- timing
_wbuf = torch.empty(2 * L2, dtype=torch.uint8, device=dev)
_rbuf = torch.ones(2 * L2 // 4, dtype=torch.float32, device=dev)
_sink = torch.empty((), dtype=torch.float32, device=dev)
_val = [0]


def flush(mode):
    torch.cuda._sleep(200_000)
    if mode == "wflush":
        _val[0] = _val[0] % 255 + 1
        _wbuf.fill_(_val[0])
    elif mode == "rflush":
        _wbuf.fill_(7)                     # dirty lines first ...
        _sink.copy_(_rbuf.sum())        # ... evicted by a clean read of 2 x L2


def time_fn(fn, mode, iters=100, warmup=10):
    for _ in range(warmup):
        flush(mode); fn()
    ev = []
    for _ in range(iters):
        flush(mode)
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); ev.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def read_bw():
    x = torch.ones(1 << 28, dtype=torch.float32, device=dev)   # 1 GiB
    t = time_fn(lambda: _sink.copy_(x.sum()), "none", iters=30)
    return (1 << 30) / (t * 1e-6) / 1e9


RBW = read_bw()
print(f"read bandwidth (1 GiB sum): {RBW:.0f} GB/s", flush=True)

# ----------------------------------------------------------------------------- A. layers
results = {"gpu": props.name, "read_bw_gbps": RBW, "gemm": [], "step": []}
SHAPES = [(6144, 4096, None), (4096, 4096, None), (28672, 4096, "swiglu"), (4096, 14336, None)]
WTYPES = [(4, False), (2, False), (8, True)]


def bytes_of(*ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def gemm_impls(n, k, act, m):
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    impls = {}
    impls["cublas"] = (lambda: F.linear(x, w), bytes_of(w))
    qw4 = mixgemm.quantize(w, 4, 128)
    packed_u8, sz = torch_int4_params(qw4.qweight, qw4.scales, qw4.zeros)
    tp = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    impls["torch_int4"] = (lambda: torch.ops.aten._weight_int4pack_mm(x, tp, 128, sz), bytes_of(tp, sz))
    for bits, sym in WTYPES:
        pw = mixgemm.prepack(mixgemm.quantize(w, bits, 128, symmetric=sym))
        name = f"mixgemm-{pw.weight_type.value}"
        impls[name] = ((lambda pw=pw: mixgemm.gemm(x, pw, activation=act)), pw.nbytes)
    return impls


for m in (1, 16):
    for n, k, act in SHAPES:
        impls = gemm_impls(n, k, act, m)
        for name, (fn, nbytes) in impls.items():
            fn(); torch.cuda.synchronize()
            row = {"n": n, "k": k, "m": m, "act": act, "impl": name, "bytes": nbytes}
            for mode in ("wflush", "rflush", "warm"):
                row[mode] = time_fn(fn, mode)
            row["floor_us"] = nbytes / (RBW * 1e3)
            results["gemm"].append(row)
            print(f"M={m} {n}x{k} {name:14s} wflush {row['wflush']:7.2f}  rflush {row['rflush']:7.2f}  "
                  f"warm {row['warm']:7.2f}  floor {row['floor_us']:6.2f} us  "
                  f"(rflush {100 * row['floor_us'] / row['rflush']:.0f}% of floor)", flush=True)
        del impls
        torch.cuda.empty_cache()

# ------------------------------------------------------------------------------ B. step
H, I, NH, NKV, D, CTX, NL = 4096, 14336, 32, 8, 128, 1024, 4


def rmsnorm(x, w, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Dense(nn.Module):
    def __init__(self, w):
        super().__init__(); self.w = w

    def forward(self, x):
        return F.linear(x, self.w)


class DenseGateUp(nn.Module):
    def __init__(self, w):
        super().__init__(); self.w = w

    def forward(self, x):
        gu = F.linear(x, self.w)
        g, u = gu.chunk(2, -1)
        return F.silu(g) * u


class TInt4(nn.Module):
    def __init__(self, w, gate_up=False):
        super().__init__()
        qw = mixgemm.quantize(w, 4, 128)
        p, self.sz = torch_int4_params(qw.qweight, qw.scales, qw.zeros)
        self.p = torch.ops.aten._convert_weight_to_int4pack(p, 8)
        self.gate_up = gate_up

    def forward(self, x):
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), self.p, 128, self.sz)
        y = y.view(*x.shape[:-1], -1)
        if self.gate_up:
            g, u = y.chunk(2, -1)
            return F.silu(g) * u
        return y


class Layer(nn.Module):
    def __init__(self, variant):
        super().__init__()
        std = 0.02
        wqkv = (torch.randn((NH + 2 * NKV) * D, H, device=dev) * std).to(torch.bfloat16)
        wo = (torch.randn(H, NH * D, device=dev) * std).to(torch.bfloat16)
        wg = nn.Linear(H, I, bias=False, device=dev, dtype=torch.bfloat16)
        wu = nn.Linear(H, I, bias=False, device=dev, dtype=torch.bfloat16)
        wg.weight.data.normal_(0, std); wu.weight.data.normal_(0, std)
        wd = (torch.randn(H, I, device=dev) * std).to(torch.bfloat16)
        self.ln1 = torch.ones(H, device=dev, dtype=torch.bfloat16)
        self.ln2 = torch.ones(H, device=dev, dtype=torch.bfloat16)
        if variant == "bf16":
            self.qkv, self.o, self.down = Dense(wqkv), Dense(wo), Dense(wd)
            self.gu = DenseGateUp(torch.cat([wg.weight.data, wu.weight.data]))
        elif variant == "torch_int4":
            self.qkv, self.o, self.down = TInt4(wqkv), TInt4(wo), TInt4(wd)
            self.gu = TInt4(torch.cat([wg.weight.data, wu.weight.data]), gate_up=True)
        else:
            bits, sym = {"u4": (4, False), "u2": (2, False), "s8": (8, True)}[variant]
            q = lambda w: QuantLinear.from_packed(mixgemm.prepack(mixgemm.quantize(w, bits, 128, symmetric=sym)))
            self.qkv, self.o, self.down = q(wqkv), q(wo), q(wd)
            self.gu = QuantLinear.from_gate_up(wg, wu, bits=bits, group_size=128, symmetric=sym)
        del wg, wu

    def forward(self, x, kc, vc, cos, sin):
        b = x.shape[0]
        h = rmsnorm(x, self.ln1)
        qkv = self.qkv(h)
        q, k, v = qkv.split([NH * D, NKV * D, NKV * D], -1)
        q = q.view(b, 1, NH, D).transpose(1, 2)
        k = k.view(b, 1, NKV, D).transpose(1, 2)
        v = v.view(b, 1, NKV, D).transpose(1, 2)

        def rope(t):
            t1, t2 = t[..., : D // 2], t[..., D // 2:]
            return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)
        q, k = rope(q), rope(k)
        kc[:, :, CTX:CTX + 1] = k
        vc[:, :, CTX:CTX + 1] = v
        a = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
        a = a.transpose(1, 2).reshape(b, NH * D)
        x = x + self.o(a)
        x = x + self.down(self.gu(rmsnorm(x, self.ln2)))
        return x


def step_bytes(layer, variant, b):
    tot = 0
    for mod in (layer.qkv, layer.o, layer.gu, layer.down):
        if isinstance(mod, QuantLinear):
            tot += mod.packed.nbytes
        elif isinstance(mod, TInt4):
            tot += bytes_of(mod.p, mod.sz)
        else:
            tot += bytes_of(mod.w)
    kv = b * 2 * NKV * (CTX + 1) * D * 2
    return tot + kv


def profile_breakdown(graph, reps=20):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    fam = {}
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in events:
        name = e.name
        key = ("mixgemm_decode" if "mixgemm_decode" in name else "mixgemm_gemm" if "mixgemm_gemm" in name
               else "gemv/gemm(cublas)" if ("gemv" in name.lower() or "gemm" in name.lower() or "sm90_xmma" in name
                                             or "cutlass" in name.lower() or "nvjet" in name.lower())
               else "int4pack" if "int4" in name.lower() or "tinygemm" in name.lower()
               else "attention" if ("flash" in name.lower() or "attention" in name.lower() or "fmha" in name.lower()
                                    or "efficient" in name.lower())
               else "other")
        fam.setdefault(key, [0.0, 0])
        fam[key][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        fam[key][1] += 1
    names = {}
    for e in events:
        names.setdefault(e.name[:90], [0.0, 0])
        names[e.name[:90]][0] += getattr(e, "device_time_total", 0.0)
        names[e.name[:90]][1] += 1
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:14]
    return ({k: (v[0] / reps, v[1] / reps) for k, v in fam.items()},
            [(n, v[0] / reps, v[1] / reps) for n, v in top])


for b in (1, 16):
    base = None
    for variant in ("bf16", "u4", "u2", "s8", "torch_int4"):
        try:
            torch.manual_seed(1)
            layers = [Layer(variant) for _ in range(NL)]
            kcs = [torch.randn(b, NKV, CTX + 1, D, device=dev, dtype=torch.bfloat16) for _ in range(NL)]
            vcs = [torch.randn(b, NKV, CTX + 1, D, device=dev, dtype=torch.bfloat16) for _ in range(NL)]
            cos = torch.randn(1, 1, 1, D // 2, device=dev, dtype=torch.bfloat16)
            sin = torch.randn(1, 1, 1, D // 2, device=dev, dtype=torch.bfloat16)
            x0 = torch.randn(b, H, device=dev, dtype=torch.bfloat16)

            def step():
                x = x0
                for l, kc, vc in zip(layers, kcs, vcs):
                    x = l(x, kc, vc, cos, sin)
                return x
            with torch.no_grad():
                step(); torch.cuda.synchronize()
                eager = time_fn(step, "rflush", iters=30, warmup=3)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    y = step()
                times = {mode: time_fn(g.replay, mode, iters=50, warmup=5) for mode in ("rflush", "wflush")}
                fam, top = profile_breakdown(g)
            nbytes = step_bytes(layers[0], variant, b)
            row = {"batch": b, "variant": variant, "graph_rflush_us_per_layer": times["rflush"] / NL,
                   "graph_wflush_us_per_layer": times["wflush"] / NL, "eager_us_per_layer": eager / NL,
                   "bytes_per_layer": nbytes, "floor_us_per_layer": nbytes / (RBW * 1e3),
                   "families_us_per_layer": {k: v[0] / NL for k, v in fam.items()},
                   "top_kernels": [(n, t / NL, c / NL) for n, t, c in top]}
            if variant == "bf16":
                base = row
            row["speedup_graph"] = base["graph_rflush_us_per_layer"] / row["graph_rflush_us_per_layer"]
            row["speedup_eager"] = base["eager_us_per_layer"] / row["eager_us_per_layer"]
            results["step"].append(row)
            busy = sum(v[0] for v in fam.values()) / NL
            print(f"\nbatch {b} {variant:10s}: graph {row['graph_rflush_us_per_layer']:6.1f} us/layer (wflush "
                  f"{row['graph_wflush_us_per_layer']:6.1f}), eager {row['eager_us_per_layer']:7.1f}, floor "
                  f"{row['floor_us_per_layer']:5.1f} ({100 * row['floor_us_per_layer'] / row['graph_rflush_us_per_layer']:.0f}%), "
                  f"speedup {row['speedup_graph']:.2f}x graph / {row['speedup_eager']:.2f}x eager; kernel-busy {busy:.1f} us/layer",
                  flush=True)
            for k, v in sorted(row["families_us_per_layer"].items(), key=lambda kv: -kv[1]):
                print(f"    {k:22s} {v:7.2f} us/layer")
            for n, t, c in row["top_kernels"][:10]:
                print(f"      {t:7.2f} us x{c:.1f}  {n}")
            del layers, kcs, vcs, g
            torch.cuda.empty_cache()
        except Exception as e:
            print(f"batch {b} {variant}: FAILED {type(e).__name__}: {e}", flush=True)

with open(os.path.join(OUT, "exp1.json"), "w") as f:
    json.dump(results, f, indent=1)
print("wrote exp1.json")
