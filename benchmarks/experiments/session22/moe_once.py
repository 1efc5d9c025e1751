"""Session 22: one fused_moe call for a profiler (ncu --profile-from-start off): bench --moe's
weights, uniform routing, three warm-up calls, then the profiled call between
cudaProfilerStart / Stop.
usage: moe_once.py PRESET WEIGHT TOKENS
"""
import sys

import torch
from moe_point import point_inputs, preset_weights, quantized

from mixgemm import moe


def main():
    pname, wname, t = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dev = torch.device("cuda", 0)
    p, w13b, w2b = preset_weights(pname, dev)
    layer = quantized(w13b, w2b, wname)
    x, tw, ids = point_inputs(p, t, "uniform", dev)
    for _ in range(3):
        moe.fused_moe(x, layer.w13, layer.w2, tw, ids)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    moe.fused_moe(x, layer.w13, layer.w2, tw, ids)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
