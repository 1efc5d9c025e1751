"""Per-layer error of the GEMM on SmolLM2-like Q4_1 weights (u4 g32 with float zero offsets, K = 576
or 1536): mixgemm.gemm against float64 on the same weight (its exact value (q - z) * s + o, and
dequantize_reference), beside bf16 F.linear on dequantize_reference's weight."""
import torch, mixgemm
from mixgemm.types import QuantizedWeight
torch.manual_seed(0)
dev = "cuda"
def rel(a, b): return float((a.double() - b.double()).norm() / b.double().norm())
for dt in (torch.bfloat16, torch.float16):
    for n, k in ((576, 576), (1536, 576), (576, 1536), (192, 576)):
        for offsets in (False, True):
            g = k // 32
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            d = (torch.rand(n, g) * 0.01 + 0.002)
            z = torch.full((n, g), 8.0)
            o = ((torch.rand(n, g) - 0.5) * d) if offsets else None
            qw = QuantizedWeight(q, d.to(dt), z.to(dt), 4, 32, False, o)
            pk = mixgemm.prepack(qw).to(dev)
            exact = ((q.double() - z.repeat_interleave(32, 1)) * d.to(dt).double().repeat_interleave(32, 1))
            if o is not None:
                exact = exact + o.double().repeat_interleave(32, 1)
            wref = mixgemm.dequantize_reference(qw).to(dev)
            for m in (1, 5, 16):
                x = torch.randn(m, k, dtype=dt, device=dev)
                y = mixgemm.gemm(x, pk)
                y64 = x.double() @ exact.to(dev).T
                yl = torch.nn.functional.linear(x, wref.to(dt))
                print(f"{str(dt)[6:]:8s} {n:5d}x{k:<5d} offsets={offsets!s:5s} M={m:2d}: gemm vs exact {rel(y, y64):.2e}, "
                      f"F.linear(bf16 weight) vs exact {rel(yl, y64):.2e}, gemm vs F.linear {rel(y, yl):.2e}")
