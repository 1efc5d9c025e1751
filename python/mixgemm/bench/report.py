"""Reporting: where the numbers come from (:class:`MachineInfo`), the grid's report
(:class:`BenchReport`) as an aligned table and as JSON, the merge of runs that split a grid, and
the file helpers every mode's output uses (atomic writes, the per-GPU results folder).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from .._version import __version__
from ..dispatch.tuning import gpu_slug
from .grid import OK, UNAVAILABLE, PointResult

#: JSON schema tag of the grid's report.
JSON_SCHEMA = "mixgemm.bench/1"

#: A folder name for a GPU name: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``, the
#: same name the measured tuning tables use (mixgemm.dispatch.tuning).
slugify = gpu_slug


def results_dir(root: Path, gpu_name: str) -> Path:
    """``<root>/<gpu-name-slug>``: where ``--save`` writes its files (``bench.json``,
    ``model-<preset>.json``, ``host.json``, ...)."""
    return Path(root) / slugify(gpu_name)


def default_results_root() -> Path:
    """``benchmarks/results`` of the source checkout this module lives in, else of the current
    directory."""
    repo = Path(__file__).resolve().parents[3]
    if (repo / "benchmarks").is_dir():
        return repo / "benchmarks" / "results"
    return Path.cwd() / "benchmarks" / "results"


@dataclasses.dataclass(frozen=True)
class MachineInfo:
    """Where the numbers come from."""

    gpu_name: str
    device_name: str
    compute_capability: str
    sm_count: int
    l2_cache_bytes: int
    memory_bytes: int
    torch_version: str
    cuda_version: Optional[str]
    triton_version: Optional[str]
    gemlite_version: Optional[str]
    mixgemm_version: str
    python_version: str
    copy_bw_gbps: Optional[float]
    dense_bf16_tflops: Optional[float]
    timestamp: str
    #: measured by the runs that need it (--model, --host); absent from older reports
    read_bw_gbps: Optional[float] = None


def _module_version(name: str) -> Optional[str]:
    try:
        module = __import__(name)
    except Exception:
        return None
    return str(getattr(module, "__version__", "unknown"))


def machine_info(device: torch.device, gpu_name: Optional[str], copy_bw_gbps: Optional[float],
                 dense_tflops: Optional[float], read_bw_gbps: Optional[float] = None) -> MachineInfo:
    """Describe the GPU and the software stack (``gpu_name`` overrides the reported name)."""
    props = torch.cuda.get_device_properties(device)
    return MachineInfo(
        gpu_name=gpu_name or props.name, device_name=props.name,
        compute_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
        l2_cache_bytes=int(getattr(props, "L2_cache_size", 0)), memory_bytes=int(props.total_memory),
        torch_version=torch.__version__, cuda_version=torch.version.cuda,
        triton_version=_module_version("triton"), gemlite_version=_module_version("gemlite"),
        mixgemm_version=__version__, python_version=platform.python_version(),
        copy_bw_gbps=copy_bw_gbps, dense_bf16_tflops=dense_tflops, read_bw_gbps=read_bw_gbps,
        timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


@dataclasses.dataclass(frozen=True)
class BenchReport:
    """A whole run: where, how, and every point."""

    machine: MachineInfo
    config: dict
    results: list


def report_to_dict(report: BenchReport) -> dict:
    """The JSON document of a report (only standard JSON values: no NaN)."""
    return {"schema": JSON_SCHEMA, "machine": dataclasses.asdict(report.machine),
            "config": dict(report.config),
            "points": [dataclasses.asdict(r) for r in report.results]}


def report_from_dict(data: Mapping[str, Any]) -> BenchReport:
    """Inverse of :func:`report_to_dict`."""
    if data.get("schema") != JSON_SCHEMA:
        raise ValueError(f"not a {JSON_SCHEMA} document (schema {data.get('schema')!r})")
    return BenchReport(machine=MachineInfo(**data["machine"]), config=dict(data["config"]),
                       results=[PointResult(**p) for p in data["points"]])


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_json(path: Path, report: BenchReport) -> Path:
    """Write the report as JSON (creating the folder, atomically); returns the path."""
    return write_json_doc(path, report_to_dict(report))


def write_json_doc(path: Path, doc: Mapping[str, Any]) -> Path:
    """Write a JSON document (standard JSON only: no NaN) atomically; returns the path."""
    return atomic_write_text(path, json.dumps(doc, indent=1, allow_nan=False))


def read_json(path: Path) -> BenchReport:
    """Read a report written by :func:`write_json`."""
    return report_from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def merge_reports(reports: Sequence[BenchReport]) -> BenchReport:
    """One report from runs that split a grid across processes (``--m`` or ``--shapes`` parts,
    to fit a per-process time limit) on the same GPU, dtype and group size.

    Each point keeps what its own run measured (its speedups are against the cuBLAS and peers
    of that run); the config lists the union of shapes, M and implementations, and
    ``config["runs"]`` each run's timestamp, copy bandwidth, dense rate and grid. The machine
    entry is the first run's.

    Raises
    ------
    ValueError
        No reports; runs on different GPUs, dtypes or group sizes; a point measured twice.
    """
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0]
    for r in reports[1:]:
        if r.machine.gpu_name != first.machine.gpu_name:
            raise ValueError(f"runs on different GPUs: {first.machine.gpu_name!r} and {r.machine.gpu_name!r}")
        for key in ("dtype", "group_size"):
            if r.config.get(key) != first.config.get(key):
                raise ValueError(f"runs with different {key}: {first.config.get(key)!r} and {r.config.get(key)!r}")
    seen: set[tuple[str, int, int, int]] = set()
    results: list = []
    for r in reports:
        for p in r.results:
            key = (p.impl, p.n, p.k, p.m)
            if key in seen:
                raise ValueError(f"{p.impl} at N={p.n} K={p.k} M={p.m} is in more than one run")
            seen.add(key)
            results.append(p)

    def union(key: str) -> list:
        out: list = []
        for r in reports:
            for v in r.config.get(key, []):
                if v not in out:
                    out.append(v)
        return out

    config = dict(first.config)
    config.update(shapes=union("shapes"), ms=sorted(union("ms")), impls=union("impls"),
                  runs=[{"timestamp": r.machine.timestamp, "copy_bw_gbps": r.machine.copy_bw_gbps,
                         "dense_bf16_tflops": r.machine.dense_bf16_tflops,
                         "ms": list(r.config.get("ms", [])), "impls": list(r.config.get("impls", []))}
                        for r in reports])
    return BenchReport(machine=first.machine, config=config, results=results)


def machine_line(machine: MachineInfo) -> str:
    """The measured ceilings of a run, as one line."""
    read = "" if machine.read_bw_gbps is None else f", read {fmt(machine.read_bw_gbps, '.0f', ' GB/s')}"
    return (f"measured: device copy {fmt(machine.copy_bw_gbps, '.0f', ' GB/s')} (read+write){read}, "
            f"dense bf16 {fmt(machine.dense_bf16_tflops, '.0f', ' TFLOP/s')}")


def gpu_line(machine: MachineInfo) -> str:
    """The GPU and the software stack, as one line."""
    return (f"GPU: {machine.gpu_name} (sm_{machine.compute_capability.replace('.', '')}, "
            f"{machine.sm_count} SMs, L2 {machine.l2_cache_bytes / 2**20:.0f} MiB)  "
            f"torch {machine.torch_version} CUDA {machine.cuda_version} "
            f"triton {machine.triton_version} gemlite {machine.gemlite_version}")


def fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix``; ``-`` for None."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def align(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """Rows of cells as lines of aligned columns (right-aligned where ``right`` says so)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if r else cell.ljust(w)
                      for cell, w, r in zip(row, widths, right)).rstrip() for row in rows]


