"""Token tiles: the padded expert-sorted layout of the grouped sm90 GEMM (many rows per expert).

The grouped GEMM (:class:`mixgemm.codegen.GroupedGemmSpec`,
``cutlass_ext/mixgemm/grouped_scheduler.hpp``) walks x in token tiles of ``tile`` rows, each of
one expert. So x's rows, sorted by expert, are laid out with every expert's rows starting at a
multiple of ``tile``::

    expert e's sorted row j (offsets[e] <= j < offsets[e + 1])  ->  padded row
        tile * tile_starts[e] + (j - offsets[e])

    tile_starts[e] = sum over e' < e of ceil(count[e'] / tile)

The padding rows between experts are never read back (each output row depends on its own x row
only). The kernel reads a table ``[U, expert of tile 0, ..., expert of tile U - 1]`` with
``U = tile_starts[E]``, built here on the GPU with torch ops: no host sync, so the layout can
change between replays of a CUDA graph. The padded buffer's capacity is the static bound
``ceil(R / tile) + min(E, R)`` tiles for ``R`` sorted rows.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TokenTiles", "SplitLayout", "capacity_tiles", "token_tiles", "split_layout"]


class TokenTiles(NamedTuple):
    """The padded layout of ``rows`` expert-sorted rows in tiles of ``tile`` rows.

    ``table`` (int32 ``[1 + capacity_tiles]``): ``[U, expert of tile 0, ...]`` as the kernel reads
    it (entries past U name the last expert and are never read). ``positions`` (int64
    ``[rows]``): the padded row of each sorted row; a sorted row past ``expert_offsets[E]`` (an
    assignment the routing kernel dropped) goes to the spare row ``capacity`` (the padded
    buffers hold ``capacity + 1`` rows)."""

    tile: int
    table: torch.Tensor
    positions: torch.Tensor
    capacity: int


def capacity_tiles(rows: int, num_experts: int, tile: int) -> int:
    """The most token tiles ``rows`` sorted rows over ``num_experts`` experts can need: every
    expert with rows wastes less than one tile, and at most ``min(E, rows)`` experts have rows."""
    return -(-rows // tile) + min(num_experts, rows)


def token_tiles(expert_offsets: torch.Tensor, rows: int, tile: int) -> TokenTiles:
    """The padded layout (:class:`TokenTiles`) of ``rows`` sorted rows whose experts own
    ``[expert_offsets[e], expert_offsets[e + 1])`` (int32 ``[E + 1]``, on the GPU or the CPU).
    Torch ops on the offsets' device, nothing read back to the host."""
    if expert_offsets.dtype != torch.int32 or expert_offsets.dim() != 1 or expert_offsets.numel() < 2:
        raise ValueError(f"expert_offsets must be int32 [E + 1], got {expert_offsets.dtype} "
                         f"{list(expert_offsets.shape)}")
    if tile <= 0:
        raise ValueError(f"tile must be positive, got {tile}")
    dev = expert_offsets.device
    e = expert_offsets.numel() - 1
    cap_tiles = capacity_tiles(rows, e, tile)
    offsets = expert_offsets.long()
    counts = offsets[1:] - offsets[:-1]
    starts = torch.zeros(e + 1, dtype=torch.int64, device=dev)
    torch.cumsum(torch.div(counts + (tile - 1), tile, rounding_mode="floor"), 0, out=starts[1:])
    table = torch.empty(1 + cap_tiles, dtype=torch.int32, device=dev)
    table[:1] = starts[e:]
    j = torch.arange(cap_tiles, dtype=torch.int64, device=dev)
    table[1:] = torch.searchsorted(starts[1:], j, right=True).clamp_(max=e - 1)
    r = torch.arange(rows, dtype=torch.int64, device=dev)
    expert = torch.searchsorted(offsets[1:], r, right=True)
    clamped = expert.clamp(max=e - 1)
    positions = r - offsets[clamped] + tile * starts[clamped]
    positions = torch.where(expert < e, positions, torch.full_like(positions, cap_tiles * tile))
    return TokenTiles(tile, table, positions, cap_tiles * tile)


class SplitLayout(NamedTuple):
    """x's sorted rows split between the two grouped kernels by their expert's row count: the
    rows of experts with fewer than ``hot_from`` rows ("cold") in ``[0, rows)`` in expert order with
    the offsets ``cold_offsets`` (int32 ``[E + 1]``; the other experts empty), for the grouped decode
    kernel; the rows of the others ("hot") from row ``rows`` on, in token tiles (``tiles``: its
    table and capacity; its positions are those of this layout), for the grouped GEMM. One buffer
    of ``rows + tiles.capacity + 1`` rows holds both; ``tiles.positions[j]`` is sorted row j's row
    in it (dropped assignments: the spare last row)."""

    cold_offsets: torch.Tensor
    tiles: TokenTiles
    rows: int


def split_layout(expert_offsets: torch.Tensor, rows: int, tile: int, hot_from: int) -> SplitLayout:
    """:class:`SplitLayout` of ``rows`` sorted rows with ``expert_offsets`` (int32 ``[E + 1]``):
    experts with at least ``hot_from`` rows go to token tiles of ``tile`` rows. Torch ops on the
    offsets' device, nothing read back to the host: which experts are hot is decided on the GPU."""
    if expert_offsets.dtype != torch.int32 or expert_offsets.dim() != 1 or expert_offsets.numel() < 2:
        raise ValueError(f"expert_offsets must be int32 [E + 1], got {expert_offsets.dtype} "
                         f"{list(expert_offsets.shape)}")
    if tile <= 0 or hot_from <= 0:
        raise ValueError(f"tile and hot_from must be positive, got {tile} and {hot_from}")
    dev = expert_offsets.device
    e = expert_offsets.numel() - 1
    cap_tiles = capacity_tiles(rows, e, tile)
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
    positions = torch.where(hot[clamped], rows + tile * starts[clamped] + within, cold_offsets[clamped].long() + within)
    positions = torch.where(expert < e, positions, torch.full_like(positions, rows + cap_tiles * tile))
    return SplitLayout(cold_offsets, TokenTiles(tile, table, positions, cap_tiles * tile), rows)
