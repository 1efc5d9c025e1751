"""Where the time of fused_moe goes at few tokens (qwen3-30b-a3b shapes, u4 g128): the GPU time of
each kernel of one call (torch.profiler), and the CUDA-graph replay time of the whole call."""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from mixgemm.moe import PackedExperts, fused_moe
from mixgemm.quantize import interleave_rows
E, H, I, TOPK = 128, 2048, 768, 8
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
gate = torch.randn(E, I, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
up = torch.randn(E, I, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
down = torch.randn(E, H, I, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
w13 = PackedExperts.quantize(torch.stack([interleave_rows(gate[e], up[e]) for e in range(E)]), bits=4, group_size=128)
w2 = PackedExperts.quantize(down, bits=4, group_size=128)
w13, w2 = w13.to(dev), w2.to(dev)
del gate, up, down
for T in (1, 16):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=dev)
    tw, ti = logits.softmax(-1).topk(TOPK)
    for _ in range(3):
        fused_moe(x, w13, w2, tw, ti)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fused_moe(x, w13, w2, tw, ti)
        torch.cuda.synchronize()
    print(f"=== T={T}: GPU time per call by kernel (us, mean of 20 calls)")
    rows = []
    for ev in prof.key_averages():
        if ev.device_time_total > 0:
            rows.append((ev.device_time_total / 20, ev.count // 20, ev.key[:90]))
    for t, c, k in sorted(rows, reverse=True):
        print(f"{t:8.1f} {c:3d}x  {k}")
    print(f"   sum {sum(r[0] for r in rows):.1f} us, {sum(r[1] for r in rows)} kernels per call")
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe(x, w13, w2, tw, ti)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w13, w2, tw, ti)
    for _ in range(10): graph.replay()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(50):
        st.record(); graph.replay(); en.record(); torch.cuda.synchronize(); times.append(st.elapsed_time(en) * 1e3)
    times.sort(); print(f"   graph replay (L2 warm) median {times[25]:.1f} us")
