"""Bad input to the Python API gets a clear error before anything runs (no GPU needed: every
check here happens before a kernel is chosen, loaded or launched), and edge values work."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixgemm
from mixgemm.errors import UnsupportedLayerError
from mixgemm.nn import QuantLinear, quantize_model


def first_line(excinfo) -> str:
    return str(excinfo.value).splitlines()[0]


@pytest.fixture(scope="module")
def packed():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    return mixgemm.prepack(mixgemm.quantize(w, 4, 64))


@pytest.mark.parametrize("case,x,exc,message", [
    ("CPU tensors", lambda: torch.randn(2, 128, dtype=torch.bfloat16), ValueError,
     "mixgemm kernels run on CUDA tensors, got a tensor on cpu"),
    ("float32 x", lambda: torch.randn(2, 128), TypeError, "x must be bfloat16 or float16, got torch.float32"),
    ("integer x", lambda: torch.ones(2, 128, dtype=torch.int32), TypeError,
     "x must be bfloat16 or float16, got torch.int32"),
    ("the wrong K", lambda: torch.randn(2, 64, dtype=torch.bfloat16), ValueError, "x has K=64 but w has K=128"),
])
def test_gemm_refuses(packed, case, x, exc, message, pin_case, monkeypatch):
    if case == "the wrong K":     # the device comes first: pretend the CPU is a usable GPU to reach K
        monkeypatch.setattr(mixgemm.dispatch.checks, "device_problem", lambda device: None)
    with pytest.raises(exc) as excinfo:
        mixgemm.gemm(x(), packed)
    assert first_line(excinfo) == message
    ok, why = mixgemm.supports(tuple(x().shape), packed, x().dtype)
    assert not ok and why
    pin_case("API", f"gemm with {case}", "mixgemm.gemm(x, w)", type(excinfo.value).__name__, message)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in memory that starts 8 bytes past a 16-byte boundary."""
    raw = torch.empty(t.numel() * t.element_size() + 32, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 16 + 8
    out = raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 == 8
    return out


def test_the_device_is_the_reason_before_the_alignment(packed, pin_case):
    """A CPU weight whose tensors are only 8-byte aligned (what mixgemm.load returned before it
    aligned them): the reason is the device, not the alignment."""
    import dataclasses
    bad = dataclasses.replace(packed, qdata=_misaligned(packed.qdata), scales=_misaligned(packed.scales))
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    message = "mixgemm kernels run on CUDA tensors, got a tensor on cpu"
    assert mixgemm.supports(tuple(x.shape), bad, x.dtype) == (False, message)
    with pytest.raises(ValueError) as excinfo:
        mixgemm.gemm(x, bad)
    assert first_line(excinfo) == message
    pin_case("API", "gemm with a CPU weight that is only 8-byte aligned", "mixgemm.gemm(x, w)", "ValueError", message)


def test_dequantize_refuses_cpu_weights(packed):
    with pytest.raises(ValueError, match="mixgemm kernels run on CUDA tensors"):
        mixgemm.dequantize(packed)


@pytest.mark.parametrize("in_features,group_size,why", [
    (96, 32, "in_features=96 is not a multiple of 64"),
    (100, 128, "in_features=100 is not a multiple of 64"),
])
def test_from_linear_refuses_an_unsupported_shape(in_features, group_size, why, pin_case):
    with pytest.raises(UnsupportedLayerError) as excinfo:
        QuantLinear.from_linear(nn.Linear(in_features, 64), bits=4, group_size=group_size)
    assert isinstance(excinfo.value, ValueError)
    assert first_line(excinfo) == (f"QuantLinear.from_linear: {why} (mixgemm's kernels need out_features % 16 == 0 "
                                   f"and in_features % 64 == 0; quantize_model keeps such a layer as nn.Linear)")
    pin_case("API", f"QuantLinear.from_linear with in_features={in_features}",
             f"QuantLinear.from_linear(nn.Linear({in_features}, 64), group_size={group_size})",
             "UnsupportedLayerError (a ValueError)", first_line(excinfo))


def test_quantize_model_keeps_an_unsupported_layer(pin_case):
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 96), nn.Linear(96, 64)).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = quantize_model(model, bits=4, group_size=32, progress=False)
    assert summary.replaced == ["0", "2"]
    assert type(model[3]) is nn.Linear and summary.skipped == {"3": "in_features=96 is not a multiple of 64"}
    (warning,) = [w for w in caught if "mixgemm" in str(w.message)]
    assert str(warning.message) == "mixgemm.quantize_model: keeping 3 as nn.Linear: in_features=96 is not a multiple of 64"
    pin_case("API", "quantize_model with one layer of in_features=96", "quantize_model(model, group_size=32)",
             "UserWarning; the layer stays nn.Linear", str(warning.message))


