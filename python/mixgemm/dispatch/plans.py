"""Launch plans: what a GEMM call launches, decided once, and the per-call work that is left.

A :class:`LaunchPlan` holds everything about a launch that does not change from one call to the
next: the kernel (loaded), its split factor, raster and swizzle, the fused activation, the
weight's pointers, and the launch function bound to them (:func:`mixgemm.jit.launcher.bind`: one C
call that encodes the params and launches, or its Python fallback). What is left per call is
what a call brings: the token count, the x, y and bias pointers, the stream and a workspace.

Plans are cached in :data:`PLANS`, keyed by everything that decides the launch:

* the weight: the identity of its ``qdata`` tensor in the key; the plan keeps weak references to
  ``qdata``, ``scales``, ``zeros`` and ``zero_offsets`` and the data pointers of the first three
  (baked into the kernel arguments), and every call checks them, with the weight type, group
  size, N and K: a buffer replaced or moved (``module.to(...)``, a new tensor, ``.data = ...``)
  misses, and a plan is dropped when its ``qdata`` is freed;
* the token-count bucket (:func:`mixgemm.dispatch.heuristic.token_bucket`: the heuristic's choice is the
  same for every M of a bucket on a given layer and GPU), the activation, x's dtype and device
  index (and the plan checks the device type: CUDA);
* whether the current stream is capturing a CUDA graph (a captured launch may not grow memory).

What a launch needs besides its plan -- a workspace, and for a stream-K kernel zeroed locks,
which the kernel leaves zeroed (cutlass_ext's ``streamk_scheduler.hpp``) -- comes from
:data:`WORKSPACES` and :data:`LOCKS`: one buffer per stream, of driver memory outside torch's
allocator, made and grown outside captures (:class:`StreamArenas`). So no launch zeroes
anything, and nothing a CUDA-graph capture allocates outlives it: torch.compile's CUDA-graph
trees (``mode="reduce-overhead"``) accept the graphs.

:func:`run` is the hot path: a few attribute reads check a call against its plan, and anything
unusual (a miss, another dtype or device, a non-contiguous bias, a subclass of Tensor) returns
None, so that the caller takes the full path (:func:`mixgemm.ops.gemm`'s validation with its
error messages, then a new plan).
"""
from __future__ import annotations

import logging
import math
import threading
import weakref
from typing import Optional

import torch

from . import heuristic
from ..dtypes import WeightType
from ..errors import BuildError
from ..jit import launcher, torch_ops
from ..jit.driver import (ABI_VERSION, GemmArgs, LoadedKernel, capturing, check, cuda_driver, current_stream,
                          driver_entry_point)
from ..jit.specs import Activation, Raster
from ..weights.types import PackedWeight

log = logging.getLogger("mixgemm")


_Tensor = torch.Tensor


def _no_tensor():
    """The "weak reference" of an absent tensor (zeros of a symmetric weight, no offsets)."""
    return None


class LaunchPlan:
    """One cached launch decision (see the module docstring). ``launch`` is bound to the kernel
    and the weight; ``backend`` says which launcher it is ("compiled" or "python")."""

    __slots__ = ("key", "spec", "kernel", "device", "device_index", "is_cuda", "dtype", "weight_type",
                 "group_size", "n", "k", "n_out", "activation", "splits", "raster", "swizzle", "capturing",
                 "bias_shape", "qdata_ref", "scales_ref", "zeros_ref", "offsets_ref", "qdata_ptr", "scales_ptr",
                 "zeros_ptr", "signature", "args", "launch", "backend", "uses_locks", "op_key", "__weakref__")

    def made_for(self, w: PackedWeight, spec, splits: int) -> bool:
        """Whether this plan launches ``spec`` with ``splits`` on exactly ``w``'s tensors."""
        return (self.spec == spec and self.splits == max(0, int(splits)) and self.qdata_ref() is w.qdata
                and self.scales_ref() is w.scales and self.zeros_ref() is w.zeros
                and self.offsets_ref() is w.zero_offsets and self.qdata_ptr == w.qdata.data_ptr()
                and self.scales_ptr == w.scales.data_ptr()
                and self.zeros_ptr == (0 if w.zeros is None else w.zeros.data_ptr())
                and (self.weight_type, self.group_size, self.n, self.k) == (w.weight_type, w.group_size, w.n, w.k))

    def __repr__(self) -> str:
        return (f"LaunchPlan({self.spec.name}, n={self.n}, k={self.k}, splits={self.splits}, "
                f"activation={self.activation}, {self.device}, {self.dtype}, capturing={self.capturing}, "
                f"{self.backend})")


