"""Session 22: fused_moe's host time per eager call (#19): bench --moe's layer (qwen3-30b-a3b,
uniform routing), the mean host time per call over 300 calls issued back to back (no sync), the
eager latency (sync before and after, median of 100), and a cProfile of 300 calls by cumulative
time. usage: moe_host.py OUT.txt [preset] [T] [u4]"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
from moe_point import point_inputs, preset_weights, quantized

from mixgemm import moe


def main():
    out = sys.argv[1]
    pname = sys.argv[2] if len(sys.argv) > 2 else "qwen3-30b-a3b"
    t = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    wname = sys.argv[4] if len(sys.argv) > 4 else "u4"
    dev = torch.device("cuda", 0)
    p, w13b, w2b = preset_weights(pname, dev)
    layer = quantized(w13b, w2b, wname)
    x, tw, ids = point_inputs(p, t, "uniform", dev)

    def call():
        return moe.fused_moe(x, layer.w13, layer.w2, tw, ids)

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(300):
        call()
    host = (time.perf_counter() - t0) / 300 * 1e6
    torch.cuda.synchronize()
    lat = []
    for _ in range(100):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        lat.append((time.perf_counter() - t0) * 1e6)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        call()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("tottime").print_stats(30)
    text = (f"{pname} {wname} T={t}: host {host:.1f} us per call (300 back to back), eager latency median "
            f"{statistics.median(lat):.1f} us\n" + s.getvalue() + s2.getvalue())
    open(out, "w").write(text)
    print(text[:6000])


if __name__ == "__main__":
    main()
