"""The compiler mixgemm builds with, and what of the build environment goes into a cache key.

* :func:`toolchain`: the nvcc found (:func:`mixgemm.jit.env.find_nvcc`), its version text, CUDA >=
  12.4 (sm_90a mixed-input kernels);
* the flags of the device (cubin) and host-helper builds, the include directories, and
  ``MIXGEMM_NVCC_FLAGS``;
* :func:`headers_digest`: the mixgemm headers a kernel source includes, transitively, hashed, so
  that an edit to a header changes the key of exactly the kernels that include it.

:mod:`mixgemm.jit.build` puts these into its cache keys and command lines.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Optional

from ..errors import BuildError
from . import env as paths

ARCH = "sm_90a"
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
#: Flags common to the device and host builds. -DNDEBUG matters: without it ptxas serializes
#: wgmma (warning C7510).
BASE_FLAGS = ("-std=c++17", "-DNDEBUG", "--expt-relaxed-constexpr", GENCODE,
              "-Xcompiler=-Wno-deprecated-declarations", "-diag-suppress=177,550")
CUBIN_FLAGS = ("-O3", "-cubin")
HELPER_FLAGS = ("-O2", "-shared", "-Xcompiler=-fPIC", "-Xlinker=--strip-all", "-DMIXGEMM_HOST_HELPER")
#: Environment variables that change what nvcc produces, hence part of the key.
#: (Which nvcc runs is covered by its version text; its install path is not part of the key, so
#: a cache built with one install of CUDA 13.0 serves another.)
KEY_ENV_VARS = ("MIXGEMM_NVCC_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")


@dataclasses.dataclass(frozen=True)
class Toolchain:
    nvcc: str
    version: str       # the full `nvcc --version` text

    @property
    def release(self) -> tuple[int, int]:
        for token in self.version.replace(",", " ").split():
            if token[:1] == "V" and token[1:2].isdigit():
                major, minor = token[1:].split(".")[:2]
                return int(major), int(minor)
        return (0, 0)


@functools.lru_cache(maxsize=None)
def toolchain_at(nvcc: str) -> Toolchain:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"cannot run {nvcc} --version: {e}") from e
    return Toolchain(nvcc, out.strip())


def toolchain() -> Toolchain:
    """The nvcc mixgemm builds with (CUDA >= 12.4 for sm_90a mixed-input kernels)."""
    nvcc = paths.find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found: set CUDA_HOME, put nvcc on PATH, or install the CUDA "
                         "toolkit (CUDA >= 12.4)")
    tc = toolchain_at(nvcc)
    if tc.release < (12, 4):
        raise BuildError(f"{nvcc} is CUDA {tc.release}; mixgemm needs CUDA >= 12.4 for sm_90a")
    return tc


_INCLUDE = re.compile(r'^\s*#\s*include\s*"(mixgemm/[^"]+)"', re.M)


def _header_roots() -> tuple[Path, ...]:
    return (paths.cutlass_ext_dir(), paths.converters_dir())


def _resolve(include: str) -> Optional[Path]:
    for root in _header_roots():
        p = root / include
        if p.is_file():
            return p
    return None


@functools.lru_cache(maxsize=None)
def _file_digest(path: str, mtime_ns: int, size: int) -> tuple[str, tuple[str, ...]]:
    """(sha256 of a header, the mixgemm headers it includes). mtime/size key the memo to edits."""
    text = Path(path).read_text()
    return hashlib.sha256(text.encode()).hexdigest(), tuple(_INCLUDE.findall(text))


def headers_digest(source: str) -> str:
    """Digest of the mixgemm headers ``source`` includes, transitively (``#include "mixgemm/..."``
    resolved against cutlass_ext/ and converters/). An edit to a header changes the key of exactly
    the kernels that include it; the CUTLASS headers are covered by the CUTLASS version."""
    seen: dict[str, str] = {}
    todo = list(_INCLUDE.findall(source))
    while todo:
        inc = todo.pop()
        if inc in seen:
            continue
        p = _resolve(inc)
        if p is None:
            raise BuildError(f"the kernel source includes {inc!r}, which is not a mixgemm header")
        st = p.stat()
        digest, includes = _file_digest(str(p), st.st_mtime_ns, st.st_size)
        seen[inc] = digest
        todo.extend(includes)
    return hashlib.sha256(json.dumps(sorted(seen.items())).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def cutlass_version() -> str:
    try:
        return metadata.version("nvidia-cutlass")
    except metadata.PackageNotFoundError:
        return "unknown:" + str(paths.cutlass_include_dir())


def include_flags() -> list[str]:
    return [f"-I{paths.cutlass_ext_dir()}", f"-I{paths.converters_dir()}", f"-I{paths.cutlass_include_dir()}"]


def extra_flags() -> list[str]:
    return os.environ.get("MIXGEMM_NVCC_FLAGS", "").split()
