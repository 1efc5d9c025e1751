"""``mixgemm doctor``: can this machine run mixgemm's GPU kernels, and if not, why not.

:func:`diagnose` runs every check and returns a :class:`Report` of :class:`Finding` s; the
command line prints :meth:`Report.format` and exits with status 1 unless :attr:`Report.gemm_ok`.

The checks, in order: the package (version, location); its C++ headers (where they come from,
and that the include closure of every kernel resolves: an incomplete install cannot build a
kernel); CUTLASS's headers and version; nvcc (path, version >= 12.4); the GPU (sm_90);
cuda-bindings; the kernel cache (directory, kernels built there, size) and whether it is
writable; and, when all of that is fine, one tiny kernel built (or loaded from the cache) and
run on the GPU, with its time. A :attr:`Status.FAIL` means the GEMM path cannot work; a
:attr:`Status.WARN` is worth knowing but does not stop it. Every finding that is not ``ok`` says
what to do next.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import re
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from .._version import __version__
from ..errors import BuildError
from ..jit import build, catalog, env as paths, toolchain
from ..jit.render import render
from ..ops import dense
from ..ops.dense import select_spec
from ..utils.progress import Elapsed
from ..weights import quantize
from ..weights.layout import prepack
from ..weights.quantize import dequantize_reference

#: The oldest nvcc that builds mixgemm's sm_90a kernels.
MIN_NVCC = (12, 4)
#: The CUTLASS release mixgemm is built and tested with.
CUTLASS_SERIES = "4.2"


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"
    SKIP = "skip"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's result: ``name`` (what was checked), ``status``, ``detail`` (what was found,
    one line), ``fix`` (the next step; empty when ok) and ``more`` (a longer error text, shown
    with ``verbose``)."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    more: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
    findings: tuple[Finding, ...]

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.status is Status.FAIL]

    @property
    def gemm_ok(self) -> bool:
        """True when nothing stops the GEMM path (no FAIL)."""
        return not self.problems

    def get(self, name: str) -> Finding:
        return next(f for f in self.findings if f.name == name)

    def format(self, verbose: bool = False) -> str:
        width = max(len(f.name) for f in self.findings)
        lines = [f"mixgemm doctor: can this machine run mixgemm's GPU kernels? (mixgemm {__version__})"]
        for f in self.findings:
            lines.append(f"  {f.status.value:<5} {f.name:<{width}}  {f.detail}")
            pad = " " * (width + 10)
            if f.fix:
                lines.append(f"{pad}-> {f.fix}")
            if verbose and f.more:
                lines.extend(pad + line for line in f.more.splitlines())
        if self.gemm_ok:
            lines.append("result: the GEMM path works on this machine")
        else:
            names = ", ".join(f.name for f in self.problems)
            lines.append(f"result: the GEMM path cannot work here ({len(self.problems)} problem"
                         f"{'s' if len(self.problems) > 1 else ''}: {names}); quantize, prepack, "
                         f"save and load work without a GPU")
        return "\n".join(lines)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def fmt_size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------------ checks

REINSTALL = ("reinstall mixgemm (pip install --force-reinstall --no-deps mixgemm, or `pip install .` "
             "from a checkout), or set MIXGEMM_SOURCE_DIR to a source checkout")


def check_package() -> Finding:
    pkg = Path(__file__).resolve().parents[1]
    return Finding("mixgemm", Status.OK, f"{__version__} at {pkg}")


def check_headers() -> Finding:
    """Where the headers come from, and whether every kernel's include closure resolves."""

    try:
        root = paths.source_root()
    except FileNotFoundError as e:
        return Finding("headers", Status.FAIL, str(e), REINSTALL)
    pkg = Path(__file__).resolve().parents[1]
    if os.environ.get("MIXGEMM_SOURCE_DIR") and root == Path(os.environ["MIXGEMM_SOURCE_DIR"]):
        origin = "$MIXGEMM_SOURCE_DIR"
    elif root == pkg / "_include":
        origin = "installed copy"
    else:
        origin = "source checkout"
    files = sum(1 for d in ("cutlass_ext", "converters") for p in (root / d).rglob("*") if p.is_file())
    try:
        specs = catalog.default_specs()
        broken = {}
        for spec in specs:
            try:
                build.headers_digest(render(spec))
            except build.BuildError as e:
                broken[spec.name] = str(e)
    except Exception as e:  # rendering needs cutlass_library: reported by the CUTLASS check too
        return Finding("headers", Status.FAIL, f"{origin} {root} ({files} files); cannot render the kernels: "
                       f"{_first_line(e)}", "see the CUTLASS line", more=repr(e))
    if broken:
        example = next(iter(broken.values()))
        return Finding("headers", Status.FAIL,
                       f"{origin} {root} ({files} files) is incomplete: {len(broken)} of {len(specs)} "
                       f"kernels cannot be built ({example})", REINSTALL)
    detail = f"{origin} {root} ({files} files); the includes of all {len(specs)} kernels resolve"
    env = os.environ.get("MIXGEMM_SOURCE_DIR")
    if env and origin != "$MIXGEMM_SOURCE_DIR":
        return Finding("headers", Status.WARN, detail + f"; $MIXGEMM_SOURCE_DIR={env} is ignored",
                       "point MIXGEMM_SOURCE_DIR at a checkout (holding cutlass_ext/ and converters/), or unset it")
    return Finding("headers", Status.OK, detail)


