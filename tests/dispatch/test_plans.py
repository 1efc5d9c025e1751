"""Launch plans and the launchers on a faked GPU (CPU only): the plan cache's keys, the fast
path's checks and errors, workspaces, driver and helper errors, QuantLinear's eager and op paths.

The GPU is faked by tests/fake_gpu.py: CPU tensors pass the device check, the CUDA driver is
tests/cpp/fake_libcuda.c (it records launches and memsets; nothing runs), and the kernels' host
helpers are either Python fakes that report the arguments they were given (these tests need a C
compiler only) or the real helper.so built by nvcc (marked ``nvcc``).
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os

import pytest
import torch

import fake_driver
from fake_gpu import SM_COUNT, FakeGpu, FakeHelper, function_handle, launched_args

import mixgemm
from mixgemm.jit import driver
from mixgemm.jit import build, launcher, env as paths, loader as runtime
from mixgemm.dispatch import heuristic, plans
from mixgemm.ops import dense as ops
from mixgemm.errors import BuildError, CudaError, KernelError
from mixgemm.nn import QuantLinear
from mixgemm.jit.specs import Activation, Raster

pytestmark = pytest.mark.skipif(fake_driver.compiler() is None or fake_driver.real_driver_present(),
                                reason="needs a C compiler for the fake CUDA driver, and no real one")

BACKENDS = ["python", pytest.param("compiled", marks=pytest.mark.nvcc)]


@pytest.fixture(scope="session")
def fake_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fake-gpu")


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    """One kernel cache for the session: the compiled launcher is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def fake_gpu(fake_dir, session_cache, monkeypatch, request):
    """A FakeGpu with Python fake helpers, launching through the test's ``backend`` parameter
    (python when it has none)."""
    callspec = getattr(request.node, "callspec", None)
    backend = callspec.params.get("backend", "python") if callspec else "python"
    if backend == "compiled" and paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(session_cache))
    with FakeGpu(fake_dir, launcher_mode=backend, helpers="fake") as gpu:
        gpu.driver.reset(params_size=ctypes.sizeof(driver.GemmArgs))
        yield gpu


