"""GPU correctness of the grouped decode kernel's routed mode (needs an sm_90 GPU).

Every grouped decode kernel ranks the top-k ids itself (no offsets, no routing launch): against a
float64 per-assignment reference on the reference-dequantized experts, outputs poisoned with NaN
(the rows of dropped ids, and sorted rows past the kept ones, must stay untouched), in every
layout of x (by token, sorted) and y (by assignment, sorted), with int32 and int64 ids, ids out of
range, a token naming one expert twice, an expert with more rows than the token tile (the row
loop), and the most assignments the kernel ranks; and bit for bit against the same kernel in its
offsets mode on the same rows. fused_moe's three-launch decode path against its four-launch path,
bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from mixgemm import moe
from mixgemm.moe import layer as moe_layer
from mixgemm.jit.catalog import ALL_ACTS, ALL_WEIGHTS, grouped_specs
from mixgemm.moe.grouped import ROUTED_MAX_ASSIGNMENTS
from mixgemm.jit.specs import KernelKind
from moe_reference import random_experts, tolerance

pytestmark = pytest.mark.gpu

_DECODE_SPECS = [s for s in grouped_specs() if s.kind is KernelKind.GROUPED_DECODE]

#: (T, topk, E): fewer rows than experts (the CTAs find their expert by rank; past the first 256
#: experts with 300), one token, odd T, a token tile's row loop (48 x 2 over 4 experts: 24 rows
#: each; 16 x 2 over 2: 16 rows each, a grid of E), and the most assignments (32 x 8 = 256)
_ROUTINGS = [(1, 8, 64), (3, 2, 16), (7, 4, 16), (48, 2, 4), (16, 2, 2), (32, 8, 128), (4, 8, 300)]


def _ids(t: int, topk: int, e: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (t, topk), generator=g)
    ids[0, 0] = e + 2                  # out of range: dropped
    if t > 1 and topk > 1:
        ids[1, 1] = ids[1, 0]          # one token, one expert, twice
        ids[-1, -1] = -1               # dropped
    return ids.to(dtype).cuda()


def _reference(x, deq, ids, activation):
    """[T * topk, N'] float64, row t * topk + s: act(x[t] @ deq[ids[t, s]].T); NaN for dropped."""
    t, topk = ids.shape
    e = deq.shape[0]
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    y = torch.einsum("ik,ink->in", x.double().repeat_interleave(topk, 0), deq[flat.clamp(0, e - 1)])
    if activation == "swiglu":
        p = y.view(t * topk, -1, 2, 8)
        y = (torch.nn.functional.silu(p[:, :, 0]) * p[:, :, 1]).reshape(t * topk, -1)
    return torch.where(valid.unsqueeze(1), y, torch.full_like(y, float("nan")))


def _sorted(ids: torch.Tensor, e: int):
    """The routing kernel's stable order with the dropped ids last: (order, tokens, offsets int32
    [E + 1], kept)."""
    topk = ids.shape[1]
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < e)
    order = torch.sort(torch.where(valid, flat, e), stable=True).indices
    counts = torch.bincount(flat[valid], minlength=e)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    return order, order // topk, offsets, int(valid.sum())


def _spec_ids(spec):
    return spec.name.removeprefix("mixgemm_gdecode_")


@pytest.mark.parametrize("spec", _DECODE_SPECS, ids=_spec_ids)
def test_every_routed_grouped_kernel(requires_gpu, spec):
    from mixgemm.jit.specs import Activation

    activation = None if spec.activation is Activation.NONE else spec.activation.value
    act = spec.act
    gated = activation == "swiglu"
    for t, topk, e in _ROUTINGS:
        n, k = 128, 384
        ex, deq = random_experts(act, spec.weight, e, n, k, 64, gated=gated, seed=t)
        torch.manual_seed(t)
        x = torch.randn(t, k, device="cuda", dtype=act.torch_dtype)
        for dtype in (torch.int32, torch.int64):
            ids = _ids(t, topk, e, dtype, seed=t + topk)
            ref = _reference(x, deq, ids, activation)
            order, tokens, offsets, kept = _sorted(ids, e)
            xs = x[tokens[:kept]]
            n_out = ex.n // 2 if gated else ex.n
            for x_by_token, y_by_assignment in ((True, True), (True, False), (False, True), (False, False)):
                xin = x if x_by_token else torch.cat([xs, torch.zeros(t * topk - kept, k, device="cuda",
                                                                       dtype=x.dtype)])
                y = torch.full((t * topk, n_out), float("nan"), device="cuda", dtype=x.dtype)
                moe.grouped_gemm_routed(xin, ex, ids, spec, out=y, activation=activation, x_by_token=x_by_token,
                                        y_by_assignment=y_by_assignment)
                want = ref if y_by_assignment else torch.cat([ref[order[:kept]], ref.new_full(
                    (t * topk - kept, n_out), float("nan"))])
                what = f"{spec.name} T={t} topk={topk} E={e} {dtype} x_by_token={x_by_token} " \
                       f"y_by_assignment={y_by_assignment}"
                written = ~torch.isnan(want[:, 0])
                assert not torch.isnan(y[written]).any(), f"{what}: unwritten (or NaN) outputs"
                assert torch.isnan(y[~written]).all(), f"{what}: rows of dropped ids were written"
                err = ((y[written].double() - want[written]).norm() / want[written].norm()).item()
                assert err <= tolerance(k, x.dtype), f"{what}: relative error {err:.3e}"
                if not y_by_assignment:
                    # the same kernel in its offsets mode on the same sorted rows: the same bits
                    y2 = torch.full_like(y, float("nan"))
                    moe.grouped_gemm_with_spec(xin if not x_by_token else torch.cat(
                        [xs, xs.new_zeros(t * topk - kept, k)]), ex, offsets, spec, out=y2,
                        activation=activation)
                    assert torch.equal(y[:kept], y2[:kept]), f"{what}: not the offsets mode's bits"


