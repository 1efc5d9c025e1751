"""Per-kernel GPU time of one llama3-8b decode step (bench --model's decoder stack), bf16 and u4, batch 1 and 16."""
import sys, statistics, torch
from torch.profiler import ProfilerActivity, profile
from mixgemm.bench import decoder, variants
dev = torch.device("cuda", 0)
p = decoder.PRESETS["llama3-8b"]
L = 2
rot = decoder.Rotary(p.head_dim, p.rope_theta, 1100, torch.bfloat16, dev)
for b in (1, 16):
    for vname in ("bf16", "int4"):
        v = variants.parse_variant(vname)
        projs = [variants.build_layer(p, v, l, 0, dev, 128)[0] for l in range(L)]
        states = [decoder.layer_state(p, l, 0, b, 1025, dev, torch.bfloat16) for l in range(L)]
        stack = decoder.DecoderStack(p, projs, states, rot)
        x = torch.randn(b, 1, p.hidden, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            stack(x, 1024); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                stack(x, 1024)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10): g.replay()
                torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        tot = {}
        for e in ev:
            tot.setdefault(e.name[:70], [0.0, 0]); tot[e.name[:70]][0] += e.device_time_total; tot[e.name[:70]][1] += 1
        busy = sum(v_[0] for v_ in tot.values()) / 10 / L
        print(f"\n== batch {b} {vname}: kernel-busy {busy:.1f} us/layer, {sum(v_[1] for v_ in tot.values()) / 10 / L:.1f} kernels/layer")
        for n, (t, c) in sorted(tot.items(), key=lambda kv: -kv[1][0])[:16]:
            print(f"   {t / 10 / L:7.2f} us  x{c / 10 / L:4.1f}  {n}")
        del stack, projs, states, g
        torch.cuda.empty_cache()
