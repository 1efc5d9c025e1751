"""One decoder layer's decode step in one operator call: :func:`decode_layer`.

A LLaMA-style decoder layer in mixgemm's kernels (``mixgemm.nn.blocks.FusedDecoderLayer``) runs
about ten launches per step: two RMSNorms, four GEMMs, the rotary / KV-cache kernel, the cache
counter, the attention and the residual add. Called one by one from Python, eagerly, each costs
more host time than its GPU time at decode sizes, and the host sets the pace of the step.
``torch.ops.mixgemm.decode_layer`` takes them all in one call: its C++ kernel (the torch operator
library, ``jit/csrc/torch_ops.cpp``) calls the same kernels in the same order, with the same
arguments, so the results are the same bit for bit; each part hands what the C++ kernel cannot
take to its own Python kernel. Its Python kernel (every other device, and before the library is
loaded) is the definition below, in the operators' Python entry points.

The attention of the step is one of the two that the fused layer chooses between (the choice is
the caller's): FlashAttention-2's variable-length form over the slots each sequence has filled
(:func:`flash_decode_attention`), or SDPA with the query heads of each KV head as its query rows
and the step's mask (:func:`grouped_decode_attention`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..dispatch.library import custom_op
from .norm import rms_norm
from .rotary import rotary_kv_cache

__all__ = ["decode_layer", "grouped_decode_attention", "flash_decode_attention", "LINEARS"]

#: the layer's GEMMs, in the order of ``weights`` / ``shapes`` / ``weight_types``, and their activations
LINEARS = (("qkv", "none"), ("o", "none"), ("gate_up", "swiglu"), ("down", "none"))


def grouped_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor],
                             kv_heads: int, scale: float) -> torch.Tensor:
    """One query token per sequence attending over a KV cache, the ``heads / kv_heads`` query heads
    that share a KV head taken as that head's query rows: ``q [B, heads, 1, D]`` becomes
    ``[B, kv_heads, group, D]`` against ``keys / values [B, kv_heads, L, D]``, with ``mask``
    (boolean or additive, ``[B or 1, 1, 1, L]``) broadcast over both. The scores and softmax of
    repeating each KV head ``group`` times, without that copy of the cache, in one SDPA call.
    Returns ``[B, 1, heads, D]``."""
    b, heads, _, d = q.shape
    packed = q.reshape(b, kv_heads, heads // kv_heads, d)
    out = torch.nn.functional.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, 1, d).transpose(1, 2)


def flash_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                           q_offsets: torch.Tensor, k_offsets: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token of one sequence attending over the first ``lengths[0]`` slots of a KV cache,
    in one FlashAttention-2 launch (its variable-length form with ``seqused_k``: the length is read
    on the GPU). ``q [1, heads, 1, D]`` against ``keys / values [1, kv_heads, L, D]``, read in
    place as ``[L, kv_heads, D]``; ``q_offsets`` / ``k_offsets`` are int32 ``[0, 1]`` and
    ``[0, L]``. CUDA, bf16 / fp16 only. Returns ``[1, 1, heads, D]``."""
    heads, d = q.shape[1], q.shape[3]
    out = torch.ops.aten._flash_attention_forward(
        q.reshape(1, heads, d), keys[0].transpose(0, 1), values[0].transpose(0, 1), q_offsets, k_offsets, 1,
        keys.shape[2], 0.0, False, False, scale=scale, seqused_k=lengths)[0]
    return out.view(1, 1, heads, d)


def _gemm(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
          bias: Optional[torch.Tensor], weight_type: str, group_size: int, n: int, k: int, activation: str) -> torch.Tensor:
    """One of the layer's GEMMs (the operator ``mixgemm::gemm``, as a QuantLinear's forward launches it)."""
    return torch.ops.mixgemm.gemm(x, qdata, scales, zeros, None, bias, weight_type, group_size, n, k, activation)


