"""Token tiles: the padded expert-sorted layout of the grouped sm90 GEMM (many rows per expert).

The grouped GEMM (:class:`mixgemm.jit.specs.GroupedGemmSpec`,
``cutlass_ext/mixgemm/grouped_scheduler.hpp``) walks x in token tiles of ``tile`` rows, each of
one expert. So x's rows, sorted by expert, are laid out with every expert's rows starting at a
multiple of ``tile``::

    expert e's sorted row j (offsets[e] <= j < offsets[e + 1])  ->  padded row
        tile * tile_starts[e] + (j - offsets[e])

    tile_starts[e] = sum over e' < e of ceil(count[e'] / tile)

The padding rows between experts are never read back (each output row depends on its own x row
only). The kernel reads a table ``[U, expert of tile 0, ..., expert of tile U - 1]`` with
``U = tile_starts[E]``. The padded buffer's capacity is the static bound ``ceil(R / tile) +
min(E, R)`` tiles for ``R`` sorted rows. :func:`split_layout` is the same with only the experts
of many rows in token tiles (the fused layer's "split" plan).

The layout is computed on the GPU, with no host sync, so it can change between replays of a CUDA
graph: on an sm_90 GPU by one launch of mixgemm's layout kernel (``cutlass_ext/mixgemm/
moe_layout_kernel.hpp``, :class:`mixgemm.jit.specs.MoeLayoutSpec`; up to :data:`LAYOUT_MAX_EXPERTS`
experts), elsewhere by the same arithmetic in torch ops.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch

from ..dispatch import checks
from ..jit import loader as runtime
from ..jit.specs import MoeLayoutSpec

__all__ = ["TokenTiles", "SplitLayout", "capacity_tiles", "token_tiles", "split_layout", "LAYOUT_MAX_EXPERTS"]


class TokenTiles(NamedTuple):
    """The padded layout of ``rows`` expert-sorted rows in tiles of ``tile`` rows.

    ``table`` (int32 ``[1 + capacity_tiles]``): ``[U, expert of tile 0, ...]`` as the kernel reads
    it (entries past U name the last expert and are never read). ``positions`` (int64
    ``[rows]``): the padded row of each sorted row; a sorted row past ``expert_offsets[E]`` (an
    assignment the routing kernel dropped) goes to the spare row ``capacity`` (the padded
    buffers hold ``capacity + 1`` rows). ``inv``: the routing's inverse (assignment -> sorted
    row) through ``positions``, when one was given (-1 stays -1)."""

    tile: int
    table: torch.Tensor
    positions: torch.Tensor
    capacity: int
    inv: Optional[torch.Tensor] = None


class SplitLayout(NamedTuple):
    """x's sorted rows split between the two grouped kernels by their expert's row count: the
    rows of experts with fewer than ``hot_from`` rows ("cold") in ``[0, rows)`` in expert order with
    the offsets ``cold_offsets`` (int32 ``[E + 1]``; the other experts empty), for the grouped decode
    kernel; the rows of the others ("hot") from row ``rows`` on, in token tiles (``tiles``: its
    table and capacity; its positions and inv are those of this layout), for the grouped GEMM. One
    buffer of ``rows + tiles.capacity + 1`` rows holds both; ``tiles.positions[j]`` is sorted row
    j's row in it (dropped assignments: the spare last row)."""

    cold_offsets: torch.Tensor
    tiles: TokenTiles
    rows: int


#: The most experts the layout kernel takes (``kLayoutMaxExperts``); beyond, torch ops.
LAYOUT_MAX_EXPERTS = 2048


