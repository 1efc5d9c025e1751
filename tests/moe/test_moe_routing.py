"""mixgemm.moe.routing on the CPU: the routing and combine kernel specs and their C++, the torch
path of route_and_gather / combine against route(), the custom ops traced by torch.compile, the
launches on a faked GPU, and (with nvcc) the kernels built."""
from __future__ import annotations

import struct

import pytest
import torch

import fake_driver
from fake_gpu import FakeGpu, function_handle

from mixgemm.jit import catalog
from mixgemm.jit import env as paths
from mixgemm import moe
from mixgemm.moe import routing as moe_routing
from mixgemm.jit.catalog import default_specs
from mixgemm.jit.render import render
from mixgemm.jit.specs import (HELPER_KINDS, IndexType, MoeCombineSpec, MoeLayoutSpec, MoeRouteSpec, RoutingWeightType,
                           parse_name)
from mixgemm.dtypes import ActType


# ---------------------------------------------------------------------------------------------- specs
def test_specs_name_every_field_and_parse_back():
    specs = catalog.moe_specs()
    assert len(specs) == 2 + 2 * 3 + 1                 # int32 / int64 ids; 2 acts x 3 weight types; the layout kernel
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        assert parse_name(s.name) == s
        # the routing and combine kernels wait for the previous grid (griddepcontrol.wait); the layout kernel does not
        assert s.programmatic_launch == (not isinstance(s, MoeLayoutSpec))
    assert MoeRouteSpec(IndexType.I32).name == "mixgemm_moe_route_i32"
    assert MoeCombineSpec(ActType.FP16, RoutingWeightType.BF16).name == "mixgemm_moe_combine_fp16_wbf16"
    assert set(specs) <= set(default_specs())
    assert not isinstance(specs[0], HELPER_KINDS)   # plain arguments: no host helper
    with pytest.raises(ValueError, match="not a mixgemm kernel name"):
        parse_name("mixgemm_moe_route_i16")


def test_render_instantiates_one_kernel():
    src = render(MoeRouteSpec(IndexType.I64))
    assert '#include "mixgemm/moe_route_kernel.hpp"' in src
    assert src.count("MIXGEMM_MOE_ROUTE_ENTRY(") == 1
    assert "MIXGEMM_MOE_ROUTE_ENTRY(mixgemm_moe_route_i64, int64_t)" in src
    src = render(MoeCombineSpec(ActType.BF16, RoutingWeightType.F16))
    assert src.count("MIXGEMM_MOE_COMBINE_ENTRY(") == 1
    assert "MIXGEMM_MOE_COMBINE_ENTRY(mixgemm_moe_combine_bf16_wf16, cutlass::bfloat16_t, cutlass::half_t)" in src
    assert "MIXGEMM_MOE_COMBINE_ENTRY(mixgemm_moe_combine_fp16_wf32, cutlass::half_t, float)" in render(
        MoeCombineSpec(ActType.FP16, RoutingWeightType.F32))


def test_header_bounds_match_python():
    text = (paths.cutlass_ext_dir() / "mixgemm" / "moe_route_kernel.hpp").read_text()
    assert f"kRouteMaxAssignments = {moe_routing.ROUTE_MAX_ASSIGNMENTS};" in text
    assert f"kRouteMaxExperts = {moe_routing.ROUTE_MAX_EXPERTS};" in text
    assert f"kRouteThreads = {moe_routing._ROUTE_THREADS};" in text
    assert f"kCombineThreads = {moe_routing._COMBINE_THREADS};" in text


def test_generate_lists_them(capsys):
    from mixgemm.cli.main import main

    assert main(["generate", "--list", "--kernels", "_moe_"]) == 0
    assert capsys.readouterr().out.split() == [s.name for s in catalog.moe_specs()]


def test_spec_selection():
    assert moe_routing.route_spec(torch.zeros(1, 1, dtype=torch.int32)) == MoeRouteSpec(IndexType.I32)
    assert moe_routing.route_spec(torch.zeros(1, 1, dtype=torch.int64)) == MoeRouteSpec(IndexType.I64)
    assert moe_routing.route_spec(torch.zeros(1, 1, dtype=torch.int16)) is None
    y = torch.zeros(2, 8, dtype=torch.bfloat16)
    for wd, want in ((torch.float32, RoutingWeightType.F32), (torch.float64, RoutingWeightType.F32),
                     (torch.bfloat16, RoutingWeightType.BF16), (torch.float16, RoutingWeightType.F16)):
        assert moe_routing.combine_spec(y, torch.zeros(1, 2, dtype=wd)) == MoeCombineSpec(ActType.BF16, want)
    assert [s.name for s in moe_routing.routing_specs(ActType.FP16, torch.int32, torch.bfloat16)] == \
        ["mixgemm_moe_route_i32", "mixgemm_moe_combine_fp16_wbf16"]


