"""Session 22: the inputs of the session's MoE experiment scripts, as bench --moe makes them: a
preset's bf16 experts (seed 0), one weight type's quantized layer, and one point's x and routing."""
import torch

from mixgemm.bench.moe import MOE_PRESETS, make_routing
from mixgemm.bench.moe_run import MixgemmLayer, base_weights
from mixgemm.bench.variants import parse_variant


def preset_weights(pname: str, dev):
    """(preset, w13, w2): bench --moe's bf16 experts of ``pname``."""
    p = MOE_PRESETS[pname]
    return (p, *base_weights(p, 0, dev))


def quantized(w13, w2, wname: str) -> MixgemmLayer:
    """The mixgemm layer of weight type ``wname`` (u4, u2, s8, ...), group size 128."""
    return MixgemmLayer(w13, w2, parse_variant(wname), 128)


def point_inputs(p, t: int, routing: str, dev):
    """(x, topk_weights, topk_ids) of ``t`` tokens under ``routing`` (uniform / zipf), on ``dev``."""
    ids, tw = make_routing(p.experts, p.topk, t, routing, 0)
    x = (torch.randn(t, p.hidden, device=dev) * 0.5).to(torch.bfloat16)
    return x, tw.to(dev), ids.to(dev)
