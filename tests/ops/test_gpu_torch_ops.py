"""The C++ kernels of ``torch.ops.mixgemm.gemm``, the RMSNorm operators and
``torch.ops.mixgemm.rotary_kv_cache`` (mixgemm.jit.torch_ops) on the GPU.

A compiled graph's GEMMs must launch from C++ once their plans exist (the library's counters
say who launched), with outputs equal to eager's bit for bit; every call it cannot take (no plan,
zero offsets, a strided x, a bad argument) must reach the Python kernel, with its result or
its error; its plans must leave with their weights; and it must work under plain CUDA-graph
capture, with new inputs at each replay. The norms and the rotary / KV-cache write likewise
launch from C++ (the rotary's caches equal to eager's too) and hand what they cannot take to
Python, in compiled graphs and in eager calls after the first.
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import mixgemm
from mixgemm.dispatch import plans
from mixgemm.nn import QuantLinear

pytestmark = pytest.mark.gpu

H = 1024


def _linear(n, k, dev, seed=0, bits=4, **kw):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lin = nn.Linear(k, n, bias=kw.pop("bias", False))
    lin.weight.data = torch.randn(n, k, generator=g) * 0.02
    if lin.bias is not None:
        lin.bias.data = torch.randn(n, generator=g) * 0.1
    return QuantLinear.from_linear(lin.to(dev, torch.bfloat16), bits=bits, group_size=128, **kw)


def _op(layer: QuantLinear, x):
    return torch.ops.mixgemm.gemm(x, layer.qdata, layer.scales, layer.zeros, layer.zero_offsets, layer.bias,
                                  layer.weight_type.value, layer.group_size, layer.weight_rows, layer.in_features,
                                  layer.activation)


def test_compiled_chain_launches_from_cpp_and_equals_eager(requires_gpu, library):
    dev = requires_gpu
    chain = nn.Sequential(*[_linear(H, H, dev, seed=i, bits=(4, 2, 8)[i % 3], bias=i == 1) for i in range(6)])
    compiled = torch.compile(chain, fullgraph=True)
    with torch.no_grad():
        for m in (1, 7, 64, 300):
            x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
            want = chain(x)
            compiled(x)   # compile, and the plans
            torch.cuda.synchronize()
            hits, fallbacks = library.counters()
            got = compiled(x)
            torch.cuda.synchronize()
            hits2, fallbacks2 = library.counters()
            assert (hits2 - hits, fallbacks2 - fallbacks) == (6, 0), m
            assert torch.equal(got, want), m


def test_calls_it_cannot_take_reach_the_python_kernel(requires_gpu, library):
    dev = requires_gpu
    layer = _linear(512, H, dev, seed=3)
    x = torch.randn(8, 2 * H, device=dev, dtype=torch.bfloat16)[:, ::2]   # strided
    want = layer(x.contiguous())
    _, before = library.counters()
    assert torch.equal(_op(layer, x), want)
    assert library.counters()[1] > before
    with pytest.raises(ValueError):
        _op(layer, torch.randn(8, H + 64, device=dev, dtype=torch.bfloat16))
    # HQQ-style fractional zero points: the offsets' term is added in torch, by the Python kernel
    frac = _linear(512, H, dev, seed=4)
    frac.zero_offsets = torch.randn(H // 128, 512, device=dev) * 1e-3
    x = torch.randn(4, H, device=dev, dtype=torch.bfloat16)
    _op(frac, x)
    _, before = library.counters()
    assert torch.equal(_op(frac, x), frac(x))
    assert library.counters()[1] > before


def test_plans_leave_with_their_weights(requires_gpu, library):
    dev = requires_gpu
    gc.collect()
    start = library.plan_count()
    layer = _linear(512, H, dev, seed=5)
    x = torch.randn(3, H, device=dev, dtype=torch.bfloat16)
    _op(layer, x)
    assert library.plan_count() == start + 1
    hits, _ = library.counters()
    _op(layer, x)
    assert library.counters()[0] == hits + 1
    del layer
    gc.collect()
    assert library.plan_count() == start


def test_plain_cuda_graph_capture_replays_with_new_inputs(requires_gpu, library):
    dev = requires_gpu
    layers = [_linear(H, H, dev, seed=6), _linear(H, H, dev, seed=7)]
    for m in (1, 16, 200):
        x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up: the plans and buffers, outside the capture
            for _ in range(2):
                _op(layers[1], _op(layers[0], x))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = _op(layers[1], _op(layers[0], x))
        for seed in range(3):
            x.copy_(torch.randn(m, H, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(seed)))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, layers[1](layers[0](x))), (m, seed)


def test_compiled_norms_launch_from_cpp_and_equal_eager(requires_gpu, library):
    dev = requires_gpu
    weight = torch.rand(H, device=dev, dtype=torch.bfloat16) + 0.5

    def chain(x, residual):
        for _ in range(3):
            x, residual = mixgemm.rms_norm(x, weight, 1e-5, residual=residual)
        return mixgemm.rms_norm(x, weight, 1e-5), residual

    compiled = torch.compile(chain, fullgraph=True)
    for m in (1, 5, 300):
        x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
        r = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
        want = chain(x, r)
        compiled(x, r)
        torch.cuda.synchronize()
        hits, fallbacks = library.counters()
        got = compiled(x, r)
        torch.cuda.synchronize()
        assert (library.counters()[0] - hits, library.counters()[1] - fallbacks) == (4, 0), m
        assert all(torch.equal(g, w) for g, w in zip(got, want)), m
    # a strided x goes to the Python kernel, which copies it
    x = torch.randn(4, 2 * H, device=dev, dtype=torch.bfloat16)[:, ::2]
    _, before = library.counters()
    assert torch.equal(torch.ops.mixgemm.rms_norm(x, weight, 1e-5), mixgemm.rms_norm(x.contiguous(), weight, 1e-5))
    assert library.counters()[1] == before + 1
    with pytest.raises(ValueError, match="weight must be a 1-D tensor"):
        torch.ops.mixgemm.rms_norm(x.contiguous(), weight[:-8], 1e-5)


def test_eager_norms_launch_from_cpp_after_the_first_call(requires_gpu, library):
    """Eager mixgemm.rms_norm, with and without the residual: once a call on the device has
    handed the kernel over, every plain call launches from C++ (the hits grow, the fallbacks do
    not), with outputs equal bit for bit to the Python kernel's (``rms_norm_py`` /
    ``add_rms_norm_py``); a strided x reaches Python with its result, a bad weight with its
    error."""
    dev = requires_gpu
    for dtype in (torch.bfloat16, torch.float16):
        weight = (torch.rand(H, device=dev) + 0.5).to(dtype)
        x = torch.randn(2, H, device=dev, dtype=dtype)
        mixgemm.rms_norm(x, weight, 1e-5)
        mixgemm.rms_norm(x, weight, 1e-5, residual=x)
        assert plans.OPERATORS.holds_norm(x, False) and plans.OPERATORS.holds_norm(x, True)
        for m in (1, 5, 300):
            x = torch.randn(m, H, device=dev, dtype=dtype)
            r = torch.randn(m, H, device=dev, dtype=dtype)
            want = torch.ops.mixgemm.rms_norm_py(x, weight, 1e-5)
            want_y, want_s = torch.ops.mixgemm.add_rms_norm_py(x, r, weight, 1e-5)
            torch.cuda.synchronize()
            hits, fallbacks = library.counters()
            got = mixgemm.rms_norm(x, weight, 1e-5)
            got_y, got_s = mixgemm.rms_norm(x, weight, 1e-5, residual=r)
            torch.cuda.synchronize()
            case = (dtype, m)
            assert (library.counters()[0] - hits, library.counters()[1] - fallbacks) == (2, 0), case
            assert torch.equal(got, want) and torch.equal(got_y, want_y) and torch.equal(got_s, want_s), case
        # a strided x goes to the Python kernel, which copies it
        x = torch.randn(4, 2 * H, device=dev, dtype=dtype)[:, ::2]
        _, before = library.counters()
        want = torch.ops.mixgemm.rms_norm_py(x.contiguous(), weight, 1e-5)
        assert torch.equal(mixgemm.rms_norm(x, weight, 1e-5), want)
        assert library.counters()[1] == before + 1
        # a bad weight: the Python kernel's error, the same as the Python path's
        with pytest.raises(ValueError, match=r"weight must be a 1-D tensor of H=1024 values, got \[1016\]"):
            mixgemm.rms_norm(x.contiguous(), weight[:-8], 1e-5)
        assert library.counters()[1] == before + 2


ROPE_HEADS, ROPE_KV, ROPE_D, ROPE_LEN = 8, 2, 128, 64
ROPE_WIDTH = (ROPE_HEADS + 2 * ROPE_KV) * ROPE_D


def _rope_tables(dev, positions=ROPE_LEN, d=ROPE_D):
    """LLaMA's cos / sin tables [positions, D] in bf16."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dev, torch.bfloat16), emb.sin().to(dev, torch.bfloat16)