def capacity_tiles(rows: int, num_experts: int, tile: int) -> int:
    """The most token tiles ``rows`` sorted rows over ``num_experts`` experts can need: every
    expert with rows wastes less than one tile, and at most ``min(E, rows)`` experts have rows."""
    return -(-rows // tile) + min(num_experts, rows)


def _check(expert_offsets: torch.Tensor, tile: int, hot_from: int, inv: Optional[torch.Tensor]) -> None:
    if expert_offsets.dtype != torch.int32 or expert_offsets.dim() != 1 or expert_offsets.numel() < 2:
        raise ValueError(f"expert_offsets must be int32 [E + 1], got {expert_offsets.dtype} "
                         f"{list(expert_offsets.shape)}")
    if tile <= 0 or hot_from <= 0:
        raise ValueError(f"tile and hot_from must be positive, got {tile} and {hot_from}")
    if inv is not None and (inv.dtype != torch.int32 or inv.device != expert_offsets.device):
        raise ValueError(f"inv must be int32 on {expert_offsets.device}, got {inv.dtype} on {inv.device}")


def token_tiles(expert_offsets: torch.Tensor, rows: int, tile: int,
                inv: Optional[torch.Tensor] = None) -> TokenTiles:
    """The padded layout (:class:`TokenTiles`) of ``rows`` sorted rows whose experts own
    ``[expert_offsets[e], expert_offsets[e + 1])`` (int32 ``[E + 1]``, on the GPU or the CPU), and
    ``inv`` (int32, the routing's inverse) through it. Nothing is read back to the host."""
    _check(expert_offsets, tile, 1, inv)
    _, table, positions, inv_out, cap = _layout(expert_offsets, rows, tile, 1, 0, inv, cold=False)
    return TokenTiles(tile, table, positions, cap * tile, inv_out)


def split_layout(expert_offsets: torch.Tensor, rows: int, tile: int, hot_from: int,
                 inv: Optional[torch.Tensor] = None) -> SplitLayout:
    """:class:`SplitLayout` of ``rows`` sorted rows with ``expert_offsets`` (int32 ``[E + 1]``):
    experts with at least ``hot_from`` rows go to token tiles of ``tile`` rows; ``inv`` through
    it. Nothing is read back to the host: which experts are hot is decided on the GPU."""
    _check(expert_offsets, tile, hot_from, inv)
    cold, table, positions, inv_out, cap = _layout(expert_offsets, rows, tile, hot_from, rows, inv, cold=True)
    return SplitLayout(cold, TokenTiles(tile, table, positions, cap * tile, inv_out), rows)


def _layout(expert_offsets, rows, tile, hot_from, hot_base, inv, cold: bool):
    """(cold_offsets or None, table, positions, inv through them or None, capacity in tiles)."""

    e = expert_offsets.numel() - 1
    cap_tiles = capacity_tiles(rows, e, tile)
    if expert_offsets.device.type == "cuda" and e <= LAYOUT_MAX_EXPERTS and checks.on_sm90(expert_offsets.device):
        return (*_layout_kernel(expert_offsets, rows, tile, hot_from, hot_base, inv, cold, cap_tiles), cap_tiles)
    return (*_layout_torch(expert_offsets, rows, tile, hot_from, hot_base, inv, cold, cap_tiles), cap_tiles)


def _layout_kernel(expert_offsets, rows, tile, hot_from, hot_base, inv, cold, cap_tiles):

    dev = expert_offsets.device
    e = expert_offsets.numel() - 1
    offsets = expert_offsets.contiguous()
    cold_offsets = torch.empty(e + 1, dtype=torch.int32, device=dev) if cold else None
    table = torch.empty(1 + cap_tiles, dtype=torch.int32, device=dev)
    positions = torch.empty(rows, dtype=torch.int64, device=dev)
    inv = None if inv is None else inv.contiguous()
    inv_out = None if inv is None else torch.empty_like(inv)
    p, i = ctypes.c_void_p, ctypes.c_int
    ptr = lambda t: p(0 if t is None else t.data_ptr())  # noqa: E731
    kernel = runtime.KERNELS.get(MoeLayoutSpec(), dev)
    runtime.launch_kernel(kernel, (1, 1, 1), _LAYOUT_THREADS,
                          (ptr(offsets), ptr(inv), ptr(cold_offsets), ptr(table), ptr(positions), ptr(inv_out),
                           i(e), i(rows), i(0 if inv is None else inv.numel()), i(tile), i(hot_from), i(hot_base),
                           i(cap_tiles)))
    return cold_offsets, table, positions, inv_out


_LAYOUT_THREADS = 1024


def _layout_torch(expert_offsets, rows, tile, hot_from, hot_base, inv, cold, cap_tiles):
    dev = expert_offsets.device
    e = expert_offsets.numel() - 1
    offsets = expert_offsets.long()
    counts = offsets[1:] - offsets[:-1]
    hot = counts >= hot_from
    zero = torch.zeros_like(counts)
    cold_offsets = torch.zeros(e + 1, dtype=torch.int32, device=dev)
    torch.cumsum(torch.where(hot, zero, counts), 0, out=cold_offsets[1:])
    starts = torch.zeros(e + 1, dtype=torch.int64, device=dev)
    torch.cumsum(torch.where(hot, torch.div(counts + (tile - 1), tile, rounding_mode="floor"), zero), 0,
                 out=starts[1:])
    table = torch.empty(1 + cap_tiles, dtype=torch.int32, device=dev)
    table[:1] = starts[e:]
    j = torch.arange(cap_tiles, dtype=torch.int64, device=dev)
    table[1:] = torch.searchsorted(starts[1:], j, right=True).clamp_(max=e - 1)
    r = torch.arange(rows, dtype=torch.int64, device=dev)
    expert = torch.searchsorted(offsets[1:], r, right=True)
    clamped = expert.clamp(max=e - 1)
    within = r - offsets[clamped]
    positions = torch.where(hot[clamped], hot_base + tile * starts[clamped] + within,
                            cold_offsets[clamped].long() + within)
    positions = torch.where(expert < e, positions, torch.full_like(positions, hot_base + cap_tiles * tile))
    inv_out = None
    if inv is not None and rows == 0:
        inv_out = torch.full_like(inv, -1)                       # nothing to point at
    elif inv is not None:
        iv = inv.long()
        inv_out = torch.where(iv >= 0, positions[iv.clamp(min=0)], -1).to(torch.int32)
    return (cold_offsets if cold else None), table, positions, inv_out
