"""The torch operator library (mixgemm.jit.torch_ops) without a GPU: its source compiles against
the installed torch's headers, its cache key follows the torch it builds against, and the plan
cache's link to it does nothing until it is attached (and never with MIXGEMM_TORCH_OPS=python)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mixgemm.dispatch import plans
from mixgemm.jit import build, torch_ops
from mixgemm.jit.toolchain import include_flags


def test_source_compiles_against_the_installed_torch(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    flags = [f for f in torch_ops.build_flags() if f.startswith(("-std=", "-D", "-I"))]
    root = Path(torch.__file__).resolve().parent / "include"
    if not (root / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():   # a CPU wheel omits it
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    cmd = [nvcc, *flags, "-Xcompiler=-fPIC", "-c", *include_flags(), str(torch_ops.SOURCE), "-o",
           str(tmp_path / "torch_ops.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "torch_ops.o").stat().st_size > 0


def test_flags_and_key_follow_the_torch():
    flags = torch_ops.build_flags()
    root = Path(torch.__file__).resolve().parent
    assert f"-I{root / 'include'}" in flags and "-lc10_cuda" in flags
    assert f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}" in flags
    assert sum(f.startswith("-std=") for f in flags) == 1
    tc = build.toolchain()
    source = torch_ops.SOURCE.read_text()
    key = build.host_library_key("torch_ops", source, tc, flags, torch_ops.key_extra())
    assert key == build.host_library_key("torch_ops", source, tc, flags, torch_ops.key_extra())
    other = dict(torch_ops.key_extra(), torch="0.0.0")
    assert build.host_library_key("torch_ops", source, tc, flags, other) != key
    assert build.host_library_key("torch_ops", source, tc, flags[:-1], torch_ops.key_extra()) != key


def test_key_structure_matches_the_source():
    """OpKey mirrors MixgemmOpKey field by field (names and order)."""
    import re

    text = torch_ops.SOURCE.read_text()
    body = text[text.index("struct MixgemmOpKey {"):]
    body = body[:body.index("};")]
    fields = re.findall(r"^\s*(?:u?int(?:32|64)_t)\s+(\w+);", body, re.M)
    assert fields == [name for name, _ in torch_ops.OpKey._fields_]
    assert f"#define MIXGEMM_TORCH_OPS_VERSION {torch_ops.TORCH_OPS_VERSION}" in text


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv(torch_ops.TORCH_OPS_ENV, "Compiled ")
    assert torch_ops.mode() == "compiled"
    monkeypatch.setenv(torch_ops.TORCH_OPS_ENV, "cpp")
    with pytest.raises(ValueError, match="MIXGEMM_TORCH_OPS must be auto, compiled or python"):
        torch_ops.mode()


def test_python_mode_never_builds(monkeypatch):
    monkeypatch.setenv(torch_ops.TORCH_OPS_ENV, "python")
    link = plans.OperatorLibrary()

    def fail():
        raise AssertionError("built")

    monkeypatch.setattr(torch_ops, "load", fail)
    assert link.attach() is None
    assert link.attach() is None and link.lib is None


def test_unattached_link_does_nothing():
    link = plans.OperatorLibrary()
    link.clear_plans()
    link.set_arena(torch_ops.WORKSPACE_ARENA, 0, 0, 1 << 20, 1 << 16)


def test_no_cuda_torch_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    from mixgemm.errors import BuildError

    with pytest.raises(BuildError, match="^the torch operator library cannot be built: this torch has no CUDA$"):
        torch_ops.load()
