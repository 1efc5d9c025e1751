"""``mixgemm bench --moe`` without a GPU: the presets, the routing generators (deterministic, distinct
experts per token, Zipf actually skewed), the bytes a layer moves (by hand, and against the tensors
the variants hold), the floor / fraction / speedup arithmetic, the FAIL rules, the table, JSON,
--save, the plot, the kernel list, the options and their errors, and the run end to end on the CPU
(bf16 per-expert loop, and torch-int4 through PyTorch's CPU tinygemm, against their references)."""
from __future__ import annotations

import json

import pytest
import torch

from mixgemm import bench
from mixgemm.bench import moe as B
from mixgemm.bench import moe_run as R
from mixgemm.bench import variants as V
from mixgemm.moe import fused_moe_reference
from mixgemm.jit.specs import GroupedDecodeSpec, MoeLayoutSpec
from mixgemm.dtypes import ActType, WeightType

from bench_helpers import machine, parse, stats, WallClock

CPU = torch.device("cpu")
SMALL = B.MoePreset("small", "test", hidden=128, intermediate=128, experts=6, topk=2)
PRESETS_T = {**B.MOE_PRESETS, "small": SMALL}
U4, U2, S8 = (V.Variant(V.VariantKind.MIXGEMM, w) for w in (WeightType.U4, WeightType.U2, WeightType.S8))


def test_presets():
    assert {n: (p.hidden, p.intermediate, p.experts, p.topk) for n, p in B.MOE_PRESETS.items()} == {
        "qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2),
        "deepseek-v3": (7168, 2048, 256, 8)}
    # DeepSeek-V3's routed experts in bf16: 256 * 3 * 7168 * 2048 * 2 bytes ~ 22.5 GB
    assert B.MOE_PRESETS["deepseek-v3"].expert_elements * 256 * 2 == 22_548_578_304


# ----------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("routing", B.ROUTINGS)
def test_routing_is_deterministic_with_distinct_experts_per_token(routing):
    ids, w = B.make_routing(128, 8, 257, routing, seed=3)
    assert ids.shape == w.shape == (257, 8) and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert int(ids.min()) >= 0 and int(ids.max()) < 128
    assert all(len(set(row)) == 8 for row in ids.tolist())                    # top-k distinct experts
    assert torch.allclose(w.sum(1), torch.ones(257)) and bool((w > 0).all())
    ids2, w2 = B.make_routing(128, 8, 257, routing, seed=3)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)                      # same for every variant
    assert not torch.equal(ids, B.make_routing(128, 8, 257, routing, seed=4)[0])
    assert sum(B.expert_counts(ids, 128)) == 257 * 8


def test_zipf_is_skewed_and_uniform_is_not():
    tokens, e, k = 4096, 128, 8
    uni = sorted(B.expert_counts(B.make_routing(e, k, tokens, "uniform", 0)[0], e), reverse=True)
    zipf = sorted(B.expert_counts(B.make_routing(e, k, tokens, "zipf", 0)[0], e), reverse=True)
    mean = tokens * k / e                                                       # 256 rows per expert
    assert uni[0] < 1.5 * mean and uni[-1] > 0.5 * mean
    assert zipf[0] > 4 * mean                   # the hottest expert takes several times its share
    assert sum(zipf[:8]) > 0.4 * tokens * k     # and 8 of 128 experts take a large part of the rows
    # the hot experts are not always the lowest ids
    ids = B.make_routing(e, k, tokens, "zipf", 0)[0]
    counts = B.expert_counts(ids, e)
    assert max(range(e), key=counts.__getitem__) != 0 or max(range(e), key=B.expert_counts(
        B.make_routing(e, k, tokens, "zipf", 1)[0], e).__getitem__) != 0
    # one token: top-k experts touched
    one = B.make_routing(e, k, 1, "zipf", 0)[0]
    assert sum(1 for c in B.expert_counts(one, e) if c) == k


def test_routing_errors():
    with pytest.raises(ValueError, match="topk"):
        B.make_routing(4, 5, 3, "uniform", 0)
    with pytest.raises(ValueError, match="unknown routing"):
        B.make_routing(4, 2, 3, "pareto", 0)


