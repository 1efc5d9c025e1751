"""The C++ kernel of ``torch.ops.mixgemm.fused_moe`` (mixgemm.jit.torch_ops) on the GPU.

At decode sizes (the routed plan) a QuantMoE call must launch from C++ once its MoE plan exists
(the library's counters say who launched), eager and compiled, with outputs equal bit for bit to
the Python kernel's (the operator ``mixgemm::fused_moe_py`` called directly), for int32 and int64
ids and every top-k weight dtype; every call it cannot take (more rows than the routed kernels
rank, a strided x) must reach the Python kernel, with its result or its error; its plans must
leave with their weights; and it must work under plain CUDA-graph capture, with new inputs at
each replay.
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from mixgemm.dispatch import plans
from mixgemm.nn.moe import QuantMoE
from mixgemm.weights.experts import PackedExperts

pytestmark = pytest.mark.gpu

E, H, I, TOPK = 16, 1024, 512, 2


def _layer(bits: int, seed: int = 0, symmetric: bool = False) -> QuantMoE:
    g = torch.Generator().manual_seed(seed)
    w13 = PackedExperts.quantize(torch.randn(E, 2 * I, H, generator=g) * 0.02, bits, 128, symmetric, torch.bfloat16)
    w2 = PackedExperts.quantize(torch.randn(E, H, I, generator=g) * 0.02, bits, 128, symmetric, torch.bfloat16)
    return QuantMoE(w13, w2).cuda()


def _routing(t: int, ids_dtype=torch.int64, weights_dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)]).to(ids_dtype).cuda()
    w = torch.softmax(torch.randn(t, TOPK, generator=g), -1).to(weights_dtype).cuda()
    return w, ids


def _py(layer: QuantMoE, x, w, ids):
    """The Python kernel's output (what MIXGEMM_TORCH_OPS=python runs)."""
    return torch.ops.mixgemm.fused_moe_py(
        x, layer.w13_qdata, layer.w13_scales, layer.w13_zeros, layer.w2_qdata, layer.w2_scales, layer.w2_zeros,
        layer.experts("w13").weight_type.value, layer.experts("w13").group_size, layer.experts("w2").group_size,
        H, I, w, ids)


def _counted(library, fn):
    """fn()'s result and the (hits, fallbacks) it added, after the GPU is idle."""
    torch.cuda.synchronize()
    hits, fallbacks = library.counters()
    out = fn()
    torch.cuda.synchronize()
    h2, f2 = library.counters()
    return out, (h2 - hits, f2 - fallbacks)


@pytest.mark.parametrize("bits", (4, 2))
@pytest.mark.parametrize("ids_dtype", (torch.int32, torch.int64))
@pytest.mark.parametrize("t", (1, 4))
def test_eager_calls_launch_from_cpp_and_equal_python(requires_gpu, library, bits, ids_dtype, t):
    layer = _layer(bits, seed=bits)
    w, ids = _routing(t, ids_dtype, seed=t)
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x, w, ids)   # the first call (the library's first: through Python) makes the plan
        for seed in range(3):
            gen = torch.Generator("cuda").manual_seed(seed)
            x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            w, ids = _routing(t, ids_dtype, seed=10 + seed)   # the same sizes, new routing
            got, counts = _counted(library, lambda: layer(x, w, ids))
            assert counts == (1, 0), seed
            assert torch.equal(got, _py(layer, x, w, ids)), seed


def test_compiled_chain_launches_from_cpp_and_equals_python(requires_gpu, library):
    layers = nn.ModuleList([_layer(4, seed=1), _layer(2, seed=2), _layer(4, seed=3, symmetric=True)])

    def chain(x, w, ids):
        for layer in layers:
            x = layer(x, w, ids)
        return x

    def python_chain(x, w, ids):
        for layer in layers:
            x = _py(layer, x, w, ids)
        return x

    compiled = torch.compile(chain, fullgraph=True)
    with torch.no_grad():
        for t in (1, 4):
            for ids_dtype in (torch.int32, torch.int64):
                w, ids = _routing(t, ids_dtype, seed=t)
                x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
                compiled(x, w, ids)   # compile, and the plans
                got, counts = _counted(library, lambda: compiled(x, w, ids))
                assert counts == (3, 0), (t, ids_dtype)
                assert torch.equal(got, python_chain(x, w, ids)), (t, ids_dtype)
                _, counts = _counted(library, lambda: chain(x, w, ids))   # eager too
                assert counts == (3, 0), (t, ids_dtype)


