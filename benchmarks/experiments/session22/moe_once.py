"""Session 22: one fused_moe call for a profiler (ncu --profile-from-start off): bench --moe's
weights, uniform routing, three warm-up calls, then the profiled call between
cudaProfilerStart / Stop.
usage: moe_once.py PRESET WEIGHT TOKENS
"""
import sys

import torch

from mixgemm import moe
from mixgemm.bench.moe import MOE_PRESETS, make_routing
from mixgemm.bench.moe_run import MixgemmLayer, base_weights
from mixgemm.bench.variants import parse_variant


def main():
    pname, wname, t = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dev = torch.device("cuda", 0)
    p = MOE_PRESETS[pname]
    w13b, w2b = base_weights(p, 0, dev)
    layer = MixgemmLayer(w13b, w2b, parse_variant(wname), 128)
    ids, tw = make_routing(p.experts, p.topk, t, "uniform", 0)
    ids, tw = ids.to(dev), tw.to(dev)
    x = (torch.randn(t, p.hidden, device=dev) * 0.5).to(torch.bfloat16)
    for _ in range(3):
        moe.fused_moe(x, layer.w13, layer.w2, tw, ids)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    moe.fused_moe(x, layer.w13, layer.w2, tw, ids)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
