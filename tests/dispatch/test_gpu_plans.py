"""Launch plans on the GPU: reused (no re-plan), bit for bit the reference launch, captured by
CUDA graphs, the same errors after a plan exists, one workspace per stream."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import mixgemm
from mixgemm.jit import catalog
from mixgemm.jit import driver
from mixgemm.jit import launcher, loader as runtime
from mixgemm.dispatch import heuristic, plans
from mixgemm.ops import dense as ops
from mixgemm.nn import QuantLinear
from mixgemm.weights.quantize import interleave_gate_up
from mixgemm.jit.specs import Activation

pytestmark = pytest.mark.gpu


def _weight(dev, n=4096, k=4096, bits=4, symmetric=False, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(n, k, device=dev, generator=gen) * 0.02
    return mixgemm.prepack(mixgemm.quantize(w, bits, 128, symmetric=symmetric, dtype=dtype))


def _gate_up(dev, n=4096, k=4096):
    gen = torch.Generator(device=dev).manual_seed(5)
    qg = mixgemm.quantize(torch.randn(n // 2, k, device=dev, generator=gen) * 0.02, 4, 128, dtype=torch.bfloat16)
    qu = mixgemm.quantize(torch.randn(n // 2, k, device=dev, generator=gen) * 0.02, 4, 128, dtype=torch.bfloat16)
    return mixgemm.prepack(interleave_gate_up(qg, qu))


def reference(x, w, spec, bias=None, activation=None, splits=0):
    """The launch as mixgemm made it before the plans: GemmArgs filled field by field, then
    runtime.launch_gemm (helper.prepare into new buffers, cuda-python objects made per call, a
    workspace from torch's allocator)."""
    raster, swizzle = catalog.launch_order(spec)
    m = x.shape[0]
    n_out = w.n // 2 if activation == "swiglu" else w.n
    y = torch.empty(m, n_out, device=x.device, dtype=x.dtype)
    args = driver.GemmArgs()
    args.abi_version = driver.ABI_VERSION
    args.m, args.n, args.k, args.group_size = m, w.n, w.k, w.group_size
    args.sm_count = heuristic.sm_count(x.device.index)
    args.splits, args.raster, args.swizzle = splits, raster.abi, swizzle
    args.activation = Activation(activation or "none").abi
    args.weight, args.scales = w.qdata.data_ptr(), w.scales.data_ptr()
    args.zeros = 0 if w.zeros is None else w.zeros.data_ptr()
    args.x, args.y = x.data_ptr(), y.data_ptr()
    args.bias = 0 if bias is None else bias.data_ptr()
    args.ldx, args.ldy = w.k, n_out
    runtime.launch_gemm(runtime.KERNELS.get(spec, x.device), args)
    return y


@contextlib.contextmanager
def launcher_mode(mode):
    old = os.environ.get(launcher.LAUNCHER_ENV)
    os.environ[launcher.LAUNCHER_ENV] = mode
    launcher.reset()
    plans.clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ[launcher.LAUNCHER_ENV]
        else:
            os.environ[launcher.LAUNCHER_ENV] = old
        launcher.reset()
        plans.clear()


def test_plans_are_reused(requires_gpu):
    """The second call makes no plan; QuantLinear over the same tensors shares gemm's plan; the
    planned launch is the compiled launcher (nvcc is on the GPU machine)."""
    dev = requires_gpu
    w = _weight(dev)
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    plans.clear()
    y1 = mixgemm.gemm(x, w)
    assert plans.PLANS.made == 1
    y2 = mixgemm.gemm(x, w)
    assert plans.PLANS.made == 1 and torch.equal(y1, y2)
    assert plans.PLANS.plans()[0].backend == "compiled"
    layer = QuantLinear.from_packed(w)
    with torch.no_grad():
        assert torch.equal(layer(x), y1)
        layer(x)
    assert plans.PLANS.made == 1
    for m in (2, 8):   # the same token bucket
        mixgemm.gemm(torch.randn(m, 4096, device=dev, dtype=torch.bfloat16), w)
    assert plans.PLANS.made == 1


# (M, activation, forced decode splits or None) over every kind of launch: decode kernels with a
# cluster reduction, with the global workspace (12 splits), the stream-K GEMMs (a workspace of
# partials and the stream's zeroed locks), the gated epilogue
_CASES = [(1, None, None), (3, "silu", None), (16, None, None), (25, None, None), (1, None, 12),
          (64, None, None), (100, "gelu", None), (300, None, None), (1, "swiglu", None), (64, "swiglu", None),
          (1024, None, None), (1536, None, None)]


@pytest.mark.parametrize("m,activation,splits", _CASES)
def test_planned_launch_equals_the_reference_bit_for_bit(requires_gpu, m, activation, splits):
    """The compiled launcher and the Python one give exactly the reference launch's output."""
    dev = requires_gpu
    w = _gate_up(dev) if activation == "swiglu" else _weight(dev)
    bias = torch.randn(w.n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    spec = ops.select_spec(m, w, activation)
    if splits is None:
        run = lambda: mixgemm.gemm(x, w, bias=bias, activation=activation)
        splits = ops._tuned_splits(spec, w, x.device)
    else:
        run = lambda: ops.gemm_with_spec(x, w, spec, bias=bias, splits=splits)
    ref = reference(x, w, spec, bias, activation, splits)
    ref2 = reference(x, w, spec, bias, activation, splits)
    deterministic = torch.equal(ref, ref2)
    outputs = {}
    for mode in ("compiled", "python"):
        with launcher_mode(mode):
            run()
            outputs[mode] = run()      # the second call: the cached plan
            assert plans.PLANS.made == 1 and plans.PLANS.plans()[0].backend == mode
    for mode, y in outputs.items():
        if deterministic:
            assert torch.equal(y, ref), mode
        else:   # a kernel whose reduction order varies from run to run: as close as two reference runs
            tol = (ref2.float() - ref.float()).abs().max().item()
            assert (y.float() - ref.float()).abs().max().item() <= 2 * tol + 1e-2, mode


def test_large_m_plans_follow_the_device(requires_gpu):
    """Above 512 tokens each call launches the config the full path picks on this GPU's SM count
    (heuristic.large_bucket on the cached path): on 4096 x 4096 at 132 SMs, "xlp" at 1024 tokens
    (128 tiles: one wave), "xl" at 1536 (192 tiles: stream-K evens out the tail). The outputs
    stay within K-scaled tolerance of the float64 reference."""
    dev = requires_gpu
    w = _weight(dev)
    deq = mixgemm.dequantize_reference(w).to(dev).double()
    sms = heuristic.sm_count(dev.index)
    plans.clear()
    labels = set()
    for m in (1024, 1536, 1000, 2048, 1536, 4000):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        for _ in range(2):   # the full path, then the cached one
            y = mixgemm.gemm(x, w)
        want = ops.select_spec(m, w, None, sms)
        labels.add(ops.select_tile(m, w.n, w.k, sms).label)
        plan = next(p for p in plans.PLANS.plans() if p.spec == want)
        assert plan.made_for(w, want, 0)
        ref = x.double() @ deq.T
        assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3, m
    if sms == 132:
        assert labels == {"xl", "xlp"}
    assert plans.PLANS.made == len({heuristic.token_bucket(m, w.n, w.k, sms) for m in (1024, 1536, 1000, 2048, 4000)})


@pytest.mark.parametrize("m", (1, 64, 300, 1536))
def test_graphs_capture_the_planned_path(requires_gpu, m):
    """Capture twice: the first capture makes the capture-state plan, the second reuses it;
    replays equal eager calls, also after the eager workspaces were dropped and their memory
    handed out again (a captured launch owns its workspace through the graph's pool)."""
    dev = requires_gpu
    w = _weight(dev)
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    plans.clear()
    mixgemm.gemm(x, w)                       # warm-up: the kernel and the eager plan
    torch.cuda.synchronize()
    graphs, outs = [], []
    for i in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(mixgemm.gemm(x, w))
        graphs.append(g)
        assert plans.PLANS.made == 2, "one capture-state plan, made by the first capture"
    assert sum(p.capturing for p in plans.PLANS.plans()) == 1
    plans.WORKSPACES.clear()
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 20,), 7, device=dev, dtype=torch.int32) for _ in range(8)]
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        want = mixgemm.gemm(x, w)
        for out in outs:
            assert torch.equal(out, want)
    del junk


