"""`mixgemm prepack` interrupted by real signals: SIGINT leaves no output and no temporary file;
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

from mixgemm.cli import main
from mixgemm.io import load
from mixgemm.types import PackedWeight

ROOT = Path(__file__).resolve().parents[1]

WRAPPER = r'''
import sys, time
from pathlib import Path
stage, ready = sys.argv[1], Path(sys.argv[2])
if stage == "quantize":          # pause while quantizing the second weight
    import mixgemm.quantize
    q = sys.modules["mixgemm.quantize"]      # (mixgemm.quantize is also the function's name)
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
from mixgemm.cli import main
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


def start(job, stage):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = ["prepack", str(job["src"]), "-o", str(job["out"]), "--bits", "4", "--group-size", "128"]
    proc = subprocess.Popen([sys.executable, str(job["wrapper"]), stage, str(job["ready"]), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=job["tmp"])
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
        temporary = Path(job["ready"].read_text())
        assert temporary.exists() and temporary.parent == job["out_dir"]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.splitlines() == ["mixgemm prepack: interrupted"]
    assert os.listdir(job["out_dir"]) == []                  # no output, no temporary
    assert sorted(os.listdir(job["src"].parent)) == ["model.safetensors"]
    where = "while quantizing" if stage == "quantize" else "with the temporary file written, before the rename"
    pin_case("Interrupts", f"SIGINT {where}", "mixgemm prepack IN -o OUT --bits 4 --group-size 128",
             "exit 130", err.splitlines()[0])


def test_sigkill_leaves_a_named_temporary_that_the_next_run_removes(job, capsys, pin_case):
    proc = start(job, "save")
    temporary = Path(job["ready"].read_text())
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # what a kill leaves: only the temporary, named after the output and the dead process
    assert os.listdir(job["out_dir"]) == [temporary.name]
    assert re.fullmatch(rf"\.model\.int4\.safetensors\.{proc.pid}\.[a-z0-9_]+\.tmp", temporary.name)
    # the next run cleans it up and writes the output
    rc = main(["prepack", str(job["src"]), "-o", str(job["out"]), "--bits", "4", "--group-size", "128"])
    assert rc == 0, capsys.readouterr().err
    assert os.listdir(job["out_dir"]) == [job["out"].name]
    assert isinstance(load(job["out"])["layers.0.proj.weight"], PackedWeight)
    pin_case("Interrupts", "SIGKILL with the temporary file written",
             "mixgemm prepack IN -o OUT --bits 4 --group-size 128", "killed (-9)", "(nothing: killed)",
             "one temporary file '.OUT.<pid>.<random>.tmp'; the next run removes it")
