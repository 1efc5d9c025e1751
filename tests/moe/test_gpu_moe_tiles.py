"""GPU correctness of the grouped sm90 GEMM (many rows per expert; needs an sm_90 GPU).

Every grouped GEMM kernel (:func:`mixgemm.jit.catalog.grouped_gemm_specs`: each token tile, each
type, both epilogues) against a float64 per-expert reference on the weights dequantized by the
reference dequantizer, outputs poisoned with NaN (every routed row written, rows past offsets[E]
left alone); routings with experts of zero rows, one row, odd counts, counts of several token
tiles, all rows on one expert; E = 1 and E = 256; fused_moe on this path against an unfused MoE on
the dequantized weights; CUDA-graph replay with routing that changes between replays.
"""
from __future__ import annotations

import pytest
import torch

from mixgemm.jit import catalog
from mixgemm import moe
from mixgemm.weights.experts import PackedExperts
from mixgemm.weights.quantize import interleave_gate_up, quantize
from mixgemm.jit.specs import Epilogue, GroupedGemmSpec, KernelKind
from mixgemm.dtypes import ActType, WeightType

from moe_graph import capture_fused_moe, replay_matches_eager
from moe_reference import distinct_experts, expert_offsets, fused_moe_error, grouped_reference, random_experts, tolerance

pytestmark = pytest.mark.gpu

#: zero rows, one row, odd counts, several token tiles (300 > 256), everything on one expert
ROUTINGS = ([0, 1, 0, 3, 0, 0, 2, 1], [5, 0, 67, 1, 0, 130, 9, 0], [0, 300, 0, 0, 0, 0, 0, 3],
            [0] * 7 + [257], [64] * 8, [0] * 8)