def test_bad_inputs_raise_the_same_with_a_plan(requires_gpu):
    """tests/ops/test_gpu_gemm.py's bad inputs, after a plan exists for the weight: the same
    errors, messages included."""
    dev = requires_gpu
    w = _weight(dev, 256, 512)
    x = torch.randn(4, 512, device=dev, dtype=torch.bfloat16)
    calls = [lambda: mixgemm.gemm(x.half(), w),
             lambda: mixgemm.gemm(torch.randn(4, 256, device=dev, dtype=torch.bfloat16), w),
             lambda: mixgemm.gemm(x.cpu(), w),
             lambda: mixgemm.gemm(x, w, out=torch.empty(4, 255, device=dev, dtype=torch.bfloat16)),
             lambda: mixgemm.gemm(x, w, bias=torch.zeros(255, device=dev, dtype=torch.bfloat16)),
             lambda: mixgemm.gemm(x, w, bias=torch.zeros(512, device=dev, dtype=torch.bfloat16)[::2]),
             lambda: mixgemm.gemm(x, torch.zeros(256, 512, device=dev)),
             lambda: mixgemm.gemm(x, w, activation="relu")]

    def errors():
        out = []
        for call in calls:
            with pytest.raises((TypeError, ValueError)) as e:
                call()
            out.append((type(e.value), str(e.value)))
        return out

    plans.clear()
    cold = errors()
    mixgemm.gemm(x, w)
    assert plans.PLANS.made == 1
    assert errors() == cold