def _caches(b, dev, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (b, ROPE_KV, ROPE_LEN, ROPE_D)
    return (torch.randn(shape, generator=g).to(dev, torch.bfloat16),
            torch.randn(shape, generator=g).to(dev, torch.bfloat16))


def _rope_op(qkv, cos, sin, k_cache, v_cache, positions, pos0=0):
    return torch.ops.mixgemm.rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, positions, pos0, ROPE_HEADS, ROPE_KV)


def test_compiled_rotary_launches_from_cpp_and_equals_eager(requires_gpu, library):
    dev = requires_gpu
    cos, sin = _rope_tables(dev)

    def chain(qkvs, k_cache, v_cache, positions):
        # each call writes the next T positions (positions: a [B, T] tensor, or the first token's)
        return [mixgemm.rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, positions + i * qkv.shape[1], ROPE_HEADS,
                                        ROPE_KV) for i, qkv in enumerate(qkvs)]

    compiled = torch.compile(chain, fullgraph=True)
    for b, t in ((1, 1), (4, 1), (2, 5)):
        g = torch.Generator(device="cpu").manual_seed(b * 10 + t)
        qkvs = [torch.randn(b, t, ROPE_WIDTH, generator=g).to(dev, torch.bfloat16) for _ in range(3)]
        starts = torch.randint(0, ROPE_LEN - 3 * t, (b, 1), generator=g)
        table = (starts + torch.arange(t)[None]).to(dev)                      # int64 [B, T]
        for positions in (table, 7):
            k0, v0 = _caches(b + 1, dev, seed=b + t)
            k_want, v_want = k0.clone(), v0.clone()
            want = chain(qkvs, k_want, v_want, positions)
            k_cache, v_cache = k0.clone(), v0.clone()
            compiled(qkvs, k_cache, v_cache, positions)   # compile, and the kernel handed over
            torch.cuda.synchronize()
            k_cache, v_cache = k0.clone(), v0.clone()
            hits, fallbacks = library.counters()
            got = compiled(qkvs, k_cache, v_cache, positions)
            torch.cuda.synchronize()
            case = (b, t, type(positions).__name__)
            assert (library.counters()[0] - hits, library.counters()[1] - fallbacks) == (3, 0), case
            assert all(torch.equal(q, q_want) for q, q_want in zip(got, want)), case
            assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want), case


