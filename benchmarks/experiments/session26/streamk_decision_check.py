"""xl_evens_waves's premise, checked against CUTLASS itself: the "xl" kernel's host helper
reports a workspace (partials) exactly when its stream-K heuristic splits tiles, and
mixgemm.heuristic's condition (tail of the rounded tile count less than half a wave, more than 8
k-tiles per tile) must say the same (benchmarks/NOTES.md 32a). Needs a built "xl" helper:

    python streamk_decision_check.py CACHE_DIR/kernels/mixgemm_gemm_bf16_u4_t128x256x64_coop_streamk_biasact_s0-*/helper.so
"""
import sys

from mixgemm import runtime

helper = runtime.HostHelper(sys.argv[1], "mixgemm_gemm_bf16_u4_t128x256x64_coop_streamk_biasact_s0")


def splits_tiles(m, n, k, sms):
    a = runtime.GemmArgs(abi_version=runtime.ABI_VERSION, m=m, n=n, k=k, group_size=128 if k % 128 == 0 else 64,
                         sm_count=sms, splits=0, raster=1, swizzle=2, weight=1 << 20, scales=2 << 20, zeros=5 << 20,
                         x=3 << 20, bias=0, y=4 << 20, workspace=6 << 20, ldx=k, ldy=n, locks=7 << 20)
    return helper.workspace_size(a) > 0


def rule(m, n, k, sms):   # the first half of mixgemm.heuristic.xl_evens_waves
    rows = -(-n // 128)
    rows += rows & 1
    cols = -(-m // 256)
    tail = rows * (cols + (cols & 1)) % sms
    return tail > 0 and 2 * tail < sms and -(-k // 64) > 8


points = [(m, n, k, sms) for sms in (132, 114, 78) for n in range(256, 60000, 896) for m in range(513, 8200, 192)
          for k in (512, 576, 640, 4096)]
bad = [p for p in points if splits_tiles(*p) != rule(*p)]
print(f"{len(points)} points, {len(bad)} where CUTLASS and the rule disagree: {bad[:10]}")