def make_plan(spec, kernel: "LoadedKernel", w: PackedWeight, *, dtype: torch.dtype, device: torch.device,
              activation: Optional[str], splits: int, raster: "Raster", swizzle: int, sm_count: int,
              capturing: bool, key: Optional[tuple] = None) -> LaunchPlan:
    """A plan for ``w`` on ``kernel``, from decisions already made and checked by the caller
    (:mod:`mixgemm.ops`): ``activation`` is the one the kernel applies."""

    p = LaunchPlan()
    p.key, p.spec, p.kernel = key, spec, kernel
    p.device, p.dtype, p.is_cuda = device, dtype, device.type == "cuda"
    p.device_index = device.index if device.index is not None else -1   # as Tensor.get_device()
    p.weight_type, p.group_size, p.n, p.k = w.weight_type, w.group_size, w.n, w.k
    p.n_out = w.n // 2 if activation == "swiglu" else w.n
    p.activation, p.raster, p.swizzle, p.capturing = activation, raster, swizzle, capturing
    p.splits = max(0, int(splits))
    p.bias_shape = (w.n,)
    p.qdata_ref = weakref.ref(w.qdata)
    p.scales_ref = weakref.ref(w.scales)
    p.zeros_ref = _no_tensor if w.zeros is None else weakref.ref(w.zeros)
    p.offsets_ref = _no_tensor if w.zero_offsets is None else weakref.ref(w.zero_offsets)
    p.qdata_ptr, p.scales_ptr = w.qdata.data_ptr(), w.scales.data_ptr()
    p.zeros_ptr = 0 if w.zeros is None else w.zeros.data_ptr()
    # what run() compares a call's weight with, in one tuple
    p.signature = (p.qdata_ptr, p.scales_ptr, p.zeros_ptr, p.weight_type, p.group_size, p.n, p.k)
    a = GemmArgs()
    a.abi_version = ABI_VERSION
    a.n, a.k, a.group_size, a.sm_count = w.n, w.k, w.group_size, sm_count
    a.splits = p.splits
    a.raster, a.swizzle = raster.abi, swizzle
    a.activation = Activation(activation or "none").abi
    a.weight, a.scales, a.zeros = p.qdata_ptr, p.scales_ptr, p.zeros_ptr
    p.args = a
    p.launch, p.backend = launcher.bind(kernel, a)
    p.uses_locks = bool(getattr(spec, "self_resetting_locks", False))
    p.op_key = None   # set when the torch operator library holds a copy (OperatorLibrary.put)
    return p


def plan_key(qdata: torch.Tensor, bucket, activation: Optional[str], dtype: torch.dtype,
             device: torch.device) -> tuple:
    """The cache key of a plan (as :func:`run` builds it): the weight (its ``qdata``'s identity;
    the plan checks the rest), the token-count bucket, the activation, x's dtype and device index
    (the plan checks the device type). The capture state picks one of the entry's two plans.
    :func:`mixgemm.ops.gemm_with_spec` puts its caller's kernel and launch order (a tuple) in
    the bucket's place."""
    return (id(qdata), bucket, activation, dtype, device.index if device.index is not None else -1)


