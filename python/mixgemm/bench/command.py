"""The command line of ``mixgemm bench`` (and ``python -m mixgemm.bench``): the dispatch to a
mode (the options and their validation: :mod:`.options`), and each mode's outputs:

* the grid (default): :mod:`.grid`, every implementation x layer shape x token count;
* ``--block``: :mod:`.block`, a LLaMA MLP block under CUDA graphs;
* ``--model NAME``: :mod:`.model` / :mod:`.model_run`, a decoder layer stack's decode and prefill
  steps;
* ``--moe NAME``: :mod:`.moe` / :mod:`.moe_run`, one mixture-of-experts layer under CUDA graphs;
* ``--host``: :mod:`.host`, the host's time per call and the eager decode step;
* ``--generate TARGET``: :mod:`.generate` / :mod:`.generate_run`, transformers' ``generate()`` on a
  causal LM (a preset's shapes or a model directory), bf16 against mixgemm, in four modes;
* ``--merge``: no GPU, one report from the JSON of runs that split a grid (or a set of presets);
* ``--list-kernels``: no GPU, the mixgemm kernels a run would launch.

User errors (bad options, no GPU) raise :class:`mixgemm.errors.CliError`, which ``mixgemm``
prints as one line (exit status 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..errors import BenchError, CliError
from .block import run_block_cli
from .decoder import PRESETS
from .generate import GenerateConfig, GenerateReport, analyze_generate, format_generate_table, model_description
from .generate_run import run_generate
from .grid import FAIL, BenchConfig, analyze, run_benchmark
from .host import format_host_table, HOST_CALLS, HOST_CHAIN, host_kernel_specs, HOST_MODES, HOST_MS, HOST_REPEATS, HOST_SHAPE, HostReport, run_host, run_host_modes, write_host_json
from .model import ModelConfig, ModelReport, analyze_model, format_model_table
from .model_run import run_kernel_specs, run_model
from .moe import MOE_PRESETS, MoeConfig, MoeReport, analyze_moe, format_moe_table
from .moe_run import run_kernel_specs as moe_kernel_specs, run_moe
from .options import (build_parser, config_from_args, generate_config_from_args, host_step_config,
                      model_config_from_args, moe_config_from_args)
from .peers import QuantCache, make_impls
from .plots import write_generate_plot, write_model_plot, write_moe_plot, write_plot
from .preset_report import PresetReport, failed, split_by_preset, write_report_json
from .report import (JSON_SCHEMA, BenchReport, default_results_root, format_table, machine_info, merge_reports,
                     report_from_dict, results_dir, write_json)
from .timing import measure_copy_bandwidth, measure_dense_tflops, measure_read_bandwidth

NO_GPU_MESSAGE = ("no CUDA GPU is visible to PyTorch: `mixgemm bench` times kernels on an "
                  "NVIDIA GPU (mixgemm's own kernels need an sm_90 H100/H200)")

Log = Callable[[str], None]

def require_cuda() -> torch.device:
    """The current CUDA device; :class:`BenchError` with a clear message when there is none."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise BenchError(NO_GPU_MESSAGE)
    return torch.device("cuda", torch.cuda.current_device())


def _user_error(message: str) -> Exception:
    """A :class:`mixgemm.errors.CliError`, which ``mixgemm`` prints as one line."""
    return CliError(message)


# ------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------
def _save_folder(cfg, gpu_name: str) -> Path:
    return results_dir(Path(cfg.results_root) if cfg.results_root else default_results_root(), gpu_name)


def write_outputs(report: BenchReport, cfg: BenchConfig, log: Log = print) -> list[Path]:
    """Write the grid's JSON and plot files that ``cfg`` asks for; returns the paths written."""
    written: list[Path] = []
    targets_json = [Path(cfg.json_path)] if cfg.json_path else []
    targets_plot = [Path(cfg.plot_path)] if cfg.plot_path else []
    if cfg.save:
        folder = _save_folder(cfg, report.machine.gpu_name)
        targets_json.append(folder / "bench.json")
        targets_plot.append(folder / "bench.png")
    for path in targets_json:
        written.append(write_json(path, report))
        log(f"wrote {path}")
    title = (f"{report.machine.gpu_name}: speedup over cuBLAS ({report.config.get('dtype')}, "
             f"group {report.config.get('group_size')})")
    for path in targets_plot:
        ok, what = write_plot(report.results, path, title=title)
        if ok:
            written.append(Path(what))
            log(f"wrote {what}")
        else:
            log(f"plot not written: {what}")
    return written


