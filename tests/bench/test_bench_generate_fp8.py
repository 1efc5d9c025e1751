"""``mixgemm bench --generate`` with e4m3 (``-fp8``) and per-call (``-auto``) activations, without
a GPU: the ``--types`` names and the refusal of 8-bit ones, the run plan's ``act_format`` through
``quantize_model``, the n/a outcome of a model where no layer takes the format, the ``-auto``
notes, and the rows of the table, the JSON and the plot."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from mixgemm import bench
from mixgemm.bench import generate as G
from mixgemm.bench import generate_run as R
from mixgemm.bench import peers, plots
from mixgemm.bench.decoder import PRESETS, ModelPreset
from mixgemm.bench.generate import GenMeasurement, analyze_generate
from mixgemm.bench.variants import parse_variant
from mixgemm.dtypes import WeightType
from mixgemm.nn import QuantizeSummary, QuantLinear

from bench_helpers import generate_run_on_the_cpu, machine, parse, stats

CPU = torch.device("cpu")
BASE = dict(preset="llama3-8b", prompt_tokens=128, new_tokens=64, layers=32)
TINY = ModelPreset("tiny", "test", hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, qkv_bias=False,
                   rope_theta=10000.0, rms_eps=1e-5, model_layers=2)


def gen(*argv):
    return bench.generate_config_from_args(parse("--generate", *argv))


# --------------------------------------------------------------------------------- options
def test_types_take_fp8_and_auto():
    cfg = gen("llama3-8b", "--types", "u4,u4-fp8,u4-auto,int4-auto,U2-FP8,mixgemm-u2-auto,s4-auto,u2",
              "--fuse-layers", "on")
    names = [v.name for v in cfg.types]
    assert names == ["mixgemm-u4", "mixgemm-u4-fp8", "mixgemm-u4-auto", "mixgemm-u2-fp8", "mixgemm-u2-auto",
                     "mixgemm-s4-auto", "mixgemm-u2"]                              # int4-auto is u4-auto
    assert [v.act_format for v in cfg.types] == ["bf16", "fp8", "auto", "fp8", "auto", "auto", "bf16"]
    assert [v.weight_type for v in cfg.types][:3] == [WeightType.U4] * 3
    runs = cfg.runs()
    assert [(r.name, r.act_format, r.fuse) for r in runs[:4]] == [
        ("bf16", "bf16", None), ("mixgemm-u4", "bf16", True), ("mixgemm-u4-fp8", "fp8", True),
        ("mixgemm-u4-auto", "auto", True)]
    assert runs[2].label == "mixgemm-u4-fp8 fuse_layers=on"
    assert cfg.to_json()["types"] == names


@pytest.mark.parametrize("name", ["s8-fp8", "s8-auto", "mixgemm-u8-auto", "int8-fp8"])
def test_8bit_types_with_e4m3_activations_are_refused(name, capsys):
    wt = parse_variant(name).weight_type.value
    with pytest.raises(bench.BenchError) as e:
        gen("llama3-8b", "--types", f"u4,{name}")
    msg = str(e.value)
    assert msg == (f"--types: '{name}': {wt} weights have no e4m3 kernel (the e4m3 GEMM takes s4, u4, s2 and u2 "
                   f"codes): {wt} runs with exact activations only")
    assert bench.main(["--generate", "llama3-8b", "--types", name]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mixgemm bench: error: --types: ") and err.count("\n") == 1


def test_unknown_suffixes_stay_unknown():
    for bad in ("u4-fp16", "u4-auto-fp8", "bf16-auto", "torch-int4-fp8"):
        with pytest.raises(bench.BenchError, match="unknown variant|not a mixgemm weight type"):
            gen("llama3-8b", "--types", bad)


def test_unavailable_reason_of_an_8bit_e4m3_run():
    """A config built in code (not through --types) still reports an 8-bit e4m3 run n/a."""
    support = {"quantize_model": True, "from_pretrained": True}
    cfg = G.GenerateConfig()
    s8_auto = G.RunVariant("mixgemm-s8-auto", WeightType.S8, False, "auto")
    assert "s8 weights have no e4m3 kernel" in G.unavailable_reason(cfg, s8_auto, support)
    u2_fp8 = G.RunVariant("mixgemm-u2-fp8", WeightType.U2, True, "fp8")
    assert G.unavailable_reason(cfg, u2_fp8, support) is None
    assert G.unavailable_reason(cfg, u2_fp8, support, (False, "needs sm_90")) == "needs sm_90"


def test_act_format_outcome():
    layers = ["a.qkv_proj", "a.o_proj", "m.gate_up", "m.down_proj"]
    assert G.act_format_outcome("bf16", layers, {}) == (None, "")
    assert G.act_format_outcome("fp8", layers, {}) == (None, "")
    why = "act_format='fp8' needs a group size that is a multiple of 32, w has 16"
    kept = G.act_format_outcome("fp8", layers, {"m.down_proj": why})
    assert kept == (None, f"1 of 4 layers keep exact activations ({why})")
    unavailable, note = G.act_format_outcome("auto", layers, dict.fromkeys(layers, why))
    assert unavailable == f"act_format='auto': no layer takes it ({why})" and note == ""


def test_auto_note():
    assert G.auto_note(16, 128, (0, 128), (96, 128)) == (
        "act_format='auto': e4m3 in 0 of 128 layers at the decode step (M=16), 96 of 128 at the prompt (M=2048)")


# ------------------------------------------------- the GPU run's pieces that run on the CPU
@pytest.fixture
def tiny_preset(monkeypatch):
    """The tiny preset, known to the run for the test."""
    monkeypatch.setitem(G.PRESET_MODELS, "tiny", G.PresetModel("llama", 128, 64))
    monkeypatch.setitem(PRESETS, "tiny", TINY)


def _fake_quantize(calls, exact=lambda names: {}):
    """A quantize_model that records its keywords and leaves the model as it is."""
    def quantize_model(model, **kwargs):
        calls.append(kwargs)
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
        return QuantizeSummary(names, {"lm_head": "matches skip"}, 1, 1, bf16_activations=exact(names))
    return quantize_model


@pytest.mark.parametrize("types,fuse", [(("u4-fp8",), False), (("u2-auto",), True), (("s4",), True)])
def test_load_model_passes_act_format_to_quantize_model(tiny_preset, monkeypatch, types, fuse):
    calls = []
    monkeypatch.setattr(R, "quantize_model", _fake_quantize(calls))
    cfg = dataclasses.replace(G.GenerateConfig(), name="tiny", target="tiny", types=G.parse_types(types),
                              fuse=(fuse,), group_size=64)
    bf16, run = cfg.runs()
    support = {"quantize_model": True, "from_pretrained": True}
    model, summary = R.load_model(cfg, bf16, CPU, support)
    assert summary is None and calls == []                 # bf16: not quantized
    model, summary = R.load_model(cfg, run, CPU, support)
    v = cfg.types[0]
    assert calls == [dict(bits=v.weight_type.bits, group_size=64, symmetric=v.weight_type.signed, progress=False,
                          act_format=v.act_format, fuse_layers=fuse)]
    assert isinstance(summary, QuantizeSummary) and summary.replaced


def test_auto_choices_count_the_auto_layers(monkeypatch):
    """auto_choices asks resolve_act_format about every act_format='auto' QuantLinear (and no
    other layer) at the token count given."""
    asked = []

    def resolve(fmt, m, packed, device):
        asked.append((fmt, m, packed.n))
        return "fp8" if packed.n == 128 and m >= 64 else "bf16"

    monkeypatch.setattr(R, "resolve_act_format", resolve)
    layers = [QuantLinear.from_linear(nn.Linear(64, n, bias=False).bfloat16(), bits=4, group_size=64)
              for n in (64, 128, 256)]
    for q in layers[:2]:
        q.set_act_format("auto")
    model = nn.Sequential(*layers)
    assert R.auto_choices(model, 2, CPU) == (0, 2)
    assert R.auto_choices(model, 64, CPU) == (1, 2)
    assert asked == [("auto", 2, 64), ("auto", 2, 128), ("auto", 64, 64), ("auto", 64, 128)]


def test_run_generate_runs_the_act_formats_on_the_cpu(tiny_preset, monkeypatch):
    """The whole run on a tiny preset, quantize_model replaced by one that leaves the model in bf16
    and says which layers keep exact activations: u2-auto is measured with the act_format='auto'
    note of each batch, u4-fp8 (no layer takes e4m3 here) is n/a with the reason, every row under
    its own name."""
    generate_run_on_the_cpu(monkeypatch, R, host_us=1.0, gpu_loop_us=2.0)
    monkeypatch.setattr(R, "prebuild_model", lambda model, cfg, log: None)
    monkeypatch.setattr(peers, "mixgemm_available", lambda: (True, ""))
    calls = []
    why = "act_format='fp8' needs a group size that is a multiple of 32"
    monkeypatch.setattr(R, "quantize_model", _fake_quantize(
        calls, lambda names: dict.fromkeys(names, why) if calls[-1]["act_format"] == "fp8" else {}))
    asked = []
    monkeypatch.setattr(R, "auto_choices", lambda model, m, device: asked.append(m) or (m // 5, 7))
    cfg = dataclasses.replace(G.GenerateConfig(), name="tiny", target="tiny", types=G.parse_types(["u2-auto", "u4-fp8"]),
                              fuse=(False,), batches=(1, 2), prompt_tokens=5, new_tokens=3, repeats=1,
                              modes=("eager",), iters=2, warmup=0)
    meas, info = R.run_generate(cfg, CPU, log=lambda s: None)
    assert [c["act_format"] for c in calls] == ["auto", "fp8"]
    assert asked == [1, 5, 2, 10]                            # each batch's decode step, then its prompt
    pts = {(p.variant, p.batch): p for p in analyze_generate(meas)}
    assert sorted(pts) == sorted((v, b) for v in ("bf16", "mixgemm-u2-auto", "mixgemm-u4-fp8") for b in (1, 2))
    for b in (1, 2):
        auto = pts[("mixgemm-u2-auto", b)]
        assert auto.status == bench.OK and auto.speedup_vs_bf16 > 0 and auto.fuse == "off"
        assert auto.note.startswith(G.auto_note(b, 5, (b // 5, 7), (b, 7)))
        fp8 = pts[("mixgemm-u4-fp8", b)]
        assert fp8.status == bench.UNAVAILABLE and fp8.note == f"act_format='fp8': no layer takes it ({why})"


# ------------------------------------------------------------------------------ the report
def _m(variant, fuse="off", mode="static", batch=1, gen_s=1.0, pre_s=0.1, **kw):
    return GenMeasurement(**BASE, variant=variant, fuse=fuse, mode=mode, batch=batch, generate_s=(gen_s,),
                          prefill_s=(pre_s,), first_s=10.0, new_tokens_made=(64,), step=stats(4000.0, 50),
                          step_finite=True, host_us=1000.0, host_queued=True, **kw)


def _points():
    return analyze_generate([
        _m("bf16", "-", gen_s=2.0), _m("bf16", "-", batch=16, gen_s=4.0),
        _m("mixgemm-u2"), _m("mixgemm-u2-fp8", gen_s=1.6), _m("mixgemm-u2-auto", gen_s=0.8),
        _m("mixgemm-u2-auto", batch=16, gen_s=2.0, note=G.auto_note(16, 128, (0, 128), (96, 128)))])


def test_fp8_and_auto_rows_compare_with_bf16_in_the_same_mode_and_batch():
    pts = {(p.variant, p.batch): p for p in _points()}
    assert pts[("mixgemm-u2", 1)].speedup_vs_bf16 == pytest.approx(2.0)
    assert pts[("mixgemm-u2-fp8", 1)].speedup_vs_bf16 == pytest.approx(1.25)
    assert pts[("mixgemm-u2-auto", 1)].speedup_vs_bf16 == pytest.approx(2.5)
    assert pts[("mixgemm-u2-auto", 16)].speedup_vs_bf16 == pytest.approx(2.0)       # batch 16's bf16


def test_table_json_and_plot_name_each_act_format(tmp_path, monkeypatch):
    cfg = G.GenerateConfig(layers=32, types=G.parse_types(["u2", "u2-fp8", "u2-auto"]))
    conf = {**cfg.to_json(), "transformers_version": "5.24.0"}
    report = G.GenerateReport(machine(), conf, {cfg.name: G.model_description(cfg)}, _points())
    text = G.format_generate_table(report)
    rows = [r for r in (line.split() for line in text.splitlines())
            if r and r[0].startswith("mixgemm-") and r[1] in ("-", "off", "on")]
    assert [(r[0], r[3], r[5]) for r in rows] == [("mixgemm-u2", "1", "2.00x"), ("mixgemm-u2-fp8", "1", "1.25x"),
                                                  ("mixgemm-u2-auto", "1", "2.50x"),
                                                  ("mixgemm-u2-auto", "16", "2.00x")]
    assert "-fp8: quantize_model(act_format='fp8')" in text and "-auto: act_format='auto'" in text
    assert "mixgemm-u2-auto fuse_layers=off static b16: act_format='auto': e4m3 in 0 of 128 layers" in text
    assert "-auto: act_format" not in G.format_generate_table(
        dataclasses.replace(report, points=[p for p in report.points if p.variant in ("bf16", "mixgemm-u2")]))

    path = tmp_path / "g.json"
    bench.write_generate_outputs(report, G.GenerateConfig(json_path=str(path)), log=lambda s: None)
    doc = json.loads(path.read_text())
    assert doc["config"]["types"] == ["mixgemm-u2", "mixgemm-u2-fp8", "mixgemm-u2-auto"]
    assert [p["variant"] for p in doc["points"]] == [p.variant for p in report.points]
    assert G.GenerateReport.from_dict(doc) == report

    pytest.importorskip("matplotlib")
    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, p: figures.append(fig) or p)
    assert bench.write_generate_plot(report.points, tmp_path / "g.png")[0]
    labels = [t.get_text() for t in figures[0].legends[0].get_texts() if t.get_text() != "GPU step ceiling"]
    assert labels == ["bf16", "mixgemm-u2 fuse_layers=off", "mixgemm-u2-fp8 fuse_layers=off",
                          "mixgemm-u2-auto fuse_layers=off"]