class PlanCache:
    """The process's launch plans: ``(id(qdata), token bucket, activation, dtype, device)`` ->
    ``[eager plan, captured plan]``. A plan leaves the cache when its ``qdata`` is freed."""

    def __init__(self):
        self._plans: dict[tuple, list] = {}
        self._lock = threading.RLock()
        #: plans made since the process started (or the last clear()): a test's "no re-plan"
        self.made = 0

    def get(self, key: tuple, capturing: bool) -> Optional[LaunchPlan]:
        entry = self._plans.get(key)
        return None if entry is None else entry[capturing]

    def put(self, plan: LaunchPlan) -> None:
        key = plan.key
        with self._lock:
            entry = self._plans.setdefault(key, [None, None])
            old, entry[plan.capturing] = entry[plan.capturing], plan
            self.made += 1
            if old is not None:
                OPERATORS.drop(old)
            OPERATORS.put(plan)
        # forget the plan with its weight (the key holds the weight's id, which may be reused)
        plan.qdata_ref = weakref.ref(plan.qdata_ref(), self._evictor(key))

    def _evictor(self, key: tuple):
        cache = weakref.ref(self)

        def evict(ref):    # may run inside any allocation (the GC): hence the re-entrant lock
            me = cache()
            if me is None:
                return
            with me._lock:
                entry = me._plans.get(key)
                if entry is None:
                    return
                for i, p in enumerate(entry):
                    if p is not None and p.qdata_ref is ref:
                        entry[i] = None
                        OPERATORS.drop(p)
                if entry == [None, None]:
                    del me._plans[key]
        return evict

    def __len__(self) -> int:
        return sum(p is not None for entry in list(self._plans.values()) for p in entry)

    def plans(self) -> list[LaunchPlan]:
        return [p for entry in list(self._plans.values()) for p in entry if p is not None]

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.made = 0
            OPERATORS.clear_plans()


PLANS = PlanCache()


class DeviceBuffer:
    """``nbytes`` of device memory from the CUDA driver (``cuMemAlloc``), outside torch's caching
    allocator: memory that belongs to no CUDA-graph memory pool, so a buffer made while
    torch.compile's CUDA-graph trees warm a graph up (which routes the thread's torch allocations
    to the graph's pool) is not mistaken for an allocation of the graph, and a graph captured
    with its address may use it for the graph's whole life. Freed by :meth:`free` only."""

    __slots__ = ("ptr", "nbytes", "device", "__weakref__")

    def __init__(self, device: torch.device, nbytes: int):

        drv = cuda_driver()
        self.device, self.nbytes = device, int(nbytes)
        if device.type == "cuda":
            with torch.cuda.device(device):   # the device's primary context, current
                self.ptr = int(check(drv.cuMemAlloc(self.nbytes), "cuMemAlloc"))
        else:   # the tests' fake driver
            self.ptr = int(check(drv.cuMemAlloc(self.nbytes), "cuMemAlloc"))

    def zero(self, stream: int) -> None:
        """Queue ``memset(0)`` of the whole buffer on ``stream``."""

        drv = cuda_driver()
        check(drv.cuMemsetD8Async(drv.CUdeviceptr(self.ptr), 0, self.nbytes, drv.CUstream(stream)),
              "cuMemsetD8Async")

    def read(self) -> bytes:
        """The buffer's bytes (synchronizes the device: for tests)."""

        drv = cuda_driver()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        host = bytearray(self.nbytes)
        check(drv.cuMemcpyDtoH(host, drv.CUdeviceptr(self.ptr), self.nbytes), "cuMemcpyDtoH")
        return bytes(host)

    def free(self) -> None:
        """Give the memory back (the caller makes sure nothing still uses it)."""

        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            check(cuda_driver().cuMemFree(cuda_driver().CUdeviceptr(ptr)), "cuMemFree")


