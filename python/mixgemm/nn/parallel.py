"""Tensor parallelism over several GPUs: :class:`ColumnParallelQuantLinear` and
:class:`RowParallelQuantLinear`, with ``torch.distributed`` collectives (NCCL on GPUs).

A layer ``y = x @ W.T + b`` with ``W`` ``[N, K]`` is split over ``tp_size`` ranks in one of
two ways (Megatron-LM's pair), each rank holding a :meth:`mixgemm.PackedWeight.shard` of the
packed weight -- never re-quantized, so every rank's codes, scales and zeros are exactly the
whole layer's:

* **column parallel** (:class:`ColumnParallelQuantLinear`): rank ``r`` holds the output rows
  ``r*N/P .. (r+1)*N/P`` (and that slice of the bias) and computes those output features
  from the whole input; ``gather_output=True`` all-gathers them into ``[..., N]`` on every
  rank, ``False`` keeps them (the input of a row-parallel layer, or of the attention over the
  rank's heads). A swiglu (gate/up) layer splits at 16-row atoms, each holding 8 gate and 8 up
  rows: rank ``r`` computes the features ``r*I/P ..`` of ``silu(gate) * up``;
* **row parallel** (:class:`RowParallelQuantLinear`): rank ``r`` holds the input columns
  ``r*K/P .. (r+1)*K/P`` (whole groups) and multiplies its slice of the input (already split
  by a column-parallel layer: ``input_is_parallel=True``, or sliced here); the partial
  products are summed with an all-reduce, and the bias is added once, after it. No activation:
  it would have to act on the sum.

A transformer block uses them in pairs, with one all-reduce per pair: q/k/v and gate/up
column parallel without gathering, o and down row parallel over the column-parallel outputs.

Collectives and CUDA graphs: ``torch.distributed.all_reduce`` and ``all_gather_single``
(``all_gather_into_tensor`` before PyTorch 2.13)
on an NCCL process group can be captured in a CUDA graph (PyTorch >= 1.13, NCCL >= 2.9.6),
as the GEMMs can: run one step eagerly first (it creates the NCCL communicator and loads the
kernels), then capture (``benchmarks/tp_bench.py`` does). With ``tp_size == 1`` no collective runs
and no process group is needed. Keep NCCL's NVLink SHARP (multicast) off on machines that
share GPUs (``NCCL_NVLS_ENABLE=0``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .linear import QuantLinear

__all__ = ["ColumnParallelQuantLinear", "RowParallelQuantLinear", "RowParallelLinear", "tp_rank_and_size"]


def tp_rank_and_size(tp_rank: Optional[int], tp_size: Optional[int], group=None) -> tuple[int, int]:
    """``(tp_rank, tp_size)``: the given values, else the process group's (``group``, default
    the world). Given values are checked against an initialized process group."""
    initialized = dist.is_available() and dist.is_initialized()
    if tp_rank is None or tp_size is None:
        if not initialized:
            raise ValueError("pass tp_rank and tp_size, or initialize torch.distributed "
                             "(torch.distributed.init_process_group) to take them from the process group")
        tp_rank = dist.get_rank(group) if tp_rank is None else tp_rank
        tp_size = dist.get_world_size(group) if tp_size is None else tp_size
    for name, v in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    if initialized and tp_size > 1 and dist.get_world_size(group) != tp_size:
        raise ValueError(f"tp_size={tp_size} but the process group has {dist.get_world_size(group)} ranks")
    return tp_rank, tp_size


def _check_layer(layer) -> None:
    if not isinstance(layer, QuantLinear):
        raise TypeError(f"expected a mixgemm.nn.QuantLinear, got {type(layer).__name__}")


def _rows(t: Optional[torch.Tensor], sections: Sequence[int], rank: int, size: int) -> Optional[torch.Tensor]:
    """The rank's rows of each section of ``t`` (dim 0), concatenated (a copy)."""
    if t is None:
        return None
    parts, start = [], 0
    for s in sections:
        part = s // size
        parts.append(t[start + rank * part:start + (rank + 1) * part])
        start += s
    return torch.cat(parts)


