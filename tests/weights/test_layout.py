"""prepack / unpack: exact round trips, the documented bit layout, and input validation."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixgemm.weights.layout as layout
from mixgemm.dtypes import WeightType
from mixgemm.weights.layout import prepack, unpack
from mixgemm.weights.types import LAYOUT_VERSION, PackedWeight, QuantizedWeight
from random_weights import random_qw

BITS = (8, 4, 2)
DTYPES = (torch.bfloat16, torch.float16)


def assert_same_qw(a: QuantizedWeight, b: QuantizedWeight):
    assert a.qweight.dtype == b.qweight.dtype
    assert torch.equal(a.qweight, b.qweight)
    assert a.scales.dtype == b.scales.dtype and torch.equal(a.scales, b.scales)
    if a.zeros is None:
        assert b.zeros is None
    else:
        assert a.zeros.dtype == b.zeros.dtype and torch.equal(a.zeros, b.zeros)
    assert (a.bits, a.group_size, a.symmetric) == (b.bits, b.group_size, b.symmetric)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, "K"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits", BITS)
def test_round_trip_every_type(bits, symmetric, group_size, dtype):
    n, k = 48, 512
    gs = k if group_size == "K" else group_size
    qw = random_qw(n, k, bits, symmetric, gs, dtype, seed=bits * 7 + gs)
    packed = prepack(qw)
    assert packed.qdata.dtype == torch.uint8
    assert tuple(packed.qdata.shape) == (n // 16, k // 64, 128 * bits)
    assert packed.weight_type == WeightType.of(bits, symmetric)
    assert (packed.n, packed.k, packed.group_size) == (n, k, gs)
    assert packed.arch == "sm90a" and packed.layout_version == LAYOUT_VERSION
    assert torch.equal(packed.scales, qw.scales.t())  # transposed to [G, N]
    if not symmetric:
        assert torch.equal(packed.zeros, qw.zeros.t())
    assert packed.nbytes == n * k * bits // 8 + qw.scales.numel() * 2 * (1 if symmetric else 2)
    assert_same_qw(unpack(packed), qw)


@settings(max_examples=40, deadline=None)
@given(
    na=st.integers(1, 5),
    ka=st.integers(1, 8),
    bits=st.sampled_from(BITS),
    symmetric=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    group_choice=st.integers(0, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_random_shapes(na, ka, bits, symmetric, dtype, group_choice, seed):
    n, k = 16 * na, 64 * ka
    sizes = [g for g in (32, 64, 128, 256) if k % g == 0] + [k]
    gs = sizes[group_choice % len(sizes)]
    qw = random_qw(n, k, bits, symmetric, gs, dtype, seed)
    assert_same_qw(unpack(prepack(qw)), qw)


def test_chunked_prepack_matches_unchunked(monkeypatch):
    qw = random_qw(96, 256, 4, False, 64, seed=3)
    whole = prepack(qw)
    monkeypatch.setattr(layout, "_CHUNK_CODES", 16 * 256 * 2)  # two atom rows per chunk
    chunked = prepack(qw)
    assert torch.equal(whole.qdata, chunked.qdata)
    assert_same_qw(unpack(chunked), qw)


def test_non_contiguous_codes():
    qw = random_qw(64, 128, 4, True, 128, seed=5)
    q_t = qw.qweight.t().contiguous().t()  # same values, column-major strides
    assert not q_t.is_contiguous()
    qw_t = QuantizedWeight(q_t, qw.scales, None, 4, 128, True)
    assert torch.equal(prepack(qw_t).qdata, prepack(qw).qdata)


# --------------------------------------------------------------- the documented bit layout


def documented_location(n, k, bits):
    """(na, ka, byte, bit-in-byte) of code (n, k), straight from the layout.py docstring."""
    na, ka = n // 16, k // 64
    r, c = n % 16, k % 64
    lane = 4 * (r % 8) + (c % 8) // 2
    value = 8 * (c // 16) + (c % 2) + 2 * (r // 8) + 4 * ((c % 16) // 8)
    per_word = 32 // bits
    word, slot = value // per_word, value % per_word
    bit = 32 * word + 16 * (slot % 2) + bits * (slot // 2)
    return na, ka, 4 * bits * lane + bit // 8, bit % 8


@pytest.mark.parametrize("bits,symmetric", list(itertools.product(BITS, [False, True])))
def test_every_element_at_documented_bits(bits, symmetric):
    n, k = 32, 128
    qw = random_qw(n, k, bits, symmetric, 64, seed=11 + bits)
    qdata = prepack(qw).qdata.tolist()
    codes = qw.qweight.tolist()
    mask = (1 << bits) - 1
    used = set()
    for i in range(n):
        for j in range(k):
            na, ka, byte, pos = documented_location(i, j, bits)
            stored = (qdata[na][ka][byte] >> pos) & mask
            assert stored == codes[i][j] & mask, (i, j)  # low b bits, two's complement
            for b in range(bits):
                used.add((na, ka, byte, pos + b))
    assert len(used) == n * k * bits  # a bijection: every bit of qdata holds exactly one code bit


def test_lane_value_map_matches_the_wgmma_fragment_table():
    # PTX's register fragment of A for wgmma m64nNk16 (16-bit types), per warp and k16 block:
    # value i of lane l = 4g + t holds (row, col) below.
    table = lambda g, t: [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
                          (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]
    seen = set()
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for v in range(32):
            row, col = table(g, t)[v % 8]
            r, c = torch.tensor(row), torch.tensor(16 * (v // 8) + col)
            got_lane, got_value = layout.lane_value_of(r, c)
            assert (int(got_lane), int(got_value)) == (lane, v)
            seen.add((row, 16 * (v // 8) + col))
    assert len(seen) == 16 * 64


@pytest.mark.parametrize("bits,order", [(4, [0, 2, 4, 6, 1, 3, 5, 7]), (8, [0, 2, 1, 3]),
                                        (2, [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15])])
def test_documented_field_order_in_a_word(bits, order):
    # field j of a 32-bit word (bits b*j .. b*j+b-1) holds fragment value order[j]
    fields = [int(layout.bit_of(torch.tensor(v), bits)) // bits for v in range(32 // bits)]
    assert [fields.index(j) for j in range(32 // bits)] == order


@pytest.mark.parametrize("bits", BITS)
def test_shift_and_mask_yield_consecutive_value_pairs(bits):
    """The docstring's claim: (word >> b*j) & ((2^b-1) * 0x00010001) = values (2j, 2j+1)."""
    mask = (1 << bits) - 1
    # Code of each element = its fragment value, so the packed words reveal the value order.
    r = torch.arange(16).repeat_interleave(64)
    c = torch.arange(64).repeat(16)
    _, value = layout.lane_value_of(r, c)
    codes = (value % (1 << bits)).view(16, 64).to(torch.uint8)
    qw = QuantizedWeight(codes, torch.ones(16, 1, dtype=torch.bfloat16),
                         torch.zeros(16, 1, dtype=torch.bfloat16), bits, 64, False)
    atom = prepack(qw).qdata[0, 0]
    words = atom.view(32, bits, 4).to(torch.int64)  # [lane, word, byte]
    words = (words * torch.tensor([1, 1 << 8, 1 << 16, 1 << 24])).sum(-1)  # little endian
    per_word = 32 // bits
    for w in range(bits):
        for j in range(per_word // 2):
            pair = (words[:, w] >> (bits * j)) & (mask * 0x00010001)
            lo, hi = pair & 0xFFFF, pair >> 16
            v = w * per_word + 2 * j
            assert torch.all(lo == v % (1 << bits)) and torch.all(hi == (v + 1) % (1 << bits))


# ------------------------------------------------------------------------------ bad input


def test_prepack_rejects_bad_input():
    with pytest.raises(TypeError, match="QuantizedWeight"):
        prepack(torch.zeros(16, 64, dtype=torch.uint8))
    qw = random_qw(16, 64, 4, False, 64)
    with pytest.raises(ValueError, match="arch"):
        prepack(qw, arch="sm80")
    with pytest.raises(ValueError, match="N % 16"):
        prepack(random_qw(24, 64, 4, False, 64))
    with pytest.raises(ValueError, match="K % 64"):
        prepack(random_qw(16, 96, 4, False, 32))


def test_unpack_rejects_bad_input():
    with pytest.raises(TypeError, match="PackedWeight"):
        unpack(random_qw(16, 64, 4, False, 64))


def test_packed_weight_validation():
    packed = prepack(random_qw(32, 128, 4, False, 64))
    fields = dict(qdata=packed.qdata, scales=packed.scales, zeros=packed.zeros,
                  weight_type=packed.weight_type, group_size=64, n=32, k=128)
    PackedWeight(**fields)  # valid
    with pytest.raises(ValueError, match="qdata"):
        PackedWeight(**{**fields, "qdata": packed.qdata[:, :, :-1]})
    with pytest.raises(ValueError, match="layout version"):
        PackedWeight(**fields, layout_version=LAYOUT_VERSION + 1)
    with pytest.raises(ValueError, match="arch"):
        PackedWeight(**fields, arch="sm100a")
    with pytest.raises(ValueError, match="zeros"):
        PackedWeight(**{**fields, "zeros": None})
    with pytest.raises(ValueError, match="scales"):
        PackedWeight(**{**fields, "scales": packed.scales.t().contiguous()})


def test_quantized_weight_validation():
    q = torch.zeros(16, 64, dtype=torch.uint8)
    s = torch.ones(16, 1, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="int8"):
        QuantizedWeight(q, s, None, 4, 64, True)  # symmetric codes must be int8
    with pytest.raises(ValueError, match="zeros"):
        QuantizedWeight(q, s, None, 4, 64, False)
    with pytest.raises(ValueError, match="group_size"):
        QuantizedWeight(q, s, s, 4, 48, False)
    with pytest.raises(ValueError, match="bits"):
        QuantizedWeight(q, s, s, 3, 64, False)
