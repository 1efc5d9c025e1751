"""The measurement tools that run on committed data, on the CPU: the decode planner's cost model
against the committed split sweeps (tools/planner_model.py), the split tables' planner entries
(tools/freeze_tuning_tables.py), the decode phase trace's record parser (tools/decode_trace.py),
the guard count of a compiled decode step (tools/compile_guards.py), the summary of an Nsight Compute source export (tools/sass_count.py --ncu-source), and the generate() profiler's
refusals of a bad command line (tools/profile_generate.py)."""
from __future__ import annotations

import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
RESULTS = ROOT / "benchmarks" / "results"


def _tool(name: str):
    if str(TOOLS) not in sys.path:   # (the tools import each other by name, as scripts do)
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_planner_model_check_on_the_committed_sweeps(capsys):
    """`python tools/planner_model.py check`: the committed constants' picks are within 3% of the
    best timed factor on the geometric mean of every committed sweep (worst 1.2x), the planner they
    replaced 11-19% over (docs/dispatch.md)."""
    pm = _tool("planner_model")
    scores = pm.scores()
    assert set(scores) == {"H100 presets", "H100 held-out shapes", "H200 presets (M=16)"}
    for name, s in scores.items():
        (new, new_max), (old, _) = s["committed"], s["previous"]
        assert s["points"] >= 48, name
        assert new <= 1.03 and new_max <= 1.2 and old >= 1.1, (name, s)
    assert scores["H100 held-out shapes"]["points"] == 108
    assert pm.main(["check"]) == 0
    assert "H100 held-out shapes: planner 1.02" in capsys.readouterr().out


def test_freeze_reproduces_the_committed_planner_entries():
    """`python tools/freeze_tuning_tables.py --check`: dropping each table's planner entries and
    rebuilding them from the previous planner gives the committed tables exactly."""
    ft = _tool("freeze_tuning_tables")
    for gpu in ft.GPUS:
        doc = json.loads(Path(ft.table_path(gpu)).read_text())
        planner = [e for e in doc["decode_splits"] if e.get("source") == "planner"]
        assert planner, gpu
        assert ft.frozen_entries(doc["decode_splits"]) == doc["decode_splits"], gpu
        # and from a table with none: the same entries come back
        assert ft.frozen_entries([e for e in doc["decode_splits"] if e.get("source") != "planner"]) \
            == doc["decode_splits"], gpu
    assert ft.main(["--check"]) == 0


def test_h100_table_holds_the_held_out_sweeps_entries():
    """The H100 table's entries of the 18 layers of other models are the held-out sweep's
    (tools/sweep_decode.py --table --merge-into on that sweep's rows)."""
    from mixgemm.dispatch import tuning

    rows = json.loads((RESULTS / "nvidia-h100-80gb-hbm3" / "sweep-decode-held-out-cluster-waves.json").read_text())
    doc = json.loads((tuning.TABLE_DIR / "nvidia-h100-80gb-hbm3.json").read_text())
    merged = tuning.merge_entries(doc["decode_splits"], tuning.table_from_sweep(rows, stage_bytes=None),
                                  tuning.swept_keys(rows, stage_bytes=None))
    assert merged == doc["decode_splits"]


def test_decode_trace_phases_match_the_kernel():
    """The trace reader's phases are the kernel's TracePhase, in order."""
    dt = _tool("decode_trace")
    header = (ROOT / "cutlass_ext" / "mixgemm" / "decode_kernel.hpp").read_text()
    enum = re.search(r"enum TracePhase : int \{(.*?)\};", header, re.S).group(1)
    names = [n.strip() for n in enum.replace("\n", " ").split(",") if n.strip()]
    assert names[-1] == "kPhases"
    camel = ["k" + "".join(w.capitalize() for w in p.split("_")) for p in dt.PHASES]
    assert [c.lower() for c in camel] == [n.lower() for n in names[:-1]]


