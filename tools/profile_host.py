"""Host time of one GEMM call, and where it goes (docs/host-overhead.md).

    python tools/profile_host.py [--json PATH] [--iters N] [--stack] [--layers 32]
    python tools/profile_host.py --fake-driver [--json PATH]      # a CPU machine, driver faked

Host time is the time a loop of calls takes on the CPU, without synchronizing: calls are timed
in batches of --batch (fewer than the launch queue holds, so a launch never waits for the GPU),
with a synchronize between batches that is not timed; the figure is the median over batches of
the time per call. Layer 4096 x 4096, M = 1, u4 g128, bf16, warm kernel and plan.

Sections:
  calls   F.linear (bf16) and nn.Linear, then mixgemm's entry points: QuantLinear.forward
          (eager: the cached plan), the custom op, mixgemm.gemm, mixgemm.gemm with the Python
          launcher (MIXGEMM_LAUNCHER=python), gemm_with_spec (a plan of its own per call) and
          the reference path (every check and choice, then runtime.launch_gemm: what gemm did
          before the plans).
  steps   each step of the planned path and of the reference path alone.
  stack   (--stack) one eager decode step (M = 1) of an 8B-shaped stack of --layers layers
          (q, k, v, o 4096-wide, k/v 1024; gate/up 14336; down), bf16 nn.Linear against u4
          QuantLinear (separate gate and up, and fused swiglu): wall time per step with a
          synchronize per step, as a decoding loop has; plus the same steps replayed from a
          CUDA graph (the GPU time alone).

--fake-driver runs the calls and steps sections on a machine without a GPU: CPU tensors, the
fake CUDA driver (tests/cpp/fake_libcuda.c: records launches, runs nothing) and the real host
helper of the kernel (built by nvcc); F.linear is then a CPU matmul and is left out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def host_time(fn, iters: int, batch: int, sync) -> dict:
    """Median and min over batches of the per-call host time of fn (us)."""
    for _ in range(min(batch, 50)):
        fn()
    sync()
    per_call = []
    done = 0
    while done < iters:
        n = min(batch, iters - done)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per_call.append((time.perf_counter() - t0) / n * 1e6)
        sync()
        done += n
    return {"median_us": round(statistics.median(per_call), 2), "min_us": round(min(per_call), 2)}


def gpu_time(fn, iters: int = 200) -> float:
    """GPU time per call (us), from a CUDA graph of `iters` calls replayed."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / (5 * iters), 2)


def reference_gemm(x, w, bias=None):
    """mixgemm.gemm as it was before the launch plans: every check and choice on every call,
    then runtime.launch_gemm (new params, Launch, CUlaunchConfig and attribute objects)."""
    from mixgemm.jit import catalog
    from mixgemm.jit import loader as runtime
    from mixgemm.ops import args as op_args, dense as ops

    op_args.check_gemm_inputs(x, w, bias, None, None)
    m = x.shape[0]
    spec = ops.select_spec(m, w)
    splits = ops._tuned_splits(spec, w, x.device)
    raster, swizzle = catalog.launch_order(spec)
    y = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    args = driver.GemmArgs()
    args.abi_version = driver.ABI_VERSION
    args.m, args.n, args.k, args.group_size = m, w.n, w.k, w.group_size
    args.sm_count = ops._sm_count(x.device.index)
    args.splits, args.raster, args.swizzle = splits, raster.abi, swizzle
    args.activation = 0
    args.weight, args.scales = w.qdata.data_ptr(), w.scales.data_ptr()
    args.zeros = 0 if w.zeros is None else w.zeros.data_ptr()
    args.x, args.y = x.data_ptr(), y.data_ptr()
    args.bias = 0 if bias is None else bias.data_ptr()
    args.ldx, args.ldy = w.k, w.n
    runtime.launch_gemm(runtime.KERNELS.get(spec, x.device), args)
    return y