def _write_per_preset(report: PresetReport, cfg, stem: str, write_plot, title: str, log: Log) -> list[Path]:
    """``--json`` and ``--plot`` with every preset; ``--save``: ``<stem>-<preset>.json`` and
    ``.png`` per preset (:func:`.preset_report.split_by_preset`) in the GPU's results folder.
    Returns the paths written."""
    jobs, plots = [], []
    if cfg.json_path:
        jobs.append((Path(cfg.json_path), report))
    if cfg.plot_path:
        plots.append((Path(cfg.plot_path), report))
    if cfg.save:
        folder = _save_folder(cfg, report.machine.gpu_name)
        for name, part in split_by_preset(report).items():
            jobs.append((folder / f"{stem}-{name}.json", part))
            plots.append((folder / f"{stem}-{name}.png", part))
    written = []
    for path, part in jobs:
        written.append(write_report_json(path, part))
        log(f"wrote {path}")
    for path, part in plots:
        ok, what = write_plot(part.points, path, title=title)
        if ok:
            written.append(Path(what))
            log(f"wrote {what}")
        else:
            log(f"plot not written: {what}")
    return written


def write_model_outputs(report: ModelReport, cfg: ModelConfig, log: Log = print) -> list[Path]:
    """``--json`` and ``--plot`` with every preset; ``--save``: ``model-<preset>.json`` and
    ``.png`` per preset in the GPU's results folder. Returns the paths written."""
    title = (f"{report.machine.gpu_name}: decode step of {report.config.get('layers')} layers (context "
             f"{report.config.get('context')}) and prefill, speedup over bf16 and fraction of the byte floor")
    return _write_per_preset(report, cfg, "model", write_model_plot, title, log)


def write_moe_outputs(report: MoeReport, cfg: MoeConfig, log: Log = print) -> list[Path]:
    """``--json`` and ``--plot`` with every preset; ``--save``: ``moe-<preset>.json`` and
    ``.png`` per preset in the GPU's results folder. Returns the paths written."""
    title = (f"{report.machine.gpu_name}: one MoE layer (CUDA graph), speedup over bf16 and fraction of "
             f"the byte floor")
    return _write_per_preset(report, cfg, "moe", write_moe_plot, title, log)


def write_generate_outputs(report: GenerateReport, cfg: GenerateConfig, log: Log = print) -> list[Path]:
    """``--json`` and ``--plot``; ``--save``: ``generate-<model>.json`` and ``.png`` in the GPU's
    results folder. Returns the paths written."""
    title = (f"{report.machine.gpu_name}: generate() (transformers {report.config.get('transformers_version')}), "
             f"prompt {report.config.get('prompt_tokens')}, {report.config.get('new_tokens')} new tokens")
    return _write_per_preset(report, cfg, "generate", write_generate_plot, title, log)


# ------------------------------------------------------------------------------------------
# Modes
# ------------------------------------------------------------------------------------------
def _merge_cli(args: argparse.Namespace, log: Log) -> int:
    """``mixgemm bench --merge A.json B.json ...``: one report from split runs (grid, --model or --moe)."""
    if not (args.json or args.plot or args.save):
        raise _user_error("--merge needs --json, --plot or --save")
    try:
        docs = [json.loads(Path(p).read_text(encoding="utf-8")) for p in args.merge]
        schemas = {d.get("schema") if isinstance(d, dict) else None for d in docs}
        kind = next((cls for cls in (ModelReport, MoeReport, GenerateReport) if schemas == {cls.SCHEMA}), None)
        if kind is not None:
            report = kind.merge([kind.from_dict(d) for d in docs])
        elif schemas == {JSON_SCHEMA}:
            report = merge_reports([report_from_dict(d) for d in docs])
        else:
            raise ValueError(f"expected reports of one kind ({JSON_SCHEMA}, {ModelReport.SCHEMA}, "
                             f"{MoeReport.SCHEMA} or {GenerateReport.SCHEMA}), got schemas {sorted(map(str, schemas))}")
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise _user_error(f"--merge: {e}") from None
    outputs = dict(json_path=args.json, plot_path=args.plot, save=args.save, results_root=args.results_dir)
    if isinstance(report, GenerateReport):
        log(format_generate_table(report))
        write_generate_outputs(report, GenerateConfig(**outputs), log=log)
        return 1 if failed(report.points) else 0
    if isinstance(report, MoeReport):
        log(format_moe_table(report.points, report.machine, report.config))
        write_moe_outputs(report, MoeConfig(**outputs), log=log)
        return 1 if failed(report.points) else 0
    if isinstance(report, ModelReport):
        log(format_model_table(report.points, report.machine, report.config))
        write_model_outputs(report, ModelConfig(**outputs), log=log)
        return 1 if failed(report.points) else 0
    cfg = BenchConfig(**outputs)
    log(format_table(report.results, report.machine, report.config))
    write_outputs(report, cfg, log=log)
    return 1 if any(r.status == FAIL for r in report.results) else 0