def test_decode_trace_parses_records():
    """Two launches of one 3-CTA kernel on 2 SMs and one of another, as the kernel records them:
    grouped by key and entry time, with spans, gaps and phase times in us."""
    dt = _tool("decode_trace")
    np_ = dt.NP

    def rec(n, m, y, sm, grid, entry_ns, step_ns=100, ghz=2.0):
        r = np.zeros(dt.FIELDS, dtype=np.uint64)
        r[0], r[1], r[2] = n | (m << 32), y, sm | (grid << 32)
        for i in range(np_):
            r[3 + i] = entry_ns + i * step_ns
            r[3 + np_ + i] = int((entry_ns + i * step_ns) * ghz)
        return r

    t0 = 1_000_000
    recs = [("dec_a", rec(4096, 1, 0x10, cta % 2, 3, t0 + 10 * cta)) for cta in range(3)]
    recs += [("dec_a", rec(4096, 1, 0x10, cta % 2, 3, t0 + 5000 + 10 * cta)) for cta in range(3)]
    recs += [("dec_b", rec(1024, 1, 0x20, 0, 1, t0 + 2500, step_ns=200))]
    ls = dt.launches(recs)
    assert [(k[0], len(a)) for k, a in ls] == [("dec_a", 3), ("dec_b", 1), ("dec_a", 3)]
    rows = dt.summarize(ls, raw=True)
    first, second, third = rows
    assert (first["n"], first["m"], first["ctas"], first["sms"]) == (4096, 1, 3, 2)
    span = (np_ - 1) * 100 + 20   # last CTA enters 20 ns after the first
    assert first["span_us"] == round(span / 1e3, 2) and first["gap_us"] is None
    assert second["t_start_us"] == 2.5 and second["gap_us"] == round((2500 - span) / 1e3, 2)
    assert first["sm_ghz"] == 2.0
    assert first["phase_us"]["exit"] == {"p50": 0.1, "max": 0.1}
    assert second["phase_us"]["init"]["p50"] == 0.2
    assert third["t_start_us"] == 5.0 and len(third["raw"]) == 3
    assert "grid_wait_release_after_prev_end_us" in third


