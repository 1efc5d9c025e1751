"""References shared by the MoE GPU tests (tests/moe/test_gpu_moe*.py): random experts and their
dequantized weights, a float64 per-expert reference of the grouped GEMM, random routing and the
error of fused_moe against fused_moe_reference, and the tolerance they are held to."""
from __future__ import annotations

import torch

from mixgemm import moe
from mixgemm.weights.experts import PackedExperts
from mixgemm.weights.quantize import interleave_gate_up, quantize


def tolerance(k: int, dtype) -> float:
    # as tests/ops/test_gpu_gemm.py: 4x the output rounding plus 64x the float32 accumulation term
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    return 4 * unit + 64 * (k ** 0.5) * 2.0 ** -24


def random_experts(act, wt, e, n, k, group, gated=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = act.torch_dtype
    group = k if group == "K" else group
    if gated:
        qws = [interleave_gate_up(quantize(torch.randn(n // 2, k, generator=g), wt.bits, group, wt.signed, dtype),
                                  quantize(torch.randn(n // 2, k, generator=g), wt.bits, group, wt.signed, dtype))
               for _ in range(e)]
    else:
        qws = [quantize(torch.randn(n, k, generator=g), wt.bits, group, wt.signed, dtype) for _ in range(e)]
    ex = PackedExperts.from_quantized(qws).to("cuda")
    return ex, ex.dequantize_reference().double()


def expert_offsets(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def grouped_reference(x, deq, counts, activation):
    ref = []
    r0 = 0
    for e, c in enumerate(counts):
        y = x[r0:r0 + c].double() @ deq[e].T
        if activation == "swiglu":
            p = y.view(c, y.shape[1] // 16, 2, 8)   # (an expert with no rows: c = 0)
            y = (torch.nn.functional.silu(p[:, :, 0]) * p[:, :, 1]).reshape(c, y.shape[1] // 2)
        ref.append(y)
        r0 += c
    return torch.cat(ref)


def distinct_experts(t: int, topk: int, e: int) -> torch.Tensor:
    """[t, topk] int64 top-k ids: each token on ``topk`` distinct experts of ``e``, at random."""
    return torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(t)])


def fused_moe_error(x, w13, w2, topk: int, e: int) -> float:
    """The relative error of ``fused_moe`` on x under random routing (distinct experts, softmax
    weights, ``e`` experts) against ``fused_moe_reference`` on the experts' dequantized weights."""
    ids = distinct_experts(x.shape[0], topk, e)
    w = torch.softmax(torch.randn(x.shape[0], topk, device="cuda"), -1)
    got = moe.fused_moe(x, w13, w2, w, ids)
    ref = moe.fused_moe_reference(x, w13.dequantize_reference(), w2.dequantize_reference(), w, ids)
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()