def _check_spec(spec, x, ex, deq, counts, activation):
    t = x.shape[0]
    n_out = ex.n // 2 if activation == "swiglu" else ex.n
    y = torch.full((t, n_out), float("nan"), device="cuda", dtype=x.dtype)
    moe.grouped_gemm_with_spec(x, ex, expert_offsets(counts), spec, out=y, activation=activation)
    used = sum(counts)
    assert not torch.isnan(y[:used]).any(), f"{spec.name} {counts}: unwritten (or NaN) outputs"
    assert torch.isnan(y[used:]).all(), f"{spec.name} {counts}: rows past offsets[E] were written"
    if used == 0:
        return
    ref = grouped_reference(x[:used], deq, counts, activation)
    err = ((y[:used].double() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(ex.k, x.dtype), f"{spec.name} counts {counts}: relative error {err:.3e}"


@pytest.mark.parametrize("spec", catalog.grouped_gemm_specs(), ids=lambda s: s.name)
@pytest.mark.parametrize("group", (32, 128, "K"))
def test_every_grouped_gemm_kernel(requires_gpu, spec, group):
    e, n, k = 8, 256, 512
    activation = "swiglu" if spec.epilogue is Epilogue.SWIGLU else None
    ex, deq = random_experts(spec.act, spec.weight, e, n, k, group, gated=activation == "swiglu")
    torch.manual_seed(1)
    for counts in ROUTINGS:
        x = torch.randn(sum(counts) + 2, k, device="cuda", dtype=spec.act.torch_dtype)   # 2 rows past offsets[E]
        _check_spec(spec, x, ex, deq, counts, activation)


@pytest.mark.parametrize("activation", (None, "silu", "gelu"))
def test_grouped_gemm_activations(requires_gpu, activation):
    spec = GroupedGemmSpec(ActType.BF16, WeightType.S4, *catalog.GROUPED_GEMM_TILES["g64"])
    ex, deq = random_experts(ActType.BF16, WeightType.S4, 4, 128, 256, 64)
    counts = [70, 0, 5, 64]
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    y = moe.grouped_gemm_with_spec(x, ex, expert_offsets(counts), spec, activation=activation)
    ref = grouped_reference(x, deq, counts, None)
    if activation == "silu":
        ref = torch.nn.functional.silu(ref)
    elif activation == "gelu":
        ref = torch.nn.functional.gelu(ref)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(256, torch.bfloat16), f"{activation}: relative error {err:.3e}"


@pytest.mark.parametrize("e", (1, 256))
@pytest.mark.parametrize("label", tuple(catalog.GROUPED_GEMM_TILES))
def test_one_and_many_experts(requires_gpu, e, label):
    spec = GroupedGemmSpec(ActType.BF16, WeightType.U4, *catalog.GROUPED_GEMM_TILES[label])
    ex, deq = random_experts(ActType.BF16, WeightType.U4, e, 128, 256, 64)
    g = torch.Generator().manual_seed(e)
    counts = [77] if e == 1 else torch.randint(0, 40, (e,), generator=g).tolist()
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    _check_spec(spec, x, ex, deq, counts, None)
    counts = [0] * (e - 1) + [513]                       # all rows on the last expert
    x = torch.randn(513, 256, device="cuda", dtype=torch.bfloat16)
    _check_spec(spec, x, ex, deq, counts, None)


def test_heuristic_takes_the_grouped_gemm_with_many_rows(requires_gpu):
    ex, _ = random_experts(ActType.BF16, WeightType.U4, 8, 256, 256, 64)
    assert moe.select_grouped_spec(8 * moe.TILES_FROM_ROWS, ex).kind is KernelKind.GROUPED_GEMM
    assert moe.select_grouped_spec(8 * moe.TILES_FROM_ROWS - 8, ex).kind is KernelKind.GROUPED_DECODE
    odd, _ = random_experts(ActType.BF16, WeightType.U4, 8, 192, 256, 64)   # N not a multiple of the 128-row weight tile
    assert moe.select_grouped_spec(4096, odd).kind is KernelKind.GROUPED_DECODE


def _moe_weights(act, bits, symmetric, e, h, inter):
    dtype = act.torch_dtype
    w13 = PackedExperts.from_quantized([interleave_gate_up(quantize(torch.randn(inter, h) / 8, bits, 64, symmetric, dtype),
                                                           quantize(torch.randn(inter, h) / 8, bits, 64, symmetric, dtype))
                                        for _ in range(e)]).to("cuda")
    w2 = PackedExperts.quantize(torch.randn(e, h, inter) / 8, bits, 64, symmetric, dtype).to("cuda")
    return w13, w2


@pytest.mark.parametrize("act", catalog.ALL_ACTS, ids=lambda a: a.value)
@pytest.mark.parametrize("bits,symmetric", [(4, False), (2, True), (8, True)])
@pytest.mark.parametrize("t,topk,e", [(256, 2, 8), (1024, 2, 8), (333, 4, 16), (2048, 8, 64)])
def test_fused_moe_on_grouped_gemm_against_unfused(requires_gpu, act, bits, symmetric, t, topk, e):
    h, inter = 256, 128
    dtype = act.torch_dtype
    w13, w2 = _moe_weights(act, bits, symmetric, e, h, inter)
    assert moe.select_grouped_spec(t * topk, w13, "swiglu").kind is KernelKind.GROUPED_GEMM
    torch.manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=dtype)
    err = fused_moe_error(x, w13, w2, topk, e)
    assert err <= 4 * tolerance(h, dtype), f"relative error {err:.3e}"


def test_cuda_graph_replay_with_changing_routing(requires_gpu):
    e, t, topk, h, inter = 8, 512, 2, 256, 128
    w13, w2 = _moe_weights(ActType.BF16, 4, False, e, h, inter)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(t, topk, dtype=torch.long, device="cuda")
    w = torch.full((t, topk), 0.5, device="cuda")
    moe.fused_moe(x, w13, w2, w, ids)        # warm-up: kernels loaded before capture
    graph, out = capture_fused_moe(x, w13, w2, w, ids)
    for seed in range(4):                    # new routing, new inputs, same buffers
        torch.manual_seed(seed)
        new = distinct_experts(t, topk, e)
        if seed == 2:                        # skewed: most rows on two experts
            new = torch.where(torch.rand(t, topk, device="cuda") < 0.9, torch.tensor([[3, 6]], device="cuda"), new)
        if seed == 3:
            new[:, 0].fill_(5)               # every token's first slot on one expert
            new[:, 1].fill_(2)
        replay_matches_eager(graph, out, x, w13, w2, w, ids, new, seed)
        ref = moe.fused_moe_reference(x, w13.dequantize_reference(), w2.dequantize_reference(), w, ids)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err <= 4 * tolerance(h, torch.bfloat16), f"replay {seed}: relative error {err:.3e}"


def _skewed_ids(t, topk, e, kind, generator_seed=0):
    g = torch.Generator(device="cuda").manual_seed(generator_seed)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:topk] for _ in range(t)])
    if kind == "one-hot-expert":            # most tokens' first slot on expert 3: one expert far above the mean
        hot = torch.rand(t, device="cuda", generator=g) < 0.7
        ids[:, 0] = torch.where(hot & (ids[:, 1:] != 3).all(1), 3, ids[:, 0])
    elif kind == "two-experts":             # every row on experts 1 and 2: both hot, all others empty
        ids = torch.tensor([[1, 2] + [1] * (topk - 2)], device="cuda").expand(t, topk).contiguous()
    return ids


