"""GPU correctness of mixgemm's MoE routing and combine kernels (needs an sm_90 GPU).

The routing kernel against route() bit for bit (order, tokens, offsets, the gathered rows, inv)
over token counts up to the kernel's bound, top-k 1 / 2 / 8, 1 to 256 experts, int32 and int64
ids, uniform, skewed and all-on-one-expert routing; ids out of range dropped as documented; the
combine kernel bit for bit against a slot-by-slot float32 sum in torch and within one unit in the
last place of torch's combine; fused_moe through the kernels against the same layer composed of
route() and torch ops; CUDA-graph capture and replay with routing that changes between replays,
after a warm-up that took the torch path.
"""
from __future__ import annotations

import pytest
import torch

from mixgemm import moe
from mixgemm.moe import routing as moe_routing
from mixgemm.jit import loader as runtime
from mixgemm.jit.specs import IndexType, MoeRouteSpec
from moe_graph import capture_fused_moe, replay_matches_eager
from moe_reference import random_experts

pytestmark = pytest.mark.gpu


def _ids(kind: str, t: int, topk: int, e: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ids = torch.randint(0, e, (t, topk), generator=g)
    elif kind == "skewed":       # most assignments on the first few experts
        ids = (torch.rand(t, topk, generator=g) ** 4 * e).long().clamp_(max=e - 1)
    else:                        # every assignment on one expert
        ids = torch.full((t, topk), e - 1)
    return ids.to(dtype).cuda()


def _check_routing(x, ids, e):
    r, xs = moe.route_and_gather(x, ids, e)
    want = moe.route(ids, e)
    n = ids.numel()
    assert torch.equal(r.order, want.order), "order"
    assert torch.equal(r.tokens, want.tokens), "tokens"
    assert torch.equal(r.expert_offsets, want.expert_offsets), "offsets"
    assert torch.equal(xs, x[want.tokens]), "gathered rows"
    assert torch.equal(r.inv.long(), torch.empty_like(want.order).scatter_(0, want.order, torch.arange(
        n, device="cuda"))), "inv"


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64), ids=("i32", "i64"))
@pytest.mark.parametrize("e", (1, 8, 128, 256))
@pytest.mark.parametrize("topk", (1, 2, 8))
@pytest.mark.parametrize("t", (1, 2, 5, 16, 33, 512))
def test_routing_kernel_is_route(requires_gpu, t, topk, e, dtype):
    assert t * topk <= moe_routing.ROUTE_MAX_ASSIGNMENTS   # the kernel's path (512 x 8 = the bound)
    h = 2048 if t <= 16 else 256                          # 512 x 8 rows of 256: 32 CTAs gather
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    for seed, kind in enumerate(("uniform", "skewed", "one")):
        _check_routing(x, _ids(kind, t, topk, e, dtype, seed), e)


