#!/usr/bin/env python3
"""Time from an empty kernel cache to the first generated token of the tiny test model (issue
#18 part 2), in four cases, each with its own MIXGEMM_CACHE_DIR under --work:

  a  no prebuild: the kernels compile on first use, one at a time, inside generate();
  b  `mixgemm generate --build --for MODEL` first (timed apart), then the model runs;
  c  `mixgemm cache export` of b's cache, `mixgemm cache import` into a new empty cache (both
     timed; the import takes the cubins and compiles the host libraries here), then the model runs;
  d  as c, with `cache import --trust-host-code` (the archive's host libraries taken as they are).

The model is the tiny LLaMA checkpoint of tests/hf_checkpoints.py (2 layers, hidden 256; AWQ by
default), written once into --work. Each run of the model is a fresh Python process (nothing
warm is shared): it loads the model with mixgemm.hf.from_pretrained and calls generate() on a
prompt of --prompt-len tokens for --new-tokens tokens; a streamer timestamps each token as it
arrives. The compile time of each kernel is read from its cache entry's meta.json
(build_seconds), for the kernels compiled on first use (a) and by the prebuild (b).

Each case can be run alone (--cases a), as the GPU machine allows 10 minutes per command; the
results are merged into the JSON file given (--json), and the table printed covers every case
that file holds. Cases c and d need b's cache (run b before them with the same --work).

--dry-run runs everything on the CPU with the fake nvcc of tests/fake_nvcc.py: the model is
loaded on the CPU and, instead of generate(), the kernels the prompt and the decode steps select
are built one at a time as first use would build them. The times mean nothing; it checks the
script end to end.

Usage (repo root, PYTHONPATH holding mixgemm's python/ and nvidia-cutlass):
  python tools/first_token.py --work /tmp/ft --json ft.json --jobs 16 --cases a
  python tools/first_token.py --work /tmp/ft --json ft.json --jobs 16 --cases bcd
  python tools/first_token.py --work /tmp/ftdry --json dry.json --cases abcd --dry-run
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_KINDS = ("awq", "gptq-v1-sym", "ct-sym", "mixgemm")


def _env(cache: Path, args) -> dict:
    env = dict(os.environ)
    env["MIXGEMM_CACHE_DIR"] = str(cache)
    paths = [str(ROOT / "python"), str(ROOT / "tests")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if args.dry_run:
        env["CUDA_HOME"] = str(args.work / "fake-cuda")
    return env


def _fake_nvcc(work: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_nvcc import FAKE_NVCC

    nvcc = work / "fake-cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)


def _timed(cmd: list, env: dict, what: str) -> float:
    print(f"--- {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"first_token: {what} failed with exit status {proc.returncode}")
    return seconds


def _run_model(cache: Path, args, label: str) -> dict:
    out = args.work / f"run-{label}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(args.work / "model"), "--json", str(out),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    if args.dry_run:
        cmd.append("--dry-run")
    wall = _timed(cmd, _env(cache, args), f"case {label}: the model in a fresh process")
    result = json.loads(out.read_text())
    result["process_wall_s"] = round(wall, 2)
    return result


def _kernel_times(cache: Path) -> dict:
    """{entry name: build seconds} of the cache's kernels and host libraries (their meta.json)."""
    times = {}
    for kind in ("kernels", "host"):
        root = cache / kind
        if not root.is_dir():
            continue
        for entry in sorted(root.iterdir()):
            try:
                meta = json.loads((entry / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            times[meta["name"]] = meta.get("build_seconds")
    return times


def _fresh(cache: Path) -> Path:
    if cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True)
    return cache


def case_a(args) -> dict:
    cache = _fresh(args.work / "cache-a")
    run = _run_model(cache, args, "a")
    return {"what": "no prebuild: kernels compile on first use", "run": run, "kernels": _kernel_times(cache)}


def case_b(args) -> dict:
    cache = _fresh(args.work / "cache-b")
    cmd = [sys.executable, "-m", "mixgemm", "generate", "--build", "--for", str(args.work / "model"),
           "--jobs", str(args.jobs)]
    build_s = _timed(cmd, _env(cache, args), "case b: generate --build --for")
    run = _run_model(cache, args, "b")
    return {"what": "mixgemm generate --build --for, then the model", "build_s": round(build_s, 2), "run": run,
            "kernels": _kernel_times(cache)}


def case_c(args, key: str = "c", trust: bool = False) -> dict:
    source = args.work / "cache-b"
    if not (source / "kernels").is_dir():
        raise SystemExit(f"first_token: case {key} imports case b's cache, and {source} has none: run case b first "
                         f"with the same --work")
    archive = args.work / "kernels.tgz"
    export_s = _timed([sys.executable, "-m", "mixgemm", "cache", "export", str(archive), "--force"],
                      _env(source, args), f"case {key}: cache export (from b's cache)")
    cache = _fresh(args.work / f"cache-{key}")
    flags = ["--trust-host-code"] if trust else ["--jobs", str(args.jobs)]
    import_s = _timed([sys.executable, "-m", "mixgemm", "cache", "import", str(archive), *flags], _env(cache, args),
                      f"case {key}: cache import {' '.join(flags)} (into an empty cache)")
    run = _run_model(cache, args, key)
    what = ("cache export from b, import --trust-host-code, then the model" if trust else
            "cache export from b, import (host code compiled here), then the model")
    return {"what": what, "export_s": round(export_s, 2), "import_s": round(import_s, 2),
            "archive_bytes": archive.stat().st_size, "run": run, "entries": len(_kernel_times(cache))}


def case_d(args) -> dict:
    return case_c(args, "d", trust=True)


CASES = {"a": case_a, "b": case_b, "c": case_c, "d": case_d}


def table(results: dict) -> str:
    lines = []
    meta = results.get("setup", {})
    lines.append(f"model: {meta.get('model')}  prompt {meta.get('prompt_len')} tokens, {meta.get('new_tokens')} new; "
                 f"device: {meta.get('device')}{'  (DRY RUN: times mean nothing)' if meta.get('dry_run') else ''}")
    lines.append(f"{'case':<44s} {'prepare s':>10s} {'load s':>8s} {'1st token s':>12s} {'tokens s':>9s} "
                 f"{'process s':>10s}")
    for key in "abcd":
        c = results.get("cases", {}).get(key)
        if c is None:
            continue
        run = c["run"]
        prepare = c.get("build_s", (c.get("export_s", 0) + c.get("import_s", 0)) if "import_s" in c else None)
        prep = f"{prepare:10.1f}" if prepare is not None else f"{'-':>10s}"
        lines.append(f"{key}: {c['what'][:41]:<41s} {prep} {run['load_s']:8.2f} {run['first_token_s']:12.2f} "
                     f"{run['all_tokens_s']:9.2f} {run['process_wall_s']:10.1f}")
        if key in "cd":
            lines.append(f"   (export {c['export_s']:.1f} s, import {c['import_s']:.1f} s, archive "
                         f"{c['archive_bytes'] / 1e6:.1f} MB, {c['entries']} entries)")
    for key, what in (("a", "compiled on first use (case a)"), ("b", "built by generate --build --for (case b)")):
        c = results.get("cases", {}).get(key)
        if c is None:
            continue
        lines.append(f"compile seconds per kernel, {what}:")
        for name, seconds in sorted(c["kernels"].items(), key=lambda kv: -(kv[1] or 0)):
            lines.append(f"  {seconds if seconds is not None else '?':>7}  {name}")
        total = sum(s or 0 for s in c["kernels"].values())
        lines.append(f"  {total:7.1f}  total ({len(c['kernels'])} entries)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the child process

def child(args) -> None:
    t_start = time.perf_counter()
    import torch

    from mixgemm import hf
    t_import = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    model = hf.from_pretrained(args.child, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    t_load = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_len), generator=gen).to(device)
    stamps = []
    if args.dry_run:
        _dry_generate(model, args.prompt_len, args.new_tokens, stamps)
    else:
        from transformers.generation.streamers import BaseStreamer

        class Stamps(BaseStreamer):
            """The time each new token arrives (the first put() is the prompt)."""

            def __init__(self):
                self.calls = 0

            def put(self, value):
                value.cpu()                      # waits for the token
                if self.calls:
                    stamps.append(time.perf_counter())
                self.calls += 1

            def end(self):
                pass

        with torch.no_grad():
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           streamer=Stamps(), pad_token_id=0)
    t_end = time.perf_counter()
    result = {
        "import_s": round(t_import - t_start, 3),
        "load_s": round(t_load - t_import, 3),
        "first_token_s": round(stamps[0] - t_load, 3),
        "all_tokens_s": round(t_end - t_load, 3),
        "tokens": len(stamps),
        "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
    }
    Path(args.json).write_text(json.dumps(result, indent=1))


