"""Session 12: the GPU kernels of one fused_moe call at T = 1 (qwen3-30b-a3b shapes, u4), from torch.profiler."""
import torch
from mixgemm import moe
from mixgemm.experts import PackedExperts
E, H, I, topk = 128, 2048, 768, 8
w13 = PackedExperts.quantize(torch.randn(E, 2 * I, H) / 30, 4, 128, dtype=torch.bfloat16).to("cuda")
w2 = PackedExperts.quantize(torch.randn(E, H, I) / 30, 4, 128, dtype=torch.bfloat16).to("cuda")
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
w, ids = torch.randn(1, E, device="cuda").softmax(-1).topk(topk)
for _ in range(3): moe.fused_moe(x, w13, w2, w, ids)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    moe.fused_moe(x, w13, w2, w, ids); torch.cuda.synchronize()
ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
print(len(ev), "GPU events:"); [print(f"  {e.name[:60]:60s} {e.device_time:8.1f} us") for e in ev]
