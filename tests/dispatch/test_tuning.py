"""The measured split-K table (mixgemm.dispatch.tuning): built from sweep rows, read back, looked up."""
from __future__ import annotations

import json

import pytest

from mixgemm.dispatch import tuning


def _row(n, k, m, weight, splits, us, stage_bytes=1024, warps=8, stages=4):
    return dict(n=n, k=k, m=m, weight=weight, splits=splits, us=us, stage_bytes=stage_bytes,
                warps=warps, stages=stages)


def test_table_from_sweep_keeps_only_measured_wins():
    rows = [
        # M=1 (8-token tile), int4: forced 1 beats the planner's pick
        _row(28672, 8192, 1, "u4", 0, 69.3), _row(28672, 8192, 1, "u4", 1, 62.0), _row(28672, 8192, 1, "u4", 4, 68.5),
        # M=16, int2: the planner is already best -> no entry
        _row(28672, 8192, 16, "u2", 0, 72.0), _row(28672, 8192, 16, "u2", 4, 72.5),
        # other configs and other M are ignored
        _row(28672, 8192, 1, "s8", 1, 1.0, stage_bytes=2048), _row(28672, 8192, 4, "s8", 1, 1.0),
        _row(4096, 4096, 16, "s8", 0, 22.4), _row(4096, 4096, 16, "s8", 4, 20.0),
    ]
    table = tuning.table_from_sweep(rows)
    got = {(e["n"], e["k"], e["tokens"], e["bits"]): e["splits"] for e in table}
    assert got == {(28672, 8192, 8, 4): 1, (4096, 4096, 16, 8): 4}


def test_merge_replaces_only_what_the_sweep_measured():
    rows = [
        # swept: forced 1 wins (replaces the old factor 3); the planner wins (drops the old entry)
        _row(28672, 8192, 1, "u4", 0, 69.3), _row(28672, 8192, 1, "u4", 1, 62.0),
        _row(28672, 8192, 1, "u2", 0, 50.0), _row(28672, 8192, 1, "u2", 2, 50.4),
    ]
    old = [
        {"n": 28672, "k": 8192, "tokens": 8, "bits": 4, "splits": 3},
        {"n": 28672, "k": 8192, "tokens": 8, "bits": 2, "splits": 4},
        {"n": 28672, "k": 8192, "tokens": 16, "bits": 4, "splits": 2},   # other tile: not swept
        {"n": 4096, "k": 4096, "tokens": 8, "bits": 4, "splits": 4},     # other shape: not swept
    ]
    covered = tuning.swept_keys(rows)
    assert covered == {tuning.SplitKey(28672, 8192, 8, 4), tuning.SplitKey(28672, 8192, 8, 2)}
    merged = tuning.merge_entries(old, tuning.table_from_sweep(rows), covered)
    got = {(e["n"], e["k"], e["tokens"], e["bits"]): e["splits"] for e in merged}
    assert got == {(28672, 8192, 8, 4): 1, (28672, 8192, 16, 4): 2, (4096, 4096, 8, 4): 4}
    keys = [(e["n"], e["k"], e["tokens"], e["bits"]) for e in merged]
    assert keys == sorted(keys)


def test_table_round_trip_and_lookup(tmp_path, monkeypatch):
    entries = [{"n": 28672, "k": 8192, "tokens": 8, "bits": 4, "splits": 1}]
    path = tmp_path / "nvidia-test-gpu.json"
    tuning.write_table(path, "NVIDIA Test GPU", entries)
    assert not list(tmp_path.glob("*.tmp*")), "the temporary file is renamed into place"
    assert tuning.load_table(path) == {tuning.SplitKey(28672, 8192, 8, 4): 1}
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning._table.cache_clear()
    try:
        assert tuning.decode_splits("NVIDIA Test GPU", 28672, 8192, 8, 4) == 1
        assert tuning.decode_splits("NVIDIA Test GPU", 28672, 8192, 16, 4) == 0   # other tile
        assert tuning.decode_splits("Some Other GPU", 28672, 8192, 8, 4) == 0     # no table
    finally:
        tuning._table.cache_clear()


@pytest.mark.parametrize("doc", ['{"decode_splits": [{"n": 1}]}', "not json",
                                 '{"decode_splits": [{"n": 16, "k": 64, "tokens": 8, "bits": 4, "splits": 0}]}'])
def test_malformed_table_is_a_clear_error(tmp_path, doc):
    path = tmp_path / "t.json"
    path.write_text(doc)
    with pytest.raises(ValueError, match="t.json"):
        tuning.load_table(path)


def test_committed_tables_are_valid():
    tables = sorted(tuning.TABLE_DIR.glob("*.json"))
    assert tables, "the package ships the measured H100 table"
    for path in tables:
        doc = json.loads(path.read_text())
        assert tuning.gpu_slug(doc["gpu"]) == path.stem, "the file is named after its GPU"
        table = tuning.load_table(path)
        for key, splits in table.items():
            assert key.tokens in tuning.TILE_M and key.bits in (2, 4, 8)
            assert key.n % 16 == 0 and key.k % 64 == 0 and 1 <= splits <= key.k // 64
        # every entry is a measured factor, or the previous planner's pick kept for a preset layer
        # (docs/dispatch.md); the table says what it was measured on, and nothing more
        assert set(doc) == {"gpu", "measured", "decode_splits"} and set(doc["measured"]) == {"date", "command"}
        for e in doc["decode_splits"]:
            assert (e.get("us") or 0) > 0 or e.get("source") == "planner", e
