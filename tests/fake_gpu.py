"""A Hopper GPU faked on the CPU, for the host-side tests and profiles of the GEMM call path.

Inside ``with FakeGpu(dir):``

* CPU tensors pass mixgemm's device check (as if they were on an sm_90 device), with a fixed
  SM count and GPU name (so the H100 tuning table applies);
* kernels "load" as a made-up CUfunction handle and their real host helper (``helper.so``,
  built by nvcc from the real source, once per directory: a few seconds for a decode kernel),
  or a :class:`FakeHelper` (no compiler needed) that reports back what it was given;
* the CUDA driver is the fake one (tests/cpp/fake_libcuda.c): launches and memsets are recorded,
  nothing runs, and the outputs stay as torch.empty left them;
* torch's current stream is :attr:`FakeGpu.stream`, the capture state :attr:`FakeGpu.capturing` and
  the capture's id :attr:`FakeGpu.capture_id`.

So the whole path from ``QuantLinear.forward`` to ``cuLaunchKernelEx`` runs for real up to the
driver, and what it launched can be compared byte for byte.
"""
from __future__ import annotations

import contextlib
import ctypes
import types
import zlib
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import fake_driver
import torch

from mixgemm.jit import build, render as codegen, launcher, loader as runtime
from mixgemm.dispatch import checks, heuristic, plans
from mixgemm.jit import driver
from mixgemm.errors import KernelError
from mixgemm.jit.specs import HELPER_KINDS

GPU_NAME = "NVIDIA H100 80GB HBM3"
SM_COUNT = 132


def build_helper(spec, directory: Path) -> Path:
    """The real helper.so of ``spec`` (the host half of its build: no cubin), built once."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{spec.name}.so"
    if not out.exists():
        src = directory / f"{spec.name}.cu"
        src.write_text(codegen.render(spec))
        tmp = directory / f"{spec.name}.so.tmp"
        build._run_nvcc(build.toolchain(), build.BASE_FLAGS + build.HELPER_FLAGS, src, tmp)
        tmp.replace(out)
    return out


_PREPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(driver.GemmArgs), ctypes.c_void_p, ctypes.c_uint32,
                            ctypes.POINTER(driver.Launch), ctypes.c_void_p, ctypes.c_int)


class FakeHelper:
    """A host helper whose ``mixgemm_gemm_prepare`` is Python (a ctypes callback, so the compiled
    launcher calls it like a real one): the "params" it encodes are the GemmArgs bytes themselves,
    so a test reads back what a launch was given (:func:`launched_args`). The grid is (N/128,
    splits, 1), the cluster (1, splits, 1) up to 8 splits; ``workspace(args)`` bytes are asked
    for, of which ``zero_bytes`` (0xFFFFFFFF: all) start zeroed, and ``locks(args)`` bytes of
    self-resetting locks apart; ``refuse(args)`` is a reason."""

    def __init__(self, spec, workspace: Callable = lambda a: 0, zero_bytes: int = 0xFFFFFFFF,
                 refuse: Callable = lambda a: None, locks: Callable = lambda a: 0):
        self.name = spec.name
        self.params_size = ctypes.sizeof(driver.GemmArgs)
        self.smem_size = 1024
        self.workspace, self.zero_bytes, self.refuse, self.locks = workspace, zero_bytes, refuse, locks
        self.calls = 0
        self.lib = types.SimpleNamespace(mixgemm_gemm_prepare=_PREPARE(self._prepare))

    def _prepare(self, a_ptr, dst, capacity, out_ptr, err, errlen):
        self.calls += 1
        a, out = a_ptr.contents, out_ptr.contents

        def fail(msg: str) -> int:
            ctypes.memmove(err, msg.encode()[:errlen - 1] + b"\0", min(len(msg) + 1, errlen))
            return 1

        why = self.refuse(a)
        if why:
            return fail(why)
        splits = max(1, a.splits)
        out.workspace_bytes = self.workspace(a)
        out.workspace_zero_bytes = self.zero_bytes
        out.lock_bytes = self.locks(a)
        if out.workspace_bytes and not a.workspace:
            return fail("this launch needs a workspace")
        if out.lock_bytes and not a.locks:
            return fail("this launch needs its zeroed lock memory")
        out.grid[:] = ((a.n + 127) // 128, splits, 1)
        out.block[:] = (256, 1, 1)
        out.cluster[:] = (1, splits if splits <= 8 else 1, 1)
        out.smem_bytes = 1024 * a.m
        out.params_bytes = self.params_size
        ctypes.memmove(dst, a_ptr, self.params_size)
        return 0

    def check(self, args):
        return self.refuse(args)

    def workspace_size(self, args) -> int:
        return self.workspace(args)

    def lock_bytes(self, args) -> int:
        return self.locks(args)

    def prepare(self, args):   # driver.HostHelper.prepare's contract (the reference path uses it)
        buf = ctypes.create_string_buffer(self.params_size)
        launch = driver.Launch()
        err = ctypes.create_string_buffer(512)
        if self._prepare(ctypes.pointer(args), ctypes.addressof(buf), self.params_size, ctypes.pointer(launch),
                         ctypes.addressof(err), len(err)):
            raise KernelError(f"{self.name}: {err.value.decode()}")
        return buf, launch


def launched_args(launch: dict) -> driver.GemmArgs:
    """The GemmArgs a FakeHelper's launch carried (its params)."""
    return driver.GemmArgs.from_buffer_copy(launch["params"])


