"""GGUF files: mixgemm.formats.from_gguf, the Hugging Face names and `mixgemm prepack --from gguf`.

The files are written with the gguf package's own GGUFWriter, from blocks packed here by hand
after llama.cpp's block layouts (block_q8_0, block_q4_0, block_q4_1: an fp16 d, for Q4_1 an fp16
m, then the codes; 4-bit codes j and j + 16 of a block share byte j, low nibble first) or
quantized by the gguf package's own quantizer. Every imported weight is compared with the gguf
package's own dequantization (gguf.quants.dequantize, float32): bit for bit in fp16 for Q8_0 and
Q4_0, element by element within the bounds documented in mixgemm.formats.gguf for Q4_1 and bf16.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import zlib

import numpy as np
import pytest
import torch

import mixgemm
from mixgemm.cli.main import main
from mixgemm.formats import (FormatError, UnsupportedLayerError, from_gguf, gguf_name_to_hf,
                             undo_llama_rope_permutation)

gguf = pytest.importorskip("gguf")

from gguf_checks import assert_bitwise, check_against_gguf, exact_parts, gguf_reference  # noqa: E402,F401

FP16, BF16 = torch.float16, torch.bfloat16
#: [N, K] of the synthetic weights: odd multiples of the kernels' 16 x 64 where possible
SHAPES = [(48, 192), (16, 64), (32, 320)]
KINDS = ("Q8_0", "Q4_0", "Q4_1")


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ------------------------------------------------------------------- packers (llama.cpp)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """fp16 values [N, G] -> their little-endian bytes [N, G, 2]."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(*x.shape, 2)


