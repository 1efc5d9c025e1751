"""Write the ``act_format`` section of a GPU's tuning table from a bench grid (no GPU needed).

    python tools/act_format_table.py GRID.json [GRID.json ...] [--margin 1.05] [--table TABLE.json]

Each GRID.json is ``mixgemm bench --json`` of a grid (of one GPU) that measured, for each weight type it lists,
both ``mixgemm-<wt>`` and ``mixgemm-<wt>-fp8`` at the same layer shapes and token counts, e.g.::

    mixgemm bench --shapes 6144x4096,4096x4096,28672x4096,4096x14336 --m 64,128,256,512,1024,2048,4096 \\
        --impls cublas,mixgemm-u4,mixgemm-u4-fp8,mixgemm-s4,mixgemm-s4-fp8,mixgemm-u2,mixgemm-u2-fp8,mixgemm-s2,mixgemm-s2-fp8 \\
        --quick --json GRID.json

The section (:func:`mixgemm.dispatch.tuning.act_format_entries`) lists, per weight type and
shape, the token counts measured and those where the e4m3 call was at least ``--margin`` times
faster; ``act_format="auto"`` reads it (docs/fp8.md). Several grids (other layer shapes) make
one section; where two measured the same weight type and shape, the later one's entry is kept.
The section is rewritten whole from the grids given. The table defaults to the package's
``python/mixgemm/dispatch/configs/<gpu>.json`` for the grids' GPU; its other sections are kept.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mixgemm.dispatch import tuning


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grids", nargs="+", metavar="GRID", help="mixgemm bench --json output(s)")
    ap.add_argument("--margin", type=float, default=1.05,
                    help="how much faster the e4m3 call must be to be chosen (default 1.05)")
    ap.add_argument("--table", help="the table file (default: the package's table for the grids' GPU)")
    a = ap.parse_args(argv)
    gpus, by_key, commands, dates = set(), {}, [], []
    for grid in a.grids:
        doc = json.loads(Path(grid).read_text())
        try:
            gpus.add(doc["machine"]["gpu_name"])
            points = doc["points"]
        except (KeyError, TypeError):
            print(f"act_format_table: {grid} is not a mixgemm bench --json grid", file=sys.stderr)
            return 2
        for e in tuning.act_format_entries(points, a.margin):
            by_key[(e["weight"], e["n"], e["k"])] = e
        cfg = doc.get("config", {})
        commands.append(f"mixgemm bench --shapes {','.join(f'{n}x{k}' for n, k in cfg.get('shapes', []))} "
                        f"--m {','.join(str(m) for m in cfg.get('ms', []))} --impls {','.join(cfg.get('impls', []))}"
                        f"{' --quick' if cfg.get('quick') else ''} (-> {os.path.basename(grid)})")
        dates.append(doc["machine"].get("timestamp", "")[:10])
    if len(gpus) != 1:
        print(f"act_format_table: the grids are of {len(gpus)} GPUs ({', '.join(sorted(gpus))}), not one", file=sys.stderr)
        return 2
    entries = [by_key[k] for k in sorted(by_key, key=lambda k: (tuning.FP8_WEIGHTS.index(k[0]), k[1], k[2]))]
    if not entries:
        print("act_format_table: the grids measure no weight type in both activation formats", file=sys.stderr)
        return 2
    (gpu,) = gpus
    table = Path(a.table) if a.table else tuning.TABLE_DIR / f"{tuning.gpu_slug(gpu)}.json"
    command = "; ".join(commands) + (f"; python tools/act_format_table.py "
                                     f"{' '.join(os.path.basename(g) for g in a.grids)} --margin {a.margin}")
    tuning.write_act_format_table(table, gpu, entries, a.margin, command=command, date=max(dates) or None)
    for e in entries:
        print(f"{e['weight']} {e['n']}x{e['k']}: e4m3 at M = {', '.join(map(str, e['fp8'])) or 'none'} "
              f"(of {', '.join(map(str, e['tokens']))})")
    print(f"wrote the act_format section of {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