# ---------------------------------------------------------------------------------------------- torch path
def _ids(t, topk, e, dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, e, (t, topk), generator=g).to(dtype)


@pytest.mark.parametrize("t,topk,e", [(1, 1, 1), (5, 2, 8), (33, 8, 128), (0, 2, 4)])
@pytest.mark.parametrize("dtype", (torch.int32, torch.int64))
def test_route_and_gather_on_the_cpu_is_route_and_a_gather(t, topk, e, dtype):
    ids = _ids(t, topk, e, dtype)
    x = torch.randn(t, 24).to(torch.bfloat16)
    want = moe.route(ids, e)
    r, xs = moe.route_and_gather(x, ids, e)
    assert torch.equal(r.order, want.order) and torch.equal(r.tokens, want.tokens)
    assert torch.equal(r.expert_offsets, want.expert_offsets)
    assert torch.equal(xs, x[want.tokens])
    assert r.inv.dtype == torch.int32 and torch.equal(r.order[r.inv.long()], torch.arange(t * topk))
    assert want.inv is None                              # route() is as it was


def test_combine_with_inv_is_combine_without():
    t, topk, e, h = 6, 3, 5, 16
    ids = _ids(t, topk, e)
    x = torch.randn(t, h).to(torch.float16)
    r, xs = moe.route_and_gather(x, ids, e)
    w = torch.rand(t, topk, dtype=torch.float64)
    y_flat = torch.randn(t * topk, h).to(torch.float16)
    y_sorted = y_flat[r.order]
    want = (y_flat.view(t, topk, h).float() * w.float().unsqueeze(-1)).sum(1).to(torch.float16)
    assert torch.equal(moe.combine(y_sorted, r, w), want)
    assert torch.equal(moe.combine(y_sorted, r._replace(inv=None), w), want)
    assert moe.combine(y_sorted[:0], moe.route_and_gather(x[:0], ids[:0], e)[0], w[:0]).shape == (0, h)


def test_argument_errors():
    x, ids = torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"x must be \[T=3, H\]"):
        moe.route_and_gather(x[:2], ids, 4)
    with pytest.raises(TypeError, match="integer"):
        moe.route_and_gather(x, ids.float(), 4)
    with pytest.raises(ValueError, match="num_experts"):
        moe.route_and_gather(x, ids, 0)
    r, xs = moe.route_and_gather(x, ids, 4)
    with pytest.raises(ValueError, match=r"y_sorted must be \[T \* topk, H\]"):
        moe.combine(xs[:5], r, torch.ones(3, 2))
    with pytest.raises(TypeError, match="float"):
        moe.combine(xs, r, torch.ones(3, 2, dtype=torch.long))


def test_custom_ops_trace_fullgraph():
    """The two ops' fake implementations: torch.library.opcheck, and a whole routing + combine
    traced with fullgraph=True (aot_eager: the fake tensors, without inductor's compiler)."""
    t, topk, e, h = 4, 2, 8, 32
    x, ids, w = torch.randn(t, h).to(torch.bfloat16), _ids(t, topk, e), torch.rand(t, topk)
    torch.library.opcheck(torch.ops.mixgemm.route_and_gather.default, (x, ids, e))
    r, xs = moe_routing.route_and_gather_op(x, ids, e)
    torch.library.opcheck(torch.ops.mixgemm.combine.default, (xs, r.order, r.tokens, r.expert_offsets, r.inv, w))

    def layer(x, ids, w):
        r, xs = moe_routing.route_and_gather_op(x, ids, e)
        return moe_routing.combine_op(xs * 2, r, w)

    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, ids, w)
    assert torch.equal(got, layer(x, ids, w))
    torch.testing.assert_close(got.float(), x.float() * 2 * w.sum(1, keepdim=True), rtol=2 ** -7, atol=1e-6)


