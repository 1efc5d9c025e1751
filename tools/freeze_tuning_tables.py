"""The split tables' ``"planner"`` entries: the previous planner's pick for the preset layers.

When the decode planner's cost model replaced the previous planner (docs/dispatch.md), every
``bench --model`` preset layer (tools/sweep_decode.py PRESET_SHAPES) x token tile (8, 16, 32) x code
width without a measured entry had run the previous planner's pick, which the sweeps had found
within 2% of the best measured factor (or better: it may pick factors the sweep does not try).
Those keys keep that factor as an entry marked ``"source": "planner"``, so that the preset layers,
which the README's figures measure, run exactly the factors they ran before.

This tool rebuilds those entries of ``python/mixgemm/dispatch/configs/<gpu>.json``: it drops the
table's ``"planner"`` entries and adds one for every preset key without a measured entry
(tools/planner_model.py ``previous_plan``). The measured entries and the table's ``measured``
field (GPU, date, command of the sweep) stay as they are. Run it after a sweep's ``--merge-into``
when the sweep may have dropped a measured entry of a preset layer.

    python tools/freeze_tuning_tables.py           # rewrites the tables
    python tools/freeze_tuning_tables.py --check   # exit status 1 if a table's planner entries differ
"""
from __future__ import annotations

import argparse
import json
import os
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

from planner_model import previous_plan  # noqa: E402
from sweep_decode import PRESET_SHAPES, _shapes  # noqa: E402

from mixgemm.dispatch import tuning  # noqa: E402

GPUS = ("nvidia-h100-80gb-hbm3", "nvidia-h200")
WEIGHT = {4: "u4", 2: "u2", 8: "s8"}
PLANNER = "planner"


def table_path(gpu: str) -> str:
    return str(tuning.TABLE_DIR / f"{gpu}.json")


def frozen_entries(entries: list[dict]) -> list[dict]:
    """``entries`` without their planner entries, plus the previous planner's pick for every preset
    key (N, K, token tile, bits) without a measured entry; sorted by key."""
    out = [dict(e) for e in entries if e.get("source") != PLANNER]
    have = {(e["n"], e["k"], e["tokens"], e["bits"]) for e in out}
    for n, k in _shapes(PRESET_SHAPES):
        for tokens, m in tuning.TILE_M.items():
            for bits, w in WEIGHT.items():
                if (n, k, tokens, bits) in have or (tokens == 32 and n * k > 2 ** 25):
                    continue   # (the 32-token kernel runs on layers of at most 2**25 weights)
                out.append(dict(n=n, k=k, tokens=tokens, bits=bits, splits=previous_plan(m, w, n, k), us=None,
                                planner_us=None, source=PLANNER))
    out.sort(key=lambda e: (e["n"], e["k"], e["tokens"], e["bits"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table would change")
    ap.add_argument("gpus", nargs="*", default=list(GPUS), help=f"table names (default: {' '.join(GPUS)})")
    a = ap.parse_args(argv)
    rc = 0
    for gpu in a.gpus:
        path = table_path(gpu)
        with open(path) as f:
            doc = json.load(f)
        entries = frozen_entries(doc["decode_splits"])
        planner = sum(e.get("source") == PLANNER for e in entries)
        if a.check:
            same = entries == doc["decode_splits"]
            print(f"{gpu}: {len(entries)} entries, {planner} planner entries, "
                  f"{'as committed' if same else 'DIFFERENT from the committed table'}")
            rc |= not same
        else:
            tuning.write_table(path, doc["gpu"], entries, command=doc["measured"]["command"],
                               date=doc["measured"]["date"])
            print(f"{gpu}: {len(entries)} entries, {planner} planner entries -> {os.path.relpath(path)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
