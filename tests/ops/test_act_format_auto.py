"""act_format="auto" and the e4m3 path under torch.compile, on the CPU: which path a call takes
from the GPU's tuning table (the GPU's name and the table are faked), that QuantLinear and
mixgemm.gemm follow it, and what torch.compile traces (the op ``mixgemm::gemm_fp8``, whose
kernel makes the choice when it runs; the graphs never run here)."""
from __future__ import annotations


import pytest
import torch
from torch import nn

import mixgemm
from mixgemm.dispatch import heuristic, tuning
from mixgemm.nn import QuantLinear
from mixgemm.ops import dense, fp8
from mixgemm.weights.layout import prepack
from mixgemm.weights.quantize import quantize

GPU = "NVIDIA Test GPU"


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A tuning table for GPU: u2 256x128 measured at M = 16, 64, 256, e4m3 faster at 64 and 256;
    the device's name faked to GPU."""
    path = tmp_path / f"{tuning.gpu_slug(GPU)}.json"
    tuning.write_act_format_table(path, GPU, [{"weight": "u2", "n": 256, "k": 128, "tokens": [16, 64, 256],
                                              "fp8": [64, 256]}], 1.05, command="test")
    monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
    monkeypatch.setattr(heuristic, "gpu_name", lambda index: GPU)
    tuning._act_format_table.cache_clear()
    yield path
    tuning._act_format_table.cache_clear()


def _packed(bits=2, n=256, k=128, symmetric=False):
    torch.manual_seed(0)
    return prepack(quantize(torch.randn(n, k), bits, 64, symmetric=symmetric, dtype=torch.bfloat16))


CUDA = torch.device("cuda", 0)


def test_resolve_act_format_follows_the_table(table):
    w = _packed()
    assert [fp8.resolve_act_format("auto", m, w, CUDA) for m in (1, 16, 63, 64, 255, 256, 8192)] == \
        ["bf16", "bf16", "bf16", "fp8", "fp8", "fp8", "fp8"]
    assert fp8.resolve_act_format("bf16", 256, w, CUDA) == "bf16" and fp8.resolve_act_format("fp8", 1, w, CUDA) == "fp8"
    assert fp8.resolve_act_format("auto", 256, _packed(n=512), CUDA) == "bf16"             # a shape not listed
    assert fp8.resolve_act_format("auto", 256, _packed(bits=4), CUDA) == "bf16"            # a type not listed
    assert fp8.resolve_act_format("auto", 256, _packed(bits=8, symmetric=True), CUDA) == "bf16"   # no e4m3 kernel
    assert fp8.resolve_act_format("auto", 256, w, torch.device("cpu")) == "bf16"


def test_gemm_auto_takes_the_path_the_table_picks(table, monkeypatch):
    """mixgemm.gemm(act_format='auto'): the e4m3 call (with the static scale) where the table
    says so, the exact path (without it) elsewhere; supports() answers yes wherever bf16 runs."""
    calls = []
    monkeypatch.setattr(fp8, "gemm_fp8", lambda x, w, bias, out, act, input_scale=None:
                        calls.append(("fp8", x.shape[0], input_scale)) or x.new_zeros(x.shape[0], w.n))
    monkeypatch.setattr(dense.plans, "run", lambda *a, **k: None)
    monkeypatch.setattr(dense, "_gemm_planned", lambda x, w, bias, out, act:
                        calls.append(("bf16", x.shape[0], None)) or x.new_zeros(x.shape[0], w.n))
    real = fp8.resolve_act_format   # the activations taken to be on the (faked) GPU
    monkeypatch.setattr(fp8, "resolve_act_format", lambda fmt, m, w, device: real(fmt, m, w, CUDA))
    w, scale = _packed(), torch.tensor(0.5)
    for m in (16, 64, 300):
        mixgemm.gemm(torch.randn(m, 128).bfloat16(), w, act_format="auto", input_scale=scale)
    assert calls == [("bf16", 16, None), ("fp8", 64, scale), ("fp8", 300, scale)]
    assert mixgemm.supports((4, 128), _packed(bits=8, symmetric=True), act_format="auto") == \
        mixgemm.supports((4, 128), _packed(bits=8, symmetric=True))


