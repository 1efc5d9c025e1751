"""Measured launch choices: the decode kernels' split-K factor, per GPU and layer shape.

The decode kernels' host helper plans a split-K factor from a cost model
(``cutlass_ext/mixgemm/decode_plan.hpp`` ``Host::plan``, fitted to the H100 sweeps: its picks are
~3% slower than the best measured factor on layer shapes it was not fitted to, at most 1.2x;
``docs/dispatch.md``). For the layer shapes that were measured on a GPU, the
measured best factor is used instead: ``tools/sweep_decode.py`` times every factor in {1, 2, 3, 4,
6, 8, 12, 16} next to the planner's own pick, and ``--table`` writes the winners to
``python/mixgemm/dispatch/configs/<gpu>.json``, committed with the sweep's JSON
(``benchmarks/results/<gpu>/sweep-decode*.json``; H100 and H200 so far). Entries marked
``"source": "planner"`` keep the previous planner's pick for the preset layers where it had
matched the best measured factor.

A table entry is keyed by everything that decides the plan: the GPU's name, the layer's N and K,
the kernel's token tile (8, 16 or 32) and the code width in bits; the activation dtype, group size and
fused activation do not change the stream (the table is measured with bf16, g128). Shapes not in
the table, and other GPUs, use the planner.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Optional

from ..dtypes import WeightType

TABLE_DIR = Path(__file__).resolve().parent / "configs"
#: The split-K factors the sweep tries.
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)   # up to 8 reduce in a cluster, beyond in global memory
#: Representative token count measured for each decode token tile.
TILE_M = {8: 1, 16: 16, 32: 32}


def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (the table's file name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


@dataclasses.dataclass(frozen=True)
class SplitKey:
    n: int
    k: int
    tokens: int   # the decode kernel's token tile
    bits: int


@functools.lru_cache(maxsize=None)
def _table(gpu_name: str) -> Mapping[SplitKey, int]:
    path = TABLE_DIR / f"{gpu_slug(gpu_name)}.json"
    if not path.is_file():
        return {}
    return load_table(path)


def _entry_key(e: Mapping) -> SplitKey:
    return SplitKey(int(e["n"]), int(e["k"]), int(e["tokens"]), int(e["bits"]))


def load_table(path: Path) -> dict[SplitKey, int]:
    """Read a table file; raises ValueError naming the file if it is malformed."""
    try:
        data = json.loads(Path(path).read_text())
        entries = data["decode_splits"]
        table = {_entry_key(e): int(e["splits"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a mixgemm tuning table ({e})") from e
    if any(s < 1 for s in table.values()):
        raise ValueError(f"{path}: split factors must be >= 1")
    return table


def decode_splits(gpu_name: str, n: int, k: int, tokens: int, bits: int) -> int:
    """The measured split-K factor for this decode launch, or 0 (let the kernel's planner choose)."""
    return _table(gpu_name).get(SplitKey(n, k, tokens, bits), 0)


def _keyed_rows(rows: Iterable[Mapping], stage_bytes: Optional[int], warps: int, stages: int):
    """(key, row) for the sweep rows of the given kernel config (``stage_bytes=None``: any) measured
    at a token tile's representative M."""
    for r in rows:
        if stage_bytes is not None and (r["stage_bytes"], r.get("warps", 8), r["stages"]) != (stage_bytes, warps, stages):
            continue
        tokens = next((t for t, m in TILE_M.items() if m == r["m"]), None)
        if tokens is not None:
            yield SplitKey(int(r["n"]), int(r["k"]), tokens, WeightType(r["weight"]).bits), r


def swept_keys(rows: Iterable[Mapping], stage_bytes: Optional[int] = 1024, warps: int = 8,
               stages: int = 4) -> set[SplitKey]:
    """The (N, K, token tile, bits) that a sweep measured, whether or not they made the table."""
    return {key for key, _ in _keyed_rows(rows, stage_bytes, warps, stages)}


def merge_entries(old: Iterable[Mapping], new: Iterable[Mapping], covered: set[SplitKey]) -> list[dict]:
    """A table after a sweep of some shapes: the sweep decides every key it ``covered`` (its entries
    replace the old ones, and an old entry that the sweep left out -- the planner matched the best
    factor -- is dropped); the old entries of the other keys stay. Sorted by key."""
    merged = {_entry_key(e): dict(e) for e in old if _entry_key(e) not in covered}
    merged.update({_entry_key(e): dict(e) for e in new})
    return [merged[k] for k in sorted(merged, key=dataclasses.astuple)]


def table_from_sweep(rows: Iterable[Mapping], stage_bytes: Optional[int] = 1024, warps: int = 8,
                     stages: int = 4, min_gain: float = 0.02) -> list[dict]:
    """The best measured factor per (N, K, token tile, bits) from ``tools/sweep_decode.py`` rows
    (the default kernel config only, at the tile's representative M; ``stage_bytes=None``: every
    row, for sweeps of the heuristic's own kernels). A forced factor enters the table only when
    it beats the planner's own pick (``splits == 0``, measured in the same run) by more than
    ``min_gain`` (run-to-run noise is about 1%)."""
    by_key: dict[SplitKey, dict[int, float]] = {}
    for key, r in _keyed_rows(rows, stage_bytes, warps, stages):
        by_key.setdefault(key, {})[int(r["splits"])] = float(r["us"])
    out = []
    for key, times in sorted(by_key.items(), key=lambda kv: dataclasses.astuple(kv[0])):
        forced = {s: t for s, t in times.items() if s >= 1}
        if not forced:
            continue
        best = min(forced, key=forced.get)
        if 0 in times and forced[best] >= times[0] * (1 - min_gain):
            continue   # the planner already matches the best measured factor
        out.append({**dataclasses.asdict(key), "splits": best, "us": round(forced[best], 2),
                    "planner_us": round(times[0], 2) if 0 in times else None})
    return out


def write_table(path: Path, gpu_name: str, entries: list[dict], command: Optional[str] = None,
                date: Optional[str] = None) -> None:
    """Write a table file atomically (temp file + rename): the GPU, when (``date``, default today)
    and by which command it was measured, and the entries."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": gpu_name, "measured": {"date": date or datetime.date.today().isoformat(), "command": command},
           "decode_splits": entries}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
