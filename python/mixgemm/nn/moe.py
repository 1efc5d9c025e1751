""":class:`QuantMoE`: a mixture-of-experts block's experts with prepacked low-bit weights.

The routing (the router's softmax and top-k) stays with the model; :meth:`QuantMoE.forward`
takes the hidden states and the top-k weights and ids, as vLLM's ``fused_experts`` does, and
runs :func:`mixgemm.moe.fused_moe` through the ``mixgemm::fused_moe`` custom op (gate/up and down
of one weight type; else through the ``mixgemm::route_and_gather``, ``mixgemm::grouped_gemm`` and
``mixgemm::combine`` ops), so ``torch.compile(fullgraph=True)`` traces it and CUDA graphs capture
it (after a warm-up call with the same number of tokens).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .. import moe
from ..dispatch.uses import ExpertsUse
from ..moe import routing as moe_routing
from ..weights.experts import PackedExperts
from ..weights.quantize import interleave_gate_up, quantize

__all__ = ["QuantMoE"]


def _register(module: nn.Module, prefix: str, ex: PackedExperts) -> None:
    module.register_buffer(f"{prefix}_qdata", ex.qdata)
    module.register_buffer(f"{prefix}_scales", ex.scales)
    module.register_buffer(f"{prefix}_zeros", ex.zeros)


class QuantMoE(nn.Module):
    """E gated-MLP experts (``down(silu(gate(x)) * up(x))``) with prepacked weights.

    Parameters
    ----------
    w13 : PackedExperts
        ``E x [2I, H]``, gate and up interleaved in 8-row stripes per expert.
    w2 : PackedExperts
        ``E x [H, I]``.

    Use :meth:`from_mlps` to quantize a list of expert MLPs, or build the two
    :class:`PackedExperts` yourself (for example from a checkpoint).
    """

    def __init__(self, w13: PackedExperts, w2: PackedExperts):
        super().__init__()
        if not isinstance(w13, PackedExperts) or not isinstance(w2, PackedExperts):
            raise TypeError("w13 and w2 must be mixgemm.moe.PackedExperts")
        if w13.num_experts != w2.num_experts or w13.n != 2 * w2.k or w13.k != w2.n:
            raise ValueError(f"w13 (E={w13.num_experts} x [{w13.n}, {w13.k}]) and w2 (E={w2.num_experts} x "
                             f"[{w2.n}, {w2.k}]) must be E x [2I, H] and E x [H, I]")
        if w13.dtype != w2.dtype:
            raise ValueError(f"w13 is {w13.dtype} and w2 is {w2.dtype}")
        self.num_experts, self.hidden_size, self.intermediate_size = w13.num_experts, w13.k, w2.k
        self._fields = {"w13": (w13.weight_type, w13.group_size), "w2": (w2.weight_type, w2.group_size)}
        _register(self, "w13", w13)
        _register(self, "w2", w2)

    def experts(self, which: str) -> PackedExperts:
        """``"w13"`` or ``"w2"`` as :class:`PackedExperts` (views of the module's buffers)."""
        wt, group = self._fields[which]
        n, k = ((2 * self.intermediate_size, self.hidden_size) if which == "w13"
                else (self.hidden_size, self.intermediate_size))
        return PackedExperts(getattr(self, f"{which}_qdata"), getattr(self, f"{which}_scales"),
                             getattr(self, f"{which}_zeros"), wt, group, n, k)

    def kernel_uses(self) -> list[ExpertsUse]:
        """The experts as the grouped kernels see them (:class:`~mixgemm.dispatch.uses.LaunchesKernels`)."""
        return [ExpertsUse.of_layer(self)]

    @classmethod
    def from_mlps(cls, mlps: Sequence[nn.Module], bits: int, group_size: int, symmetric: bool = False,
                  dtype: Optional[torch.dtype] = None) -> "QuantMoE":
        """Quantize E expert MLPs, each with ``gate_proj``, ``up_proj`` ([I, H]) and ``down_proj``
        ([H, I]) linear layers without bias (the Qwen / Mixtral / DeepSeek expert), on their
        device. ``dtype``: the activation dtype (default: the weights' if bf16/fp16, else bf16)."""
        mlps = list(mlps)
        if not mlps:
            raise ValueError("QuantMoE needs at least one expert")
        w13, w2 = [], []
        for e, mlp in enumerate(mlps):
            for name in ("gate_proj", "up_proj", "down_proj"):
                lin = getattr(mlp, name, None)
                if not isinstance(lin, nn.Linear):
                    raise TypeError(f"expert {e} has no nn.Linear {name!r}")
                if lin.bias is not None:
                    raise ValueError(f"expert {e}: {name} has a bias; QuantMoE's experts have none")
            w = lambda lin: lin.weight.detach()  # noqa: E731
            w13.append(interleave_gate_up(quantize(w(mlp.gate_proj), bits, group_size, symmetric, dtype),
                                          quantize(w(mlp.up_proj), bits, group_size, symmetric, dtype)))
            w2.append(quantize(w(mlp.down_proj), bits, group_size, symmetric, dtype))
        return cls(PackedExperts.from_quantized(w13), PackedExperts.from_quantized(w2))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` hidden states, ``[T, topk]`` routing weights and expert ids (T the
        tokens of x) -> ``[..., H]``."""
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        (wt13, g13), (wt2, g2) = self._fields["w13"], self._fields["w2"]
        if wt13 == wt2:   # the whole layer in one op: fused_moe's plan
            # (the buffers straight to the op: building the two PackedExperts views here, which the
            # op builds again, cost ~27 us of host time per call)
            return torch.ops.mixgemm.fused_moe(
                x2, self.w13_qdata, self.w13_scales, self.w13_zeros, self.w2_qdata, self.w2_scales, self.w2_zeros,
                wt13.value, g13, g2, self.hidden_size, self.intermediate_size, topk_weights, topk_ids).reshape(shape)
        routing, xs = moe_routing.route_and_gather_op(x2, topk_ids, self.num_experts)
        h = moe.grouped_gemm_op(xs, self.experts("w13"), routing.expert_offsets, activation="swiglu")
        y = moe.grouped_gemm_op(h, self.experts("w2"), routing.expert_offsets)
        return moe_routing.combine_op(y, routing, topk_weights).reshape(shape)

    def extra_repr(self) -> str:
        wt13, g13 = self._fields["w13"]
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"{wt13.value}, group_size={g13}")