class StreamArenas:
    """One buffer per (device index, stream), of :class:`DeviceBuffer` memory, grown (to a power
    of two) when a launch on the stream needs more: the workspaces (:data:`WORKSPACES`) and the
    stream-K locks (:data:`LOCKS`) of the GEMM launches.

    * **Eager launches** use their stream's buffer. Reuse is safe in stream order: every launch
      that uses it, and a memset that zeroes it, are queued on that stream.
    * **Launches under CUDA-graph capture** use the capturing stream's buffer when it is large
      enough (torch.compile's CUDA-graph trees warm each graph up eagerly on the stream they then
      capture on, which grows it), and otherwise memory from torch's allocator in the graph's
      pool, released as soon as the launch is queued. A buffer is never made or grown during a
      capture, and nothing a capture allocates outlives it.
    * A buffer that is replaced by a larger one is kept, not freed, until :meth:`clear`: a graph
      captured with its address may still replay it.

    Launches that share a buffer must not run concurrently: a graph that used a stream's buffer
    must be replayed in order with that stream's launches (as CUDA-graph trees do), not at the same
    time on another stream.

    ``zeroed``: the buffers of :data:`LOCKS` are zeroed when made (on the stream, before the
    launch that asked), and every launch that uses them leaves them zeroed.
    """

    MIN_BYTES = 1 << 16

    def __init__(self, kind: int, zeroed: bool = False):
        #: which of the torch operator library's buffer kinds this is (torch_ops.*_ARENA)
        self.kind = kind
        self.zeroed = zeroed
        self._buffers: dict[tuple[int, int], tuple[DeviceBuffer, int, int]] = {}
        self._retired: list[DeviceBuffer] = []
        self._lock = threading.Lock()

    def get(self, device_index: int, stream: int) -> Optional[tuple[DeviceBuffer, int, int]]:
        """(buffer, pointer, bytes) of the stream's buffer, or None."""
        return self._buffers.get((device_index, stream))

    def offer(self, device_index: int, stream: int) -> tuple[int, int]:
        """(pointer, bytes) of the stream's buffer, or (0, 0)."""
        have = self._buffers.get((device_index, stream))
        return (0, 0) if have is None else (have[1], have[2])

    def grow(self, device: torch.device, device_index: int, stream: int, nbytes: int) -> tuple[DeviceBuffer, int, int]:
        """The stream's buffer, replaced by one of at least ``nbytes`` if it is smaller. Not
        during a capture of the stream."""
        with self._lock:
            have = self._buffers.get((device_index, stream))
            if have is not None and have[2] >= nbytes:
                return have
            size = max(self.MIN_BYTES, 1 << (int(nbytes) - 1).bit_length())
            buf = DeviceBuffer(device, size)
            if self.zeroed:
                buf.zero(stream)
            if have is not None:
                self._retired.append(have[0])
            entry = (buf, buf.ptr, size)
            self._buffers[(device_index, stream)] = entry
            OPERATORS.set_arena(self.kind, device_index, stream, buf.ptr, size)
            return entry

    def mirror(self) -> None:
        """Offer every buffer to the torch operator library's launches too."""
        with self._lock:
            for (device_index, stream), (_, ptr, size) in self._buffers.items():
                OPERATORS.set_arena(self.kind, device_index, stream, ptr, size)

    def buffers(self) -> list[DeviceBuffer]:
        """Every buffer held, the replaced ones too (a test's view: a lock buffer must be all
        zeros whenever the GPU is idle)."""
        with self._lock:
            return [e[0] for e in self._buffers.values()] + list(self._retired)

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    def clear(self) -> None:
        """Free every buffer, after the devices that use them are idle. Graphs captured before
        must not be replayed afterwards."""
        with self._lock:
            held = [e[0] for e in self._buffers.values()] + self._retired
            for device_index, stream in self._buffers:
                OPERATORS.set_arena(self.kind, device_index, stream, 0, 0)
            self._buffers, self._retired = {}, []
        for device in {b.device for b in held if b.device.type == "cuda"}:
            torch.cuda.synchronize(device)
        for b in held:
            b.free()


#: the GEMM launches' workspaces (split-K and stream-K partials; the launcher zeroes the prefix
#: a launch needs, in the launch's stream order)
WORKSPACES = StreamArenas(torch_ops.WORKSPACE_ARENA)
#: the stream-K GEMM kernels' locks: zeroed when made, and each launch leaves them zeroed
#: (cutlass_ext/mixgemm/streamk_scheduler.hpp), so no launch zeroes anything
LOCKS = StreamArenas(torch_ops.LOCK_ARENA, zeroed=True)