def _cutlass_header_version(include: Path) -> Optional[str]:
    try:
        text = (include / "cutlass" / "version.h").read_text()
    except OSError:
        return None
    parts = [re.search(rf"#define\s+CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def check_cutlass() -> Finding:
    try:
        include = paths.cutlass_include_dir()
    except FileNotFoundError as e:
        return Finding("CUTLASS", Status.FAIL, str(e), f"pip install 'nvidia-cutlass=={CUTLASS_SERIES}.*'")
    package = build.cutlass_version()
    headers = _cutlass_header_version(include)
    detail = f"nvidia-cutlass {package} (headers {headers or 'of unknown version'}) at {include}"
    if not (package.startswith(CUTLASS_SERIES + ".") or (headers or "").startswith(CUTLASS_SERIES + ".")):
        return Finding("CUTLASS", Status.WARN, detail, f"mixgemm is built and tested with CUTLASS "
                       f"{CUTLASS_SERIES}: pip install 'nvidia-cutlass=={CUTLASS_SERIES}.*'")
    return Finding("CUTLASS", Status.OK, detail)


def check_nvcc() -> Finding:

    fix = (f"install the CUDA toolkit >= {MIN_NVCC[0]}.{MIN_NVCC[1]} and set CUDA_HOME to it (or put its "
           f"bin/ on PATH)")
    nvcc = paths.find_nvcc()
    if nvcc is None:
        return Finding("nvcc", Status.FAIL, "not found ($CUDA_HOME/bin, $CUDA_PATH/bin, PATH, the "
                       "nvidia-cuda-nvcc wheel, /usr/local/cuda/bin)", fix)
    try:
        tc = toolchain.toolchain_at(nvcc)
    except BuildError as e:
        return Finding("nvcc", Status.FAIL, f"{nvcc} does not run: {_first_line(e)}", fix, more=str(e))
    major, minor = tc.release
    line = next((ln.strip() for ln in tc.version.splitlines() if "release" in ln), "")
    version = f"CUDA {major}.{minor}" + (f" ({line})" if line else "")
    if tc.release < MIN_NVCC:
        return Finding("nvcc", Status.FAIL, f"{nvcc}: {version}, older than {MIN_NVCC[0]}.{MIN_NVCC[1]}", fix)
    return Finding("nvcc", Status.OK, f"{nvcc}: {version}, >= {MIN_NVCC[0]}.{MIN_NVCC[1]}")


def check_gpu() -> Finding:
    gpu_fix = ("mixgemm's kernels need an NVIDIA Hopper GPU (H100/H200, sm_90); run on such a "
               "machine (quantize, prepack, save and load work anywhere)")
    if torch.version.cuda is None:
        return Finding("GPU", Status.FAIL, f"none usable: torch {torch.__version__} is a CPU-only build",
                       "install a CUDA build of torch on a machine with an H100/H200 "
                       "(https://pytorch.org/get-started/locally/)")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return Finding("GPU", Status.FAIL, f"no CUDA device visible to torch {torch.__version__} "
                       f"(CUDA {torch.version.cuda}){hint}",
                       "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES; " + gpu_fix)
    devices = []
    hopper = False
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        hopper |= (major, minor) == (9, 0)
        devices.append(f"{i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    detail = "; ".join(devices)
    if not hopper:
        return Finding("GPU", Status.FAIL, f"{detail}: not sm_90", gpu_fix)
    return Finding("GPU", Status.OK, detail)


def check_cuda_bindings() -> Finding:
    try:
        from cuda.bindings import driver  # noqa: F401
        import cuda.bindings as cb   # deferred: the check itself (is cuda-python importable)
    except ImportError as e:
        return Finding("cuda-bindings", Status.FAIL, f"not importable: {_first_line(e)}",
                       "pip install 'cuda-python>=13'")
    version = getattr(cb, "__version__", "unknown version")
    if not str(version).split(".")[0].isdigit() or int(str(version).split(".")[0]) < 12:
        return Finding("cuda-bindings", Status.WARN, f"{version}", "pip install 'cuda-python>=13'")
    return Finding("cuda-bindings", Status.OK, f"{version}")


def check_cache() -> Finding:
    root = build.cache_dir()
    if not root.exists():
        return Finding("kernel cache", Status.OK, f"{root}: does not exist yet (0 kernels)")
    if not root.is_dir():
        return Finding("kernel cache", Status.FAIL, f"{root} is not a directory",
                       "remove it, or set MIXGEMM_CACHE_DIR to a directory")
    entries = [d for d in (root / "kernels").glob("*") if (d / "meta.json").is_file()]
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    stale = build.stale_temporaries()
    extra = f"; {len(stale)} leftover temporary build director{'y' if len(stale) == 1 else 'ies'} " \
            f"(removed by the next build)" if stale else ""
    return Finding("kernel cache", Status.OK, f"{root}: {len(entries)} kernel{'s' if len(entries) != 1 else ''}, "
                   f"{fmt_size(size)}{extra}")


def check_cache_writable() -> Finding:
    root = build.cache_dir()
    fix = "set MIXGEMM_CACHE_DIR to a writable directory (kernels are built and locked there)"
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return Finding("cache writable", Status.FAIL, f"no: {probe} is not a directory", fix)
    if probe != root:
        ok = os.access(probe, os.W_OK | os.X_OK)
        return Finding("cache writable", Status.OK if ok else Status.FAIL,
                       f"{'yes' if ok else 'no'}: {root} would be created under {probe}", "" if ok else fix)
    try:
        with tempfile.NamedTemporaryFile(dir=root, prefix=".doctor-"):
            pass
        for sub in ("kernels", "locks", "tmp"):
            d = root / sub
            if d.exists() and not os.access(d, os.W_OK | os.X_OK):
                return Finding("cache writable", Status.FAIL, f"no: {d} is not writable", fix)
    except OSError as e:
        return Finding("cache writable", Status.FAIL, f"no: {_first_line(e)}", fix)
    return Finding("cache writable", Status.OK, "yes")


def run_tiny_kernel(progress_stream=None) -> Finding:
    """Build (or load) the decode kernel of a tiny int4 layer, run ``mixgemm.gemm`` on one
    token and compare with the float reference; say how long each step took."""

    n, k, group = 256, 256, 128
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    packed = prepack(quantize.quantize(w, 4, group))
    spec = select_spec(1, packed)
    try:
        t0 = time.monotonic()
        cached = build.is_cached(spec)
        if cached:
            how = "loaded from the cache"
        else:
            with Elapsed(f"mixgemm doctor: compiling {spec.name} (first use on this machine, 5-30 s)",
                         progress_stream):
                build.build(spec)
            how = f"built in {time.monotonic() - t0:.1f} s (now cached)"
        device = torch.device("cuda", torch.cuda.current_device())
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16).to(device)
        dev_w = packed.to(device)
        t1 = time.monotonic()
        y = dense.gemm(x, dev_w)
        torch.cuda.synchronize(device)
        first = time.monotonic() - t1
        ref = x.double() @ dequantize_reference(dev_w).double().t()
        err = float((y.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    except Exception as e:
        return Finding("kernel run", Status.FAIL, f"{spec.name}: {_first_line(e)}",
                       "rerun with `mixgemm --debug doctor` for the whole error", more=traceback.format_exc())
    detail = (f"{spec.name}: {how}; load + first run {first * 1e3:.0f} ms, total "
              f"{time.monotonic() - t0:.1f} s; max error vs reference {err:.1e} of max |y|")
    if not err < 2e-2:
        return Finding("kernel run", Status.FAIL, detail + ": wrong result",
                       "report this as a bug, with the output of `mixgemm --debug doctor`")
    return Finding("kernel run", Status.OK, detail)


def diagnose(run_kernel: bool = True, progress_stream=None,
             checks: Optional[tuple[Callable[[], Finding], ...]] = None) -> Report:
    """Run every check (``checks`` overrides the list, for tests); then, if nothing failed and
    ``run_kernel``, :func:`run_tiny_kernel`. Never raises for what it checks."""
    checks = checks if checks is not None else (check_package, check_headers, check_cutlass, check_nvcc,
                                                 check_gpu, check_cuda_bindings, check_cache,
                                                 check_cache_writable)
    findings = []
    for check in checks:
        try:
            findings.append(check())
        except Exception as e:   # a check that breaks is a finding, not a crash
            name = check.__name__.removeprefix("check_")
            findings.append(Finding(name, Status.FAIL, f"the check itself failed: {_first_line(e)}",
                                    "rerun with `mixgemm --debug doctor` and report it",
                                    more=traceback.format_exc()))
    if not run_kernel:
        findings.append(Finding("kernel run", Status.SKIP, "not run (--no-kernel)"))
    elif any(f.status is Status.FAIL for f in findings):
        findings.append(Finding("kernel run", Status.SKIP, "not run: fix the FAIL above first"))
    else:
        findings.append(run_tiny_kernel(progress_stream))
    return Report(tuple(findings))


__all__ = ["Status", "Finding", "Report", "diagnose", "run_tiny_kernel", "MIN_NVCC"]
