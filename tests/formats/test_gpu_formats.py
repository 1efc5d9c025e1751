"""The GEMM on imported checkpoint layers (AWQ, GPTQ incl. act-order, compressed-tensors, HQQ)
matches each source format's own dequantization, on the GPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import mixgemm
from mixgemm import formats

import reference_packers as rp   # the formats' independent reference packers (tests/reference_packers.py)

pytestmark = pytest.mark.gpu


def _check(layer: formats.ImportedLayer, w_ref: torch.Tensor, dev, k: int):
    packed = mixgemm.prepack(layer.qweight).to(dev)
    dtype = packed.dtype
    x = torch.randn(37, k, device=dev, dtype=dtype)
    y = mixgemm.gemm(layer.permute_input(x), packed)
    ref = x.double() @ w_ref.to(dev).double().T          # the source format's own formula
    err = ((y.double() - ref).norm() / ref.norm()).item()
    # only the fp32 accumulation and the final rounding of y differ (see test_gpu_gemm.tolerance)
    assert err < (6e-3 if dtype == torch.bfloat16 else 1e-3), err


@pytest.mark.parametrize("group", [64, 128])
def test_awq(requires_gpu, group):
    k, gs = rp.shape_for(group)
    qweight, qzeros, scales = rp.make_awq(k, gs, rp.gen_for("gpu-awq", group))
    w_ref = rp.awq_reference_dequant(qweight, qzeros, scales, gs)
    _check(formats.from_awq(qweight, qzeros, scales), w_ref, requires_gpu, k)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq(requires_gpu, bits, sym, act_order):
    k, gs = rp.shape_for(128)
    gen = rp.gen_for("gpu-gptq", bits, sym, act_order)
    g_idx = rp.random_act_order_g_idx(k, gs, gen) if act_order else None
    t = rp.make_gptq(k, gs, bits, sym, "gptq", torch.float16, gen, g_idx=g_idx)
    w_ref = rp.gptq_reference_dequant(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, "gptq")
    layer = formats.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=bits,
                              checkpoint_format="gptq")
    assert (layer.perm is not None) == act_order
    _check(layer, w_ref, requires_gpu, k)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors(requires_gpu, bits, sym):
    k, gs = rp.shape_for(128)
    t = rp.make_ct(k, gs, bits, sym, torch.bfloat16, rp.gen_for("gpu-ct", bits, sym))
    w_ref = rp.ct_reference_dequant(t["weight_packed"], t["weight_scale"], t["weight_shape"], bits,
                                    t.get("weight_zero_point"))
    layer = formats.from_compressed_tensors(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                            t.get("weight_zero_point"), bits=bits)
    _check(layer, w_ref, requires_gpu, k)


@pytest.mark.parametrize("bits", [2, 4])
def test_hqq_integer_zeros(requires_gpu, bits):
    k, gs = rp.shape_for(64)
    t, meta = rp.make_hqq(rp.N, k, gs, bits, torch.float16, rp.gen_for("gpu-hqq", bits), encoded=False)
    w_ref = rp.hqq_reference_dequant(t["W_q"], t["scale"], t["zero"], bits, (rp.N, k), torch.float16)
    _check(formats.from_hqq(t["W_q"], t["scale"], t["zero"], meta), w_ref, requires_gpu, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits", [2, 4])
def test_hqq_fractional_zeros_every_path(requires_gpu, bits, dtype):
    """HQQ with fractional zero points: the kernels' integer zero points plus the float32 offsets
    added after them, on the decode and GEMM paths, with and without a fused activation, against
    float64 on the weight mixgemm computes with (within the documented bound of HQQ's own)."""
    dev = requires_gpu
    k, gs = rp.shape_for(64)
    t, meta = rp.make_hqq(rp.N, k, gs, bits, dtype, rp.gen_for("gpu-hqq-frac", bits, str(dtype)),
                          zeros="fractional", encoded=False)
    qw = formats.from_hqq(t["W_q"], t["scale"], t["zero"], meta).qweight
    packed = mixgemm.prepack(qw).to(dev)
    assert packed.zero_offsets is not None
    # the exact weight: (q - z_int) * s in the activation dtype, plus the float32 offsets
    base = mixgemm.dequantize_reference(dataclasses.replace(qw, zero_offsets=None)).double()
    w = (base + qw.zero_offsets.double().repeat_interleave(gs, dim=1)).to(dev)
    tol = 6e-3 if dtype == torch.bfloat16 else 1e-3
    for m in (1, 16, 100, 300):
        x = torch.randn(m, k, device=dev, dtype=dtype)
        lin = x.double() @ w.T
        for act, ref in ((None, lin), ("silu", torch.nn.functional.silu(lin))):
            y = mixgemm.gemm(x, packed, activation=act)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < 2 * tol, (m, act, err)
    assert torch.equal(mixgemm.dequantize(packed), mixgemm.dequantize_reference(packed))
    layer = mixgemm.nn.QuantLinear.from_packed(packed)
    x = torch.randn(4, k, device=dev, dtype=dtype)
    assert torch.equal(layer(x), mixgemm.gemm(x, packed))