class OperatorLibrary:
    """The plan cache's link to the torch operator library (:mod:`mixgemm.jit.torch_ops`: the C++
    kernels of ``mixgemm::gemm``, the RMSNorm operators, ``mixgemm::rotary_kv_cache`` and
    ``mixgemm::fused_moe``, which torch.compile's graphs reach without Python).

    :meth:`attach` loads the library once per process (the Python kernel of an operator calls it
    on its first CUDA call, and so do the eager :func:`mixgemm.ops.norm.rms_norm` and
    :func:`mixgemm.ops.rotary.rotary_kv_cache` on their first CUDA call that the kernel takes;
    eager GEMMs alone never build it), and hands over every plan made so far and every stream's
    buffers. From then on :class:`PlanCache` hands over each plan it keeps (a copy: GEMM plans of
    the compiled launcher, without zero offsets, for a token bucket) and drops each one it
    forgets, and :class:`StreamArenas` mirrors its buffers; :mod:`mixgemm.ops.norm` and
    :mod:`mixgemm.ops.rotary` hand over their loaded kernels (:meth:`put_norm`, :meth:`put_rope`;
    :meth:`holds_norm` and :meth:`holds_rope` say which it holds, so that their eager calls go to
    the operators, whose C++ kernels launch them), and :mod:`mixgemm.moe.layer` the MoE plans of
    ``mixgemm::fused_moe``'s routed decode plan (:meth:`put_moe`), each dropped when the memory
    of one of its weight tensors is freed. Until then, and where the library cannot be built, every method but
    :meth:`attach` does nothing."""

    def __init__(self):
        self.lib: Optional[torch_ops.TorchOps] = None
        self._norms: set = set()
        self._ropes: set = set()
        self._tried = False
        self._lock = threading.Lock()
        #: the MoE plans held: key tuple -> (MoeKey, weak references to its weights' storages)
        self._moe: dict[tuple, tuple] = {}
        # (re-entrant: a weight's finalizer may run inside any allocation, the GC's, under put_moe)
        self._moe_lock = threading.RLock()

    def attach(self) -> Optional[torch_ops.TorchOps]:
        """Load the library and hand it what exists (once per process; then a flag check). None
        where it cannot be had (``MIXGEMM_TORCH_OPS=python``, no compiled launcher, no nvcc, a
        torch without CUDA): the operator then keeps its Python kernel."""
        if self._tried:
            return self.lib
        want = torch_ops.mode()
        with self._lock:
            if self._tried:
                return self.lib
            self._tried = True
            if want == "python":
                return None
            try:
                compiled = launcher.compiled()
                if compiled is None:
                    raise BuildError("the compiled launcher is not available")
                lib = torch_ops.load()
                lib.init(compiled.launch_address, driver_entry_point("cuStreamIsCapturing"), heuristic.TOKEN_BUCKETS,
                         [wt.value for wt in WeightType], [a.value for a in Activation])
            except (BuildError, OSError) as e:
                if want == "compiled":
                    raise
                log.warning("mixgemm: the torch operator library is not available (%s); compiled graphs call "
                            "mixgemm's Python kernels (and eager norm and rotary calls launch from Python), "
                            "which costs more host time per call",
                            str(e).splitlines()[0])
                return None
            self.lib = lib
        for plan in PLANS.plans():
            self.put(plan)
        WORKSPACES.mirror()
        LOCKS.mirror()
        return lib

    def put(self, plan: LaunchPlan) -> None:
        lib = self.lib
        if (lib is None or plan.backend != "compiled" or not plan.is_cuda or plan.offsets_ref() is not None
                or type(plan.key[1]) is not int or plan.dtype not in torch_ops.DTYPE_CODES):
            return
        key = lib.key(qdata=plan.qdata_ptr, scales=plan.scales_ptr, zeros=plan.zeros_ptr, n=plan.n, k=plan.k,
                      group_size=plan.group_size, weight_type=plan.weight_type.value,
                      activation=plan.activation or "none", dtype=plan.dtype, device=plan.device_index,
                      bucket=plan.key[1], capturing=plan.capturing)
        lib.put(key, plan.launch.plan, plan.n_out, plan.bias_shape[0], plan.uses_locks)
        plan.op_key = key

    def drop(self, plan: LaunchPlan) -> None:
        if self.lib is not None and plan.op_key is not None:
            self.lib.drop(plan.op_key)
            plan.op_key = None

    def clear_plans(self) -> None:
        if self.lib is not None:
            self.lib.clear_plans()

    def set_arena(self, kind: int, device_index: int, stream: int, ptr: int, nbytes: int) -> None:
        if self.lib is not None:
            self.lib.set_arena(kind, device_index, stream, ptr, nbytes)

    def put_norm(self, kernel: LoadedKernel, residual: bool, dtype: torch.dtype) -> None:
        """Hand over a loaded norm kernel (:class:`mixgemm.jit.specs.NormSpec`), once."""
        lib = self.lib
        if lib is None or dtype not in torch_ops.DTYPE_CODES:
            return
        key = (bool(residual), dtype, kernel.device.index)
        if key in self._norms:
            return
        self._norms.add(key)
        lib.put_norm(residual, dtype, kernel.device.index, int(kernel.function), kernel.spec.programmatic_launch,
                     launcher.entry_points().launch_kernel_ex)

    def put_rope(self, kernel: LoadedKernel, dtype: torch.dtype) -> None:
        """Hand over a loaded rotary / KV-cache kernel (:class:`mixgemm.jit.specs.RopeSpec`) for a
        qkv of ``dtype``, once per dtype and device."""
        lib = self.lib
        if lib is None or dtype not in torch_ops.DTYPE_CODES:
            return
        key = (dtype, kernel.device.index)
        if key in self._ropes:
            return
        self._ropes.add(key)
        lib.put_rope(dtype, kernel.device.index, int(kernel.function), kernel.spec.programmatic_launch,
                     launcher.entry_points().launch_kernel_ex)

    def holds_norm(self, x: torch.Tensor, residual: bool) -> bool:
        """Whether the library holds the norm kernel for rows like ``x`` (its dtype, on its CUDA
        device), with the residual add or not (:meth:`put_norm` handed it over): a set lookup,
        for the eager path of :func:`mixgemm.ops.norm.rms_norm`. False for a tensor not on a
        CUDA device."""
        return x.is_cuda and (residual, x.dtype, x.get_device()) in self._norms

    def holds_rope(self, qkv: torch.Tensor) -> bool:
        """Whether the library holds the rotary / KV-cache kernel for a ``qkv`` like this one (its
        dtype, on its CUDA device; :meth:`put_rope` handed it over): a set lookup, for the eager
        path of :func:`mixgemm.ops.rotary.rotary_kv_cache`. False for a tensor not on a CUDA
        device."""
        return qkv.is_cuda and (qkv.dtype, qkv.get_device()) in self._ropes

    def holds_moe(self, key: "torch_ops.MoeKey") -> bool:
        """Whether the library holds the MoE plan of ``key``."""
        return key.astuple() in self._moe

    def put_moe(self, key: "torch_ops.MoeKey", plan: "torch_ops.MoePlan", weights: tuple) -> None:
        """Hand over a MoE plan of ``mixgemm::fused_moe`` (:mod:`mixgemm.moe.layer` builds ``key``
        and ``plan``; the driver's ``cuLaunchKernelEx`` is filled in here), once per key. The plan
        is dropped as soon as the memory of any tensor of ``weights`` (the weight tensors of the
        key's pointers; None for an absent one) is freed: the finalizers watch their storages,
        whose Python objects torch keeps as long as the memory lives, so a plan outlives neither
        its weights nor the addresses in its key, whichever tensor objects the calls passed."""
        lib = self.lib
        if lib is None:
            return
        k = key.astuple()
        with self._moe_lock:
            if k in self._moe:
                return
            drop = self._moe_dropper(k)
            refs = tuple(weakref.ref(t.untyped_storage(), drop) for t in weights if t is not None)
            plan.launch_kernel_ex = launcher.entry_points().launch_kernel_ex
            self._moe[k] = (key, refs)
            lib.put_moe(key, plan)

    def _moe_dropper(self, k: tuple):
        link = weakref.ref(self)

        def drop(ref):
            me = link()
            if me is None:
                return
            with me._moe_lock:
                entry = me._moe.get(k)
                if entry is None or not any(r is ref for r in entry[1]):
                    return
                del me._moe[k]
                if me.lib is not None:
                    me.lib.drop_moe(entry[0])
        return drop

    def moe_plan_count(self) -> int:
        """The MoE plans held (0 while the library is not attached)."""
        return len(self._moe)

    def clear_moe(self) -> None:
        """Drop every MoE plan."""
        with self._moe_lock:
            self._moe.clear()
            if self.lib is not None:
                self.lib.clear_moe()