@pytest.mark.parametrize("e", (3, 512))
def test_routing_kernel_fp16_odd_widths_and_most_experts(requires_gpu, e):
    for t, h in ((7, 8), (3, 24), (100, 1032)):
        x = torch.randn(t, h, device="cuda", dtype=torch.float16)
        _check_routing(x, _ids("uniform", t, 4, e, torch.int64, t), e)


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64), ids=("i32", "i64"))
def test_routing_kernel_drops_ids_out_of_range(requires_gpu, dtype):
    t, topk, e, h = 9, 4, 8, 64
    ids = _ids("uniform", t, topk, e, torch.int64, 0).cpu()
    bad = {(0, 1): -1, (2, 0): e, (2, 3): e + 100, (5, 2): -(2 ** 31), (8, 3): 2 ** 31 - 1}
    for (i, s), v in bad.items():
        ids[i, s] = v
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    r, xs = moe.route_and_gather(x, ids.to(dtype).cuda(), e)
    flat = ids.reshape(-1).tolist()
    kept = [i for ex in range(e) for i in range(len(flat)) if flat[i] == ex]   # stable, by expert
    rows, n = len(kept), len(flat)
    assert rows == n - len(bad)
    counts = [sum(1 for v in flat if v == ex) for ex in range(e)]
    assert r.expert_offsets.tolist() == [sum(counts[:ex]) for ex in range(e + 1)]
    assert r.order.tolist() == kept + [-1] * (n - rows)
    assert r.tokens.tolist() == [i // topk for i in kept] + [-1] * (n - rows)
    inv = r.inv.tolist()
    assert [inv[i] for i in kept] == list(range(rows))
    assert all(inv[i * topk + s] == -1 for i, s in bad)
    assert torch.equal(xs[:rows], x[torch.tensor([i // topk for i in kept], device="cuda")])
    assert not xs[rows:].any(), "the rows of dropped assignments are zero"
    # combine: dropped slots add nothing
    w = torch.rand(t, topk, device="cuda")
    y = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    out = moe.combine(y, r, w)
    w_kept = w.clone()
    for i, s in bad:
        w_kept[i, s] = 0
    assert torch.equal(out, _sequential_combine(y, r.inv.clamp(min=0), w_kept))


def _sequential_combine(y_sorted, inv, w):
    """Slot by slot in float32, each product and each sum one torch kernel (no FMA), one rounding."""
    t, topk = w.shape
    acc = torch.zeros(t, y_sorted.shape[1], device=y_sorted.device, dtype=torch.float32)
    for s in range(topk):
        rows = inv.view(t, topk)[:, s].long()
        acc = acc + y_sorted[rows].float() * w[:, s].float().unsqueeze(-1)
    return acc.to(y_sorted.dtype)


def _ulps(a, b) -> int:
    """The largest distance of two 16-bit float tensors in units in the last place, counted along
    the number line (from -tiny to +tiny is 2)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    ai = torch.where(ai < 0, -(ai & 0x7FFF), ai)
    bi = torch.where(bi < 0, -(bi & 0x7FFF), bi)
    return int((ai - bi).abs().max()) if a.numel() else 0


@pytest.mark.parametrize("act", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("wdtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64),
                         ids=("f32", "bf16", "f16", "f64"))
@pytest.mark.parametrize("t,topk,h", [(1, 8, 2048), (5, 1, 8), (16, 2, 1032), (33, 10, 256), (512, 8, 2048)])
def test_combine_kernel(requires_gpu, act, wdtype, t, topk, h):
    e = 16
    ids = _ids("uniform", t, topk, e, torch.int64, t)
    r, _ = moe.route_and_gather(torch.zeros(t, h, device="cuda", dtype=act), ids, e)
    y = torch.randn(t * topk, h, device="cuda", dtype=act)
    w = torch.softmax(torch.randn(t, topk, device="cuda"), -1).to(wdtype)
    got = moe.combine(y, r, w)
    assert got.dtype == act and got.shape == (t, h)
    want = _sequential_combine(y, r.inv, w)
    assert torch.equal(got, want), f"not the slot-order float32 sum: {_ulps(got, want)} ulps off"
    # torch's combine sums the top-k in another association: the float32 sums differ by at most
    # ~topk * 2^-24 of the terms' magnitudes (which, where the terms cancel, can be many output
    # ulps), and the rounding to the output type by at most one ulp
    torch_combine = moe.combine(y, r._replace(inv=None), w)     # route()'s routing: torch's ops
    terms = (y[r.inv.long()].float().view(t, topk, h).abs() * w.float().abs().view(t, topk, 1)).sum(1)
    ulp = 2.0 ** -7 if act == torch.bfloat16 else 2.0 ** -10
    bound = ulp * torch_combine.float().abs() + 2.0 ** -20 * terms + 1e-30
    diff = (got.float() - torch_combine.float()).abs()
    assert (diff <= bound).all(), f"{int((diff > bound).sum())} outputs beyond the bound, worst {float((diff / bound).max()):.2f}x"


@pytest.mark.parametrize("ids_dtype,w_dtype", [(torch.int64, torch.float32), (torch.int32, torch.bfloat16)])
@pytest.mark.parametrize("t", (1, 16, 600))
def test_fused_moe_is_the_layer_of_route_and_torch_ops(requires_gpu, ids_dtype, w_dtype, t):
    """fused_moe (routing kernel up to the bound; 600 x 8 takes route()) equals route() + a torch
    gather + the same grouped GEMMs + the slot-order sum, bit for bit."""
    from mixgemm.dtypes import ActType, WeightType

    e, topk, h, inter = 64, 8, 256, 128
    w13, _ = random_experts(ActType.BF16, WeightType.U4, e, 2 * inter, h, 64, gated=True)
    w2, _ = random_experts(ActType.BF16, WeightType.U4, e, h, inter, 64, seed=3)
    torch.manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(t)]).to(ids_dtype)
    w = torch.softmax(torch.randn(t, topk, device="cuda"), -1).to(w_dtype)
    got = moe.fused_moe(x, w13, w2, w, ids)
    r = moe.route(ids, e)
    hh = moe.grouped_gemm(x[r.tokens], w13, r.expert_offsets, activation="swiglu")
    y = moe.grouped_gemm(hh, w2, r.expert_offsets)
    inv = torch.empty(t * topk, dtype=torch.int32, device="cuda").scatter_(
        0, r.order, torch.arange(t * topk, dtype=torch.int32, device="cuda"))
    assert torch.equal(got, _sequential_combine(y, inv, w))


def test_graph_replay_with_changing_routing_after_a_torch_path_warm_up(requires_gpu, monkeypatch):
    """Warm-up at a size beyond the routing kernel (the torch path) still loads the routing
    kernel, so a capture at decode size works; replays follow new ids, weights and inputs,
    out-of-range ids included, and equal eager calls."""
    from mixgemm.dtypes import ActType, WeightType

    monkeypatch.setattr(runtime, "KERNELS", runtime.KernelCache())   # nothing loaded yet
    e, t, topk, h, inter = 32, 4, 8, 256, 128
    w13, _ = random_experts(ActType.BF16, WeightType.U4, e, 2 * inter, h, 64, gated=True)
    w2, _ = random_experts(ActType.BF16, WeightType.U4, e, h, inter, 64, seed=3)
    big = 600                                   # 600 x 8 assignments: route() and a torch gather
    moe.fused_moe(torch.randn(big, h, device="cuda", dtype=torch.bfloat16), w13, w2,
                  torch.rand(big, topk, device="cuda"), torch.randint(0, e, (big, topk), device="cuda"))
    assert MoeRouteSpec(IndexType.I64).name in runtime.KERNELS.loaded()
    # 4800 rows ran on the grouped GEMM: load the grouped decode kernels of 32 rows before capture
    for spec in moe.plan_fused_moe(t * topk, ActType.BF16, WeightType.U4, e, h, inter).specs:
        runtime.KERNELS.get(spec, torch.device("cuda"))
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(t, topk, dtype=torch.long, device="cuda")
    w = torch.full((t, topk), 1.0 / topk, device="cuda")
    graph, out = capture_fused_moe(x, w13, w2, w, ids)
    for seed in range(5):
        torch.manual_seed(seed)
        new = torch.randint(0, e, (t, topk), device="cuda")
        if seed == 3:
            new.fill_(7)                        # every row on one expert
        if seed == 4:
            new[1, 2] = e + 3                   # dropped: adds nothing
        replay_matches_eager(graph, out, x, w13, w2, w, ids, new, seed)