def list_kernels(args: argparse.Namespace) -> list[str]:
    """The names of the mixgemm kernels the run that ``args`` describe would launch."""

    if getattr(args, "moe", None):
        cfg = moe_config_from_args(args)
        specs = moe_kernel_specs(cfg, [MOE_PRESETS[p] for p in cfg.presets])
    elif args.model:
        cfg = model_config_from_args(args)
        specs = run_kernel_specs(cfg, [PRESETS[p] for p in cfg.presets])
    elif args.host:
        cfg = host_step_config(args)
        specs = host_kernel_specs() + run_kernel_specs(cfg, [PRESETS[p] for p in cfg.presets])
    elif args.block or getattr(args, "generate", None) is not None:
        raise BenchError("--list-kernels takes the grid, --model, --moe or --host (--generate builds its model's "
                         "kernels itself, with mixgemm.aot.prebuild.build_for)")
    else:
        cfg = config_from_args(args)
        impls = make_impls(cfg.impls, cfg.group_size, QuantCache())
        specs = [s for i in impls if hasattr(i, "kernel_specs") for s in i.kernel_specs(cfg.torch_dtype, cfg.ms)]
    return sorted({s.name for s in specs})


def _ceilings(device: torch.device, iters: int, warmup: int, log: Log, read: bool) -> tuple:
    log("measuring the device copy" + (" and read" if read else "") + " bandwidth and the dense bf16 matmul rate ...")
    copy_bw = measure_copy_bandwidth(device, iters=iters, warmup=warmup)
    read_bw = measure_read_bandwidth(device, iters=iters, warmup=warmup) if read else None
    dense = measure_dense_tflops(device, iters=iters, warmup=warmup)
    log(f"device copy {copy_bw:.0f} GB/s (read+write)" + (f", read {read_bw:.0f} GB/s" if read else "")
        + f", dense bf16 {dense:.0f} TFLOP/s")
    return copy_bw, read_bw, dense


def run_model_cli(args: argparse.Namespace, device: torch.device, log: Log) -> int:
    try:
        cfg = model_config_from_args(args)
    except BenchError as e:
        raise _user_error(str(e)) from None
    log(f"mixgemm bench --model {','.join(cfg.presets)} on {torch.cuda.get_device_name(device)}: {cfg.layers} layers, "
        f"decode batches {','.join(map(str, cfg.batches))} after {cfg.context} tokens"
        f"{f', prefill {cfg.prefill}' if cfg.prefill else ''}; {', '.join(v.name for v in cfg.variants)}; "
        f"{', '.join(cfg.modes)}; median of {cfg.iters} runs{' (QUICK)' if cfg.quick else ''}")
    copy_bw, read_bw, dense = _ceilings(device, cfg.iters, cfg.warmup, log, read=True)
    machine = machine_info(device, cfg.gpu_name, copy_bw, dense, read_bw)
    points = analyze_model(run_model(cfg, device, log), read_bw, cfg.max_error, cfg.group_size,
                           fp8_max_error=cfg.fp8_max_error)
    report = ModelReport(machine, cfg.to_json(), {n: dataclasses.asdict(PRESETS[n]) for n in cfg.presets}, points)
    log(format_model_table(points, machine, report.config))
    write_model_outputs(report, cfg, log=log)
    return _exit_status(points, lambda p: f"{p.preset} {p.variant} {p.mode}")


