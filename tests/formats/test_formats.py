"""Checkpoint importers (mixgemm.formats).

Each format's layers are built with that format's own published packing rules, by the
reference packers of tests/reference_packers.py, written from the formats' documentation and
sources (AutoAWQ ``WQLinear_GEMM.from_linear`` / ``dequantize_gemm``, AutoGPTQ ``QuantLinear.pack``
and GPTQModel's v1 <-> v2 zero conversion, compressed-tensors ``pack_to_int32`` /
``_dequantize``, HQQ ``BitPack`` / ``Quantizer.dequantize`` / ``encode_safetensor_type``), and
dequantized with the format's own formula, also written there. mixgemm's dequantization of the
imported layer must equal it bit for bit. None of those packages is imported.
"""
import dataclasses

import numpy as np
import pytest
import torch

from mixgemm.formats import (Format, FormatError, GPTQCheckpointFormat, ImportedLayer,
                             UnsupportedLayerError, detect_format, from_awq,
                             from_compressed_tensors, from_gptq, from_hqq, import_checkpoint,
                             import_layer)
from mixgemm.weights.layout import prepack, unpack
from mixgemm.weights.quantize import dequantize_reference
from mixgemm.weights.types import PackedWeight, QuantizedWeight
from reference_packers import (FP16, BF16, N, shape_for, gen_for, rand_codes, rand_scales,
                               awq_pack, awq_reference_dequant, make_awq, gptq_pack, gptq_v2_to_v1,
                               gptq_unpack, gptq_reference_dequant, make_gptq,
                               random_act_order_g_idx, ct_pack, ct_unpack, ct_reference_dequant,
                               make_ct, hqq_encode, make_hqq, hqq_reference_dequant)

GROUPS = (32, 64, 128, 256, "K")


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
        f"{int((a.view(torch.int16) != b.view(torch.int16)).sum())} elements differ"


def assert_same_qw(a: QuantizedWeight, b: QuantizedWeight):
    assert (a.bits, a.group_size, a.symmetric) == (b.bits, b.group_size, b.symmetric)
    assert a.qweight.dtype == b.qweight.dtype and torch.equal(a.qweight, b.qweight)
    assert_bitwise(a.scales, b.scales)
    assert (a.zeros is None) == (b.zeros is None)
    if a.zeros is not None:
        assert_bitwise(a.zeros, b.zeros)


def check_round_trip(qw: QuantizedWeight):
    packed = prepack(qw)
    assert isinstance(packed, PackedWeight)
    assert_same_qw(unpack(packed), qw)
    assert_bitwise(dequantize_reference(packed), dequantize_reference(qw))


# ===================================================================================== AWQ


@pytest.mark.parametrize("zeros", ["random", "mid"])
@pytest.mark.parametrize("group", GROUPS)
def test_awq_bit_exact(group, zeros):
    k, gs = shape_for(group)
    qweight, qzeros, scales = make_awq(k, gs, gen_for("awq", group, zeros), zeros)
    layer = from_awq(qweight, qzeros, scales)
    qw = layer.qweight
    assert layer.perm is None and layer.bias is None
    assert (qw.n, qw.k, qw.bits, qw.group_size) == (N, k, 4, gs)
    assert qw.symmetric == (zeros == "mid") and qw.dtype == FP16
    ref = awq_reference_dequant(qweight, qzeros, scales, gs)
    assert_bitwise(dequantize_reference(qw), ref)
    check_round_trip(qw)
    # the same layer kept asymmetric (zeros carried over) is exact too
    asym = from_awq(qweight, qzeros, scales, symmetric=False, group_size=-1 if group == "K" else gs)
    assert not asym.qweight.symmetric
    assert_bitwise(dequantize_reference(asym.qweight), ref)


