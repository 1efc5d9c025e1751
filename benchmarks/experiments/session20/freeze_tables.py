"""Session 20: the split tables after the planner's new cost model (NOTES 24).

1. Every bench --model preset layer (tools/sweep_decode.py PRESET_SHAPES) x token tile (8, 16, 32) x
   code width without a table entry ran the old planner's pick, which the sweeps had found within
   2% of the best measured factor (or better: it may pick factors the sweep does not try). Those
   keys get the old planner's factor as an entry (`"source": "planner-s19"`), so that the preset
   layers, which #17's figures measure, run exactly the factors they ran before.
2. The H100 sweep of 18 layer shapes of other models (sweep-decode-held-s20b.json, run with the new
   planner as splits=0) adds its entries as `tools/sweep_decode.py --table --merge-into` would:
   a factor enters where it beats the new planner's pick by more than 2%.

    python freeze_tables.py     # rewrites python/mixgemm/tuning/{nvidia-h100-80gb-hbm3,nvidia-h200}.json
"""
import json
import os
import sys

from planner_model import old_plan

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from mixgemm import tuning  # noqa: E402
from sweep_decode import PRESET_SHAPES, _shapes  # noqa: E402

WEIGHT = {4: "u4", 2: "u2", 8: "s8"}
TILE_M = {8: 1, 16: 16, 32: 32}


def main():
    for gpu in ("nvidia-h100-80gb-hbm3", "nvidia-h200"):
        path = os.path.join(ROOT, "python", "mixgemm", "tuning", f"{gpu}.json")
        doc = json.load(open(path))
        entries = doc["decode_splits"]
        source = doc["source"]
        if gpu == "nvidia-h100-80gb-hbm3":
            rows = json.load(open(os.path.join(ROOT, "benchmarks", "results", gpu, "sweep-decode-held-s20b.json")))
            new = tuning.table_from_sweep(rows, stage_bytes=None)
            entries = tuning.merge_entries(entries, new, tuning.swept_keys(rows, stage_bytes=None))
            source = ("benchmarks/experiments/session20/freeze_tables.py: the entries of 18 layer shapes of other "
                      "models from tools/sweep_decode.py sweep-decode-held-s20b.json --m 1,16 --weights u4,u2,s8 "
                      "--splits 0,1,2,3,4,6,8,12,16 (the session-20 planner, with cluster waves, as splits=0); "
                      "entries marked planner-s19: the session-19 planner's pick for a preset layer without a "
                      "measured entry; the rest: " + source)
        else:
            source = ("benchmarks/experiments/session20/freeze_tables.py: entries marked planner-s19: the session-19 "
                      "planner's pick for a preset layer without a measured entry; the rest: " + source)
        have = {(e["n"], e["k"], e["tokens"], e["bits"]) for e in entries}
        added = 0
        for n, k in _shapes(PRESET_SHAPES):
            for tokens, m in TILE_M.items():
                for bits, w in WEIGHT.items():
                    if (n, k, tokens, bits) in have or (tokens == 32 and n * k > 2 ** 25):
                        continue   # (the 32-token kernel runs on layers of at most 2**25 weights)
                    entries.append(dict(n=n, k=k, tokens=tokens, bits=bits, splits=old_plan(m, w, n, k), us=None,
                                        planner_us=None, source="planner-s19"))
                    added += 1
        entries.sort(key=lambda e: (e["n"], e["k"], e["tokens"], e["bits"]))
        tuning.write_table(path, doc["gpu"], entries, source=source)
        print(gpu, "entries", len(entries), "frozen", added)


if __name__ == "__main__":
    main()