def run_moe_cli(args: argparse.Namespace, device: torch.device, log: Log) -> int:
    try:
        cfg = moe_config_from_args(args)
    except BenchError as e:
        raise _user_error(str(e)) from None
    log(f"mixgemm bench --moe {','.join(cfg.presets)} on {torch.cuda.get_device_name(device)}: tokens "
        f"{','.join(map(str, cfg.tokens))}, routing {','.join(cfg.routings)}; {', '.join(v.name for v in cfg.variants)}; "
        f"CUDA graphs, median of {cfg.iters} replays{' (QUICK)' if cfg.quick else ''}")
    copy_bw, read_bw, dense = _ceilings(device, cfg.iters, cfg.warmup, log, read=True)
    machine = machine_info(device, cfg.gpu_name, copy_bw, dense, read_bw)
    points = analyze_moe(run_moe(cfg, device, log), read_bw, cfg.max_error, cfg.group_size)
    report = MoeReport(machine, cfg.to_json(), {n: dataclasses.asdict(MOE_PRESETS[n]) for n in cfg.presets}, points)
    log(format_moe_table(points, machine, report.config))
    write_moe_outputs(report, cfg, log=log)
    return _exit_status(points, lambda p: f"{p.preset} {p.variant} {p.routing} T={p.tokens}",
                        lambda p: f"{p.preset} {p.variant}")


def run_host_cli(args: argparse.Namespace, device: torch.device, log: Log) -> int:
    try:
        step = host_step_config(args)
    except BenchError as e:
        raise _user_error(str(e)) from None
    log(f"mixgemm bench --host on {torch.cuda.get_device_name(device)}")
    copy_bw, read_bw, dense = _ceilings(device, step.iters, step.warmup, log, read=True)
    machine = machine_info(device, step.gpu_name, copy_bw, dense, read_bw)
    calls, step_points = run_host(device, step, step.iters, step.warmup, step.seed, read_bw, log)
    log(f"the ops chained {HOST_CHAIN} times at M = 1, in {', '.join(HOST_MODES)}:")
    calls += run_host_modes(device, HOST_MODES, step.iters, step.warmup, step.seed, log)
    config = {"shape": list(HOST_SHAPE), "ms": list(HOST_MS), "weight": "u4", "group_size": 128, "calls": HOST_CALLS,
              "repeats": HOST_REPEATS, "iters": step.iters, "quick": step.quick, "step": step.to_json(),
              "modes": list(HOST_MODES), "chain": HOST_CHAIN}
    report = HostReport(machine, config, calls, step_points)
    log(format_host_table(report))
    targets = [Path(args.json)] if args.json else []
    if args.save:
        targets.append(_save_folder(step, machine.gpu_name) / "host.json")
    for path in targets:
        write_host_json(path, report)
        log(f"wrote {path}")
    return _exit_status(step_points, lambda p: f"step {p.variant} {p.mode}")


def run_generate_cli(cfg: GenerateConfig, device: torch.device, log: Log) -> int:
    """``--generate`` with its validated options: run, report, write; the exit status."""
    log(f"mixgemm bench --generate {cfg.name} on {torch.cuda.get_device_name(device)}: "
        f"{cfg.layers or 'all'} layers, batch {','.join(map(str, cfg.batches))}, prompt {cfg.prompt_tokens}, "
        f"{cfg.new_tokens} new tokens; {', '.join(r.label for r in cfg.runs())}; {', '.join(cfg.modes)}; median of "
        f"{cfg.repeats} generate() calls{' (QUICK)' if cfg.quick else ''}")
    machine = machine_info(device, cfg.gpu_name, None, None)
    measurements, info = run_generate(cfg, device, log)
    points = analyze_generate(measurements)
    report = GenerateReport(machine, {**cfg.to_json(), **info}, {cfg.name: model_description(cfg)}, points)
    log(format_generate_table(report))
    write_generate_outputs(report, cfg, log=log)
    return _exit_status(points, lambda p: p.label)


