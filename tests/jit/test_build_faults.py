"""The kernel cache under faults, with the real nvcc and the fastest-compiling kernels (a
dequant kernel: about a second; a decode kernel where a host helper is needed: 5-20 s).

nvcc is wrapped by a script (found first through ``CUDA_HOME``) that logs every compilation
(every call with ``-o``) and can pause before running the real nvcc; the wrapper prints the
real nvcc's version, so the cache keys are the real ones.

* 4 processes loading the same missing kernel at once: one nvcc build, four working loads;
* a truncated cubin, or a truncated host helper, in the cache: detected and rebuilt;
* a build killed with SIGKILL: its lock is released by the kernel, its temporary directory is
  removed by the next build, which succeeds.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixgemm.dtypes import ActType, WeightType
from mixgemm.jit import catalog
from mixgemm.jit import build, env as paths
from mixgemm.jit.specs import DecodeSpec, DequantSpec, GemmSpec

pytestmark = pytest.mark.nvcc

ROOT = Path(__file__).resolve().parents[2]
DEQ = DequantSpec(ActType.BF16, WeightType.U4)
DEQ_CALL = "load_artifacts(mixgemm_dequant_bf16_u4)"


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """A private cache and a counting nvcc wrapper; returns (cache dir, log file)."""
    real = paths.find_nvcc()
    if real is None:
        pytest.skip("nvcc not found")
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    wrapper = home / "bin" / "nvcc"
    wrapper.write_text(f"""#!/bin/sh
case " $* " in
  *" -o "*)
    echo "$$ $*" >> "$NVCC_CALLS"
    if [ -n "$NVCC_STARTED" ]; then : > "$NVCC_STARTED"; fi
    if [ -n "$NVCC_PAUSE" ]; then sleep "$NVCC_PAUSE"; fi ;;
esac
exec '{real}' "$@"
""")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    cache, calls = tmp_path / "cache", tmp_path / "calls.log"
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(cache))
    monkeypatch.setenv("NVCC_CALLS", str(calls))
    for var in ("NVCC_PAUSE", "NVCC_STARTED") + build.KEY_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return cache, calls


def compilations(calls: Path) -> list[str]:
    """The artifact each logged nvcc call produced (kernel.cubin / helper.so)."""
    if not calls.exists():
        return []
    return [Path(line.split(" -o ")[1].split()[0]).name for line in calls.read_text().splitlines()]


def child_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


LOADER = r"""
import hashlib, json, os, sys, time
from pathlib import Path
from mixgemm import build, specs
spec = specs.parse_name(sys.argv[1])
Path(sys.argv[2]).write_text("ready")
while not Path(sys.argv[3]).exists():      # start together
    time.sleep(0.01)
art, cubin = build.load_artifacts(spec)
print(json.dumps({"sha256": hashlib.sha256(cubin).hexdigest(), "head": cubin[:4].hex(),
                  "dir": str(art.directory)}))