# ------------------------------------------------------------------------------------- bytes
def test_expert_bytes_by_hand():
    # qwen3-30b-a3b, group 128: gate/up [1536, 2048] and down [2048, 768] = 4,718,592 weights;
    # scale rows: 16 * 1536 + 6 * 2048 = 36,864 -> 73,728 bytes of 16-bit scales
    q = B.MOE_PRESETS["qwen3-30b-a3b"]
    assert B.expert_weight_bytes(q, V.BF16, 128) == 2 * 4_718_592
    assert B.expert_weight_bytes(q, U4, 128) == 4_718_592 // 2 + 2 * 73_728            # + zeros
    assert B.expert_weight_bytes(q, U2, 128) == 4_718_592 // 4 + 2 * 73_728
    assert B.expert_weight_bytes(q, S8, 128) == 4_718_592 + 73_728                     # no zeros
    assert B.expert_weight_bytes(q, V.TORCH_INT4, 128) == 4_718_592 // 2 + 2 * 73_728  # scale_and_zeros


def test_traffic_by_hand():
    # small: H = I = 128, top-2; 5 tokens -> 10 routed rows touching 4 experts of 1000 bytes
    t = B.moe_traffic(SMALL, 5, 4, 1000)
    assert t.weights == 4000
    assert t.activations == 2 * (2 * 5 * 128 + 10 * 256 + 10 * 256) + 8 * 10 == 12_880
    assert t.total == 16_880
    assert B.floor_us(3_000_000, 3000.0) == pytest.approx(1.0)


def test_layer_bytes_match_the_formula_and_references_on_the_cpu():
    """The tensors the bf16 and torch-int4 layers hold are the formula's; the mixgemm layer's
    PackedExperts too (packed on the CPU), and its reference weights are its dequantized experts."""
    w13, w2 = R.base_weights(SMALL, 0, CPU)
    assert w13.shape == (6, 256, 128) and w2.shape == (6, 128, 128) and w13.dtype == torch.bfloat16
    assert torch.equal(w13, R.base_weights(SMALL, 0, CPU)[0])
    bf = R.Bf16Layer(w13, w2, grouped=False)
    assert bf.expert_bytes == B.expert_weight_bytes(SMALL, V.BF16, 64)
    g, u = bf.reference_weights()[0][3].reshape(-1, 2, 8, 128).unbind(1)      # interleaved in 8-row stripes
    assert torch.equal(g.reshape(-1, 128), w13[3, :128]) and torch.equal(u.reshape(-1, 128), w13[3, 128:])
    for variant in (U4, S8):
        mix = R.MixgemmLayer(w13, w2, variant, 64)
        assert mix.expert_bytes == B.expert_weight_bytes(SMALL, variant, 64)
        assert mix.w13.num_experts == 6 and mix.w13.weight_type is variant.weight_type
        d13, d2 = mix.reference_weights()
        err = (d13[2].float() - R._interleaved(w13[2]).float()).norm() / w13[2].float().norm()
        assert 0 < float(err) < (0.1 if variant is U4 else 0.01)
        assert d2[5].shape == (128, 128)


# ----------------------------------------------------------------------------------- analysis
def meas(variant, us, routing="uniform", tokens=16, err=1e-3, preset="small", **kw):
    base = dict(experts_touched=kw.pop("experts_touched", 4), max_expert_rows=kw.pop("max_expert_rows", 9))
    if us is None:
        return B.MoeMeasurement(preset, routing, tokens, variant, **base, **kw)
    return B.MoeMeasurement(preset, routing, tokens, variant, **base, timing=stats(us), err=err, **kw)


def point(points, variant, routing="uniform", tokens=16):
    return next(p for p in points if p.variant == variant and p.routing == routing and p.tokens == tokens)


