"""The C++ kernel of ``torch.ops.mixgemm.gemm`` (mixgemm.jit.torch_ops) on the GPU.

A compiled graph's GEMMs must launch from C++ once their plans exist (the library's counters
say who launched), with outputs equal to eager's bit for bit; every call it cannot take (no plan,
zero offsets, a strided x, a bad argument) must reach the Python kernel, with its result or
its error; its plans must leave with their weights; and it must work under plain CUDA-graph
capture, with new inputs at each replay.
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


@pytest.fixture
def library(requires_gpu):
    lib = plans.OPERATORS.attach()
    if lib is None:
        pytest.fail("the torch operator library did not load on a GPU machine")
    return lib


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
