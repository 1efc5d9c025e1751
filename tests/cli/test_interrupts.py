"""`mixgemm prepack` interrupted by real signals: SIGINT, SIGHUP and SIGTERM leave no output and no
temporary file;
SIGKILL leaves at most a temporary file with a recognisable name, which the next run removes.

The command runs in a child process through a small wrapper that makes it pause at a chosen
moment (in the middle of quantizing, or with the whole temporary file written but not yet
renamed) and says so by creating a file; the test then sends the signal. The pause stands in
for the minutes a multi-GB checkpoint takes, so that the signal lands exactly there every time.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mixgemm.cli.main import main
from mixgemm.weights.io import load
from mixgemm.weights.types import PackedWeight

ROOT = Path(__file__).resolve().parents[2]

WRAPPER = r'''
import signal, sys, time
from pathlib import Path
# as in a terminal: Python's SIGINT handler even when this test runs where SIGINT is ignored
# (a background job of a non-interactive shell inherits SIG_IGN, and Python keeps it)
signal.signal(signal.SIGINT, signal.default_int_handler)
stage, ready = sys.argv[1], Path(sys.argv[2])
if stage == "quantize":          # pause while quantizing the second weight
    import mixgemm.weights.quantize
    q = sys.modules["mixgemm.weights.quantize"]      # (mixgemm.quantize is also the function's name)
    real, calls = q.quantize, []
    def quantize(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            ready.write_text("quantizing")
            time.sleep(120)
        return real(*a, **k)
    q.quantize = quantize
else:                            # pause with the temporary file written, before the rename
    import safetensors.torch as st
    real = st.save_file
    def save_file(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        ready.write_text(filename)
        time.sleep(120)
    st.save_file = save_file
from mixgemm.cli.main import main
sys.exit(main(sys.argv[3:]))
'''


@pytest.fixture
def job(tmp_path):
    src = tmp_path / "in" / "model.safetensors"
    src.parent.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.proj.weight": (torch.randn(256, 512, generator=gen) * 0.02).to(torch.bfloat16)
               for i in range(4)}
    tensors["norm.weight"] = torch.ones(512, dtype=torch.bfloat16)
    safetensors.torch.save_file(tensors, str(src))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    return {"src": src, "out": out_dir / "model.int4.safetensors", "out_dir": out_dir, "wrapper": wrapper,
            "ready": tmp_path / "ready", "tmp": tmp_path}


def _default_signals() -> None:
    """The child's SIGHUP and SIGTERM at their defaults, whatever the test runner inherited (under
    nohup SIGHUP is ignored, and mixgemm leaves an ignored signal alone, as it should)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start(job, stage):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = ["prepack", str(job["src"]), "-o", str(job["out"]), "--bits", "4", "--group-size", "128"]
    proc = subprocess.Popen([sys.executable, str(job["wrapper"]), stage, str(job["ready"]), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=job["tmp"],
                            preexec_fn=_default_signals)
    deadline = time.monotonic() + 120
    while not job["ready"].exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the child did not reach '{stage}': {proc.communicate()[1]}")
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("stage", ["quantize", "save"])
def test_sigint_leaves_nothing(job, stage, pin_case):
    proc = start(job, stage)
    if stage == "save":
        temporary = Path(job["ready"].read_text())     # the file, in its private temporary directory
        assert temporary.is_file() and temporary.parent.parent == job["out_dir"]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.splitlines() == ["mixgemm prepack: interrupted"]
    assert os.listdir(job["out_dir"]) == []                  # no output, no temporary
    assert sorted(os.listdir(job["src"].parent)) == ["model.safetensors"]
    where = "while quantizing" if stage == "quantize" else "with the temporary file written, before the rename"
    pin_case("Interrupts", f"SIGINT {where}", "mixgemm prepack IN -o OUT --bits 4 --group-size 128",
             "exit 130", err.splitlines()[0])


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
@pytest.mark.parametrize("stage", ["quantize", "save"])
def test_sighup_and_sigterm_leave_nothing(job, stage, sig, pin_case):
    """A closed terminal (SIGHUP) or a plain kill (SIGTERM): the process ends by that signal, as
    without mixgemm's handler, and leaves neither an output nor a temporary."""
    proc = start(job, stage)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -sig, err
    assert os.listdir(job["out_dir"]) == []                  # no output, no temporary
    assert sorted(os.listdir(job["src"].parent)) == ["model.safetensors"]
    if stage == "save":
        name = signal.Signals(sig).name
        pin_case("Interrupts", f"{name} with the temporary file written, before the rename",
                 "mixgemm prepack IN -o OUT --bits 4 --group-size 128", f"killed by {name} ({-sig})",
                 "(nothing: killed)", "none (the temporary is removed first)")


def test_sigkill_leaves_a_named_temporary_that_the_next_run_removes(job, capsys, pin_case):
    proc = start(job, "save")
    temporary = Path(job["ready"].read_text()).parent
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # what a kill leaves: only the temporary directory, named after the output and the dead process
    assert os.listdir(job["out_dir"]) == [temporary.name] and temporary.is_dir()
    assert re.fullmatch(rf"\.model\.int4\.safetensors\.{proc.pid}\.[a-z0-9_]+\.tmp", temporary.name)
    # the next run cleans it up and writes the output
    rc = main(["prepack", str(job["src"]), "-o", str(job["out"]), "--bits", "4", "--group-size", "128"])
    assert rc == 0, capsys.readouterr().err
    assert os.listdir(job["out_dir"]) == [job["out"].name]
    assert isinstance(load(job["out"])["layers.0.proj.weight"], PackedWeight)
    pin_case("Interrupts", "SIGKILL with the temporary file written",
             "mixgemm prepack IN -o OUT --bits 4 --group-size 128", "killed (-9)", "(nothing: killed)",
             "one temporary directory '.OUT.<pid>.<random>.tmp/'; the next run removes it")


SAVER = r"""
import signal, sys, torch
import mixgemm
signal.signal(signal.SIGINT, signal.default_int_handler)   # (see WRAPPER)
try:
    mixgemm.save(sys.argv[1], {"big": torch.zeros(int(sys.argv[2]), dtype=torch.uint8)})
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_a_signal_during_the_real_write(tmp_path, sig, pin_case):
    """No pause this time: a 256 MiB save, signalled as soon as safetensors has begun to write
    in save's temporary directory (safetensors writes to a temporary file of its own, ``.tmpXXXXXX``,
    next to the file it is asked to write: inside that directory). SIGINT: nothing left.
    SIGKILL: only the recognisable directory, which the next save removes."""
    out = tmp_path / "out"
    out.mkdir()
    target = out / "big.safetensors"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(target), str(256 << 20)], env=env, cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:                         # until safetensors has begun writing in our directory
        names = os.listdir(out)
        if names and (out / names[0]).is_dir() and os.listdir(out / names[0]):
            break
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.001)
    seen = os.listdir(out / names[0])
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    left = os.listdir(out)
    if sig == signal.SIGINT:
        # (the signal is handled when safetensors returns: the save either finished before it,
        # or is undone; never a partial file)
        assert proc.returncode in (130, 0)
        assert left == [] if proc.returncode == 130 else left == ["big.safetensors"]
        pin_case("Interrupts", "SIGINT during the real write (256 MiB)", "mixgemm.save(path, ...)",
                 "KeyboardInterrupt (exit 130 in the child)", "(KeyboardInterrupt)")
        return
    assert proc.returncode == -signal.SIGKILL
    assert len(left) == 1 and re.fullmatch(rf"\.big\.safetensors\.{proc.pid}\.[a-z0-9_]+\.tmp", left[0]), (seen, left)
    assert os.listdir(out / left[0]), "what safetensors was writing is inside it"
    import mixgemm
    mixgemm.save(target, {"x": torch.zeros(2)})
    assert os.listdir(out) == ["big.safetensors"]
    pin_case("Interrupts", "SIGKILL during the real write (256 MiB)", "mixgemm.save(path, ...), then save again",
             "killed (-9)", "(nothing: killed)",
             "one temporary directory '.NAME.<pid>.<random>.tmp/'; the next save removes it")