#: the process's link to the torch operator library
OPERATORS = OperatorLibrary()


def clear() -> None:
    """Drop every cached plan (the torch operator library's MoE plans too), and free every
    workspace and lock buffer (after the devices are idle): graphs captured before must not be
    replayed afterwards."""
    PLANS.clear()
    OPERATORS.clear_moe()
    WORKSPACES.clear()
    LOCKS.clear()


# ---------------------------------------------------------------------------------------------
# The per-call work
# ---------------------------------------------------------------------------------------------
def add_zero_offsets(x2: torch.Tensor, offsets: torch.Tensor, group_size: int, y2: torch.Tensor) -> None:
    """y += (x summed per group) @ zero_offsets, in float32 with one rounding: the term of the
    fractional zero points, ``sum_g xsum[m, g] * o[g, n]`` (see PackedWeight.zero_offsets)."""
    xs = x2.float().view(x2.shape[0], offsets.shape[0], group_size).sum(-1)
    y2.copy_((y2.float() + xs @ offsets).to(y2.dtype))


def _aligned_2d(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t as a contiguous, 16-byte aligned [rows, cols] matrix (a copy when it is not already)."""
    t2 = t.reshape(-1, cols)
    if not t2.is_contiguous() or t2.data_ptr() % 16:
        t2 = t2.contiguous()
        if t2.data_ptr() % 16:
            t2 = t2.clone()
    return t2


def execute(plan: LaunchPlan, x: torch.Tensor, m: int, y_shape: tuple, bias: Optional[torch.Tensor],
            out: Optional[torch.Tensor], zero_offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """Launch ``plan`` for a checked call: ``x`` ``[..., K]`` of ``m`` tokens, the output
    ``y_shape`` (into ``out`` if given), then the zero offsets' term."""
    k, n_out = plan.k, plan.n_out
    x_ptr = x.data_ptr()
    if x_ptr & 15 or not x.is_contiguous():
        x = _aligned_2d(x, k)
        x_ptr = x.data_ptr()
    # (sizes as arguments, not a tuple: torch parses them ~0.4 us faster)
    y = torch.empty(*y_shape, dtype=plan.dtype, device=plan.device) if out is None else out
    y_ptr = y.data_ptr()
    bias_ptr = 0 if bias is None else bias.data_ptr()
    index = plan.device_index
    stream = current_stream(index)
    ws_ptr, ws_size = WORKSPACES.offer(index, stream)
    lk_ptr, lk_size = LOCKS.offer(index, stream) if plan.uses_locks else (0, 0)
    rc = plan.launch(m, x_ptr, k, y_ptr, n_out, bias_ptr, ws_ptr, ws_size, lk_ptr, lk_size, stream)
    if rc:
        _launch_with_memory(plan, rc, m, x_ptr, y_ptr, bias_ptr, stream, ws_ptr, ws_size, lk_ptr, lk_size)
    if zero_offsets is not None:
        add_zero_offsets(x.reshape(m, k), zero_offsets, plan.group_size, y.view(m, n_out))
    return y


def launch_memory(arenas: StreamArenas, device: torch.device, device_index: int, stream: int, need: int,
                  capturing: bool, held: list) -> tuple[int, int]:
    """(pointer, bytes) of at least ``need`` bytes of ``arenas``' kind for one launch on ``stream``:
    the stream's buffer, grown if it is smaller, outside a capture; under a capture, the stream's
    buffer if it is large enough, else memory from torch's allocator in the graph's pool (zeroed
    by a memset queued before the launch, for the locks), appended to ``held``, which the caller
    keeps until the launch is queued."""
    if not capturing:
        return arenas.grow(device, device_index, stream, need)[1:]
    ptr, size = arenas.offer(device_index, stream)
    if size >= need:
        return ptr, size
    make = torch.zeros if arenas.zeroed else torch.empty
    held.append(make(need, dtype=torch.uint8, device=device))
    return held[-1].data_ptr(), need


def _launch_with_memory(plan: LaunchPlan, rc: int, m: int, x_ptr: int, y_ptr: int, bias_ptr: int, stream: int,
                        ws_ptr: int, ws_size: int, lk_ptr: int, lk_size: int) -> None:
    """A launch that answered NEED_WORKSPACE or NEED_LOCKS, again with what it asked for: the
    stream's grown buffer (:class:`StreamArenas`), or under graph capture memory from torch's
    allocator in the graph's pool (the locks zeroed by a memset queued before the launch), held
    only until the launch is queued. Any other answer raises its error."""

    held: list = []

    def memory(arenas: StreamArenas, need: int) -> tuple[int, int]:
        return launch_memory(arenas, plan.device, plan.device_index, stream, need, plan.capturing, held)

    for _ in range(3):   # at most one answer of each kind, then the launch
        if rc == launcher.LaunchResult.NEED_WORKSPACE:
            ws_ptr, ws_size = memory(WORKSPACES, launcher.current_call().workspace_bytes)
        elif rc == launcher.LaunchResult.NEED_LOCKS:
            lk_ptr, lk_size = memory(LOCKS, launcher.current_call().lock_bytes)
        else:
            launcher.raise_for(rc, plan.kernel)
        rc = plan.launch(m, x_ptr, plan.k, y_ptr, plan.n_out, bias_ptr, ws_ptr, ws_size, lk_ptr, lk_size, stream)
        if not rc:
            return   # `held` may go now: the launch is queued, and torch reuses memory only in stream order
    launcher.raise_for(rc, plan.kernel)


def run(x, qdata, scales, zeros, zero_offsets, bias, out, weight_type: WeightType, group_size: int, n: int,
        k: int, activation: Optional[str], buckets: tuple) -> Optional[torch.Tensor]:
    """The cached-plan path of :func:`mixgemm.ops.gemm`: the call checked against its plan with a
    few attribute reads and launched, or None when anything is unusual or no plan exists (the
    caller then takes the full path, which validates, raises the errors, and makes the plan).
    ``buckets`` is :data:`mixgemm.dispatch.heuristic.TOKEN_BUCKETS` (M -> bucket up to 512 tokens; above,
    :func:`mixgemm.dispatch.heuristic.large_bucket` picks one of two by the layer and the GPU)."""
    if type(x) is not _Tensor or (activation is not None and type(activation) is not str):
        return None
    shape = x.shape
    ndim = len(shape)
    if ndim == 2:
        m = shape[0]
    elif ndim > 2:
        m = math.prod(shape[:-1])
    elif ndim == 1:
        m = 1
    else:
        return None
    if shape[-1] != k or m <= 0 or m >= 2 ** 31:
        return None
    index = x.get_device()
    entry = PLANS._plans.get((id(qdata), buckets[m] if m < len(buckets) else heuristic.large_bucket(m, n, k, index),
                              activation, x.dtype, index))
    if entry is None:
        return None
    plan = entry[capturing()]
    # the weight: the same tensors (identity), at the same addresses, with the same fields
    if (plan is None or not (x.is_cuda if plan.is_cuda else x.device == plan.device) or plan.qdata_ref() is not qdata
            or plan.scales_ref() is not scales or plan.zeros_ref() is not zeros
            or plan.offsets_ref() is not zero_offsets
            or (qdata.data_ptr(), scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(), weight_type,
                group_size, n, k) != plan.signature):
        return None
    if bias is not None and (not isinstance(bias, _Tensor) or bias.dtype is not plan.dtype
                             or bias.get_device() != index
                             or not (bias.is_cuda if plan.is_cuda else bias.device == plan.device)
                             or bias.shape != plan.bias_shape or not bias.is_contiguous()):
        return None
    y_shape = (m, plan.n_out) if ndim == 2 else (*shape[:-1], plan.n_out)
    if out is not None and (not isinstance(out, _Tensor) or out.dtype is not plan.dtype
                            or out.get_device() != index
                            or not (out.is_cuda if plan.is_cuda else out.device == plan.device)
                            or out.shape != y_shape or not out.is_contiguous() or out.data_ptr() & 15):
        return None
    return execute(plan, x, m, y_shape, bias, out, zero_offsets)
