"""`mixgemm doctor`: each check on this (CPU) machine and on faked ones, the report, the exit
status; on a GPU, the tiny kernel."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixgemm.cli import doctor
from mixgemm.jit import env as paths
from mixgemm.cli.main import main
from mixgemm.cli.doctor import Finding, Status

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def fake_nvcc(tmp_path, release="13.0", build_no="88"):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.{build_no}'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return home


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(d))
    return d


def fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H100 80GB HBM3"):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)


# ----------------------------------------------------------------------------- this machine

def test_this_cpu_machine(capsys, cache):
    """No GPU here: the GPU check fails (and says why), the tiny kernel is not run, the exit
    status is 1; the package, headers, CUTLASS, cuda-bindings and cache checks pass."""
    report = doctor.diagnose()
    assert not report.gemm_ok
    gpu = report.get("GPU")
    assert gpu.status is Status.FAIL and gpu.fix
    if torch.version.cuda is None:
        assert re.fullmatch(r"none usable: torch \S+ is a CPU-only build", gpu.detail)
        assert "install a CUDA build of torch" in gpu.fix
    assert report.get("kernel run").status is Status.SKIP
    for name in ("mixgemm", "headers", "CUTLASS", "cuda-bindings", "kernel cache", "cache writable"):
        assert report.get(name).status is Status.OK, report.get(name)
    assert re.search(r"the includes of all \d+ kernels resolve", report.get("headers").detail)
    assert "does not exist yet (0 kernels)" in report.get("kernel cache").detail
    rc, out, err = run(capsys, "doctor")
    assert rc == 1 and err == ""
    assert re.search(r"^  FAIL  GPU +none usable|^  FAIL  GPU +no CUDA device", out, re.M)
    assert re.search(r"^ +-> ", out, re.M), "a failing check gives the next step"
    assert out.rstrip().splitlines()[-1].startswith("result: the GEMM path cannot work here (1 problem: GPU)")


def test_python_dash_m_doctor(tmp_path):
    """`python -m mixgemm doctor` as a user runs it (the report is on stdout, exit status 1)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), MIXGEMM_CACHE_DIR=str(tmp_path / "c"),
               CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "mixgemm", "doctor"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 1, res.stderr
    assert res.stdout.startswith("mixgemm doctor: can this machine run mixgemm's GPU kernels?")
    assert "FAIL  GPU" in res.stdout and res.stderr == ""


# ----------------------------------------------------------------------------- faked machines

def test_nvcc_missing(monkeypatch):
    monkeypatch.setattr(paths, "find_nvcc", lambda: None)
    f = doctor.check_nvcc()
    assert f.status is Status.FAIL and f.detail.startswith("not found")
    assert "install the CUDA toolkit >= 12.4" in f.fix and "CUDA_HOME" in f.fix


def test_nvcc_too_old(tmp_path, monkeypatch):
    home = fake_nvcc(tmp_path, release="12.2")
    monkeypatch.setenv("CUDA_HOME", str(home))
    f = doctor.check_nvcc()
    assert f.status is Status.FAIL
    assert f.detail == f"{home}/bin/nvcc: CUDA 12.2 (Cuda compilation tools, release 12.2, V12.2.88), older than 12.4"


def test_nvcc_new_enough(tmp_path, monkeypatch):
    home = fake_nvcc(tmp_path, release="12.4")
    monkeypatch.setenv("CUDA_HOME", str(home))
    f = doctor.check_nvcc()
    assert f.status is Status.OK and f.detail.endswith("CUDA 12.4 (Cuda compilation tools, release 12.4, V12.4.88), >= 12.4")


def test_nvcc_that_does_not_run(tmp_path, monkeypatch):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("not a program")
    (home / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(home))
    f = doctor.check_nvcc()
    assert f.status is Status.FAIL and "does not run" in f.detail


@pytest.mark.parametrize("capability,status", [((9, 0), Status.OK), ((8, 0), Status.FAIL), ((10, 0), Status.FAIL)])
def test_gpu_capability(monkeypatch, capability, status):
    fake_gpu(monkeypatch, capability)
    f = doctor.check_gpu()
    assert f.status is status
    assert f.detail.startswith(f"0: NVIDIA H100 80GB HBM3 (sm_{capability[0]}{capability[1]})")
    if status is Status.FAIL:
        assert f.detail.endswith("not sm_90") and "H100/H200" in f.fix


def test_no_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    f = doctor.check_gpu()
    assert f.status is Status.FAIL and "CUDA_VISIBLE_DEVICES=''" in f.detail and "nvidia-smi" in f.fix


def test_incomplete_headers(tmp_path, monkeypatch):
    """A header tree without collective/builder.hpp (the broken wheel of issue #15)."""
    root = tmp_path / "src"
    for d in ("cutlass_ext", "converters"):
        shutil.copytree(paths.source_root() / d, root / d)
    (root / "cutlass_ext" / "mixgemm" / "collective" / "builder.hpp").unlink()
    monkeypatch.setenv("MIXGEMM_SOURCE_DIR", str(root))
    paths.source_root.cache_clear()
    try:
        f = doctor.check_headers()
    finally:
        paths.source_root.cache_clear()
    assert f.status is Status.FAIL
    files = sum(1 for d in ("cutlass_ext", "converters") for p in (root / d).rglob("*") if p.is_file())
    assert files >= 14
    assert re.fullmatch(rf"\$MIXGEMM_SOURCE_DIR {re.escape(str(root))} \({files} files\) is incomplete: \d+ of \d+ kernels "
                        r"cannot be built \(the kernel source includes 'mixgemm/collective/builder\.hpp', which is "
                        r"not a mixgemm header\)", f.detail), f.detail
    assert f.fix.startswith("reinstall mixgemm")


