"""The gguf package's own dequantization of a GGUF file, and the checks of an imported tensor
against it (bit for bit, or within the bounds documented in mixgemm.formats.gguf): shared by
tests/formats/test_formats_gguf.py and tests/formats/test_gguf_smollm2.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mixgemm

gguf = pytest.importorskip("gguf")

FP16 = torch.float16


def gguf_reference(path):
    """name -> (type name, float32 tensor in the usual [N, K] order): gguf's own dequantize."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = [int(v) for v in reversed(t.shape.tolist())]
        values = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        out[t.name] = (t.tensor_type.name, torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape))
    return out


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
        f"{int((a.view(torch.int16) != b.view(torch.int16)).sum())} of {a.numel()} elements differ"


def exact_parts(qw: mixgemm.QuantizedWeight):
    """float64 ``(q - z) * s`` and the offsets, expanded to [N, K]."""
    g = qw.group_size
    q = qw.qweight.double()
    z = 0.0 if qw.zeros is None else qw.zeros.double().repeat_interleave(g, 1)
    p = (q - z) * qw.scales.double().repeat_interleave(g, 1)
    o = torch.zeros_like(p) if qw.zero_offsets is None else qw.zero_offsets.double().repeat_interleave(g, 1)
    return p, o


def documented_bound(kind: str, dtype, w: torch.Tensor, p16: torch.Tensor, o: torch.Tensor):
    """The element-wise bounds of mixgemm.formats.gguf on |dequantize_reference - w|, with
    2^-24 |w| for the gguf package's own float32 rounding of q*d + m and 2^-24 |o| for an offset
    that float32 cannot hold exactly (``p16``: (q - z)*d with the fp16 d, exact)."""
    w, p16 = w.abs(), p16.abs()
    slack = 2.0 ** -24 * (w + o.abs())
    if dtype == FP16:
        if kind != "Q4_1":
            return None                                       # bit-exact
        return 2.0 ** -11 * (1 + 2.0 ** -10) * (w + p16) + 2.0 ** -23 + slack
    if kind != "Q4_1":
        return (2.0 ** -7 + 2.0 ** -16) * w + slack
    return 2.0 ** -8 * (1 + 2.0 ** -14) * w + 2.0 ** -7 * (1 + 2.0 ** -6) * p16 + slack


def check_against_gguf(kind, qw16, qw_other, dtype, w):
    """Everything the docstring promises for one tensor: fp16 bit-exact (Q8_0, Q4_0), the
    bounds otherwise, the GEMM's own weight fl16(p) + o within 2^-11 |p| (+ 2^-25), and the
    round trip through prepack. Returns the fraction of elements equal to w rounded to dtype."""
    qw = qw16 if dtype == FP16 else qw_other
    got = mixgemm.dequantize_reference(qw)
    assert_bitwise(mixgemm.dequantize_reference(mixgemm.prepack(qw)), got)
    p16, o = exact_parts(qw16)
    w64 = w.double()
    bound = documented_bound(kind, dtype, w64, p16, o)
    if bound is None:
        assert_bitwise(got, w.to(dtype))
    else:
        err = (got.double() - w64).abs()
        assert bool((err <= bound).all()), f"worst error / bound {(err / bound).max().item():.4f}"
    if kind == "Q4_1" and dtype == FP16:
        eff = p16.to(FP16).double() + o.float().double()      # what the GEMM computes with
        bound = 2.0 ** -11 * p16.abs() + 2.0 ** -25 + 2.0 ** -24 * (w64.abs() + o.abs())
        assert bool(((eff - w64).abs() <= bound).all())
    return (got.view(torch.int16) == w.to(dtype).view(torch.int16)).double().mean().item()