def test_quantlinear_paths_agree(requires_gpu):
    """QuantLinear eager (the plan), through the custom op (autograd recording) and compiled
    (fullgraph) give the same bits."""
    dev = requires_gpu
    lin = torch.nn.Linear(4096, 4096).to(dev, torch.bfloat16)
    layer = QuantLinear.from_linear(lin, bits=4, group_size=128)
    x = torch.randn(5, 4096, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    via_op = layer(x.clone().requires_grad_(True))
    assert via_op.grad_fn is not None
    assert torch.equal(eager, compiled) and torch.equal(eager, via_op.detach())


def test_one_workspace_per_stream(requires_gpu):
    """Stream-K launches (M = 64: 32 tiles of 128 x 64 split over the SMs, so a workspace) on two
    streams at once each use their stream's workspace and give the single-stream result."""
    dev = requires_gpu
    w = _weight(dev)
    xs = [torch.randn(64, 4096, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    want = [mixgemm.gemm(x, w) for x in xs]
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    torch.cuda.synchronize()
    got = [None, None]
    for _ in range(5):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                got[i] = mixgemm.gemm(xs[i], w)
    torch.cuda.synchronize()
    keys = {key for key in plans.WORKSPACES._buffers}
    assert {(0, s.cuda_stream) for s in streams} <= keys
    for g, y in zip(got, want):
        assert torch.equal(g, y) or (g.float() - y.float()).abs().max().item() < 1e-2


def _stream_k_chain(dev):
    """Stream-K launches of several shapes and decompositions, one after another on one stream:
    (weight, x, spec, forced splits). M = 64 / 128 on 4096 x 4096 (128 x 64 tiles, stream-K
    units), the 256 x 64 tile at M = 64 on 4096 x 4096 (16 tiles over every SM: ~8 splits per
    tile, so many slots per tile), M = 300 on 4096 x 14336 (128 x 256 tiles), and forced split-K
    (3 and 7 splits: every tile is split, so every lock is used)."""
    from mixgemm.jit.catalog import TILE_CONFIGS

    cases = []
    for i, (n, k, m, splits, label) in enumerate([(4096, 4096, 64, 0, None), (4096, 14336, 300, 0, None),
                                                   (4096, 4096, 128, 3, None), (6144, 4096, 64, 0, None),
                                                   (4096, 4096, 64, 0, "tall"), (4096, 14336, 64, 7, None)]):
        w = _weight(dev, n, k, seed=i)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        spec = (ops.select_spec(m, w) if label is None else
                next(tc for tc in TILE_CONFIGS if tc.label == label).spec(w.act_type, w.weight_type))
        assert spec.self_resetting_locks, spec.name
        cases.append((w, x, spec, splits))
    return cases


def _graph_nodes(g) -> int:
    from cuda.bindings import driver as drv

    raw = g.raw_cuda_graph()
    err, _, count = drv.cuGraphGetNodes(drv.CUgraph(raw), 0)
    assert err == drv.CUresult.CUDA_SUCCESS
    return int(count)


def test_stream_k_locks_are_left_zeroed_and_shared(requires_gpu):
    """Stream-K launches leave their locks zeroed (cutlass_ext/mixgemm/streamk_scheduler.hpp), so a
    stream's launches share one lock buffer with no memset: a chain of stream-K GEMMs of several
    shapes and decompositions, run eagerly three times on a side stream, equals the reference
    launches (fresh zeroed locks each) bit for bit (the reduction order is deterministic), and
    the buffer is all zeros afterwards. Captured on that stream, the chain is its launches alone
    (the stream's locks); captured on a stream that never ran it, each launch brings its own
    zeroed locks (a memset node each), released with the capture. The replays (with new inputs,
    the graphs one after another) equal eager calls."""
    dev = requires_gpu
    plans.clear()
    chain = _stream_k_chain(dev)

    def run():
        return [ops.gemm_with_spec(x, w, spec, splits=s) for w, x, spec, s in chain]

    ref = [reference(x, w, spec, splits=s) for w, x, spec, s in chain]
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            got = run()
    torch.cuda.synchronize()
    for y, r, (w, x, spec, s) in zip(got, ref, chain):
        assert torch.equal(y, r), (spec.name, s)
        want = x.double() @ mixgemm.dequantize_reference(w).to(dev).double().T
        assert ((y.double() - want).norm() / want.norm()).item() < 4e-3, (spec.name, s)
    lock_buffers = [b for b in plans.LOCKS.buffers() if plans.LOCKS.get(0, side.cuda_stream)[0] is b]
    assert len(lock_buffers) == 1 and not any(lock_buffers[0].read()), "one buffer for the stream, left zeroed"

    graphs, outs = [], []
    for stream, nodes in ((side, len(chain)), (side, len(chain)), (None, 2 * len(chain))):
        g = torch.cuda.CUDAGraph(keep_graph=True)   # (its cudaGraph_t kept: its nodes are counted)
        made = plans.LOCKS.nbytes()
        with torch.cuda.graph(g, stream=stream):
            outs.append(run())
        graphs.append(g)
        assert _graph_nodes(g) == nodes, "the launches (and a zeroing node each without the stream's locks)"
        assert plans.LOCKS.nbytes() == made, "no lock buffer made during a capture"
    for _ in range(3):
        for _, x, _, _ in chain:
            x.copy_(torch.randn_like(x))
        for g in (graphs[0], graphs[1], graphs[2], graphs[0]):
            g.replay()
        torch.cuda.synchronize()
        want = run()
        for out in outs:
            for y, r in zip(out, want):
                assert torch.equal(y, r)
    torch.cuda.synchronize()
    assert not any(any(b.read()) for b in plans.LOCKS.buffers())