def test_a_source_dir_without_headers_is_ignored_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXGEMM_SOURCE_DIR", str(tmp_path / "nothing"))
    paths.source_root.cache_clear()
    try:
        f = doctor.check_headers()
    finally:
        paths.source_root.cache_clear()
    assert f.status is Status.WARN and f.detail.endswith(f"$MIXGEMM_SOURCE_DIR={tmp_path / 'nothing'} is ignored")
    assert "unset it" in f.fix


def test_cache_with_kernels(cache):
    for i in range(2):
        entry = cache / "kernels" / f"mixgemm_dequant_bf16_u{i}-abc"
        entry.mkdir(parents=True)
        (entry / "meta.json").write_text("{}")
        (entry / "kernel.cubin").write_bytes(b"x" * 2048)
    (cache / "kernels" / "half-built").mkdir()          # no meta.json: not a kernel
    f = doctor.check_cache()
    assert f.status is Status.OK
    assert f.detail == f"{cache}: 2 kernels, 4.0 KiB"
    assert doctor.check_cache_writable() == Finding("cache writable", Status.OK, "yes")


def test_cache_that_cannot_be_written(tmp_path, monkeypatch):
    """Under a regular file (root ignores permission bits, so a file is the portable way)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(blocker / "cache"))
    f = doctor.check_cache_writable()
    assert f.status is Status.FAIL and f.detail == f"no: {blocker} is not a directory"
    assert "MIXGEMM_CACHE_DIR" in f.fix
    assert doctor.check_cache().status is Status.OK      # it does not exist: nothing to count


def test_cuda_bindings_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)    # makes the import fail
    f = doctor.check_cuda_bindings()
    assert f.status is Status.FAIL and f.fix == "pip install 'cuda-python>=13'"


# ----------------------------------------------------------------------------- the report

def ok(name):
    return lambda: Finding(name, Status.OK, "fine")


def test_kernel_runs_only_when_nothing_failed(monkeypatch):
    ran = []
    monkeypatch.setattr(doctor, "run_tiny_kernel", lambda stream=None: ran.append(1) or
                        Finding("kernel run", Status.OK, "mixgemm_decode_x: built in 9.0 s"))
    report = doctor.diagnose(checks=(ok("a"), ok("b")))
    assert ran == [1] and report.gemm_ok and report.get("kernel run").status is Status.OK
    assert report.format().splitlines()[-1] == "result: the GEMM path works on this machine"
    report = doctor.diagnose(checks=(ok("a"), lambda: Finding("nvcc", Status.FAIL, "not found", "install it")))
    assert ran == [1] and not report.gemm_ok
    assert report.get("kernel run") == Finding("kernel run", Status.SKIP, "not run: fix the FAIL above first")
    assert doctor.diagnose(run_kernel=False, checks=(ok("a"),)).get("kernel run").detail == "not run (--no-kernel)"


def test_a_warning_does_not_fail(monkeypatch):
    monkeypatch.setattr(doctor, "run_tiny_kernel", lambda stream=None: Finding("kernel run", Status.OK, "ran"))
    report = doctor.diagnose(checks=(lambda: Finding("CUTLASS", Status.WARN, "4.3", "use 4.2"),))
    assert report.gemm_ok
    assert "  warn  CUTLASS     4.3\n" in report.format() + "\n" and "-> use 4.2" in report.format()


def test_a_broken_check_is_a_finding():
    def check_boom():
        raise RuntimeError("boom\nsecond line")
    report = doctor.diagnose(checks=(check_boom,))
    f = report.get("boom")
    assert f.status is Status.FAIL and f.detail == "the check itself failed: RuntimeError: boom"
    assert "Traceback" in f.more
    assert "Traceback" in report.format(verbose=True) and "Traceback" not in report.format()


def test_cli_exit_status_follows_the_report(capsys, monkeypatch):
    monkeypatch.setattr(doctor, "diagnose", lambda run_kernel=True: doctor.Report((
        Finding("nvcc", Status.OK, "/usr/local/cuda/bin/nvcc: CUDA 12.8"),
        Finding("kernel run", Status.OK, "mixgemm_decode_x: loaded from the cache"))))
    rc, out, err = run(capsys, "doctor")
    assert rc == 0 and err == ""
    assert out.splitlines()[1:] == ["  ok    nvcc        /usr/local/cuda/bin/nvcc: CUDA 12.8",
                                    "  ok    kernel run  mixgemm_decode_x: loaded from the cache",
                                    "result: the GEMM path works on this machine"]


@pytest.mark.gpu
def test_tiny_kernel_on_the_gpu(requires_gpu, tmp_path, monkeypatch):
    """On an H100/H200: the doctor builds (fresh cache) then loads the tiny kernel, runs it and
    reports the times; the whole report passes."""
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    first = doctor.run_tiny_kernel()
    assert first.status is Status.OK, first
    assert re.match(r"mixgemm_decode_bf16_u4_m8\S*: built in \d+\.\d s \(now cached\); load \+ first run \d+ ms",
                    first.detail)
    second = doctor.run_tiny_kernel()
    assert second.status is Status.OK and ": loaded from the cache;" in second.detail
    report = doctor.diagnose()
    assert report.gemm_ok, report.format(verbose=True)
