"""The package as a user installs it: the wheel, in a fresh virtual environment, away from the
checkout (issue #15: a wheel without ``collective/builder.hpp`` could build no GEMM kernel, and
every test ran from the source checkout, so nothing noticed).

How the environment is made, and why it cannot see the checkout:

* the wheel is built by ``pip wheel --no-deps`` from a copy of the checkout in a temporary
  directory, so no ``build/`` or ``*.egg-info`` of the checkout is used or left behind. When
  this interpreter has setuptools >= 68 (pyproject's build requirement) the build uses it
  (``--no-build-isolation``: no download, so the test also runs on a machine without a package
  index); otherwise pip builds in an isolated environment, as ``pip install .`` does. The build
  backend is setuptools' either way;
* the virtual environment is created *without* the system site-packages: this machine's (and
  CI's) site-packages holds an editable install of a checkout (a ``.pth`` file naming its
  ``python/`` directory), which ``--system-site-packages`` would put on sys.path;
* the wheel is installed with ``--no-deps --no-index``; mixgemm's dependencies (torch, numpy,
  safetensors, tqdm, nvidia-cutlass, cuda-bindings), already installed here, are reached
  through one ``.pth`` file in the venv listing the directories that hold them. A plain path
  line in a ``.pth`` file appends that directory to sys.path *without* processing the ``.pth``
  files inside it, so the editable install's ``.pth`` is not applied;
* every command runs from a temporary directory, with ``PYTHONPATH`` and
  ``MIXGEMM_SOURCE_DIR`` unset and ``PYTHONNOUSERSITE=1``;
* :func:`test_installed_package_is_the_wheel` asserts that this worked: ``mixgemm.__file__`` is in
  the venv, its headers come from the wheel's ``mixgemm/_include`` and no sys.path entry lies
  in the checkout.

Then: the wheel ships the header trees whole; every kernel of ``mixgemm generate --list``
renders and its whole include closure resolves against the installed package; one decode kernel
and one sm90 GEMM kernel (the two the demo runs) compile with nvcc from it (compilation only,
no GPU); ``mixgemm demo`` prints its CPU report. Marked ``slow`` (the GEMM kernel takes 40-100 s
of nvcc); it still runs in CI's default test command.
"""
from __future__ import annotations

import importlib.util
import json
import re
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HEADER_TREES = ("cutlass_ext", "converters")
#: Imported by mixgemm at run time (nvidia.cuda_nvcc only where that wheel is installed).
DEPENDENCIES = ("torch", "numpy", "safetensors", "tqdm", "cutlass_library", "cuda.bindings", "nvidia.cuda_nvcc")
#: Top-level entries of the checkout that are not sources (build outputs, caches, carried data).
_NOT_SOURCES = {".git", "build", "dist", ".whl", ".cubins", ".gpu", ".pytest_cache", ".hypothesis",
                "mixgemm_kernels"}


def _ignore(directory, names):
    top = Path(directory).resolve() == ROOT
    return {n for n in names if (top and n in _NOT_SOURCES) or n == "__pycache__" or n.endswith(".egg-info")}


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "MIXGEMM_SOURCE_DIR", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