def test_compile_guards_counts_a_one_layer_step(tmp_path):
    """`python tools/compile_guards.py --layers 1`: a row per variant, the quantized models' with
    the three tensors of each GEMM's weight among the graph's inputs."""
    pytest.importorskip("transformers")
    out = tmp_path / "guards.json"
    assert _tool("compile_guards").main(["--layers", "1", "--rounds", "1", "--json", str(out),
                                         "--dump", str(tmp_path)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"bf16", "u4", "u4-fused-layers"}
    for r in rows.values():
        assert r["guards"] > 0 and r["guard_check_us"] > 0 and r["call_us"] > 0
        assert r["tensor_guards"] == r["graph_inputs"]
    # 7 weights per layer in bf16; 4 GEMMs of 3 tensors each in u4 (fused layers: and the rope table)
    assert rows["u4"]["graph_inputs"] - rows["bf16"]["graph_inputs"] == 12 - 7
    assert rows["u4-fused-layers"]["graph_inputs"] - rows["u4"]["graph_inputs"] == 2
    assert (tmp_path / "u4_1.tsv").read_text().count("TENSOR_MATCH") == rows["u4"]["tensor_guards"]


@pytest.mark.parametrize("tool", ("planner_model", "freeze_tuning_tables", "decode_trace", "compile_guards"))
def test_tool_usage(tool, capsys):
    """Each tool answers a bad command line with its usage, not a traceback."""
    mod = _tool(tool)
    if tool == "compile_guards":
        assert mod.main(["--bogus"]) == 2
        assert "python tools/" in capsys.readouterr().out
    elif tool == "freeze_tuning_tables":
        with pytest.raises(SystemExit) as e:
            mod.main(["--bogus"])
        assert e.value.code == 2
    else:
        assert mod.main(["--help"] if tool == "decode_trace" else ["bogus"]) == 2
        assert "python tools/" in capsys.readouterr().out


def test_fp8_check_lists_its_kernels(capsys):
    """`python tools/fp8_check.py --list`: the quantizers, the e4m3 GEMM kernels of
    tests/ops/test_gpu_fp8.py, and for the timed rows the bf16 path's kernels; a bad option is a
    usage error."""
    mod = _tool("fp8_check")
    assert mod.main(["--list", "--shapes", "256x512", "--m", "256"]) == 0
    names = capsys.readouterr().out.split()
    assert {"mixgemm_quant_fp8_bf16", "mixgemm_quant_fp8_fp16", "mixgemm_f8gemm_bf16_u4_t128x128x128_s0",
            "mixgemm_f8gemm_bf16_s2_t128x128x128_s0", "mixgemm_f8gemm_fp16_u4_t128x128x128_s0",
            "mixgemm_f8gemm_fp16_u2_t128x128x128_swiglu_s0", "mixgemm_f8gemm_bf16_u4_t128x32x128_s0",
            "mixgemm_f8gemm_fp16_s4_t128x64x128_swiglu_s0"} <= set(names)
    # 2 quantizers, 3 token tiles x 2 schedulers x (4 bf16 + 2 fp16 plain + 8 gated) e4m3 GEMMs, the
    # timed row's bf16 GEMM
    assert "mixgemm_f8gemm_bf16_u4_t128x32x128_streamk_s0" in names
    assert len(names) == len(set(names)) == 87 and any(n.startswith("mixgemm_gemm_bf16_u4_") for n in names)
    with pytest.raises(SystemExit) as e:
        mod.main(["--bogus"])
    assert e.value.code == 2


def test_profile_generate_refuses_before_any_work(capsys):
    """`python tools/profile_generate.py`: an unknown variant is a one-line usage error naming the
    known ones; without a CUDA GPU it says so instead of failing inside the profiler."""
    mod = _tool("profile_generate")
    with pytest.raises(SystemExit) as e:
        mod.main(["--variants", "bf16,u3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown variant(s) u3" in err and "u4-on" in err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            mod.main([])
        assert e.value.code == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_prebuild_gpu_suite_from_tests_lists_the_catalogue_and_the_test_only_kernels():
    from mixgemm.jit.catalog import default_specs

    out = subprocess.run([sys.executable, str(ROOT / "tools" / "prebuild_gpu_suite.py"), "--from-tests", "--list"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    names = set(out.stdout.split())
    assert {s.name for s in default_specs()} <= names
    # test_gpu_gemm's k-sliced decode kernels are outside the catalogue
    assert {f"mixgemm_decode_{a}_{w}_m8_w8_b1024_s4_k{k}_none" for a in ("bf16", "fp16") for w in ("u4", "s2")
            for k in (2, 4, 8)} <= names


def _ncu_csv(path: Path, rows) -> None:
    """An ncu source-page export: the kernel's name, the header, one row per instruction."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "mixgemm_f8gemm_bf16_u4_t128x128x128_s0"])
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
                    "stall_wait", "stall_short_sb", "stall_wait (Not Issued)"])
        for r in rows:
            w.writerow(r)


def test_sass_count_summarizes_an_ncu_source_export(tmp_path):
    """tools/sass_count.py --ncu-source: executed instructions and stall samples added up by kind
    (a predicated instruction by its opcode), the stall reasons without their not-issued copies,
    and instructions per warp and k-tile from the wgmma issues (BLK_K 128 / k32 = 4 per k-tile)."""
    sc = _tool("sass_count")
    path = tmp_path / "src.csv"
    _ncu_csv(path, [
        ["0x10", "QGMMA.64x128x32.F32.E4M3.E4M3 R24, R92, gdesc[UR20], RZ, !UPT", "50", "400", "5", "0", "9"],
        ["0x20", "@P0 PRMT R187, R108, 0x7351, R109", "30", "1,000", "0", "20", "9"],
        ["0x30", "LOP3.LUT R1, R2, 0x7, RZ, 0xc0, !PT", "10", "600", "4", "0", "9"],
        ["0x40", "FFMA R3, R4, R5, R3", "8", "800", "1", "2", "9"],
        ["0x50", "IMAD R6, R7, 0x2, RZ", "2", "200", "0", "0", "9"],
        ["", "", "", "", "", "", ""],
    ])
    s = sc.ncu_source(str(path), top=2, out=io.StringIO())
    assert s["kernel"] == "mixgemm_f8gemm_bf16_u4_t128x128x128_s0"
    assert s["kinds"]["mma"] == (400, 50) and s["kinds"]["convert"] == (1600, 40)
    assert s["kinds"]["promote"] == (800, 8) and s["kinds"]["other"] == (200, 2)
    assert s["reasons"] == {"stall_wait": 10, "stall_short_sb": 22}
    assert s["per_ktile"] == pytest.approx(3000 / (400 / 4))
    text = io.StringIO()
    sc.ncu_source(str(path), top=1, out=text)
    assert "QGMMA" in text.getvalue() and "FFMA R3" not in text.getvalue()   # only the top instruction listed


def test_sass_count_refuses_a_csv_that_is_not_a_source_export(tmp_path):
    sc = _tool("sass_count")
    path = tmp_path / "x.csv"
    path.write_text('"ID","Kernel Name"\n"0","k"\n')
    with pytest.raises(SystemExit, match="not an ncu source-page CSV export"):
        sc.ncu_source(str(path), out=io.StringIO())


def test_act_format_table_is_the_committed_grids(tmp_path):
    """tools/act_format_table.py on the committed H200 grid writes the act_format section that the
    package ships (the shipped choice of act_format='auto' is that measurement's, nothing else),
    and refuses a file that is not a bench grid."""
    from mixgemm.dispatch import tuning

    tool = _tool("act_format_table")
    shipped = tuning.TABLE_DIR / "nvidia-h200.json"
    section = json.loads(shipped.read_text())["act_format"]
    grids = re.findall(r"\(-> ([\w.-]+\.json)\)", section["measured"]["command"])   # the grids it names
    assert grids and all((RESULTS / "nvidia-h200" / g).is_file() for g in grids)
    out = tmp_path / "t.json"
    assert tool.main([str(RESULTS / "nvidia-h200" / g) for g in grids] +
                     ["--margin", str(section["margin"]), "--table", str(out)]) == 0
    assert tuning.load_act_format_table(out) == tuning.load_act_format_table(shipped)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert tool.main([str(bad), "--table", str(out)]) == 2
    other = tmp_path / "other.json"   # a grid of another GPU does not mix with the H200's
    doc = json.loads((RESULTS / "nvidia-h200" / grids[0]).read_text())
    doc["machine"]["gpu_name"] = "NVIDIA Other"
    other.write_text(json.dumps(doc))
    assert tool.main([str(RESULTS / "nvidia-h200" / grids[0]), str(other), "--table", str(out)]) == 2


def test_fp8_accuracy_refuses_bad_options_and_a_machine_without_hopper(monkeypatch, capsys):
    """`python tools/fp8_accuracy.py`: a weight type without an e4m3 kernel or a count below one
    is a usage error; without an sm_90 GPU it says so and exits 2, before building any model."""
    mod = _tool("fp8_accuracy")
    for bad in (["--types", "u8"], ["--layers", "0"], ["--new-tokens", "0"], ["--bogus"]):
        with pytest.raises(SystemExit) as e:
            mod.main(bad)
        assert e.value.code == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.main(["--layers", "1"]) == 2
    assert "needs an sm_90 (Hopper) GPU" in capsys.readouterr().err