class ColumnParallelQuantLinear(nn.Module):
    """A :class:`~mixgemm.nn.QuantLinear` split along its output features over ``tp_size`` ranks.

    Build it with :meth:`from_quant_linear` (a whole layer, sharded here) or
    :meth:`from_packed`. ``self.linear`` is the rank's own QuantLinear (its shard: ``N/P`` rows,
    the whole K, the bias slice); ``out_features`` is the whole layer's.

    Parameters
    ----------
    linear : QuantLinear
        The rank's shard.
    out_features : int
        The whole layer's output features (``tp_size * linear.out_features``).
    tp_rank, tp_size : int
    gather_output : bool
        All-gather the ranks' outputs into ``[..., out_features]`` (True), or return the rank's
        ``[..., out_features / tp_size]`` (False).
    sections : sequence of int, optional
        Output sections of a fused layer (q/k/v), whole-layer sizes: a gathered output is put
        back in section order (``[q; k; v]``, not ``[q_0 k_0 v_0 q_1 ...]``).
    group : torch.distributed.ProcessGroup, optional
        Default the world.
    """

    def __init__(self, linear: QuantLinear, out_features: int, *, tp_rank: int, tp_size: int,
                 gather_output: bool = True, sections: Optional[Sequence[int]] = None, group=None):
        super().__init__()
        _check_layer(linear)
        self.linear = linear
        self.out_features, self.in_features = out_features, linear.in_features
        self.tp_rank, self.tp_size, self.gather_output, self.group = tp_rank, tp_size, gather_output, group
        sections = tuple(sections) if sections is not None else (out_features,)
        if sum(sections) != out_features or any(s % tp_size for s in sections):
            raise ValueError(f"sections {list(sections)} must sum to out_features={out_features} and divide "
                             f"by tp_size={tp_size}")
        if linear.out_features * tp_size != out_features:
            raise ValueError(f"the shard has {linear.out_features} output features; {tp_size} shards make "
                             f"{linear.out_features * tp_size}, not {out_features}")
        self.local_sections = tuple(s // tp_size for s in sections)

    @property
    def activation(self) -> str:
        return self.linear.activation

    @classmethod
    def from_quant_linear(cls, layer: QuantLinear, *, tp_rank: Optional[int] = None, tp_size: Optional[int] = None,
                          gather_output: bool = True, sections: Optional[Sequence[int]] = None,
                          group=None) -> "ColumnParallelQuantLinear":
        """Shard a whole layer: the rank's rows of the packed weight
        (:meth:`PackedWeight.shard` along N), of the bias, and the whole input permutation.

        Parameters
        ----------
        layer : QuantLinear
            The whole layer (any activation: none / silu / gelu apply per feature; swiglu
            splits at gate/up stripe pairs).
        tp_rank, tp_size : int, optional
            Default: the process group's.
        gather_output, sections, group
            As for the class. ``sections`` (output features per section, e.g.
            ``(q_size, kv_size, kv_size)``) shards each section on its own; not with swiglu.

        Raises
        ------
        ValueError
            N (or a section) not divisible into ``tp_size`` slices of whole 16-row atoms.
        """
        _check_layer(layer)
        tp_rank, tp_size = tp_rank_and_size(tp_rank, tp_size, group)
        swiglu = layer.activation == "swiglu"
        if swiglu and sections is not None:
            raise ValueError("a swiglu (gate/up) layer has one section")
        rows = tuple(sections) if sections is not None else (layer.weight_rows,)
        packed = layer.packed.shard(0, tp_rank, tp_size, sections=rows)
        bias = _rows(layer.bias.detach() if layer.bias is not None else None, rows, tp_rank, tp_size)
        local = QuantLinear.from_packed(packed, bias=bias, perm=layer.perm)
        if swiglu:
            local.activation, local.out_features = "swiglu", packed.n // 2
        else:
            local.activation = layer.activation
        return cls(local, layer.out_features, tp_rank=tp_rank, tp_size=tp_size, gather_output=gather_output,
                   sections=sections, group=group)

    @classmethod
    def from_packed(cls, packed, bias: Optional[torch.Tensor] = None, perm: Optional[torch.Tensor] = None, *,
                    activation: str = "none", tp_rank: Optional[int] = None, tp_size: Optional[int] = None,
                    gather_output: bool = True, sections: Optional[Sequence[int]] = None,
                    group=None) -> "ColumnParallelQuantLinear":
        """:meth:`from_quant_linear` of ``QuantLinear.from_packed(packed, bias, perm)`` (the whole
        weight, e.g. from :func:`mixgemm.load` or an importer of :mod:`mixgemm.formats`) with
        ``activation`` ("swiglu": ``packed`` is a gate/up interleaved weight)."""
        layer = QuantLinear.from_packed(packed, bias=bias, perm=perm)
        layer.activation = activation
        if activation == "swiglu":
            layer.out_features = packed.n // 2
        return cls.from_quant_linear(layer, tp_rank=tp_rank, tp_size=tp_size, gather_output=gather_output,
                                     sections=sections, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.gather_output and self.tp_size > 1:
            y = _all_gather_features(y, self.tp_size, self.local_sections, self.group)
        return y

    def extra_repr(self) -> str:
        return (f"out_features={self.out_features}, tp_rank={self.tp_rank}, tp_size={self.tp_size}, "
                f"gather_output={self.gather_output}")

    def get_extra_state(self):
        return {"format": "mixgemm.ColumnParallelQuantLinear", "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "out_features": self.out_features}

    def set_extra_state(self, state) -> None:
        _check_parallel_state(state, self.get_extra_state())


class RowParallelQuantLinear(nn.Module):
    """A :class:`~mixgemm.nn.QuantLinear` split along its input features over ``tp_size`` ranks.

    Build it with :meth:`from_quant_linear` or :meth:`from_packed`. ``self.linear`` is the
    rank's own QuantLinear (``K/P`` input features, no bias, no activation); ``self.bias``
    (``[N]``, the whole layer's) is added once, after the all-reduce; ``in_features`` is the
    whole layer's.

    Parameters
    ----------
    linear : QuantLinear
        The rank's shard.
    in_features : int
        The whole layer's input features.
    bias : torch.Tensor, optional
        ``[N]``, the activation dtype.
    tp_rank, tp_size : int
    input_is_parallel : bool
        The input is the rank's ``[..., K/P]`` slice already (the output of a column-parallel
        layer that did not gather); False: the whole ``[..., K]``, sliced here.
    group : torch.distributed.ProcessGroup, optional
        Default the world.
    """

    def __init__(self, linear: QuantLinear, in_features: int, bias: Optional[torch.Tensor] = None, *,
                 tp_rank: int, tp_size: int, input_is_parallel: bool = True, group=None):
        super().__init__()
        _check_layer(linear)
        if linear.bias is not None or linear.activation != "none":
            raise ValueError("a row-parallel shard has no bias and no activation (both act on the sum)")
        if linear.in_features * tp_size != in_features:
            raise ValueError(f"the shard has {linear.in_features} input features; {tp_size} shards make "
                             f"{linear.in_features * tp_size}, not {in_features}")
        if linear.perm is not None and input_is_parallel:
            raise ValueError("an act-order layer (input permutation) needs the whole input: "
                             "input_is_parallel=False")
        self.linear = linear
        self.in_features, self.out_features = in_features, linear.out_features
        self.tp_rank, self.tp_size, self.input_is_parallel, self.group = tp_rank, tp_size, input_is_parallel, group
        if bias is not None:
            if tuple(bias.shape) != (linear.out_features,):
                raise ValueError(f"bias must have shape [{linear.out_features}], got {list(bias.shape)}")
            bias = nn.Parameter(bias.detach().to(linear.scales.dtype), requires_grad=False)
        self.bias = bias

    @classmethod
    def from_quant_linear(cls, layer: QuantLinear, *, tp_rank: Optional[int] = None, tp_size: Optional[int] = None,
                          input_is_parallel: bool = True, group=None) -> "RowParallelQuantLinear":
        """Shard a whole layer: the rank's columns of the packed weight
        (:meth:`PackedWeight.shard` along K: whole 64-column atoms and whole groups). An
        act-order layer's permutation (``layer.perm``) keeps the rank's entries: they select
        its columns from the whole input (so it needs ``input_is_parallel=False``).

        Raises
        ------
        ValueError
            A swiglu / silu / gelu layer; K not divisible into ``tp_size`` slices of whole
            atoms and groups.
        """
        _check_layer(layer)
        if layer.activation != "none":
            raise ValueError(f"a row-parallel layer sums partial products before its activation: "
                             f"cannot split a {layer.activation!r} layer along K")
        tp_rank, tp_size = tp_rank_and_size(tp_rank, tp_size, group)
        packed = layer.packed.shard(1, tp_rank, tp_size)
        perm = None
        if layer.perm is not None:
            perm = layer.perm[tp_rank * packed.k:(tp_rank + 1) * packed.k].clone()
        local = QuantLinear.from_packed(packed, perm=perm)
        bias = layer.bias.detach() if layer.bias is not None else None
        return cls(local, layer.in_features, bias, tp_rank=tp_rank, tp_size=tp_size,
                   input_is_parallel=input_is_parallel, group=group)

    @classmethod
    def from_packed(cls, packed, bias: Optional[torch.Tensor] = None, perm: Optional[torch.Tensor] = None, *,
                    tp_rank: Optional[int] = None, tp_size: Optional[int] = None, input_is_parallel: bool = True,
                    group=None) -> "RowParallelQuantLinear":
        """:meth:`from_quant_linear` of ``QuantLinear.from_packed(packed, bias, perm)``."""
        return cls.from_quant_linear(QuantLinear.from_packed(packed, bias=bias, perm=perm), tp_rank=tp_rank,
                                     tp_size=tp_size, input_is_parallel=input_is_parallel, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.linear.perm is None and self.tp_size > 1:
            k = self.linear.in_features
            x = x.narrow(-1, self.tp_rank * k, k)
        y = self.linear(x)
        if self.tp_size > 1:
                dist.all_reduce(y, group=self.group)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, bias={self.bias is not None}, tp_rank={self.tp_rank}, "
                f"tp_size={self.tp_size}, input_is_parallel={self.input_is_parallel}")

    def get_extra_state(self):
        return {"format": "mixgemm.RowParallelQuantLinear", "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "in_features": self.in_features}

    def set_extra_state(self, state) -> None:
        _check_parallel_state(state, self.get_extra_state())


class RowParallelLinear(nn.Module):
    """A full-precision linear layer split along its input features: the counterpart of
    :class:`RowParallelQuantLinear` for a layer kept unquantized (e.g. an ``o_proj`` that the
    checkpoint stores in bf16). ``y = all_reduce(x_r @ W_r.T) + b``.

    Parameters
    ----------
    weight : torch.Tensor
        The rank's columns ``[N, K/P]``.
    bias : torch.Tensor, optional
        ``[N]``, the whole layer's, added once after the all-reduce.
    in_features : int
        The whole layer's K.
    tp_rank, tp_size : int
    group : torch.distributed.ProcessGroup, optional
        Default the world.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], in_features: int, *, tp_rank: int,
                 tp_size: int, group=None):
        super().__init__()
        if weight.dim() != 2 or weight.shape[1] * tp_size != in_features:
            raise ValueError(f"the shard's weight must be [N, {in_features // max(tp_size, 1)}], "
                             f"got {list(weight.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        if self.tp_size > 1:
                dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp_rank={self.tp_rank}, tp_size={self.tp_size}")


def _check_parallel_state(state, mine: dict) -> None:
    """Refuse a state saved by another rank, another split or another class."""
    if not isinstance(state, dict) or state.get("format") != mine["format"]:
        raise ValueError(f"not a {mine['format']} state")
    diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
    if diff:
        raise ValueError(f"tensor-parallel state mismatch (state, module): {diff}")


def _all_gather_features(y: torch.Tensor, tp_size: int, local_sections: Sequence[int], group) -> torch.Tensor:
    """The ranks' ``[..., n]`` outputs gathered into ``[..., tp_size * n]``, in section order."""
    lead, n = y.shape[:-1], y.shape[-1]
    flat = y.reshape(-1, n).contiguous()
    stacked = flat.new_empty((tp_size * flat.shape[0], n))       # the ranks' [m, n] blocks, in rank order
    _all_gather_single(stacked, flat, group=group)
    stacked = stacked.view(tp_size, *lead, n)
    if len(local_sections) == 1:
        return stacked.movedim(0, -2).reshape(*lead, tp_size * n)
    parts = stacked.split(tuple(local_sections), dim=-1)
    return torch.cat([p.movedim(0, -2).reshape(*lead, tp_size * s) for p, s in zip(parts, local_sections)], dim=-1)


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``torch.distributed.all_gather_single`` (PyTorch >= 2.13), else its older name
    ``all_gather_into_tensor``: the ranks' inputs concatenated along dim 0."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)