@pytest.mark.parametrize("weights_dtype", (torch.bfloat16, torch.float16, torch.float64))
def test_every_weights_dtype(requires_gpu, library, weights_dtype):
    """Weights of a dtype with a combine kernel of its own, and float64, which the C++ kernel
    converts to float32 as the Python kernel does."""
    layer = _layer(4, seed=5)
    w, ids = _routing(4, torch.int32, weights_dtype, seed=5)
    x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x, w, ids)
        got, counts = _counted(library, lambda: layer(x, w, ids))
    assert counts == (1, 0)
    assert torch.equal(got, _py(layer, x, w, ids))


def test_calls_it_cannot_take_reach_the_python_kernel(requires_gpu, library):
    layer = _layer(4, seed=6)
    with torch.no_grad():
        # more assignments than the routed kernels rank: another plan, in Python, every time
        w, ids = _routing(160, seed=6)
        x = torch.randn(160, H, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            got, counts = _counted(library, lambda: layer(x, w, ids))
            assert counts == (0, 1)
            assert torch.equal(got, _py(layer, x, w, ids))
        # a strided x (a plan exists for its sizes): Python copies it
        w, ids = _routing(4, seed=7)
        x = torch.randn(4, 2 * H, device="cuda", dtype=torch.bfloat16)[:, ::2]
        layer(x.contiguous(), w, ids)
        got, counts = _counted(library, lambda: layer(x, w, ids))
        assert counts == (0, 1)
        assert torch.equal(got, _py(layer, x.contiguous(), w, ids))
        # transposed (non-contiguous) ids and weights
        got, counts = _counted(library, lambda: layer(x.contiguous(), w.t().contiguous().t(), ids.t().contiguous().t()))
        assert counts == (0, 1)
        assert torch.equal(got, _py(layer, x.contiguous(), w, ids))
        # an argument the Python kernel refuses: its error
        with pytest.raises(ValueError, match="topk_weights and topk_ids"):
            layer(x.contiguous(), w[:, :1], ids)


def test_plans_leave_with_their_weights(requires_gpu, library):
    gc.collect()
    start, held = library.moe_plan_count(), plans.OPERATORS.moe_plan_count()
    layer = _layer(2, seed=8)
    w, ids = _routing(1, seed=8)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x, w, ids)
        assert library.moe_plan_count() == start + 1 and plans.OPERATORS.moe_plan_count() == held + 1
        _, counts = _counted(library, lambda: layer(x, w, ids))
        assert counts == (1, 0)
    del layer
    gc.collect()
    assert library.moe_plan_count() == start and plans.OPERATORS.moe_plan_count() == held
    # a buffer replaced: the old plan goes with the old tensor, the call makes a new one
    layer = _layer(2, seed=9)
    with torch.no_grad():
        layer(x, w, ids)
        assert library.moe_plan_count() == start + 1
        layer.w2_scales = layer.w2_scales.clone()
        gc.collect()
        assert library.moe_plan_count() == start
        got, counts = _counted(library, lambda: layer(x, w, ids))
        assert counts == (0, 1) and library.moe_plan_count() == start + 1
        assert torch.equal(got, _py(layer, x, w, ids))


def test_plain_cuda_graph_capture_replays_with_new_inputs(requires_gpu, library):
    layers = [_layer(4, seed=10), _layer(2, seed=11)]
    for t in (1, 4):
        w, ids = _routing(t, seed=t)
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):   # warm-up: the kernels and the eager plans
                for _ in range(2):
                    layers[1](layers[0](x, w, ids), w, ids)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):     # the first capture makes the captured plans
                y = layers[1](layers[0](x, w, ids), w, ids)
            hits, fallbacks = library.counters()
            again = torch.cuda.CUDAGraph()
            with torch.cuda.graph(again):     # a second capture launches from C++
                layers[1](layers[0](x, w, ids), w, ids)
            assert (library.counters()[0] - hits, library.counters()[1] - fallbacks) == (2, 0), t
            for seed in range(3):
                gen = torch.Generator("cuda").manual_seed(seed)
                x.copy_(torch.randn(t, H, device="cuda", dtype=torch.bfloat16, generator=gen))
                w2, ids2 = _routing(t, seed=20 + seed)
                w.copy_(w2)
                ids.copy_(ids2)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(y, _py(layers[1], _py(layers[0], x, w, ids), w, ids)), (t, seed)