@contextlib.contextmanager
def launcher_mode(mode: str):
    from mixgemm.jit import launcher
    from mixgemm.dispatch import plans

    old = os.environ.get(launcher.LAUNCHER_ENV)
    os.environ[launcher.LAUNCHER_ENV] = mode
    launcher.reset()
    plans.clear()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(launcher.LAUNCHER_ENV, None)
        else:
            os.environ[launcher.LAUNCHER_ENV] = old
        launcher.reset()
        plans.clear()


def calls_and_steps(dev, iters: int, batch: int, fake: bool) -> dict:
    import mixgemm
    from mixgemm.jit import driver
    from mixgemm.jit import render as codegen, loader as runtime
    from mixgemm.ops import args as op_args, dense as ops
    from mixgemm.dispatch import plans
    from mixgemm.nn import QuantLinear

    sync = (lambda: None) if fake else torch.cuda.synchronize
    torch.manual_seed(0)
    n = k = 4096
    w32 = torch.randn(n, k, device=dev) * 0.02
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    packed = mixgemm.prepack(mixgemm.quantize(w32, 4, 128, dtype=torch.bfloat16))
    layer = QuantLinear.from_packed(packed, bias=bias)
    linear = torch.nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
    weight = linear.weight.detach()
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    spec = ops.select_spec(1, packed)
    out: dict = {"layer": f"{n}x{k} u4 g128 bf16, M=1", "kernel": spec.name,
                 "device": "CPU + fake driver" if fake else torch.cuda.get_device_name(dev), "calls": {}, "steps": {}}

    def t(section, name, fn):
        out[section][name] = host_time(fn, iters, batch, sync)
        print(f"{section:6s} {name:58s} {out[section][name]['median_us']:8.2f} us "
              f"(min {out[section][name]['min_us']:.2f})", flush=True)

    with torch.no_grad():
        if not fake:
            t("calls", "F.linear (bf16)", lambda: torch.nn.functional.linear(x, weight, bias))
            t("calls", "nn.Linear module (bf16)", lambda: linear(x))
        t("calls", "QuantLinear.forward (eager, planned)", lambda: layer(x))
        legacy_layer = _LegacyQuantLinear(layer)
        op = torch.ops.mixgemm.gemm
        qdata, scales, zeros = packed.qdata, packed.scales, packed.zeros
        t("calls", "torch.ops.mixgemm.gemm (the custom op)",
          lambda: op(x, qdata, scales, zeros, None, bias, "u4", 128, n, k, "none"))
        t("calls", "mixgemm.gemm (planned)", lambda: mixgemm.gemm(x, packed, bias=bias))
        with launcher_mode("python"):
            t("calls", "mixgemm.gemm (planned, Python launcher)", lambda: mixgemm.gemm(x, packed, bias=bias))
        t("calls", "gemm_with_spec (a plan per call)", lambda: ops.gemm_with_spec(x, packed, spec, bias=bias))
        t("calls", "reference: checks + choice + runtime.launch_gemm", lambda: reference_gemm(x, packed, bias))
        t("calls", "reference: QuantLinear.forward as before (op + PackedWeight + reference)",
          lambda: legacy_layer(x))
        if not fake:   # a stream-K GEMM (M = 64): a workspace, its memset and the launch
            x64 = torch.randn(64, k, device=dev, dtype=torch.bfloat16)
            t("calls", "mixgemm.gemm, M=64 (stream-K: workspace + memset)",
          lambda: mixgemm.gemm(x64, packed, bias=bias))
            t("calls", "reference, M=64 (stream-K: workspace + memset)", lambda: reference_gemm(x64, packed, bias))
            out["kernel_gpu_us"] = gpu_time(lambda: mixgemm.gemm(x, packed, bias=bias))
            out["f_linear_gpu_us"] = gpu_time(lambda: torch.nn.functional.linear(x, weight, bias))

        # -- the planned path, step by step
        mixgemm.gemm(x, packed, bias=bias)
        plan = plans.PLANS.get(plans.plan_key(packed.qdata, ops.token_bucket(1), None, x.dtype, x.device), False)
        y = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        real_execute = plans.execute
        plans.execute = lambda *a: None
        try:
            t("steps", "plan: checks + lookup (plans.run, execute stubbed)",
              lambda: plans.run(x, packed.qdata, packed.scales, packed.zeros, None, bias, None, packed.weight_type,
                                128, n, k, None, ops.TOKEN_BUCKETS))
        finally:
            plans.execute = real_execute
        t("steps", "plan: torch.empty(y)", lambda: torch.empty((1, n), dtype=torch.bfloat16, device=plan.device))
        t("steps", "plan: current stream (raw handle)", lambda: plans.current_stream(plan.device_index))
        t("steps", "plan: capture state", lambda: plans.capturing())
        xp, yp, bp = x.data_ptr(), y.data_ptr(), bias.data_ptr()
        stream = plans.current_stream(plan.device_index)
        t("steps", f"plan: launch ({plan.backend}: prepare + cuLaunchKernelEx)",
          lambda: plan.launch(1, xp, k, yp, n, bp, 0, 0, stream))
        t("steps", "plan: execute (out given)", lambda: plans.execute(plan, x, 1, (1, n), bias, y, None))
        real_run = plans.run
        plans.run = lambda *a: y        # forward with the plan's work taken out
        try:
            t("steps", "QuantLinear: module call + eager checks + reads (plans.run stubbed)", lambda: layer(x))
        finally:
            plans.run = real_run

        # -- the reference path, step by step
        kernel = runtime.KERNELS.get(spec, x.device)
        t("steps", "ref: check_gemm_inputs", lambda: op_args.check_gemm_inputs(x, packed, bias, None, None))
        t("steps", "ref: select_spec", lambda: ops.select_spec(1, packed))
        t("steps", "ref: _tuned_splits", lambda: ops._tuned_splits(spec, packed, x.device))
        t("steps", "ref: launch_order", lambda: catalog.launch_order(spec))
        t("steps", "ref: spec.name (KernelCache key)", lambda: spec.name)
        t("steps", "ref: KERNELS.get", lambda: runtime.KERNELS.get(spec, x.device))
        t("steps", "ref: PackedWeight(...) (the op's implementation)",
          lambda: mixgemm.PackedWeight(layer.qdata, layer.scales, layer.zeros, packed.weight_type, 128, n, k))
        args = driver.GemmArgs(abi_version=driver.ABI_VERSION, m=1, n=n, k=k, group_size=128, sm_count=132,
                                splits=plan.splits, weight=packed.qdata.data_ptr(), scales=packed.scales.data_ptr(),
                                zeros=packed.zeros.data_ptr(), x=xp, bias=bp, y=yp, ldx=k, ldy=n)
        t("steps", "ref: helper.workspace_size (ctypes)", lambda: kernel.helper.workspace_size(args))
        t("steps", "ref: helper.prepare (ctypes, new buffers)", lambda: kernel.helper.prepare(args))
        t("steps", "ref: CUlaunchConfig + 2 attribute objects", _config_objects(kernel, args))
        t("steps", "ref: torch.cuda.current_stream -> CUstream", lambda: runtime.stream_handle(kernel.device))
        drv = driver.cuda_driver()

        def workspace():   # what launch_gemm does for a stream-K launch (64 KiB here)
            ws = torch.empty(1 << 16, dtype=torch.uint8, device=dev)
            driver.check(drv.cuMemsetD8Async(drv.CUdeviceptr(ws.data_ptr()), 0, 1 << 16,
                                              runtime.stream_handle(kernel.device)), "memset")
        t("steps", "ref: workspace torch.empty + cuMemsetD8Async (cuda-python)", workspace)
        t("steps", "ref: runtime.launch_gemm (whole launch)", lambda: runtime.launch_gemm(kernel, args))
        t("steps", "custom op dispatch alone (same schema, body returns a tensor)", _noop_op(x, layer, n, k))
    return out


