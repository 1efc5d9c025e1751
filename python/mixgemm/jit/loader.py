"""Loading cubins and launching kernels with cuda-python (``cuda.bindings.driver``).

* Every driver call's ``(err, value...)`` result goes through :func:`check`, which raises
  :class:`CudaError` naming the operation, the kernel and the CUDA error.
* A GEMM kernel's ``Params`` come from its host helper library (``helper.so``, built from the
  same source): the TMA descriptors are encoded on the host. The bytes are passed by value with
  ``cuLaunchKernelEx`` through a ``void**`` (``cuda.core.launch`` cannot pass such a struct).
* Launches go to torch's current stream. :func:`launch_gemm` is the reference launch (params,
  workspace from torch's caching allocator and cuda-python objects made per call); the call path
  of :func:`mixgemm.gemm` launches cached plans instead (:mod:`mixgemm.dispatch.plans`,
  :mod:`mixgemm.jit.launcher`), which the tests compare with it bit for bit.
* Nothing is loaded at import time. Loaded kernels are kept in one :class:`KernelCache`, keyed
  by (kernel name, device); a kernel that is not loaded yet cannot be loaded during CUDA graph
  capture (warm up first).
"""
from __future__ import annotations

import ctypes
import functools
import threading
from typing import Callable, Optional

import torch

from . import driver
from .build import load_artifacts
from .launcher import entry_points
from .driver import GemmArgs, HostHelper, Launch, LoadedKernel, check, cuda_driver
from .specs import HELPER_KINDS, KernelSpec


# ---------------------------------------------------------------------------------------------
# Loaded kernels
# ---------------------------------------------------------------------------------------------
def _ensure_context(device: torch.device) -> None:
    """Make torch's (primary) context of ``device`` current on this thread for driver calls."""
    drv = cuda_driver()
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # forces torch to make the device's context current
        ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            dev = check(drv.cuDeviceGet(device.index), "cuDeviceGet")
            ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class KernelCache:
    """The process's loaded kernels, keyed by (kernel name, device index). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kernels: dict[tuple[str, int], LoadedKernel] = {}
        self._plain: dict[tuple[str, int], "PlainLaunch"] = {}

    def get(self, spec: KernelSpec, device: torch.device) -> LoadedKernel:
        if device.type == "cuda" and device.index is None:   # "cuda": the current device, one key for both
            device = torch.device("cuda", torch.cuda.current_device())
        key = (spec.name, device.index)
        with self._lock:
            k = self._kernels.get(key)
            if k is not None:
                return k
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"mixgemm kernel {spec.name} is not loaded yet and CUDA graph capture is in progress; "
                    "run the operation once with the same shapes (a warm-up) before capturing")
            k = self._load(spec, device)
            self._kernels[key] = k
            return k

    def loaded(self) -> list[str]:
        with self._lock:
            return sorted({name for name, _ in self._kernels})

    def plain_launch(self, spec: KernelSpec, device: torch.device, slot_types: tuple, block: int) -> "PlainLaunch":
        """The kernel of :meth:`get` as a :class:`PlainLaunch` (made on first use, then reused:
        an eager hot path launches it without building its arguments and config each call)."""
        kernel = self.get(spec, device)
        key = (spec.name, kernel.device.index)
        launch = self._plain.get(key)
        if launch is None:
            with self._lock:
                launch = self._plain.setdefault(key, PlainLaunch(kernel, slot_types, block))
        return launch

    @staticmethod
    def _load(spec: KernelSpec, device: torch.device) -> LoadedKernel:
        drv = cuda_driver()
        art, cubin = load_artifacts(spec)  # builds on first use (JIT), under the entry's lock
        helper = HostHelper(str(art.helper_path), spec.name) if isinstance(spec, HELPER_KINDS) else None
        _ensure_context(device)
        if helper is not None:
            helper.bind_driver()
        with torch.cuda.device(device):
            module = check(drv.cuModuleLoadData(cubin), f"cuModuleLoadData({spec.name})")
            function = check(drv.cuModuleGetFunction(module, spec.name.encode()),
                             f"cuModuleGetFunction({spec.name})")
            if helper is not None and helper.smem_size > 48 * 1024:
                check(drv.cuFuncSetAttribute(
                    function, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    helper.smem_size), f"cuFuncSetAttribute(max dynamic smem, {spec.name})")
        return LoadedKernel(spec, device, module, function, helper, art)


KERNELS = KernelCache()


def current_stream_ptr(device: torch.device) -> int:
    """torch's current stream on ``device`` as an integer handle (:data:`mixgemm.jit.driver.current_stream`:
    one C call where the installed torch has it; ``torch.cuda.current_stream`` builds a Stream
    object, a few us of an eager launch's host time on the GPU machine, docs/host-overhead.md)."""
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return int(driver.current_stream(index))