@pytest.mark.parametrize("act", ALL_ACTS, ids=lambda a: a.value)
@pytest.mark.parametrize("wt", ALL_WEIGHTS, ids=lambda w: w.value)
@pytest.mark.parametrize("t,topk,e", [(1, 8, 128), (3, 2, 8), (16, 8, 256), (9, 4, 64)])
def test_fused_moe_routed_is_the_four_launch_path(requires_gpu, monkeypatch, act, wt, t, topk, e):
    """fused_moe at decode sizes (three launches, no routing kernel) equals its four-launch path
    (routing and gather, the offsets-mode GEMMs, combine through inv), bit for bit, ids out of
    range included."""
    h, inter = 256, 128
    w13, _ = random_experts(act, wt, e, 2 * inter, h, 64, gated=True, seed=1)
    w2, _ = random_experts(act, wt, e, h, inter, 64, seed=2)
    torch.manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=act.torch_dtype)
    ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(t)])
    ids[0, -1] = e                                  # dropped
    w = torch.softmax(torch.randn(t, topk, device="cuda"), -1)
    assert moe.plan_fused_moe(t * topk, w13.act_type, w13.weight_type, e, h, inter).kind == "each"
    monkeypatch.setattr(moe_layer, "routed_plan", lambda *a: True)
    got = moe.fused_moe(x, w13, w2, w, ids)
    monkeypatch.setattr(moe_layer, "routed_plan", lambda *a: False)
    want = moe.fused_moe(x, w13, w2, w, ids)
    assert torch.equal(got, want)


def test_routed_plan_decisions(requires_gpu):
    """fused_moe's choice of the routed path: decode plans with few CTAs per SM, the kernel's
    bounds on assignments and experts, int32 / int64 ids."""
    from types import SimpleNamespace

    from mixgemm.dtypes import ActType, WeightType

    x = torch.zeros(1, 16, device="cuda", dtype=torch.bfloat16)

    def routed(preset, tokens, wt, dtype=torch.int64):
        h, inter, e, topk = preset
        w13, w2 = SimpleNamespace(n=2 * inter, num_experts=e), SimpleNamespace(n=h, num_experts=e)
        ids = torch.zeros(tokens, topk, dtype=dtype, device="cuda")
        plan = moe.plan_fused_moe(tokens * topk, ActType.BF16, wt, e, h, inter)
        return moe_layer.routed_plan(plan, w13, w2, x, ids)

    qwen3, mixtral = (2048, 768, 128, 8), (4096, 14336, 8, 2)
    u4, u2, s8 = WeightType.U4, WeightType.U2, WeightType.S8
    assert routed(qwen3, 1, u4) and routed(qwen3, 4, u2) and routed(mixtral, 1, u4) and routed(qwen3, 1, u4, torch.int32)
    assert not routed(qwen3, 16, u4)          # 128 experts' CTAs: many waves
    assert not routed(mixtral, 4, u4)         # 8 experts x 256 row blocks
    assert not routed(mixtral, 1, s8)         # the k-sliced tile: a CTA per 16 weight rows
    assert not routed(qwen3, 1, u4, torch.int16)
    assert not routed((256, 128, 300, 8), 33, u4)   # 264 assignments: past the kernel's bound
    assert not routed((256, 128, 600, 1), 1, u4)    # more experts than the kernel ranks


def test_routed_bound_is_the_kernels_threads(requires_gpu):
    """At the kernel's bound fused_moe takes the routed path and equals the four-launch path."""
    from mixgemm.dtypes import ActType, WeightType

    e, h, inter, topk = 300, 256, 128, 8
    w13, _ = random_experts(ActType.BF16, WeightType.U4, e, 2 * inter, h, 64, gated=True)
    w2, _ = random_experts(ActType.BF16, WeightType.U4, e, h, inter, 64, seed=3)
    x = torch.randn(ROUTED_MAX_ASSIGNMENTS // topk, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, e, (x.shape[0], topk), device="cuda")
    w = torch.softmax(torch.randn(x.shape[0], topk, device="cuda"), -1)
    plan = moe.plan_fused_moe(ids.numel(), ActType.BF16, WeightType.U4, e, h, inter)
    assert moe_layer.routed_plan(plan, w13, w2, x, ids)
    got = moe.fused_moe(x, w13, w2, w, ids)
    keep = moe_layer.routed_plan
    try:
        moe_layer.routed_plan = lambda *a: False
        want = moe.fused_moe(x, w13, w2, w, ids)
    finally:
        moe_layer.routed_plan = keep
    assert torch.equal(got, want)