def test_rotary_calls_it_cannot_take_reach_the_python_kernel(requires_gpu, library):
    dev = requires_gpu
    cos, sin = _rope_tables(dev)
    b, t = 2, 3
    qkv = torch.randn(b, t, ROPE_WIDTH, device=dev, dtype=torch.bfloat16)
    k0, v0 = _caches(b, dev, seed=11)
    _rope_op(qkv, cos, sin, k0.clone(), v0.clone(), None, 0)   # the kernel handed over
    hits, _ = library.counters()
    _rope_op(qkv, cos, sin, k0.clone(), v0.clone(), None, 0)
    assert library.counters()[0] == hits + 1
    table = torch.tensor([[3, 4, 5], [40, 9, 1]], device=dev)

    def check(k_cache, v_cache, positions, pos0=0, **tables):
        """The op on these arguments goes to Python, with eager's q and caches."""
        k_want, v_want = k0.clone(), v0.clone()
        want = mixgemm.rotary_kv_cache(qkv, cos, sin, k_want, v_want, positions if positions is not None else pos0,
                                       ROPE_HEADS, ROPE_KV)
        _, before = library.counters()
        got = _rope_op(qkv, tables.get("cos", cos), tables.get("sin", sin), k_cache, v_cache, positions, pos0)
        assert library.counters()[1] == before + 1
        assert torch.equal(got, want)
        assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)

    # int32 positions: Python converts them
    check(k0.clone(), v0.clone(), table.int())
    # a non-contiguous position table: Python copies it
    check(k0.clone(), v0.clone(), table.t().contiguous().t())
    # caches whose last stride is not 1: Python runs the torch formula (equal to the kernel's)
    k_big = torch.stack((k0, torch.randn_like(k0)), dim=-1)
    v_big = torch.stack((v0, torch.randn_like(v0)), dim=-1)
    k_other, v_other = k_big[..., 1].clone(), v_big[..., 1].clone()
    check(k_big[..., 0], v_big[..., 0], table)
    assert torch.equal(k_big[..., 1], k_other) and torch.equal(v_big[..., 1], v_other)
    # caches of one shape but other strides
    check(k0.clone(), v0.clone().transpose(1, 2).contiguous().transpose(1, 2), None, 5)
    # tables that are not contiguous: Python copies them
    wide = torch.cat((cos, sin), dim=-1)
    check(k0.clone(), v0.clone(), None, 2, cos=wide[:, :ROPE_D], sin=wide[:, ROPE_D:])
    # positions outside the tables and the cache: Python raises, nothing is written
    for pos0 in (ROPE_LEN - t + 1, -1):
        k_cache, v_cache = k0.clone(), v0.clone()
        _, before = library.counters()
        with pytest.raises(ValueError, match="outside the 64 positions"):
            _rope_op(qkv, cos, sin, k_cache, v_cache, None, pos0)
        assert library.counters()[1] == before + 1
        assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)
    # no tokens: an empty q, from C++ without a launch
    hits, fallbacks = library.counters()
    q = _rope_op(qkv[:0], cos, sin, k0.clone(), v0.clone(), None, 0)
    assert q.shape == (0, t, ROPE_HEADS, ROPE_D) and q.dtype == torch.bfloat16
    assert library.counters() == (hits + 1, fallbacks)


