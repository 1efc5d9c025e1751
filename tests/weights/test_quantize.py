"""quantize / dequantize_reference: the documented formulas, the error bound, bad input.

The reference below recomputes the documented formulas independently, in numpy float64,
with "round up to the dtype" done by a binary search over the sorted table of every positive
finite bf16/fp16 value.
"""
import importlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixgemm.weights.layout import prepack
from mixgemm.weights.quantize import dequantize_reference, quantize, round_up_to_dtype
from mixgemm.weights.types import QuantizedWeight

# `mixgemm.quantize` the attribute is the function (re-exported by the package): get the module.
mq = importlib.import_module("mixgemm.weights.quantize")

BITS = (8, 4, 2)
DTYPES = (torch.bfloat16, torch.float16)
GROUPS = (32, 64, 128, 256, "K")


def positive_values(dtype):
    """Every finite value >= 0 of dtype, sorted, as float64 (bit patterns 0 .. max)."""
    patterns = torch.arange(0, 0x7F80 if dtype == torch.bfloat16 else 0x7C00, dtype=torch.int32)
    return patterns.to(torch.int16).view(dtype).double().numpy()


TABLES = {dtype: positive_values(dtype) for dtype in DTYPES}


def ceil_to(x, dtype):
    table = TABLES[dtype]
    idx = np.searchsorted(table, x, side="left")
    assert np.all(idx < len(table)), "overflow in the reference"
    return table[idx]


def half_ulp(x, dtype):
    """Half the spacing of dtype just above |x| (x representable in dtype)."""
    table = TABLES[dtype]
    idx = np.searchsorted(table, np.abs(x), side="left")
    return (table[np.minimum(idx + 1, len(table) - 1)] - table[idx]) / 2