@torch.library.custom_op("mixgemm_profile::legacy_gemm", mutates_args=())
def _legacy_gemm(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 zero_offsets: torch.Tensor | None, bias: torch.Tensor | None, weight_type: str, group_size: int,
                 n: int, k: int, activation: str = "none") -> torch.Tensor:
    """The custom op's implementation before the plans: a PackedWeight, then the reference gemm."""
    import mixgemm

    w = mixgemm.PackedWeight(qdata, scales, zeros, mixgemm.WeightType(weight_type), group_size, n, k,
                             zero_offsets=zero_offsets)
    return reference_gemm(x, w, bias)


class _LegacyQuantLinear(torch.nn.Module):
    """QuantLinear.forward before the plans: every call through the custom op (module attribute
    reads through nn.Module.__getattr__, as before)."""

    def __init__(self, layer):
        super().__init__()
        for name in ("qdata", "scales", "zeros", "zero_offsets"):
            self.register_buffer(name, getattr(layer, name))
        self.bias = layer.bias
        self.weight_type, self.group_size = layer.weight_type, layer.group_size
        self.weight_rows, self.in_features, self.activation = layer.weight_rows, layer.in_features, layer.activation

    def forward(self, x):
        return torch.ops.mixgemm_profile.legacy_gemm(x, self.qdata, self.scales, self.zeros, self.zero_offsets,
                                                     self.bias, self.weight_type.value, self.group_size,
                                                     self.weight_rows, self.in_features, self.activation)