def test_floor_fraction_and_speedup():
    ms = [meas("bf16", 100.0, expert_bytes=10_000), meas("mixgemm-u4", 25.0, expert_bytes=3_000),
          meas("bf16", 50.0, routing="zipf"), meas("mixgemm-u4", 40.0, routing="zipf")]
    pts = B.analyze_moe(ms, 1000.0, presets=PRESETS_T)
    u4 = point(pts, "mixgemm-u4")
    act = B.moe_traffic(SMALL, 16, 4, 0).activations
    assert u4.status == bench.OK and u4.weight_bytes == 12_000 and u4.total_bytes == 12_000 + act
    assert u4.floor_us == pytest.approx((12_000 + act) / 1e12 * 1e6)        # 1000 GB/s
    assert u4.frac_of_floor == pytest.approx(u4.floor_us / 25.0)
    assert u4.speedup_vs_bf16 == pytest.approx(4.0)
    assert point(pts, "bf16").speedup_vs_bf16 == pytest.approx(1.0)
    # zipf's speedup is over zipf's bf16; no measured bytes: the formula's
    z = point(pts, "mixgemm-u4", "zipf")
    assert z.speedup_vs_bf16 == pytest.approx(50 / 40)
    assert z.expert_bytes == B.expert_weight_bytes(SMALL, U4, 128)
    assert B.analyze_moe(ms, None, presets=PRESETS_T)[0].floor_us is None


@pytest.mark.parametrize("kw,needle", [
    (dict(err=0.5), "err 5.00e-01 > 2e-02"),
    (dict(err=float("nan")), "err is nan"),
    (dict(err=None), "err not measured"),
    (dict(replay_err=0.1), "replay_err"),
    (dict(output_finite=False), "NaN/inf"),
])
def test_bad_points_fail(kw, needle):
    pts = B.analyze_moe([meas("bf16", 10.0), meas("mixgemm-u2", 5.0, **kw)], 1000.0, presets=PRESETS_T)
    bad = point(pts, "mixgemm-u2")
    assert bad.status == bench.FAIL and needle in bad.note and bad.speedup_vs_bf16 is None
    assert B.failed(pts) == [bad]


def test_bar_unavailable_and_errors():
    pts = B.analyze_moe([meas("bf16", 10.0, err=0.03), meas("torch-int4", None, error="no tinygemm", unavailable=True),
                         meas("mixgemm-s8", None, error="KernelError: x")], 1000.0, max_error=0.05,
                        presets=PRESETS_T)
    assert point(pts, "bf16").status == bench.OK
    assert point(pts, "torch-int4").status == bench.UNAVAILABLE and point(pts, "torch-int4").note == "no tinygemm"
    assert point(pts, "mixgemm-s8").status == bench.ERROR and point(pts, "mixgemm-s8").time_us is None
    assert B.analyze_moe([meas("bf16", 10.0, err=0.03)], 1.0, presets=PRESETS_T)[0].status == bench.FAIL


def report(**kw):
    ms = [meas("bf16", 100.0, impl="torch._grouped_mm", eager_timing=stats(412.5)),
          meas("mixgemm-u4", 25.0, impl="mixgemm.moe.fused_moe"),
          meas("torch-int4", None, error="no tinygemm", unavailable=True),
          meas("mixgemm-u4", 30.0, routing="zipf", tokens=1, err=0.9)]
    pts = B.analyze_moe(ms, 2000.0, presets=PRESETS_T)
    cfg = B.MoeConfig(presets=("small",), **kw)
    return B.MoeReport(machine(read_bw_gbps=2000.0), cfg.to_json(), {"small": {"hidden": 128}}, pts)


def test_table():
    rep = report()
    text = B.format_moe_table(rep.points, rep.machine, rep.config, presets=PRESETS_T)
    assert "small: hidden 128, expert intermediate 128, 6 experts, top-2" in text
    assert "bf16: torch._grouped_mm" in text and "mixgemm-u4: mixgemm.moe.fused_moe" in text
    assert "4.00x" in text and "torch-int4: n/a: no tinygemm" in text
    assert "mixgemm-u4 zipf T=1: FAIL" in text
    assert "eager us" in text and " 412.5 " in text    # the eager column (empty where not measured)
    assert point(rep.points, "bf16").eager_us == 412.5 and point(rep.points, "mixgemm-u4").eager_us is None
    rows = [line for line in text.splitlines() if line.startswith(("uniform", "zipf"))]
    assert [r.split()[0] for r in rows] == ["uniform"] * 3 + ["zipf"]     # routing, tokens, variant order
    quick = B.format_moe_table(rep.points, rep.machine, B.MoeConfig(quick=True).to_json(), presets=PRESETS_T)
    assert "QUICK RUN" in quick