def test_quant_linear_auto(table, monkeypatch):
    """QuantLinear(act_format='auto'): its forward takes the e4m3 path for the calls the table
    sends there and its own exact path for the others; kernel_uses lists the kernels of both
    (an 8-bit layer, which has no e4m3 kernel, only its own); the format survives the state."""
    layer = QuantLinear(128, 256, bits=2, group_size=64, act_format="auto")
    seen = []
    monkeypatch.setattr(QuantLinear, "_forward_fp8", lambda self, x: seen.append(("fp8", x.shape[0])) or x)
    monkeypatch.setattr("mixgemm.nn.linear.plans.run", lambda *a, **k: seen.append(("bf16", a[0].shape[0])) or a[0])
    monkeypatch.setattr("mixgemm.nn.linear.layer_prefers_fp8", lambda m, *a: m >= 64)
    for m in (16, 64):
        layer(torch.randn(m, 128).bfloat16())
    assert seen == [("bf16", 16), ("fp8", 64)]
    names = {u.name if hasattr(u, "name") else type(u).__name__ for u in layer.kernel_uses()}
    assert any(n.startswith("mixgemm_f8gemm_") for n in names) and any(n.startswith("mixgemm_quant_fp8") for n in names)
    assert len(layer.kernel_uses()) == 2 + 6       # the weight, the quantizer, the e4m3 GEMM's token tiles x 2
    assert {n for n in names if n.startswith("mixgemm_f8gemm_")} == {
        f"mixgemm_f8gemm_bf16_u2_t128x{t}x128{sk}_s0" for t in (128, 64, 32) for sk in ("", "_streamk")}
    assert len(QuantLinear(128, 256, bits=8, act_format="auto").kernel_uses()) == 1
    assert layer.state_dict()["_extra_state"]["act_format"] == "auto"
    QuantLinear(128, 256, bits=2, group_size=64, act_format="auto").load_state_dict(layer.state_dict())
    with pytest.raises(ValueError, match="act_format"):   # the format is part of what the state describes
        QuantLinear(128, 256, bits=2, group_size=64).load_state_dict(layer.state_dict())


def shapes_backend(graphs: list):
    """A backend that keeps the graph and returns outputs of the traced shapes (runs nothing)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        vals = [torch.empty_strided(a.meta["example_value"].shape, a.meta["example_value"].stride(),
                                    dtype=a.meta["example_value"].dtype) for a in out.args[0]]
        return lambda *args: vals
    return backend


@pytest.mark.parametrize("fmt", ["fp8", "auto"])
@pytest.mark.parametrize("activation", [None, "silu", "swiglu"])
def test_compile_traces_the_fp8_op(fmt, activation):
    """mixgemm.gemm and QuantLinear with act_format 'fp8' or 'auto' trace whole (fullgraph) into
    one call of mixgemm::gemm_fp8 with the layer's tensors, fields and format, of the eager
    call's output shape (the fake implementation)."""
    w = _packed(bits=4)
    bias = torch.randn(w.n).bfloat16()
    graphs = []
    torch._dynamo.reset()
    y = torch.compile(lambda x: mixgemm.gemm(x, w, bias, activation=activation, act_format=fmt),
                      fullgraph=True, backend=shapes_backend(graphs))(torch.randn(5, 3, 128).bfloat16())
    assert tuple(y.shape) == (5, 3, w.n // 2 if activation == "swiglu" else w.n)
    calls = [n for n in graphs[0].graph.nodes if n.target in (torch.ops.mixgemm.gemm_fp8,
                                                               torch.ops.mixgemm.gemm_fp8.default)]
    assert len(calls) == 1
    assert tuple(calls[0].args[6:]) == ("u4", 64, w.n, w.k, activation or "none", None, fmt)
    layer = QuantLinear.from_packed(w, act_format=fmt)
    graphs.clear()
    torch._dynamo.reset()
    torch.compile(layer, fullgraph=True, backend=shapes_backend(graphs))(torch.randn(7, 128).bfloat16())
    assert [n.args[-1] for n in graphs[0].graph.nodes if n.target in (torch.ops.mixgemm.gemm_fp8,
                                                                      torch.ops.mixgemm.gemm_fp8.default)] == [fmt]


def test_compile_refuses_what_eager_refuses():
    """Under torch.compile the e4m3 call refuses an 8-bit weight and a bad activation with the
    eager call's messages (at trace time, before anything runs)."""
    x = torch.randn(4, 128).bfloat16()
    for w, kw, msg in ((_packed(bits=8, symmetric=True), {}, "act_format='fp8' takes u4, s4, u2 and s2 weights"),
                       (_packed(bits=4), dict(activation="relu"), "activation must be None or one of")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=msg):
            torch.compile(lambda x: mixgemm.gemm(x, w, act_format="fp8", **kw), fullgraph=True,
                          backend=shapes_backend([]))(x)


def test_the_fake_implementation_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode   # (a private torch module: only this test needs it)

    w = _packed(bits=2)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 128).bfloat16())
        args = [mode.from_tensor(t) for t in (w.qdata, w.scales, w.zeros)]
        for act, n in (("none", w.n), ("swiglu", w.n // 2)):
            y = torch.ops.mixgemm.gemm_fp8(x, *args, None, None, "u2", 64, w.n, w.k, act, None, "auto")
            assert tuple(y.shape) == (3, n) and y.dtype == torch.bfloat16
