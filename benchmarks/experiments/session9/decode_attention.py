"""Decode attention options for the bench layer (llama3-8b: 32 q heads, 8 kv heads, d 128, ctx 1025)."""
import statistics, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = torch.device("cuda", 0)
L2 = torch.cuda.get_device_properties(dev).L2_cache_size
_w = torch.empty(2 * L2, dtype=torch.uint8, device=dev); _r = torch.ones(2 * L2 // 4, device=dev); _s = torch.empty((), device=dev)
def flush():
    torch.cuda._sleep(300_000); _w.fill_(3); _s.copy_(_r.sum())
def tg(fn, iters=40):
    fn(); torch.cuda.synchronize(); g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    for _ in range(3): flush(); g.replay()
    ev = []
    for _ in range(iters):
        flush(); a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); ev.append((a, b))
    torch.cuda.synchronize(); return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)
H, KV, D, L = 32, 8, 128, 1025
for b in (1, 16, 64):
    q = torch.randn(b, H, 1, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, KV, L, D, device=dev, dtype=torch.bfloat16) * 2
    v = torch.randn(b, KV, L, D, device=dev, dtype=torch.bfloat16)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)).float()
    opts = {
      "folded default": lambda: F.scaled_dot_product_attention(q.reshape(b, KV, 4, D), k, v).reshape(b, H, 1, D),
      "unfolded enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION):
        def f(be=be):
            with sdpa_kernel([be]): return F.scaled_dot_product_attention(q.reshape(b, KV, 4, D), k, v).reshape(b, H, 1, D)
        opts[f"folded {be.name}"] = f
        def g(be=be):
            with sdpa_kernel([be]): return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        opts[f"unfolded {be.name}"] = g
    for name, fn in opts.items():
        try:
            err = float(((fn().float() - ref).norm() / ref.norm()))
            t = tg(fn)
            print(f"b={b:<3} {name:28s} {t:7.2f} us  err {err:.1e}  (KV {2 * b * KV * L * D * 2 / 1e6:.1f} MB)", flush=True)
        except Exception as e:
            print(f"b={b:<3} {name:28s} n/a ({type(e).__name__}: {str(e)[:80]})", flush=True)