def stream_handle(device: torch.device):
    drv = cuda_driver()
    return drv.CUstream(current_stream_ptr(device))


def launch_gemm(kernel: LoadedKernel, args: GemmArgs) -> None:
    """Prepare params through the helper and launch on torch's current stream. A workspace is
    taken from torch's caching allocator; the part the helper says must start at zero (the split
    counters of the decode kernels) is zeroed on the same stream by a driver memset. A stream-K
    launch's locks are a fresh zeroed tensor (this reference path does not reuse them; the call
    path of :mod:`mixgemm.dispatch.plans` does, with no memset)."""
    drv = cuda_driver()
    helper = kernel.helper
    assert helper is not None
    workspace = locks = None
    ws_bytes = helper.workspace_size(args)
    if ws_bytes:
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=kernel.device)
        args.workspace = workspace.data_ptr()
    lock_bytes = helper.lock_bytes(args)
    if lock_bytes:
        locks = torch.zeros(lock_bytes, dtype=torch.uint8, device=kernel.device)
        args.locks = locks.data_ptr()
    params, launch = helper.prepare(args)
    stream = current_stream_ptr(kernel.device)
    if workspace is not None:
        zero = ws_bytes if launch.workspace_zero_bytes == 0xFFFFFFFF else min(ws_bytes, launch.workspace_zero_bytes)
        if zero:   # a memset on the stream (a memset node under graph capture), not a fill kernel
            check(drv.cuMemsetD8Async(drv.CUdeviceptr(workspace.data_ptr()), 0, zero, drv.CUstream(stream)),
                  "cuMemsetD8Async(workspace)")
    launch_prepared(kernel, params, launch, stream)
    # `workspace` and `locks` may be freed now: torch's allocator reuses them only in stream order.
    del workspace, locks


def launch_prepared(kernel: LoadedKernel, params: ctypes.Array, launch: Launch, stream: Optional[int] = None) -> None:
    """Launch ``kernel`` with params and a launch shape its helper prepared, on ``stream`` (an
    integer handle; default: torch's current stream), with its cluster shape and, where the
    kernel allows it, programmatic stream serialization. The driver's ``cuLaunchKernelEx`` is
    called through ctypes with a ``CUlaunchConfig`` built here (cuda-python's config and
    attribute objects took ~100 us of host time per launch on the GPU machine, docs/host-overhead.md)."""
    if stream is None:
        stream = current_stream_ptr(kernel.device)
    # (the helper's cluster shape, (1, 1, 1) included)
    config, _attrs = _launch_config(kernel, launch.grid, launch.block, int(stream), int(launch.smem_bytes),
                                    launch.cluster)
    _launch_with(kernel, config, (ctypes.c_void_p * 1)(ctypes.addressof(params)))


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): the id, padding to 8 bytes, the 64-byte value union."""

    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_uint32 * 16)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h)."""

    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("smem", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint32)]


