"""``mixgemm bench --model``'s e4m3 variants without a GPU: ``mixgemm-<wt>-fp8`` (QuantLinear with
``act_format="fp8"``) and ``scaled-mm`` (``torch._scaled_mm`` e4m3 x e4m3): their names and
aliases, bytes (by hand for a small layer), the layers and references they build, their kernel
lists, their error bar, the options, why they do not run, and the run itself on the CPU (scaled-mm
through PyTorch's CPU kernel; mixgemm's e4m3 layers through a CPU emulation of their product)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mixgemm import bench
from mixgemm.bench import model as M
from mixgemm.bench import run_support
from mixgemm.bench import variants as V
from mixgemm.bench.decoder import DecoderStack, ModelPreset, Rotary, float_weight, layer_state
from mixgemm.bench.model import StepMeasurement, StepShape, analyze_model, layer_traffic
from mixgemm.bench.model_run import mode_problem, run_model
from mixgemm.dtypes import ActType, WeightType
from mixgemm.jit.catalog import layer_specs
from mixgemm.nn import QuantLinear
from mixgemm.ops.fp8 import quant_spec, quantize_fp8_reference
from mixgemm.weights.layout import unpack
from mixgemm.weights.quantize import deinterleave_rows

from bench_helpers import WallClock, parse

CPU = torch.device("cpu")
# the small layer of test_bench_model.py: q 128, kv 64 each; qkv (256, 128), o (128, 128),
# gate_up (512, 128), down (128, 256); a qkv bias
SMALL = ModelPreset("small", "test", hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32, qkv_bias=True,
                    rope_theta=10000.0, rms_eps=1e-5, model_layers=4)
PRESETS_T = {**bench.PRESETS, "small": SMALL}
U4_FP8 = V.Variant(V.VariantKind.MIXGEMM, WeightType.U4, "fp8")


def _scaled_mm_runs_on_the_cpu() -> bool:
    try:
        a = torch.ones(16, 32).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
        return True
    except Exception:   # no float8, no _scaled_mm, or no CPU kernel for it in this PyTorch
        return False


CPU_SCALED_MM = pytest.mark.skipif(not _scaled_mm_runs_on_the_cpu(), reason="no CPU torch._scaled_mm here")


# ---------------------------------------------------------------------------------- names
def test_variant_names_and_aliases():
    assert V.parse_variant("int4-fp8") == V.parse_variant("mixgemm-u4-fp8") == V.parse_variant(" U4-FP8 ") == U4_FP8
    assert U4_FP8.name == "mixgemm-u4-fp8" and U4_FP8.e4m3 and U4_FP8.quantized
    assert V.parse_variant("int2-fp8").name == "mixgemm-u2-fp8"
    assert V.parse_variant("s4-fp8") == V.Variant(V.VariantKind.MIXGEMM, WeightType.S4, "fp8")
    assert V.parse_variant("int8-fp8").name == "mixgemm-s8-fp8"          # parses; its points are n/a
    assert V.parse_variant("scaled-mm") == V.parse_variant("scaled_mm") == V.SCALED_MM
    assert V.SCALED_MM.name == "scaled-mm" and V.SCALED_MM.e4m3 and V.SCALED_MM.quantized
    assert V.SCALED_MM.act_format == "bf16"                               # e4m3 by kind, not by format
    assert not any(V.parse_variant(n).e4m3 for n in ("bf16", "int4", "torch-int4", "no-gemm"))
    assert V.is_e4m3("mixgemm-s2-fp8") and V.is_e4m3("scaled-mm") and not V.is_e4m3("mixgemm-s2")
    assert not V.is_e4m3("something else")
    assert [v.name for v in V.parse_variants(["int4", "int4-fp8", "scaled_mm", "mixgemm-u4-fp8"])] == [
        "bf16", "mixgemm-u4", "mixgemm-u4-fp8", "scaled-mm"]
    for bad in ("fp8", "bf16-fp8", "scaled-mm-fp8", "no-gemm-fp8", "torch-int4-fp8", "int3-fp8", "u4-fp16"):
        with pytest.raises(ValueError, match="unknown variant"):
            V.parse_variant(bad)
    with pytest.raises(ValueError, match="only a mixgemm variant"):
        V.Variant(V.VariantKind.SCALED_MM, act_format="fp8")
    with pytest.raises(ValueError, match="act_format"):
        V.Variant(V.VariantKind.MIXGEMM, WeightType.U4, "fp16")
    assert "int4-fp8" not in V.DEFAULT_VARIANTS and "scaled-mm" not in V.DEFAULT_VARIANTS   # selectable, not default


# ------------------------------------------------------------------------------------ bytes
# By hand, group 64 (test_bench_model.py's HAND): the e4m3 variants read mixgemm's packed weight;
# scaled-mm one byte per weight (147,456) + a float32 scale per row (4 * 1,024 rows) + the bias and
# the norms (512 + 512).
HAND = {"mixgemm-u4-fp8": 83_968, "mixgemm-u4": 83_968, "mixgemm-s2-fp8": 36_864 + 4_608 + 1_024,
        "scaled-mm": 147_456 + 4_096 + 512 + 512}


@pytest.mark.parametrize("name", sorted(HAND))
def test_layer_weight_bytes_by_hand(name):
    assert V.layer_weight_bytes(SMALL, V.parse_variant(name), 64) == HAND[name]
    assert V.projection_weight_bytes(4096, 4096, V.SCALED_MM, 128) == 4096 * 4096 + 4 * 4096


def test_layer_traffic_of_an_e4m3_step_by_hand():
    # per token, beside the 1,664 elements * 2 bytes of test_bench_model.py: each linear's input as
    # e4m3 codes (qkv 128, o 128, gate/up 128, down 256 bytes) and a 4-byte scale, written and read
    # back: 2 * (640 + 16) = 1,312 bytes
    exact = layer_traffic(SMALL, StepShape("decode", 4, 1, 10), 1000)
    e4m3 = layer_traffic(SMALL, StepShape("decode", 4, 1, 10), 1000, e4m3=True)
    assert e4m3.activations == 4 * (1664 * 2 + 1312) and e4m3.activations - exact.activations == 4 * 1312
    assert (e4m3.weights, e4m3.kv_read, e4m3.kv_write) == (exact.weights, exact.kv_read, exact.kv_write)
    step = [StepMeasurement("small", "decode", 4, 1, 10, 4, name, "graph", timing=bench.summarize_times([0.1] * 5),
                            err=1e-2, kv_err=1e-2) for name in ("mixgemm-u4", "mixgemm-u4-fp8", "scaled-mm")]
    pts = {p.variant: p for p in analyze_model(step, 100.0, group_size=64, presets=PRESETS_T)}
    assert pts["mixgemm-u4-fp8"].weight_bytes == pts["mixgemm-u4"].weight_bytes == HAND["mixgemm-u4"]
    assert pts["mixgemm-u4-fp8"].act_bytes == pts["mixgemm-u4"].act_bytes + 4 * 1312
    assert pts["scaled-mm"].weight_bytes == HAND["scaled-mm"] and pts["scaled-mm"].act_bytes == e4m3.activations
    assert pts["scaled-mm"].bytes_per_layer == HAND["scaled-mm"] + e4m3.kv_read + e4m3.kv_write + e4m3.activations


# ----------------------------------------------------------------------------------- layers
def test_mixgemm_fp8_layer_on_the_cpu():
    """The e4m3 variant builds mixgemm-u4's layers (the same packed weights, the same reference)
    with act_format="fp8" on each, gate/up included; an 8-bit type is refused with the reason."""
    proj, ref = V.build_layer(SMALL, U4_FP8, 0, 3, CPU, 64)
    plain, plain_ref = V.build_layer(SMALL, V.parse_variant("int4"), 0, 3, CPU, 64)
    assert {n: q.act_format for n, q in proj.layers.items()} == dict.fromkeys(("qkv", "o", "gate_up", "down"), "fp8")
    assert {q.act_format for q in plain.layers.values()} == {"bf16"}
    assert proj.layers["gate_up"].activation == "swiglu"
    for name in proj.layers:
        assert torch.equal(proj.layers[name].qdata, plain.layers[name].qdata)
    for attr in ("w_qkv", "w_o", "w_gate_up", "w_down", "b_qkv"):
        assert torch.equal(getattr(ref, attr), getattr(plain_ref, attr))
    states = [layer_state(SMALL, 0, 3, 1, 1, CPU, torch.bfloat16)]
    assert DecoderStack(SMALL, [proj], states, Rotary(32, 1e4, 1, torch.bfloat16)).weight_bytes() == HAND["mixgemm-u4"]
    with pytest.raises(bench.ImplUnavailable, match="u4, s4, u2 and s2"):
        V.build_layer(SMALL, V.parse_variant("int8-fp8"), 0, 3, CPU, 64)


def test_scaled_mm_layer_on_the_cpu():
    """scaled-mm's layer: each projection's bf16 weight as e4m3 codes with a float32 scale per row
    (one byte per weight), gate then up; its reference is its own weight, the codes times their
    scales in bf16, a few percent from the dense bf16 weight."""
    proj, ref = V.build_layer(SMALL, V.SCALED_MM, 0, 3, CPU, 64)
    assert isinstance(proj, V.ScaledMmProjections)
    assert proj.weight_bytes() == HAND["scaled-mm"] - 512                  # the norms are the stack's
    dense = V.build_layer(SMALL, V.BF16, 0, 3, CPU, 64)[0]
    for name, attr in (("qkv", "w_qkv"), ("o", "w_o"), ("gate_up", "w_gate_up"), ("down", "w_down")):
        codes, scales = proj.weights[name]
        assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        assert codes.shape == getattr(dense, attr).shape and scales.shape == (codes.shape[0],)
        natural, _, expected_scales = bench.scaled_mm_weight(getattr(dense, attr))
        assert torch.equal(scales, expected_scales)
        own = (natural.float() * scales.unsqueeze(1)).to(torch.bfloat16)
        assert torch.equal(getattr(ref, attr), own)
        assert 5e-3 < bench.relative_error(own, getattr(dense, attr)) < 4e-2
    gate = float_weight(SMALL, "gate", 0, 3, CPU).to(torch.bfloat16)
    assert torch.equal(proj.weights["gate_up"][1][:SMALL.intermediate], bench.e4m3_rows(gate)[1])
    assert torch.equal(ref.b_qkv, dense.b_qkv) and torch.equal(proj.b_qkv, dense.b_qkv)


def test_kernel_specs_of_the_e4m3_variants(monkeypatch, capsys):
    act = ActType.BF16
    layer = [s.name for s in layer_specs([act])]
    names = [s.name for s in V.kernel_specs(SMALL, U4_FP8, [1, 2048])]
    tiled = [f"mixgemm_f8gemm_bf16_{{wt}}_t128x{t}x128{sk}{g}_s0" for g in ("", "_swiglu")
             for sk in ("", "_streamk") for t in (128, 64, 32)]
    assert names == [quant_spec(torch.bfloat16).name, *(n.format(wt="u4") for n in tiled), *layer]
    assert [s.name for s in V.kernel_specs(SMALL, V.SCALED_MM, [1])] == [quant_spec(torch.bfloat16).name, *layer]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--model", "llama3-8b", "--batch", "1,64", "--variants", "int2-fp8,scaled-mm",
                       "--list-kernels"]) == 0
    assert capsys.readouterr().out.split() == sorted(
        {quant_spec(torch.bfloat16).name, *(n.format(wt="u2") for n in tiled), *layer})


def test_why_the_e4m3_variants_do_not_run_here(monkeypatch):
    ok, why = run_support.variant_available(V.parse_variant("mixgemm-u8-fp8"))
    assert not ok and "u4, s4, u2 and s2" in why and "u8" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_support.variant_available(U4_FP8) == (False, "needs a CUDA GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 6))
    ok, why = run_support.variant_available(V.SCALED_MM)
    assert not ok and why == "torch._scaled_mm's e4m3 GEMM needs an sm_89+ GPU, this one is sm_86"
    assert not run_support.launches_mixgemm_kernels(V.SCALED_MM)           # no mixgemm kernel below sm_90
    assert run_support.launches_mixgemm_kernels(U4_FP8)
    for mode in ("compiled", "graph", "eager"):   # the e4m3 path traces (mixgemm::gemm_fp8)
        assert mode_problem(U4_FP8, mode) is None
    assert mode_problem(V.SCALED_MM, "compiled") is None and mode_problem(V.parse_variant("int4"), "compiled") is None


# ---------------------------------------------------------------------------------- the bar
def step(variant, us=100.0, mode="graph", err=1e-3, kv_err=1e-3, **kw):
    timing = None if us is None else bench.summarize_times([us / 1e3] * 5)
    return StepMeasurement("small", "decode", 1, 1, 10, 4, variant, mode, timing=timing, err=err, kv_err=kv_err, **kw)


def test_the_e4m3_variants_have_their_own_bar():
    """e4m3 activations move the step by 0.1-0.2 on random llama3-8b-shaped layers: within the
    e4m3 bar (0.5), while the exact variants keep 5e-2; above the bar an e4m3 step FAILs too."""
    assert M.DEFAULT_MODEL_FP8_MAX_ERROR == 0.5 and M.DEFAULT_MODEL_MAX_ERROR == 5e-2
    meas = [step("bf16", 400.0, err=None, kv_err=None), step("mixgemm-u4-fp8", err=0.18, kv_err=0.16),
            step("scaled-mm", err=0.2, kv_err=0.15, replay_err=0.1), step("mixgemm-u4", err=0.18),
            step("mixgemm-u2-fp8", err=0.6), step("scaled-mm", mode="eager", err=0.2, kv_err=0.7)]
    pts = analyze_model(meas, 100.0, group_size=64, presets=PRESETS_T)
    assert [p.status for p in pts] == [bench.OK, bench.OK, bench.OK, bench.FAIL, bench.FAIL, bench.FAIL]
    assert "err 1.80e-01 > 5e-02" in pts[3].note
    assert "err 6.00e-01 > 5e-01" in pts[4].note and "kv_err 7.00e-01 > 5e-01" in pts[5].note
    assert pts[1].speedup_vs_bf16 == pytest.approx(4.0) and pts[4].speedup_vs_bf16 is None
    tight = analyze_model(meas, 100.0, group_size=64, presets=PRESETS_T, fp8_max_error=0.1)
    assert tight[1].status == bench.FAIL and "err 1.80e-01 > 1e-01" in tight[1].note
    assert tight[3].status == bench.FAIL                                   # the exact bar is its own
    assert M.classify_step(step("scaled-mm", err=None), 5e-2)[1] == "err not measured"
    text = M.format_model_table(pts, config={"iters": 5}, presets=PRESETS_T)
    assert "e4m3 variants (mixgemm-<wt>-fp8, scaled-mm): err and kv err against the bf16 step" in text
    assert "e4m3 variants" not in M.format_model_table(pts[:1] + pts[3:4], presets=PRESETS_T)


def test_model_fp8_options():
    cfg = bench.model_config_from_args(parse("--model", "llama3-8b", "--variants", "int4-fp8,scaled_mm"))
    assert [v.name for v in cfg.variants] == ["bf16", "mixgemm-u4-fp8", "scaled-mm"]
    assert cfg.fp8_max_error == 0.5 and cfg.to_json()["fp8_max_error"] == 0.5
    assert cfg.to_json()["variants"] == ["bf16", "mixgemm-u4-fp8", "scaled-mm"]
    cfg = bench.model_config_from_args(parse("--model", "llama3-8b", "--model-fp8-max-error", "0.3"))
    assert cfg.fp8_max_error == 0.3
    assert bench.host_step_config(parse("--host", "--variants", "int4,int4-fp8")).variants[2] == U4_FP8
    with pytest.raises(bench.BenchError, match="--model-fp8-max-error must be positive"):
        bench.model_config_from_args(parse("--model", "llama3-8b", "--model-fp8-max-error", "0"))
    with pytest.raises(bench.BenchError, match="only apply to --model and --host"):
        bench.config_from_args(parse("--model-fp8-max-error", "0.3"))
    for name in ("int4-fp8", "scaled-mm"):
        with pytest.raises(bench.BenchError, match="--moe has no e4m3-activation variant"):
            bench.moe_config_from_args(parse("--moe", "qwen3-30b-a3b", "--variants", f"int4,{name}"))
    gen = bench.generate_config_from_args(parse("--generate", "llama3-8b", "--types", "u4,u4-fp8"))
    assert [v.name for v in gen.types] == ["mixgemm-u4", "mixgemm-u4-fp8"]      # --generate runs them too


def test_auto_variants_parse_but_do_not_build_a_model_layer():
    """``-auto`` names parse (the --generate types) and count as e4m3 for the error bar; a --model
    layer of one is n/a with the reason, never the exact layers under the -auto name."""
    v = V.parse_variant("int2-auto")
    assert (v.name, v.act_format, v.e4m3, v.e4m3_problem) == ("mixgemm-u2-auto", "auto", True, None)
    assert V.parse_variant(v.name) == V.parse_variant(" U2-Auto ") == v and V.is_e4m3("mixgemm-s4-auto")
    assert V.parse_variant("s8-auto").e4m3_problem.startswith("s8 weights have no e4m3 kernel")
    assert V.parse_variant("int4").e4m3_problem is None and U4_FP8.e4m3_problem is None
    with pytest.raises(bench.ImplUnavailable, match="--generate variant"):
        V.build_layer(SMALL, v, 0, 0, CPU, 128)


@pytest.mark.parametrize("make,argv", [
    (bench.model_config_from_args, ("--model", "llama3-8b", "--variants", "int4,int4-auto")),
    (bench.host_step_config, ("--host", "--variants", "mixgemm-u2-auto")),
    (bench.moe_config_from_args, ("--moe", "qwen3-30b-a3b", "--variants", "u4-auto")),
])
def test_variants_refuse_auto(make, argv):
    """--variants times exact and e4m3 activations apart; act_format='auto' is --generate's."""
    with pytest.raises(bench.BenchError) as e:
        make(parse(*argv))
    msg = str(e.value)
    assert msg.startswith("--variants: '") and "act_format='auto' is a --generate type" in msg and "\n" not in msg
    wt = "u2" if "u2" in argv[-1] else "u4"
    assert f"--types {wt}-auto" in msg and f"mixgemm-{wt},mixgemm-{wt}-fp8" in msg


