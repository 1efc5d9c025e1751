"""Session 13: which grouped kernel for how many rows per expert, and which walk of its tiles
(NOTES 17). bench --moe with mixgemm.moe's thresholds patched: MODE "decode" (the grouped decode
kernel at every size, the path before the grouped sm90 GEMM), "g64" / "g128" / "g256" (the grouped
GEMM with that token tile at every size), "heuristic" (as shipped); a suffix ":w" walks weight-row
tiles first, ":t" token tiles first (else the shipped walk).
usage: moe_tiles_sweep.py MODE[:w|:t] bench-args..."""
import sys

from mixgemm import moe_grouped as moe   # the thresholds live (and are read) in moe_grouped
from mixgemm.cli import main

INF = float("inf")
MODES = {"decode": (INF, INF, INF), "g64": (0, INF, INF), "g128": (0, 0, INF), "g256": (0, 0, 0),
         "heuristic": (moe.TILES_FROM_ROWS, moe.TILE128_FROM_ROWS, moe.TILE256_FROM_ROWS)}
mode, _, walk = sys.argv[1].partition(":")
moe.TILES_FROM_ROWS, moe.TILE128_FROM_ROWS, moe.TILE256_FROM_ROWS = MODES[mode]
if walk:
    from mixgemm.specs import Raster
    moe.TILES_RASTER = {"w": Raster.WEIGHT_ROWS, "t": Raster.TOKENS}[walk]
sys.exit(main(["bench"] + sys.argv[2:]))