def decode_layer(x: torch.Tensor, norms: Sequence[torch.Tensor], eps: Sequence[float],
                 weights: Sequence[Optional[torch.Tensor]], weight_types: str, shapes: Sequence[int],
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 positions: torch.Tensor, counter: Optional[torch.Tensor], heads: int, kv_heads: int,
                 scaling: float, mask: Optional[torch.Tensor] = None, lengths: Optional[torch.Tensor] = None,
                 q_offsets: Optional[torch.Tensor] = None, k_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A LLaMA-style decoder layer's step over a static KV cache, in one operator call.

    ``h = x + o(attention(rope(qkv(norm1(x)))))``, ``y = h + down(swiglu(gate_up(norm2(h))))``.

    Parameters
    ----------
    x : torch.Tensor
        ``[B, T, H]`` hidden states (bf16 or fp16 for the kernels).
    norms, eps
        The two RMSNorms' weights ``[H]`` (x's dtype) and epsilons.
    weights : sequence of 16 tensors or None
        ``qdata, scales, zeros, bias`` of each GEMM of :data:`LINEARS` (qkv ``[H] -> [(heads +
        2 kv_heads) D]``, o, gate/up with its rows interleaved for swiglu, down), as a
        :class:`~mixgemm.nn.QuantLinear` holds them (``zeros`` None: symmetric; ``bias`` None:
        none). No zero offsets.
    weight_types : str
        Their weight types, comma-separated (``"u4,u4,u4,u4"``).
    shapes : sequence of 12 ints
        ``group_size, n, k`` of each GEMM (``n``: the weight's rows, twice the output for swiglu).
    cos, sin, k_cache, v_cache, positions, heads, kv_heads
        As for :func:`mixgemm.ops.rotary.rotary_kv_cache` (``positions`` an int64 tensor
        ``[B, T]``): the caches are written in place.
    counter : torch.Tensor or None
        The static cache layer's count of written slots (transformers' ``cumulative_length``):
        ``T`` is added to it in place.
    scaling : float
        The attention's softmax scale.
    mask : torch.Tensor, optional
        ``[B or 1, 1, 1, L]`` boolean or additive: the SDPA attention (:func:`grouped_decode_attention`);
        ``T`` must be 1.
    lengths, q_offsets, k_offsets : torch.Tensor, optional
        Given together (instead of ``mask``): the FlashAttention over the filled slots
        (:func:`flash_decode_attention`); ``B`` and ``T`` must be 1.

    Returns
    -------
    torch.Tensor
        ``[B, T, H]``, x's dtype: the layer's output hidden states.
    """
    _check(norms, eps, weights, weight_types, shapes, mask, lengths, q_offsets, k_offsets)
    return torch.ops.mixgemm.decode_layer(x, list(norms), list(eps), list(weights), weight_types, list(shapes), cos,
                                          sin, k_cache, v_cache, positions, counter, heads, kv_heads, scaling, mask,
                                          lengths, q_offsets, k_offsets)


def _check(norms, eps, weights, weight_types: str, shapes, mask, lengths, q_offsets, k_offsets) -> None:
    """The arguments' counts and the attention's inputs, or a ValueError (before anything runs)."""
    types = weight_types.split(",") if isinstance(weight_types, str) else ()
    if len(norms) != 2 or len(eps) != 2 or len(weights) != 16 or len(shapes) != 12 or len(types) != 4:
        raise ValueError("decode_layer takes 2 norms and eps, 16 weight tensors, 12 sizes and 4 weight types, got "
                         f"{len(norms)}, {len(eps)}, {len(weights)}, {len(shapes)} and {len(types)}")
    flash = (lengths is not None, q_offsets is not None, k_offsets is not None)
    if any(flash) and not all(flash):
        raise ValueError("decode_layer's FlashAttention takes lengths, q_offsets and k_offsets together")
    if mask is None and not all(flash):
        raise ValueError("decode_layer needs a mask (SDPA) or lengths, q_offsets and k_offsets (FlashAttention)")


@custom_op("mixgemm::decode_layer", mutates_args=("k_cache", "v_cache", "counter"))
def _decode_layer_op(x: torch.Tensor, norms: list[torch.Tensor], eps: list[float],
                     weights: list[Optional[torch.Tensor]], weight_types: str, shapes: list[int], cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     counter: Optional[torch.Tensor], heads: int, kv_heads: int, scaling: float,
                     mask: Optional[torch.Tensor], lengths: Optional[torch.Tensor],
                     q_offsets: Optional[torch.Tensor], k_offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """The definition (the Python kernel): the operators one by one."""
    _check(norms, eps, weights, weight_types, shapes, mask, lengths, q_offsets, k_offsets)
    types = weight_types.split(",")

    def linear(i: int, inp: torch.Tensor) -> torch.Tensor:
        qdata, scales, zeros, bias = weights[4 * i:4 * i + 4]
        group_size, n, k = shapes[3 * i:3 * i + 3]
        return _gemm(inp, qdata, scales, zeros, bias, types[i], group_size, n, k, LINEARS[i][1])

    b, t, _ = x.shape
    qkv = linear(0, rms_norm(x, norms[0], eps[0]))
    q = rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads).transpose(1, 2)
    if counter is not None:
        counter.add_(t)
    if lengths is not None:
        out = flash_decode_attention(q, k_cache, v_cache, lengths, q_offsets, k_offsets, scaling)
    else:
        out = grouped_decode_attention(q, k_cache, v_cache, mask, kv_heads, scaling)
    a = linear(1, out.reshape(b, t, -1).contiguous())
    h, residual = rms_norm(a, norms[1], eps[1], residual=x)
    return residual + linear(3, linear(2, h))


@_decode_layer_op.register_fake
def _decode_layer_fake(x, norms, eps, weights, weight_types, shapes, cos, sin, k_cache, v_cache, positions, counter,
                       heads, kv_heads, scaling, mask, lengths, q_offsets, k_offsets):
    return torch.empty_like(x)
