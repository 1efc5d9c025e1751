"""Session 12: the 32-row grouped tile when experts get many rows (NOTES 16b). bench --moe with
mixgemm.moe.select_grouped_spec patched: the 32-row tile when rows per expert with rows (rows /
min(E, rows)) exceed THRESHOLD, else the heuristic's own. usage: moe_tile32.py THRESHOLD bench-args..."""
import dataclasses, sys
from mixgemm import moe
from mixgemm.cli import main

threshold = float(sys.argv[1])
orig = moe.select_grouped_spec


def patched(rows, experts, activation=None):
    s = orig(rows, experts, activation)
    if rows / min(experts.num_experts, rows) > threshold:
        s = dataclasses.replace(s, tokens=32, kslices=1)
    return s


moe.select_grouped_spec = patched
sys.exit(main(["bench"] + sys.argv[2:]))
