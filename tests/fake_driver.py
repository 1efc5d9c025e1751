"""The fake CUDA driver (tests/cpp/fake_libcuda.c) for CPU-only tests and host-time profiles.

:func:`load` compiles it with the system C compiler (once per directory) and loads it into the
process as ``libcuda.so.1`` before cuda-python opens the driver, so that cuda-python's calls --
and the compiled launcher's, which gets its driver entry points from cuda-python -- land in it.
Launches and memsets are recorded (:meth:`FakeDriver.calls`); nothing runs on any device.
Once loaded it stays loaded for the life of the process (cuda-python keeps the handle).
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).resolve().parent / "cpp" / "fake_libcuda.c"


class FakeCall(ctypes.Structure):
    """One recorded call; mirrors FakeCall in fake_libcuda.c."""

    _fields_ = [
        ("seq", ctypes.c_uint64), ("kind", ctypes.c_int32), ("result", ctypes.c_int32),
        ("function", ctypes.c_uint64), ("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
        ("smem", ctypes.c_uint32), ("num_attrs", ctypes.c_uint32), ("cluster", ctypes.c_uint32 * 3),
        ("pdl", ctypes.c_int32), ("stream", ctypes.c_uint64), ("dptr", ctypes.c_uint64),
        ("value", ctypes.c_uint32), ("count", ctypes.c_uint64), ("params_size", ctypes.c_uint32),
        ("params", ctypes.c_uint8 * 4096),
    ]

    LAUNCH, MEMSET = 1, 2

    def summary(self) -> dict:
        """Everything recorded, as plain values (the params as bytes)."""
        if self.kind == self.LAUNCH:
            return {"kind": "launch", "function": self.function, "grid": tuple(self.grid),
                    "block": tuple(self.block), "smem": self.smem, "cluster": tuple(self.cluster),
                    "pdl": self.pdl, "num_attrs": self.num_attrs, "stream": self.stream,
                    "params": bytes(self.params[:self.params_size])}
        return {"kind": "memset", "dptr": self.dptr, "value": self.value, "count": self.count,
                "stream": self.stream}


class FakeDriver:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.fake_call_count.restype = ctypes.c_uint64
        lib.fake_alloc_count.restype = ctypes.c_uint64
        lib.fake_allocated_bytes.restype = ctypes.c_uint64
        lib.fake_get_call.argtypes = [ctypes.c_uint64, ctypes.POINTER(FakeCall)]
        lib.fake_set_params_size.argtypes = [ctypes.c_uint32]
        lib.fake_fail_next_launch.argtypes = [ctypes.c_int]
        lib.fake_fail_next_memset.argtypes = [ctypes.c_int]

    def reset(self, params_size: int = 0) -> None:
        self.lib.fake_reset()
        self.lib.fake_set_params_size(params_size)

    def count(self) -> int:
        return int(self.lib.fake_call_count())

    def calls(self, since: int = 0) -> list[dict]:
        """The calls recorded after the ``since``-th (at most the last 64)."""
        out = []
        for seq in range(since + 1, self.count() + 1):
            c = FakeCall()
            if self.lib.fake_get_call(seq, ctypes.byref(c)):
                out.append(c.summary())
        return out

    def allocations(self) -> int:
        """cuMemAlloc calls since the driver was loaded."""
        return int(self.lib.fake_alloc_count())

    def allocated_bytes(self) -> int:
        """Bytes of device memory held now (cuMemAlloc'd, not freed)."""
        return int(self.lib.fake_allocated_bytes())

    def fail_next_launch(self, result: int) -> None:
        self.lib.fake_fail_next_launch(result)

    def fail_next_memset(self, result: int) -> None:
        self.lib.fake_fail_next_memset(result)


_LOADED: Optional[FakeDriver] = None


def compiler() -> Optional[str]:
    return shutil.which("cc") or shutil.which("gcc")


def real_driver_present() -> bool:
    """Whether the process can open a real libcuda.so.1 (then the fake must not be loaded: it
    would take the driver's place for torch too)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def load(build_dir: Path) -> FakeDriver:
    """Build (if needed) and load the fake driver; the same object on every later call."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    if real_driver_present():
        raise RuntimeError("a CUDA driver is installed: the fake one is for machines without one")
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc) to build the fake CUDA driver")
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    lib_path = build_dir / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", str(SOURCE), "-o", str(lib_path)],
                   check=True, capture_output=True, text=True)
    # loaded globally under the driver's soname: cuda-python's dlopen("libcuda.so.1") finds it
    _LOADED = FakeDriver(ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL))
    return _LOADED