def _exit_status(points: Sequence, name: Callable, failed_name: Optional[Callable] = None) -> int:
    """1 when a point FAILed, else 0; the errors (``name(point)``) and the failures
    (``failed_name(point)``, by default ``name``) said on stderr."""
    failed_name = failed_name or name
    bad = failed(points)
    errors = [p for p in points if p.status == "error"]
    if errors:
        print("mixgemm bench: errors (not measured): " + "; ".join(f"{name(p)}: {p.note}" for p in errors[:5]),
              file=sys.stderr)
    if bad:
        print(f"mixgemm bench: {len(bad)} point(s) FAILED (wrong or non-finite results): "
              + ", ".join(sorted({failed_name(p) for p in bad})), file=sys.stderr)
        return 1
    return 0


def run_cli(args: argparse.Namespace) -> int:
    """Run ``mixgemm bench`` with parsed ``args``; the exit status.

    Returns 0 when every point that ran is correct, 1 when any point FAILed (a wrong or
    non-finite result). User errors (no GPU, bad options) raise ``mixgemm.errors.CliError``.
    """
    log = print
    if getattr(args, "list_kernels", False):
        try:
            for name in list_kernels(args):
                print(name)
        except BenchError as e:
            raise _user_error(str(e)) from None
        return 0
    if getattr(args, "merge", None):
        return _merge_cli(args, log)
    try:                                # the options first: a bad one is reported even without a GPU
        if getattr(args, "moe", None):
            moe_config_from_args(args)
        elif getattr(args, "generate", None) is not None:
            generate_cfg = generate_config_from_args(args)
        elif getattr(args, "model", None):
            model_config_from_args(args)
        elif getattr(args, "host", False):
            host_step_config(args)
            if args.plot:
                raise BenchError("--host draws no plot (its table and --json are the report)")
        else:
            config_from_args(args)
        device = require_cuda()
    except BenchError as e:
        raise _user_error(str(e)) from None
    torch.cuda.set_device(device)
    if getattr(args, "moe", None):
        return run_moe_cli(args, device, log)
    if getattr(args, "generate", None) is not None:
        return run_generate_cli(generate_cfg, device, log)
    if getattr(args, "model", None):
        return run_model_cli(args, device, log)
    if getattr(args, "host", False):
        return run_host_cli(args, device, log)
    cfg = config_from_args(args)
    if getattr(args, "block", False):
        return run_block_cli(cfg, device, log)
    return run_grid_cli(cfg, device, log)


def run_grid_cli(cfg: BenchConfig, device: torch.device, log: Log) -> int:
    props = torch.cuda.get_device_properties(device)
    log(f"mixgemm bench on {props.name}: {len(cfg.shapes)} shapes x {len(cfg.ms)} M x "
        f"{len(cfg.impls)} implementations, {cfg.dtype}, group {cfg.group_size}, "
        f"median of {cfg.iters} runs{' (QUICK)' if cfg.quick else ''}")
    copy_bw, read_bw, dense = _ceilings(device, cfg.iters, cfg.warmup, log, read=True)
    machine = machine_info(device, cfg.gpu_name, copy_bw, dense, read_bw)
    cache = QuantCache()
    impls = make_impls(cfg.impls, cfg.group_size, cache)
    measurements = run_benchmark(cfg, impls, device, log=log)
    cache.clear()
    results = analyze(measurements, copy_bw, cfg.max_error, cfg.group_size, cfg.peer_max_error, cfg.fp8_max_error,
                      cfg.dtype)
    report = BenchReport(machine=machine, config=cfg.to_json(), results=results)
    log(format_table(results, machine, report.config))
    write_outputs(report, cfg, log=log)
    failed_points = [r for r in results if r.status == FAIL]
    if failed_points:
        print(f"mixgemm bench: {len(failed_points)} point(s) FAILED (wrong or non-finite results): "
              + ", ".join(sorted({r.impl for r in failed_points})), file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mixgemm.bench [options]``: parse, run, return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    try:
        return run_cli(args)
    except CliError as e:   # BenchError is one
        print(f"mixgemm bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mixgemm bench: interrupted", file=sys.stderr)
        return 130


__all__ = ["NO_GPU_MESSAGE", "require_cuda", "write_outputs", "write_model_outputs", "write_moe_outputs",
           "write_generate_outputs", "list_kernels", "run_model_cli", "run_moe_cli", "run_host_cli", "run_generate_cli",
           "run_cli",
           "run_grid_cli", "main"]
