"""``mixgemm bench``'s options (the grid's and the common ones), their errors, and the exit
without a GPU."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixgemm import bench
from mixgemm.bench import BASELINE, DEFAULT_MS, DEFAULT_SHAPES, BenchError

from bench_helpers import parse

ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------------- options
def test_defaults_are_the_issues_shapes_and_ms():
    args = parse()
    assert args.shapes == ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                           (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672))
    assert args.shapes == DEFAULT_SHAPES
    assert args.m == DEFAULT_MS == (1, 4, 16, 32, 64, 128, 256, 1024, 4096, 16384)
    cfg = bench.config_from_args(args)
    assert cfg.iters == 100 and cfg.dtype == "bf16" and cfg.group_size == 128
    assert cfg.max_error == 1e-2 and cfg.peer_max_error == 1e-1 and cfg.check_rows == 1024
    assert cfg.fp8_max_error is None            # the e4m3 rows: fp8_error_bar of each K
    assert cfg.impls == tuple(bench.impl_names()) and not cfg.all_configs and not cfg.save
    assert cfg.impls[0] == BASELINE
    assert cfg.impls == ("cublas", "torch_int4", "gemlite-u4", "gemlite-u2", "scaled_mm", "mixgemm-s8", "mixgemm-u8",
                         "mixgemm-s4", "mixgemm-u4", "mixgemm-s2", "mixgemm-u2",
                         "mixgemm-s4-fp8", "mixgemm-u4-fp8", "mixgemm-s2-fp8", "mixgemm-u2-fp8")
    assert "fp8_max_error" in cfg.to_json() and "sqrt(K)" in cfg.to_json()["fp8_max_error"]


def test_overrides_parse():
    args = parse("--shapes", "4096x4096, 28672x8192", "--m", "1,16,4096", "--impls", "mixgemm-u4,gemlite",
                 "--dtype", "fp16", "--group-size", "64", "--iters", "250", "--warmup", "5",
                 "--json", "out.json", "--plot", "out.png", "--gpu-name", "H200 test", "--save",
                 "--results-dir", "/tmp/r", "--max-error", "0.02", "--check-rows", "64", "--seed", "7",
                 "--peer-max-error", "0.1", "--fp8-max-error", "0.02")
    cfg = bench.config_from_args(args)
    assert cfg.shapes == ((4096, 4096), (28672, 8192)) and cfg.ms == (1, 16, 4096)
    assert cfg.impls == ("cublas", "gemlite-u4", "gemlite-u2", "mixgemm-u4")
    assert (cfg.dtype, cfg.group_size, cfg.iters, cfg.warmup) == ("fp16", 64, 250, 5)
    assert (cfg.json_path, cfg.plot_path, cfg.gpu_name, cfg.save) == ("out.json", "out.png", "H200 test", True)
    assert (cfg.results_root, cfg.max_error, cfg.check_rows, cfg.seed) == ("/tmp/r", 0.02, 64, 7)
    assert cfg.peer_max_error == 0.1 and cfg.fp8_max_error == 0.02 and cfg.to_json()["fp8_max_error"] == 0.02
    assert cfg.torch_dtype == torch.float16


def test_all_configs_adds_every_tile_config():
    from mixgemm.jit.catalog import TILE_CONFIGS

    cfg = bench.config_from_args(parse("--all-configs", "--impls", "mixgemm-s4"))
    assert cfg.impls == ("cublas", "mixgemm-s4") + tuple(f"mixgemm-s4@{tc.label}" for tc in TILE_CONFIGS)


@pytest.mark.parametrize("bad", ["4096", "4096x", "x4096", "ax4096", "0x4096", "4096x-1", "4096x4096x2",
                                 "", ",", "4096x4096;8192x8192"])
def test_bad_shapes_give_a_clear_error(bad, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="NxK"):
        bench.parse_shapes(bad)
    with pytest.raises(SystemExit) as e:
        parse("--shapes", bad)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--shapes" in err and "NxK" in err


@pytest.mark.parametrize("bad", ["", "a", "0", "-4", "1,,x"])
def test_bad_m_gives_a_clear_error(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
        bench.parse_int_list(bad)


def test_iteration_minimum_unless_quick():
    with pytest.raises(BenchError, match="--quick"):
        bench.config_from_args(parse("--iters", "99"))
    assert bench.config_from_args(parse("--iters", "100")).iters == 100
    quick = bench.config_from_args(parse("--quick"))
    assert quick.quick and quick.iters == bench.QUICK_ITERS and quick.warmup == bench.QUICK_WARMUP
    assert bench.config_from_args(parse("--quick", "--iters", "3")).iters == 3
    with pytest.raises(BenchError):
        bench.config_from_args(parse("--quick", "--iters", "0"))
    with pytest.raises(BenchError):
        bench.config_from_args(parse("--warmup", "-1"))


def test_impls_filter_errors():
    with pytest.raises(BenchError, match="'cutlass'.*match no implementation"):
        bench.config_from_args(parse("--impls", "cutlass"))
    with pytest.raises(BenchError, match="--all-configs"):
        bench.config_from_args(parse("--impls", "mixgemm-u4@dec8"))
    assert bench.config_from_args(parse("--impls", "cublas")).impls == ("cublas",)
    assert bench.config_from_args(parse("--impls", "mixgemm-s")).impls == (
        "cublas", "mixgemm-s8", "mixgemm-s4", "mixgemm-s2", "mixgemm-s4-fp8", "mixgemm-s2-fp8")
    with pytest.raises(BenchError, match="--fp8-max-error must be positive"):
        bench.config_from_args(parse("--fp8-max-error", "0"))


def test_impls_exact_names_and_the_fp8_rows():
    """An exact name is that row (and its @config rows), not the rows whose names it starts:
    mixgemm-u4 is not mixgemm-u4-fp8; a prefix still takes every row it starts."""
    from mixgemm.jit.catalog import TILE_CONFIGS

    impls = lambda *names: bench.config_from_args(parse("--impls", ",".join(names))).impls  # noqa: E731
    assert impls("mixgemm-u4") == ("cublas", "mixgemm-u4")
    assert impls("cublas", "scaled_mm", "mixgemm-u4", "mixgemm-u4-fp8") == (
        "cublas", "scaled_mm", "mixgemm-u4", "mixgemm-u4-fp8")
    assert impls("mixgemm-u4-") == ("cublas", "mixgemm-u4-fp8")                  # a prefix
    assert impls("scaled") == ("cublas", "scaled_mm")
    assert bench.config_from_args(parse("--all-configs", "--impls", "mixgemm-u2")).impls[2:] == tuple(
        f"mixgemm-u2@{tc.label}" for tc in TILE_CONFIGS)
    # the 8-bit types with e4m3 activations: only when named exactly (their points are n/a, with the reason)
    assert bench.NAMED_ONLY == ("mixgemm-s8-fp8", "mixgemm-u8-fp8")
    assert impls("mixgemm-s8-fp8", "mixgemm-u4") == ("cublas", "mixgemm-u4", "mixgemm-s8-fp8")
    assert "mixgemm-s8-fp8" not in impls("mixgemm-s") and "mixgemm-u8-fp8" not in bench.impl_names()
    with pytest.raises(BenchError, match="'mixgemm-u4-fp8@dec8'"):
        bench.config_from_args(parse("--all-configs", "--impls", "mixgemm-u4-fp8@dec8"))


def test_add_arguments_on_a_subcommand_parser():
    """The `mixgemm` CLI wires `bench` as a subcommand with add_arguments + run_cli."""
    top = argparse.ArgumentParser(prog="mixgemm")
    sub = top.add_subparsers(dest="command")
    p = bench.add_arguments(sub.add_parser("bench"))
    p.set_defaults(func=bench.run_cli)
    args = top.parse_args(["bench", "--m", "1,2", "--quick"])
    assert args.func is bench.run_cli and args.m == (1, 2) and args.quick


# -------------------------------------------------------------------------------- no GPU
def test_cli_without_gpu_exits_nonzero_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--quick", "--shapes", "256x512", "--m", "1"]) == 1
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err
    from mixgemm.cli.main import CliError

    with pytest.raises(CliError, match="no CUDA GPU"):
        bench.run_cli(parse("--quick"))


def test_module_entry_without_gpu_exits_nonzero():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, "-m", "mixgemm.bench", "--quick"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "no CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


