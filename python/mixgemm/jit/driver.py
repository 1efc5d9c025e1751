"""The CUDA driver through cuda-python (:func:`cuda_driver`): the error check of its calls,
the C ABI structures shared with the host helpers and the compiled launcher
(``cutlass_ext/mixgemm/abi.hpp``) and the host helper that speaks it, driver entry points, a loaded
kernel's record, and torch's current stream.

Nothing here loads or builds a kernel (:mod:`mixgemm.jit.loader` does), so every layer that talks
to the driver can import it.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..errors import BuildError, CudaError, KernelError

if TYPE_CHECKING:
    from .build import Artifacts
    from .specs import KernelSpec


def cuda_driver():
    """cuda-python's driver module, ``cuda.bindings.driver``."""
    # deferred: `mixgemm doctor` reports a missing or broken cuda-python instead of failing at import
    from cuda.bindings import driver   # deferred: `mixgemm doctor` reports a missing cuda-python instead of failing at import
    return driver


ABI_VERSION = 5  # cutlass_ext/mixgemm/abi.hpp kAbiVersion


def check(result: Any, what: str):
    """Unwrap a cuda.bindings result ``(err, *values)``; raise CudaError if err is not success."""
    drv = cuda_driver()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        _, desc = drv.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        desc = desc.decode() if isinstance(desc, bytes) else str(desc)
        raise CudaError(f"{what}: {name} ({desc})")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


# ---------------------------------------------------------------------------------------------
# The C ABI of the host helpers (mirrors cutlass_ext/mixgemm/abi.hpp)
# ---------------------------------------------------------------------------------------------
class GemmArgs(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_int32),
        ("m", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("group_size", ctypes.c_int32),
        ("sm_count", ctypes.c_int32),
        ("splits", ctypes.c_int32),
        ("raster", ctypes.c_int32),
        ("activation", ctypes.c_int32),  # specs.Activation's index: none, silu, gelu, swiglu
        ("swizzle", ctypes.c_int32),     # the tile scheduler's max_swizzle_size (0: 1)
        ("weight", ctypes.c_uint64),
        ("scales", ctypes.c_uint64),
        ("zeros", ctypes.c_uint64),
        ("x", ctypes.c_uint64),
        ("bias", ctypes.c_uint64),
        ("y", ctypes.c_uint64),
        ("workspace", ctypes.c_uint64),
        ("ldx", ctypes.c_int64),
        ("ldy", ctypes.c_int64),
        ("locks", ctypes.c_uint64),      # zeroed lock memory the kernel leaves zeroed (stream-K), or 0
    ]


class Fp8GemmArgs(ctypes.Structure):
    """``abi::Fp8GemmArgs`` (cutlass_ext/mixgemm/gemm_entry_fp8.hpp): the arguments of an e4m3
    GEMM kernel, :class:`GemmArgs` (``x``: the e4m3 activations) and the per-token scales."""

    _fields_ = [
        ("gemm", GemmArgs),
        ("x_scales", ctypes.c_uint64),   # float32 [m]
    ]


class Launch(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("cluster", ctypes.c_uint32 * 3),
        ("smem_bytes", ctypes.c_uint32),
        ("params_bytes", ctypes.c_uint32),
        ("workspace_zero_bytes", ctypes.c_uint32),  # UINT32_MAX: all
        ("workspace_bytes", ctypes.c_uint64),
        ("lock_bytes", ctypes.c_uint64),   # zeroed locks the launch needs at GemmArgs.locks, left zeroed
    ]


def driver_entry_point(name: str, flag: Any = None, cuda_version: int = 12000) -> int:
    """The CUDA driver's function ``name`` for the ABI of ``cuda_version``, from
    ``cuGetProcAddress`` through cuda-python (the driver that cuda-python opened and that owns
    the contexts); ``flag``: a ``CUdriverProcAddress_flags`` (default: ``CU_GET_PROC_ADDRESS_DEFAULT``)."""
    drv = cuda_driver()
    if flag is None:
        flag = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    pfn, status = check(drv.cuGetProcAddress(name.encode(), cuda_version, flag), f"cuGetProcAddress({name})")
    if status != drv.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS or not pfn:
        raise BuildError(f"the CUDA driver has no {name} for CUDA {cuda_version // 1000}.0 ({status!r})")
    return int(pfn)