def test_eager_rotary_launches_from_cpp_after_the_first_call(requires_gpu, library):
    """Eager mixgemm.rotary_kv_cache: once a call on the device has handed the kernel over, every
    plain call (an int first position or an int64 position table) launches from C++, with q and
    the caches equal bit for bit to the Python kernel's (``rotary_kv_cache_py``); int32
    positions reach Python with their result, a first position out of range with its error and
    nothing written."""
    dev = requires_gpu
    cos, sin = _rope_tables(dev)
    b, t = 2, 3
    qkv = torch.randn(b, t, ROPE_WIDTH, device=dev, dtype=torch.bfloat16)
    k0, v0 = _caches(b, dev, seed=21)
    mixgemm.rotary_kv_cache(qkv, cos, sin, k0.clone(), v0.clone(), 0, ROPE_HEADS, ROPE_KV)
    assert plans.OPERATORS.holds_rope(qkv)
    table = torch.tensor([[3, 4, 5], [40, 9, 1]], device=dev)
    for seed, positions in enumerate((7, table, 0)):
        qkv = torch.randn(b, t, ROPE_WIDTH, device=dev, dtype=torch.bfloat16,
                          generator=torch.Generator(dev).manual_seed(seed))
        k_want, v_want = k0.clone(), v0.clone()
        given = positions if isinstance(positions, torch.Tensor) else None
        want = torch.ops.mixgemm.rotary_kv_cache_py(qkv, cos, sin, k_want, v_want, given,
                                                    0 if given is not None else positions, ROPE_HEADS, ROPE_KV)
        k_cache, v_cache = k0.clone(), v0.clone()
        torch.cuda.synchronize()
        hits, fallbacks = library.counters()
        got = mixgemm.rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, positions, ROPE_HEADS, ROPE_KV)
        torch.cuda.synchronize()
        case = type(positions).__name__
        assert (library.counters()[0] - hits, library.counters()[1] - fallbacks) == (1, 0), case
        assert torch.equal(got, want) and torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want), case
    # int32 positions: the Python kernel converts them
    k_want, v_want = k0.clone(), v0.clone()
    want = mixgemm.rotary_kv_cache(qkv, cos, sin, k_want, v_want, table, ROPE_HEADS, ROPE_KV)
    k_cache, v_cache = k0.clone(), v0.clone()
    _, before = library.counters()
    got = mixgemm.rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, table.int(), ROPE_HEADS, ROPE_KV)
    assert library.counters()[1] == before + 1
    assert torch.equal(got, want) and torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    # a first position out of range: the Python kernel's error, nothing written
    k_cache, v_cache = k0.clone(), v0.clone()
    with pytest.raises(ValueError, match="positions 62..64 are outside the 64 positions"):
        mixgemm.rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, ROPE_LEN - t + 1, ROPE_HEADS, ROPE_KV)
    assert library.counters()[1] == before + 2
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)