def _config_objects(kernel, args):
    from mixgemm.jit.driver import cuda_driver

    drv = cuda_driver()
    _, launch = kernel.helper.prepare(args)

    def make():
        config = drv.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = (int(v) for v in launch.grid)
        config.blockDimX, config.blockDimY, config.blockDimZ = (int(v) for v in launch.block)
        config.sharedMemBytes = int(launch.smem_bytes)
        cluster = drv.CUlaunchAttribute()
        cluster.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        dim = cluster.value.clusterDim
        dim.x, dim.y, dim.z = (int(v) for v in launch.cluster)
        pdl = drv.CUlaunchAttribute()
        pdl.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        pdl.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [cluster, pdl]
        config.numAttrs = 2
        return config
    return make


def _noop_op(x, layer, n, k):
    out = torch.empty_like(x)

    @torch.library.custom_op("mixgemm_profile::noop", mutates_args=())
    def noop(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             zero_offsets: torch.Tensor | None, bias: torch.Tensor | None, weight_type: str, group_size: int,
             n: int, k: int, activation: str = "none") -> torch.Tensor:
        return out

    op = torch.ops.mixgemm_profile.noop
    return lambda: op(x, layer.qdata, layer.scales, layer.zeros, None, layer.bias, "u4", 128, n, k, "none")


# ---------------------------------------------------------------------------------------------
# The decode stack
# ---------------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    """The linear layers of one LLaMA-3-8B decoder layer (attention itself left out: at one
    token its cost is small and the same for both)."""

    def __init__(self, h=4096, kv=1024, inter=14336, dtype=torch.bfloat16, device=None):
        super().__init__()
        mk = lambda i, o: torch.nn.Linear(i, o, bias=False, dtype=dtype, device=device)
        self.q, self.k, self.v, self.o = mk(h, h), mk(h, kv), mk(h, kv), mk(h, h)
        self.gate, self.up, self.down = mk(h, inter), mk(h, inter), mk(inter, h)
        self.gate_up = None

    def forward(self, x):
        q = self.q(x)
        self.k(x), self.v(x)
        x = x + self.o(q)
        if self.gate_up is not None:
            return x + self.down(self.gate_up(x))
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _forward_through_op(layer, x):
    """A QuantLinear's forward through the custom op alone (what torch.compile traces)."""
    if layer.perm is not None:
        x = x.index_select(-1, layer.perm)
    return torch.ops.mixgemm.gemm(x, layer.qdata, layer.scales, layer.zeros, layer.zero_offsets, layer.bias,
                                  layer.weight_type.value, layer.group_size, layer.weight_rows,
                                  layer.in_features, layer.activation)


