"""Where things are: CUTLASS's headers, mixgemm's own headers, and the CUDA toolkit."""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Optional

_PKG_DIR = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def source_root() -> Path:
    """Directory holding mixgemm's C++ headers (``cutlass_ext/`` and ``converters/``).

    ``$MIXGEMM_SOURCE_DIR`` if set; else the repository root for a source checkout or an
    editable install; else the copy shipped inside the installed package (``mixgemm/_include``).
    """
    env = os.environ.get("MIXGEMM_SOURCE_DIR")
    candidates = [Path(env)] if env else []
    candidates += [_PKG_DIR.parent.parent, _PKG_DIR / "_include"]
    for root in candidates:
        if (root / "cutlass_ext").is_dir() and (root / "converters").is_dir():
            return root
    raise FileNotFoundError("mixgemm's C++ headers (cutlass_ext/, converters/) were not found; "
                            "reinstall mixgemm or set MIXGEMM_SOURCE_DIR to a source checkout")


def converters_dir() -> Path:
    return source_root() / "converters"


def cutlass_ext_dir() -> Path:
    return source_root() / "cutlass_ext"


def repo_file(rel: str) -> Path:
    """A file of the source checkout (tests and tools only)."""
    return source_root() / rel


@functools.lru_cache(maxsize=None)
def cutlass_include_dir() -> Path:
    """CUTLASS 4.2's headers, as shipped by the ``nvidia-cutlass`` wheel
    (``cutlass_library/source/include``). The one place mixgemm looks them up."""
    try:
        import cutlass_library   # deferred: heavy, and needed only to find the headers
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise FileNotFoundError("the nvidia-cutlass package (cutlass_library) is not installed") from e
    inc = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if not (inc / "cutlass" / "cutlass.h").is_file():
        raise FileNotFoundError(f"CUTLASS headers not found under {inc}; reinstall nvidia-cutlass==4.2.*")
    return inc


def find_nvcc() -> Optional[str]:
    """nvcc from ``$CUDA_HOME``/``$CUDA_PATH``, then ``PATH``, then the nvidia-cuda-nvcc wheel."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    try:
        import nvidia.cuda_nvcc as wheel  # type: ignore[import-not-found]
        cand = Path(list(wheel.__path__)[0]) / "bin" / "nvcc"
        if cand.is_file():
            return str(cand)
    except ImportError:
        pass
    for default in ("/usr/local/cuda/bin/nvcc",):
        if Path(default).is_file():
            return default
    return None