class FakeKernels(runtime.KernelCache):
    """KernelCache whose kernels are a made-up function handle and their real host helper, or a
    :class:`FakeHelper` (``helpers="fake"``, or a spec -> FakeHelper function)."""

    def __init__(self, helper_dir: Path, helpers="real"):
        super().__init__()
        self.helper_dir = helper_dir
        self.helpers = helpers
        self.loads = 0

    def _load(self, spec, device):
        from cuda.bindings import driver as drv

        self.loads += 1
        function = drv.CUfunction(function_handle(spec))
        if not isinstance(spec, HELPER_KINDS):   # plain-argument kernels (dequant, MoE routing): no helper
            return driver.LoadedKernel(spec, device, None, function, None, None)
        if self.helpers == "real":
            helper = driver.HostHelper(str(build_helper(spec, self.helper_dir)), spec.name)
            helper.bind_driver()   # (as runtime.KernelCache._load does: the fake driver's encoder)
        else:
            helper = FakeHelper(spec) if self.helpers == "fake" else self.helpers(spec)
        return driver.LoadedKernel(spec, device, None, function, helper, None)


def function_handle(spec) -> int:
    """The made-up CUfunction of a kernel (distinct per kernel name)."""
    return 0x1000 + (zlib.crc32(spec.name.encode()) & 0xFFFFFF) * 16


class FakeGpu(contextlib.ExitStack):
    def __init__(self, directory: Path, launcher_mode: Optional[str] = None, helpers="real", stream: int = 0x5000):
        super().__init__()
        self.directory = Path(directory)
        self.launcher_mode = launcher_mode
        self.stream = stream
        self.capturing = False
        self.kernels = FakeKernels(self.directory / "helpers", helpers)
        self.driver: Optional[fake_driver.FakeDriver] = None

    def __enter__(self) -> "FakeGpu":
        super().__enter__()
        self.driver = fake_driver.load(self.directory / "driver")
        self.driver.reset()
        patch = self.enter_context
        patch(mock.patch.object(checks, "device_problem", lambda d: None if d.type == "cpu" else f"not the fake GPU: {d}"))
        patch(mock.patch.object(heuristic, "sm_count", lambda index: SM_COUNT))
        patch(mock.patch.object(heuristic, "gpu_name", lambda index: GPU_NAME))
        patch(mock.patch.object(runtime, "KERNELS", self.kernels))
        patch(mock.patch.object(driver, "current_stream", lambda index: self.stream))
        patch(mock.patch.object(plans, "current_stream", lambda index: self.stream))
        patch(mock.patch.object(plans, "capturing", lambda: self.capturing))
        patch(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: self.capturing))
        patch(mock.patch.object(plans, "PLANS", plans.PlanCache()))
        patch(mock.patch.object(plans, "WORKSPACES", plans.StreamArenas(0)))
        patch(mock.patch.object(plans, "LOCKS", plans.StreamArenas(1, zeroed=True)))
        self.callback(lambda: (plans.WORKSPACES.clear(), plans.LOCKS.clear()))   # before the patches go
        if self.launcher_mode is not None:
            patch(mock.patch.dict("os.environ", {launcher.LAUNCHER_ENV: self.launcher_mode}))
        launcher.reset()
        self.callback(launcher.reset)
        return self

    def launches(self, since: int = 0) -> list[dict]:
        return [c for c in self.driver.calls(since) if c["kind"] == "launch"]
