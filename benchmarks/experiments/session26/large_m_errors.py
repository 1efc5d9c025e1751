"""mixgemm.gemm above 512 tokens through the heuristic (xl or xlp by the waves, NOTES 32a): the
kernel each call picks and its relative error against float64 on the reference-dequantized weight,
for bf16 / fp16 activations and u4 / u2 / s8 weights (g128), eager and from a CUDA graph.

    python large_m_errors.py OUT.json
"""
import json
import sys

import torch

import mixgemm
from mixgemm import heuristic

dev = torch.device("cuda")
sms = heuristic.sm_count(torch.cuda.current_device())
rows, worst = [], {}
for n, k in ((4608, 3584), (6144, 4096), (5120, 5120), (4096, 4096)):
    for bits, sym in ((4, False), (2, False), (8, True)):
        for dtype in (torch.bfloat16, torch.float16):
            torch.manual_seed(0)
            qw = mixgemm.quantize(torch.randn(n, k, device=dev) * 0.02, bits, 128, symmetric=sym, dtype=dtype)
            w, deq = mixgemm.prepack(qw), mixgemm.dequantize_reference(qw).to(dev).double()
            for m in (640, 1024, 1536, 2048, 3000):
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = x.double() @ deq.T
                y = mixgemm.gemm(x, w)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    yg = mixgemm.gemm(x, w)
                g.replay()
                torch.cuda.synchronize()
                err = ((y.double() - ref).norm() / ref.norm()).item()
                label = heuristic.select_tile(m, n, k, sms).label
                rows.append(dict(n=n, k=k, m=m, bits=bits, dtype=str(dtype), label=label, err=err,
                                 graph_equal=bool(torch.equal(y, yg))))
                key = (str(dtype), label)
                worst[key] = max(worst.get(key, 0.0), err)
                assert torch.equal(y, yg), rows[-1]
for (dt, label), e in sorted(worst.items()):
    print(f"{dt} {label}: {sum(r['dtype'] == dt and r['label'] == label for r in rows)} calls, max relative error {e:.2e}")
json.dump(dict(device=torch.cuda.get_device_name(), sm_count=sms, rows=rows), open(sys.argv[1], "w"), indent=1)
