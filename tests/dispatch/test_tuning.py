"""The measured split-K table (mixgemm.dispatch.tuning): built from sweep rows, read back, looked up."""
from __future__ import annotations

import json

import pytest

from mixgemm.dispatch import tuning
from mixgemm.dtypes import WeightType


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
        assert set(doc) <= {"gpu", "measured", "decode_splits", "act_format"} and set(doc["measured"]) == {"date", "command"}
        if "act_format" in doc:   # act_format="auto"'s section: measured too, and well formed
            assert set(doc["act_format"]) == {"measured", "margin", "entries"} and doc["act_format"]["margin"] >= 1
            assert set(doc["act_format"]["measured"]) == {"date", "command"}
            assert tuning.load_act_format_table(path)
        for e in doc["decode_splits"]:
            assert (e.get("us") or 0) > 0 or e.get("source") == "planner", e


def _grid_point(impl, n, k, m, us, status="ok"):
    return {"impl": impl, "n": n, "k": k, "m": m, "time_us": us, "status": status}


def test_act_format_entries_from_a_bench_grid():
    """Per weight type and layer shape, the token counts where both formats were measured and
    those where the e4m3 call beat the exact one by the margin (not merely by noise); a shape
    without both formats, or a point that failed, is left out."""
    pts = [_grid_point("mixgemm-u2", 4096, 4096, 64, 10.0), _grid_point("mixgemm-u2-fp8", 4096, 4096, 64, 20.0),
           _grid_point("mixgemm-u2", 4096, 4096, 256, 30.0), _grid_point("mixgemm-u2-fp8", 4096, 4096, 256, 25.0),
           _grid_point("mixgemm-u2", 4096, 4096, 1024, 100.0), _grid_point("mixgemm-u2-fp8", 4096, 4096, 1024, 97.0),
           _grid_point("mixgemm-u2", 4096, 4096, 4096, 400.0),
           _grid_point("mixgemm-u2-fp8", 4096, 4096, 4096, 300.0, status="error"),
           _grid_point("mixgemm-u4-fp8", 8192, 4096, 64, 5.0),                     # no exact row: left out
           _grid_point("cublas", 4096, 4096, 64, 1.0)]
    assert tuning.act_format_entries(pts, margin=1.05) == [
        {"weight": "u2", "n": 4096, "k": 4096, "tokens": [64, 256, 1024], "fp8": [256]}]
    assert tuning.act_format_entries(pts, margin=1.0)[0]["fp8"] == [256, 1024]
    with pytest.raises(ValueError, match="margin"):
        tuning.act_format_entries(pts, margin=0.9)


def test_act_format_table_round_trip_keeps_the_other_section(tmp_path, monkeypatch):
    path = tmp_path / "nvidia-test-gpu.json"
    splits = [{"n": 28672, "k": 8192, "tokens": 8, "bits": 4, "splits": 1}]
    auto = [{"weight": "u2", "n": 4096, "k": 4096, "tokens": [64, 256, 1024], "fp8": [256, 1024]}]
    tuning.write_table(path, "NVIDIA Test GPU", splits, command="sweep")
    tuning.write_act_format_table(path, "NVIDIA Test GPU", auto, 1.05, command="grid")
    tuning.write_table(path, "NVIDIA Test GPU", splits, command="sweep again")   # keeps act_format
    doc = json.loads(path.read_text())
    assert doc["measured"]["command"] == "sweep again" and doc["act_format"]["measured"]["command"] == "grid"
    assert tuning.load_table(path) == {tuning.SplitKey(28672, 8192, 8, 4): 1}
    key = tuning.ActFormatKey("u2", 4096, 4096)
    assert tuning.load_act_format_table(path) == {key: ((64, 256, 1024), frozenset({256, 1024}))}
    assert not list(tmp_path.glob("*.tmp*"))
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    tuning._act_format_table.cache_clear()
    try:
        u2 = WeightType("u2")
        assert not tuning.prefers_fp8("NVIDIA Test GPU", u2, 4096, 4096, 63)     # below the smallest measured
        assert not tuning.prefers_fp8("NVIDIA Test GPU", u2, 4096, 4096, 255)    # 64's choice
        assert tuning.prefers_fp8("NVIDIA Test GPU", u2, 4096, 4096, 256)
        assert tuning.prefers_fp8("NVIDIA Test GPU", u2, 4096, 4096, 9999)       # the largest's choice
        assert not tuning.prefers_fp8("NVIDIA Test GPU", WeightType("u4"), 4096, 4096, 256)   # not listed
        assert not tuning.prefers_fp8("NVIDIA Test GPU", u2, 4096, 8192, 256)
        assert not tuning.prefers_fp8("Some Other GPU", u2, 4096, 4096, 256)
    finally:
        tuning._act_format_table.cache_clear()


def test_a_table_is_written_only_over_a_table_of_the_same_gpu(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("not json")
    with pytest.raises(ValueError, match="not overwriting"):
        tuning.write_act_format_table(path, "NVIDIA Test GPU", [], 1.05)
    tuning.write_table(tmp_path / "g.json", "NVIDIA Other GPU", [])
    with pytest.raises(ValueError, match="not overwriting"):
        tuning.write_table(tmp_path / "g.json", "NVIDIA Test GPU", [])
    (tmp_path / "d.json").mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        tuning.write_act_format_table(tmp_path / "d.json", "NVIDIA Test GPU", [], 1.05)
    assert path.read_text() == "not json"


@pytest.mark.parametrize("section", ['{"entries": [{"weight": "u2"}]}',
                                     '{"entries": [{"weight": "s8", "n": 16, "k": 64, "tokens": [1], "fp8": [1]}]}',
                                     '{"entries": [{"weight": "u2", "n": 16, "k": 64, "tokens": [1], "fp8": [2]}]}'])
def test_malformed_act_format_section_is_a_clear_error(tmp_path, section):
    path = tmp_path / "t.json"
    path.write_text('{"gpu": "X", "act_format": ' + section + '}')
    with pytest.raises(ValueError, match="t.json"):
        tuning.load_act_format_table(path)
