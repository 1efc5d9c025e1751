"""Session 19: the grouped decode kernel's token tile chosen by rows per expert.

moe_grouped.decode_spec_for picks the 8-row tile only when the whole call has <= 8 rows (T x
topk), so mixtral at 16 tokens (32 rows over 8 experts, ~4 an expert) and qwen3 at 2-16 tokens
run the 16-row tile, whose two token tiles double the MMAs and the ldmatrix per weight atom
for rows that are mostly absent; an expert with more than 8 rows would loop over 8-row tiles
(its weights streamed once per tile). Here fused_moe runs with the committed choice ("dec16")
and with the 8-row tile forced ("dec8"), in one process, bench --moe's timer (CUDA graphs, L2
flushed); the bench checks every point against bf16 on the same dequantized experts.
usage: moe_tile.py OUT_PREFIX [bench --moe arguments]
"""
import sys

from mixgemm import bench
import mixgemm.moe_grouped as grouped

orig = grouped.decode_spec_for


def forced8(rows, act_type, weight_type, activation=None, num_experts=1):
    return orig(min(rows, 8), act_type, weight_type, activation, num_experts)


def main():
    prefix, args = sys.argv[1], sys.argv[2:]
    for tag, fn in (("dec16", orig), ("dec8", forced8), ("dec16b", orig), ("dec8b", forced8)):
        grouped.decode_spec_for = fn
        print("==", tag, flush=True)
        bench.main(args + ["--json", f"{prefix}-{tag}.json"])


if __name__ == "__main__":
    main()