def test_json_round_trip_and_save(tmp_path):
    rep = report()
    path = B.write_moe_json(tmp_path / "a" / "moe.json", rep)
    doc = json.loads(path.read_text())
    assert doc["schema"] == B.MOE_SCHEMA and doc["config"]["host_counts"].startswith("per-expert loops")
    back = B.moe_report_from_dict(doc)
    assert back.points == rep.points and back.machine == rep.machine
    # eager_us is written where measured, left out where not (older results lack it)
    assert [("eager_us" in p, p.get("eager_us")) for p in doc["points"]][:2] == [(True, 412.5), (False, None)]
    with pytest.raises(ValueError, match="not a"):
        B.moe_report_from_dict({"schema": "x"})
    cfg = B.MoeConfig(presets=("small",), save=True, results_root=str(tmp_path / "res"),
                      json_path=str(tmp_path / "all.json"))
    written = bench.write_moe_outputs(rep, cfg, log=lambda s: None)
    names = {p.name for p in written}
    assert {"all.json", "moe-small.json"} <= names
    saved = next(p for p in written if p.name == "moe-small.json")
    assert saved.parent.parent == tmp_path / "res"
    assert B.moe_report_from_dict(json.loads(saved.read_text())).config["presets"] == ["small"]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    ok, what = bench.write_moe_plot(report().points, tmp_path / "moe.png")
    assert ok and (tmp_path / "moe.png").stat().st_size > 1000


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    from mixgemm.bench import plots
    monkeypatch.setattr(plots, "_matplotlib", lambda: None)
    ok, why = bench.write_moe_plot(report().points, tmp_path / "moe.png")
    assert not ok and "matplotlib" in why and not (tmp_path / "moe.png").exists()


# ------------------------------------------------------------------------------------ options
def test_moe_defaults_and_overrides():
    cfg = bench.moe_config_from_args(parse("--moe", "qwen3-30b-a3b"))
    assert cfg.presets == ("qwen3-30b-a3b",) and cfg.tokens == (1, 16, 64, 256, 1024, 4096)
    assert cfg.routings == ("uniform", "zipf") and (cfg.iters, cfg.warmup, cfg.group_size) == (50, 5, 128)
    assert [v.name for v in cfg.variants] == ["bf16", "mixgemm-u4", "mixgemm-u2", "mixgemm-s8", "torch-int4"]
    assert cfg.max_error == B.DEFAULT_MOE_MAX_ERROR and cfg.point_budget_s == B.DEFAULT_MOE_POINT_BUDGET_S
    cfg = bench.moe_config_from_args(parse(
        "--moe", "mixtral-8x7b,deepseek-v3", "--tokens", "1,16,1", "--routing", "zipf", "--variants", "int4",
        "--moe-max-error", "0.1", "--point-budget", "2", "--group-size", "64", "--iters", "60", "--seed", "2"))
    assert cfg.presets == ("mixtral-8x7b", "deepseek-v3") and cfg.tokens == (1, 16) and cfg.routings == ("zipf",)
    assert [v.name for v in cfg.variants] == ["bf16", "mixgemm-u4"]
    assert (cfg.max_error, cfg.point_budget_s, cfg.group_size, cfg.iters, cfg.seed) == (0.1, 2.0, 64, 60, 2)
    assert bench.moe_config_from_args(parse("--moe", "all")).presets == tuple(B.MOE_PRESETS)
    assert cfg.to_json()["routings"] == ["zipf"] and cfg.to_json()["zipf_exponent"] == B.ZIPF_EXPONENT


@pytest.mark.parametrize("argv,needle", [
    (["--moe", "qwen3-30b-a3b", "--iters", "10"], "--quick"),
    (["--moe", "qwen3-30b-a3b", "--routing", "pareto"], "--routing"),
    (["--moe", "qwen3-30b-a3b", "--variants", "int3"], "--variants"),
    (["--moe", "qwen3-30b-a3b", "--variants", "int4,no-gemm"], "no-gemm is a --model"),
    (["--moe", "qwen3-30b-a3b", "--dtype", "fp16"], "bf16"),
    (["--moe", "qwen3-30b-a3b", "--moe-max-error", "0"], "positive"),
    (["--moe", "qwen3-30b-a3b", "--layers", "2"], "only apply to --model and --host"),
])
def test_bad_moe_options(argv, needle):
    with pytest.raises(bench.BenchError, match=needle):
        bench.moe_config_from_args(parse(*argv))