"""


def test_four_processes_build_once(counted, tmp_path, pin_case):
    cache, calls = counted
    go = tmp_path / "go"
    env = child_env(NVCC_PAUSE="2")       # widen the window in which the others wait
    procs = []
    for i in range(4):
        ready = tmp_path / f"ready{i}"
        procs.append((ready, subprocess.Popen([sys.executable, "-c", LOADER, DEQ.name, str(ready), str(go)],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env=env, cwd=tmp_path)))
    deadline = time.monotonic() + 180
    while not all(r.exists() for r, _ in procs):
        assert time.monotonic() < deadline and all(p.poll() is None for _, p in procs), "a loader died"
        time.sleep(0.05)
    go.write_text("go")
    results = []
    for _, p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert compilations(calls) == ["kernel.cubin"], "exactly one nvcc build"
    assert len({r["sha256"] for r in results}) == 1 and results[0]["head"] == b"\x7fELF".hex()
    assert len({r["dir"] for r in results}) == 1
    assert [p.name for p in (cache / "kernels").iterdir()] == [Path(results[0]["dir"]).name]
    assert list((cache / "tmp").iterdir()) == []
    pin_case("Kernel cache", "4 processes load the same missing kernel at once", f"4 x {DEQ_CALL}",
             "1 nvcc build; 4 loads of the same cubin", "(no error)")


def build_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mixgemm" and "building kernel" in r.getMessage()]


@pytest.mark.parametrize("artifact", ["kernel.cubin", "helper.so"])
def test_a_truncated_artifact_is_rebuilt(counted, artifact, pin_case, caplog):
    cache, calls = counted
    # the fastest kernel with that artifact: dequant kernels have no host helper
    spec = DEQ if artifact == "kernel.cubin" else DecodeSpec(ActType.BF16, WeightType.U4, tokens=8)
    art = build.build(spec)
    built = compilations(calls)
    path = art.directory / artifact
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert not build.is_cached(spec), "the truncation is detected"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mixgemm"):
        art2, cubin = build.load_artifacts(spec)
    (line,) = build_logs(caplog)
    assert line == (f"mixgemm: building kernel {spec.name} (its cache entry {art.directory} is incomplete or "
                    f"corrupt: its files do not match meta.json); this takes a few seconds")
    assert art2.directory == art.directory
    assert sorted(compilations(calls)) == sorted(built * 2), "the whole entry is built again, once"
    meta = json.loads((art2.directory / "meta.json").read_text())
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["sha256"][artifact]
    assert len(path.read_bytes()) > len(data) // 2
    assert cubin[:4] == b"\x7fELF" and build.is_cached(spec)
    if artifact == "helper.so":
        from mixgemm.jit import driver
        helper = driver.HostHelper(str(art2.helper_path), spec.name)     # loads without a GPU
        assert helper.params_size > 0
    assert list((cache / "tmp").iterdir()) == []
    pin_case("Kernel cache", f"a truncated cached {artifact}", f"load_artifacts({spec.name})",
             "rebuilt (sha256 against meta.json), then loads", "log: " + line.replace(str(cache), "<cache>"))


KILLED_BUILDER = r"""
import sys
from mixgemm import build, specs
build.build(specs.parse_name(sys.argv[1]))
"""


def test_a_build_killed_with_sigkill_recovers(counted, tmp_path, pin_case, caplog):
    cache, calls = counted
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_BUILDER, DEQ.name], env=child_env(
        NVCC_PAUSE="60", NVCC_STARTED=str(started)), cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while not started.exists():            # nvcc is running, inside the entry's lock
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)    # the builder and its nvcc
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    (leftover,) = (cache / "tmp").iterdir()
    owner = json.loads((leftover / "owner.json").read_text())
    assert owner["pid"] == proc.pid and leftover.name.startswith(DEQ.name + "-")
    assert list((cache / "locks").iterdir()), "the lock file stays (flock released by the kernel)"
    assert not (cache / "kernels").exists() or not any((cache / "kernels").iterdir()), "no entry"
    assert build.stale_temporaries() == [leftover]
    # the next build: not blocked by the lock, removes the leftover, builds and loads
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mixgemm"):
        art, cubin = build.load_artifacts(DEQ)
    assert time.monotonic() - t0 < 120
    (line,) = build_logs(caplog)
    assert line == (f"mixgemm: building kernel {DEQ.name} (first use, not in the cache {cache}); this takes "
                    f"a few seconds")
    assert cubin[:4] == b"\x7fELF" and build.is_cached(DEQ)
    assert list((cache / "tmp").iterdir()) == [] and build.stale_temporaries() == []
    assert compilations(calls) == ["kernel.cubin", "kernel.cubin"]
    pin_case("Kernel cache", "a build killed with SIGKILL (builder and nvcc)", f"then {DEQ_CALL}",
             "the next build succeeds", "log: " + line.replace(str(cache), "<cache>"),
             "tmp/<kernel>-<random>/ with owner.json and a lock file; the next build removes the directory, "
             "the lock is harmless")


def test_a_live_builders_temporary_is_kept(counted, tmp_path):
    """The clean-up removes only what a dead process left: a build in progress elsewhere (a
    live pid on this host, or another host) keeps its directory; one without an owner only
    when it is an hour old."""
    import socket
    cache, _ = counted
    tmp_root = cache / "tmp"
    tmp_root.mkdir(parents=True)
    now = time.time()

    def make(name, owner):
        d = tmp_root / name
        d.mkdir()
        if owner is not None:
            (d / "owner.json").write_text(json.dumps(owner))
        return d

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    live = make("live", {"host": host, "pid": os.getppid(), "started": now})
    remote = make("remote", {"host": host + "-elsewhere", "pid": dead.pid, "started": now})
    gone = make("gone", {"host": host, "pid": dead.pid, "started": now})
    fresh = make("fresh", None)
    old = make("old", None)
    os.utime(old, (now - 7200, now - 7200))
    ancient = make("ancient", {"host": host + "-elsewhere", "pid": 1, "started": now - 3 * 86400})
    assert sorted(build.stale_temporaries()) == sorted([gone, old, ancient])
    build.build(DEQ)
    assert sorted(p.name for p in tmp_root.iterdir()) == sorted([live.name, remote.name, fresh.name])


def test_the_first_use_line_says_how_long_each_kind_of_kernel_takes():
    """A GEMM kernel (CUTLASS's sm90 collective) takes about a minute to build, a decode or dequant
    kernel seconds: the first-use log line says which (README's first-token table)."""
    gemm = next(s for s in catalog.default_specs() if isinstance(s, GemmSpec))
    dec = next(s for s in catalog.default_specs() if isinstance(s, DecodeSpec))
    assert build.build_time_hint(gemm) == "this takes about a minute"
    assert build.build_time_hint(dec) == build.build_time_hint(DEQ) == "this takes a few seconds"
