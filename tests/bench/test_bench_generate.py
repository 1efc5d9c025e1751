"""``mixgemm bench --generate`` without a GPU: the options and their one-line errors, the
arithmetic of the reported figures (tok/s, per-token time, speedups, ceilings), the FAIL rules,
the table, the JSON round trip and merge, the plot, the transformers models built from the
presets (on the meta device: the real shapes, no memory), and the pieces of the GPU run that
also run on the CPU (a tiny model's recorded decode step, the timed generate() calls, the
modes' forwards)."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

from mixgemm import bench
from mixgemm.bench import generate as G
from mixgemm.bench import plots
from mixgemm.bench.decoder import PRESETS, ModelPreset
from mixgemm.bench.generate import GenMeasurement, analyze_generate
from mixgemm.dtypes import WeightType

from bench_helpers import machine, parse, stats
from bench_helpers import generate_run_on_the_cpu

CPU = torch.device("cpu")
BASE = dict(preset="llama3-8b", prompt_tokens=128, new_tokens=64, layers=32)


def gen(*argv):
    return bench.generate_config_from_args(parse("--generate", *argv))


# --------------------------------------------------------------------------------- options
def test_defaults():
    cfg = gen("llama3-8b")
    assert (cfg.name, cfg.source, cfg.layers, cfg.batches) == ("llama3-8b", G.PRESET, None, (1, 16))
    assert (cfg.prompt_tokens, cfg.new_tokens, cfg.repeats, cfg.group_size) == (128, 64, 3, 128)
    assert cfg.modes == ("eager", "compile", "static", "reduce-overhead") == G.GEN_MODES
    assert [v.weight_type for v in cfg.types] == [WeightType.U4] and cfg.fuse == (False, True)
    assert (cfg.iters, cfg.warmup, cfg.quick) == (50, 5, False)
    assert [r.label for r in cfg.runs()] == ["bf16", "mixgemm-u4 fuse_layers=off", "mixgemm-u4 fuse_layers=on"]


def test_the_issues_example_parses():
    cfg = gen("llama3-8b", "--layers", "4", "--batch", "1", "--gen-modes", "eager")
    assert (cfg.layers, cfg.batches, cfg.modes) == (4, (1,), ("eager",))
    doc = cfg.to_json()
    assert doc["mode_definitions"] == {"eager": G.MODE_DEFINITIONS["eager"]} and doc["layers"] == 4


def test_overrides():
    cfg = gen("QWEN2.5-7B", "--types", "u4,u2,s8,int4", "--fuse-layers", "off", "--gen-modes",
              "static, Reduce-Overhead,static", "--prompt-tokens", "32", "--new-tokens", "8", "--repeats", "5",
              "--batch", "4,4,2", "--group-size", "64", "--seed", "3", "--iters", "7", "--quick")
    assert cfg.name == "qwen2.5-7b" and cfg.modes == ("static", "reduce-overhead")
    assert [v.weight_type for v in cfg.types] == [WeightType.U4, WeightType.U2, WeightType.S8]
    assert (cfg.fuse, cfg.batches, cfg.prompt_tokens, cfg.new_tokens, cfg.repeats) == ((False,), (4, 2), 32, 8, 5)
    assert (cfg.group_size, cfg.seed, cfg.iters, cfg.quick) == (64, 3, 7, True)
    assert [r.label for r in cfg.runs()] == ["bf16"] + [f"mixgemm-{t} fuse_layers=off" for t in ("u4", "u2", "s8")]


@pytest.mark.parametrize("argv,needle", [
    (["llama3-8b", "--gen-modes", "eager,lazy"], "--gen-modes: unknown 'lazy'; expected eager, compile"),
    (["llama3-8b", "--gen-modes", ","], "expected a comma-separated list of names"),
    (["llama3-8b", "--types", "u3"], "--types: unknown variant 'u3'"),
    (["llama3-8b", "--types", "bf16"], "--types: 'bf16' is not a mixgemm weight type"),
    (["llama3-8b", "--types", "torch-int4"], "is not a mixgemm weight type"),
    (["llama3-8b", "--new-tokens", "1"], "--new-tokens must be at least 2"),
    (["llama3-8b", "--prompt-tokens", "0"], "--prompt-tokens must be at least 1"),
    (["llama3-8b", "--repeats", "0"], "--repeats must be at least 1"),
    (["llama3-8b", "--layers", "0"], "--layers must be 1 to 32"),
    (["llama3-8b", "--layers", "33"], "--layers must be 1 to 32"),
    (["llama4"], "neither a model preset"),
    (["llama3-8b", "--dtype", "fp16"], "bf16"),
    (["llama3-8b", "--iters", "10"], "--quick"),
    (["llama3-8b", "--context", "8"], "--context do not apply to --generate"),
    (["llama3-8b", "--variants", "int4"], "only apply to --model, --host and --moe"),
    (["llama3-8b", "--tokens", "4"], "only apply to --moe"),
])
def test_bad_options_are_one_line_errors(argv, needle, capsys):
    if needle == "expected a comma-separated list of names":       # argparse's own check
        with pytest.raises(SystemExit) as e:
            parse("--generate", *argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err
        return
    with pytest.raises(bench.BenchError) as e:
        gen(*argv)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert bench.main(["--generate", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mixgemm bench: error: ") and needle in err and err.count("\n") == 1


@pytest.mark.parametrize("bad", ["0", "1,-2", "x"])
def test_bad_batch_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        parse("--generate", "llama3-8b", "--batch", bad)
    assert e.value.code == 2 and "positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--types", "u4"], "--types only apply to --generate"),
    (["--model", "llama3-8b", "--gen-modes", "eager"], "--gen-modes only apply to --generate"),
    (["--layers", "2"], "only apply to --model and --host (--layers and --batch also to --generate)"),
])
def test_generate_options_need_generate(argv, needle, capsys):
    assert bench.main(["--quick", *argv]) == 1
    assert needle in capsys.readouterr().err


def test_generate_excludes_the_other_modes(capsys):
    with pytest.raises(SystemExit):
        parse("--generate", "llama3-8b", "--model", "llama3-8b")
    assert "not allowed with" in capsys.readouterr().err


def test_no_gpu_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--generate", "llama3-8b", "--layers", "4", "--batch", "1", "--gen-modes", "eager"]) == 1
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err and err.count("\n") == 1


def test_list_kernels_refuses_generate(capsys):
    assert bench.main(["--generate", "llama3-8b", "--list-kernels"]) == 1
    assert "build_for" in capsys.readouterr().err


def _model_dir(tmp_path, name, **extra):
    d = tmp_path / name
    d.mkdir()
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 256, **extra}
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_directory_targets(tmp_path):
    plain = _model_dir(tmp_path, "plain")
    cfg = gen(str(plain), "--types", "u2", "--fuse-layers", "on")
    assert (cfg.name, cfg.source, cfg.quant_method) == ("plain", G.HF_DIR, None)
    assert [r.label for r in cfg.runs()] == ["bf16", "mixgemm-u2 fuse_layers=on"]
    desc = G.model_description(cfg)
    assert (desc["hidden"], desc["head_dim"], desc["kv_heads"], desc["layers"]) == (64, 16, 2, 3)
    awq = _model_dir(tmp_path, "awq", quantization_config={"quant_method": "awq", "bits": 4})
    cfg = gen(str(awq))
    assert (cfg.source, cfg.quant_method) == (G.QUANTIZED_DIR, "awq")
    assert [r.label for r in cfg.runs()] == ["bf16", "awq fuse_layers=off", "awq fuse_layers=on"]
    with pytest.raises(bench.BenchError, match="already quantized"):
        gen(str(awq), "--types", "u4")
    with pytest.raises(bench.BenchError, match="--layers applies to a preset"):
        gen(str(plain), "--layers", "2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(bench.BenchError, match="not a transformers model directory"):
        gen(str(tmp_path / "empty"))


def test_unavailable_reasons():
    support = {"quantize_model": False, "from_pretrained": True}
    cfg = gen("llama3-8b")
    bf16, off, on = cfg.runs()
    assert G.unavailable_reason(cfg, bf16, support, (False, "no GPU")) is None
    assert G.unavailable_reason(cfg, off, support) is None
    assert G.unavailable_reason(cfg, on, support) == ("fuse_layers=on: mixgemm.nn.quantize_model has no fuse_layers "
                                                      "keyword in this mixgemm")
    assert G.unavailable_reason(cfg, off, support, (False, "needs sm_90")) == "needs sm_90"
    assert "quantize_model has no fuse_layers" in G.fuse_note(cfg, support)
    assert G.fuse_note(cfg, {**support, "quantize_model": True}) == ""
    ckpt = G.GenerateConfig(source=G.QUANTIZED_DIR, quant_method="gptq")
    b, off, on = ckpt.runs()
    assert "no bf16 baseline" in G.unavailable_reason(ckpt, b, support)
    assert G.unavailable_reason(ckpt, on, support) is None          # from_pretrained takes it here
    assert G.fuse_note(ckpt, support) == ""


def test_accepts_keyword():
    assert G.accepts_keyword(lambda a, fuse_layers=False: a, "fuse_layers")
    assert G.accepts_keyword(lambda a, **kw: a, "fuse_layers")
    assert not G.accepts_keyword(lambda a, b=1: a, "fuse_layers")


def test_generate_kwargs_per_mode():
    assert G.generate_kwargs("eager") == {"disable_compile": True}           # the model's default cache
    assert G.generate_kwargs("static") == {"cache_implementation": "static", "disable_compile": False}
    assert G.generate_kwargs("compile") == {"cache_implementation": "static", "disable_compile": True}
    ro = G.generate_kwargs("reduce-overhead")           # generate()'s own compile, CUDA graphs, no graph break
    config = ro.pop("compile_config")
    assert ro == {"cache_implementation": "static", "disable_compile": False}
    assert (config.mode, config.fullgraph) == ("reduce-overhead", True)
    with pytest.raises(ValueError, match="unknown mode"):
        G.generate_kwargs("graph")


# -------------------------------------------------------------------------------- analysis
def test_generate_times():
    gen_ms, pre_ms, per = G.generate_times([1.2, 1.0, 1.1], [0.3, 0.1, 0.2], 10)
    assert gen_ms == pytest.approx(1100.0) and pre_ms == pytest.approx(200.0) and per == pytest.approx(100.0)
    assert G.generate_times([1.0], [], 10) == (1000.0, None, None)
    assert G.generate_times([0.1], [0.2], 10)[2] is None          # not positive: no per-token time
    assert G.tokens_per_second(16, 64, 2000.0) == pytest.approx(512.0)
    assert G.tokens_per_second(1, 1, None) is None and G.tokens_per_second(1, 1, 0.0) is None


def _m(variant, fuse, mode="eager", batch=1, gen_s=(2.0,), pre_s=(0.2,), step_us=10_000.0, host_us=25_000.0,
       made=None, **kw):
    return GenMeasurement(**BASE, variant=variant, fuse=fuse, mode=mode, batch=batch, generate_s=gen_s,
                          prefill_s=pre_s, first_s=30.0, new_tokens_made=made or (64,) * len(gen_s),
                          step=None if step_us is None else stats(step_us, 50), step_finite=True,
                          host_us=host_us, host_queued=True, **kw)


def _points():
    meas = [_m("bf16", "-", gen_s=(2.0, 2.2, 1.9), pre_s=(0.2, 0.1, 0.3)),
            _m("mixgemm-u4", "off", gen_s=(1.0, 1.0, 1.0), pre_s=(0.1, 0.1, 0.1), step_us=4_000.0, host_us=30_000.0),
            _m("mixgemm-u4", "on", gen_s=(0.5,), pre_s=(0.05,), step_us=3_500.0, host_us=5_000.0,
               mode_step_us=3_900.0),
            _m("bf16", "-", mode="static", batch=16, gen_s=(1.0,), pre_s=(0.2,)),
            _m("mixgemm-u4", "off", mode="static", batch=16, gen_s=(0.8,), pre_s=(0.2,), made=(63,)),
            _m("mixgemm-u4", "on", mode="static", batch=16, gen_s=(0.4,), pre_s=(0.1,),
               error="generate() compiled nothing (its auto-compile criteria were not met)"),
            _m("mixgemm-u4", "on", mode="compile", gen_s=(), pre_s=(), error="needs fuse_layers", unavailable=True),
            _m("mixgemm-u4", "off", mode="compile", gen_s=(1.0,), pre_s=(0.1,), note="host time: x"),
            dataclass_replace(_m("mixgemm-u4", "off", mode="reduce-overhead"), step_finite=False)]
    return analyze_generate(meas)


def dataclass_replace(m, **kw):
    import dataclasses

    return dataclasses.replace(m, **kw)


def test_analysis_figures_and_speedups():
    pts = _points()
    bf16, off, on = pts[:3]
    assert bf16.generate_ms == pytest.approx(2000.0) and bf16.prefill_ms == pytest.approx(200.0)
    assert bf16.ms_per_token == pytest.approx(1800.0 / 63) and bf16.tok_s == pytest.approx(32.0)
    assert bf16.decode_tok_s == pytest.approx(63 / 1.8) and bf16.speedup_vs_bf16 == pytest.approx(1.0)
    assert bf16.gpu_step_ms == pytest.approx(10.0) and bf16.ceiling_tok_s == pytest.approx(100.0)
    assert bf16.host_ms_per_token == pytest.approx(25.0) and bf16.step_iters == 50 and bf16.repeats == 3
    assert off.tok_s == pytest.approx(64.0) and off.speedup_vs_bf16 == pytest.approx(2.0)
    assert off.decode_speedup_vs_bf16 == pytest.approx((1800.0 / 63) / (900.0 / 63))
    assert on.speedup_vs_bf16 == pytest.approx(4.0) and on.ceiling_tok_s == pytest.approx(1e3 / 3.5)
    assert on.mode_step_ms == pytest.approx(3.9) and bf16.mode_step_ms is None
    assert all(p.status == bench.OK for p in pts[:4]) and pts[0].first_generate_s == 30.0


def test_analysis_fail_and_error_rules():
    pts = {(p.variant, p.fuse, p.mode, p.batch): p for p in _points()}
    wrong = pts[("mixgemm-u4", "off", "static", 16)]
    assert wrong.status == bench.FAIL and "made 63 new tokens, expected 64" in wrong.note
    assert wrong.speedup_vs_bf16 is None and wrong.tok_s is not None
    nothing = pts[("mixgemm-u4", "on", "static", 16)]
    assert nothing.status == bench.ERROR and "compiled nothing" in nothing.note and nothing.speedup_vs_bf16 is None
    na = pts[("mixgemm-u4", "on", "compile", 1)]
    assert na.status == bench.UNAVAILABLE and na.tok_s is None
    no_base = pts[("mixgemm-u4", "off", "compile", 1)]
    assert no_base.status == bench.OK and no_base.speedup_vs_bf16 is None and no_base.note == "host time: x"
    nan = pts[("mixgemm-u4", "off", "reduce-overhead", 1)]
    assert nan.status == bench.FAIL and "NaN" in nan.note


# ------------------------------------------------------------------------------ the report
def _report(points=None, **config):
    cfg = G.GenerateConfig(layers=32)
    conf = {**cfg.to_json(), "transformers_version": "5.24.0", "static_compile_config": {"bf16": {"mode": "reduce-overhead"}},
            **config}
    return G.GenerateReport(machine(), conf, {cfg.name: G.model_description(cfg)}, points or _points())


def test_table():
    import dataclasses

    pts = _points()
    pts[1] = dataclasses.replace(pts[1], host_queued=False)
    text = G.format_generate_table(_report(pts))
    for words in ("transformers 5.24.0", "torch 2.11.0+cu130", "GPU NVIDIA H100 80GB HBM3", *G.GEN_TABLE_HEADER,
                  "static's CompileConfig, bf16: {'mode': 'reduce-overhead'}", G.MODE_DEFINITIONS["reduce-overhead"],
                  "llama3-8b (meta-llama/Meta-Llama-3-8B): llama, hidden 4096, intermediate 14336, heads 32/8 x 128",
                  "vocab 128256; 32 of its 32 layers", "compiled nothing", "made 63 new tokens",
                  "mixgemm-u4 fuse_layers=off compile b1: host time: x", "!: the GPU woke"):
        assert words in text, words
    rows = [r for r in (line.split() for line in text.splitlines())
            if r and r[0] in ("bf16", "mixgemm-u4") and r[1] in ("-", "off", "on")]
    # variant x fuse x mode x batch: bf16 first, then u4 off, then u4 on; eager before compile before static
    assert [r[:4] for r in rows] == [["bf16", "-", "eager", "1"], ["bf16", "-", "static", "16"],
                                     ["mixgemm-u4", "off", "eager", "1"], ["mixgemm-u4", "off", "compile", "1"],
                                     ["mixgemm-u4", "off", "static", "16"],
                                     ["mixgemm-u4", "off", "reduce-overhead", "1"],
                                     ["mixgemm-u4", "on", "eager", "1"], ["mixgemm-u4", "on", "compile", "1"],
                                     ["mixgemm-u4", "on", "static", "16"]]
    assert rows[2][4:9] == ["64.0", "2.00x", "100.0", "14.29", "4.00"] and rows[2][10] == "30.00!"


def test_json_round_trip_and_merge(tmp_path):
    rep = _report()
    cfg = G.GenerateConfig(json_path=str(tmp_path / "g.json"))
    written = bench.write_generate_outputs(rep, cfg, log=lambda s: None)
    doc = json.loads(written[0].read_text())
    assert doc["schema"] == G.GENERATE_SCHEMA and doc["config"]["transformers_version"] == "5.24.0"
    back = G.GenerateReport.from_dict(doc)
    assert back == rep and back.points[1].speedup_vs_bf16 == pytest.approx(2.0)
    with pytest.raises(ValueError, match="not a"):
        G.GenerateReport.from_dict({**doc, "schema": "mixgemm.bench.model/1"})
    eager = [p for p in rep.points if p.mode == "eager"]
    rest = [p for p in rep.points if p.mode != "eager"]
    parts = []
    for i, pts in enumerate((eager, rest)):
        path = tmp_path / f"part{i}.json"
        bench.write_generate_outputs(_report(pts, modes=sorted({p.mode for p in pts})),
                                     G.GenerateConfig(json_path=str(path)), log=lambda s: None)
        parts.append(str(path))
    out = tmp_path / "merged.json"
    assert bench.main(["--merge", *parts, "--json", str(out)]) == 1       # the FAIL points carry over
    merged = G.GenerateReport.from_dict(json.loads(out.read_text()))
    assert sorted(p.key for p in merged.points) == sorted(p.key for p in rep.points)
    assert merged.config["modes"] == sorted(G.GEN_MODES)
    with pytest.raises(ValueError, match="more than one run"):
        G.GenerateReport.merge([rep, rep])


def test_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    ok, path = bench.write_generate_plot(_points(), tmp_path / "g.png", title="t")
    assert ok and (tmp_path / "g.png").stat().st_size > 1000


def test_plot_without_matplotlib_or_points(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "_matplotlib", lambda: None)
    assert bench.write_generate_plot(_points(), tmp_path / "g.png") == (False, plots.NO_MATPLOTLIB)
    monkeypatch.setattr(plots, "_matplotlib", lambda: (object, object))
    failed = [p for p in _points() if p.status != bench.OK]
    assert bench.write_generate_plot(failed, tmp_path / "g.png") == (False, "no ok points to plot")


# ------------------------------------------------------------------------------- the models
def test_every_preset_has_a_transformers_model():
    assert set(G.PRESET_MODELS) == set(PRESETS)
    for name, preset in PRESETS.items():
        assert (G.PRESET_MODELS[name].model_type == "qwen2") == preset.qkv_bias


@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-7b"])
def test_preset_model_has_the_presets_shapes(name):
    from mixgemm.bench.generate_run import build_preset_model

    preset = PRESETS[name]
    model = build_preset_model(preset, 2, "meta", 0)           # the real sizes, no memory
    family = G.PRESET_MODELS[name]
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family.model_type]
    assert model.dtype == torch.bfloat16 and len(model.model.layers) == 2 and not model.training
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.q_proj.weight.shape == (preset.q_size, preset.hidden)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (preset.kv_size, preset.hidden)
    assert attn.o_proj.weight.shape == (preset.hidden, preset.q_size)
    assert (attn.q_proj.bias is not None) == preset.qkv_bias
    assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (preset.intermediate, preset.hidden)
    assert mlp.down_proj.weight.shape == (preset.hidden, preset.intermediate)
    assert model.lm_head.weight.shape == model.model.embed_tokens.weight.shape == (family.vocab, preset.hidden)
    assert model.config.rope_parameters["rope_theta"] == preset.rope_theta
    assert model.config.rms_norm_eps == preset.rms_eps and model.config.max_position_embeddings == family.max_positions
    desc = G.model_description(G.GenerateConfig(name=name, layers=2))
    assert (desc["layers"], desc["model_layers"], desc["vocab"]) == (2, preset.model_layers, family.vocab)


# ------------------------------------------------- the GPU run's pieces that run on the CPU
TINY = ModelPreset("tiny", "test", hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, qkv_bias=False,
                   rope_theta=10000.0, rms_eps=1e-5, model_layers=2)


@pytest.fixture
def tiny(monkeypatch):
    from mixgemm.bench import generate_run as R

    monkeypatch.setitem(G.PRESET_MODELS, "tiny", G.PresetModel("llama", 128, 64))
    model = R.build_preset_model(TINY, None, CPU, 0)
    prompt = R.prompt_ids(128, 2, 6, 0, CPU)
    return R, model, prompt


def test_recorded_decode_step_repeats(tiny):
    R, model, prompt = tiny
    pad = R.pad_token_id(model)
    with torch.no_grad():
        step = R.record_decode_step(model, prompt, 4, pad)
        assert "forward" not in vars(model)                       # the model's own forward again
        assert step.kwargs["input_ids"].shape == (2, 1) and step.counters
        assert [int(s) for _, s in step.counters] == [6 + 2] * 2   # prompt + 2 tokens written before the last step
        call = step.call(model)
        first = call().logits.clone()
        assert [int(t) for t, _ in step.counters] == [9, 9]
        again = call().logits
    assert torch.equal(first, again) and [int(t) for t, _ in step.counters] == [9, 9]


def test_compiled_forwards_keep_the_signature(tiny):
    R, model, _ = tiny
    params = list(inspect.signature(model.forward).parameters)
    assert "logits_to_keep" in params             # generate() reads it from the forward's signature
    with R.mode_forward(model, "compile") as host:
        assert "forward" in vars(model) and host() is model
        assert list(inspect.signature(model.forward).parameters) == params
    assert "forward" not in vars(model)
    for mode in ("static", "reduce-overhead"):
        vars(model)["_compiled_call"] = object()
        with R.mode_forward(model, mode) as host:
            assert "forward" not in vars(model)
            assert host() is None                  # forgotten: generate() compiles afresh


def test_run_generate_on_the_cpu(tiny, monkeypatch):
    """The whole GPU run on a tiny preset with the CUDA-only timers replaced by wall-clock ones:
    bf16 runs in eager (figures, ceiling, host time) and in static (where generate() compiles
    nothing on the CPU: reported as an error, its times kept); mixgemm's variants are n/a here."""
    import dataclasses

    R, _, _ = tiny
    monkeypatch.setitem(PRESETS, "tiny", TINY)
    generate_run_on_the_cpu(monkeypatch, R, host_us=123.0, gpu_loop_us=456.0)
    import mixgemm.bench.peers as peers

    monkeypatch.setattr(peers, "mixgemm_available", lambda: (False, "needs a CUDA GPU"))
    cfg = dataclasses.replace(G.GenerateConfig(), name="tiny", target="tiny", batches=(1, 2), prompt_tokens=5,
                              new_tokens=3, repeats=1, modes=("eager", "static"), iters=2, warmup=0)
    meas, info = R.run_generate(cfg, CPU, log=lambda s: None)
    assert info["transformers_version"] and set(info["fuse_layers_supported"]) == {"quantize_model", "from_pretrained"}
    pts = {(p.variant, p.fuse, p.mode, p.batch): p for p in analyze_generate(meas)}
    assert len(pts) == 3 * 2 * 2
    for b in (1, 2):
        eager = pts[("bf16", "-", "eager", b)]
        assert eager.status == bench.OK, eager.note
        assert eager.tok_s > 0 and eager.prefill_ms > 0 and eager.gpu_step_ms > 0 and eager.step_iters == 2
        assert eager.repeats == 1 and eager.first_generate_s > 0
        assert eager.host_ms_per_token == pytest.approx(0.123) and eager.speedup_vs_bf16 == pytest.approx(1.0)
        assert eager.mode_step_ms == pytest.approx(0.456)
        static = pts[("bf16", "-", "static", b)]
        assert static.status == bench.ERROR and "compiled nothing" in static.note and static.tok_s > 0
        for fuse in ("off", "on"):
            u4 = pts[("mixgemm-u4", fuse, "eager", b)]
            assert u4.status == bench.UNAVAILABLE and u4.note == "needs a CUDA GPU" and u4.layers == 2


