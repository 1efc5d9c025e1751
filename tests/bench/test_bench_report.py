"""The benchmark grid's reports without a GPU: the JSON round trip, the merge of split runs,
the table, the plot and ``--save``'s folder."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mixgemm import bench
from mixgemm.bench import MIN_ITERS, BenchReport, analyze

from bench_helpers import K, N, machine, meas

# ------------------------------------------------------------------------- JSON round trip
def test_json_round_trip(tmp_path):
    res = analyze([meas("cublas", 100.0), meas("torch_int4", 50.0), meas("mixgemm-u4", 20.0),
                   meas("mixgemm-s2", 10.0, err_impl=float("nan")),
                   meas("gemlite-u2", error="gemlite is not importable", unavailable=True)],
                  copy_bw_gbps=3000.0)
    cfg = bench.BenchConfig(shapes=((N, K),), ms=(16,), impls=("cublas", "torch_int4"))
    report = BenchReport(machine(), cfg.to_json(), res)
    path = bench.write_json(tmp_path / "sub" / "bench.json", report)
    back = bench.read_json(path)
    assert back == report
    doc = json.loads(path.read_text())
    assert doc["schema"] == bench.JSON_SCHEMA
    mach = doc["machine"]
    for key in ("gpu_name", "torch_version", "triton_version", "cuda_version", "copy_bw_gbps",
                "dense_bf16_tflops"):
        assert key in mach
    assert mach["copy_bw_gbps"] == 3000.0 and mach["dense_bf16_tflops"] == 790.0
    assert doc["config"]["shapes"] == [[N, K]] and doc["config"]["iters"] == MIN_ITERS
    pts = {p["impl"]: p for p in doc["points"]}
    assert set(pts) == {"cublas", "torch_int4", "mixgemm-u4", "mixgemm-s2", "gemlite-u2"}
    assert pts["mixgemm-u4"]["speedup_vs_cublas"] == pytest.approx(5.0)
    assert pts["mixgemm-u4"]["speedup_vs_best_peer"] == pytest.approx(2.5)
    assert pts["mixgemm-s2"]["status"] == "FAIL" and pts["mixgemm-s2"]["err_impl"] is None
    assert pts["gemlite-u2"]["status"] == "n/a"
    with pytest.raises(ValueError):
        bench.report_from_dict({**doc, "schema": "other"})


def test_merge_reports_joins_split_runs(tmp_path):
    """A grid split by M across two processes comes back as one report, each point as measured."""
    a = BenchReport(machine(timestamp="t1"), bench.BenchConfig(ms=(1, 16), impls=("cublas", "mixgemm-u4")).to_json(),
                    analyze([meas("cublas", 100.0, m=1), meas("mixgemm-u4", 25.0, m=1),
                             meas("cublas", 100.0, m=16), meas("mixgemm-u4", 50.0, m=16)], 3000.0))
    b = BenchReport(machine(timestamp="t2", copy_bw_gbps=2900.0),
                    bench.BenchConfig(ms=(4096,), impls=("cublas", "mixgemm-u4", "mixgemm-u2")).to_json(),
                    analyze([meas("cublas", 900.0, m=4096), meas("mixgemm-u4", 1000.0, m=4096),
                             meas("mixgemm-u2", 950.0, m=4096)], 2900.0))
    merged = bench.merge_reports([a, b])
    assert len(merged.results) == 7 and merged.machine == a.machine
    assert merged.config["ms"] == [1, 16, 4096]
    assert merged.config["impls"] == ["cublas", "mixgemm-u4", "mixgemm-u2"]
    assert [r["timestamp"] for r in merged.config["runs"]] == ["t1", "t2"]
    assert merged.config["runs"][1]["copy_bw_gbps"] == 2900.0
    by = {(r.impl, r.m): r for r in merged.results}
    assert by[("mixgemm-u4", 1)].speedup_vs_cublas == pytest.approx(4.0)
    assert by[("mixgemm-u4", 4096)].speedup_vs_cublas == pytest.approx(0.9)
    # the merged document is a report like any other
    path = bench.write_json(tmp_path / "merged.json", merged)
    assert bench.read_json(path) == merged
    with pytest.raises(ValueError, match="more than one run"):
        bench.merge_reports([a, a])
    with pytest.raises(ValueError, match="different GPUs"):
        bench.merge_reports([a, BenchReport(machine(gpu_name="other"), a.config, [])])
    with pytest.raises(ValueError, match="different dtype"):
        bench.merge_reports([a, BenchReport(machine(), {**a.config, "dtype": "fp16"}, [])])
    with pytest.raises(ValueError, match="nothing"):
        bench.merge_reports([])


def test_merge_cli_writes_one_report(tmp_path, capsys):
    parts = []
    for i, m in enumerate((1, 64)):
        rep = BenchReport(machine(timestamp=f"t{i}"), bench.BenchConfig(ms=(m,), impls=("cublas", "mixgemm-u4")).to_json(),
                          analyze([meas("cublas", 100.0, m=m), meas("mixgemm-u4", 40.0, m=m)], 3000.0))
        parts.append(str(bench.write_json(tmp_path / f"part{i}.json", rep)))
    out = tmp_path / "all.json"
    assert bench.main(["--merge", *parts, "--json", str(out)]) == 0
    merged = bench.read_json(out)
    assert sorted({r.m for r in merged.results}) == [1, 64] and merged.config["ms"] == [1, 64]
    capsys.readouterr()
    assert bench.main(["--merge", *parts]) != 0
    assert "--merge needs --json" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert bench.main(["--merge", str(tmp_path / "bad.json"), "--json", str(out)]) != 0
    assert "--merge:" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- table
def test_table_lists_every_implementation_and_shape():
    shapes = [(4096, 4096), (28672, 8192)]
    names = bench.impl_names()
    ms = []
    for n, k in shapes:
        for m in (1, 128):
            for i, name in enumerate(names):
                if name == "gemlite-u2":
                    ms.append(meas(name, m=m, n=n, k=k, error="gemlite is not importable: X",
                                   unavailable=True))
                else:
                    ms.append(meas(name, 10.0 + i, m=m, n=n, k=k))
    res = analyze(ms, copy_bw_gbps=3000.0)
    text = bench.format_table(res, machine(), {"dtype": "bf16", "group_size": 128, "iters": 100})
    for n, k in shapes:
        assert f"N={n} K={k}" in text
    for name in names:
        assert name in text
    assert "gemlite-u2: n/a: gemlite is not importable: X" in text
    assert "NVIDIA H100 80GB HBM3" in text and "3000 GB/s" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("M "))
    for col in ("time us", "GB/s", "%copyBW", "TFLOP/s", "x cuBLAS", "x peer", "err(own)",
                "err(float)", "status"):
        assert col in header
    # every data row is aligned to the header width of its block
    rows = [line for line in lines if line.split() and line.split()[0].isdigit()]
    assert len(rows) == len(shapes) * 2 * len(names)


def test_table_marks_quick_runs():
    text = bench.format_table(analyze([meas("cublas", 1.0)], None), None, {"quick": True, "iters": 10})
    assert "QUICK" in text


# ------------------------------------------------------------------------------------ plot
def test_plot_written_when_matplotlib_is_available(tmp_path):
    pytest.importorskip("matplotlib")
    ms = [meas(name, 100.0 / (1 + i), m=m, n=n)
          for n in (4096, 8192, 28672) for m in (1, 16, 256, 4096)
          for i, name in enumerate(["cublas", "torch_int4", "gemlite-u4", "mixgemm-u4"])]
    ok, where = bench.write_plot(analyze(ms, 3000.0), tmp_path / "p" / "bench.png", title="t")
    assert ok, where
    data = Path(where).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_degrades_gracefully_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    ok, why = bench.write_plot(analyze([meas("cublas", 1.0)], None), tmp_path / "x.png")
    assert not ok and "matplotlib" in why
    assert not (tmp_path / "x.png").exists()


def test_save_writes_to_the_gpu_folder(tmp_path):
    res = analyze([meas("cublas", 100.0), meas("mixgemm-u4", 20.0)], 3000.0)
    cfg = bench.BenchConfig(save=True, results_root=str(tmp_path), json_path=str(tmp_path / "a.json"))
    logs = []
    written = bench.write_outputs(BenchReport(machine(gpu_name="My H200!"), cfg.to_json(), res), cfg,
                                  log=logs.append)
    folder = tmp_path / "my-h200"
    assert (folder / "bench.json").is_file() and (tmp_path / "a.json").is_file()
    assert folder / "bench.json" in written
    try:
        import matplotlib  # noqa: F401
        assert (folder / "bench.png").is_file()
    except ImportError:
        assert any("plot not written" in line for line in logs)


def test_slug_and_results_dir():
    assert bench.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bench.slugify("  ") == "unknown-gpu"
    assert bench.results_dir(Path("/r"), "NVIDIA H200") == Path("/r/nvidia-h200")


