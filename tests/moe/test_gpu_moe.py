"""GPU correctness of the grouped (MoE) kernels and the fused MoE layer (needs an sm_90 GPU).

Every grouped decode kernel against a float64 per-expert reference on the weights dequantized by
the reference dequantizer, outputs poisoned with NaN (rows of experts are all written; rows past
offsets[E] are left alone); routing with experts of zero rows, one row, all rows on one expert;
E = 1 and E = 256; odd row counts; row counts above the token tile (the row loop); fused_moe
against an unfused MoE on the dequantized weights; CUDA-graph capture and replay with routing
that changes between replays; torch.compile(fullgraph=True) of QuantMoE.
"""
from __future__ import annotations

import pytest
import torch

from mixgemm import moe
from mixgemm.jit.catalog import ALL_ACTS, ALL_WEIGHTS
from mixgemm.weights.experts import PackedExperts
from mixgemm.weights.quantize import interleave_gate_up, quantize
from moe_graph import capture_fused_moe, replay_matches_eager
from moe_reference import distinct_experts, expert_offsets, fused_moe_error, grouped_reference, random_experts, tolerance

pytestmark = pytest.mark.gpu


def _check(x, ex, deq, counts, activation=None):
    t = x.shape[0]
    n_out = ex.n // 2 if activation == "swiglu" else ex.n
    y = torch.full((t, n_out), float("nan"), device="cuda", dtype=x.dtype)
    moe.grouped_gemm(x, ex, expert_offsets(counts), out=y, activation=activation)
    used = sum(counts)
    assert not torch.isnan(y[:used]).any(), "unwritten (or NaN) outputs"
    assert torch.isnan(y[used:]).all(), "rows past offsets[E] were written"
    if used == 0:
        return
    ref = grouped_reference(x[:used], deq, counts, activation)
    err = ((y[:used].double() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(ex.k, x.dtype), f"counts {counts}: relative error {err:.3e}"


@pytest.mark.parametrize("act", ALL_ACTS, ids=lambda a: a.value)
@pytest.mark.parametrize("wt", ALL_WEIGHTS, ids=lambda w: w.value)
@pytest.mark.parametrize("group", (32, 128, "K"))
@pytest.mark.parametrize("activation", (None, "swiglu"))
def test_every_grouped_kernel(requires_gpu, act, wt, group, activation):
    e, n, k = 8, 256, 512
    ex, deq = random_experts(act, wt, e, n, k, group, gated=activation == "swiglu")
    torch.manual_seed(1)
    # zero rows, one row, odd counts, a count above the 16-row tile (the row loop)
    # (fewer rows than experts: the grid is compacted to one CTA per row block and rank, and the
    # CTAs find their experts from the offsets; the 2 extra rows count, so 0 to 5 routed rows)
    for counts in ([0, 1, 0, 3, 0, 0, 2, 1], [1] * 8, [0, 0, 0, 0, 0, 7, 0, 0], [5, 0, 17, 1, 0, 2, 9, 0],
                   [0, 40, 0, 0, 0, 0, 0, 3], [0, 0, 1, 0, 0, 0, 0, 2], [0] * 7 + [1], [0] * 8):
        x = torch.randn(sum(counts) + 2, k, device="cuda", dtype=act.torch_dtype)   # 2 rows past offsets[E]
        _check(x, ex, deq, counts, activation)


@pytest.mark.parametrize("wt", ALL_WEIGHTS, ids=lambda w: w.value)
@pytest.mark.parametrize("splits", (1, 2, 3, 5, 8))
def test_grouped_decode_forced_splits(requires_gpu, wt, splits):
    """Every forced split-K factor of the grouped decode kernels (one cluster of up to 8 CTAs per
    row block) on both token tiles, against the float64 reference; K = 1280 (20 atoms: 3, 5 and 8
    split it unevenly)."""
    from mixgemm.dtypes import ActType
    from mixgemm.jit.catalog import TILE_CONFIGS
    from mixgemm.jit.specs import Activation, GroupedDecodeSpec

    act = ActType.BF16
    e, n, k = 8, 256, 1280
    ex, deq = random_experts(act, wt, e, n, k, 128, gated=True)
    torch.manual_seed(2)
    for label, counts in (("dec8", [0, 1, 0, 3, 0, 0, 1, 0]), ("dec16", [2, 0, 9, 1, 0, 0, 14, 0])):
        rows = sum(counts)
        x = torch.randn(rows, k, device="cuda", dtype=act.torch_dtype)
        d = next(t for t in TILE_CONFIGS if t.label == label).spec(act, wt, Activation.SWIGLU)
        spec = GroupedDecodeSpec(d.act, d.weight, d.tokens, d.warps, d.stage_bytes, d.stages, d.activation, d.kslices)
        y = torch.full((rows, n // 2), float("nan"), device="cuda", dtype=x.dtype)
        moe.grouped_gemm_with_spec(x, ex, expert_offsets(counts), spec, out=y, activation="swiglu", splits=splits)
        ref = grouped_reference(x, deq, counts, "swiglu")
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err <= tolerance(k, x.dtype), f"{spec.name} splits {splits} counts {counts}: {err:.3e}"


@pytest.mark.parametrize("wt", ALL_WEIGHTS, ids=lambda w: w.value)
@pytest.mark.parametrize("label", ("dec8", "dec16"))
def test_row_loop_on_a_compacted_grid(requires_gpu, wt, label):
    """Fewer rows than experts (z ranks the experts with rows), some experts with more rows than
    the token tile (each CTA runs its expert's tiles one after another), past the first pass of
    256 experts' offsets, with 1 and 2 splits on both token tiles."""
    from mixgemm.dtypes import ActType
    from mixgemm.jit.catalog import TILE_CONFIGS
    from mixgemm.jit.specs import Activation, GroupedDecodeSpec

    act = ActType.BF16
    e, n, k = 300, 128, 384
    ex, deq = random_experts(act, wt, e, n, k, 64, gated=True)
    counts = [0] * e
    counts[3], counts[17], counts[255], counts[256], counts[299] = 37, 9, 1, 17, 2   # 66 rows <= E
    torch.manual_seed(3)
    x = torch.randn(sum(counts), k, device="cuda", dtype=act.torch_dtype)
    d = next(t for t in TILE_CONFIGS if t.label == label).spec(act, wt, Activation.SWIGLU)
    spec = GroupedDecodeSpec(d.act, d.weight, d.tokens, d.warps, d.stage_bytes, d.stages, d.activation, d.kslices)
    ref = grouped_reference(x, deq, counts, "swiglu")
    for splits in (1, 2):
        y = torch.full((x.shape[0], n // 2), float("nan"), device="cuda", dtype=x.dtype)
        moe.grouped_gemm_with_spec(x, ex, expert_offsets(counts), spec, out=y, activation="swiglu", splits=splits)
        assert not torch.isnan(y).any(), f"{spec.name} splits {splits}: unwritten rows"
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err <= tolerance(k, x.dtype), f"{spec.name} splits {splits}: relative error {err:.3e}"


@pytest.mark.parametrize("e", (1, 256))
def test_one_and_many_experts(requires_gpu, e):
    from mixgemm.dtypes import ActType, WeightType

    ex, deq = random_experts(ActType.BF16, WeightType.U4, e, 128, 256, 64)
    g = torch.Generator().manual_seed(e)
    counts = [3] if e == 1 else torch.randint(0, 3, (e,), generator=g).tolist()
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    _check(x, ex, deq, counts)
    # all rows on one expert (the last)
    counts = [0] * (e - 1) + [33]
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    _check(x, ex, deq, counts)


@pytest.mark.parametrize("act", ALL_ACTS, ids=lambda a: a.value)
@pytest.mark.parametrize("bits,symmetric", [(4, False), (2, True), (8, True)])
@pytest.mark.parametrize("t,topk,e", [(1, 8, 64), (16, 2, 8), (7, 8, 128), (64, 4, 16)])
def test_fused_moe_against_unfused(requires_gpu, act, bits, symmetric, t, topk, e):
    h, inter = 256, 128
    dtype = act.torch_dtype
    w13 = PackedExperts.from_quantized([interleave_gate_up(quantize(torch.randn(inter, h) / 8, bits, 64, symmetric, dtype),
                                                           quantize(torch.randn(inter, h) / 8, bits, 64, symmetric, dtype))
                                        for _ in range(e)]).to("cuda")
    w2 = PackedExperts.quantize(torch.randn(e, h, inter) / 8, bits, 64, symmetric, dtype).to("cuda")
    torch.manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=dtype)
    err = fused_moe_error(x, w13, w2, topk, e)
    # two GEMMs, each rounded once to the activation dtype (the reference rounds the same places)
    assert err <= 4 * tolerance(h, dtype), f"relative error {err:.3e}"


@pytest.mark.parametrize("e", (300, 1000))
def test_compacted_grid_finds_experts_past_the_first_pass(requires_gpu, e):
    """Fewer rows than experts: z is a rank among the experts with rows, found 256 experts per
    pass; here the second expert with rows lies past the first pass (and the third, for 1000,
    past the third)."""
    from mixgemm.dtypes import ActType, WeightType

    ex, deq = random_experts(ActType.BF16, WeightType.U4, e, 64, 128, 64)
    counts = [0] * e
    counts[5], counts[290] = 1, 2
    if e == 1000:
        counts[999] = 3
    x = torch.randn(sum(counts), 128, device="cuda", dtype=torch.bfloat16)
    _check(x, ex, deq, counts)


def test_cuda_graph_replay_with_changing_routing(requires_gpu):
    from mixgemm.dtypes import ActType, WeightType

    e, t, topk, h, inter = 16, 8, 2, 256, 128
    w13, _ = random_experts(ActType.BF16, WeightType.U4, e, 2 * inter, h, 64, gated=True)
    w2, _ = random_experts(ActType.BF16, WeightType.U4, e, h, inter, 64, seed=3)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(t, topk, dtype=torch.long, device="cuda")
    w = torch.full((t, topk), 0.5, device="cuda")
    moe.fused_moe(x, w13, w2, w, ids)        # warm-up: kernels loaded before capture
    graph, out = capture_fused_moe(x, w13, w2, w, ids)
    for seed in range(4):                    # new routing, new inputs, same buffers
        torch.manual_seed(seed)
        new = distinct_experts(t, topk, e)
        if seed == 3:
            new.fill_(5)                     # every row on one expert
        replay_matches_eager(graph, out, x, w13, w2, w, ids, new, seed)


def test_grouped_gemm_op_compiles_fullgraph(requires_gpu):
    from mixgemm.dtypes import ActType, WeightType

    ex, deq = random_experts(ActType.BF16, WeightType.S4, 4, 128, 256, 32)
    counts = [2, 0, 3, 1]
    offsets = expert_offsets(counts)
    x = torch.randn(6, 256, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda a, o: moe.grouped_gemm_op(a, ex, o), fullgraph=True)
    y = f(x, offsets)
    assert torch.equal(y, moe.grouped_gemm(x, ex, offsets))


def test_quant_moe_from_mlps_compiles_fullgraph(requires_gpu):
    from torch import nn

    from mixgemm.nn.moe import QuantMoE

    class Mlp(nn.Module):
        def __init__(self, h, i):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)

    torch.manual_seed(0)
    e, h, i, t, topk = 8, 256, 128, 5, 2
    mlps = [Mlp(h, i).to(torch.bfloat16) for _ in range(e)]
    layer = QuantMoE.from_mlps(mlps, 4, 64).cuda()
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, e, (t, topk), device="cuda")
    w = torch.softmax(torch.randn(t, topk, device="cuda"), -1)
    eager = layer(x, w, ids)
    ref = moe.fused_moe(x, layer.experts("w13"), layer.experts("w2"), w, ids)
    assert torch.equal(eager, ref)
    compiled = torch.compile(layer, fullgraph=True)
    # the same kernels; inductor may fuse the float32 top-k sum differently: one rounding apart
    torch.testing.assert_close(compiled(x, w, ids), eager)