def stack(dev, layers: int, steps: int) -> dict:
    from mixgemm.nn import QuantLinear, quantize_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Layer(device=dev) for _ in range(layers)]).eval()
    for p in model.parameters():
        p.data.mul_(0.02 / p.data.std())
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    res: dict = {"layers": layers, "launches_per_step": {"bf16": 7 * layers, "u4": 7 * layers,
                                                          "u4 swiglu": 6 * layers}}

    def step_time(fn):
        with torch.no_grad():
            for _ in range(3):
                fn(x)
            torch.cuda.synchronize()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn(x)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            side = torch.cuda.Stream()      # warm-up on a side stream before capturing (torch's advice)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(x)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(x)
            g.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                g.replay()
            torch.cuda.synchronize()
            graph_ms = (time.perf_counter() - t0) * 1e3 / steps
        return {"eager_ms": round(statistics.median(times), 3), "graph_ms": round(graph_ms, 3)}

    def measure(name, fn):
        try:
            res[name] = step_time(fn)
        except Exception as e:     # one variant failing leaves the others' figures
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"stack  {name:26s} {res[name]}", flush=True)

    measure("bf16", model)
    # the int4 stack from the same weights (separate gate and up)
    quantize_model(model, bits=4, group_size=128, progress=False)
    torch.cuda.empty_cache()
    measure("u4", model)
    with launcher_mode("python"):
        measure("u4 python launcher", model)
    forward = QuantLinear.forward
    QuantLinear.forward = _forward_through_op           # every call through the custom op
    try:
        measure("u4 via custom op", model)
    finally:
        QuantLinear.forward = forward
    # fused gate/up: one swiglu launch instead of two, from bf16 copies of the quantized weights
    import mixgemm
    for layer in model:
        g = torch.nn.Linear(4096, 14336, bias=False, dtype=torch.bfloat16, device=dev)
        u = torch.nn.Linear(4096, 14336, bias=False, dtype=torch.bfloat16, device=dev)
        g.weight.data = mixgemm.dequantize(layer.gate.packed)
        u.weight.data = mixgemm.dequantize(layer.up.packed)
        layer.gate_up = QuantLinear.from_gate_up(g, u, bits=4, group_size=128)
        layer.gate = layer.up = None
    torch.cuda.empty_cache()
    measure("u4 swiglu", model)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=200, help="calls per timed batch (below the launch queue's depth)")
    ap.add_argument("--stack", action="store_true", help="also time the 8B-shaped decode stack")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fake-driver", action="store_true", help="CPU only: the fake CUDA driver, CPU tensors")
    a = ap.parse_args()
    if a.fake_driver:
        sys.path.insert(0, str(ROOT / "tests"))
        from fake_gpu import FakeGpu
        import tempfile
        work = Path(os.environ.get("MIXGEMM_FAKE_GPU_DIR", Path(tempfile.gettempdir()) / "mixgemm-fake-gpu"))
        with FakeGpu(work, helpers="real") as gpu:
            gpu.driver.reset()
            res = calls_and_steps(torch.device("cpu"), a.iters, a.batch, fake=True)
    else:
        dev = torch.device("cuda", 0)
        res = calls_and_steps(dev, a.iters, a.batch, fake=False)
        print(f"kernel (GPU time, graph replay) {res['kernel_gpu_us']} us; F.linear {res['f_linear_gpu_us']} us")
        if a.stack:
            res["stack"] = stack(dev, a.layers, a.steps)
    res["torch"] = torch.__version__
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
