"""CUDA-graph capture and replay of :func:`mixgemm.moe.fused_moe`, shared by the MoE GPU tests:
the captured call's buffers (x, routing weights, top-k ids) get new contents, the graph is
replayed, and its output must equal an eager call on the same inputs."""
from __future__ import annotations

import torch

from mixgemm import moe


def capture_fused_moe(x, w13, w2, w, ids):
    """``(graph, out)``: ``fused_moe(x, w13, w2, w, ids)`` captured (its kernels loaded before)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, w, ids)
    return graph, out


def replay_matches_eager(graph, out, x, w13, w2, w, ids, new_ids, label) -> None:
    """Write ``new_ids``, fresh softmax routing weights and fresh inputs into the captured buffers,
    replay, and assert the output equals an eager call on them."""
    ids.copy_(new_ids)
    w.copy_(torch.softmax(torch.randn(w.shape, device=w.device), -1))
    x.copy_(torch.randn(x.shape, device=x.device, dtype=x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe.fused_moe(x, w13, w2, w, ids)), f"replay {label} differs from an eager call"
