"""The per-preset report (``mixgemm.bench.preset_report``) of ``--model`` and ``--moe`` on the
results committed under benchmarks/results: every ``model-*.json`` and ``moe-*.json`` loads, comes
back as the same report and the same bytes, splits and merges back to its points, and prints a
table row per point."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mixgemm.bench import model as M
from mixgemm.bench import moe as B
from mixgemm.bench.preset_report import PresetReport, split_by_preset, write_report_json

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FILES = sorted([*RESULTS.glob("*/model-*.json"), *RESULTS.glob("*/moe-*.json")])
KINDS = {M.MODEL_SCHEMA: (M.ModelReport, M.format_model_table), B.MOE_SCHEMA: (B.MoeReport, B.format_moe_table)}


def load(path: Path) -> tuple[str, PresetReport]:
    text = path.read_text(encoding="utf-8")
    cls, _ = KINDS[json.loads(text)["schema"]]
    return text, cls.from_dict(json.loads(text))


def test_there_are_committed_results_of_both_kinds():
    assert {json.loads(p.read_text())["schema"] for p in FILES} == set(KINDS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_result_round_trips(path, tmp_path):
    text, rep = load(path)
    assert rep.points and all(isinstance(p, rep.POINT) for p in rep.points)
    assert type(rep).from_dict(rep.to_dict()) == rep
    assert json.dumps(rep.to_dict(), indent=1, allow_nan=False) + "\n" == text
    # the module-level names of each mode are the same functions
    to_dict = M.model_report_to_dict if isinstance(rep, M.ModelReport) else B.moe_report_to_dict
    assert to_dict(rep) == rep.to_dict()
    written = write_report_json(tmp_path / "again.json", rep)
    assert written.read_text(encoding="utf-8") == text


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_result_splits_merges_and_prints(path):
    _, rep = load(path)
    parts = split_by_preset(rep)
    assert list(parts) == list(rep.presets)
    assert all(type(part) is type(rep) and part.config["presets"] == [name] for name, part in parts.items())
    merged = type(rep).merge(list(parts.values()))
    assert merged.points == rep.points and merged.presets == rep.presets and merged.machine == rep.machine
    assert [run["presets"] for run in merged.config["runs"]] == [[name] for name in parts]
    with pytest.raises(ValueError, match="is in more than one run"):
        type(rep).merge([rep, rep])
    _, table = KINDS[rep.SCHEMA]
    text = table(rep.points, rep.machine, rep.config)
    assert text.splitlines()[0].startswith(f"GPU: {rep.machine.gpu_name} ")
    for name in rep.presets:
        assert any(line.startswith(f"{name}: hidden ") for line in text.splitlines())
    header = "  ".join(M.MODEL_TABLE_HEADER if isinstance(rep, M.ModelReport) else B.MOE_TABLE_HEADER)
    n_headers = sum(1 for line in text.splitlines() if line.split() == header.split())
    rows = [line for line in text.splitlines() if line.split() and line.split()[-1] in ("ok", "FAIL", "error", "n/a")]
    assert n_headers == len(rep.presets) and len(rows) == len(rep.points)


def test_kinds_do_not_mix():
    model = next(load(p)[1] for p in FILES if p.name.startswith("model-"))
    moe = next(load(p)[1] for p in FILES if p.name.startswith("moe-"))
    assert model.SCHEMA != moe.SCHEMA
    with pytest.raises(ValueError, match="not a mixgemm.bench.moe/1 document"):
        B.MoeReport.from_dict(model.to_dict())
    same_fields = M.ModelReport(moe.machine, moe.config, moe.presets, moe.points)
    assert same_fields != moe                          # a report's kind is part of its value


def test_moe_merge_checks_group_sizes_and_unites_tokens():
    moe = next(load(p)[1] for p in FILES if p.name.startswith("moe-"))
    other = dataclasses.replace(moe, config={**moe.config, "group_size": 64}, points=[])
    with pytest.raises(ValueError, match="runs with different group sizes: 128 and 64"):
        B.merge_moe_reports([moe, other])
    more = dataclasses.replace(moe, config={**moe.config, "tokens": [3, 8192]}, points=[])
    merged = B.merge_moe_reports([moe, more])
    assert merged.config["tokens"] == sorted({*moe.config["tokens"], 3, 8192})
    assert [run["tokens"] for run in merged.config["runs"]] == [moe.config["tokens"], [3, 8192]]
    assert list(merged.config)[-1] == "runs" and merged.config["presets"] == list(moe.presets)
