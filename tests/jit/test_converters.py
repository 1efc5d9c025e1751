"""Exhaustive, bit-exact checks of the C++ converters (converters/mixgemm) on the host.

The converters are compiled for the CPU from the very headers the kernels include
(tests/cpp/converter_check.cpp drives them), fed lane chunks in the prepacked layout, and their
output is compared bit for bit with an independent Python decode of the same bits: the bit
positions come from mixgemm.weights.layout, the arithmetic from torch (``(q - z).to(dtype) * s``).

The decode kernels' own conversion (converters/mixgemm/raw_decode.hpp: E + F c, and F (q - z)
with F = 4 on row g + 8 of 2-bit codes) is checked the same way, against the documented formula.

Coverage, for every code type (s8 u8 s4 u4 s2 u2) x activation type (bf16 fp16):
  * every 16-bit pattern in both half-words of every word of a lane chunk (so every byte,
    nibble and crumb value in every position), with random zero points and scales;
  * every (code, zero point) combination;
  * every finite scale bit pattern (all 2^16 minus inf/NaN).
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from mixgemm.dtypes import WeightType
from mixgemm.jit import env as paths
from mixgemm.weights.layout import bit_of

ALL_TYPES = [WeightType.S8, WeightType.U8, WeightType.S4, WeightType.U4, WeightType.S2, WeightType.U2]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Odd multipliers: x -> x * m mod 2^16 is a bijection of 16-bit words, so each half-word of each
# word of the chunk runs through all 2^16 patterns, in a different order per position.
_ODD = [1] + [(40503 * (2 * i + 1)) % 65536 | 1 for i in range(15)]


def _compile(out, compiler_cmd):
    res = subprocess.run(compiler_cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"compiling the converter check failed:\n{res.stderr[-4000:]}"
    return out


@pytest.fixture(scope="session")
def host_check(tmp_path_factory):
    """converter_check built with a plain C++ compiler: the portable host path."""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("cc") / "converter_check"
    return _compile(out, [cxx, "-O2", "-std=c++17", "-Wall", "-Werror", f"-I{paths.converters_dir()}",
                          str(paths.repo_file("tests/cpp/converter_check.cpp")), "-o", str(out)])


@pytest.fixture(scope="session")
def cutlass_check(tmp_path_factory):
    """converter_check with the cutlass::NumericArrayConverter specialization (needs nvcc,
    because CUTLASS's numeric_conversion.h only compiles under nvcc)."""
    nvcc = paths.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("cc") / "converter_check_cutlass"
    return _compile(out, [nvcc, "-O1", "-std=c++17", "-x", "cu", "-arch=sm_90a", "-DMIXGEMM_WITH_CUTLASS",
                          f"-I{paths.converters_dir()}", f"-I{paths.cutlass_include_dir()}",
                          str(paths.repo_file("tests/cpp/converter_check.cpp")), "-o", str(out)])


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
def _pack_chunks(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [n, 32] (low `bits` bits used) in fragment-value order -> chunk words [n, bits]."""
    words = np.zeros((codes.shape[0], bits), dtype=np.uint64)
    for v in range(32):
        bit = int(bit_of(torch.tensor(v), bits))
        words[:, bit // 32] |= (codes[:, v].astype(np.uint64) & ((1 << bits) - 1)) << np.uint64(bit % 32)
    return words.astype(np.uint32)


def _finite_half_bits(dtype: torch.dtype) -> np.ndarray:
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    return allbits[torch.isfinite(allbits.float())].view(torch.int16).numpy().view(np.uint16)


def _random_scales(rng, n, dtype) -> np.ndarray:
    mag = torch.from_numpy(rng.uniform(-4, 1, size=n)).exp2()
    sign = torch.from_numpy(rng.choice([-1.0, 1.0], size=n, p=[0.1, 0.9]))
    return (mag * sign).to(dtype).view(torch.int16).numpy().view(np.uint16)


def _cases(wt: WeightType, dtype: torch.dtype, rng):
    """Yield (name, words[n, bits], zeros[n, 2], scales[n, 2])."""
    bits, zmax = wt.bits, (1 << wt.bits) - 1
    # 1. every 16-bit pattern in both half-words of every word of the chunk
    x = np.arange(65536, dtype=np.uint64)
    words = np.stack([((x * _ODD[2 * w]) & 0xFFFF) | (((x * _ODD[2 * w + 1]) & 0xFFFF) << 16)
                      for w in range(bits)], axis=1).astype(np.uint32)
    n = words.shape[0]
    zeros = rng.integers(0, zmax + 1, size=(n, 2))
    yield "all-patterns", words, zeros, _random_scales(rng, 2 * n, dtype).reshape(n, 2)
    # 2. every (code, zero point)
    codes = np.arange(1 << bits)
    per_chunk = np.resize(codes, (max(1, (1 << bits) // 32), 32)) if bits == 8 else np.resize(codes, (1, 32))
    reps = (zmax + 1) if wt.has_zero else 1
    chunk_codes = np.tile(per_chunk, (reps, 1))
    z = np.repeat(np.arange(reps), per_chunk.shape[0])
    yield "all-code-zero", _pack_chunks(chunk_codes, bits), np.stack([z, z], 1), \
        _random_scales(rng, 2 * len(z), dtype).reshape(-1, 2)
    # 3. every finite scale bit pattern
    sbits = _finite_half_bits(dtype)
    n = len(sbits)
    chunk_codes = rng.integers(0, 1 << bits, size=(n, 32))
    yield "all-scales", _pack_chunks(chunk_codes, bits), rng.integers(0, zmax + 1, size=(n, 2)), \
        np.stack([sbits, sbits[::-1]], 1)


def _run(binary, wt, dname, mode, words, zeros, scales, tmp_path):
    """zeros: integer zero points [n, 2]; scales: bit patterns [n, 2] of the activation dtype."""
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    zero_bits = torch.from_numpy(np.asarray(zeros, dtype=np.int64)).to(DTYPES[dname]).view(torch.int16).numpy()
    with open(inp, "wb") as f:
        np.array([words.shape[0]], dtype=np.uint32).tofile(f)
        np.ascontiguousarray(words, dtype=np.uint32).tofile(f)
        if mode in ("dequant", "centered"):
            np.ascontiguousarray(zero_bits.view(np.uint16)).tofile(f)
            np.ascontiguousarray(scales, dtype=np.uint16).tofile(f)
    res = subprocess.run([str(binary), str(wt.bits), str(int(wt.signed)), dname, mode, str(inp), str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return np.fromfile(out, dtype=np.uint16).reshape(words.shape[0], 32)


# ---------------------------------------------------------------------------------------------
# Independent reference: decode the bits with the layout's documented positions, then torch.
# ---------------------------------------------------------------------------------------------
def _decode_codes(words: np.ndarray, wt: WeightType) -> torch.Tensor:
    bits = wt.bits
    cols = []
    for v in range(32):
        bit = int(bit_of(torch.tensor(v), bits))
        cols.append((words[:, bit // 32].astype(np.int64) >> (bit % 32)) & ((1 << bits) - 1))
    codes = torch.from_numpy(np.stack(cols, 1))
    if wt.signed:
        codes = torch.where(codes >= (1 << (bits - 1)), codes - (1 << bits), codes)
    return codes  # [n, 32] int64, value v in fragment order


def _row_of_value() -> torch.Tensor:
    # fragment value i = v % 8: values 2,3 and 6,7 are on row g + 8 (index 1), the others on row g
    return torch.tensor([((v % 8) // 2) % 2 for v in range(32)])


def _reference_dequant(words, zeros, scales, wt, dtype):
    q = _decode_codes(words, wt)
    row = _row_of_value()
    s = torch.from_numpy(scales.astype(np.int16)).view(dtype)[:, row]
    if wt.has_zero:
        z = torch.from_numpy(zeros.astype(np.int64))[:, row]
        t = (q - z).to(dtype)
    else:
        t = q.to(dtype)
    return (t * s).view(torch.int16).numpy().view(np.uint16)


def _assert_bits_equal(got, want, what):
    bad = np.nonzero(got != want)
    assert bad[0].size == 0, (f"{what}: {bad[0].size} mismatches, first at chunk {bad[0][0]} value "
                              f"{bad[1][0]}: got {got[bad][0]:#06x}, want {want[bad][0]:#06x}")


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("wt", ALL_TYPES, ids=lambda w: w.value)
def test_dequant_exhaustive(host_check, wt, dname, tmp_path):
    dtype = DTYPES[dname]
    rng = np.random.default_rng(1234 + wt.bits)
    for name, words, zeros, scales in _cases(wt, dtype, rng):
        got = _run(host_check, wt, dname, "dequant", words, zeros, scales, tmp_path)
        want = _reference_dequant(words, zeros, scales, wt, dtype)
        _assert_bits_equal(got, want, f"{wt.value}->{dname} {name}")


def _reference_values(words, wt, dtype):
    q = _decode_codes(words, wt)
    return q.to(dtype).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("wt", ALL_TYPES, ids=lambda w: w.value)
def test_values_all_patterns(host_check, wt, dname, tmp_path):
    rng = np.random.default_rng(99)
    name, words, zeros, scales = next(_cases(wt, DTYPES[dname], rng))
    got = _run(host_check, wt, dname, "values", words, zeros, scales, tmp_path)
    _assert_bits_equal(got, _reference_values(words, wt, DTYPES[dname]), f"{wt.value}->{dname} values")


@pytest.mark.nvcc
@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("wt", ALL_TYPES, ids=lambda w: w.value)
def test_cutlass_numeric_array_converter(cutlass_check, wt, dname, tmp_path):
    """cutlass::NumericArrayConverter<D, mixgemm::prepacked<T>, 32> decodes the prepacked order."""
    rng = np.random.default_rng(7)
    name, words, zeros, scales = next(_cases(wt, DTYPES[dname], rng))
    got = _run(cutlass_check, wt, dname, "cutlass", words, zeros, scales, tmp_path)
    _assert_bits_equal(got, _reference_values(words, wt, DTYPES[dname]), f"{wt.value}->{dname} cutlass")


def test_natural_order_decode_disagrees():
    """Negative control: reading prepacked bits in natural (sequential) order gives other values,
    so the tests above would catch a converter that ignored the prepacked order."""
    rng = np.random.default_rng(3)
    for wt in ALL_TYPES:
        codes = rng.integers(0, 1 << wt.bits, size=(64, 32))
        words = _pack_chunks(codes, wt.bits)
        natural = np.zeros_like(codes)
        for v in range(32):
            bit = v * wt.bits
            natural[:, v] = (words[:, bit // 32].astype(np.int64) >> (bit % 32)) & ((1 << wt.bits) - 1)
        assert (natural != codes).any(), wt


# ---------------------------------------------------------------------------------------------
# The decode kernels' conversion (raw_decode.hpp): x = E + F c without zero point or scale, and
# x - bias = F (q - z). F = 4 on row g + 8 of 2-bit codes, 1 elsewhere; E = 128 (bf16) or 1024
# (fp16); c = the unsigned code, or q + 2^(bits-1) for signed codes. bf16 int8 decodes in two
# parts instead: x = q (signed) or u - 128 (unsigned).
# ---------------------------------------------------------------------------------------------
def _row_factor(wt: WeightType) -> torch.Tensor:
    return torch.where(_row_of_value() == 1, 4 if wt.bits == 2 else 1, 1).to(torch.int64)


def _two_part(wt: WeightType, dname: str) -> bool:
    return wt.bits == 8 and dname == "bf16"


def _reference_raw(words, wt, dname):
    q = _decode_codes(words, wt)
    if _two_part(wt, dname):
        x = q if wt.signed else q - 128
    else:
        c = q + (1 << (wt.bits - 1)) if wt.signed else q
        x = (128 if dname == "bf16" else 1024) + _row_factor(wt) * c
    return x.to(DTYPES[dname]).view(torch.int16).numpy().view(np.uint16)


def _reference_centered(words, zeros, wt, dname):
    q = _decode_codes(words, wt)
    if wt.has_zero:
        q = q - torch.from_numpy(zeros.astype(np.int64))[:, _row_of_value()]
    return (_row_factor(wt) * q).to(DTYPES[dname]).view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("wt", ALL_TYPES, ids=lambda w: w.value)
def test_raw_decode_exhaustive(host_check, wt, dname, tmp_path):
    rng = np.random.default_rng(4321 + wt.bits)
    for name, words, zeros, scales in _cases(wt, DTYPES[dname], rng):
        got = _run(host_check, wt, dname, "raw", words, zeros, scales, tmp_path)
        _assert_bits_equal(got, _reference_raw(words, wt, dname), f"{wt.value}->{dname} raw {name}")
        got = _run(host_check, wt, dname, "centered", words, zeros, scales, tmp_path)
        _assert_bits_equal(got, _reference_centered(words, zeros, wt, dname), f"{wt.value}->{dname} centered {name}")