@pytest.mark.parametrize("act", catalog.ALL_ACTS, ids=lambda a: a.value)
@pytest.mark.parametrize("bits,symmetric", [(4, False), (2, True), (8, True)])
@pytest.mark.parametrize("kind", ("uniform", "one-hot-expert", "two-experts"))
def test_fused_moe_split_against_unfused(requires_gpu, act, bits, symmetric, kind):
    e, t, topk, h, inter = 32, 128, 4, 256, 128          # 16 rows per expert on average: the split plan
    w13, w2 = _moe_weights(act, bits, symmetric, e, h, inter)
    assert moe.plan_fused_moe(t * topk, act, w13.weight_type, e, h, inter).kind == "split"
    torch.manual_seed(7)
    x = torch.randn(t, h, device="cuda", dtype=act.torch_dtype)
    ids = _skewed_ids(t, topk, e, kind)
    w = torch.softmax(torch.randn(t, topk, device="cuda"), -1)
    got = moe.fused_moe(x, w13, w2, w, ids)
    ref = moe.fused_moe_reference(x, w13.dequantize_reference(), w2.dequantize_reference(), w, ids)
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= 4 * tolerance(h, act.torch_dtype), f"{kind}: relative error {err:.3e}"


def test_cuda_graph_replay_of_the_split_plan(requires_gpu):
    e, t, topk, h, inter = 32, 128, 4, 256, 128
    w13, w2 = _moe_weights(ActType.BF16, 4, False, e, h, inter)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = _skewed_ids(t, topk, e, "uniform")
    w = torch.full((t, topk), 0.25, device="cuda")
    moe.fused_moe(x, w13, w2, w, ids)        # warm-up: kernels loaded before capture
    graph, out = capture_fused_moe(x, w13, w2, w, ids)
    for seed, kind in enumerate(("one-hot-expert", "uniform", "two-experts", "one-hot-expert")):
        # which experts are hot changes between replays
        replay_matches_eager(graph, out, x, w13, w2, w, ids, _skewed_ids(t, topk, e, kind, seed), f"{seed} ({kind})")
        ref = moe.fused_moe_reference(x, w13.dequantize_reference(), w2.dequantize_reference(), w, ids)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err <= 4 * tolerance(h, torch.bfloat16), f"replay {seed} ({kind}): relative error {err:.3e}"


@pytest.mark.parametrize("e", (1, 8, 128, 2048))
@pytest.mark.parametrize("tile", (64, 256))
@pytest.mark.parametrize("hot_from", (1, 32))
def test_layout_kernel_equals_the_torch_layout(requires_gpu, e, tile, hot_from):
    from mixgemm.moe.tiles import _layout_kernel, _layout_torch, capacity_tiles

    g = torch.Generator().manual_seed(e + tile)
    for case in range(4):
        counts = torch.randint(0, 3 * tile // 2, (e,), generator=g)
        if case == 1:
            counts[torch.rand(e, generator=g) < 0.7] = 0
        elif case == 2:
            counts.zero_()
            counts[-1] = 3000                                    # everything on the last expert
        dropped = 5 if case == 3 else 0                          # rows past offsets[E]
        rows = int(counts.sum()) + dropped
        offsets = torch.tensor([0] + counts.cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        n = rows + 7
        inv = torch.randint(-1, max(rows, 1), (n,), generator=g).to(torch.int32).cuda()
        if rows == 0:
            inv.fill_(-1)                                        # nothing to point at
        cap = capacity_tiles(rows, e, tile)
        for cold, base in ((False, 0), (True, rows)):
            want = _layout_torch(offsets, rows, tile, hot_from, base, inv, cold, cap)
            got = _layout_kernel(offsets, rows, tile, hot_from, base, inv, cold, cap)
            for name, a, b in zip(("cold_offsets", "table", "positions", "inv"), got, want):
                if b is None:
                    assert a is None, name
                else:
                    assert torch.equal(a, b), f"case {case} cold={cold}: {name} differs"
