"""QuantLinear, quantize_model and the custom op's fake implementation (CPU)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixgemm
from mixgemm.nn import QuantLinear, quantize_model


def _linear(n=64, k=128, bias=True, dtype=torch.bfloat16):
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=bias)
    return lin.to(dtype)


def test_from_linear_matches_quantize_and_prepack():
    lin = _linear()
    q = QuantLinear.from_linear(lin, bits=4, group_size=64)
    ref = mixgemm.prepack(mixgemm.quantize(lin.weight.detach(), 4, 64))
    assert torch.equal(q.qdata, ref.qdata) and torch.equal(q.scales, ref.scales)
    assert torch.equal(q.zeros, ref.zeros) and torch.equal(q.bias, lin.bias.detach())
    assert q.packed.weight_type is mixgemm.WeightType.U4
    r = repr(q)
    for part in ("in_features=128", "out_features=64", "bits=4", "group_size=64", "symmetric=False",
                 "layout=sm90a/v1"):
        assert part in r


@pytest.mark.parametrize("bits,sym", [(8, True), (4, False), (2, True), (2, False)])
def test_state_dict_round_trip_exact(bits, sym):
    src = QuantLinear.from_linear(_linear(bias=not sym), bits=bits, group_size=128, symmetric=sym)
    sd = src.state_dict()
    assert "_extra_state" in sd and sd["_extra_state"]["weight_type"] == src.weight_type.value
    dst = QuantLinear(128, 64, bits=bits, group_size=128, symmetric=sym, bias=not sym)
    dst.load_state_dict(sd)
    for name, t in src.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, dst.state_dict()[name]), name
    assert dst.packed.weight_type is src.packed.weight_type


def test_state_dict_metadata_mismatch_refused():
    sd = QuantLinear.from_linear(_linear(), bits=4, group_size=64).state_dict()
    with pytest.raises((ValueError, RuntimeError), match="mismatch|size"):
        QuantLinear(128, 64, bits=4, group_size=128).load_state_dict(sd)
    sd["_extra_state"] = dict(sd["_extra_state"], layout_version=99)
    with pytest.raises((ValueError, RuntimeError), match="upgrade"):
        QuantLinear(128, 64, bits=4, group_size=64).load_state_dict(sd)


def test_act_order_perm_round_trips_through_state_dict():
    lin = _linear()
    base = QuantLinear.from_linear(lin, bits=4, group_size=64)
    perm = torch.randperm(128)
    q = QuantLinear.from_packed(base.packed, bias=lin.bias.detach(), perm=perm)
    dst = QuantLinear(128, 64, bits=4, group_size=64)
    dst.load_state_dict(q.state_dict())
    assert torch.equal(dst.perm, perm)


def test_bad_constructions():
    with pytest.raises(ValueError, match="in_features % 64"):
        QuantLinear(100, 64)
    with pytest.raises(ValueError, match="group_size"):
        QuantLinear(128, 64, group_size=48)
    with pytest.raises(TypeError, match="dtype"):
        QuantLinear(128, 64, dtype=torch.float32)
    with pytest.raises(TypeError, match="PackedWeight"):
        QuantLinear.from_packed(torch.zeros(3))


def test_zero_offsets_round_trip_through_state_dict():
    """A layer imported with fractional zero points keeps its offsets through the state dict
    (the buffer is created on load, like perm) and through .packed."""
    import dataclasses

    base = QuantLinear.from_linear(_linear(), bits=4, group_size=64)
    qw = mixgemm.unpack(base.packed)
    offsets = torch.randn(qw.n, qw.k // 64) * 1e-3
    q = QuantLinear.from_packed(mixgemm.prepack(dataclasses.replace(qw, zero_offsets=offsets)))
    dst = QuantLinear(128, 64, bits=4, group_size=64, bias=False)
    assert dst.zero_offsets is None
    dst.load_state_dict(q.state_dict())
    assert torch.equal(dst.zero_offsets, offsets.t()) and torch.equal(dst.packed.zero_offsets, offsets.t())


def test_fake_impl_gives_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q = QuantLinear.from_linear(_linear(n=80, k=192), bits=2, group_size=64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, 5, 192, dtype=torch.bfloat16)
        y = q(x)
        assert y.shape == (3, 5, 80) and y.dtype == torch.bfloat16


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128, bias=False)
        self.odd = nn.Linear(100, 64)              # K % 64 != 0: stays nn.Linear
        self.lm_head = nn.Linear(128, 512)         # skipped by name


def test_quantize_model_replaces_skips_and_warns():
    m = _Block().to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = quantize_model(m, bits=4, group_size=64, progress=False)
    assert isinstance(m.up, QuantLinear) and isinstance(m.down, QuantLinear)
    assert type(m.odd) is nn.Linear and type(m.lm_head) is nn.Linear
    assert sorted(summary.replaced) == ["down", "up"]
    assert "in_features=100" in summary.skipped["odd"] and summary.skipped["lm_head"] == "matches skip"
    assert any("keeping odd as nn.Linear" in str(w.message) for w in caught)
    assert summary.bytes_before == 2 * 2 * 128 * 256
    assert summary.bytes_after == m.up.packed.nbytes + m.down.packed.nbytes < summary.bytes_before
    assert "replaced 2 Linear layers" in str(summary)


def test_gate_up_layer_interleaves_and_round_trips():
    """from_gate_up: each projection quantized on its own, rows interleaved in 8-row stripes, the
    state dict round-trips (with the activation and the stripe as metadata), and the fake op
    gives [.., I]."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    gate, up = _linear(n=96, k=128), _linear(n=96, k=128)
    up.weight.data.mul_(-0.5)
    layer = QuantLinear.from_gate_up(gate, up, bits=4, group_size=64)
    assert layer.activation == "swiglu" and layer.out_features == 96 and layer.weight_rows == 192
    deq = mixgemm.dequantize_reference(layer.packed)
    dg = mixgemm.dequantize_reference(mixgemm.quantize(gate.weight.detach(), 4, 64, dtype=torch.bfloat16))
    du = mixgemm.dequantize_reference(mixgemm.quantize(up.weight.detach(), 4, 64, dtype=torch.bfloat16))
    stripes = deq.view(96 // 8, 2, 8, 128)
    assert torch.equal(stripes[:, 0].reshape(96, 128), dg) and torch.equal(stripes[:, 1].reshape(96, 128), du)
    assert layer.state_dict()["_extra_state"]["gate_up_stripe"] == 8
    b = layer.bias.view(96 // 8, 2, 8)
    assert torch.equal(b[:, 0].reshape(-1), gate.bias.detach().to(torch.bfloat16))
    assert torch.equal(b[:, 1].reshape(-1), up.bias.detach().to(torch.bfloat16))

    fresh = QuantLinear(128, 96, bits=4, group_size=64, activation="swiglu")
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.qdata, layer.qdata) and fresh.activation == "swiglu"
    with pytest.raises(ValueError, match="mismatch"):
        QuantLinear(128, 96, bits=4, group_size=64).load_state_dict(layer.state_dict())
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = layer(torch.empty(2, 128, dtype=torch.bfloat16))
        assert y.shape == (2, 96)
    with pytest.raises(ValueError, match="same shape"):
        QuantLinear.from_gate_up(gate, _linear(n=80, k=128))


@pytest.mark.parametrize("symmetric", (False, True))
def test_gate_up_state_from_mixgemm_0_1_is_restriped(symmetric):
    """A swiglu layer saved by mixgemm 0.1 (16-row stripes, no stripe in its metadata) loads into
    today's 8-row layout exactly: the same buffers as from_gate_up builds."""
    from mixgemm.weights.quantize import interleave_rows

    gate, up = _linear(n=96, k=128), _linear(n=96, k=128)
    up.weight.data.mul_(-0.5)
    new = QuantLinear.from_gate_up(gate, up, bits=2, group_size=64, symmetric=symmetric)
    qg = mixgemm.quantize(gate.weight.detach(), 2, 64, symmetric=symmetric, dtype=torch.bfloat16)
    qu = mixgemm.quantize(up.weight.detach(), 2, 64, symmetric=symmetric, dtype=torch.bfloat16)
    old_qw = mixgemm.QuantizedWeight(
        interleave_rows(qg.qweight, qu.qweight, 16), interleave_rows(qg.scales, qu.scales, 16),
        None if symmetric else interleave_rows(qg.zeros, qu.zeros, 16), 2, 64, symmetric)
    old_bias = interleave_rows(gate.bias.detach(), up.bias.detach(), 16)
    old = QuantLinear.from_packed(mixgemm.prepack(old_qw), bias=old_bias)
    old.activation, old.out_features = "swiglu", 96
    state = old.state_dict()
    state["_extra_state"] = {k: v for k, v in state["_extra_state"].items() if k != "gate_up_stripe"}
    assert not torch.equal(state["qdata"], new.qdata)

    fresh = QuantLinear(128, 96, bits=2, group_size=64, symmetric=symmetric, activation="swiglu")
    fresh.load_state_dict(state)
    for name in ("qdata", "scales", "zeros", "bias"):
        a, b = getattr(fresh, name), getattr(new, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    # a state whose stripe is neither today's nor 0.1's is refused, not misread
    bad = new.state_dict()
    bad["_extra_state"] = {**bad["_extra_state"], "gate_up_stripe": 4}
    with pytest.raises(ValueError):
        QuantLinear(128, 96, bits=2, group_size=64, symmetric=symmetric, activation="swiglu").load_state_dict(bad)


# ---------------------------------------------------------------------------------------------
# act_format="fp8" and the static input scale
# ---------------------------------------------------------------------------------------------
def test_act_format_defaults_and_refusals():
    q = QuantLinear(128, 64)
    assert q.act_format == "bf16" and q.input_scale is None
    assert "act_format" not in q.state_dict()["_extra_state"]           # the default state is unchanged
    assert QuantLinear(128, 64, bits=2, act_format="fp8").act_format == "fp8"
    assert QuantLinear(128, 64, activation="swiglu", act_format="fp8").act_format == "fp8"   # the gated e4m3 kernel
    assert QuantLinear(128, 64, bits=8, act_format="auto").act_format == "auto"   # always exact, for 8-bit codes
    for kw, msg in ((dict(act_format="e4m3"), "act_format must be one of ('bf16', 'fp8', 'auto'), got 'e4m3'"),
                    (dict(bits=8, act_format="fp8"), "act_format='fp8' takes u4, s4, u2 and s2 weights")):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            QuantLinear(128, 64, **kw)
    with pytest.raises(ValueError, match="act_format='fp8' takes u4"):
        QuantLinear(128, 64, bits=8).set_act_format("fp8")
    with pytest.raises(ValueError, match="act_format='fp8' takes u4"):
        QuantLinear.from_packed(QuantLinear(128, 64, bits=8).packed, act_format="fp8")


@pytest.mark.parametrize("scale,msg", [
    (torch.tensor(0.0), "input_scale must be positive and finite, got 0.0"),
    (torch.tensor([float("nan")]), "input_scale must be positive and finite, got nan"),
    (torch.tensor([1.0, 2.0]), "input_scale must be a floating-point tensor of one element, got [2]"),
    (torch.tensor(3), "input_scale must be a floating-point tensor of one element"),
])
def test_input_scale_refused(scale, msg):
    q = QuantLinear(128, 64, act_format="fp8")
    with pytest.raises(ValueError) as excinfo:
        q.set_input_scale(scale)
    assert str(excinfo.value).startswith(msg) and q.input_scale is None


def test_input_scale_and_act_format_round_trip_through_state_dict():
    """The scale is stored float32 (a bf16 checkpoint value converted exactly); act_format is in
    the metadata; a bf16 module refuses an fp8 state and the other way round."""
    lin = _linear()
    base = QuantLinear.from_linear(lin, bits=4, group_size=64)
    scale = torch.tensor([0.0123], dtype=torch.bfloat16)
    q = QuantLinear.from_packed(base.packed, bias=lin.bias.detach(), act_format="fp8", input_scale=scale)
    assert q.input_scale.dtype == torch.float32 and q.input_scale.shape == () and q.input_scale == scale.float()
    assert "act_format=fp8, input_scale=static" in repr(q)
    sd = q.state_dict()
    assert sd["_extra_state"]["act_format"] == "fp8" and torch.equal(sd["input_scale"], q.input_scale)
    dst = QuantLinear(128, 64, bits=4, group_size=64, act_format="fp8")
    dst.load_state_dict(sd)
    assert torch.equal(dst.input_scale, q.input_scale) and dst.act_format == "fp8"
    with pytest.raises((ValueError, RuntimeError), match="mismatch"):
        QuantLinear(128, 64, bits=4, group_size=64).load_state_dict(sd)
    with pytest.raises((ValueError, RuntimeError), match="mismatch"):
        dst.load_state_dict(base.state_dict())
    q.set_input_scale(None)
    assert q.input_scale is None and "input_scale" not in q.state_dict()


def test_fp8_forward_calls_the_e4m3_gemm(monkeypatch):
    """forward with act_format='fp8': x permuted (act-order) then mixgemm.gemm(..., act_format='fp8')
    with the layer's weight, bias, activation and input scale (float32 even after a dtype cast)."""
    from mixgemm.nn import linear as linear_mod

    calls = []
    monkeypatch.setattr(linear_mod, "gemm", lambda x, w, bias, activation=None, act_format="bf16", input_scale=None:
                        calls.append((x, w, bias, activation, act_format, input_scale)) or x[..., :w.n])
    lin = _linear()
    perm = torch.randperm(128)
    q = QuantLinear.from_packed(QuantLinear.from_linear(lin, bits=4, group_size=64).packed, bias=lin.bias.detach(),
                                perm=perm, act_format="fp8", input_scale=torch.tensor(0.5))
    q.activation = "gelu"
    x = torch.randn(3, 128).to(torch.bfloat16)
    q(x)
    ((gx, w, bias, act, fmt, scale),) = calls
    assert torch.equal(gx, x[:, perm]) and w.n == 64 and bias is q.bias and act == "gelu" and fmt == "fp8"
    assert scale is q.input_scale
    q.input_scale.data = q.input_scale.data.to(torch.bfloat16)      # as model.to(torch.bfloat16) leaves it
    q(x)
    assert calls[-1][5].dtype == torch.float32 and calls[-1][5] == 0.5
    q.set_input_scale(None)
    q(x)
    assert calls[-1][5] is None                                     # per-token scales


def test_fp8_forward_on_the_cpu_names_the_device():
    q = QuantLinear.from_linear(_linear(), bits=4, group_size=64)
    q.set_act_format("fp8")
    with pytest.raises(ValueError, match="mixgemm kernels run on CUDA tensors"):
        q(torch.randn(2, 128).to(torch.bfloat16))


def test_prebuild_lists_the_e4m3_kernels_of_an_fp8_layer():
    """specs_for a model with an act_format='fp8' layer: its quantizer and its e4m3 GEMM, and none
    of the bf16-activation GEMMs it never launches; a bf16 layer of the same weight lists those."""
    from mixgemm.aot.prebuild import specs_for

    model = torch.nn.Sequential(QuantLinear(256, 128, bits=4, group_size=64, act_format="fp8"))
    names = [s.name for s in specs_for(model)]
    assert names == sorted(["mixgemm_quant_fp8_bf16"] + [f"mixgemm_f8gemm_bf16_u4_t128x{t}x128{sk}_s0"
                                                         for t in (128, 64, 32) for sk in ("", "_streamk")]), names
    # (every token tile, whole-tile and split-K)
    model[0].set_act_format("bf16")
    names = [s.name for s in specs_for(model)]
    assert names and not any("fp8" in n or "f8gemm" in n for n in names), names
    assert any(n.startswith("mixgemm_gemm_bf16_u4") for n in names) and any("decode" in n for n in names), names