def test_a_step_that_waits_for_the_gpu_gets_no_host_time(tiny):
    """transformers' eager mask code synchronizes: a step still running after the longest sleep
    reports no host time (not the sleep it waited out) and no GPU time in its mode, and says why."""
    R, _, _ = tiny
    from mixgemm.bench.host import HostPoint

    waited = HostPoint("decode step", 1, 0, 0, bench.OK, host_us=G.STEP_MAX_SLEEP_US, gpu_loop_us=9000.0,
                       queued=False)
    host_us, mode_step_us, queued, note = R._host_figures(waited)
    assert host_us is None and mode_step_us is None and queued is False and "waits for the GPU" in note
    ok = HostPoint("decode step", 1, 0, 0, bench.OK, host_us=1500.0, gpu_loop_us=2900.0, queued=True)
    assert R._host_figures(ok) == (1500.0, 2900.0, True, "")


def test_timed_generate_calls_run_with_the_heap_frozen(monkeypatch):
    """The warm-up calls (the compile) run with the collector as it is; the timed calls with the
    heap frozen, and it is unfrozen after them, even when a call fails."""
    import gc

    from mixgemm.bench import generate_run as R

    frozen = []

    def fake_greedy(model, prompt, tokens, pad, **kw):
        frozen.append(gc.get_freeze_count() > 0)
        return torch.zeros(1, prompt.shape[-1] + tokens, dtype=torch.long)

    monkeypatch.setattr(R, "greedy", fake_greedy)
    assert gc.get_freeze_count() == 0
    times = R.time_generate(None, torch.zeros(1, 4, dtype=torch.long), {}, 3, 2, 0, torch.device("cpu"))
    assert len(times.generate_s) == 2 and times.made == (3, 3)
    assert frozen == [False] * (G.WARMUP_GENERATES + 1) + [True] * 4
    assert gc.get_freeze_count() == 0

    def failing(*a, **k):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError), R.frozen_heap():
        failing()
    assert gc.get_freeze_count() == 0


def test_compile_config_record_is_json():
    """A CompileConfig with a guard filter function (a fused model's) records as JSON data."""
    import json

    def guard_filter(entries):
        return entries

    rec = G.compile_config_record({"mode": None, "fullgraph": False,
                                   "options": {"triton.cudagraphs": True, "guard_filter_fn": guard_filter}})
    assert json.loads(json.dumps(rec)) == rec
    assert rec["options"]["guard_filter_fn"].endswith("test_compile_config_record_is_json.<locals>.guard_filter")
    assert rec["mode"] is None and rec["options"]["triton.cudagraphs"] is True


def test_table_reads_a_report_of_one_compile_config():
    """A report written when one CompileConfig was recorded for every variant still prints it."""
    text = G.format_generate_table(_report(static_compile_config={"mode": "reduce-overhead", "fullgraph": False}))
    assert "static's CompileConfig, every variant: {'mode': 'reduce-overhead', 'fullgraph': False}" in text
