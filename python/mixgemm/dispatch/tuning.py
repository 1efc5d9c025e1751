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

The same file may hold an ``act_format`` section: for ``act_format="auto"``, per weight type and
layer shape, the token counts at which a bench grid measured both activation formats and those
at which the e4m3 path (``mixgemm-<wt>-fp8``) beat the exact one (``mixgemm-<wt>``) by at least the
section's margin (``tools/act_format_table.py``, docs/fp8.md). A call with M tokens takes the
e4m3 path when the largest measured token count at or below M is one of those; layer shapes,
weight types and GPUs the section does not list keep the exact activations.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import re
from pathlib import Path
from typing import Iterable, Mapping, Optional

from ..dtypes import WeightType
from ..utils.atomic import replacing

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


def _table_file(gpu_name: str) -> Optional[Path]:
    """The package's table of ``gpu_name``, or None where it has none."""
    path = TABLE_DIR / f"{gpu_slug(gpu_name)}.json"
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def _table(gpu_name: str) -> Mapping[SplitKey, int]:
    path = _table_file(gpu_name)
    return {} if path is None else load_table(path)


def _entry_key(e: Mapping) -> SplitKey:
    return SplitKey(int(e["n"]), int(e["k"]), int(e["tokens"]), int(e["bits"]))


def load_table(path: Path) -> dict[SplitKey, int]:
    """Read a table file; raises ValueError naming the file if it is malformed."""
    try:
        data = json.loads(Path(path).read_text())
        # (a file that holds only the act_format section has no split entries)
        entries = data["decode_splits"] if "decode_splits" in data or "act_format" not in data else []
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


def _other_sections(path: Path, gpu_name: str, own: tuple) -> dict:
    """The sections of an existing table file other than ``own`` (kept when one is rewritten);
    {} when there is none. A file of another GPU, or that is not a table, is refused."""
    if not path.exists():
        return {}
    if not path.is_file():
        raise ValueError(f"{path}: exists and is not a regular file; not writing a table over it")
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: exists and is not a mixgemm tuning table ({e}); not overwriting it") from e
    if not isinstance(old, dict) or old.get("gpu") != gpu_name:
        raise ValueError(f"{path}: a table of {old.get('gpu') if isinstance(old, dict) else '?'!r}, "
                         f"not of {gpu_name!r}; not overwriting it")
    return {k: v for k, v in old.items() if k not in own}


def _write_doc(path: Path, doc: dict) -> None:
    """Write a table file through mixgemm's atomic writer (a temporary, renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        Path(tmp).write_text(json.dumps(doc, indent=1) + "\n")


def write_table(path: Path, gpu_name: str, entries: list[dict], command: Optional[str] = None,
                date: Optional[str] = None) -> None:
    """Write a table file's split-K section atomically (temp file + rename): the GPU, when
    (``date``, default today) and by which command it was measured, and the entries; the file's
    other sections (``act_format``) are kept."""
    path = Path(path)
    rest = _other_sections(path, gpu_name, ("gpu", "measured", "decode_splits"))
    doc = {"gpu": gpu_name, "measured": {"date": date or datetime.date.today().isoformat(), "command": command},
           "decode_splits": entries, **rest}
    _write_doc(path, doc)


# ---------------------------------------------------------------------------------------------
# act_format="auto": where the e4m3 path was measured faster
# ---------------------------------------------------------------------------------------------
#: the weight types the e4m3 path takes
FP8_WEIGHTS = ("u4", "s4", "u2", "s2")


@dataclasses.dataclass(frozen=True)
class ActFormatKey:
    weight: str   # WeightType value
    n: int
    k: int


def act_format_entries(points: Iterable[Mapping], margin: float = 1.05) -> list[dict]:
    """The ``act_format`` entries of a bench grid's points (``mixgemm bench --json``'s
    ``points``): per weight type and (N, K) with both ``mixgemm-<wt>`` and ``mixgemm-<wt>-fp8``
    measured (status ok), the token counts measured and those at which the e4m3 call was at least
    ``margin`` times faster. Sorted by key."""
    if not margin >= 1.0:
        raise ValueError(f"margin must be >= 1 (how much faster the e4m3 path must be), got {margin}")
    times: dict[tuple, float] = {}
    for p in points:
        if p.get("status", "ok") == "ok" and p.get("time_us"):
            times[(p["impl"], int(p["n"]), int(p["k"]), int(p["m"]))] = float(p["time_us"])
    out = []
    for wt in FP8_WEIGHTS:
        shapes = sorted({(n, k) for (impl, n, k, _) in times if impl == f"mixgemm-{wt}-fp8"})
        for n, k in shapes:
            ms = sorted(m for (impl, n2, k2, m) in times if impl == f"mixgemm-{wt}-fp8" and (n2, k2) == (n, k)
                        and (f"mixgemm-{wt}", n, k, m) in times)
            if not ms:
                continue
            fp8 = [m for m in ms if times[(f"mixgemm-{wt}", n, k, m)] >= margin * times[(f"mixgemm-{wt}-fp8", n, k, m)]]
            out.append({"weight": wt, "n": n, "k": k, "tokens": ms, "fp8": fp8})
    return out


def write_act_format_table(path: Path, gpu_name: str, entries: list[dict], margin: float,
                           command: Optional[str] = None, date: Optional[str] = None) -> None:
    """Write a table file's ``act_format`` section atomically, keeping its other sections (a new
    file holds only this one)."""
    path = Path(path)
    rest = _other_sections(path, gpu_name, ("gpu", "act_format"))
    section = {"measured": {"date": date or datetime.date.today().isoformat(), "command": command},
               "margin": margin, "entries": entries}
    _write_doc(path, {"gpu": gpu_name, **rest, "act_format": section})


def load_act_format_table(path: Path) -> dict[ActFormatKey, tuple[tuple[int, ...], frozenset]]:
    """A table file's ``act_format`` section ({} without one); ValueError naming the file if it is
    malformed."""
    try:
        data = json.loads(Path(path).read_text())
        section = data.get("act_format")
        if section is None:
            return {}
        table = {}
        for e in section["entries"]:
            key = ActFormatKey(WeightType(e["weight"]).value, int(e["n"]), int(e["k"]))
            tokens = tuple(sorted(int(t) for t in e["tokens"]))
            fp8 = frozenset(int(t) for t in e["fp8"])
            if key.weight not in FP8_WEIGHTS or not tokens or not fp8 <= set(tokens) or tokens[0] < 1:
                raise ValueError(f"bad entry {e}")
            table[key] = (tokens, fp8)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a mixgemm act_format table ({e})") from e
    return table


@functools.lru_cache(maxsize=None)
def _act_format_table(gpu_name: str) -> Mapping[ActFormatKey, tuple]:
    path = _table_file(gpu_name)
    return {} if path is None else load_act_format_table(path)


def prefers_fp8(gpu_name: str, weight: WeightType, n: int, k: int, m: int) -> bool:
    """Whether ``act_format="auto"`` takes the e4m3 path for M = ``m`` tokens of this layer on this
    GPU: the largest measured token count at or below ``m`` is one where it was faster (False for
    what the table does not list, and below its smallest token count)."""
    entry = _act_format_table(gpu_name).get(ActFormatKey(weight.value, n, k))
    if entry is None:
        return False
    tokens, fp8 = entry
    below = [t for t in tokens if t <= m]
    return bool(below) and below[-1] in fp8
