"""Launching a GEMM kernel from a launch plan: the compiled launcher, and the Python fallback.

A launch is: the kernel's ``Params`` encoded by its host helper (``mixgemm_gemm_prepare``: the
GEMM kernels' TMA descriptors embed the x and y pointers, so this runs on every call), the
leading bytes of the workspace zeroed when the helper says so, and ``cuLaunchKernelEx``.

* :class:`CompiledLauncher` does all of it in one C call (``csrc/launcher.cpp``, built once per
  machine with nvcc into mixgemm's kernel cache, :func:`mixgemm.jit.build.load_host_library`). It
  is handed the helper's ``mixgemm_gemm_prepare`` and the driver's ``cuLaunchKernelEx`` and
  ``cuMemsetD8Async`` as function pointers (from ``cuGetProcAddress`` through cuda-python,
  which keeps loading the modules and owning the contexts), so it links no CUDA library.
* :func:`python_launch` does the same with ctypes and cuda-python (its ``CUlaunchConfig`` and
  attribute objects made once per plan and reused): the path when no compiler is available
  (a machine with prebuilt kernels), or with ``MIXGEMM_LAUNCHER=python``.

Both are made per plan by :func:`bind` and called with what changes per call; both answer with
a :class:`LaunchResult` and fill this thread's :class:`LaunchCall` (the workspace a launch needs,
the helper's refusal, the failed driver call), which :func:`raise_for` turns into the errors the
reference path (:func:`mixgemm.jit.loader.launch_gemm`) raises.

``MIXGEMM_LAUNCHER``: ``auto`` (default: the compiled launcher, else Python with a warning),
``compiled`` (fail if it cannot be built) or ``python``.
"""
from __future__ import annotations

import ctypes
import enum
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Callable, Optional

from ..errors import BuildError, KernelError
from .build import load_host_library
from .driver import ABI_VERSION, GemmArgs, Launch, LoadedKernel, check, cuda_driver, driver_entry_point

log = logging.getLogger("mixgemm")

SOURCE = Path(__file__).resolve().parent / "csrc" / "launcher.cpp"
#: kLauncherVersion (cutlass_ext/mixgemm/launcher_abi.hpp): the structures below mirror that version's
LAUNCHER_VERSION = 2
LAUNCHER_ENV = "MIXGEMM_LAUNCHER"


class LaunchResult(enum.IntEnum):
    """What a launch did (``MixgemmLaunchResult``, cutlass_ext/mixgemm/launcher_abi.hpp)."""

    LAUNCHED = 0
    REFUSED = 1          # the helper refused the arguments (LaunchCall.message)
    NEED_WORKSPACE = 2   # the launch needs LaunchCall.workspace_bytes > the capacity on offer; nothing ran
    DRIVER_ERROR = 3     # a driver call failed (LaunchCall.cuda_error, failed_call)
    NEED_LOCKS = 4       # the launch needs LaunchCall.lock_bytes > the zeroed locks on offer; nothing ran


class LaunchPlanStruct(ctypes.Structure):
    """``MixgemmLaunchPlan``: filled once per plan."""

    _fields_ = [
        ("version", ctypes.c_int32),
        ("programmatic", ctypes.c_int32),
        ("function", ctypes.c_uint64),
        ("prepare", ctypes.c_uint64),
        ("launch_kernel_ex", ctypes.c_uint64),
        ("memset_d8_async", ctypes.c_uint64),
        ("args", GemmArgs),
    ]


