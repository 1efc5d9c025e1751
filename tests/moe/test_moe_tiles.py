"""The token-tile layout of the grouped sm90 GEMM (mixgemm.moe.tiles), its kernel specs, and the
combine through a padded layout: CPU only."""
from __future__ import annotations

import pytest
import torch

from mixgemm.jit import catalog
from mixgemm.jit import render as codegen
from mixgemm import moe
from mixgemm.moe.routing import Routing, _combine_torch, route
from mixgemm.moe.tiles import capacity_tiles, token_tiles
from mixgemm.jit.specs import Epilogue, GroupedGemmSpec, KernelKind, parse_name
from mixgemm.dtypes import ActType, WeightType


def _offsets(counts):
    return torch.tensor([0] + torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


COUNTS = ([0, 1, 0, 3, 0, 0, 2, 1], [5, 0, 67, 1, 0, 130, 9, 0], [64] * 8, [0] * 7 + [257], [0] * 8, [1],
          [300], [63, 65, 0, 128, 129])


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("tile", (64, 128, 256))
def test_layout_puts_each_expert_on_whole_tiles(counts, tile):
    rows = sum(counts)
    tt = token_tiles(_offsets(counts), rows, tile)
    assert tt.capacity == capacity_tiles(rows, len(counts), tile) * tile
    pos = tt.positions.tolist()
    assert len(set(pos)) == rows, "two rows share a padded row"
    assert all(0 <= p < tt.capacity for p in pos)
    used = tt.table[0].item()
    assert used == sum(-(-c // tile) for c in counts)
    assert used <= tt.table.numel() - 1
    r = 0
    for e, c in enumerate(counts):
        if c:
            first = pos[r]
            assert first % tile == 0, f"expert {e} starts mid-tile"
            assert pos[r:r + c] == list(range(first, first + c)), f"expert {e}'s rows are not contiguous"
            for j in range(first // tile, (first + c - 1) // tile + 1):
                assert tt.table[1 + j].item() == e, f"token tile {j} names the wrong expert"
        r += c
    # tiles in use hold rows of their expert only, in expert order
    assert tt.table[1:1 + used].tolist() == sorted(tt.table[1:1 + used].tolist())


def test_capacity_holds_for_the_worst_routing():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        e = int(torch.randint(1, 300, (1,), generator=g))
        tile = (64, 128, 256)[int(torch.randint(0, 3, (1,), generator=g))]
        counts = torch.randint(0, 3 * tile, (e,), generator=g)
        counts[torch.rand(e, generator=g) < 0.5] = 0
        rows = int(counts.sum())
        tt = token_tiles(_offsets(counts.tolist()), rows, tile)
        assert tt.table[0].item() * tile <= tt.capacity


def test_dropped_rows_go_to_the_spare_row():
    # the routing kernel counts dropped ids in no expert: sorted rows past offsets[E]
    offsets = _offsets([2, 0, 3])
    tt = token_tiles(offsets, 7, 64)
    assert tt.positions[5:].tolist() == [tt.capacity, tt.capacity]
    assert tt.positions[:5].tolist() == [0, 1, 64, 65, 66]


def test_bad_offsets_are_refused():
    with pytest.raises(ValueError, match="int32"):
        token_tiles(torch.tensor([0, 3]), 3, 64)
    with pytest.raises(ValueError, match="tile"):
        token_tiles(_offsets([3]), 3, 0)


def test_combine_reads_a_padded_layout_through_inv():
    torch.manual_seed(0)
    t, topk, e, h = 37, 3, 5, 16
    ids = torch.randint(0, e, (t, topk))
    w = torch.softmax(torch.randn(t, topk), -1)
    r = route(ids, e)
    n = t * topk
    inv = torch.empty(n, dtype=torch.int32)
    inv.scatter_(0, r.order, torch.arange(n, dtype=torch.int32))
    y = torch.randn(n, h, dtype=torch.bfloat16)
    want = _combine_torch(y, r, w)                      # sorted rows through order
    tt = token_tiles(r.expert_offsets, n, 64)
    yp = torch.full((tt.capacity + 1, h), float("nan"), dtype=torch.bfloat16)
    yp[tt.positions] = y
    got = _combine_torch(yp, Routing(r.order, r.tokens, r.expert_offsets, tt.positions[inv.long()].int()), w)
    assert torch.equal(got, want)


def test_grouped_gemm_specs_cover_every_type_tile_and_epilogue():
    specs = catalog.grouped_gemm_specs()
    assert len(specs) == len(catalog.ALL_ACTS) * len(catalog.ALL_WEIGHTS) * len(catalog.GROUPED_GEMM_TILES) * 2
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        assert parse_name(s.name) == s
    assert set(specs) <= set(catalog.default_specs())


def test_grouped_gemm_source_names_the_grouped_scheduler():
    spec = GroupedGemmSpec(ActType.FP16, WeightType.S2, 128, 128, 64, Epilogue.SWIGLU)
    src = codegen.render(spec)
    assert "mixgemm::GroupedTokenTiles" in src
    assert '#include "mixgemm/grouped_scheduler.hpp"' in src
    assert '#include "mixgemm/epilogue_gated.hpp"' in src
    assert f"MIXGEMM_GROUPED_GEMM_ENTRY({spec.name}," in src
    dense = codegen.render(spec.dense)
    assert "GroupedTokenTiles" not in dense and "MIXGEMM_GROUPED_GEMM_ENTRY" not in dense


def test_grouped_gemm_spec_refuses_what_it_cannot_build():
    with pytest.raises(ValueError):
        GroupedGemmSpec(ActType.BF16, WeightType.U4, 64, 64, 64)       # cooperative needs 128 rows
    with pytest.raises(ValueError, match="bias"):
        GroupedGemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64, Epilogue.BIAS)


@pytest.mark.parametrize("rows,e,k,want", [(1, 8, 0, "gdecode"), (8 * 31, 8, 0, "gdecode"), (8 * 32, 8, 0, "t128x64x64"),
                                           (8 * 16, 8, 4096, "t128x64x64"), (8 * 15, 8, 4096, "gdecode"),
                                           (8 * 100, 8, 0, "t128x128x64"), (8 * 200, 8, 0, "t128x256x64"),
                                           (4096, 128, 0, "t128x64x64"), (3, 512, 0, "gdecode")])
def test_grouped_spec_by_rows_per_expert(rows, e, k, want):
    spec = moe.grouped_spec_for(rows, ActType.BF16, WeightType.U4, None, e, None, k)
    assert want in spec.name
    assert (spec.kind is KernelKind.GROUPED_GEMM) == want.startswith("t")



@pytest.mark.parametrize("tokens", (1, 16, 64, 256, 1024, 4096))
def test_fused_moe_runs_both_gemms_on_one_layout(tokens):
    # mixtral's experts at top-2: gate/up decides, down follows on the same token tiles
    plan = moe.plan_fused_moe(tokens * 2, ActType.BF16, WeightType.U4, 8, 4096, 14336)
    assert plan.kind == ("tiles" if tokens >= 64 else "each")
    if plan.kind == "tiles":
        assert plan.gate_up.tile_n == plan.down.tile_n
        assert (plan.gate_up.epilogue, plan.down.epilogue) == (Epilogue.SWIGLU, Epilogue.BIAS_ACT)
    else:
        assert {s.kind for s in plan.specs} == {KernelKind.GROUPED_DECODE}


def test_fused_moe_splits_hot_experts_between_the_thresholds():
    # qwen3's experts at top-8: 256 tokens are 16 rows per expert on average
    plan = moe.plan_fused_moe(256 * 8, ActType.BF16, WeightType.U4, 128, 2048, 768)
    assert plan.kind == "split" and plan.hot_from == moe.TILES_FROM_ROWS
    assert [s.kind for s in plan.specs] == [KernelKind.GROUPED_DECODE] * 2 + [KernelKind.GROUPED_GEMM] * 2
    assert plan.hot_gate_up.epilogue is Epilogue.SWIGLU and plan.hot_down.epilogue is Epilogue.BIAS_ACT
    assert moe.plan_fused_moe(64 * 8, ActType.BF16, WeightType.U4, 128, 2048, 768).kind == "each"


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("hot_from", (1, 32, 100, 10 ** 6))
def test_split_layout_sends_each_expert_to_one_kernel(counts, hot_from):
    from mixgemm.moe.tiles import split_layout

    rows, tile = sum(counts), 64
    lay = split_layout(_offsets(counts), rows, tile, hot_from)
    pos = lay.tiles.positions.tolist()
    assert len(set(pos)) == rows and all(0 <= p < rows + lay.tiles.capacity for p in pos)
    cold = lay.cold_offsets.tolist()
    assert cold[0] == 0 and cold == sorted(cold)
    used = lay.tiles.table[0].item()
    assert used == sum(-(-c // tile) for c in counts if c >= hot_from)
    r = 0
    for e, c in enumerate(counts):
        mine = pos[r:r + c]
        if c >= hot_from:                           # hot: whole token tiles past the cold rows
            assert cold[e + 1] == cold[e]
            assert mine == list(range(mine[0], mine[0] + c)) and (mine[0] - rows) % tile == 0
            for j in range((mine[0] - rows) // tile, (mine[-1] - rows) // tile + 1):
                assert lay.tiles.table[1 + j].item() == e
        else:                                       # cold: its rows of the decode kernel's offsets
            assert mine == list(range(cold[e], cold[e + 1]))
        r += c


def test_split_layout_sends_dropped_rows_to_the_spare_row():
    from mixgemm.moe.tiles import split_layout

    lay = split_layout(_offsets([2, 40, 1]), 45, 64, 32)
    spare = 45 + lay.tiles.capacity
    assert lay.tiles.positions[43:].tolist() == [spare, spare]


def test_layout_of_no_rows_sends_the_inverse_nowhere():
    tt = token_tiles(_offsets([0, 0]), 0, 64, torch.full((5,), -1, dtype=torch.int32))
    assert tt.positions.numel() == 0 and tt.inv.tolist() == [-1] * 5 and tt.table.tolist() == [0]
