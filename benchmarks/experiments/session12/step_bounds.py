"""Session 12: what bounds a decode step (NOTES 14b).

(a) The llama3-8b decoder stack (bench --model's code) at batch 1 and 16, under a CUDA graph and
    through torch.compile + graph, with the projections of bf16, mixgemm u4/u2/s8, torch int4 and
    "null" (each linear returns a preallocated output of its shape: no GEMM at all). null is the
    time of the layer's other kernels, which every variant pays; (variant - null) is its GEMMs'
    share of the step.
(b) A chain of 8 identical GEMMs in one graph (u4 M=1, N=4096, K from 256 to 16384; cuBLAS bf16
    on the same shapes; 8 trivial torch kernels), per-kernel time against bytes: the intercept is
    the per-kernel fixed cost in a chain.
usage: step_bounds.py OUT.json
"""
import json, statistics, sys
import torch
import torch.nn.functional as F
from mixgemm.bench import decoder, variants
from mixgemm.bench.model_run import _compiled
from mixgemm.nn import QuantLinear

from harness import DEV as dev, flush, read_gbps, time_graph


class NullProjections(decoder.Projections):
    """Every linear returns a preallocated output of its shape (values 0.01): no GEMM."""
    def __init__(self, p, m):
        self.bufs = {n: torch.full((m, r), 0.01, device=dev, dtype=torch.bfloat16)
                     for n, r in (("qkv", p.qkv_rows), ("o", p.hidden), ("mlp", p.intermediate), ("down", p.hidden))}
    def qkv(self, x): return self.bufs["qkv"][: x.shape[0]]
    def o(self, x): return self.bufs["o"][: x.shape[0]]
    def mlp_in(self, x): return self.bufs["mlp"][: x.shape[0]]
    def down(self, x): return self.bufs["down"][: x.shape[0]]
    def weight_tensors(self): return []


out = {"step": [], "chain": []}
out["read_gbps"] = bw = read_gbps()
print(f"read {bw:.0f} GB/s", flush=True)

# (b) chains first (small)
for k in (256, 512, 1024, 2048, 4096, 8192, 16384):
    n = 4096
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    lin.weight.data.normal_(0, 0.02)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    row = dict(n=n, k=k)
    for wt in ("u4", "s8"):
        q = QuantLinear.from_linear(lin, bits=int(wt[1]), group_size=128, symmetric=wt[0] == "s")
        nb = sum(t.numel() * t.element_size() for t in (q.qdata, q.scales, q.zeros) if t is not None)
        with torch.no_grad():
            row[wt] = time_graph(lambda: [q(x) for _ in range(8)]) / 8
        row[wt + "_mb"] = nb / 1e6
        del q
    with torch.no_grad():
        row["bf16"] = time_graph(lambda: [F.linear(x, lin.weight) for _ in range(8)]) / 8
    row["bf16_mb"] = n * k * 2 / 1e6
    out["chain"].append({kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in row.items()})
    print(json.dumps(out["chain"][-1]), flush=True)
t = torch.zeros(4096, device=dev, dtype=torch.bfloat16)
out["trivial_chain_us"] = time_graph(lambda: [t.add_(1) for _ in range(8)]) / 8
print("trivial kernel in a chain:", out["trivial_chain_us"], flush=True)

p = decoder.PRESETS["llama3-8b"]
LAYERS = 4
rot = decoder.Rotary(p.head_dim, p.rope_theta, 1100, torch.bfloat16, dev)
for vname in ("null", "bf16", "int4", "int2", "int8", "torch-int4"):
    if vname == "null":
        projs = None
    else:
        v = variants.parse_variant(vname)
        projs = [variants.build_layer(p, v, l, 0, dev, 128)[0] for l in range(LAYERS)]
    for b in (1, 16):
        ps = projs if projs is not None else [NullProjections(p, b) for _ in range(LAYERS)]
        states = [decoder.layer_state(p, l, 0, b, 1025, dev, torch.bfloat16) for l in range(LAYERS)]
        stack = decoder.DecoderStack(p, ps, states, rot)
        x = torch.randn(b, 1, p.hidden, device=dev, dtype=torch.bfloat16)
        row = dict(variant=vname, batch=b)
        with torch.no_grad():
            row["graph"] = time_graph(lambda: stack(x, 1024)) / LAYERS
            try:
                if b != 1:
                    raise RuntimeError("compiled at batch 1 only")
                c = _compiled(stack, 1024)
                row["compiled"] = time_graph(lambda: c(x)) / LAYERS
            except Exception as e:  # noqa
                row["compiled_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out["step"].append({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()})
        print(json.dumps(out["step"][-1]), flush=True)
        del stack, states
    del projs
    torch.cuda.empty_cache()
open(sys.argv[1], "w").write(json.dumps(out, indent=1))