@pytest.mark.parametrize("argv", [["--tokens", "1"], ["--routing", "zipf"], ["--moe-max-error", "1"],
                                  ["--model", "llama3-8b", "--tokens", "1"]])
def test_moe_options_need_moe(argv, capsys):
    assert bench.main(["--quick", *argv]) == 1
    assert "only apply to --moe" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--moe", "llama3-8b"], "unknown MoE preset 'llama3-8b'"),
    (["--moe", "qwen3-30b-a3b", "--model", "llama3-8b"], "not allowed with"),
    (["--moe", "qwen3-30b-a3b", "--tokens", "0"], "positive integer"),
])
def test_moe_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_no_gpu_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--moe", "qwen3-30b-a3b", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err


def test_list_kernels_needs_no_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--moe", "qwen3-30b-a3b", "--tokens", "1", "--variants", "int4", "--list-kernels"]) == 0
    names = capsys.readouterr().out.split()
    # 1 token x top-8 = 8 rows: the 8-row grouped tile, gate/up with swiglu and down without; the
    # routing kernel for int64 ids and the combine kernel for bf16 outputs and float32 weights
    routing = {"mixgemm_moe_route_i64", "mixgemm_moe_combine_bf16_wf32"}
    grouped = [n for n in names if n not in routing]
    assert len(names) == 4 and routing <= set(names)
    assert len(grouped) == 2 and all(n.startswith("mixgemm_gdecode_bf16_u4_m8_") for n in grouped)
    assert {n.rsplit("_", 1)[1] for n in grouped} == {"none", "swiglu"}
    assert bench.main(["--moe", "all", "--list-kernels"]) == 0
    names = capsys.readouterr().out.split()
    grouped = [n for n in names if n not in routing and n != "mixgemm_moe_layout"]
    assert routing | {"mixgemm_moe_layout"} <= set(names)
    # every preset at 1..4096 tokens: the grouped decode kernels and the grouped GEMMs the plans name
    from mixgemm.jit import catalog
    from mixgemm.bench.moe import DEFAULT_TOKENS, MOE_PRESETS
    from mixgemm.moe import plan_fused_moe
    want = {s.name for p in MOE_PRESETS.values() for t in DEFAULT_TOKENS for wt in (WeightType.U4, WeightType.U2, WeightType.S8)
            for s in plan_fused_moe(t * p.topk, ActType.BF16, wt, p.experts, p.hidden, p.intermediate).specs}
    assert set(grouped) == want
    assert any(n.startswith("mixgemm_ggemm_bf16_") for n in grouped)
    assert set(grouped) <= {s.name for s in catalog.grouped_specs() + catalog.grouped_gemm_specs()}
    assert set(names) <= {s.name for s in catalog.default_specs()}
    specs = R.moe_kernel_specs(SMALL, U2, (1, 64))
    plans = [plan_fused_moe(t * 2, ActType.BF16, WeightType.U2, 6, 128, 128) for t in (1, 64)]
    want = list(dict.fromkeys(s.name for p in plans for s in p.specs + ((MoeLayoutSpec(),) if p.kind != "each" else ())))
    assert [s.name for s in specs[:-2]] == want
    assert isinstance(specs[0], GroupedDecodeSpec)
    assert [s.name for s in specs[-2:]] == ["mixgemm_moe_route_i64", "mixgemm_moe_combine_bf16_wf32"]
    assert R.moe_kernel_specs(SMALL, V.BF16, (1,)) == []


# ------------------------------------------------------------------------- the run, on the CPU


class EagerGraph:
    """A CPU stand-in for a CUDA graph: replay() reruns the function into the captured output."""

    def __init__(self, fn):
        self.fn = fn
        self.out = fn()

    def replay(self):
        self.out.copy_(self.fn())


def eager_capture(fn):
    g = EagerGraph(fn)
    return g, g.out


