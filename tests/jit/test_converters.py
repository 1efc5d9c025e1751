"""Exhaustive, bit-exact checks of the C++ converters (converters/mixgemm) on the host.

The converters are compiled for the CPU from the very headers the kernels include
(tests/cpp/converter_check.cpp drives them), fed lane chunks in the prepacked layout, and their
output is compared bit for bit with an independent Python decode of the same bits: the bit
positions come from mixgemm.weights.layout, the arithmetic from torch (``(q - z).to(dtype) * s``).

The decode kernels' own conversion (converters/mixgemm/raw_decode.hpp: E + F c, and F (q - z)
with F = 4 on row g + 8 of 2-bit codes) is checked the same way, against the documented formula.

The e4m3 (FP8) converters (converters/mixgemm/e4m3.hpp: q, or u - z, for s4 u4 s2 u2) are checked
against torch's float8_e4m3fn, at the 8-bit fragment positions derived from the PTX fragment and
the documented K permutation: every 16-bit pattern in every half-word of a chunk, and every code
at every position with every pair of zero points of the lane's two rows, for the tables built in
registers and the compile-time tables; their device path is compiled for sm_90a and its SASS
read (no branches, no local memory, the documented instruction count).

Coverage, for every code type (s8 u8 s4 u4 s2 u2) x activation type (bf16 fp16):
  * every 16-bit pattern in both half-words of every word of a lane chunk (so every byte,
    nibble and crumb value in every position), with random zero points and scales;
  * every (code, zero point) combination;
  * every finite scale bit pattern (all 2^16 minus inf/NaN).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mixgemm.dtypes import WeightType
from mixgemm.jit import env as paths
from mixgemm.weights.layout import bit_of, lane_value_of

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


# ---------------------------------------------------------------------------------------------
# e4m3 (FP8) converters (converters/mixgemm/e4m3.hpp): q, or u - z, for 4- and 2-bit codes, in
# the 8-bit wgmma A-fragment order. Reference: torch's float8_e4m3fn of the same integers, at
# the fragment positions derived here from the PTX fragment and the layout's lane_value_of.
# ---------------------------------------------------------------------------------------------
E4M3_TYPES = [WeightType.S4, WeightType.U4, WeightType.S2, WeightType.U2]


def _mma_to_weight_col(f: int) -> int:
    """The documented K permutation inside a 32-column block: MMA column F = 16p + 4t + j holds
    weight column L = 8j + 2t + p."""
    p, t, j = (f % 32) // 16, (f // 4) % 4, f % 4
    return (f // 32) * 32 + 8 * j + 2 * t + p


def _e4m3_value_order() -> np.ndarray:
    """Chunk value index (0..31) of each output byte o = 16 m + 4 r + j of the e4m3 converter.

    Byte j of register r of k32 block m is, in wgmma's 8-bit A fragment (CUTLASS
    GMMA::ALayout_64x32), row g + 8 (r % 2) and MMA column 32 m + 16 (r // 2) + 4 t + j; that
    MMA column holds weight column _mma_to_weight_col(...) of the atom, whose (lane, value) the
    layout gives. The value must be the same for every lane, and the lane must be 4 g + t."""
    order = np.empty(32, dtype=np.int64)
    for o in range(32):
        m, r, j = o // 16, (o // 4) % 4, o % 4
        values = set()
        for g in range(8):
            for t in range(4):
                row = g + 8 * (r % 2)
                col = _mma_to_weight_col(32 * m + 16 * (r // 2) + 4 * t + j)
                lane, value = lane_value_of(torch.tensor(row), torch.tensor(col))
                assert int(lane) == 4 * g + t, (o, g, t)
                values.add(int(value))
        assert len(values) == 1, (o, values)
        order[o] = values.pop()
    assert sorted(order) == list(range(32))
    return order


def _e4m3_cases(wt: WeightType, rng):
    """Yield (name, words[n, bits], zeros[n, 2]) (integer zero points of rows g, g + 8)."""
    bits, zmax = wt.bits, (1 << wt.bits) - 1
    # 1. every 16-bit pattern in both half-words of every word of the chunk, random zero points
    x = np.arange(65536, dtype=np.uint64)
    words = np.stack([((x * _ODD[2 * w]) & 0xFFFF) | (((x * _ODD[2 * w + 1]) & 0xFFFF) << 16)
                      for w in range(bits)], axis=1).astype(np.uint32)
    yield "all-patterns", words, rng.integers(0, zmax + 1, size=(words.shape[0], 2))
    # 2. every code at every position, with every pair of zero points of the two rows
    shifts = np.arange(1 << bits)
    codes = (np.arange(32)[None, :] + shifts[:, None]) % (1 << bits)       # [2^b, 32]
    zg, z8 = np.meshgrid(np.arange(zmax + 1), np.arange(zmax + 1), indexing="ij")
    pairs = np.stack([zg.ravel(), z8.ravel()], 1)                           # [(zmax+1)^2, 2]
    yield "all-code-zero", _pack_chunks(np.tile(codes, (len(pairs), 1)), bits), \
        np.repeat(pairs, len(codes), axis=0)


def _run_e4m3(binary, wt, zdtype, mode, words, zeros, tmp_path):
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(inp, "wb") as f:
        np.array([words.shape[0]], dtype=np.uint32).tofile(f)
        np.ascontiguousarray(words, dtype=np.uint32).tofile(f)
        if mode in ("e4m3", "e4m3_lut"):
            zb = torch.from_numpy(np.asarray(zeros, dtype=np.int64)).to(DTYPES[zdtype]).view(torch.int16)
            np.ascontiguousarray(zb.numpy().view(np.uint16)).tofile(f)
    res = subprocess.run([str(binary), str(wt.bits), str(int(wt.signed)), zdtype, mode, str(inp), str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return np.fromfile(out, dtype=np.uint8).reshape(words.shape[0], 32)


def _reference_e4m3(words, zeros, wt):
    q = _decode_codes(words, wt)
    if zeros is not None and wt.has_zero:
        q = q - torch.from_numpy(np.asarray(zeros, dtype=np.int64))[:, _row_of_value()]
    assert int(q.abs().max()) <= 15
    fp8 = q.to(torch.float32).to(torch.float8_e4m3fn)
    assert torch.equal(fp8.to(torch.int64), q), "not exact in e4m3"
    return fp8.view(torch.uint8).numpy()[:, _e4m3_value_order()]


def test_e4m3_fragment_order():
    """The output order follows from the PTX fragment and the permutation; the permutation is a
    bijection inside each 32-column block (so group boundaries at multiples of 32 survive)."""
    order = _e4m3_value_order()
    # register r = 2 p + row, byte j: value 8 (2 m + j // 2) + 4 (j % 2) + 2 row + p
    for o in range(32):
        m, r, j = o // 16, (o // 4) % 4, o % 4
        assert order[o] == 8 * (2 * m + j // 2) + 4 * (j % 2) + 2 * (r % 2) + r // 2
    assert sorted(_mma_to_weight_col(f) for f in range(64)) == list(range(64))
    assert all(_mma_to_weight_col(f) // 32 == f // 32 for f in range(64))


@pytest.mark.parametrize("mode", ["e4m3", "e4m3_lut"])
@pytest.mark.parametrize("wt", E4M3_TYPES, ids=lambda w: w.value)
def test_e4m3_exhaustive(host_check, wt, mode, tmp_path):
    rng = np.random.default_rng(2468 + wt.bits)
    for name, words, zeros in _e4m3_cases(wt, rng):
        for zdtype in DTYPES:   # the zero points' format (bf16 / fp16 bit patterns)
            if name == "all-patterns" and zdtype == "fp16":
                continue   # the zero point decode is covered by the all-code-zero case
            got = _run_e4m3(host_check, wt, zdtype, mode, words, zeros, tmp_path)
            _assert_bits_equal(got, _reference_e4m3(words, zeros, wt), f"{wt.value}->e4m3 {mode} {name} {zdtype}")


@pytest.mark.parametrize("wt", E4M3_TYPES, ids=lambda w: w.value)
def test_e4m3_values_all_patterns(host_check, wt, tmp_path):
    _, words, _ = next(_e4m3_cases(wt, np.random.default_rng(5)))
    got = _run_e4m3(host_check, wt, "bf16", "e4m3_values", words, None, tmp_path)
    _assert_bits_equal(got, _reference_e4m3(words, None, wt), f"{wt.value}->e4m3 values")


@pytest.mark.nvcc
@pytest.mark.parametrize("wt", E4M3_TYPES, ids=lambda w: w.value)
def test_e4m3_cutlass_numeric_array_converter(cutlass_check, wt, tmp_path):
    """cutlass::NumericArrayConverter<float_e4m3_t, mixgemm::prepacked<T>, 32>."""
    _, words, _ = next(_e4m3_cases(wt, np.random.default_rng(6)))
    got = _run_e4m3(cutlass_check, wt, "bf16", "e4m3_cutlass", words, None, tmp_path)
    _assert_bits_equal(got, _reference_e4m3(words, None, wt), f"{wt.value}->e4m3 cutlass")


# ---------------------------------------------------------------------------------------------
# The e4m3 converters' device path: compiled for sm_90a with the kernels' flags (compile only),
# and, where cuobjdump is at hand, its SASS read: no branches, no local memory, and no more
# instructions than e4m3.hpp documents per k32 block (16 codes).
# ---------------------------------------------------------------------------------------------
_E4M3_SASS_BUDGET = {4: 26, 2: 9}   # prmt + lop3 + shifts per k32 block


@pytest.fixture(scope="session")
def e4m3_device_object(tmp_path_factory):
    from mixgemm.jit.toolchain import BASE_FLAGS, include_flags
    nvcc = paths.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("e4m3") / "e4m3_device.o"
    res = subprocess.run([nvcc, *BASE_FLAGS, "-O3", "-c", *include_flags(),
                          str(paths.repo_file("tests/cpp/e4m3_device.cu")), "-o", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"nvcc -arch=sm_90a -c e4m3_device.cu failed:\n{res.stderr[-4000:]}"
    return nvcc, out


@pytest.mark.nvcc
def test_e4m3_device_compiles(e4m3_device_object):
    assert e4m3_device_object[1].stat().st_size > 0


def _sass_functions(nvcc: str, obj) -> dict:
    tool = shutil.which("cuobjdump") or str(Path(nvcc).parent / "cuobjdump")
    if not Path(tool).is_file():
        pytest.skip("cuobjdump not found")
    res = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True)
    if res.returncode != 0 or "Function :" not in res.stdout:
        pytest.skip(f"cuobjdump -sass unavailable: {res.stderr.strip()[-200:]}")
    funcs = {}
    for part in res.stdout.split("Function : ")[1:]:
        name, body = part.split("\n", 1)
        ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", body)
        funcs[name.strip()] = [op.split(".")[0] for op in ops]
    return funcs


@pytest.mark.nvcc
def test_e4m3_device_sass(e4m3_device_object):
    funcs = _sass_functions(*e4m3_device_object)
    assert len(funcs) == 12, sorted(funcs)
    for name, ops in funcs.items():
        assert not {"LDL", "STL"} & set(ops), f"{name} uses local memory"
        last_exit = max(i for i, op in enumerate(ops) if op == "EXIT")
        assert all(i > last_exit for i, op in enumerate(ops) if op == "BRA"), f"{name} branches"
        m = re.match(r"_Z12e4m3_convertILi(\d)ELb", name)
        if m:
            bits = int(m.group(1))
            used = sum(op in ("PRMT", "LOP3", "SHF") for op in ops)
            assert used <= 2 * _E4M3_SASS_BUDGET[bits], f"{name}: {used} > {2 * _E4M3_SASS_BUDGET[bits]}"