# -------------------------------------------------------------------------- the run, on the CPU
@CPU_SCALED_MM
def test_the_scaled_mm_run_on_the_cpu(monkeypatch):
    """run_model with scaled-mm on the CPU, eager and compiled (Dynamo's "eager" backend: the whole
    step traces, the quantizer as its torch definition): checked against the bf16 step on its own
    e4m3 weights, within the e4m3 bar, ok, with the e4m3 codes in its bytes; the 8-bit e4m3 variant
    and mixgemm's (no GPU) are n/a with their reasons."""
    from mixgemm.bench import model_run

    monkeypatch.setattr(model_run, "COMPILE_BACKEND", "eager")
    cfg = M.ModelConfig(presets=("small",), layers=2, batches=(1, 3), context=6, prefill=5,
                        variants=V.parse_variants(["scaled-mm", "int8-fp8", "int4-fp8"]), modes=("eager", "compiled"),
                        iters=2, warmup=1, quick=True, group_size=128)
    meas = run_model(cfg, CPU, log=lambda line: None, make_clock=lambda mode: WallClock(), presets=[SMALL])
    pts = analyze_model(meas, 100.0, cfg.max_error, cfg.group_size, presets=PRESETS_T)
    assert len(pts) == 4 * 3 * 2
    smm = [p for p in pts if p.variant == "scaled-mm"]
    assert len(smm) == 6 and all(p.status == bench.OK for p in smm), [(p.mode, p.note) for p in smm]
    for p in smm:
        assert 1e-3 < p.err < cfg.fp8_max_error and 0 < p.kv_err < cfg.fp8_max_error
        assert p.weight_bytes == V.layer_weight_bytes(SMALL, V.SCALED_MM, 128)
        assert p.act_bytes == layer_traffic(SMALL, p.shape, 0, e4m3=True).activations
        if p.mode == "compiled":
            assert p.replay_err is not None and p.replay_err < cfg.fp8_max_error
    s8 = [p for p in pts if p.variant == "mixgemm-s8-fp8"]
    assert all(p.status == bench.UNAVAILABLE and "u4, s4, u2 and s2" in p.note for p in s8)
    u4 = [p for p in pts if p.variant == "mixgemm-u4-fp8"]
    assert all(p.status == bench.UNAVAILABLE and "GPU" in p.note for p in u4)