class LaunchCall(ctypes.Structure):
    """``MixgemmLaunchCall``: one call's inputs (packed by :data:`_CALL_INPUTS`) and outputs."""

    _fields_ = [
        ("m", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("x", ctypes.c_uint64),
        ("ldx", ctypes.c_int64),
        ("y", ctypes.c_uint64),
        ("ldy", ctypes.c_int64),
        ("bias", ctypes.c_uint64),
        ("workspace", ctypes.c_uint64),
        ("workspace_capacity", ctypes.c_uint64),
        ("locks", ctypes.c_uint64),
        ("locks_capacity", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("workspace_bytes", ctypes.c_uint64),
        ("lock_bytes", ctypes.c_uint64),
        ("cuda_error", ctypes.c_int32),
        ("failed_call", ctypes.c_int32),   # 1: cuMemsetD8Async, 2: cuLaunchKernelEx
        ("message", ctypes.c_char * 256),
    ]


#: LaunchCall's inputs, written in one struct.pack_into (far cheaper than ten ctypes field stores)
_CALL_INPUTS = struct.Struct("=iiQqQqQQQQQQ")
assert _CALL_INPUTS.size == LaunchCall.workspace_bytes.offset

_tls = threading.local()


def current_call() -> LaunchCall:
    """This thread's LaunchCall: the one the last launch on this thread filled."""
    try:
        return _tls.call[0]
    except AttributeError:
        return _new_call()[0]


def _new_call() -> tuple[LaunchCall, int]:
    call = LaunchCall()
    _tls.call = (call, ctypes.addressof(call))
    return _tls.call


def raise_for(result: int, kernel: LoadedKernel) -> None:
    """Raise the error a failed launch (REFUSED or DRIVER_ERROR) stands for, with the message
    :func:`mixgemm.jit.loader.launch_gemm` gives."""
    call = current_call()
    if result == LaunchResult.REFUSED:
        raise KernelError(f"{kernel.spec.name}: {call.message.decode(errors='replace')}")
    if result == LaunchResult.DRIVER_ERROR:
        what = f"cuLaunchKernelEx({kernel.spec.name})" if call.failed_call == 2 else "cuMemsetD8Async(workspace)"
        check(cuda_driver().CUresult(call.cuda_error), what)
    raise RuntimeError(f"mixgemm launch of {kernel.spec.name} ended with {result!r}")


# ---------------------------------------------------------------------------------------------
# Driver entry points
# ---------------------------------------------------------------------------------------------
class DriverEntryPoints:
    """The driver functions the compiled launcher calls, from cuda-python's ``cuGetProcAddress``
    (so they are the driver cuda-python opened). The stream flavour follows cuda-python's: the
    legacy default stream, unless ``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM`` is set, as
    torch's stream 0 is."""

    #: the CUDA version whose ABI of these functions is asked for (cuLaunchKernelEx: 12.0)
    CUDA_VERSION = 12000

    def __init__(self):
        drv = cuda_driver()
        flags = drv.CUdriverProcAddress_flags
        per_thread = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
        flag = flags.CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM if per_thread \
            else flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
        self.launch_kernel_ex = driver_entry_point("cuLaunchKernelEx", flag, self.CUDA_VERSION)
        self.memset_d8_async = driver_entry_point("cuMemsetD8Async", flag, self.CUDA_VERSION)


_entry_points: Optional[DriverEntryPoints] = None
_entry_lock = threading.Lock()


def entry_points() -> DriverEntryPoints:
    global _entry_points
    with _entry_lock:
        if _entry_points is None:
            _entry_points = DriverEntryPoints()
        return _entry_points


# ---------------------------------------------------------------------------------------------
# The compiled launcher
# ---------------------------------------------------------------------------------------------
class CompiledLauncher:
    """``csrc/launcher.cpp`` loaded with ctypes. The library is loaded as a ``PyDLL`` (the GIL
    stays held during a launch of a few microseconds), so the call needs no lock."""

    def __init__(self, path: Path):
        self.path = Path(path)
        lib = ctypes.PyDLL(str(path), mode=ctypes.RTLD_LOCAL)
        for name in ("mixgemm_launcher_version", "mixgemm_launcher_abi_version"):
            getattr(lib, name).restype = ctypes.c_int32
        for name in ("mixgemm_launcher_plan_size", "mixgemm_launcher_call_size", "mixgemm_launcher_max_params"):
            getattr(lib, name).restype = ctypes.c_uint32
        got = (lib.mixgemm_launcher_version(), lib.mixgemm_launcher_abi_version(),
               lib.mixgemm_launcher_plan_size(), lib.mixgemm_launcher_call_size())
        want = (LAUNCHER_VERSION, ABI_VERSION, ctypes.sizeof(LaunchPlanStruct), ctypes.sizeof(LaunchCall))
        if got != want:
            raise BuildError(f"{path}: launcher (version, ABI, plan size, call size) {got} != {want} expected")
        self.max_params = int(lib.mixgemm_launcher_max_params())
        proto = ctypes.PYFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p)
        self.launch = proto(("mixgemm_launch", lib))
        self.lib = lib

    def bind(self, kernel: LoadedKernel, args: GemmArgs, entry: DriverEntryPoints) -> Callable[..., int]:
        """``launch(m, x, ldx, y, ldy, bias, workspace, workspace_capacity, locks, locks_capacity,
        stream) -> LaunchResult`` for ``kernel`` with ``args`` (every field but the call's)."""
        helper = kernel.helper
        if helper.params_size > self.max_params:
            raise KernelError(f"{kernel.spec.name}: {helper.params_size} bytes of parameters, the launcher "
                              f"takes at most {self.max_params}")
        plan = LaunchPlanStruct(
            version=LAUNCHER_VERSION, programmatic=int(kernel.spec.programmatic_launch),
            function=int(kernel.function),
            prepare=ctypes.cast(helper.lib.mixgemm_gemm_prepare, ctypes.c_void_p).value,
            launch_kernel_ex=entry.launch_kernel_ex, memset_d8_async=entry.memset_d8_async,
            args=GemmArgs.from_buffer_copy(args))
        plan_addr = ctypes.addressof(plan)
        call_c, pack, tls = self.launch, _CALL_INPUTS.pack_into, _tls

        def launch(m, x, ldx, y, ldy, bias, workspace, capacity, locks, locks_capacity, stream,
                   _keep=(plan, helper)):
            try:
                call, call_addr = tls.call
            except AttributeError:
                call, call_addr = _new_call()
            pack(call, 0, m, 0, x, ldx, y, ldy, bias, workspace, capacity, locks, locks_capacity, stream)
            return call_c(plan_addr, call_addr)

        launch.plan = plan   # the torch operator library copies it (mixgemm.jit.torch_ops)
        return launch

    @property
    def launch_address(self) -> int:
        """The address of ``mixgemm_launch`` (the torch operator library calls it)."""
        return ctypes.cast(self.launch, ctypes.c_void_p).value


# ---------------------------------------------------------------------------------------------
# The Python fallback
# ---------------------------------------------------------------------------------------------
def python_launch(kernel: LoadedKernel, args: GemmArgs) -> Callable[..., int]:
    """:meth:`CompiledLauncher.bind`'s launch, in Python: the helper through ctypes, the driver
    through cuda-python, with the argument, params and launch buffers and the ``CUlaunchConfig``
    and attribute objects made once here and reused (under a lock: they are shared)."""
    drv = cuda_driver()
    helper = kernel.helper
    a = GemmArgs.from_buffer_copy(args)
    params = ctypes.create_string_buffer(helper.params_size)
    out = Launch()
    err = ctypes.create_string_buffer(256)
    prepare = helper.lib.mixgemm_gemm_prepare
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    argv_addr = ctypes.addressof(argv)
    config = drv.CUlaunchConfig()
    cluster = drv.CUlaunchAttribute()
    cluster.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attrs = [cluster]
    if kernel.spec.programmatic_launch:
        pdl = drv.CUlaunchAttribute()
        pdl.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        pdl.value.programmaticStreamSerializationAllowed = 1
        attrs.append(pdl)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    function = kernel.function
    success = drv.CUresult.CUDA_SUCCESS
    lock = threading.Lock()
    last = {"cluster": None, "stream": None}

    def launch(m, x, ldx, y, ldy, bias, workspace, capacity, locks, locks_capacity, stream,
               _keep=argv):   # argv_addr points into argv
        call = current_call()
        with lock:
            a.m, a.x, a.ldx, a.y, a.ldy, a.bias = m, x, ldx, y, ldy, bias
            a.workspace = workspace if capacity else 0
            a.locks = locks if locks_capacity else 0
            ctypes.memset(ctypes.addressof(out), 0, ctypes.sizeof(out))
            rc = prepare(ctypes.byref(a), params, len(params), ctypes.byref(out), err, len(err))
            call.workspace_bytes = out.workspace_bytes
            call.lock_bytes = out.lock_bytes
            if out.workspace_bytes > capacity:
                return LaunchResult.NEED_WORKSPACE
            if out.lock_bytes > locks_capacity:
                return LaunchResult.NEED_LOCKS
            if rc != 0:
                call.message = err.value
                return LaunchResult.REFUSED
            if stream != last["stream"]:
                config.hStream = drv.CUstream(stream)
                last["stream"] = stream
            if out.workspace_bytes:
                zero = out.workspace_bytes if out.workspace_zero_bytes == 0xFFFFFFFF \
                    else min(out.workspace_bytes, out.workspace_zero_bytes)
                if zero:
                    (e,) = drv.cuMemsetD8Async(drv.CUdeviceptr(workspace), 0, zero, config.hStream)
                    if e != success:
                        call.cuda_error, call.failed_call = int(e), 1
                        return LaunchResult.DRIVER_ERROR
            config.gridDimX, config.gridDimY, config.gridDimZ = out.grid
            config.blockDimX, config.blockDimY, config.blockDimZ = out.block
            config.sharedMemBytes = out.smem_bytes
            dims = tuple(out.cluster)
            if dims != last["cluster"]:    # the config holds a copy of its attributes
                dim = config.attrs[0].value.clusterDim
                dim.x, dim.y, dim.z = dims
                last["cluster"] = dims
            (e,) = drv.cuLaunchKernelEx(config, function, argv_addr, 0)
            if e != success:
                call.cuda_error, call.failed_call = int(e), 2
                return LaunchResult.DRIVER_ERROR
            return LaunchResult.LAUNCHED

    return launch


# ---------------------------------------------------------------------------------------------
# Choosing one
# ---------------------------------------------------------------------------------------------
_compiled: Optional[CompiledLauncher] = None
_compiled_tried = False
_compiled_lock = threading.Lock()


def mode() -> str:
    value = os.environ.get(LAUNCHER_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "compiled", "python"):
        raise ValueError(f"{LAUNCHER_ENV} must be auto, compiled or python, got {value!r}")
    return value


def build_compiled() -> Path:
    """Build the compiled launcher into the cache (if it is not there yet); its path."""
    return load_host_library("launcher", SOURCE.read_text(), lambda path: path)


def load_compiled() -> CompiledLauncher:
    """Build (once per machine: it is cached like the kernels) and load the compiled launcher."""
    return load_host_library("launcher", SOURCE.read_text(), CompiledLauncher)


def compiled() -> Optional[CompiledLauncher]:
    """The process's compiled launcher, or None where it cannot be had (then launches go through
    :func:`python_launch`; ``MIXGEMM_LAUNCHER=compiled`` makes that an error instead). Tried
    once per process."""
    global _compiled, _compiled_tried
    want = mode()
    if want == "python":
        return None
    with _compiled_lock:
        if not _compiled_tried:
            _compiled_tried = True
            try:
                _compiled = load_compiled()
            except (BuildError, OSError) as e:
                if want == "compiled":
                    raise
                log.warning("mixgemm: the compiled launcher is not available (%s); launching from Python, "
                            "which costs more host time per call", str(e).splitlines()[0])
        if _compiled is None and want == "compiled":
            raise BuildError("MIXGEMM_LAUNCHER=compiled, but the compiled launcher could not be built or loaded")
        return _compiled


def reset() -> None:
    """Forget the loaded launcher and driver entry points (tests)."""
    global _compiled, _compiled_tried, _entry_points
    with _compiled_lock:
        _compiled, _compiled_tried = None, False
    with _entry_lock:
        _entry_points = None


def bind(kernel: LoadedKernel, args: GemmArgs) -> tuple[Callable[..., int], str]:
    """The launch function of a plan (compiled when available) and which one it is."""
    lib = compiled()
    if lib is not None:
        return lib.bind(kernel, args, entry_points()), "compiled"
    return python_launch(kernel, args), "python"