def pack_q8_0(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """d fp16 [N, G], q int8 [N, K] -> uint8 [N, G * 34]: d, then 32 int8 per block."""
    n, g = d.shape
    blocks = np.concatenate([_f16_bytes(d), q.astype(np.int8).view(np.uint8).reshape(n, g, 32)], -1)
    return blocks.reshape(n, g * 34)


def pack_q4(d: np.ndarray, m, codes: np.ndarray) -> np.ndarray:
    """Q4_0 (m None) or Q4_1: d (, m) fp16 [N, G], codes [N, K] in [0, 15] -> uint8 blocks: byte
    j of the 16 holds code j in its low nibble and code j + 16 in its high nibble."""
    n, g = d.shape
    c = codes.astype(np.uint8).reshape(n, g, 32)
    qs = c[..., :16] | (c[..., 16:] << 4)
    parts = [_f16_bytes(d)] + ([] if m is None else [_f16_bytes(m)]) + [qs]
    return np.concatenate(parts, -1).reshape(n, -1)


def random_block_tensor(kind: str, n: int, k: int, rng: np.random.Generator, edge: bool = False):
    """Random blocks of ``kind`` straight from their parts; returns (bytes, parts). ``edge``:
    scales over fp16's whole useful range (subnormals, zeros, both signs) and Q4_1 minimums far
    from -z*d on either side (z clamped at 0 and 15) or exactly -z*d."""
    g = k // 32
    lo = -24 if edge else -12
    d = (rng.choice([-1.0, 1.0], (n, g)) if (edge or kind == "Q4_0") else 1.0) \
        * 2.0 ** rng.uniform(lo, 2, (n, g))
    if edge:
        d[rng.random((n, g)) < 0.05] = 0.0
    d = d.astype(np.float16)
    if kind == "Q8_0":
        q = rng.integers(-128, 128, (n, k))
        return pack_q8_0(d, q), dict(d=d, q=q)
    codes = rng.integers(0, 16, (n, k))
    if kind == "Q4_0":
        return pack_q4(d, None, codes), dict(d=d, codes=codes)
    d = np.abs(d) if not edge else d
    z = rng.integers(0, 16, (n, g)).astype(np.float64)
    m = -z * d.astype(np.float64) * (1 + rng.uniform(-0.05, 0.05, (n, g)))   # near -z*d
    if edge:
        pick = rng.random((n, g))
        m = np.where(pick < 0.15, -z * d, m)                                   # exactly -z*d
        m = np.where((pick >= 0.15) & (pick < 0.3), np.abs(d) * rng.uniform(1, 50, (n, g)), m)
        m = np.where((pick >= 0.3) & (pick < 0.45), -np.abs(d) * rng.uniform(16, 3000, (n, g)), m)
    m = m.astype(np.float16)
    return pack_q4(d, m, codes), dict(d=d, m=m, codes=codes)


def quantized_by_gguf(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A weight-like tensor quantized by the gguf package's own quantizer."""
    w = (rng.standard_normal((n, k)) * 0.02 + rng.standard_normal((n, 1)) * 0.005).astype(np.float32)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def write_gguf(path, tensors, arch="llama", fields=()):
    """``tensors``: name -> (type name, array: bytes [rows..., row bytes] for quantized types)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value, vtype in fields:
        w.add_key_value(key, value, vtype)
    for name, (kind, arr) in tensors.items():
        plain = kind in ("F32", "F16", "F64", "I8", "I16", "I32", "I64")
        w.add_tensor(name, arr, raw_dtype=None if plain else gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ======================================================================== the test packers


@pytest.mark.parametrize("kind", KINDS)
def test_packers_follow_the_gguf_layout(kind):
    """The hand packers above against gguf's dequantize and the formulas of the format."""
    n, k = 16, 64
    raw, parts = random_block_tensor(kind, n, k, rng_for("layout", kind))
    got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)
    d = np.repeat(parts["d"].astype(np.float32), 32, axis=1)
    if kind == "Q8_0":
        want = parts["q"].astype(np.float32) * d
    elif kind == "Q4_0":
        want = (parts["codes"].astype(np.float32) - 8) * d
    else:
        want = parts["codes"].astype(np.float32) * d + np.repeat(parts["m"].astype(np.float32), 32, axis=1)
    np.testing.assert_array_equal(got, want)


# ========================================================================= the importer


@pytest.mark.parametrize("source", ["blocks", "edge", "gguf-quantizer"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", KINDS)
def test_every_type_against_gguf(tmp_path, kind, shape, source):
    n, k = shape
    rng = rng_for("types", kind, shape, source)
    if source == "gguf-quantizer":
        raw = quantized_by_gguf(kind, n, k, rng)
    else:
        raw, parts = random_block_tensor(kind, n, k, rng, edge=source == "edge")
    path = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (kind, raw),
                                            "blk.0.ffn_norm.weight": ("F32", np.ones(k, np.float32))})
    (kind_read, w), = [v for name, v in gguf_reference(path).items() if name.endswith("ffn_up.weight")]
    assert kind_read == kind
    qw16 = from_gguf(path)["blk.0.ffn_up.weight"]
    qwbf = from_gguf(path, BF16)["blk.0.ffn_up.weight"]
    assert isinstance(qw16, mixgemm.QuantizedWeight) and (qw16.n, qw16.k) == (n, k)
    assert qw16.group_size == 32 and qw16.dtype == FP16 and qwbf.dtype == BF16
    if kind == "Q8_0":
        assert qw16.weight_type.value == "s8" and qw16.zero_offsets is None
    elif kind == "Q4_0":
        assert qw16.weight_type.value == "s4" and qw16.zero_offsets is None
    else:
        assert qw16.weight_type.value == "u4" and qw16.zero_offsets is not None
    if source != "gguf-quantizer":   # the codes are carried over as they are
        want = parts["q"] if kind == "Q8_0" else parts["codes"] - (8 if kind == "Q4_0" else 0)
        assert torch.equal(qw16.qweight.to(torch.int64), torch.from_numpy(want))
    for dtype in (FP16, BF16):
        check_against_gguf(kind, qw16, qwbf, dtype, w)


def test_q4_1_zero_points_and_offsets(tmp_path):
    """z = clamp(round(-m/d), 0, 15), o = m + z*d exactly; |o| <= |d|/2 where z is not clamped."""
    n, k = 48, 192
    raw, parts = random_block_tensor("Q4_1", n, k, rng_for("q41-z"), edge=True)
    qw = from_gguf(write_gguf(tmp_path / "m.gguf", {"w": ("Q4_1", raw)}))["w"]
    d, m = parts["d"].astype(np.float64), parts["m"].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(d != 0, np.clip(np.round(-m / np.where(d != 0, d, 1)), 0, 15), 0)
    assert np.array_equal(qw.zeros.double().numpy(), z)
    o = qw.zero_offsets.double().numpy()
    assert np.array_equal(o, (m + z * d).astype(np.float32).astype(np.float64))
    inner = (z > 0) & (z < 15)
    assert np.all(np.abs(o[inner]) <= np.abs(d[inner]) / 2)
    assert inner.any() and (~inner).any()


def test_q4_1_with_integer_minimums_is_exact_and_needs_no_offsets(tmp_path):
    n, k = 32, 128
    rng = rng_for("q41-int")
    # scales of 6 significant bits: z * d (z <= 15) is an fp16 number, so m = -z * d is exact
    d = (rng.integers(32, 64, (n, k // 32)) * 2.0 ** rng.integers(-16, -10, (n, k // 32))).astype(np.float16)
    codes = rng.integers(0, 16, (n, k))
    for zs, want in ((rng.integers(0, 16, (n, k // 32)), "u4"), (np.full((n, k // 32), 8), "s4")):
        m = (-zs * d.astype(np.float64)).astype(np.float16)
        assert np.array_equal(m.astype(np.float64), -zs * d.astype(np.float64))   # representable
        path = write_gguf(tmp_path / f"{want}.gguf", {"w": ("Q4_1", pack_q4(d, m, codes))})
        qw = from_gguf(path)["w"]
        assert qw.zero_offsets is None and qw.weight_type.value == want
        assert_bitwise(mixgemm.dequantize_reference(qw), gguf_reference(path)["w"][1].to(FP16))


def test_symmetric_option(tmp_path):
    raw8, _ = random_block_tensor("Q8_0", 16, 64, rng_for("sym8"))
    raw41, _ = random_block_tensor("Q4_1", 16, 64, rng_for("sym41"))
    path = write_gguf(tmp_path / "m.gguf", {"a": ("Q8_0", raw8)})
    asym = from_gguf(path, symmetric=False)["a"]
    assert asym.weight_type.value == "u8" and bool((asym.zeros == 128).all())
    assert_bitwise(mixgemm.dequantize_reference(asym), gguf_reference(path)["a"][1].to(FP16))
    with pytest.raises(FormatError, match="'b'.*symmetric=True, but the Q4_1 minimums"):
        from_gguf(write_gguf(tmp_path / "b.gguf", {"b": ("Q4_1", raw41)}), symmetric=True)


def test_plain_tensors_pass_through(tmp_path):
    rng = rng_for("plain")
    norm = rng.standard_normal(64).astype(np.float32)
    half = rng.standard_normal((3, 5)).astype(np.float16)
    bf = torch.randn(4, 6, dtype=BF16)
    ints = np.arange(7, dtype=np.int32)
    path = write_gguf(tmp_path / "m.gguf", {
        "output_norm.weight": ("F32", norm), "x.f16": ("F16", half),
        "x.bf16": ("BF16", bf.view(torch.int16).numpy().view(np.uint8).reshape(4, 12)),
        "x.i32": ("I32", ints)})
    out = from_gguf(path, BF16)
    assert out["output_norm.weight"].dtype == torch.float32
    assert torch.equal(out["output_norm.weight"], torch.from_numpy(norm))
    assert out["x.f16"].dtype == FP16 and torch.equal(out["x.f16"], torch.from_numpy(half))
    assert out["x.bf16"].dtype == BF16 and out["x.bf16"].shape == (4, 6)
    assert torch.equal(out["x.bf16"].view(torch.int16), bf.view(torch.int16))
    assert torch.equal(out["x.i32"], torch.from_numpy(ints))
    assert list(out) == ["output_norm.weight", "x.f16", "x.bf16", "x.i32"]   # the file's order


def _k_quant_bytes(kind, n, k, rng):
    """K-quant blocks (256 elements) of random bytes but finite fp16 scales: Q4_K starts with d
    and dmin, Q6_K ends with d."""
    size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scale = _f16_bytes(np.full((n, k // 256), 0.01, np.float16))
    if kind == "Q4_K":
        raw[..., :2], raw[..., 2:4] = scale, scale
    else:
        raw[..., -2:] = scale
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind,tensor,message", [
    ("Q4_K", "k", r"type Q4_K is not supported: mixgemm imports Q8_0, Q4_0, Q4_1 \(K-quants are not supported\)"),
    ("Q6_K", "k", r"type Q6_K is not supported.*K-quants"),
    ("Q5_0", "k", r"type Q5_0 is not supported: mixgemm imports Q8_0, Q4_0, Q4_1 \(or pass dense="),
    ("Q8_0", "n40", r"Q8_0 \[N=40, K=64\]: mixgemm's kernels need N \(out_features\) % 16 == 0"),
    ("Q4_1", "k96", r"Q4_1 \[N=16, K=96\]: .*K \(in_features\) % 64 == 0"),
    ("Q8_0", "3d", r"a Q8_0 tensor of shape \[2, 16, 64\]: mixgemm imports 2-D weights"),
])
def test_refused_tensors_name_the_tensor_and_type_unless_dense(tmp_path, kind, tensor, message):
    rng = rng_for("refuse", kind, tensor)
    if kind.endswith("_K"):
        raw = _k_quant_bytes(kind, 16, 256, rng)
    elif kind == "Q5_0":
        raw = quantized_by_gguf("Q5_0", 16, 64, rng)
    elif tensor == "n40":
        raw, _ = random_block_tensor(kind, 40, 64, rng)
    elif tensor == "k96":
        raw, _ = random_block_tensor(kind, 16, 96, rng)
    else:
        raw = random_block_tensor(kind, 32, 64, rng)[0].reshape(2, 16, -1)
    name = "blk.0.ffn_down.weight"
    path = write_gguf(tmp_path / "m.gguf", {name: (kind, raw)})
    with pytest.raises(UnsupportedLayerError, match=f"GGUF tensor '{re.escape(name)}': {message}"):
        from_gguf(path)
    for dtype in (FP16, BF16):
        dense = from_gguf(path, dtype, dense=r"ffn_down")[name]
        want = gguf_reference(path)[name][1].to(dtype)
        assert isinstance(dense, torch.Tensor) and dense.dtype == dtype
        assert_bitwise(dense, want)


def test_dense_selects_by_gguf_name(tmp_path):
    raw, _ = random_block_tensor("Q8_0", 16, 64, rng_for("dense"))
    path = write_gguf(tmp_path / "m.gguf", {"token_embd.weight": ("Q8_0", raw), "blk.0.attn_v.weight": ("Q8_0", raw)})
    out = from_gguf(path, dense=mixgemm.formats.gguf.EMBEDDING_TENSORS)
    assert isinstance(out["token_embd.weight"], torch.Tensor)
    assert isinstance(out["blk.0.attn_v.weight"], mixgemm.QuantizedWeight)
    assert_bitwise(out["token_embd.weight"], mixgemm.dequantize_reference(out["blk.0.attn_v.weight"]))


def test_bad_files_and_arguments(tmp_path, monkeypatch):
    good = write_gguf(tmp_path / "good.gguf", {"w": ("Q8_0", random_block_tensor("Q8_0", 16, 64, rng_for("bad"))[0])})
    data = good.read_bytes()
    with pytest.raises(FileNotFoundError, match="nope.gguf: no such file"):
        from_gguf(tmp_path / "nope.gguf")
    for name, content in (("text.gguf", b"hello world"), ("empty.gguf", b""),
                          ("st.gguf", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(FormatError, match=f"{name}: not a GGUF file"):
            from_gguf(tmp_path / name)
    for cut in (10, 100, len(data) - 1):   # the header, the tensor infos, the data
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(FormatError, match=r"cut.gguf: (not a readable GGUF file \(truncated or corrupt\?|"
                                              r"tensor 'w' is cut short)"):
            from_gguf(tmp_path / "cut.gguf")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        from_gguf(good, torch.float32)
    with pytest.raises(TypeError, match="dense must be a regular expression"):
        from_gguf(good, dense=["w"])
    with pytest.raises(TypeError, match="hf_names must be a bool"):
        from_gguf(good, hf_names="yes")
    monkeypatch.setitem(sys.modules, "gguf", None)    # as if it were not installed
    with pytest.raises(ImportError, match=r"needs the 'gguf' package.*pip install 'mixgemm\[gguf\]'"):
        from_gguf(good)


# ===================================================================== Hugging Face names


@pytest.mark.parametrize("gguf_name,hf_name", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
    ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
    ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight"),
    ("blk.3.attn_v.bias", "model.layers.3.self_attn.v_proj.bias"),
    ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
    ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
    ("blk.7.ffn_gate.weight", "model.layers.7.mlp.gate_proj.weight"),
    ("blk.7.ffn_up.weight", "model.layers.7.mlp.up_proj.weight"),
    ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
])
def test_gguf_name_to_hf(gguf_name, hf_name):
    assert gguf_name_to_hf(gguf_name) == hf_name


@pytest.mark.parametrize("name", ["rope_freqs.weight", "blk.0.ffn_gate_exps.weight", "blk.x.attn_q.weight",
                                  "token_embd", "blk.0.attn_q.weight.extra"])
def test_gguf_name_to_hf_refuses_other_names(name):
    with pytest.raises(KeyError, match="not a GGUF Llama tensor name"):
        gguf_name_to_hf(name)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rows -> the GGUF file's."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [1, 3, 4])
def test_undo_llama_rope_permutation(heads):
    rows = heads * 16
    w = torch.randn(rows, 64)
    assert torch.equal(undo_llama_rope_permutation(llama_cpp_permute(w, heads), heads), w)
    b = torch.randn(rows)
    assert torch.equal(undo_llama_rope_permutation(llama_cpp_permute(b, heads), heads), b)
    assert not torch.equal(llama_cpp_permute(w, heads), w)
    qw = mixgemm.quantize(w, 4, 32)
    stored = dataclasses.replace(qw, qweight=llama_cpp_permute(qw.qweight, heads),
                                 scales=llama_cpp_permute(qw.scales, heads), zeros=llama_cpp_permute(qw.zeros, heads),
                                 zero_offsets=llama_cpp_permute(torch.randn(rows, 2), heads))
    back = undo_llama_rope_permutation(stored, heads)
    assert isinstance(back, mixgemm.QuantizedWeight)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
    assert torch.equal(back.zeros, qw.zeros)
    assert torch.equal(llama_cpp_permute(back.zero_offsets, heads), stored.zero_offsets)
    with pytest.raises(ValueError, match="do not split into 5 heads"):
        undo_llama_rope_permutation(w, 5)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        undo_llama_rope_permutation(w, 0)


def llama_file(path, rng, *, heads=4, kv_heads=2, extra=None, arch="llama"):
    """A one-block Llama GGUF file: hidden 128, head dim 32, q [128, 128] Q8_0, k [64, 128] Q4_1,
    v Q4_0, the rest Q8_0 / F32; q/k written with llama.cpp's permutation of HF rows."""
    vt = gguf.GGUFValueType
    hidden, hd = 128, 128 // heads
    hf = {"q": torch.from_numpy(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.02),
          "k": torch.from_numpy(rng.standard_normal((kv_heads * hd, hidden)).astype(np.float32) * 0.02)}
    tensors = {
        "token_embd.weight": ("Q8_0", quantized_by_gguf("Q8_0", 64, hidden, rng)),
        "blk.0.attn_norm.weight": ("F32", np.ones(hidden, np.float32)),
        "blk.0.attn_q.weight": ("Q8_0", gguf.quants.quantize(llama_cpp_permute(hf["q"], heads).numpy(),
                                                             gguf.GGMLQuantizationType.Q8_0)),
        "blk.0.attn_k.weight": ("Q4_1", gguf.quants.quantize(llama_cpp_permute(hf["k"], kv_heads).numpy(),
                                                             gguf.GGMLQuantizationType.Q4_1)),
        "blk.0.attn_v.weight": ("Q4_0", quantized_by_gguf("Q4_0", kv_heads * hd, hidden, rng)),
        "blk.0.attn_output.weight": ("Q8_0", quantized_by_gguf("Q8_0", hidden, hidden, rng)),
        "blk.0.ffn_norm.weight": ("F32", np.ones(hidden, np.float32)),
        "blk.0.ffn_gate.weight": ("Q4_1", quantized_by_gguf("Q4_1", 192, hidden, rng)),
        "blk.0.ffn_up.weight": ("Q4_1", quantized_by_gguf("Q4_1", 192, hidden, rng)),
        "blk.0.ffn_down.weight": ("Q4_1", quantized_by_gguf("Q4_1", hidden, 192, rng)),
        "output_norm.weight": ("F32", np.ones(hidden, np.float32)),
        "rope_freqs.weight": ("F32", np.ones(hd // 2, np.float32)),
        **(extra or {})}
    fields = [(f"{arch}.attention.head_count", heads, vt.UINT32),
              (f"{arch}.attention.head_count_kv", kv_heads, vt.UINT32),
              (f"{arch}.block_count", 1, vt.UINT32)]
    return write_gguf(path, tensors, arch=arch, fields=fields)


def test_from_gguf_with_hf_names(tmp_path):
    heads, kv_heads = 4, 2
    path = llama_file(tmp_path / "l.gguf", rng_for("hf"), heads=heads, kv_heads=kv_heads)
    ref = gguf_reference(path)
    out = from_gguf(path, hf_names=True, dense=mixgemm.formats.gguf.EMBEDDING_TENSORS)
    assert list(out) == [gguf_name_to_hf(n) for n in ref if n != "rope_freqs.weight"]
    for name, (kind, w) in ref.items():
        if name == "rope_freqs.weight":
            continue
        got = out[gguf_name_to_hf(name)]
        if ".attn_q." in name or ".attn_k." in name:    # HF's rows: transformers' reverse permutation
            n_head = heads if ".attn_q." in name else kv_heads
            dim = w.shape[0] // n_head // 2
            w = w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
        if isinstance(got, mixgemm.QuantizedWeight):
            p, o = exact_parts(got)
            assert torch.equal((p + o).float(), w), name   # the exact GGUF value, rows in HF order
        elif kind == "F32":
            assert torch.equal(got, w), name
        else:
            assert_bitwise(got, w.to(FP16))
    assert not torch.equal(out["model.layers.0.self_attn.q_proj.weight"].qweight,
                           from_gguf(path, )["blk.0.attn_q.weight"].qweight)


def test_hf_names_refusals(tmp_path):
    with pytest.raises(FormatError, match="hf_names=True maps Llama files, but this one's general.architecture is 'qwen2'"):
        from_gguf(llama_file(tmp_path / "q.gguf", rng_for("hf-q"), arch="qwen2"), hf_names=True)
    odd = {"blk.0.ffn_gate_exps.weight": ("F32", np.ones((2, 4), np.float32))}
    with pytest.raises(FormatError, match="GGUF tensor 'blk.0.ffn_gate_exps.weight': no Hugging Face Llama name"):
        from_gguf(llama_file(tmp_path / "e.gguf", rng_for("hf-e"), extra=odd), hf_names=True)


# ========================================================================= command line


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_prepack_from_gguf(tmp_path, capsys):
    src = llama_file(tmp_path / "l.gguf", rng_for("cli"))
    dst = tmp_path / "out" / "packed.safetensors"
    dst.parent.mkdir()
    rc, out, err = run(capsys, "prepack", src, "-o", dst, "--from", "gguf")
    assert rc == 0, err
    assert re.search(r"converted 7 gguf tensors \(1 s4, 2 s8, 4 u4 with float zero offsets\), copied 5 tensors", out)
    got = mixgemm.load(str(dst))
    want = from_gguf(src)
    ref = gguf_reference(src)
    assert sorted(got) == sorted(want)
    assert_bitwise(got["token_embd.weight"], ref["token_embd.weight"][1].to(FP16))     # dense by default
    for name, qw in want.items():
        if name == "token_embd.weight":
            continue
        if isinstance(qw, mixgemm.QuantizedWeight):
            assert isinstance(got[name], mixgemm.PackedWeight)
            assert_bitwise(mixgemm.dequantize_reference(got[name]), mixgemm.dequantize_reference(qw))
        else:
            assert torch.equal(got[name], qw)
    # Hugging Face names, bf16, and one more tensor dense
    dst2 = tmp_path / "out" / "hf.safetensors"
    rc, out, err = run(capsys, "prepack", src, "-o", dst2, "--from", "gguf", "--hf-names", "--dtype", "bf16",
                       "--exclude", "ffn_down")
    assert rc == 0, err
    got = mixgemm.load(str(dst2))
    hf = from_gguf(src, BF16, hf_names=True, dense="ffn_down|token_embd")
    assert sorted(got) == sorted(hf) and "rope_freqs.weight" not in got
    for name in ("model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert isinstance(got[name], torch.Tensor) and got[name].dtype == BF16
        assert_bitwise(got[name], hf[name])
    q = got["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == BF16
    assert_bitwise(mixgemm.dequantize_reference(q), mixgemm.dequantize_reference(hf["model.layers.0.self_attn.q_proj.weight"]))


def test_cli_embedding_of_a_packable_shape_is_packed_without_the_default(tmp_path, capsys):
    raw, _ = random_block_tensor("Q8_0", 64, 128, rng_for("cli-embd"))
    src = write_gguf(tmp_path / "e.gguf", {"token_embd.weight": ("Q8_0", raw)})
    dst = tmp_path / "o.safetensors"
    rc, out, err = run(capsys, "prepack", src, "-o", dst, "--from", "gguf")
    assert rc == 1 and "no Q8_0, Q4_0 or Q4_1 tensor to pack" in err and not dst.exists()
    rc, out, err = run(capsys, "prepack", src, "-o", dst, "--from", "gguf", "--no-default-exclude")
    assert rc == 0, err
    assert isinstance(mixgemm.load(str(dst))["token_embd.weight"], mixgemm.PackedWeight)


@pytest.mark.parametrize("case,message,rc_want", [
    ("not-gguf", r"not a GGUF file \(it starts with b'hell'", 1),
    ("truncated", r"not a readable GGUF file \(truncated or corrupt\?", 1),
    ("k-quant", r"GGUF tensor 'blk.0.ffn_down.weight': type Q4_K is not supported", 1),
    ("directory", r"is a directory: --from gguf reads one .gguf file", 1),
    ("missing", r"nope.gguf: no such file or directory", 1),
    ("no-gguf-package", r"needs the 'gguf' package", 1),
    ("hf-names-without-gguf", r"--hf-names goes with --from gguf", 2),
    ("bits", r"--bits, --group-size and --symmetric come from the checkpoint", 2),
])
def test_cli_refusals_leave_nothing_behind(tmp_path, capsys, monkeypatch, pin_case, case, message, rc_want):
    src = tmp_path / "in" / "m.gguf"
    src.parent.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    good = llama_file(tmp_path / "good.gguf", rng_for("cli-bad"))
    src.write_bytes(good.read_bytes())
    extra = []
    if case == "not-gguf":
        src.write_bytes(b"hello, not a gguf file")
    elif case == "truncated":
        src.write_bytes(good.read_bytes()[:-1000])
    elif case == "k-quant":
        write_gguf(src, {"blk.0.ffn_down.weight": ("Q4_K", _k_quant_bytes("Q4_K", 16, 256, rng_for("cli-k")))})
    elif case == "directory":
        src = src.parent
    elif case == "missing":
        src = src.parent / "nope.gguf"
    elif case == "no-gguf-package":
        monkeypatch.setitem(sys.modules, "gguf", None)
    elif case == "bits":
        extra = ["--bits", "4"]
    fmt = "awq" if case == "hf-names-without-gguf" else "gguf"
    argv = ["prepack", src, "-o", out_dir / "out.safetensors", "--from", fmt, *extra]
    if case == "hf-names-without-gguf":
        argv.append("--hf-names")
    before = sorted(os.listdir(src.parent))
    rc, _, err = run(capsys, *argv)
    assert rc == rc_want, err
    lines = err.splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), err
    assert lines[0].startswith("mixgemm prepack: error: ")
    assert os.listdir(out_dir) == [] and sorted(os.listdir(src.parent)) == before
    pin_case("Files", f"--from gguf: {case}", "mixgemm prepack IN.gguf -o OUT --from gguf", f"exit {rc}", lines[0])