# ---------------------------------------------------------------------------------------------
# The host helpers (a GEMM kernel's helper.so) and a loaded kernel
# ---------------------------------------------------------------------------------------------
class HostHelper:
    """ctypes wrapper of a GEMM kernel's helper.so."""

    def __init__(self, path: str, kernel_name: str):
        self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        lib = self.lib
        lib.mixgemm_abi_version.restype = ctypes.c_int32
        lib.mixgemm_kernel_name.restype = ctypes.c_char_p
        lib.mixgemm_params_size.restype = ctypes.c_uint32
        lib.mixgemm_smem_size.restype = ctypes.c_uint32
        lib.mixgemm_gemm_check.argtypes = [ctypes.POINTER(GemmArgs), ctypes.c_char_p, ctypes.c_int]
        lib.mixgemm_gemm_check.restype = ctypes.c_int
        lib.mixgemm_gemm_workspace_size.argtypes = [ctypes.POINTER(GemmArgs)]
        lib.mixgemm_gemm_workspace_size.restype = ctypes.c_uint64
        lib.mixgemm_gemm_prepare.argtypes = [ctypes.POINTER(GemmArgs), ctypes.c_void_p, ctypes.c_uint32,
                                             ctypes.POINTER(Launch), ctypes.c_char_p, ctypes.c_int]
        lib.mixgemm_gemm_prepare.restype = ctypes.c_int
        self._lock_bytes = getattr(lib, "mixgemm_gemm_lock_bytes", None)   # GEMM helpers only
        if self._lock_bytes is not None:
            self._lock_bytes.argtypes = [ctypes.POINTER(GemmArgs)]
            self._lock_bytes.restype = ctypes.c_uint64
        if lib.mixgemm_abi_version() != ABI_VERSION:
            raise KernelError(f"{path}: helper ABI {lib.mixgemm_abi_version()} != runtime ABI {ABI_VERSION}")
        name = lib.mixgemm_kernel_name().decode()
        if name != kernel_name:
            raise KernelError(f"{path}: helper is for {name}, expected {kernel_name}")
        self.name = kernel_name
        self.params_size = int(lib.mixgemm_params_size())
        self.smem_size = int(lib.mixgemm_smem_size())

    def bind_driver(self) -> None:
        """Hand the helper the driver functions it calls itself: the decode kernels' helpers
        encode their scale rows' TMA descriptors on every call (cuTensorMapEncodeTiled). A no-op
        for the other helpers."""
        setter = getattr(self.lib, "mixgemm_set_tensor_map_encoder", None)
        if setter is not None:
            setter.argtypes = [ctypes.c_void_p]
            setter.restype = None
            setter(driver_entry_point("cuTensorMapEncodeTiled"))

    def check(self, args: GemmArgs) -> Optional[str]:
        return _checked(self.lib.mixgemm_gemm_check, args)

    def workspace_size(self, args: GemmArgs) -> int:
        return int(self.lib.mixgemm_gemm_workspace_size(ctypes.byref(args)))

    def lock_bytes(self, args: GemmArgs) -> int:
        """The zeroed lock memory a stream-K launch needs apart from its workspace (0: none; the
        decode kernels' helpers have no such function)."""
        fn = self._lock_bytes
        return 0 if fn is None else int(fn(ctypes.byref(args)))

    def _fp8(self, name: str):
        fn = getattr(self.lib, name, None)
        if fn is None:
            raise KernelError(f"{self.name} is not an e4m3 GEMM kernel (its helper has no {name})")
        if fn.argtypes is None:
            if name == "mixgemm_fp8_gemm_check":
                fn.argtypes = [ctypes.POINTER(Fp8GemmArgs), ctypes.c_char_p, ctypes.c_int]
            elif name == "mixgemm_fp8_gemm_memory":
                fn.argtypes = [ctypes.POINTER(Fp8GemmArgs), ctypes.POINTER(ctypes.c_uint64)]
            else:
                fn.argtypes = [ctypes.POINTER(Fp8GemmArgs), ctypes.c_void_p, ctypes.c_uint32,
                               ctypes.POINTER(Launch), ctypes.c_char_p, ctypes.c_int]
            fn.restype = ctypes.c_int
        return fn

    def check_fp8(self, args: Fp8GemmArgs) -> Optional[str]:
        """An e4m3 GEMM kernel's check of ``args`` (None: it can run them)."""
        return _checked(self._fp8("mixgemm_fp8_gemm_check"), args)

    def memory_fp8(self, args: Fp8GemmArgs) -> tuple[int, int]:
        """(workspace bytes, zeroed lock bytes) an e4m3 GEMM launch of ``args`` needs (its split
        factor decides them; (0, 0) for a launch of whole tiles)."""
        out = (ctypes.c_uint64 * 2)()
        if self._fp8("mixgemm_fp8_gemm_memory")(ctypes.byref(args), out):
            raise KernelError(f"{self.name}: null arguments to mixgemm_fp8_gemm_memory")
        return int(out[0]), int(out[1])

    def prepare_fp8(self, args: Fp8GemmArgs) -> tuple[ctypes.Array, Launch]:
        """An e4m3 GEMM kernel's params and launch shape for ``args`` (:meth:`prepare`'s)."""
        return self._prepared(self._fp8("mixgemm_fp8_gemm_prepare"), args)

    def prepare(self, args: GemmArgs) -> tuple[ctypes.Array, Launch]:
        return self._prepared(self.lib.mixgemm_gemm_prepare, args)

    def _prepared(self, fn, args) -> tuple[ctypes.Array, Launch]:
        """The params bytes and launch shape that the helper's prepare function ``fn`` writes for ``args``."""
        buf = ctypes.create_string_buffer(self.params_size)
        launch = Launch()
        err = ctypes.create_string_buffer(512)
        rc = fn(ctypes.byref(args), buf, self.params_size, ctypes.byref(launch), err, len(err))
        if rc != 0:
            raise KernelError(f"{self.name}: {err.value.decode()}")
        return buf, launch


def _checked(fn, args) -> Optional[str]:
    """What the helper's check function ``fn`` says of ``args`` (None: the kernel can run them)."""
    err = ctypes.create_string_buffer(512)
    rc = fn(ctypes.byref(args), err, len(err))
    return None if rc == 0 else err.value.decode()


@dataclasses.dataclass
class LoadedKernel:
    spec: KernelSpec
    device: torch.device
    module: Any
    function: Any
    helper: Optional[HostHelper]
    artifacts: Artifacts


# ---------------------------------------------------------------------------------------------
# torch's current stream
# ---------------------------------------------------------------------------------------------
def _stream_function() -> Callable[[int], int]:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and torch.cuda._is_compiled():
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def _capture_function() -> Callable[[], bool]:
    if torch.cuda._is_compiled():
        return torch._C._cuda_isCurrentStreamCapturing
    return lambda: False


#: the raw handle (int) of torch's current stream on a device index
current_stream: Callable[[int], int] = _stream_function()
#: whether torch's current stream is capturing a CUDA graph
capturing: Callable[[], bool] = _capture_function()
