"""A fake nvcc (a script that writes its command line and source into the output file) and a
private kernel cache, so that the build cache's logic runs in seconds without a compiler.

``fake_env`` is a fixture: import it into a test module (``from fake_nvcc import fake_env``) and
take it as an argument. It puts the fake nvcc under ``$CUDA_HOME/bin``, points
``MIXGEMM_CACHE_DIR`` into the test's temporary directory and logs each compiled file's name, which
``nvcc_calls(fake_env)`` reads back. ``FAKE_NVCC_FAIL``, ``FAKE_NVCC_NOTE`` and ``FAKE_NVCC_SLEEP``
make it fail, print a note on stderr or take its time. tools/first_token.py --dry-run uses
``FAKE_NVCC`` too.
"""
from __future__ import annotations

import stat
import textwrap
from pathlib import Path

import pytest

from mixgemm.jit import build


FAKE_NVCC = textwrap.dedent("""\
    #!/usr/bin/env python3
    import os, sys, time
    args = sys.argv[1:]
    if args == ["--version"]:
        print("nvcc: NVIDIA (R) Cuda compiler driver\\nCuda compilation tools, release 13.0, V13.0.88")
        sys.exit(0)
    out = args[args.index("-o") + 1]
    src = [a for a in args if a.endswith((".cu", ".cpp"))][0]
    log = os.environ.get("FAKE_NVCC_LOG")
    if log:
        with open(log, "a") as f:
            f.write(os.path.basename(out) + "\\n")
    if os.environ.get("FAKE_NVCC_FAIL"):
        print("error: fake failure", file=sys.stderr)
        sys.exit(2)
    if os.environ.get("FAKE_NVCC_NOTE"):
        print(os.environ["FAKE_NVCC_NOTE"], file=sys.stderr)
    time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
    with open(out, "w") as f:
        f.write(" ".join(args) + "\\n" + open(src).read())
    """)


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(tmp_path / "calls.log"))
    for var in build.KEY_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def nvcc_calls(tmp: Path) -> list[str]:
    log = tmp / "calls.log"
    return log.read_text().split() if log.exists() else []