def _dry_generate(model, prompt_len: int, new_tokens: int, stamps: list) -> None:
    """What generate() would compile on first use, built one kernel at a time (the prompt's token
    count, then one token per step), with the compiled launcher first."""
    from mixgemm.jit import build, launcher
    from mixgemm.aot import prebuild
    from mixgemm.ops.dense import select_spec
    from mixgemm.jit.specs import Activation

    launcher.build_compiled()
    uses = set(prebuild.uses_of(model))
    for m in [prompt_len] + [1] * (new_tokens - 1):
        for use in sorted(uses, key=lambda u: (u.n, u.k, u.activation.value)):
            act = use.kernel_activation
            build.build(select_spec(m, use.meta_weight(), None if act is Activation.NONE else act.value))
        stamps.append(time.perf_counter())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/mixgemm-first-token"),
                   help="the model, the caches and the archive go here")
    p.add_argument("--json", required=True, help="results JSON (merged with what it already holds)")
    p.add_argument("--cases", default="abcd", help="which of a, b, c, d to run (default abcd)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc builds for case b")
    p.add_argument("--model", choices=MODEL_KINDS, default="awq", help="the tiny checkpoint's format")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (the first token's GEMM M)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated (decode steps: M = 1)")
    p.add_argument("--dry-run", action="store_true", help="on the CPU with the fake nvcc (times mean nothing)")
    p.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prompt_len < 1 or args.new_tokens < 1 or args.jobs < 1:
        p.error("--prompt-len, --new-tokens and --jobs must be positive")
    if args.child:
        child(args)
        return 0
    if not args.cases or set(args.cases) - set(CASES):
        p.error("--cases takes letters among a, b, c")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        _fake_nvcc(args.work)
    model_dir = args.work / "model"
    marker = args.work / "model.kind"
    if not (model_dir / "config.json").is_file() or not marker.is_file() or marker.read_text() != args.model:
        sys.path.insert(0, str(ROOT / "tests"))
        sys.path.insert(0, str(ROOT / "python"))
        import hf_checkpoints as hc

        if model_dir.exists():
            shutil.rmtree(model_dir)
        hc.WRITERS[args.model](model_dir)
        marker.write_text(args.model)
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.is_file() else {}
    setup = {"model": f"tiny llama ({args.model}, tests/hf_checkpoints.py)", "prompt_len": args.prompt_len,
             "new_tokens": args.new_tokens, "jobs": args.jobs, "dry_run": args.dry_run}
    if results.get("setup") and {k: v for k, v in results["setup"].items() if k != "device"} != setup:
        print(f"first_token: {path} holds results of another setup; starting it afresh", file=sys.stderr)
        results = {}
    results["setup"] = setup
    results.setdefault("cases", {})
    for key in sorted(set(args.cases)):
        results["cases"][key] = CASES[key](args)
        results["setup"]["device"] = results["cases"][key]["run"]["device"]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, path)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
