"""Run the whole GPU test suite on every GPU of a machine, resumably, within a deadline.

One pytest process per GPU (``CUDA_VISIBLE_DEVICES`` set to it), each holding the tests of its
shard (``--shard g/N`` of :mod:`pytest_shard`: the node ids hashed over the GPUs) and running
them on ``--workers`` pytest-xdist workers. Then, on a machine of two or more GPUs, the tests
marked ``multigpu`` in one process that sees them all (on one GPU they skip, and say so). Every finished test is appended to
``OUT/record.txt`` as it ends; at ``--deadline`` seconds the processes are interrupted, and a
later ``--resume`` runs only what has not passed or been skipped::

    python tools/gpu_suite.py --out /tmp/gpu-suite --deadline 540            # first call
    python tools/gpu_suite.py --out /tmp/gpu-suite --deadline 540 --resume   # the next ones

It prints one line per outcome and a last line with the counts, writes ``OUT/summary.json``,
and exits 0 only when every collected GPU test has run and none failed. Build the kernels
first (``mixgemm generate --build`` and ``tools/prebuild_gpu_suite.py``), or the first test
of each kernel waits for its compile.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(TOOLS))
from pytest_shard import read_record  # noqa: E402  (this folder's plugin, on the path just above)

MARK = "gpu and not multigpu"
MULTI_MARK = "gpu and multigpu"
GRACE_S = 60


def count_gpus() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return len(out.stdout.split()) if out.returncode == 0 else 0


def has_xdist() -> bool:
    return importlib.util.find_spec("xdist") is not None


def pytest_command(mark: str, record: Path, extra: list[str], shard: str | None = None, workers: int = 1,
                   resume: bool = False, paths: tuple[str, ...] = ("tests",)) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *paths, "-m", mark, "-p", "pytest_shard", "-p", "no:cacheprovider",
           "-q", "-rfE", "--record", str(record)]
    if shard:
        cmd += ["--shard", shard]
    if resume and record.exists():
        cmd += ["--skip-done", str(record)]
    if workers > 1:
        cmd += ["-n", str(workers)]
    return cmd + extra


def child_env(gpus: str | None, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TOOLS), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = str(threads)   # (the workers share the machine's cores)
    env["PYTHONUNBUFFERED"] = "1"
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def run_all(commands: list[tuple[list[str], dict, Path]], deadline: float) -> list[int]:
    """Start every command in its own session with its log; interrupt (SIGINT: pytest reports
    what ran) those still running at ``deadline`` (a time.monotonic() value), kill them GRACE_S later."""
    procs = []
    for cmd, env, log in commands:
        f = open(log, "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                       start_new_session=True), f))
    interrupted = False
    while any(p.poll() is None for p, _ in procs):
        now = time.monotonic()
        if not interrupted and now >= deadline:
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGINT)
            interrupted = True
        if interrupted and now >= deadline + GRACE_S:
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(1.0)
    for _, f in procs:
        f.close()
    return [p.returncode for p, _ in procs]


def collect_command(mark: str, paths: tuple[str, ...] = ("tests",)) -> list[str]:
    return [sys.executable, "-m", "pytest", *paths, "-m", mark, "--collect-only", "-q", "-p", "no:cacheprovider"]


def collected_ids(text: str) -> list[str]:
    """The node ids in ``pytest --collect-only -q`` output."""
    return [line.strip() for line in text.splitlines() if "::" in line and line.startswith("tests/")]


def summarize(record: Path, collected: list[str]) -> dict:
    outcomes = read_record(record) if record.exists() else {}
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for nodeid in collected:
        if nodeid in outcomes:
            counts[outcomes[nodeid]] = counts.get(outcomes[nodeid], 0) + 1
    not_run = [n for n in collected if n not in outcomes]
    bad = sorted(n for n in collected if outcomes.get(n) in ("failed", "error"))
    return {"collected": len(collected), **counts, "not_run": len(not_run), "failed_tests": bad,
            "not_run_tests": not_run}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for record.txt, the logs and summary.json")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all that nvidia-smi lists)")
    p.add_argument("--workers", type=int, default=4, help="pytest-xdist workers per GPU (default 4)")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which to interrupt the run")
    p.add_argument("--resume", action="store_true", help="run only what OUT/record.txt does not list as done")
    p.add_argument("--paths", nargs="+", default=["tests"], help="test files or folders (default: tests)")
    p.add_argument("pytest_args", nargs="*", help="more pytest options (after --)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.deadline is not None and args.deadline <= 0:
        p.error("--deadline must be positive")
    gpus = count_gpus() if args.gpus is None else args.gpus
    if gpus < 1:
        p.error("no GPU: nvidia-smi lists none (or --gpus is below 1)")
    workers = args.workers if has_xdist() else 1
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    record = out / "record.txt"
    if not args.resume and record.exists():
        record.unlink()
    t0 = time.monotonic()
    deadline = t0 + (args.deadline if args.deadline is not None else float("inf"))
    threads = max(1, (os.cpu_count() or 1) // (gpus * workers))
    all_env = child_env(None, threads)
    collect_log = open(out / "collected.txt", "w")
    paths = tuple(args.paths)
    collector = subprocess.Popen(collect_command("gpu", paths) + args.pytest_args, cwd=ROOT, env=all_env,
                                 stdout=collect_log, stderr=subprocess.DEVNULL)   # (on the CPU, beside the shards)
    commands = [(pytest_command(MARK, record, args.pytest_args, f"{g}/{gpus}", workers, args.resume, paths),
                 child_env(str(g), threads), out / f"shard-{g}.log") for g in range(gpus)]
    print(f"GPU suite: {gpus} GPU(s) x {workers} worker(s), {threads} CPU thread(s) each, logs in {out}", flush=True)
    rcs = run_all(commands, deadline)
    if time.monotonic() < deadline:   # (on one GPU they skip, and say why)
        rcs += run_all([(pytest_command(MULTI_MARK, record, args.pytest_args, None, 1, True, paths), all_env,
                         out / "multigpu.log")], deadline)
    collector.wait()
    collect_log.close()
    collected = collected_ids((out / "collected.txt").read_text())
    summary = summarize(record, collected)
    summary.update(gpus=gpus, workers=workers, seconds=round(time.monotonic() - t0, 1), exit_codes=rcs)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for nodeid in summary["failed_tests"]:
        print(f"FAILED {nodeid}")
    print(f"GPU suite: {summary['passed']} passed, {summary['failed']} failed, {summary['error']} errors, "
          f"{summary['skipped']} skipped, {summary['not_run']} not run, of {summary['collected']} "
          f"({gpus} GPU(s) x {workers} worker(s), {summary['seconds']} s)")
    ok = summary["not_run"] == 0 and summary["failed"] == 0 and summary["error"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