def _weight(n=256, k=512, bits=4, group=128, symmetric=False, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return mixgemm.prepack(mixgemm.quantize(torch.randn(n, k) * 0.02, bits, group, symmetric=symmetric, dtype=dtype))


def _last_args(gpu: FakeGpu, since: int = 0) -> driver.GemmArgs:
    launches = gpu.launches(since)
    assert launches, "nothing was launched"
    return launched_args(launches[-1])


# ---------------------------------------------------------------------------------------------
# Token buckets
# ---------------------------------------------------------------------------------------------
def test_token_buckets_follow_the_heuristic():
    """Every M of a bucket gets the same kernel config on every layer that matters (the sizes
    and row counts at and next to each bound of the table, and the preset layers, on two SM
    counts): a plan made for one M serves its bucket."""
    table = heuristic._HEURISTIC
    sizes = {1} | {b + d for _, b, _, _ in table if b is not None for d in (0, 1)}
    rows = {r + d for _, _, _, r in table if r is not None for d in (-1, 0)}
    layers = sorted({(s, 1) for s in sizes} | {(r, max(1, s // r)) for r in rows for s in sizes}
                    | {(4608, 3584), (6144, 4096), (5120, 27648), (57344, 8192), (3584, 18944)})
    for sms in (132, 114):
        first: dict = {}
        for m in [*range(1, 700), *range(700, 9000, 61)]:
            for n, k in layers:
                bucket = ops.token_bucket(m, n, k, sms)
                label = ops.select_tile(m, n, k, sms).label
                assert first.setdefault((bucket, n, k), label) == label, (m, n, k, sms, bucket)
        # above 512 tokens both configs occur, each in its own bucket
        assert {first[b, 4608, 3584] for b in heuristic.LARGE_M_BUCKETS} == {"xl", "xlp"}
    bounds = sorted({m_max for m_max, _, _, _ in table if m_max is not None})
    for i, b in enumerate(bounds):     # a bound ends its bucket; one more token starts the next
        assert ops.token_bucket(b) == i and ops.token_bucket(b + 1) == i + 1
    assert ops.token_bucket(10 ** 7) == len(bounds) == heuristic.LARGE_M_BUCKETS[0]


def test_xl_where_stream_k_evens_out_the_waves():
    """Above 512 tokens "xl" (stream-K) replaces "xlp" (persistent, whole waves) only where
    CUTLASS's heuristic splits xl's tiles (its last wave less than half full, more than 8 k-tiles
    per tile) and xl's waves, ~5% dearer each, undercut xlp's whole ones."""
    xl = heuristic.xl_evens_waves
    # 4608 x 3584 at 1024 tokens: 36 x 4 = 144 tiles, 1.09 waves of 132 SMs against xlp's 2
    assert xl(1024, 4608, 3584, 132) and ops.select_tile(1024, 4608, 3584, 132).label == "xl"
    # 6144 x 4096: 192 tiles, a tail of 60 on 132 SMs (split), of 78 on 114 (data-parallel)
    assert xl(1024, 6144, 4096, 132) and not xl(1024, 6144, 4096, 114)
    # a whole number of waves, or a tail of more than half a wave: data-parallel
    assert not xl(1024, 4096, 4096, 128) and not xl(2048, 6144, 4096, 132)
    # at most 8 k-tiles per tile: CUTLASS never splits
    assert xl(1024, 4608, 3584, 132) and not xl(1024, 4608, 512, 132)
    # an odd count of token tiles: xl computes an empty one (its swizzle rounds them to pairs)
    assert not xl(640, 28672, 4096, 132)
    # many waves: the tail is worth less than xl's overhead per tile
    assert not xl(2048, 57344, 8192, 132) and xl(2048, 7168, 5120, 132)
    for m in (1, 16, 64, 256, 512):     # the table's buckets do not change
        assert ops.select_tile(m, 4608, 3584, 132).label == ops.select_tile(m, 4608, 3584, 114).label


def test_large_m_plans_follow_the_waves(fake_gpu):
    """Above 512 tokens the cached path takes the bucket of the layer's and the GPU's choice
    (heuristic.large_bucket), so each call launches what the full path would pick: a 4352 x 576
    layer on the fake GPU's 132 SMs makes 34 x 4 = 136 tiles at M = 1024 (a 4-tile tail: "xl"),
    204 at M = 1536 (a 72-tile tail: "xlp"), 272 at M = 2048 ("xl" again, the same plan)."""
    gpu = fake_gpu
    w = _weight(n=4352, k=576, group=64)
    made = plans.PLANS.made
    for m, label, new_plan in ((1024, "xl", True), (1000, "xl", False), (1536, "xlp", True), (2048, "xl", False),
                               (1500, "xlp", False), (1024, "xl", False)):
        spec = ops.select_tile(m, 4352, 576, SM_COUNT).spec(w.act_type, w.weight_type)
        assert ops.select_tile(m, 4352, 576).label == label
        mixgemm.gemm(torch.randn(m, 576, dtype=torch.bfloat16), w)
        made += new_plan
        assert plans.PLANS.made == made, (m, label)
        assert gpu.launches()[-1]["function"] == function_handle(spec), (m, label)
        assert _last_args(gpu).m == m


# ---------------------------------------------------------------------------------------------
# The plan cache
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_plans_are_keyed_on_everything_that_decides_the_launch(fake_gpu, backend):
    """One thing changes at a time (M within and across a bucket, activation, capture state,
    dtype, the weight's storage, the weight itself) and the call gets the same plan or a new one,
    as it should; each launch carries the call's own pointers."""
    gpu = fake_gpu
    w = _weight()
    bias = torch.randn(256, dtype=torch.bfloat16)
    x = torch.randn(1, 512, dtype=torch.bfloat16)

    y = mixgemm.gemm(x, w, bias=bias)
    assert plans.PLANS.made == 1
    (plan,) = plans.PLANS.plans()
    assert plan.backend == backend and plan.spec.name.startswith("mixgemm_decode_bf16_u4_m8")
    a = _last_args(gpu)
    assert (a.m, a.n, a.k, a.group_size, a.x, a.y, a.bias, a.ldx, a.ldy) == \
        (1, 256, 512, 128, x.data_ptr(), y.data_ptr(), bias.data_ptr(), 512, 256)
    assert (a.weight, a.scales, a.zeros) == (w.qdata.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr())
    assert gpu.launches()[-1]["function"] == function_handle(plan.spec)

    def same_plan():
        assert plans.PLANS.made == made and plans.PLANS.plans()[:1] == [plan]

    made = 1
    for m in (1, 5, 8):                               # same bucket: the same plan
        xm = torch.randn(m, 512, dtype=torch.bfloat16)
        n0 = gpu.driver.count()
        ym = mixgemm.gemm(xm, w, bias=bias)
        same_plan()
        a = _last_args(gpu, n0)
        assert (a.m, a.x, a.y) == (m, xm.data_ptr(), ym.data_ptr())
    mixgemm.gemm(torch.randn(9, 512, dtype=torch.bfloat16), w)        # the next bucket: dec16
    assert plans.PLANS.made == 2
    assert any(p.spec.name.startswith("mixgemm_decode_bf16_u4_m16") for p in plans.PLANS.plans())
    mixgemm.gemm(x, w, activation="silu")                              # another activation
    assert plans.PLANS.made == 3 and _last_args(gpu).activation == Activation.SILU.abi
    gpu.capturing = True                                               # under graph capture
    mixgemm.gemm(x, w)
    assert plans.PLANS.made == 4 and sum(p.capturing for p in plans.PLANS.plans()) == 1
    mixgemm.gemm(x, w)
    assert plans.PLANS.made == 4
    gpu.capturing = False
    mixgemm.gemm(x, w)
    made = 4
    same_plan()

    # another dtype: the same codes with fp16 scales and zeros
    w16 = mixgemm.PackedWeight(w.qdata, w.scales.half(), w.zeros.half(), w.weight_type, w.group_size, w.n, w.k)
    mixgemm.gemm(x.half(), w16)
    assert plans.PLANS.made == 5
    assert {p.dtype for p in plans.PLANS.plans()} == {torch.bfloat16, torch.float16}
    mixgemm.gemm(x, w)
    assert plans.PLANS.made == 5

    # the weight's storage moves (same tensor object): a new plan with the new pointer
    w.qdata.data = w.qdata.data.clone()
    mixgemm.gemm(x, w)
    assert plans.PLANS.made == 6 and _last_args(gpu).weight == w.qdata.data_ptr()
    mixgemm.gemm(x, w)
    assert plans.PLANS.made == 6

    # the device is part of the key (the fake GPU has one device; the key is checked directly)
    key0 = plans.plan_key(w.qdata, 0, None, torch.bfloat16, torch.device("cuda", 0))
    assert key0 != plans.plan_key(w.qdata, 0, None, torch.bfloat16, torch.device("cuda", 1))
    for other in (plans.plan_key(w.qdata, 1, None, torch.bfloat16, torch.device("cuda", 0)),
                  plans.plan_key(w.qdata, 0, "silu", torch.bfloat16, torch.device("cuda", 0)),
                  plans.plan_key(w.qdata, 0, None, torch.float16, torch.device("cuda", 0))):
        assert other != key0

    # a weight that is freed takes its plans along
    before = len(plans.PLANS)
    del w, w16
    gc.collect()
    assert len(plans.PLANS) < before


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantlinear_buffers_replaced_or_moved(fake_gpu, backend):
    """QuantLinear: the plan follows its buffers through load_state_dict (same tensors: reused),
    a replaced buffer and a dtype change (new plans), and launches the new pointers."""
    gpu = fake_gpu
    layer = QuantLinear.from_packed(_weight(), bias=torch.randn(256, dtype=torch.bfloat16))
    x = torch.randn(2, 3, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
        assert y.shape == (2, 3, 256) and plans.PLANS.made == 1
        layer.load_state_dict(QuantLinear.from_packed(_weight(seed=1), bias=torch.randn(256, dtype=torch.bfloat16))
                              .state_dict())
        layer(x)
        assert plans.PLANS.made == 1, "load_state_dict copies into the same buffers"
        layer.scales = layer.scales.clone()
        layer(x)
        assert plans.PLANS.made == 2 and _last_args(gpu).scales == layer.scales.data_ptr()
        layer.half()
        layer(x.half())
        assert plans.PLANS.made == 3
        a = _last_args(gpu)
        assert (a.scales, a.zeros, a.bias) == (layer.scales.data_ptr(), layer.zeros.data_ptr(), layer.bias.data_ptr())


# ---------------------------------------------------------------------------------------------
# The fast path's checks: the full path's errors, nothing launched
# ---------------------------------------------------------------------------------------------
def _bad_calls(w, x):
    dev_bias = torch.randn(256, dtype=torch.bfloat16)
    return [
        ("dtype mismatch", lambda: mixgemm.gemm(x.half(), w)),
        ("K", lambda: mixgemm.gemm(torch.randn(4, 256, dtype=torch.bfloat16), w)),
        ("device", lambda: mixgemm.gemm(x.to("meta"), w)),
        ("out shape", lambda: mixgemm.gemm(x, w, out=torch.empty(4, 255, dtype=torch.bfloat16))),
        ("out dtype", lambda: mixgemm.gemm(x, w, out=torch.empty(4, 256, dtype=torch.float16))),
        ("out strided", lambda: mixgemm.gemm(x, w, out=torch.empty(256, 4, dtype=torch.bfloat16).t())),
        ("bias shape", lambda: mixgemm.gemm(x, w, bias=torch.zeros(255, dtype=torch.bfloat16))),
        ("bias dtype", lambda: mixgemm.gemm(x, w, bias=dev_bias.half())),
        ("bias strided", lambda: mixgemm.gemm(x, w, bias=torch.zeros(512, dtype=torch.bfloat16)[::2])),
        ("bias type", lambda: mixgemm.gemm(x, w, bias=[0.0] * 256)),
        ("activation", lambda: mixgemm.gemm(x, w, activation="relu")),
        ("activation type", lambda: mixgemm.gemm(x, w, activation=["silu"])),
        ("weight type", lambda: mixgemm.gemm(x, torch.zeros(256, 512))),
        ("x type", lambda: mixgemm.gemm([1.0], w)),
        ("scalar x", lambda: mixgemm.gemm(torch.tensor(1.0, dtype=torch.bfloat16), w)),
    ]


def test_fast_path_rejects_what_the_full_path_rejects(fake_gpu):
    """Every bad input raises the same error, with the same message, whether or not a plan
    exists for the weight, and nothing is launched."""
    gpu = fake_gpu
    w = _weight()
    x = torch.randn(4, 512, dtype=torch.bfloat16)

    def errors():
        got = {}
        for name, call in _bad_calls(w, x):
            n0 = gpu.driver.count()
            with pytest.raises((TypeError, ValueError)) as e:
                call()
            assert gpu.driver.count() == n0, f"{name}: launched"
            got[name] = (type(e.value), str(e.value))
        return got

    plans.PLANS.clear()
    cold = errors()
    assert plans.PLANS.made == 0
    mixgemm.gemm(x, w)
    mixgemm.gemm(x, w, bias=torch.zeros(256, dtype=torch.bfloat16))
    assert plans.PLANS.made == 1
    warm = errors()
    assert warm == cold
    assert "bias must be contiguous" in cold["bias strided"][1]
    assert "K=" in cold["K"][1] and "out must be" in cold["out shape"][1]
    # a non-contiguous x is copied, not rejected, on both paths
    xt = torch.randn(512, 4, dtype=torch.bfloat16).t()
    n0 = gpu.driver.count()
    mixgemm.gemm(xt, w)
    a = _last_args(gpu, n0)
    assert a.x != xt.data_ptr() and a.x % 16 == 0 and a.ldx == 512


# ---------------------------------------------------------------------------------------------
# Workspaces
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zero_bytes,zeroed", [(0xFFFFFFFF, "all"), (48, 48), (0, 0)])
def test_workspace_reused_per_stream_grown_and_captured(fake_gpu, backend, zero_bytes, zeroed):
    """A launch that needs a workspace gets the stream's reusable one, driver memory (grown when
    too small, its prefix zeroed by a memset queued before the launch on the same stream);
    another stream has its own; under graph capture the capturing stream's buffer serves when it
    is large enough, else memory from torch for that launch alone, and no buffer is made."""
    gpu = fake_gpu
    gpu.kernels.helpers = lambda spec: FakeHelper(spec, workspace=lambda a: 1000 * a.m, zero_bytes=zero_bytes)
    w = _weight()

    def call(m):
        n0 = gpu.driver.count()
        mixgemm.gemm(torch.randn(m, 512, dtype=torch.bfloat16), w)
        calls = gpu.driver.calls(n0)
        launches = [c for c in calls if c["kind"] == "launch"]
        memsets = [c for c in calls if c["kind"] == "memset"]
        assert len(launches) == 1
        ws = launched_args(launches[0]).workspace
        need = 1000 * m
        if zeroed:
            assert [(c["dptr"], c["count"], c["stream"]) for c in memsets] == \
                [(ws, need if zeroed == "all" else zeroed, gpu.stream)]
            assert calls.index(memsets[0]) < calls.index(launches[0])
        else:
            assert not memsets
        return ws

    allocs = gpu.driver.allocations()
    ws1 = call(3)
    pool = plans.WORKSPACES.get(-1, gpu.stream)
    assert ws1 != 0 and pool[1] == ws1 and pool[2] == plans.StreamArenas.MIN_BYTES
    assert gpu.driver.allocations() == allocs + 1, "driver memory, not torch's"
    assert call(5) == ws1 and plans.WORKSPACES.get(-1, gpu.stream)[0] is pool[0], "reused"
    ws_big = call(100)                         # 100000 bytes: grown to the next power of two
    assert plans.WORKSPACES.get(-1, gpu.stream)[2] == 1 << 17 and ws_big == plans.WORKSPACES.get(-1, gpu.stream)[1]
    assert pool[0] in plans.WORKSPACES.buffers() and pool[0].ptr, "the replaced buffer is kept (a graph may use it)"
    gpu.stream = 0x6000                        # another stream: its own workspace
    ws_other = call(3)
    assert ws_other == plans.WORKSPACES.get(-1, 0x6000)[1] != plans.WORKSPACES.get(-1, 0x5000)[1]
    held = {k: v[1] for k, v in plans.WORKSPACES._buffers.items()}
    allocs = gpu.driver.allocations()
    gpu.capturing = True                       # capture: the stream's buffer when large enough ...
    assert call(5) == ws_other
    gpu.stream = 0x7000                        # ... else torch's memory for the launch alone
    ws_captured = call(3)
    assert ws_captured not in held.values()
    assert {k: v[1] for k, v in plans.WORKSPACES._buffers.items()} == held
    assert gpu.driver.allocations() == allocs, "no buffer is made during a capture"
    gpu.capturing = False
    before = gpu.driver.allocated_bytes()
    plans.WORKSPACES.clear()
    assert gpu.driver.allocated_bytes() == before - (plans.StreamArenas.MIN_BYTES * 2 + (1 << 17))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_k_locks_zeroed_once_per_stream(fake_gpu, backend):
    """A stream-K launch takes zeroed locks apart from its workspace and leaves them zeroed
    (cutlass_ext/mixgemm/streamk_scheduler.hpp), so no launch zeroes anything: launches on a
    stream share one buffer of driver memory, zeroed on the stream when made and replaced by a
    larger one when a launch needs more; another stream has its own. Under graph capture the
    capturing stream's buffer serves when it is large enough; otherwise torch's memory, zeroed
    for that launch and released after it: nothing made during a capture outlives it. A kernel
    without such locks is offered none."""
    from mixgemm.jit.specs import ActType, GemmSpec, Scheduler, WeightType

    gpu = fake_gpu
    gpu.kernels.helpers = lambda spec: FakeHelper(spec, workspace=lambda a: 1000 * a.m, zero_bytes=0,
                                                  locks=lambda a: 256 * a.m)
    w = _weight()
    spec = GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64, scheduler=Scheduler.STREAMK)
    assert spec.self_resetting_locks

    def call(m, use=spec, memsets=0):
        n0 = gpu.driver.count()
        ops.gemm_with_spec(torch.randn(m, 512, dtype=torch.bfloat16), w, use)
        calls = gpu.driver.calls(n0)
        assert [c["kind"] for c in calls] == ["memset"] * memsets + ["launch"]
        return launched_args(calls[-1]).locks

    def region(stream=None):
        return plans.LOCKS.get(-1, gpu.stream if stream is None else stream)

    first = call(3, memsets=1)                 # made and zeroed once, on the stream, before the launch
    buf, ptr, size = region()
    assert first == ptr != 0 and size == plans.StreamArenas.MIN_BYTES and not any(buf.read())
    assert call(5) == first and region()[0] is buf, "reused, not zeroed again"
    big = call(1000, memsets=1)                # 256000 bytes: a new region of the next power of two
    assert big == region()[1] != first and region()[2] == 1 << 18 and not any(region()[0].read())
    assert call(3) == big
    gpu.stream = 0x6000                        # another stream: its own region
    assert call(3, memsets=1) == region(0x6000)[1] != region(0x5000)[1]
    held = {k: v[1] for k, v in plans.LOCKS._buffers.items()}
    allocs = gpu.driver.allocations()
    gpu.capturing = True                       # a capture on a stream whose region is large enough
    assert call(4) == held[(-1, 0x6000)]
    gpu.stream = 0x7000                        # a capture on a stream without one: torch's (zeroed by torch)
    captured = call(3)
    assert captured not in held.values()
    assert {k: v[1] for k, v in plans.LOCKS._buffers.items()} == held
    assert gpu.driver.allocations() == allocs, "no buffer is made during a capture"
    gpu.capturing = False
    assert not any(any(r.read()) for r in plans.LOCKS.buffers())
    # a kernel whose helper asks for no locks (a persistent tile) is offered none
    persistent = GemmSpec(ActType.BF16, WeightType.U4, 128, 128, 64, scheduler=Scheduler.PERSISTENT)
    assert not persistent.self_resetting_locks
    gpu.kernels.helpers = lambda s: FakeHelper(s)
    assert call(3, persistent) == 0


# ---------------------------------------------------------------------------------------------
# Errors of the helper and the driver
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_launch_errors_keep_their_messages(fake_gpu, backend):
    gpu = fake_gpu
    gpu.kernels.helpers = lambda spec: FakeHelper(
        spec, workspace=lambda a: 64 * a.m if a.m > 4 else 0, zero_bytes=16,
        refuse=lambda a: "M must be odd (a fake rule)" if a.m == 2 else None)
    w = _weight()
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    spec = ops.select_spec(1, w)
    mixgemm.gemm(x, w)
    with pytest.raises(KernelError, match=f"^{spec.name}: M must be odd"):
        mixgemm.gemm(torch.randn(2, 512, dtype=torch.bfloat16), w)
    gpu.driver.fail_next_launch(700)
    with pytest.raises(CudaError, match=rf"^cuLaunchKernelEx\({spec.name}\): CUDA_ERROR_FAKE"):
        mixgemm.gemm(x, w)
    gpu.driver.fail_next_memset(1)
    with pytest.raises(CudaError, match=r"^cuMemsetD8Async\(workspace\): CUDA_ERROR_FAKE"):
        mixgemm.gemm(torch.randn(6, 512, dtype=torch.bfloat16), w)
    mixgemm.gemm(x, w)     # and the next call is fine
    # the reference path (runtime.launch_gemm) says the same
    gpu.driver.fail_next_launch(700)
    kernel = runtime.KERNELS.get(spec, x.device)
    args = launched_args(gpu.launches()[-1])
    with pytest.raises(CudaError, match=rf"^cuLaunchKernelEx\({spec.name}\): CUDA_ERROR_FAKE"):
        runtime.launch_gemm(kernel, args)


# ---------------------------------------------------------------------------------------------
# QuantLinear: eager calls the plan, everything else the op
# ---------------------------------------------------------------------------------------------
def test_quantlinear_eager_path_and_op_path(fake_gpu, monkeypatch):
    """Eager without autograd calls the plan directly; with autograd recording, a tensor
    subclass or meta tensors, the custom op runs (it has no backward: torch's autograd fallback
    says so at backward()); both launch the same arguments."""
    gpu = fake_gpu
    op_calls = []
    real = ops.gemm_tensors
    monkeypatch.setattr(ops, "gemm_tensors", lambda *a, **k: op_calls.append(1) or real(*a, **k))
    layer = QuantLinear.from_packed(_weight(), bias=torch.randn(256, dtype=torch.bfloat16))
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        n0 = gpu.driver.count()
        y = layer(x)
        assert not op_calls and len(gpu.launches(n0)) == 1 and y.grad_fn is None
        eager = launched_args(gpu.launches(n0)[0])
    xg = x.clone().requires_grad_(True)
    n0 = gpu.driver.count()
    yg = layer(xg)                                   # autograd records: through the op
    assert op_calls == [1] and len(gpu.launches(n0)) == 1 and yg.grad_fn is not None
    via_op = launched_args(gpu.launches(n0)[0])
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        yg.float().sum().backward()
    fields = ("m", "n", "k", "group_size", "sm_count", "splits", "raster", "activation", "swizzle", "weight",
              "scales", "zeros", "bias", "ldx", "ldy")
    assert [getattr(eager, f) for f in fields] == [getattr(via_op, f) for f in fields]
    assert plans.PLANS.made == 1, "the op's implementation uses the same plan"
    ym = layer(x.to("meta"))                         # meta: the op's fake implementation
    assert ym.device.type == "meta" and ym.shape == (3, 256)


def test_quantlinear_under_torch_compile_fullgraph(fake_gpu):
    """torch.compile(fullgraph=True) traces the op (no graph break) and runs the same plan."""
    gpu = fake_gpu
    layer = QuantLinear.from_packed(_weight(), bias=torch.randn(256, dtype=torch.bfloat16))
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)
        eager = launched_args(gpu.launches()[-1])
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        n0 = gpu.driver.count()
        compiled(x)
        compiled(x)
    assert len(gpu.launches(n0)) == 2 and plans.PLANS.made == 1
    got = launched_args(gpu.launches()[-1])
    assert (got.m, got.weight, got.bias, got.x) == (eager.m, eager.weight, eager.bias, x.data_ptr())


# ---------------------------------------------------------------------------------------------
# The compiled launcher: built once, cached like a kernel; the fallback without a compiler
# ---------------------------------------------------------------------------------------------
@pytest.mark.nvcc
def test_launcher_library_is_cached_and_validated(tmp_path, monkeypatch):
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path))
    runs = []
    real_run = build._run_nvcc
    monkeypatch.setattr(build, "_run_nvcc", lambda *a: runs.append(a) or real_run(*a))
    first = launcher.load_compiled()
    assert len(runs) == 1 and first.path.parent.parent == tmp_path / "host"
    assert launcher.load_compiled().path == first.path and len(runs) == 1, "the second load builds nothing"
    assert launcher.build_compiled() == first.path and len(runs) == 1     # `mixgemm generate --build`'s step
    damaged = first.path.with_name("damaged")        # a damaged entry is rebuilt (a new file: the
    damaged.write_bytes(b"corrupt")                  # loaded one stays mapped in this process)
    os.replace(damaged, first.path)
    again = launcher.load_compiled()
    assert len(runs) == 2 and again.path == first.path
    # the key covers the source and the mixgemm headers it includes
    key = build.host_library_key("launcher", launcher.SOURCE.read_text(), build.toolchain())
    assert first.path.parent.name == f"launcher-{key[:20]}"
    assert build.host_library_key("launcher", launcher.SOURCE.read_text() + "\n", build.toolchain()) != key


def test_without_a_compiler_the_python_launcher_runs(fake_gpu, monkeypatch, caplog):
    """No nvcc: a warning, and the plans launch from Python; MIXGEMM_LAUNCHER=compiled makes it
    an error instead; a bad value is refused."""
    monkeypatch.setattr(build, "toolchain", lambda: (_ for _ in ()).throw(BuildError("nvcc not found")))
    monkeypatch.setenv(launcher.LAUNCHER_ENV, "auto")
    launcher.reset()
    w = _weight()
    with caplog.at_level(logging.WARNING, logger="mixgemm"):
        mixgemm.gemm(torch.randn(1, 512, dtype=torch.bfloat16), w)
    assert plans.PLANS.plans()[0].backend == "python"
    assert "compiled launcher is not available" in caplog.text
    monkeypatch.setenv(launcher.LAUNCHER_ENV, "compiled")
    launcher.reset()
    with pytest.raises(BuildError):
        mixgemm.gemm(torch.randn(1, 512, dtype=torch.bfloat16), _weight(seed=2))
    monkeypatch.setenv(launcher.LAUNCHER_ENV, "fastest")
    with pytest.raises(ValueError, match="MIXGEMM_LAUNCHER"):
        launcher.mode()


# ---------------------------------------------------------------------------------------------
# The real helper: the compiled launcher, the Python one and the reference launch agree
# ---------------------------------------------------------------------------------------------
@pytest.mark.nvcc
@pytest.mark.parametrize("backend", ["compiled", "python"])
def test_real_helper_launches_equal_the_reference_bit_for_bit(fake_dir, session_cache, monkeypatch, backend):
    """With the real decode helper (built by nvcc), a planned launch passes the driver exactly
    the params, grid, block, cluster, shared memory, PDL attribute and memset that
    runtime.launch_gemm (the reference: the pre-plan path) passes, for the tuned split factor
    (a cluster reduction) and a forced 12 (the global workspace)."""
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(session_cache))
    w = _weight(n=4096, k=4096)
    bias = torch.randn(4096, dtype=torch.bfloat16)
    x = torch.randn(3, 4096, dtype=torch.bfloat16)
    with FakeGpu(fake_dir, launcher_mode=backend, helpers="real") as gpu:
        spec = ops.select_spec(3, w)
        kernel = runtime.KERNELS.get(spec, x.device)
        gpu.driver.reset(params_size=kernel.helper.params_size)
        for splits in (ops._tuned_splits(spec, w, x.device), 12):
            y = torch.empty(3, 4096, dtype=torch.bfloat16)
            n0 = gpu.driver.count()
            if splits == 12:
                ops.gemm_with_spec(x, w, spec, bias=bias, out=y, splits=12)
            else:
                mixgemm.gemm(x, w, bias=bias, out=y)
            ours = gpu.driver.calls(n0)
            args = driver.GemmArgs(abi_version=driver.ABI_VERSION, m=3, n=4096, k=4096, group_size=128,
                                    sm_count=132, splits=splits, raster=Raster.HEURISTIC.abi, swizzle=1,
                                    activation=0, weight=w.qdata.data_ptr(), scales=w.scales.data_ptr(),
                                    zeros=w.zeros.data_ptr(), x=x.data_ptr(), bias=bias.data_ptr(), y=y.data_ptr(),
                                    workspace=0, ldx=4096, ldy=4096)
            n0 = gpu.driver.count()
            runtime.launch_gemm(kernel, args)
            ref = gpu.driver.calls(n0)
            assert [c["kind"] for c in ours] == [c["kind"] for c in ref]
            if splits == 12:    # the workspaces differ: compare with the reference's pointers swapped in
                assert ours[0]["count"] == ref[0]["count"] > 0
                swap = {ref[0]["dptr"]: ours[0]["dptr"],
                        ref[0]["dptr"] + ref[0]["count"]: ours[0]["dptr"] + ours[0]["count"]}
                params = ref[-1]["params"]
                for old, new in swap.items():
                    params = params.replace(old.to_bytes(8, "little"), new.to_bytes(8, "little"))
                ref[-1]["params"] = params
                ref[0]["dptr"] = ours[0]["dptr"]
            assert ours == ref
            assert ours[-1]["pdl"] == 1 and ours[-1]["cluster"] == ((1, splits, 1) if splits <= 8 else (1, 1, 1))