def reference(w64, bits, group_size, symmetric, dtype):
    """The module docstring's formulas in float64: returns (q, s_r, z or None)."""
    n, k = w64.shape
    wg = w64.reshape(n, k // group_size, group_size)
    levels = 2**bits - 1
    if symmetric:
        s = 2 * np.abs(wg).max(-1) / levels
    else:
        xmin = np.minimum(wg.min(-1), 0)
        xmax = np.maximum(wg.max(-1), 0)
        s = (xmax - xmin) / levels
    s = np.where(s == 0, 1.0, s)
    s_r = ceil_to(s, dtype)
    if symmetric:
        q = np.clip(np.rint(wg / s_r[..., None]), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        return q.reshape(n, k), s_r, None
    z = np.clip(np.rint(-xmin / s_r), 0, levels)
    q = np.clip(np.rint(wg / s_r[..., None]) + z[..., None], 0, levels)
    return q.reshape(n, k), s_r, z


def make_weight(n=32, k=512, seed=0, dtype=torch.float32):
    """Gaussian weights with outliers, an all-zero group, constant groups of both signs, an
    all-positive and an all-negative group, and tiny values."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.05
    w[3, 5] = 1.5
    w[4, 100] = -2.0
    w[5, :32] = 0.0
    w[6, :32] = 0.3
    w[7, :32] = -0.7
    w[8, :32] = w[8, :32].abs() + 0.01
    w[9, :32] = -w[9, :32].abs() - 0.01
    w[10, :64] *= 1e-4
    return w.to(dtype)


def check_against_reference(w, qw, bits, gs, symmetric, dtype):
    w64 = w.double().numpy()
    q_ref, s_ref, z_ref = reference(w64, bits, gs, symmetric, dtype)
    assert qw.qweight.dtype == (torch.int8 if symmetric else torch.uint8)
    assert qw.scales.dtype == dtype
    np.testing.assert_array_equal(qw.scales.double().numpy(), s_ref)
    if symmetric:
        assert qw.zeros is None
    else:
        assert qw.zeros.dtype == dtype
        np.testing.assert_array_equal(qw.zeros.double().numpy(), z_ref)
    np.testing.assert_array_equal(qw.qweight.numpy().astype(np.float64), q_ref)


def check_error_bound(w, qw, dtype):
    """|w - deq| <= s/2 + ulp(deq)/2 for every element, and codes in range."""
    wt = qw.weight_type
    assert int(qw.qweight.min()) >= wt.qmin and int(qw.qweight.max()) <= wt.qmax
    deq = dequantize_reference(qw).double().numpy()
    s = qw.scales.double().repeat_interleave(qw.group_size, dim=1).numpy()
    err = np.abs(w.double().numpy() - deq)
    bound = s / 2 + half_ulp(deq, dtype)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)}"


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits", BITS)
def test_formulas_and_error_bound(bits, symmetric, group_size, dtype, in_dtype):
    w = make_weight(dtype=in_dtype, seed=bits)
    gs = w.shape[1] if group_size == "K" else group_size
    qw = quantize(w, bits, gs, symmetric=symmetric, dtype=dtype)
    assert qw.group_size == gs and qw.bits == bits and qw.symmetric == symmetric
    check_against_reference(w, qw, bits, gs, symmetric, dtype)
    check_error_bound(w, qw, dtype)


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.float64])
def test_other_input_dtypes(in_dtype):
    w = make_weight(dtype=in_dtype, seed=7)
    for symmetric in (False, True):
        qw = quantize(w, 4, 64, symmetric=symmetric)
        assert qw.dtype == (torch.float16 if in_dtype == torch.float16 else torch.bfloat16)
        check_against_reference(w, qw, 4, 64, symmetric, qw.dtype)
        check_error_bound(w, qw, qw.dtype)


def test_ties_and_near_ties():
    # scale exactly s = 1.5 * 2^-7 (w in [0, 255 s]); values at and next to .5 ties of w / s
    s = 1.5 * 2**-7
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)
    w = torch.full((1, 64), 3 * s, dtype=torch.float32)
    w[0, 0] = 255 * s
    w[0, 1] = 100.5 * s  # exact tie -> even code 100
    w[0, 2] = 101.5 * s  # exact tie -> even code 102
    w[0, 3] = torch.nextafter(f32(100.5 * s), f32(10.0))  # just above a tie -> 101
    w[0, 4] = torch.nextafter(f32(101.5 * s), f32(0.0))  # just below a tie -> 101
    for in_dtype in (torch.float32, torch.float64):
        qw = quantize(w.to(in_dtype), 8, 64, dtype=torch.bfloat16)
        assert float(qw.scales[0, 0]) == s and float(qw.zeros[0, 0]) == 0
        assert qw.qweight[0, :5].tolist() == [255, 100, 102, 101, 101]


def test_zero_and_constant_groups():
    w = torch.zeros(16, 128)
    w[1, 64:] = 0.3
    w[2, 64:] = -0.7
    for bits in BITS:
        asym = quantize(w, bits, 64)
        sym = quantize(w, bits, 64, symmetric=True)
        # all-zero group: s = 1, z = 0, q = 0, and it dequantizes to exactly 0
        assert float(asym.scales[0, 0]) == 1 and float(asym.zeros[0, 0]) == 0
        assert int(asym.qweight[0].max()) == 0 and float(sym.scales[0, 0]) == 1
        assert int(sym.qweight[0].abs().max()) == 0
        for qw in (asym, sym):
            deq = dequantize_reference(qw)
            assert torch.all(deq[0] == 0) and torch.all(deq[1, :64] == 0)
            check_error_bound(w, qw, torch.bfloat16)
        # a constant positive group sits at the top of its grid, a negative one at the bottom
        assert int(asym.zeros[1, 1]) == 0
        assert int(asym.qweight[2, 64:].max()) == 0


def test_scales_round_up_and_cover_the_group():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen)
    for dtype in DTYPES:
        qw = quantize(w, 4, 32, dtype=dtype)
        wg = w.double().view(64, 8, 32)
        s = (wg.amax(-1).clamp(min=0) - wg.amin(-1).clamp(max=0)) / 15
        s_r = qw.scales.double()
        assert torch.all(s_r >= s)  # rounded up...
        prev = (qw.scales.view(torch.int16) - 1).view(dtype).double()
        assert torch.all(prev < s)  # ...to the nearest representable value
        assert torch.any(s_r > s)


def test_chunking_does_not_change_the_result(monkeypatch):
    w = make_weight(n=48, k=256, seed=3)
    whole = quantize(w, 4, 32)
    monkeypatch.setattr(mq, "_CHUNK_ELEMS", 256 * 5)  # 5 rows per chunk, ragged last chunk
    chunked = quantize(w, 4, 32)
    assert torch.equal(whole.qweight, chunked.qweight)
    assert torch.equal(whole.scales, chunked.scales) and torch.equal(whole.zeros, chunked.zeros)


def test_non_contiguous_input():
    w = make_weight(n=64, k=128, seed=4)
    w_t = w.t().contiguous().t()
    assert not w_t.is_contiguous()
    a, b = quantize(w, 4, 64), quantize(w_t, 4, 64)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 24),
    groups=st.integers(1, 4),
    group_size=st.sampled_from([32, 64, 128, 256]),
    bits=st.sampled_from(BITS),
    symmetric=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    magnitude=st.sampled_from([1e-6, 1e-3, 0.05, 1.0, 300.0]),
    offset=st.floats(-2, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_error_bound_random(n, groups, group_size, bits, symmetric, dtype, magnitude, offset, seed):
    k = groups * group_size
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) + offset) * magnitude
    qw = quantize(w, bits, group_size, symmetric=symmetric, dtype=dtype)
    check_error_bound(w, qw, dtype)
    check_against_reference(w, qw, bits, group_size, symmetric, dtype)


# --------------------------------------------------------------------- dequantize_reference


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_reference_is_one_rounding_of_the_exact_product(bits, symmetric, dtype):
    qw = quantize(make_weight(seed=bits + 10), bits, 64, symmetric=symmetric, dtype=dtype)
    q = qw.qweight.double()
    s = qw.scales.double().repeat_interleave(64, dim=1)
    exact = q * s if symmetric else (q - qw.zeros.double().repeat_interleave(64, dim=1)) * s
    want = exact.to(dtype)  # exact in float64 (<= 19 significant bits), rounded once
    for source in (qw, prepack(qw)):
        got = dequantize_reference(source)
        assert got.dtype == dtype and got.shape == (32, 512)
        assert torch.equal(got, want)


def test_dequantize_reference_dtype_override():
    qw = quantize(make_weight(seed=2), 4, 128, dtype=torch.bfloat16)
    got = dequantize_reference(qw, dtype=torch.float16)
    q = qw.qweight.double() - qw.zeros.double().repeat_interleave(128, dim=1)
    want = (q * qw.scales.to(torch.float16).double().repeat_interleave(128, dim=1)).to(torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, want)


def test_dequantize_reference_rejects_bad_input():
    with pytest.raises(TypeError, match="QuantizedWeight"):
        dequantize_reference(torch.zeros(16, 64))
    s = torch.ones(16, 1, dtype=torch.bfloat16)
    q = torch.full((16, 64), 16, dtype=torch.uint8)  # 16 does not fit in 4 bits
    with pytest.raises(ValueError, match="out of range"):
        dequantize_reference(QuantizedWeight(q, s, torch.zeros_like(s), 4, 64, False))
    q = torch.full((16, 64), 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="zeros"):
        dequantize_reference(QuantizedWeight(q, s, torch.full_like(s, 2.5), 4, 64, False))
    with pytest.raises(ValueError, match="out of range"):
        dequantize_reference(QuantizedWeight(q.to(torch.int8) - 12, s, None, 4, 64, True))


# ------------------------------------------------------------------------------- bad input


def test_quantize_rejects_bad_input():
    w = torch.randn(16, 128)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize(w.numpy(), 4, 64)
    with pytest.raises(ValueError, match="2-D"):
        quantize(w[0], 4, 64)
    with pytest.raises(ValueError, match="2-D"):
        quantize(w.view(2, 8, 128), 4, 64)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(w.to(torch.int32), 4, 64)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(w.to(torch.complex64), 4, 64)
    for bits in (3, 16, True, 4.0, "4"):
        with pytest.raises(ValueError, match="bits"):
            quantize(w, bits, 64)
    with pytest.raises(ValueError, match="group_size"):
        quantize(w, 4, 48)
    with pytest.raises(ValueError, match="not divisible"):
        quantize(torch.randn(16, 96), 4, 64)
    with pytest.raises(TypeError, match="group_size"):
        quantize(w, 4, 64.0)
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.randn(0, 128), 4, 64)
    with pytest.raises(TypeError, match="symmetric"):
        quantize(w, 4, 64, symmetric="yes")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        quantize(w, 4, 64, dtype=torch.float32)
    for bad in (float("nan"), float("inf"), -float("inf")):
        w2 = w.clone()
        w2[3, 7] = bad
        with pytest.raises(ValueError, match=r"non-finite.*w\[3, 7\]"):
            quantize(w2, 4, 64)


def test_fp16_overflow_is_refused_and_bf16_works():
    w = torch.zeros(16, 64)
    w[0, 0] = 65504.0  # 2-bit grid step 21840 in fp16: the top code dequantizes to 65520 -> inf
    with pytest.raises(ValueError, match="overflow.*bfloat16"):
        quantize(w, 2, 64, dtype=torch.float16)
    qw = quantize(w, 2, 64, dtype=torch.bfloat16)
    check_error_bound(w, qw, torch.bfloat16)
    with pytest.raises(ValueError, match="overflow"):
        quantize(torch.full((16, 64), 1e6), 4, 64, symmetric=True, dtype=torch.float16)


def test_round_up_to_dtype():
    x = torch.tensor([0.0, 1.0, 1.0 + 2**-20, 3e38, 65504.0, 65505.0], dtype=torch.float64)
    bf = round_up_to_dtype(x, torch.bfloat16).double().tolist()
    assert bf[:3] == [0.0, 1.0, 1.0 + 2**-7]
    assert bf[3] >= 3e38 and bf[3] != float("inf")
    fp = round_up_to_dtype(x, torch.float16).double().tolist()
    assert fp[:3] == [0.0, 1.0, 1.0 + 2**-10]
    assert fp[3] == float("inf") and fp[4] == 65504.0 and fp[5] == float("inf")
    with pytest.raises(TypeError):
        round_up_to_dtype(x, torch.float32)


@pytest.mark.gpu
def test_cuda_matches_cpu(requires_gpu):
    w = make_weight(seed=5)
    for bits in BITS:
        for symmetric in (False, True):
            cpu = quantize(w, bits, 64, symmetric=symmetric)
            gpu = quantize(w.to(requires_gpu), bits, 64, symmetric=symmetric)
            assert gpu.device.type == "cuda"
            gpu = gpu.to("cpu")
            assert torch.equal(cpu.qweight, gpu.qweight) and torch.equal(cpu.scales, gpu.scales)
            if not symmetric:
                assert torch.equal(cpu.zeros, gpu.zeros)
            assert torch.equal(dequantize_reference(cpu),
                               dequantize_reference(prepack(gpu.to(requires_gpu))).cpu())


@pytest.mark.parametrize("stripe", (8, 16))
def test_interleave_rows_and_its_inverse(stripe):
    """interleave_rows alternates stripes of a and b; deinterleave_rows is its exact inverse."""
    from mixgemm.weights.quantize import deinterleave_rows, interleave_rows

    a = torch.arange(48 * 3).reshape(48, 3)
    b = -a - 1
    t = interleave_rows(a, b, stripe)
    assert t.shape == (96, 3)
    assert torch.equal(t[:stripe], a[:stripe]) and torch.equal(t[stripe:2 * stripe], b[:stripe])
    assert torch.equal(t[2 * stripe:3 * stripe], a[stripe:2 * stripe])
    back_a, back_b = deinterleave_rows(t, stripe)
    assert torch.equal(back_a, a) and torch.equal(back_b, b)
    with pytest.raises(ValueError, match="multiple"):
        interleave_rows(a[:44], b[:44], stripe if stripe == 16 else 24)