TABLE_HEADER = ("M", "impl", "time us", "GB/s", "%copyBW", "TFLOP/s", "x cuBLAS", "x peer",
                "best peer", "err(own)", "err(float)", "status")


def format_table(results: Sequence[PointResult], machine: Optional[MachineInfo] = None,
                 config: Optional[Mapping[str, Any]] = None) -> str:
    """The report as plain aligned text: one block per (N, K), rows by M then implementation.

    Unavailable and failed implementations appear as rows with ``-`` numbers; the reasons
    are listed once under each block.
    """
    lines: list[str] = []
    if machine is not None:
        lines.append(gpu_line(machine))
        lines.append(machine_line(machine))
    if config:
        quick = "  QUICK RUN (fewer iterations: not a measurement)" if config.get("quick") else ""
        lines.append(f"dtype {config.get('dtype')}, group size {config.get('group_size')}, "
                     f"median of {config.get('iters')} runs (L2 flushed before each){quick}")
    order: dict[str, int] = {}
    for r in results:
        order.setdefault(r.impl, len(order))
    shapes: dict[tuple[int, int], list[PointResult]] = {}
    for r in results:
        shapes.setdefault((r.n, r.k), []).append(r)
    for (n, k), rs in shapes.items():
        lines.append("")
        lines.append(f"N={n} K={k}")
        rows = [list(TABLE_HEADER)]
        notes: dict[str, str] = {}
        for r in sorted(rs, key=lambda r: (r.m, order[r.impl])):
            rows.append([
                str(r.m), r.impl, fmt(r.time_us, ".1f"), fmt(r.gbps, ".0f"),
                fmt(None if r.frac_copy_bw is None else 100 * r.frac_copy_bw, ".0f", "%"),
                fmt(r.tflops, ".1f"), fmt(r.speedup_vs_cublas, ".2f", "x"),
                fmt(r.speedup_vs_best_peer, ".2f", "x"), r.best_peer or "-",
                fmt(r.err_impl, ".1e"), fmt(r.err_float, ".1e"), r.status])
            if r.status != OK and r.note:
                key = r.impl if r.status == UNAVAILABLE else f"{r.impl} M={r.m}"
                notes.setdefault(key, f"{r.status}: {r.note}")
        right = [True, False, True, True, True, True, True, True, False, True, True, False]
        lines.extend(align(rows, right))
        for key, note in notes.items():
            lines.append(f"  {key}: {note}")
    return "\n".join(lines)


#: The old private name (experiment scripts used it).
_atomic_write_text = atomic_write_text

__all__ = ["JSON_SCHEMA", "MachineInfo", "machine_info", "BenchReport", "report_to_dict", "report_from_dict",
           "atomic_write_text", "write_json_doc", "write_json", "read_json", "merge_reports", "machine_line",
           "gpu_line", "fmt", "align",
           "TABLE_HEADER", "format_table", "slugify", "results_dir", "default_results_root"]
