"""Write the ``act_format`` section of a GPU's tuning table from a bench grid (no GPU needed).

    python tools/act_format_table.py GRID.json [--margin 1.05] [--table TABLE.json]

GRID.json is ``mixgemm bench --json`` of a grid that measured, for each weight type it lists,
both ``mixgemm-<wt>`` and ``mixgemm-<wt>-fp8`` at the same layer shapes and token counts, e.g.::

    mixgemm bench --shapes 6144x4096,4096x4096,28672x4096,4096x14336 --m 64,128,256,512,1024,2048,4096 \\
        --impls cublas,mixgemm-u4,mixgemm-u4-fp8,mixgemm-s4,mixgemm-s4-fp8,mixgemm-u2,mixgemm-u2-fp8,mixgemm-s2,mixgemm-s2-fp8 \\
        --quick --json GRID.json

The section (:func:`mixgemm.dispatch.tuning.act_format_entries`) lists, per weight type and
shape, the token counts measured and those where the e4m3 call was at least ``--margin`` times
faster; ``act_format="auto"`` reads it (docs/fp8.md). The table defaults to the package's
``python/mixgemm/dispatch/configs/<gpu>.json`` for the grid's GPU; its other sections are kept.
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
    ap.add_argument("grid", help="mixgemm bench --json output")
    ap.add_argument("--margin", type=float, default=1.05,
                    help="how much faster the e4m3 call must be to be chosen (default 1.05)")
    ap.add_argument("--table", help="the table file (default: the package's table for the grid's GPU)")
    a = ap.parse_args(argv)
    doc = json.loads(Path(a.grid).read_text())
    try:
        gpu = doc["machine"]["gpu_name"]
        points = doc["points"]
    except (KeyError, TypeError):
        print(f"act_format_table: {a.grid} is not a mixgemm bench --json grid", file=sys.stderr)
        return 2
    entries = tuning.act_format_entries(points, a.margin)
    if not entries:
        print(f"act_format_table: {a.grid} measures no weight type in both activation formats", file=sys.stderr)
        return 2
    table = Path(a.table) if a.table else tuning.TABLE_DIR / f"{tuning.gpu_slug(gpu)}.json"
    cfg = doc.get("config", {})
    command = (f"mixgemm bench --shapes {','.join(f'{n}x{k}' for n, k in cfg.get('shapes', []))} "
               f"--m {','.join(str(m) for m in cfg.get('ms', []))} --impls {','.join(cfg.get('impls', []))}"
               f"{' --quick' if cfg.get('quick') else ''}; python tools/act_format_table.py "
               f"{os.path.basename(a.grid)} --margin {a.margin}")
    tuning.write_act_format_table(table, gpu, entries, a.margin, command=command,
                                  date=doc["machine"].get("timestamp", "")[:10] or None)
    for e in entries:
        print(f"{e['weight']} {e['n']}x{e['k']}: e4m3 at M = {', '.join(map(str, e['fp8'])) or 'none'} "
              f"(of {', '.join(map(str, e['tokens']))})")
    print(f"wrote the act_format section of {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