def test_awq_other_activation_dtype_is_within_the_documented_bound():
    k, gs = shape_for(128)
    qweight, qzeros, scales = make_awq(k, gs, gen_for("awq-bf16"))
    qw = from_awq(qweight, qzeros, scales, dtype=BF16).qweight
    assert qw.dtype == BF16 and torch.equal(qw.scales, scales.t().to(BF16))
    ref = awq_reference_dequant(qweight, qzeros, scales, gs).double()  # fp16, the source
    got = dequantize_reference(qw).double()
    bound = (2 ** -7 + 2 ** -16 + 2 ** -11) * (ref.abs() / (1 - 2 ** -11))
    assert bool(((got - ref).abs() <= bound).all())
    assert not torch.equal(got, ref)  # bf16 is not bit-exact with the fp16 source


# ==================================================================================== GPTQ


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 128, "K"])   # 64 and 256: AWQ, compressed-tensors, HQQ
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_bit_exact(bits, group, sym, fmt, dtype):
    k, gs = shape_for(group)
    t = make_gptq(k, gs, bits, sym, fmt, dtype, gen_for("gptq", bits, group, sym, fmt, dtype))
    layer = from_gptq(**t, checkpoint_format=fmt, bits=bits)
    qw = layer.qweight
    assert layer.perm is None
    assert (qw.n, qw.k, qw.bits, qw.group_size, qw.dtype) == (N, k, bits, gs, dtype)
    assert qw.symmetric == sym
    ref = gptq_reference_dequant(**t, bits=bits, fmt=fmt)
    assert_bitwise(dequantize_reference(qw), ref)
    check_round_trip(qw)
    if sym:  # the symmetric layer, kept with its zero points, is the same weight
        asym = from_gptq(**t, checkpoint_format=fmt, symmetric=False).qweight
        assert not asym.symmetric and bool((asym.zeros == (1 << (bits - 1))).all())
        assert_bitwise(dequantize_reference(asym), ref)
    else:
        with pytest.raises(FormatError, match="symmetric=True"):
            from_gptq(**t, checkpoint_format=fmt, symmetric=True)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_v1_and_v2_zero_conventions(bits):
    k, gs = shape_for(64)
    gen = gen_for("v1v2", bits)
    q = rand_codes((k, N), bits, gen)
    z = rand_codes((k // gs, N), bits, gen)            # includes zero points of 0
    s = rand_scales((k // gs, N), FP16, gen)
    common = dict(qweight=gptq_pack(q, bits, 0), scales=s)
    v2 = gptq_pack(z, bits, 1)
    v1 = gptq_v2_to_v1(v2, bits)                        # GPTQModel's export, borrows included
    a = from_gptq(qzeros=v2, checkpoint_format="gptq_v2", **common).qweight
    b = from_gptq(qzeros=v1, checkpoint_format=GPTQCheckpointFormat.V1, **common).qweight
    assert_same_qw(a, b)
    assert torch.equal(a.zeros, z.t().to(FP16))
    # AutoGPTQ's own v1 packing (zeros - 1, for zero points >= 1) reads the same as GPTQModel's
    z1 = z.clamp(min=1)
    c = from_gptq(qzeros=gptq_pack(z1 - 1, bits, 1), checkpoint_format="gptq", **common)
    assert torch.equal(c.qweight.zeros, z1.t().to(FP16))
    # ... and per zero point, AutoGPTQ's torch path ((stored & mask) + 1) agrees with it
    stored = gptq_unpack(gptq_pack(z1 - 1, bits, 1), bits, 1)
    assert torch.equal(c.qweight.zeros, (stored + 1).t().to(FP16))
    # reading v1 data as v2 shifts every zero point by one: the parameter matters
    wrong = from_gptq(qzeros=gptq_pack(z1 - 1, bits, 1), checkpoint_format="gptq_v2",
                      symmetric=False, **common).qweight
    assert torch.equal(wrong.zeros + 1, c.qweight.zeros)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_act_order(bits, group, fmt):
    k, gs = shape_for(group)
    gen = gen_for("actorder", bits, group, fmt)
    g_idx = random_act_order_g_idx(k, gs, gen)
    t = make_gptq(k, gs, bits, False, fmt, FP16, gen, g_idx=g_idx)
    layer = from_gptq(**t, checkpoint_format=fmt, bits=bits, group_size=gs)
    perm = layer.perm
    assert perm is not None and perm.dtype == torch.int64 and perm.shape == (k,)
    assert torch.equal(torch.sort(perm).values, torch.arange(k))
    # after the permutation the groups are contiguous
    assert torch.equal(g_idx.long()[perm], torch.arange(k) // gs)
    w_src = gptq_reference_dequant(**t, bits=bits, fmt=fmt)       # [N, K], source order
    w_mix = dequantize_reference(layer.qweight)
    assert_bitwise(w_mix, w_src[:, perm])
    # x[..., perm] @ W_mix^T == x @ W_src^T, exactly in float64: the weights are multiples of
    # 2^-20 below 2^5 and x small integers, so every partial sum is exact in any order.
    x = torch.randint(-4, 5, (3, 5, k), generator=gen).double()
    y_src = x @ w_src.double().t()
    assert torch.equal(x[..., perm] @ w_mix.double().t(), y_src)
    assert torch.equal(layer.permute_input(x) @ w_mix.double().t(), y_src)
    check_round_trip(layer.qweight)


def test_gptq_contiguous_groups_with_shuffled_labels_need_no_perm():
    k, gs = shape_for(64)
    gen = gen_for("relabel")
    labels = torch.tensor([2, 0, 1])
    g_idx = labels.repeat_interleave(gs).to(torch.int32)       # contiguous, labels shuffled
    t = make_gptq(k, gs, 4, False, "gptq_v2", BF16, gen, g_idx=g_idx)
    layer = from_gptq(**t, checkpoint_format="gptq_v2")
    assert layer.perm is None
    assert_bitwise(dequantize_reference(layer.qweight),
                   gptq_reference_dequant(**t, bits=4, fmt="gptq_v2"))


def test_gptq_act_order_with_unequal_groups_is_refused():
    k, gs = shape_for(64)
    t = make_gptq(k, gs, 4, False, "gptq_v2", FP16, gen_for("unequal"))
    g_idx = torch.arange(k, dtype=torch.int32) // gs
    g_idx[0], g_idx[-1] = 1, 1                              # group 0 shrinks, group 1 grows
    t["g_idx"] = g_idx[torch.randperm(k, generator=gen_for("unequal-perm"))]
    with pytest.raises(UnsupportedLayerError, match="unequal sizes"):
        from_gptq(**t, checkpoint_format="gptq_v2")
    t["g_idx"] = torch.full((k,), 5, dtype=torch.int32)     # out of range
    with pytest.raises(FormatError, match=r"g_idx values must lie in \[0, 3\)"):
        from_gptq(**t, checkpoint_format="gptq_v2")
    t["g_idx"] = torch.zeros(k - 1, dtype=torch.int32)
    with pytest.raises(FormatError, match="g_idx has 191 entries"):
        from_gptq(**t, checkpoint_format="gptq_v2")


# ====================================================================== compressed-tensors


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("zp", ["sym", "packed-zp", "int8-zp"])
@pytest.mark.parametrize("group", [32, 128, 256, "K"])   # "K": the channel strategy, [N, 1]
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_compressed_tensors_bit_exact(bits, group, zp, dtype):
    k, gs = shape_for(group)
    sym = zp == "sym"
    t = make_ct(k, gs, bits, sym, dtype, gen_for("ct", bits, group, zp, dtype),
                zp_packed=zp == "packed-zp")
    assert t["weight_packed"].shape == (N, k * bits // 32)
    layer = from_compressed_tensors(**t)
    qw = layer.qweight
    assert layer.perm is None and qw.symmetric == sym
    assert (qw.n, qw.k, qw.bits, qw.group_size, qw.dtype) == (N, k, bits, gs, dtype)
    if sym:
        assert qw.qweight.dtype == torch.int8 and torch.equal(
            qw.qweight, ct_unpack(t["weight_packed"], bits, k))
    ref = ct_reference_dequant(**t, bits=bits)
    assert_bitwise(dequantize_reference(qw), ref)
    check_round_trip(qw)
    # bits and group_size from the config are checked, not needed
    again = from_compressed_tensors(**t, bits=bits, group_size=-1 if group == "K" else gs)
    assert_same_qw(again.qweight, qw)


def test_compressed_tensors_packer_matches_published_little_endian_layout():
    # 4-bit, symmetric: codes -8..7 stored as code + 8, element j of a word in bits 4j..4j+3
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7] * 8])
    packed = ct_pack(q, 4)
    assert packed.shape == (1, 8)
    assert int(packed[0, 0]) == int(np.array(0xFEBA9810, dtype=np.uint32).view(np.int32))


def test_compressed_tensors_act_order_and_placeholder_g_idx():
    k, gs = shape_for(64)
    gen = gen_for("ct-actorder")
    g_idx = random_act_order_g_idx(k, gs, gen)
    t = make_ct(k, gs, 4, False, BF16, gen, g_idx=g_idx)
    layer = from_compressed_tensors(**t)
    assert layer.perm is not None
    w_src = ct_reference_dequant(**t, bits=4)
    assert_bitwise(dequantize_reference(layer.qweight), w_src[:, layer.perm])
    x = torch.randint(-4, 5, (7, k), generator=gen).double()
    assert torch.equal(layer.permute_input(x) @ dequantize_reference(layer.qweight).double().t(),
                       x @ w_src.double().t())
    # older compressed-tensors store g_idx = -1 everywhere for "no act-order"
    t["weight_g_idx"] = torch.full((k,), -1, dtype=torch.int32)
    plain = from_compressed_tensors(**t)
    assert plain.perm is None
    assert_bitwise(dequantize_reference(plain.qweight), ct_reference_dequant(
        **{**t, "weight_g_idx": None}, bits=4))


# ===================================================================================== HQQ


@pytest.mark.parametrize("encoded", [True, False], ids=["encoded-meta", "plain-meta"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("group", [32, 64, 256, "K"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_hqq_integer_zeros_bit_exact(bits, group, dtype, encoded):
    k, gs = shape_for(group)
    t, meta = make_hqq(N, k, gs, bits, dtype, gen_for("hqq", bits, group, dtype, encoded),
                       encoded=encoded)
    layer = from_hqq(**t, meta=meta)
    qw = layer.qweight
    assert (qw.n, qw.k, qw.bits, qw.group_size, qw.dtype, qw.symmetric) == \
        (N, k, bits, gs, dtype, False)
    ref = hqq_reference_dequant(**t, bits=bits, shape=(N, k), dtype=dtype)
    assert_bitwise(dequantize_reference(qw), ref)
    check_round_trip(qw)


def test_hqq_view_as_float_and_symmetric_zeros():
    k, gs = shape_for(64)
    t, meta = make_hqq(N, k, gs, 4, BF16, gen_for("hqq-view"), zeros="mid")
    ref = hqq_reference_dequant(**t, bits=4, shape=(N, k), dtype=BF16)
    viewed = dict(t, W_q=t["W_q"].view(BF16))       # view_as_float=True storage
    layer = from_hqq(**viewed, meta={**meta, "view_as_float": hqq_encode(True)})
    assert layer.qweight.symmetric                   # every zero point is 8
    assert_bitwise(dequantize_reference(layer.qweight), ref)


def _ulp(v: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |v| (normal range), as float32."""
    mant = 7 if dtype == BF16 else 10
    return torch.exp2(torch.floor(torch.log2(v.abs().float())) - mant)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("group", [64, "K"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_hqq_fractional_zeros_within_the_bound(bits, group, dtype):
    """HQQ's optimizer leaves fractional zero points: they import as the nearest integer zero
    point plus a float32 offset per (row, group), and the weight is within 2 ulp of
    2^b * |scale| of HQQ's own formula (the bound from_hqq documents); prepack/unpack and the
    kernels' layout carry the offsets."""
    k, gs = shape_for(group)
    t, meta = make_hqq(N, k, gs, bits, dtype, gen_for("hqq-frac", bits, group, dtype), zeros="fractional")
    assert bool((t["zero"] != t["zero"].round()).any())
    qw = from_hqq(**t, meta=meta).qweight
    assert qw.zero_offsets is not None and qw.zero_offsets.shape == (N, k // gs)
    assert not qw.symmetric and bool((qw.zeros == qw.zeros.round()).all())
    ref = hqq_reference_dequant(**t, bits=bits, shape=(N, k), dtype=dtype).float()
    ours = dequantize_reference(qw).float()
    s = t["scale"].reshape(N, k // gs).repeat_interleave(gs, dim=1)
    bound = 2 * _ulp((1 << bits) * s, dtype)
    assert bool(((ours - ref).abs() <= bound).all()), float(((ours - ref).abs() / bound).max())
    if bits <= 4:   # (8-bit zero points near 255 keep no fraction in bf16/fp16 to lose)
        # the offsets matter: without them the same bound fails
        plain = dequantize_reference(dataclasses.replace(qw, zero_offsets=None)).float()
        assert not bool(((plain - ref).abs() <= bound).all())
    check_round_trip(qw)
    assert torch.equal(unpack(prepack(qw)).zero_offsets, qw.zero_offsets)


def test_hqq_out_of_range_zero_becomes_an_offset():
    k, gs = shape_for(64)
    t, meta = make_hqq(N, k, gs, 2, FP16, gen_for("hqq-range"))
    t["zero"][5] = 4.0                                   # 2-bit codes: integer zeros in [0, 3]
    qw = from_hqq(**t, meta=meta).qweight
    assert float(qw.zeros.max()) == 3 and qw.zero_offsets is not None
    ref = hqq_reference_dequant(**t, bits=2, shape=(N, k), dtype=FP16).float()
    s = t["scale"].reshape(N, k // gs).repeat_interleave(gs, dim=1)
    assert bool(((dequantize_reference(qw).float() - ref).abs() <= 2 * _ulp(4 * s, FP16)).all())
    with pytest.raises(FormatError, match="fractional"):
        from_hqq(**t, meta=meta, symmetric=True)


@pytest.mark.parametrize("change, error, match", [
    ({"axis": 0}, UnsupportedLayerError, "axis=0 is not supported"),
    ({"nbits": 3}, UnsupportedLayerError, "3-bit HQQ"),
    ({"nbits": 1.58}, UnsupportedLayerError, "1.58-bit HQQ"),
    ({"packing": "2bit_u8"}, FormatError, "packing '2bit_u8' does not match nbits=4"),
    ({"shape": torch.Size([N, 256])}, FormatError, "W_q must be"),
    ({"quant_zero": True}, UnsupportedLayerError, "quant_zero=True"),
    ({"channel_wise": False}, UnsupportedLayerError, "channel_wise=False"),
])
def test_hqq_refusals(change, error, match):
    k, gs = shape_for(64)
    t, meta = make_hqq(N, k, gs, 4, FP16, gen_for("hqq-err"))
    meta = {**meta, **{key: hqq_encode(v) for key, v in change.items()}}
    with pytest.raises(error, match=match):
        from_hqq(**t, meta=meta, name="blk")


# ========================================================= state dicts: detect/import layers


def awq_state(prefix, k, gs, gen):
    qweight, qzeros, scales = make_awq(k, gs, gen)
    return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}


def gptq_state(prefix, k, gs, gen, act_order=False, bits=4, fmt="gptq"):
    g_idx = random_act_order_g_idx(k, gs, gen) if act_order else None
    t = make_gptq(k, gs, bits, False, fmt, FP16, gen, g_idx=g_idx)
    return {f"{prefix}.{key}": v for key, v in t.items()}


def ct_state(prefix, k, gs, gen, sym=False):
    return {f"{prefix}.{key}": v for key, v in make_ct(k, gs, 4, sym, BF16, gen).items()}


def hqq_state(prefix, k, gs, gen):
    t, meta = make_hqq(N, k, gs, 4, FP16, gen)
    return {f"{prefix}.{key}": v for key, v in {**t, **meta}.items()}


STATE_BUILDERS = {Format.AWQ: awq_state, Format.GPTQ: gptq_state,
                  Format.COMPRESSED_TENSORS: ct_state, Format.HQQ: hqq_state}


@pytest.mark.parametrize("fmt", Format.importable(), ids=str)
def test_detect_and_import_layer(fmt):
    gen = gen_for("detect", fmt)
    tensors = STATE_BUILDERS[fmt]("model.layers.3.self_attn.o_proj", 192, 64, gen)
    bias = torch.randn(N, dtype=FP16)
    tensors["model.layers.3.self_attn.o_proj.bias"] = bias
    assert detect_format(tensors, "model.layers.3.self_attn.o_proj") is fmt
    assert detect_format(tensors, "model.layers.3.self_attn.o_proj") == fmt.value  # a str
    opts = {"checkpoint_format": "gptq"} if fmt is Format.GPTQ else {}
    layer = import_layer(fmt.value, tensors, "model.layers.3.self_attn.o_proj", **opts)
    auto = import_layer(None, tensors, "model.layers.3.self_attn.o_proj", **opts)
    assert isinstance(layer, ImportedLayer) and layer.bias is bias
    assert_same_qw(layer.qweight, auto.qweight)
    with pytest.raises(FormatError, match="'model.layers.9'.*no quantized weight"):
        detect_format(tensors, "model.layers.9")


def test_import_checkpoint_converts_layers_and_passes_the_rest_through():
    gen = gen_for("ckpt")
    tensors = {"model.embed_tokens.weight": torch.randn(10, 192, dtype=FP16)}
    tensors.update(gptq_state("model.layers.0.mlp.up_proj", 192, 64, gen, act_order=True))
    tensors["model.layers.0.mlp.up_proj.bias"] = torch.randn(N, dtype=FP16)
    tensors.update(gptq_state("model.layers.0.mlp.down_proj", 384, 128, gen, bits=8))
    tensors["model.norm.weight"] = torch.ones(192, dtype=FP16)
    out = import_checkpoint("gptq", tensors, checkpoint_format="gptq")
    assert list(out) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                         "model.layers.0.mlp.up_proj.perm", "model.layers.0.mlp.up_proj.bias",
                         "model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.bias",
                 "model.norm.weight"):
        assert out[name] is tensors[name]
    for p in ("model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"):
        layer = import_layer("gptq", tensors, p, checkpoint_format="gptq")
        packed = out[f"{p}.weight"]
        assert isinstance(packed, PackedWeight)
        assert_same_qw(unpack(packed), layer.qweight)
        if layer.perm is not None:
            assert torch.equal(out[f"{p}.perm"], layer.perm)
    assert out["model.layers.0.mlp.down_proj.weight"].bits == 8


@pytest.mark.parametrize("fmt", Format.importable(), ids=str)
def test_import_checkpoint_every_format_and_auto(fmt):
    gen = gen_for("ckpt-all", fmt)
    tensors = STATE_BUILDERS[fmt]("a.q_proj", 192, 32, gen)
    tensors.update(STATE_BUILDERS[fmt]("a.k_proj", 320, 320, gen))
    tensors["a.k_proj.bias"] = torch.zeros(N)
    tensors["lm_head.weight"] = torch.randn(N, 64)
    opts = {"checkpoint_format": "gptq"} if fmt is Format.GPTQ else {}
    for spec in (fmt, None, "auto"):
        out = import_checkpoint(spec, tensors, **opts)
        assert sorted(out) == ["a.k_proj.bias", "a.k_proj.weight", "a.q_proj.weight",
                               "lm_head.weight"]
        for p in ("a.q_proj", "a.k_proj"):
            want = import_layer(fmt, tensors, p, **opts).qweight
            assert_same_qw(unpack(out[f"{p}.weight"]), want)
        assert out["a.k_proj.weight"].group_size == 320


# ============================================================================ error paths


def test_awq_errors_name_the_layer():
    k, gs = shape_for(64)
    qweight, qzeros, scales = make_awq(k, gs, gen_for("awq-err"))
    with pytest.raises(FormatError, match=r"'L0'.*qzeros must be \[K/g, N/8\]"):
        from_awq(qweight, qzeros[:-1], scales, name="L0")
    with pytest.raises(FormatError, match=r"'L0'.*qweight must be \[K, N/8\]"):
        from_awq(qweight[:, :-1], qzeros, scales, name="L0")
    with pytest.raises(UnsupportedLayerError, match="'L0'.*8-bit AWQ GEMM"):
        from_awq(qweight, qzeros, scales, bits=8, name="L0")
    with pytest.raises(FormatError, match="'L0'.*group_size=128 means 2 groups"):
        from_awq(qweight, qzeros, scales, group_size=128, name="L0")
    with pytest.raises(FormatError, match="'L0'.*qweight must be torch.int32"):
        from_awq(qweight.to(torch.int64), qzeros, scales, name="L0")
    # N = 40 is not a multiple of 16; K = 96 is not a multiple of 64
    q40, z40, s40 = awq_pack(torch.zeros(192, 40, dtype=torch.int64)), \
        awq_pack(torch.zeros(3, 40, dtype=torch.int64)), torch.ones(3, 40, dtype=FP16)
    with pytest.raises(FormatError, match=r"'L1'.*N \(out_features\) % 16 == 0.*N=40"):
        from_awq(q40, z40, s40, name="L1")
    q96 = awq_pack(torch.zeros(96, N, dtype=torch.int64))
    with pytest.raises(FormatError, match=r"'L2'.*K=96"):
        from_awq(q96, qzeros[:3], scales[:3], name="L2")


def test_gptq_errors_name_the_layer():
    k, gs = shape_for(64)
    t = make_gptq(k, gs, 4, False, "gptq", FP16, gen_for("gptq-err"))
    with pytest.raises(FormatError, match="'L'.*bits=8 does not match qzeros"):
        from_gptq(**t, checkpoint_format="gptq", bits=8, name="L")
    with pytest.raises(FormatError, match="'L'.*qzeros has 2 groups, scales 3"):
        from_gptq(**{**t, "qzeros": t["qzeros"][:2]}, checkpoint_format="gptq", name="L")
    with pytest.raises(FormatError, match=r"'L'.*qweight must be \[K\*bits/32, N\]"):
        from_gptq(**{**t, "qweight": t["qweight"][:, :32]}, checkpoint_format="gptq", name="L")
    with pytest.raises(ValueError, match="unknown GPTQ checkpoint_format 'marlin'"):
        from_gptq(**t, checkpoint_format="marlin", name="L")
    three_bit = dict(qweight=torch.zeros(k * 3 // 32, 64, dtype=torch.int32),
                     qzeros=torch.zeros(3, 64 * 3 // 32, dtype=torch.int32),
                     scales=torch.ones(3, 64, dtype=FP16))          # N = 64: 3-bit packs
    with pytest.raises(UnsupportedLayerError, match="'L'.*3-bit GPTQ"):
        from_gptq(**three_bit, checkpoint_format="gptq", name="L")
    tensors = {f"x.{key}": v for key, v in t.items()}
    with pytest.raises(FormatError, match="'x'.*checkpoint_format='gptq'"):
        import_layer("gptq", tensors, "x")
    del tensors["x.qzeros"]
    with pytest.raises(FormatError, match="'x'.*missing its companion tensor 'x.qzeros'"):
        import_layer("gptq", tensors, "x", checkpoint_format="gptq")


def test_compressed_tensors_errors_name_the_layer():
    k, gs = shape_for(64)
    t = make_ct(k, gs, 4, False, BF16, gen_for("ct-err"))
    with pytest.raises(FormatError, match="'c'.*bits=8 does not match weight_packed"):
        from_compressed_tensors(**t, bits=8, name="c")
    with pytest.raises(FormatError, match=r"'c'.*weight_shape \[32, 192\] does not match"):
        from_compressed_tensors(**{**t, "weight_shape": torch.tensor([32, k])}, name="c")
    with pytest.raises(UnsupportedLayerError, match="'c'.*'tensor' strategy"):
        from_compressed_tensors(**{**t, "weight_scale": torch.ones(1, dtype=BF16),
                                   "weight_zero_point": None}, name="c")
    with pytest.raises(FormatError, match="'c'.*weight_zero_point must be int32"):
        from_compressed_tensors(**{**t, "weight_zero_point": torch.zeros(5, 3)}, name="c")
    with pytest.raises(FormatError, match=r"'c'.*integers in \[-8, 7\]"):
        from_compressed_tensors(**{**t, "weight_zero_point": torch.full((N, 3), 9)}, name="c")
    with pytest.raises(FormatError, match="'c'.*pass weight_shape"):
        from_compressed_tensors(**{**t, "weight_shape": None}, name="c")
    with pytest.raises(FormatError, match="'c'.*K=160"):
        from_compressed_tensors(**{**t, "weight_shape": torch.tensor([N, 160])}, name="c")
    fp32 = {**t, "weight_scale": t["weight_scale"].float()}
    with pytest.raises(FormatError, match="'c'.*scales are torch.float32; pass dtype"):
        from_compressed_tensors(**fp32, name="c")
    exact = from_compressed_tensors(**fp32, dtype="bf16", name="c")   # bf16 values: exact
    assert_bitwise(dequantize_reference(exact.qweight), ct_reference_dequant(**t, bits=4))


def test_import_checkpoint_errors():
    gen = gen_for("ckpt-err")
    tensors = gptq_state("m.l0", 192, 64, gen)
    with pytest.raises(FormatError, match="'m.l1'.*'m.l1.qzeros' belongs to a gptq layer"):
        import_checkpoint("gptq", {**tensors, "m.l1.qzeros": tensors["m.l0.qzeros"]},
                          checkpoint_format="gptq")
    with pytest.raises(FormatError, match="'m.l0'.*plain tensor 'm.l0.weight'"):
        import_checkpoint("gptq", {**tensors, "m.l0.weight": torch.zeros(N, 192)},
                          checkpoint_format="gptq")
    with pytest.raises(FormatError, match="'m.l0'.*qweight must be"):  # AWQ read as GPTQ
        import_checkpoint("gptq", awq_state("m.l0", 192, 64, gen), checkpoint_format="gptq")
    with pytest.raises(FormatError, match="'x.w'.*'x.w.weight_scale' belongs to a "
                                          "compressed-tensors layer"):
        import_checkpoint(None, {"x.w.weight_scale": torch.ones(N, 1), "x.w.weight": torch.ones(
            N, 64)})
    with pytest.raises(ValueError, match="unknown checkpoint format 'gguf'"):
        import_checkpoint("gguf", tensors)
    odd = awq_state("m.odd", 192, 64, gen)
    odd["m.odd.qweight"] = odd["m.odd.qweight"][:, :5]  # N = 40 from qweight vs 48 in scales
    with pytest.raises(FormatError, match="'m.odd'.*neither GPTQ"):
        import_checkpoint("auto", odd)


def test_symmetric_flag_is_validated():
    k, gs = shape_for(64)
    qweight, qzeros, scales = make_awq(k, gs, gen_for("sym-flag"))
    with pytest.raises(TypeError, match="symmetric must be True, False or None"):
        from_awq(qweight, qzeros, scales, symmetric="yes")
    with pytest.raises(FormatError, match="symmetric=True, but .* zero points differ from"):
        from_awq(qweight, qzeros, scales, symmetric=True)
    t = make_ct(k, gs, 4, True, BF16, gen_for("sym-flag-ct"))
    asym = from_compressed_tensors(**t, symmetric=False).qweight   # adds zero points of 8
    assert not asym.symmetric and bool((asym.zeros == 8).all())
    assert_bitwise(dequantize_reference(asym), ct_reference_dequant(**t, bits=4))
