"""PackedWeight.shard: tensor-parallel slices of a packed weight, on the CPU.

A shard must equal, tensor for tensor, ``prepack`` of the same slice of the logical weight (no
re-quantization, nothing else changed), for every weight type, both dimensions, zero points and
zero offsets; and the sharded products must add up (row parallel) or concatenate (column
parallel) to the whole product.
"""
import itertools

import pytest
import torch

from mixgemm.weights.layout import prepack, unpack
from mixgemm.weights.types import shard
from mixgemm.weights.quantize import dequantize_reference, interleave_gate_up
from mixgemm.dtypes import WeightType
from mixgemm.weights.types import PackedWeight, QuantizedWeight

from random_weights import random_qw

TYPES = list(itertools.product((8, 4, 2), (False, True)))
TYPE_IDS = [f"{'s' if s else 'u'}{b}" for b, s in TYPES]


def with_offsets(qw: QuantizedWeight, seed: int) -> QuantizedWeight:
    """``qw`` with float32 zero offsets (an HQQ-style import)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.randn(qw.scales.shape, generator=gen) * 1e-3
    return QuantizedWeight(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group_size, qw.symmetric, offsets)


def qw_slice(qw: QuantizedWeight, dim: int, lo: int, hi: int) -> QuantizedWeight:
    """The logical weight's rows (dim 0) or columns (dim 1) ``lo .. hi``."""
    def rows(t):
        return None if t is None else t[lo:hi].contiguous()

    if dim == 0:
        return QuantizedWeight(rows(qw.qweight), rows(qw.scales), rows(qw.zeros), qw.bits, qw.group_size,
                               qw.symmetric, rows(qw.zero_offsets))
    per_channel = qw.group_size == qw.k
    g0, g1 = (0, 1) if per_channel else (lo // qw.group_size, hi // qw.group_size)

    def groups(t):
        return None if t is None else t[:, g0:g1].contiguous()

    return QuantizedWeight(qw.qweight[:, lo:hi].contiguous(), groups(qw.scales), groups(qw.zeros), qw.bits,
                           hi - lo if per_channel else qw.group_size, qw.symmetric, groups(qw.zero_offsets))


def assert_same_packed(a: PackedWeight, b: PackedWeight):
    assert (a.weight_type, a.group_size, a.n, a.k, a.arch, a.layout_version) == \
        (b.weight_type, b.group_size, b.n, b.k, b.arch, b.layout_version)
    for name in ("qdata", "scales", "zeros", "zero_offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.is_contiguous() and torch.equal(x, y), name


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("group", [64, 128, "K"])
@pytest.mark.parametrize("bits,symmetric", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_equals_prepack_of_the_slice(dim, bits, symmetric, group, world_size):
    n, k = 128, 1024
    gs = k if group == "K" else group
    qw = random_qw(n, k, bits, symmetric, gs, seed=bits * 31 + gs + dim)
    if not symmetric:
        qw = with_offsets(qw, seed=gs)
    packed = prepack(qw)
    size = (n if dim == 0 else k) // world_size
    for rank in range(world_size):
        got = packed.shard(dim, rank, world_size)
        want = qw_slice(qw, dim, rank * size, (rank + 1) * size)
        assert_same_packed(got, prepack(want))
        # and back: shard, then unpack, is the slice
        back = unpack(got)
        assert torch.equal(back.qweight, want.qweight) and torch.equal(back.scales, want.scales)
        assert back.group_size == want.group_size
        # the logical weight's shard (what the importers take) is the same slice
        logical = qw.shard(dim, rank, world_size)
        assert logical.group_size == want.group_size
        for name in ("qweight", "scales", "zeros", "zero_offsets"):
            a, b = getattr(logical, name), getattr(want, name)
            assert (a is None) == (b is None) and (a is None or (a.is_contiguous() and torch.equal(a, b))), name
        assert_same_packed(prepack(logical), got)


def test_shards_own_their_memory():
    packed = prepack(random_qw(64, 256, 4, False, 64))
    for dim in (0, 1):
        s = packed.shard(dim, 1, 2)
        for name in ("qdata", "scales", "zeros"):
            whole, part = getattr(packed, name), getattr(s, name)
            assert part.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr(), (dim, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharded_products_add_up(dtype):
    """Row parallel: the partial products of the K shards sum to the whole product; column
    parallel: the N shards' outputs concatenate to it (float64 arithmetic on the exact
    dequantized weights)."""
    n, k, world = 96, 768, 3
    qw = with_offsets(random_qw(n, k, 4, False, 128, dtype, seed=7), seed=3)
    packed = prepack(qw)
    x = torch.randn(5, k, dtype=torch.float64)
    whole = x @ dequantize_reference(packed).double().T
    partial = sum(x[:, r * k // world:(r + 1) * k // world] @ dequantize_reference(packed.shard(1, r, world)).double().T
                  for r in range(world))
    torch.testing.assert_close(partial, whole, rtol=1e-12, atol=1e-12)
    gathered = torch.cat([x @ dequantize_reference(packed.shard(0, r, 2)).double().T for r in range(2)], dim=-1)
    torch.testing.assert_close(gathered, whole, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_swiglu_shard_keeps_gate_up_pairs(world_size):
    """An N shard of a gate/up interleaved weight is the interleaved weight of the gate's and
    the up projection's own shards: each 16-row atom holds 8 gate and 8 up rows."""
    inter, k = 256, 256
    gate = random_qw(inter, k, 4, False, 64, seed=1)
    up = random_qw(inter, k, 4, False, 64, seed=2)
    fused = prepack(interleave_gate_up(gate, up))
    part = inter // world_size
    for rank in range(world_size):
        want = interleave_gate_up(qw_slice(gate, 0, rank * part, (rank + 1) * part),
                                  qw_slice(up, 0, rank * part, (rank + 1) * part))
        assert_same_packed(fused.shard(0, rank, world_size), prepack(want))


def test_sections_shard_each_section():
    """A fused q/k/v weight: each section is sliced on its own, the rank's slices stacked."""
    q_rows, kv_rows, k = 128, 32, 256
    qw = random_qw(q_rows + 2 * kv_rows, k, 4, True, 128, seed=9)
    packed = prepack(qw)
    bounds = [(0, q_rows), (q_rows, q_rows + kv_rows), (q_rows + kv_rows, q_rows + 2 * kv_rows)]
    for rank in range(2):
        parts = [qw_slice(qw, 0, lo + rank * (hi - lo) // 2, lo + (rank + 1) * (hi - lo) // 2) for lo, hi in bounds]
        want = QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), None,
                               4, 128, True)
        assert_same_packed(packed.shard(0, rank, 2, sections=(q_rows, kv_rows, kv_rows)), prepack(want))


def test_world_size_one_is_a_copy():
    packed = prepack(random_qw(32, 128, 2, False, 32))
    for dim in (0, 1):
        assert_same_packed(packed.shard(dim, 0, 1), packed)


@pytest.mark.parametrize("call,error,match", [
    (lambda p: p.shard(0, 0, 3), ValueError, "whole 16-row atoms"),          # N=64 / 3
    (lambda p: p.shard(0, 0, 8), ValueError, "multiple of 16"),              # 64 / 8 = 8 rows
    (lambda p: p.shard(1, 0, 8), ValueError, "64-column atoms"),             # K=256 / 8 = 32
    (lambda p: p.shard(2, 0, 2), ValueError, "dim must be 0"),
    (lambda p: p.shard(0, 2, 2), ValueError, "rank < world_size"),
    (lambda p: p.shard(0, -1, 2), ValueError, "rank < world_size"),
    (lambda p: p.shard(0, 0, 0), ValueError, "rank < world_size"),
    (lambda p: p.shard(0, 0, 2.0), TypeError, "world_size must be an int"),
    (lambda p: p.shard(1, 0, 2, sections=(32, 32)), ValueError, "need dim=0"),
    (lambda p: p.shard(0, 0, 2, sections=(32, 16)), ValueError, "summing to N=64"),
    (lambda p: p.shard(0, 0, 2, sections=(48, 16)), ValueError, "section of 48 rows"),
    (lambda p: shard(torch.zeros(4), 0, 0, 2), TypeError, "PackedWeight"),
])
def test_bad_shards_are_refused(call, error, match):
    packed = prepack(random_qw(64, 256, 4, False, 64))
    with pytest.raises(error, match=match):
        call(packed)


def test_k_shard_needs_whole_groups():
    qw = random_qw(32, 768, 4, False, 256)
    packed = prepack(qw)
    for weight in (packed, qw):        # the packed and the logical weight follow one rule
        with pytest.raises(ValueError, match="whole groups of 256"):
            weight.shard(1, 0, 2)          # 384 columns: whole atoms, not whole groups
        assert weight.shard(1, 0, 3).k == 256
    with pytest.raises(ValueError, match="whole 16-row atoms"):
        qw.shard(0, 0, 4)              # 8 rows
    with pytest.raises(ValueError, match="64-column atoms"):
        random_qw(32, 128, 4, False, 32).shard(1, 0, 4)     # 32 columns


def test_logical_sections_match_the_packed_ones():
    qw = random_qw(128 + 2 * 32, 256, 4, False, 64, seed=4)
    for rank in range(2):
        got = qw.shard(0, rank, 2, sections=(128, 32, 32))
        assert_same_packed(prepack(got), prepack(qw).shard(0, rank, 2, sections=(128, 32, 32)))


def test_shard_of_a_symmetric_type_has_no_zeros():
    packed = prepack(random_qw(32, 128, 8, True, 64))
    assert packed.weight_type is WeightType.S8
    assert all(packed.shard(d, 0, 2).zeros is None for d in (0, 1))