def test_loop_layers_match_the_reference_on_the_cpu():
    w13, w2 = R.base_weights(SMALL, 1, CPU)
    pt = R.PointInputs(SMALL, "zipf", 9, 1, CPU)
    layer = R.Bf16Layer(w13, w2, grouped=False)
    y = layer(pt.x, pt.topk_ids, pt.topk_weights, pt.counts)
    ref = fused_moe_reference(pt.x, *layer.reference_weights(), pt.topk_weights, pt.topk_ids)
    assert y.shape == (9, 128) and bench.relative_error(y, ref) < 1e-2
    # a wrong routing is caught: other experts give another output
    wrong = layer(pt.x, (pt.topk_ids + 1) % 6, pt.topk_weights, B.expert_counts((pt.topk_ids + 1) % 6, 6))
    assert bench.relative_error(wrong, ref) > 0.3


def test_the_run_on_the_cpu():
    """run_moe end to end on a small preset, on the CPU with stand-ins for the CUDA clock and
    graph: bf16 (the per-expert loop) and, with PyTorch's CPU tinygemm, torch-int4 are built,
    checked against fused_moe_reference and timed; mixgemm, which needs a GPU, is n/a; every
    (routing, tokens, variant) has its point."""
    cfg = B.MoeConfig(presets=("small",), tokens=(1, 5), variants=V.parse_variants(["int4", "torch-int4"]),
                      iters=3, warmup=1, quick=True, group_size=128)
    logs = []
    meas_ = R.run_moe(cfg, CPU, log=logs.append, clock=WallClock(), capture=eager_capture, presets=[SMALL])
    pts = B.analyze_moe(meas_, 100.0, cfg.max_error, cfg.group_size, presets=PRESETS_T)
    assert {(p.variant, p.routing, p.tokens) for p in pts} == {
        (v, r, t) for v in ("bf16", "mixgemm-u4", "torch-int4") for r in ("uniform", "zipf") for t in (1, 5)}
    for p in pts:
        assert p.experts_touched == (2 if p.tokens == 1 else p.experts_touched) and 2 <= p.experts_touched <= 6
        if p.variant == "mixgemm-u4":
            assert p.status == bench.UNAVAILABLE and "GPU" in p.note
            continue
        if p.variant == "torch-int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            continue
        assert p.status == bench.OK, (p.variant, p.routing, p.tokens, p.note)
        assert p.iters == 3 and p.time_us > 0 and p.eager_us > 0 and p.speedup_vs_bf16 is not None
        assert p.expert_bytes == B.expert_weight_bytes(SMALL, V.parse_variant(p.variant), 128)
        assert p.weight_bytes == p.experts_touched * p.expert_bytes
        assert p.err is not None and p.err < cfg.max_error and p.replay_err == 0.0
        assert "per-expert loop" in p.impl
    assert any("experts built" in line for line in logs)


def test_merge_moe_reports_and_the_merge_cli(tmp_path, capsys):
    a = report()
    b_pts = B.analyze_moe([meas("bf16", 80.0, tokens=4096), meas("mixgemm-u4", 90.0, tokens=4096)], 2000.0,
                          presets=PRESETS_T)
    b = B.MoeReport(machine(read_bw_gbps=2100.0), B.MoeConfig(presets=("small",), tokens=(4096,)).to_json(),
                    {"small": {"hidden": 128}}, b_pts)
    merged = B.merge_moe_reports([a, b])
    assert len(merged.points) == len(a.points) + 2 and len(merged.config["runs"]) == 2
    assert 4096 in merged.config["tokens"]
    with pytest.raises(ValueError, match="more than one run"):
        B.merge_moe_reports([a, a])
    with pytest.raises(ValueError, match="different GPUs"):
        B.merge_moe_reports([a, B.MoeReport(machine(gpu_name="other"), a.config, a.presets, b_pts)])
    paths = [str(B.write_moe_json(tmp_path / f"{i}.json", r)) for i, r in enumerate((a, b))]
    out = tmp_path / "merged.json"
    # a's zipf T=1 point FAILed: the merge reports it (exit status 1) and still writes
    assert bench.main(["--merge", *paths, "--json", str(out)]) == 1
    assert len(B.moe_report_from_dict(json.loads(out.read_text())).points) == len(merged.points)
    assert "mixgemm-u4 zipf T=1: FAIL" in capsys.readouterr().out          # the merged table
