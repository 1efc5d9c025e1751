"""A Hopper GPU faked on the CPU, for the host-side tests and profiles of the GEMM call path.

Inside ``with FakeGpu(dir):``

* CPU tensors pass mixgemm's device check (as if they were on an sm_90 device), with a fixed
  SM count and GPU name (so the H100 tuning table applies);
* kernels "load" as their real host helper (``helper.so``, built by nvcc from the real source,
  once per directory: a few seconds for a decode kernel) and a made-up CUfunction handle;
* the CUDA driver is the fake one (tests/cpp/fake_libcuda.c): launches and memsets are recorded,
  nothing runs, and the outputs stay as torch.empty left them;
* torch's current stream is :attr:`FakeGpu.stream` and the capture state :attr:`FakeGpu.capturing`.

So the whole path from ``QuantLinear.forward`` to ``cuLaunchKernelEx`` runs for real up to the
driver, and what it launched can be compared byte for byte.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional
from unittest import mock

import fake_driver
import torch

from mixgemm import build, codegen, launcher, ops, plans, runtime
from mixgemm.codegen import GEMM_KINDS

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


class FakeKernels(runtime.KernelCache):
    """KernelCache whose kernels are their real host helpers and a made-up function handle."""

    def __init__(self, helper_dir: Path):
        super().__init__()
        self.helper_dir = helper_dir
        self.loads = 0

    def _load(self, spec, device):
        from cuda.bindings import driver as drv

        assert isinstance(spec, GEMM_KINDS), spec
        self.loads += 1
        helper = runtime.HostHelper(str(build_helper(spec, self.helper_dir)), spec.name)
        function = drv.CUfunction(0x1000 + (hash(spec.name) & 0xFFFFFF) * 16)
        return runtime.LoadedKernel(spec, device, None, function, helper, None)


class FakeGpu(contextlib.ExitStack):
    def __init__(self, directory: Path, launcher_mode: Optional[str] = None, stream: int = 0x5000):
        super().__init__()
        self.directory = Path(directory)
        self.launcher_mode = launcher_mode
        self.stream = stream
        self.capturing = False
        self.kernels = FakeKernels(self.directory / "helpers")
        self.driver: Optional[fake_driver.FakeDriver] = None

    def __enter__(self) -> "FakeGpu":
        super().__enter__()
        self.driver = fake_driver.load(self.directory / "driver")
        self.driver.reset()
        patch = self.enter_context
        patch(mock.patch.object(ops, "_device_ok", lambda d: None if d.type == "cpu" else f"not the fake GPU: {d}"))
        patch(mock.patch.object(ops, "_sm_count", lambda index: SM_COUNT))
        patch(mock.patch.object(ops, "_gpu_name", lambda index: GPU_NAME))
        patch(mock.patch.object(runtime, "KERNELS", self.kernels))
        patch(mock.patch.object(runtime, "_stream_handle", self._stream_object))
        patch(mock.patch.object(plans, "current_stream", lambda index: self.stream))
        patch(mock.patch.object(plans, "capturing", lambda: self.capturing))
        patch(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: self.capturing))
        patch(mock.patch.object(plans, "PLANS", plans.PlanCache()))
        patch(mock.patch.object(plans, "WORKSPACES", plans.WorkspacePool()))
        if self.launcher_mode is not None:
            patch(mock.patch.dict("os.environ", {launcher.LAUNCHER_ENV: self.launcher_mode}))
        launcher.reset()
        self.callback(launcher.reset)
        return self

    def _stream_object(self, device):
        from cuda.bindings import driver as drv
        return drv.CUstream(self.stream)

    def launches(self, since: int = 0) -> list[dict]:
        return [c for c in self.driver.calls(since) if c["kind"] == "launch"]