def _emulated_fp8_forward(fault=None):
    """A CPU stand-in for QuantLinear's e4m3 forward: each token rounded to e4m3 (the quantizer's
    definition), times the exact weight (q - z) * s, summed in float64, the swiglu in float64,
    one rounding; ``fault="k order"`` multiplies the activations in the quantizer's K order by the
    weight in its own (what a kernel would do that forgot the permutation)."""
    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        w = bench.exact_weight(unpack(self.packed)).double()
        if fault == "k order":
            xq, xs = quantize_fp8_reference(x2)
            xe = xq.double() * xs.double().unsqueeze(1)
        else:
            xe = bench.e4m3_activations(x2)
        y = xe @ w.t()
        if self.activation == "swiglu":
            gate, up = deinterleave_rows(y.t())
            y = (F.silu(gate) * up).t()
        elif self.bias is not None:
            y = y + self.bias.double()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)
    return forward


def test_the_mixgemm_fp8_run_with_a_cpu_stand_in(monkeypatch):
    """run_model with mixgemm-u4-fp8, its e4m3 layers computed by a CPU emulation of the kernels'
    product: the variant's step runs its QuantLinear layers in fp8, is checked against the bf16
    step on its dequantized weights, is further from it than the exact variant (the e4m3 rounding)
    but within the e4m3 bar, compiled as eager (the e4m3 path traces); activations in the wrong K
    order FAIL."""
    from mixgemm.bench import model_run

    monkeypatch.setattr(model_run, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(run_support, "variant_available", lambda v: (True, ""))
    calls = []
    emulated = _emulated_fp8_forward()

    def counted(self, x):
        calls.append(self.activation)
        return emulated(self, x)

    monkeypatch.setattr(QuantLinear, "_forward_fp8", counted)
    cfg = M.ModelConfig(presets=("small",), layers=2, batches=(2,), context=6, prefill=5,
                        variants=V.parse_variants(["int4-fp8"]), modes=("eager", "compiled"), iters=2, warmup=1,
                        quick=True, group_size=128)
    meas = run_model(cfg, CPU, log=lambda line: None, make_clock=lambda mode: WallClock(), presets=[SMALL])
    pts = analyze_model(meas, 100.0, cfg.max_error, cfg.group_size, presets=PRESETS_T)
    fp8 = {(p.phase, p.mode): p for p in pts if p.variant == "mixgemm-u4-fp8"}
    assert set(fp8) == {(ph, m) for ph in ("decode", "prefill") for m in ("eager", "compiled")}
    assert calls and set(calls) == {"none", "swiglu"}                     # every linear went through fp8
    for phase in ("decode", "prefill"):
        for mode in ("eager", "compiled"):
            p = fp8[(phase, mode)]
            assert p.status == bench.OK, p.note
            assert 1e-2 < p.err < cfg.fp8_max_error and 0 < p.kv_err < cfg.fp8_max_error
            assert p.weight_bytes == V.layer_weight_bytes(SMALL, U4_FP8, 128)
    assert all(p.status == bench.OK for p in pts if p.variant == "bf16")

    monkeypatch.setattr(QuantLinear, "_forward_fp8", _emulated_fp8_forward("k order"))
    cfg = dataclasses.replace(cfg, modes=("eager",), prefill=0)
    meas = run_model(cfg, CPU, log=lambda line: None, make_clock=lambda mode: WallClock(), presets=[SMALL])
    (bad,) = [p for p in analyze_model(meas, 100.0, cfg.max_error, cfg.group_size, presets=PRESETS_T)
              if p.variant == "mixgemm-u4-fp8"]
    assert bad.status == bench.FAIL and bad.err > 1.0, (bad.err, bad.note)


def test_the_compiled_quantizer_is_the_quantizers_definition(monkeypatch):
    """scaled-mm's quantizer under torch.compile (e4m3_rows and the column table) gives
    quantize_fp8_reference's codes and scales bit for bit, at every width of the layer."""
    from mixgemm.ops.fp8 import quantize_fp8_reference

    proj, _ = V.build_layer(SMALL, V.SCALED_MM, 0, 3, CPU, 64)
    assert sorted(proj.orders) == [128, 256]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for k in (128, 256):
        x = (torch.randn(5, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-3, 3, 5)[:, None])
        x = x.to(torch.bfloat16)
        xq, xs = proj.quantize(x)
        rq, rs = quantize_fp8_reference(x)
        assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(xs, rs)