@functools.lru_cache(maxsize=None)
def _plain_launch_entry() -> tuple[Callable[..., int], int]:
    """The driver's ``cuLaunchKernelEx`` as a ctypes function (the entry point cuda-python's
    driver gives, :func:`mixgemm.jit.launcher.entry_points`), and the PDL attribute's id."""

    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    pdl = int(cuda_driver().CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    return proto(entry_points().launch_kernel_ex), pdl


@functools.lru_cache(maxsize=None)
def _cluster_attribute_id() -> int:
    return int(cuda_driver().CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)


def _launch_config(kernel: LoadedKernel, grid, block, stream: int, smem: int = 0,
                   cluster=None) -> tuple[_LaunchConfig, ctypes.Array]:
    """A ``CUlaunchConfig`` for ``kernel`` (``grid`` and ``block``: three sizes each) with its
    attributes: the cluster shape if given, then programmatic stream serialization where the
    kernel allows it. Keep both alive: the config points at the attributes."""
    _, pdl_id = _plain_launch_entry()
    attrs = (_LaunchAttribute * 2)()
    n = 0
    if cluster is not None:
        attrs[n].id = _cluster_attribute_id()
        attrs[n].value[0], attrs[n].value[1], attrs[n].value[2] = cluster
        n += 1
    if kernel.spec.programmatic_launch:
        attrs[n].id = pdl_id
        attrs[n].value[0] = 1              # programmaticStreamSerializationAllowed
        n += 1
    config = _LaunchConfig((ctypes.c_uint32 * 3)(*grid), (ctypes.c_uint32 * 3)(*block), smem, stream,
                           ctypes.addressof(attrs), n)
    return config, attrs


def _launch_with(kernel: LoadedKernel, config: _LaunchConfig, argv: ctypes.Array) -> None:
    """The driver's ``cuLaunchKernelEx`` of ``kernel`` with ``config`` and a ``void**`` to its arguments."""
    launch_ex, _ = _plain_launch_entry()
    rc = launch_ex(ctypes.addressof(config), int(kernel.function), ctypes.addressof(argv), None)
    if rc:
        check(cuda_driver().CUresult(rc), f"cuLaunchKernelEx({kernel.spec.name})")


def launch_kernel(kernel: LoadedKernel, grid: tuple[int, int, int], block: int, args: tuple) -> None:
    """Launch a kernel without a host helper (its arguments are plain pointers and ints, given as
    ctypes values in order) on torch's current stream, with programmatic stream serialization
    where the kernel allows it (:func:`launch_prepared`'s rules). The driver's
    ``cuLaunchKernelEx`` is called through ctypes with a ``CUlaunchConfig`` built here, not
    cuda-python's config objects. A kernel launched on every call of an eager hot path keeps a
    :class:`PlainLaunch` instead (:meth:`KernelCache.plain_launch`)."""
    argv = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    config, _attrs = _launch_config(kernel, grid, (block, 1, 1), current_stream_ptr(kernel.device))
    _launch_with(kernel, config, argv)


class PlainLaunch:
    """:func:`launch_kernel` for one kernel with its argument slots, attribute and config made
    once and reused by every call (under a lock: they are shared): ``launch(grid_x, stream,
    *values)`` sets the slots' values (``slot_types``: the ctypes types of the kernel's
    arguments, in order), the grid's x and the stream, and launches ``block`` threads per CTA."""

    def __init__(self, kernel: LoadedKernel, slot_types: tuple, block: int):
        self.kernel = kernel
        self._launch_ex, self._function = _plain_launch_entry()[0], int(kernel.function)
        self._slots = tuple(t() for t in slot_types)
        self._argv = (ctypes.c_void_p * len(self._slots))(*(ctypes.addressof(a) for a in self._slots))
        self._config, self._attrs = _launch_config(kernel, (1, 1, 1), (block, 1, 1), 0)
        self._addrs = (ctypes.addressof(self._config), ctypes.addressof(self._argv))
        self._lock = threading.Lock()

    def __call__(self, grid_x: int, stream: int, *values) -> None:
        with self._lock:
            for slot, v in zip(self._slots, values):
                slot.value = v
            self._config.grid[0] = grid_x
            self._config.stream = stream
            rc = self._launch_ex(self._addrs[0], self._function, self._addrs[1], None)
        if rc:
            check(cuda_driver().CUresult(rc), f"cuLaunchKernelEx({self.kernel.spec.name})")


def aligned_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with a 16-byte aligned start (a copy only if it is not): what the
    plain-argument kernels' 16-byte vector loads need."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def launch_dequant(kernel: LoadedKernel, qdata: int, scales: int, zeros: int, out: int,
                   n: int, k: int, group_size: int) -> None:
    drv = cuda_driver()
    threads = 128
    atoms = (n // 16) * (k // 64)
    blocks = (atoms * 32 + threads - 1) // threads
    args = ((qdata, scales, zeros, out, n, k, group_size),
            (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int, ctypes.c_int, ctypes.c_int))
    check(drv.cuLaunchKernel(kernel.function, blocks, 1, 1, threads, 1, 1, 0, stream_handle(kernel.device),
                             args, 0), f"cuLaunchKernel({kernel.spec.name})")

