"""QuantLinear on the GPU: eager, torch.compile(fullgraph=True), CUDA graphs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mixgemm
from mixgemm.nn import QuantLinear, quantize_model

pytestmark = pytest.mark.gpu


class _MLP(nn.Module):
    def __init__(self, h=1024, i=2816):
        super().__init__()
        self.gate = nn.Linear(h, i, bias=False)
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=True)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _model(dev):
    torch.manual_seed(0)
    m = _MLP().to(device=dev, dtype=torch.bfloat16)
    ref = _MLP().to(device=dev, dtype=torch.bfloat16)
    ref.load_state_dict(m.state_dict())
    summary = quantize_model(m, bits=4, group_size=128, progress=False)
    assert len(summary.replaced) == 3
    # the reference uses the same (dequantized) weights in plain bf16 linears
    for name in ("gate", "up", "down"):
        getattr(ref, name).weight.data.copy_(mixgemm.dequantize_reference(getattr(m, name).packed))
    return m, ref


def test_quantlinear_eager_compile_and_graph(requires_gpu):
    dev = requires_gpu
    m, ref = _model(dev)
    x = torch.randn(4, 7, 1024, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        y_ref = ref(x.double().to(torch.bfloat16)).double()
        y = m(x)
        assert ((y.double() - y_ref).norm() / y_ref.norm()).item() < 2e-2   # bf16 intermediates in both

        compiled = torch.compile(m, fullgraph=True)                           # no graph breaks allowed
        y_c = compiled(x)
        # inductor fuses silu(gate) * up in float32 where eager rounds silu to bf16 first, so the
        # block differs in the last bits; one layer alone must match eager exactly (same kernel)
        assert ((y_c.double() - y.double()).norm() / y.double().norm()).item() < 1e-2
        up_c = torch.compile(m.up, fullgraph=True)
        assert torch.equal(up_c(x), m.up(x)), "the custom op runs the same kernel under torch.compile"

        xs = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
        out = m(xs)                                                           # warm-up loads the kernels
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = m(xs)
        for _ in range(3):
            xs.copy_(torch.randn_like(xs))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, m(xs))


def test_capture_without_warmup_says_so(requires_gpu, monkeypatch):
    dev = requires_gpu
    w = torch.randn(272, 576, device=dev) * 0.02
    packed = mixgemm.prepack(mixgemm.quantize(w, 2, 64, dtype=torch.float16))
    x = torch.randn(5, 576, device=dev, dtype=torch.float16)
    from mixgemm.jit import loader as runtime
    monkeypatch.setattr(runtime, "KERNELS", runtime.KernelCache())   # nothing loaded yet
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up"):
        with torch.cuda.graph(g):
            mixgemm.gemm(x, packed)


def test_gate_up_layer_on_gpu_and_in_a_graph(requires_gpu):
    """The fused gate+up layer: one launch gives silu(gate(x)) * up(x) at decode (M <= 16) and
    through the GEMM kernels' gated epilogue (M = 64: the 128x64 tile, 300: the 128x256 tile), eager and
    replayed."""
    dev = requires_gpu
    torch.manual_seed(1)
    gate = nn.Linear(1024, 2816, bias=True).to(dev, torch.bfloat16)
    up = nn.Linear(1024, 2816, bias=True).to(dev, torch.bfloat16)
    layer = QuantLinear.from_gate_up(gate, up, bits=4, group_size=128)
    dg = mixgemm.dequantize_reference(mixgemm.quantize(gate.weight.detach(), 4, 128)).double()
    du = mixgemm.dequantize_reference(mixgemm.quantize(up.weight.detach(), 4, 128)).double()
    for m in (1, 16, 64, 300):
        x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
        ref = torch.nn.functional.silu(x.double() @ dg.T + gate.bias.double()) * (x.double() @ du.T + up.bias.double())
        with torch.no_grad():
            y = layer(x)
        assert y.shape == (m, 2816)
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1.6e-2
    for m in (1, 64):
        xs = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            out = layer(xs)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = layer(xs)
            xs.copy_(torch.randn_like(xs))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, layer(xs)), m


def test_quantlinear_fp8_with_and_without_a_static_scale(requires_gpu):
    """act_format='fp8': the layer's output is mixgemm.gemm(..., act_format='fp8') of its weight,
    per token or with its input_scale, bit for bit (the same two launches)."""
    dev = requires_gpu
    torch.manual_seed(2)
    lin = nn.Linear(2048, 1024, bias=True).to(dev, torch.bfloat16)
    layer = QuantLinear.from_linear(lin, bits=4, group_size=128)
    layer.set_act_format("fp8")
    x = torch.randn(3, 40, 2048, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), mixgemm.gemm(x, layer.packed, layer.bias, act_format="fp8"))
        layer.set_input_scale(torch.tensor(x.float().abs().amax().item() / 448))
        assert layer.input_scale.device == dev and layer.input_scale.dtype == torch.float32
        assert torch.equal(layer(x), mixgemm.gemm(x, layer.packed, layer.bias, act_format="fp8",
                                                  input_scale=layer.input_scale))


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_quantize_model_fp8_layers_equal_their_reference(requires_gpu, fuse_layers):
    """A transformers model quantized with act_format="fp8", run on the e4m3 kernels: every
    QuantLinear's output, on the input it got inside the model, equals the reference product of
    that input (the activations rounded by the quantizer's definition, float32 products) within
    the e4m3 GEMM tests' tolerance; and the model's logits move from the exact-activation model's
    by the e4m3 rounding's amount, with the same greedy tokens at most positions (the bounds of
    the CPU test on the reference product, tests/nn/test_blocks.py).

    The logits are not compared with the reference model's: the layers' outputs differ by float32
    summation order, which flips the e4m3 rounding of some of the next layer's activations (a
    step of 2^-4 where the bf16 path's would be 2^-8), and that compounds through the layers."""
    pytest.importorskip("transformers")
    from tiny_models import reference_forward, tiny_model

    def build(act_format):
        model = tiny_model("llama").to(torch.bfloat16)
        summary = quantize_model(model, bits=4, group_size=64, progress=False, fuse_layers=fuse_layers,
                                 act_format=act_format)
        return model.to(requires_gpu), summary

    model, summary = build("fp8")
    assert not summary.bf16_activations   # (the gate/up layers on the gated e4m3 kernel)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: seen.append((name, mod, args[0], out)))
             for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    ids = torch.randint(0, 160, (2, 9), device=requires_gpu, generator=torch.Generator(requires_gpu).manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits.double()
        for h in hooks:
            h.remove()
        assert len(seen) == sum(isinstance(m, QuantLinear) for m in model.modules()) > 0
        for name, layer, x, y in seen:
            assert layer.act_format == "fp8", name
            want = reference_forward(layer, x).double()
            err = ((y.double() - want).norm() / want.norm()).item()
            k = layer.packed.k
            bound = 4 * 2.0 ** -9 + 64 * k ** 0.5 * 2.0 ** -24 + 2.0 ** -12   # tests/ops/test_gpu_fp8.py's
            assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.3e}"
        exact = build("bf16")[0](ids).logits.double()
    err = ((got - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.1, err
    assert (got.argmax(-1) == exact.argmax(-1)).double().mean() >= 0.75