# ---------------------------------------------------------------------------------------------- fake GPU
pytest_fake = pytest.mark.skipif(fake_driver.compiler() is None or fake_driver.real_driver_present(),
                                 reason="needs a C compiler for the fake CUDA driver, and no real one")


@pytest_fake
@pytest.mark.parametrize("t,topk,e,h,ctas", [(1, 8, 128, 2048, 1), (16, 8, 128, 2048, 8), (512, 8, 256, 4096, 132),
                                              (3, 2, 512, 64, 1)])
def test_route_and_gather_launches_the_kernel(tmp_path, t, topk, e, h, ctas):
    """On an sm_90 device (faked): one launch of the routing kernel of the ids' type, 1024
    threads, enough CTAs for 64 KiB of gathered rows each (at most the SM count), PDL."""
    ids = _ids(t, topk, e, torch.int32)
    x = torch.randn(t, h).to(torch.bfloat16)
    with FakeGpu(tmp_path) as gpu:
        gpu.driver.reset(params_size=8)                   # the first argument: the ids' pointer
        r, xs = moe.route_and_gather(x, ids, e)
        launches = gpu.launches()
    assert len(launches) == 1
    L = launches[0]
    assert L["function"] == function_handle(MoeRouteSpec(IndexType.I32))
    assert L["grid"] == (ctas, 1, 1) and L["block"] == (1024, 1, 1) and L["smem"] == 0 and L["pdl"] == 1
    assert struct.unpack("=Q", L["params"])[0] == ids.data_ptr()
    n = t * topk
    assert (r.order.shape, r.tokens.shape, r.inv.shape, r.expert_offsets.shape, xs.shape) == \
        ((n,), (n,), (n,), (e + 1,), (n, h))
    assert (r.order.dtype, r.tokens.dtype, r.inv.dtype, r.expert_offsets.dtype) == \
        (torch.int64, torch.int64, torch.int32, torch.int32)


@pytest_fake
@pytest.mark.parametrize("t,topk,e,h,why", [(513, 8, 8, 64, "too many assignments"), (1, 2, 513, 64, "too many experts"),
                                            (2, 2, 8, 60, "rows not 16-byte vectors")])
def test_route_and_gather_beyond_the_kernel_takes_torch_ops(tmp_path, t, topk, e, h, why):
    ids = _ids(t, topk, e)
    x = torch.randn(t, h).to(torch.bfloat16)
    with FakeGpu(tmp_path) as gpu:
        r, xs = moe.route_and_gather(x, ids, e)
        assert gpu.launches() == [], why
        assert MoeRouteSpec(IndexType.I64).name in gpu.kernels.loaded()   # loaded anyway: for graph capture
    want = moe.route(ids, e)
    assert torch.equal(r.order, want.order) and torch.equal(xs, x[want.tokens])


@pytest_fake
def test_combine_launches_the_kernel_with_inv_only(tmp_path):
    t, topk, e, h = 5, 4, 16, 256
    ids, w = _ids(t, topk, e), torch.rand(t, topk, dtype=torch.float64)
    y_sorted = torch.randn(t * topk, h).to(torch.float16)
    with FakeGpu(tmp_path) as gpu:
        gpu.driver.reset(params_size=8)
        routing = moe.route(ids, e)
        moe.combine(y_sorted, routing, w)                  # route()'s routing: torch ops
        assert gpu.launches() == []
        r, _ = moe.route_and_gather(torch.zeros(t, h, dtype=torch.float16), ids, e)
        out = moe.combine(y_sorted, r, w)
        launches = gpu.launches()[1:]
    assert len(launches) == 1 and out.shape == (t, h) and out.dtype == torch.float16
    L = launches[0]
    assert L["function"] == function_handle(MoeCombineSpec(ActType.FP16, RoutingWeightType.F32))
    assert L["grid"] == (1, t, 1) and L["block"] == (128, 1, 1) and L["pdl"] == 1
    assert struct.unpack("=Q", L["params"])[0] == y_sorted.data_ptr()


# ---------------------------------------------------------------------------------------------- nvcc
@pytest.mark.nvcc
def test_the_kernels_build(tmp_path, monkeypatch):
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    from mixgemm.jit import build

    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    for spec in (MoeRouteSpec(IndexType.I64), MoeCombineSpec(ActType.BF16, RoutingWeightType.F32)):
        art = build.build(spec)
        cubin = art.read_cubin()
        assert cubin[:4] == b"\x7fELF" and spec.name.encode() in cubin
        assert art.helper_path is None