def _run(cmd, cwd, timeout=600, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def _dependency_dirs() -> list[Path]:
    """The directories (site-packages) from which this interpreter imports mixgemm's dependencies."""
    dirs = []
    for name in DEPENDENCIES:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None or spec.origin is None:
            continue
        d = Path(spec.origin).resolve().parents[len(name.split("."))]
        assert not (d / "mixgemm").exists(), f"{d} holds a mixgemm package: it would shadow the wheel"
        assert not d.is_relative_to(ROOT), f"{name} is imported from the checkout ({d})"
        if d not in dirs:
            dirs.append(d)
    return dirs


def _build_isolation() -> list[str]:
    """``--no-build-isolation`` when this interpreter can build the wheel itself."""
    from importlib import metadata

    try:
        major = int(metadata.version("setuptools").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if major >= 68 else []


class Installed:
    """A venv holding only the wheel (see the module docstring)."""

    def __init__(self, base: Path):
        self.base = base
        src = base / "src"
        shutil.copytree(ROOT, src, ignore=_ignore)
        self.src = src
        dist = base / "dist"
        res = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *_build_isolation(), "-w", dist, src],
                   cwd=base)
        assert res.returncode == 0, res.stdout + res.stderr
        (self.wheel,) = dist.glob("mixgemm-*.whl")
        self.venv = base / "venv"
        res = _run([sys.executable, "-m", "venv", self.venv], cwd=base)
        assert res.returncode == 0, res.stderr
        self.python = self.venv / "bin" / "python"
        res = _run([self.python, "-m", "pip", "install", "--no-deps", "--no-index", self.wheel], cwd=base)
        assert res.returncode == 0, res.stdout + res.stderr
        site = Path(_run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=base).stdout.strip())
        (site / "_mixgemm_test_dependencies.pth").write_text("".join(f"{d}\n" for d in _dependency_dirs()))
        self.site = site
        self.work = base / "work"            # the current directory of every command
        self.work.mkdir()
        self.probe = self.work / "installed_probe.py"
        shutil.copy(ROOT / "tests" / "installed_probe.py", self.probe)

    def run(self, *args, timeout=600, **env) -> subprocess.CompletedProcess:
        return _run(args, cwd=self.work, timeout=timeout, **env)

    def probe_json(self, *args, **env):
        res = self.run(self.python, self.probe, *args, **env)
        assert res.returncode == 0, res.stdout + res.stderr
        return json.loads(res.stdout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    return Installed(tmp_path_factory.mktemp("wheel"))


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_installed_package_is_the_wheel(installed):
    where = installed.probe_json("where")
    assert Path(where["mixgemm"]).is_relative_to(installed.site), where["mixgemm"]
    assert Path(where["source_root"]) == installed.site / "mixgemm" / "_include"
    assert where["env"] == {"MIXGEMM_SOURCE_DIR": None, "PYTHONPATH": None}
    on_path = [p for p in where["sys_path"] if p and Path(p).resolve().is_relative_to(ROOT)]
    assert on_path == [], f"checkout directories on the venv's sys.path: {on_path}"
    assert not Path(where["cutlass"]).is_relative_to(ROOT)


def test_wheel_ships_the_header_trees_whole(installed):
    """Every file of cutlass_ext/ and converters/, nothing filtered by name, in the wheel and in
    the installed package."""
    with zipfile.ZipFile(installed.wheel) as whl:
        in_wheel = set(whl.namelist())
    for tree in HEADER_TREES:
        want = _files(ROOT / tree)
        assert want, tree
        shipped = {n[len(f"mixgemm/_include/{tree}/"):] for n in in_wheel
                   if n.startswith(f"mixgemm/_include/{tree}/")}
        assert sorted(want - shipped) == [], f"files of {tree}/ missing from the wheel"
        assert sorted(shipped - want) == [], f"files in the wheel that {tree}/ does not have"
        assert _files(installed.site / "mixgemm" / "_include" / tree) == want


def test_every_kernel_resolves_its_includes(installed):
    """Every spec of the installed `mixgemm generate --list` renders, and its include closure
    resolves against the installed package (both by a preprocessor-like walk and by the build's
    own resolver, which computes the cache key)."""
    res = installed.run(installed.venv / "bin" / "mixgemm", "generate", "--list")
    assert res.returncode == 0, res.stderr
    names = res.stdout.split()
    assert len(names) > 100 and any("_gemm_" in n for n in names) and any("_decode_" in n for n in names)
    report = installed.probe_json("closure", *names)
    assert report["kernels"] == len(names)
    assert report["missing"] == {}, f"unresolved #includes: {report['missing']}"
    assert report["digest_errors"] == {}, next(iter(report["digest_errors"].values()), "")
    include_root = installed.site / "mixgemm" / "_include"
    reached = {str(Path(p).relative_to(include_root)) for p in report["mixgemm_headers"]}
    assert all(Path(p).is_relative_to(include_root) for p in report["mixgemm_headers"])
    # the trees the issue is about: the GEMM's collective builder and everything shipped
    assert "cutlass_ext/mixgemm/collective/builder.hpp" in reached
    shipped = {f"{t}/{f}" for t in HEADER_TREES for f in _files(ROOT / t) if f.endswith((".hpp", ".h", ".cuh"))}
    reached |= _host_library_headers(installed.site / "mixgemm", include_root)
    assert reached == shipped, f"headers no kernel or host library reaches: {sorted(shipped - reached)}"
    assert any(h.startswith("cutlass/") for h in report["cutlass_headers"])


def _host_library_headers(package: Path, include_root: Path) -> set[str]:
    """The mixgemm headers the installed host libraries' sources (jit/csrc/*.cpp) include,
    transitively, relative to ``include_root``; every include must resolve there."""
    include = re.compile(r'^\s*#\s*include\s*"(mixgemm/[^"]+)"', re.M)
    todo = [inc for src in sorted((package / "jit" / "csrc").glob("*.cpp")) for inc in include.findall(src.read_text())]
    assert todo, "no host library source includes a mixgemm header"
    seen: set[str] = set()
    while todo:
        inc = todo.pop()
        hits = [include_root / tree / inc for tree in HEADER_TREES if (include_root / tree / inc).is_file()]
        assert len(hits) == 1, f"{inc}: {len(hits)} installed headers of that name"
        rel = str(hits[0].relative_to(include_root))
        if rel not in seen:
            seen.add(rel)
            todo.extend(include.findall(hits[0].read_text()))
    return seen


def _demo_specs() -> tuple[str, str]:
    """The decode kernel (M = 1) and the sm90 GEMM kernel (M = 64) that `mixgemm demo` runs on
    its 4096x4096 bf16/int4 layer."""
    from mixgemm.ops.dense import select_tile
    from mixgemm.jit.specs import Activation
    from mixgemm.dtypes import ActType, WeightType

    decode = select_tile(1, 4096, 4096).spec(ActType.BF16, WeightType.U4, Activation.NONE)
    gemm = select_tile(64, 4096, 4096).spec(ActType.BF16, WeightType.U4, Activation.NONE)
    assert "_decode_" in decode.name and "_gemm_" in gemm.name
    return decode.name, gemm.name


@pytest.mark.nvcc
def test_installed_package_compiles_a_decode_and_a_gemm_kernel(installed, tmp_path):
    """nvcc compiles both kernels (in parallel, each into its own cache) and the compiled
    launcher from the installed package's files. Compilation only: no GPU needed."""
    from mixgemm.jit import env as paths

    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    procs = {}
    for name in _demo_specs():
        env = clean_env(MIXGEMM_CACHE_DIR=str(tmp_path / name))
        procs[name] = subprocess.Popen([str(installed.python), str(installed.probe), "build", name],
                                       cwd=installed.work, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    # the compiled launcher too: its source is package data, built on first use (host code)
    env = clean_env(MIXGEMM_CACHE_DIR=str(tmp_path / "launcher"))
    lau = subprocess.run([str(installed.python), str(installed.probe), "launcher"], cwd=installed.work, env=env,
                         capture_output=True, text=True, timeout=600)
    assert lau.returncode == 0, lau.stderr[-4000:]
    built = json.loads(lau.stdout)
    assert Path(built["source"]).resolve().is_relative_to(installed.site.resolve())
    assert built["head"] == b"\x7fELF".hex()
    results = {name: p.communicate(timeout=1500) + (p.returncode,) for name, p in procs.items()}
    include_root = installed.site / "mixgemm" / "_include"
    for name, (out, err, rc) in results.items():
        assert rc == 0, f"{name}:\n{err[-4000:]}"
        art = json.loads(out)
        assert art["cubin_head"] == b"\x7fELF".hex(), name
        assert art["helper"] is not None and Path(art["helper"]).is_file()
        for cmd in art["commands"].values():
            flags = [a for a in cmd if a.startswith("-I")]
            assert f"-I{include_root / 'cutlass_ext'}" in flags and f"-I{include_root / 'converters'}" in flags
            assert not any(Path(f[2:]).resolve().is_relative_to(ROOT) for f in flags), flags


def test_installed_demo_prints_its_cpu_report(installed):
    """`mixgemm demo` of the installed package, with no GPU visible: the CPU report, exit 0."""
    res = installed.run(installed.venv / "bin" / "mixgemm", "demo", CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "weight [N=4096, K=4096] bf16" in out
    assert "round trip: unpack(prepack(q)) == q exactly" in out
    assert out.rstrip().endswith("the GEMM needs an NVIDIA Hopper (sm_90) GPU; none found, skipping it")
