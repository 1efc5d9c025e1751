"""Session 12: the 16 preset layers at M = 1 in chains of 8 launches per graph (NOTES 14e):
mixgemm u4 / u2 (the heuristic's kernel and tuned splits), torch's int4 kernel (tinygemm) and
cuBLAS bf16, per launch. The one-launch graphs of the per-layer tables add ~4 us of harness to
every kernel; inside a model a GEMM sits in a chain, and there the ratios are these.
Also (b) the compiled null step with projections that are views of their input (not foldable).
usage: chain_layers.py OUT.json
"""
import json, statistics, sys
import torch
import torch.nn.functional as F
from mixgemm.bench import decoder, peers
from mixgemm.bench.model_run import _compiled
from mixgemm.nn import QuantLinear
from mixgemm.quantize import quantize

from harness import DEV as dev, flush, read_gbps, time_graph

SHAPES = ("6144x4096,4096x4096,28672x4096,4096x14336,10240x8192,8192x8192,57344x8192,8192x28672,"
          "4608x3584,3584x3584,37888x3584,3584x18944,7168x5120,5120x5120,55296x5120,5120x27648").split(",")
out = {"chain": []}
out["read_gbps"] = bw = read_gbps()
for shape in SHAPES:
    n, k = map(int, shape.split("x"))
    w = torch.randn(n, k, device=dev) * 0.02
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    row = dict(shape=shape)
    qw = quantize(w, 4, 128, symmetric=False, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    with torch.no_grad():
        for bits in (4, 2):
            q = QuantLinear.from_linear(lin, bits=bits, group_size=128)
            nb = sum(t.numel() * t.element_size() for t in (q.qdata, q.scales, q.zeros) if t is not None)
            row[f"u{bits}"] = time_graph(lambda: [q(x) for _ in range(8)]) / 8
            row[f"u{bits}_floor"] = nb / (bw * 1e3)
            del q
        packed, sz = peers.torch_int4_pack(qw)
        row["torch_int4"] = time_graph(lambda: [peers.torch_int4_mm(x, packed, 128, sz) for _ in range(8)]) / 8
        wb = w.to(torch.bfloat16)
        row["cublas"] = time_graph(lambda: [F.linear(x, wb) for _ in range(8)]) / 8
    row = {kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}
    row["torch_int4_over_u4"] = round(row["torch_int4"] / row["u4"], 2)
    out["chain"].append(row)
    print(json.dumps(row), flush=True)
    del w, qw, packed, sz, wb, lin
    torch.cuda.empty_cache()

class ViewProjections(decoder.Projections):
    """Each linear returns a broadcast view of its input's first column: no GEMM, nothing foldable."""
    def __init__(self, p):
        self.rows = {"qkv": p.qkv_rows, "o": p.hidden, "mlp": p.intermediate, "down": p.hidden}
    def _v(self, x, name): return x[:, :1].expand(x.shape[0], self.rows[name])
    def qkv(self, x): return self._v(x, "qkv")
    def o(self, x): return self._v(x, "o")
    def mlp_in(self, x): return self._v(x, "mlp")
    def down(self, x): return self._v(x, "down")
    def weight_tensors(self): return []

p = decoder.PRESETS["llama3-8b"]
rot = decoder.Rotary(p.head_dim, p.rope_theta, 1100, torch.bfloat16, dev)
states = [decoder.layer_state(p, l, 0, 1, 1025, dev, torch.bfloat16) for l in range(4)]
stack = decoder.DecoderStack(p, [ViewProjections(p) for _ in range(4)], states, rot)
xx = torch.randn(1, 1, p.hidden, device=dev, dtype=torch.bfloat16)
with torch.no_grad():
    out["null_view_graph_us_per_layer"] = round(time_graph(lambda: stack(xx, 1024)) / 4, 2)
    c = _compiled(stack, 1024)
    out["null_view_compiled_us_per_layer"] = round(time_graph(lambda: c(xx)) / 4, 2)
print("null (views):", out["null_view_graph_us_per_layer"], "graph,", out["null_view_compiled_us_per_layer"], "compiled", flush=True)
open(sys.argv[1], "w").write(json.dumps(out, indent=1))