@pytest.mark.parametrize("bad,shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf")])
def test_quantize_names_the_non_finite_position(bad, shown, pin_case):
    w = torch.randn(16, 128)
    w[3, 77] = bad
    with pytest.raises(ValueError) as excinfo:
        mixgemm.quantize(w, 4, 64)
    assert first_line(excinfo) == f"w contains non-finite values (NaN or inf), e.g. w[3, 77] = {shown}"
    pin_case("Values", f"quantize of a weight with {shown}", "mixgemm.quantize(w, 4, 64)", "ValueError",
             first_line(excinfo))


@pytest.mark.parametrize("call,exc,message,case", [
    (lambda w: mixgemm.quantize(w, 3, 64), ValueError, "bits must be one of (8, 4, 2), got 3", "bits=3"),
    (lambda w: mixgemm.quantize(w[:, :96], 4, 64), ValueError, "K=96 is not divisible by group_size=64",
     "a group size that does not divide K"),
    (lambda w: mixgemm.prepack(mixgemm.quantize(w[:24], 4, 64)), ValueError,
     "the sm90a layout needs N % 16 == 0 and K % 64 == 0, got N=24, K=128", "N not a multiple of 16 (prepack)"),
])
def test_option_errors_in_the_api(call, exc, message, case, pin_case):
    with pytest.raises(exc) as excinfo:
        call(torch.randn(32, 128))
    assert first_line(excinfo) == message
    pin_case("Options", f"{case} (API)", "mixgemm.quantize / mixgemm.prepack", type(excinfo.value).__name__, message)


@pytest.mark.parametrize("bits,symmetric", [(8, False), (4, False), (2, False), (8, True), (4, True), (2, True)])
def test_zero_and_constant_groups_round_trip(tmp_path, bits, symmetric, pin_case):
    """All-zero and constant groups: finite positive scales, all-zero groups dequantize to
    exactly zero, and the codes/scales/zeros survive prepack -> save -> load -> unpack exactly."""
    w = torch.zeros(32, 256, dtype=torch.bfloat16)
    w[1, 64:128] = 0.3
    w[2, 128:192] = -0.7
    w[3, :] = 5.0
    qw = mixgemm.quantize(w, bits, 64, symmetric=symmetric)
    assert bool(torch.isfinite(qw.scales).all()) and bool((qw.scales > 0).all())
    if qw.zeros is not None:
        assert bool(torch.isfinite(qw.zeros).all())
    deq = mixgemm.dequantize_reference(qw)
    assert bool(torch.isfinite(deq).all())
    assert torch.equal(deq[0], torch.zeros(256, dtype=torch.bfloat16))
    assert torch.equal(deq[1, :64], torch.zeros(64, dtype=torch.bfloat16))
    # constant groups stay within the error bound (s/2 + half an ulp)
    err = (deq.float() - w.float()).abs()
    bound = qw.scales.float().repeat_interleave(64, dim=1) / 2 + deq.float().abs() * 2 ** -8
    assert bool((err <= bound).all())
    path = tmp_path / "w.safetensors"
    mixgemm.save(path, {"w": mixgemm.prepack(qw)})
    back = mixgemm.unpack(mixgemm.load(path)["w"])
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
    assert (qw.zeros is None and back.zeros is None) or torch.equal(back.zeros, qw.zeros)
    assert torch.equal(mixgemm.dequantize_reference(back), deq)
    if (bits, symmetric) == (4, False):
        pin_case("Values", "all-zero and constant groups", "quantize -> prepack -> save -> load -> unpack",
                 "finite scales; exact round trip", "(no error)")
