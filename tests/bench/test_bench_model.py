"""``mixgemm bench --model`` without a GPU: the variants, the bytes a layer moves (against numbers
worked out by hand for a small layer, and against the tensors the variants actually hold), the
floor / fraction / speedup arithmetic, the FAIL rules, the table, JSON, merge, plot, the kernel
list, the options and their errors. The torch-int4 variant also runs on the CPU (PyTorch's CPU
tinygemm) against its own reference."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from mixgemm.dtypes import ActType, WeightType
from mixgemm.jit.catalog import TILE_CONFIGS
from mixgemm.jit.specs import Activation

from mixgemm import bench
from mixgemm.bench import model as M
from mixgemm.bench import variants as V
from mixgemm.bench.decoder import PRESETS, DecoderStack, ModelPreset, Rotary, float_weight, layer_state
from mixgemm.bench.model import StepMeasurement, StepShape, analyze_model, layer_traffic
from mixgemm.bench.timing import budgeted_iters
from mixgemm.dtypes import WeightType
from mixgemm.weights.quantize import dequantize_reference, quantize

from bench_helpers import machine, parse, WallClock

CPU = torch.device("cpu")
# q 128, kv 64 each: qkv (256, 128), o (128, 128), gate_up (512, 128), down (128, 256)
SMALL = ModelPreset("small", "test", hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32, qkv_bias=True,
                    rope_theta=10000.0, rms_eps=1e-5, model_layers=4)
PRESETS_T = {**PRESETS, "small": SMALL}
U4, U2, S8 = (V.Variant(V.VariantKind.MIXGEMM, w) for w in (WeightType.U4, WeightType.U2, WeightType.S8))


# --------------------------------------------------------------------------------- variants
def test_variant_names_and_parsing():
    assert [v.name for v in V.parse_variants(V.DEFAULT_VARIANTS)] == [
        "bf16", "mixgemm-u4", "mixgemm-u2", "mixgemm-s8", "torch-int4", "no-gemm"]
    assert V.parse_variant("no-gemm") == V.parse_variant(" No-GEMM ") == V.NO_GEMM
    assert V.NO_GEMM.name == "no-gemm" and V.NO_GEMM.kind is V.VariantKind.NO_GEMM
    assert not V.NO_GEMM.quantized and not V.BF16.quantized and U4.quantized and V.TORCH_INT4.quantized
    with pytest.raises(ValueError):
        V.Variant(V.VariantKind.NO_GEMM, WeightType.U4)
    assert V.parse_variants(["int4"]) == (V.BF16, U4)                       # bf16 always, first
    assert V.parse_variants(["mixgemm-s4", "u8", "int4", "mixgemm-u4"])[1:] == (
        V.Variant(V.VariantKind.MIXGEMM, WeightType.S4), V.Variant(V.VariantKind.MIXGEMM, WeightType.U8), U4)
    for bad in ("int3", "mixgemm-q4", "fp8", ""):
        with pytest.raises(ValueError, match="unknown variant"):
            V.parse_variant(bad)
    with pytest.raises(ValueError):
        V.Variant(V.VariantKind.DENSE, WeightType.U4)


# ------------------------------------------------------------------------------------ bytes
# By hand, group 64: linears hold N*K = 256*128 + 128*128 + 512*128 + 128*256 = 147,456 weights,
# and (K/64) * N scale rows: 2*256 + 2*128 + 2*512 + 4*128 = 2,304 -> 4,608 bytes of 16-bit scales.
# qkv bias 256 * 2 = 512 bytes; two norms 2 * 128 * 2 = 512 bytes.
HAND = {
    "bf16": 2 * 147_456 + 512 + 512,                   # 295,936
    "mixgemm-u4": 73_728 + 2 * 4_608 + 512 + 512,      # codes + scales + zeros: 83,968
    "mixgemm-u2": 36_864 + 2 * 4_608 + 512 + 512,      # 47,104
    "mixgemm-s8": 147_456 + 4_608 + 512 + 512,         # scales only: 153,088
    "torch-int4": 73_728 + 2 * 4_608 + 512 + 512,      # [K/g, N, 2] scale-and-zero: 83,968
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_layer_weight_bytes_by_hand(name):
    assert V.layer_weight_bytes(SMALL, V.parse_variant(name), 64) == HAND[name]


def test_layer_weight_bytes_literal_llama():
    # LLaMA-3 8B, g128: 218,103,808 weights; bf16 436,207,616 bytes + norms 16,384
    p = PRESETS["llama3-8b"]
    assert V.layer_weight_bytes(p, V.BF16, 128) == 436_207_616 + 16_384
    # u4: 109,051,904 codes + 2 * 2 * 1,703,936 (K/128 * N summed over the linears) = 115,867,648
    assert V.layer_weight_bytes(p, U4, 128) == 109_051_904 + 6_815_744 + 16_384
    assert V.layer_weight_bytes(PRESETS["qwen2.5-7b"], V.BF16, 128) == 2 * (4608 * 3584 + 3584 * 3584 + 37888 * 3584
                                                                           + 3584 * 18944) + 2 * 4608 + 4 * 3584


@pytest.mark.parametrize("name", ["mixgemm-u4", "mixgemm-u2", "mixgemm-s8"])
def test_mixgemm_layer_tensors_match_the_formula_and_its_reference(name):
    """Built on the CPU: the QuantLinear layers hold exactly the formula's bytes, and the reference
    is the dequantized weight of each projection, gate then up (the order silu * up needs)."""
    variant = V.parse_variant(name)
    wt = variant.weight_type
    proj, ref = V.build_layer(SMALL, variant, 0, 3, CPU, 64)
    states = [layer_state(SMALL, 0, 3, 1, 1, CPU, torch.bfloat16)]
    stack = DecoderStack(SMALL, [proj], states, Rotary(32, 1e4, 1, torch.bfloat16))
    assert stack.weight_bytes() == HAND[name]
    assert ref.weight_bytes() == HAND["bf16"] - 512            # the reference is dense bf16 (no norms)

    def deq(*names):
        w = torch.cat([float_weight(SMALL, n, 0, 3, CPU) for n in names])
        return dequantize_reference(quantize(w, wt.bits, 64, symmetric=wt.signed, dtype=torch.bfloat16))

    assert torch.equal(ref.w_qkv, deq("q", "k", "v")) and torch.equal(ref.w_down, deq("down"))
    assert torch.equal(ref.w_gate_up[:SMALL.intermediate], deq("gate"))
    assert torch.equal(ref.w_gate_up[SMALL.intermediate:], deq("up"))
    assert torch.equal(ref.b_qkv, proj.layers["qkv"].bias.detach())
    assert proj.layers["gate_up"].activation == "swiglu"
    assert V.kernel_specs(SMALL, V.BF16, [1]) == [] and V.kernel_specs(SMALL, V.TORCH_INT4, [1]) == []


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no CPU tinygemm")
def test_torch_int4_variant_runs_on_the_cpu_against_its_reference():
    proj, ref = V.build_layer(SMALL, V.TORCH_INT4, 0, 3, CPU, 64)
    assert proj.weight_bytes() == HAND["torch-int4"] - 512
    u4 = V.build_layer(SMALL, U4, 0, 3, CPU, 64)[1]
    # tinygemm's own weight: (q - 8) * s + zf, within rounding of mixgemm's (q - z) * s
    assert bench.relative_error(ref.w_gate_up, u4.w_gate_up) < 5e-3
    x = torch.randn(2, 1, SMALL.hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    outs = []
    for projections in (proj, ref):
        states = [layer_state(SMALL, 0, 3, 2, 9, CPU, torch.bfloat16)]
        outs.append(DecoderStack(SMALL, [projections], states, Rotary(32, 1e4, 9, torch.bfloat16))(x, 8))
    err = float((outs[0].double() - outs[1].double()).norm() / (outs[1].double() - x.double()).norm())
    assert err < 5e-2
    with pytest.raises(bench.ImplUnavailable):
        V.torch_int4_layer(SMALL, 0, 3, CPU, 48)


# --------------------------------------------------------------------------------- no-gemm
class _AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every aten op dispatched inside it (``aten.mm.default``, ...)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_gemm_projections_are_broadcast_views_of_their_input():
    proj, ref = V.build_layer(SMALL, V.NO_GEMM, 0, 3, CPU, 64)
    assert isinstance(proj, V.NoGemmProjections) and ref is None
    widths = {"qkv": SMALL.qkv_rows, "o": SMALL.hidden, "mlp_in": SMALL.intermediate, "down": SMALL.hidden}
    ins = {"qkv": SMALL.hidden, "o": SMALL.q_size, "mlp_in": SMALL.hidden, "down": SMALL.intermediate}
    for name, n in widths.items():
        x = torch.randn(5, ins[name], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        with _AtenOps() as ops:
            y = getattr(proj, name)(x)
        assert y.shape == (5, n) and y.stride(1) == 0                        # a broadcast: nothing written
        assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert torch.equal(y, x[:, :1].expand(5, n))
        assert set(ops.names) <= {"aten.slice.Tensor", "aten.expand.default"}, ops.names
    assert proj.weight_tensors() == [] and proj.weight_bytes() == 0
    assert V.kernel_specs(SMALL, V.NO_GEMM, [1, 16]) == []
    # the norms only (2 * 128 * 2 bytes): SMALL has a qkv bias, which no-gemm does not add
    assert V.layer_weight_bytes(SMALL, V.NO_GEMM, 64) == 512
    assert V.projection_weight_bytes(4096, 4096, V.NO_GEMM, 128) == 0


def test_no_gemm_layer_runs_the_layer_without_a_matmul():
    """The very same decoder layer code with no-gemm projections, on the CPU: the output has the
    layer's shape, is finite and depends on the input, the keys and values are written, and no
    matrix product is dispatched (the bf16 layer's are, through the same recorder)."""
    def run(projections, seed):
        states = [layer_state(SMALL, i, 3, 2, 9, CPU, torch.bfloat16) for i in range(2)]
        before = states[0].k_cache[:, :, 8].clone()
        x = torch.randn(2, 1, SMALL.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        stack = DecoderStack(SMALL, projections, states, Rotary(32, 1e4, 9, torch.bfloat16))
        with _AtenOps() as ops:
            y = stack(x, 8)
        return x, y, ops.names, before, states[0].k_cache[:, :, 8]

    no_gemm = [V.build_layer(SMALL, V.NO_GEMM, i, 3, CPU, 64)[0] for i in range(2)]
    x, y, ops, k_before, k_after = run(no_gemm, 1)
    assert y.shape == x.shape and bool(torch.isfinite(y).all()) and not torch.equal(y, x)
    assert not torch.equal(k_before, k_after)                             # the cache write ran
    x2, y2, _, _, _ = run(no_gemm, 2)
    assert not torch.equal(y2, y) and not torch.equal(y2 - x2, y - x)     # depends on its input
    matmuls = {"aten.mm.default", "aten.addmm.default", "aten.linear.default", "aten.matmul.default"}
    assert not matmuls & set(ops)
    assert DecoderStack(SMALL, no_gemm, [layer_state(SMALL, i, 3, 1, 1, CPU, torch.bfloat16) for i in range(2)],
                        Rotary(32, 1e4, 1, torch.bfloat16)).weight_bytes() == 2 * 512
    dense = [V.build_layer(SMALL, V.BF16, i, 3, CPU, 64)[0] for i in range(2)]
    assert matmuls & set(run(dense, 1)[2])                                # the recorder sees GEMMs


def test_layer_traffic_by_hand():
    # decode, batch 4, 10 cached tokens: a KV row is 2 (k, v) * 2 heads * 32 * 2 bytes = 256
    t = layer_traffic(SMALL, StepShape("decode", 4, 1, 10), 1000)
    assert (t.weights, t.kv_read, t.kv_write) == (1000, 4 * 11 * 256, 4 * 256)
    # per token: 2*128 (in, out) + (128 + 256) qkv + (128 + 128) o + (128 + 256) gate/up + (256 + 128) down
    assert t.activations == 4 * 1664 * 2
    assert t.total == 1000 + 11_264 + 1_024 + 13_312
    pre = layer_traffic(SMALL, StepShape("prefill", 1, 8, 0), 0)
    assert (pre.kv_read, pre.kv_write, pre.activations) == (8 * 256, 8 * 256, 8 * 1664 * 2)
    # LLaMA-3 8B decode at batch 64 after 1024 tokens: 64 * 1025 * 4096 bytes of cache read
    big = layer_traffic(PRESETS["llama3-8b"], StepShape("decode", 64, 1, 1024), 0)
    assert big.kv_read == 268_697_600 and big.kv_write == 262_144


def test_step_shapes():
    shapes = M.step_shapes((1, 16), 1024, 2048)
    assert [(s.phase, s.batch, s.tokens, s.context, s.m, s.cache_length) for s in shapes] == [
        ("decode", 1, 1, 1024, 1, 1025), ("decode", 16, 1, 1024, 16, 1025), ("prefill", 1, 2048, 0, 2048, 2048)]
    assert [s.label for s in shapes] == ["decode b1", "decode b16", "prefill 2048"]
    assert M.step_shapes((1,), 8, 0) == [StepShape("decode", 1, 1, 8)]


# ---------------------------------------------------------------------------------- analysis
def step(variant, us, mode="graph", batch=1, err=1e-3, kv_err=1e-3, phase="decode", preset="small", layers=4, **kw):
    timing = None if us is None else bench.summarize_times([us / 1e3] * 5)
    quantized = variant not in ("bf16", "no-gemm")                    # no-gemm: no reference either
    tokens, context = (1, 10) if phase == "decode" else (8, 0)
    return StepMeasurement(preset, phase, batch, tokens, context, layers, variant, mode, timing=timing,
                           err=err if quantized else None, kv_err=kv_err if quantized else None, **kw)


def by(points, variant, mode="graph", batch=1, phase="decode"):
    return next(p for p in points if (p.variant, p.mode, p.batch, p.phase) == (variant, mode, batch, phase))


def test_floor_fraction_and_speedup():
    meas = [step("bf16", 400.0), step("mixgemm-u4", 100.0), step("bf16", 600.0, mode="eager"),
            step("mixgemm-u4", 300.0, mode="eager"), step("mixgemm-u4", 50.0, batch=4)]
    pts = analyze_model(meas, read_bw_gbps=100.0, group_size=64, presets=PRESETS_T)
    u4 = by(pts, "mixgemm-u4")
    total = HAND["mixgemm-u4"] + 11 * 256 + 256 + 1664 * 2
    assert u4.bytes_per_layer == total and u4.weight_bytes == HAND["mixgemm-u4"]
    assert u4.us_per_layer == pytest.approx(25.0)                     # 100 us / 4 layers
    assert u4.floor_us_per_layer == pytest.approx(total / 100e9 * 1e6)
    assert u4.frac_of_floor == pytest.approx(u4.floor_us_per_layer / 25.0)
    assert u4.speedup_vs_bf16 == pytest.approx(4.0)
    assert by(pts, "mixgemm-u4", "eager").speedup_vs_bf16 == pytest.approx(2.0)   # eager vs eager
    assert by(pts, "bf16").speedup_vs_bf16 == pytest.approx(1.0)
    assert by(pts, "mixgemm-u4", batch=4).speedup_vs_bf16 is None       # no bf16 at batch 4
    assert all(p.status == bench.OK for p in pts)
    assert analyze_model(meas, None, group_size=64, presets=PRESETS_T)[1].frac_of_floor is None


def test_measured_weight_bytes_win_over_the_formula():
    pts = analyze_model([step("mixgemm-u4", 100.0, weight_bytes=12345)], 100.0, group_size=64, presets=PRESETS_T)
    assert pts[0].weight_bytes == 12345


@pytest.mark.parametrize("kw,needle", [
    (dict(err=0.2), "err 2.00e-01 > 5e-02"),
    (dict(kv_err=float("nan")), "kv_err is nan"),
    (dict(replay_err=0.3), "replay_err"),
    (dict(err=None), "err not measured"),
    (dict(output_finite=False), "NaN/inf"),
])
def test_bad_steps_fail(kw, needle):
    pts = analyze_model([step("bf16", 400.0), step("mixgemm-u4", 100.0, **kw)], 100.0, group_size=64,
                        presets=PRESETS_T)
    u4 = pts[1]
    assert u4.status == bench.FAIL and needle in u4.note
    assert u4.speedup_vs_bf16 is None and u4.us_per_layer == pytest.approx(25.0)
    json.dumps(M.model_report_to_dict(M.ModelReport(machine(read_bw_gbps=3200.0), {}, {}, pts)), allow_nan=False)


def test_bar_is_configurable_and_failed_bf16_gives_no_speedup():
    meas = [step("bf16", 400.0, output_finite=False), step("mixgemm-u4", 100.0, err=2e-2)]
    pts = analyze_model(meas, 100.0, max_error=1e-2, group_size=64, presets=PRESETS_T)
    assert pts[0].status == bench.FAIL and pts[1].status == bench.FAIL
    pts = analyze_model(meas, 100.0, max_error=5e-2, group_size=64, presets=PRESETS_T)
    assert pts[1].status == bench.OK and pts[1].speedup_vs_bf16 is None


def test_unavailable_and_errors():
    meas = [step("bf16", 400.0), step("torch-int4", None, error="no tinygemm", unavailable=True),
            step("mixgemm-u2", None, error="RuntimeError: boom")]
    pts = analyze_model(meas, 100.0, group_size=64, presets=PRESETS_T)
    assert pts[1].status == bench.UNAVAILABLE and pts[1].note == "no tinygemm" and pts[1].us_per_layer is None
    assert pts[2].status == bench.ERROR and pts[2].floor_us_per_layer is not None   # the floor needs no time


# The bound, by hand: 4 layers; bf16 400 us (100 per layer), no-gemm 40 us (10 per layer).
# u4 reads HAND["mixgemm-u4"] = 83,968 weight bytes, of which 512 (the norms) no-gemm reads too:
# 83,456 bytes at 83.456 GB/s take 1 us, so u4's bound is 100 / (10 + 1); bf16's: 295,424 bytes,
# 295,424 / 83,456 us.
BOUND_BW = 83.456


def test_bound_by_hand():
    meas = [step("bf16", 400.0), step("mixgemm-u4", 120.0), step("no-gemm", 40.0), step("torch-int4", 200.0),
            step("bf16", 600.0, mode="eager"), step("mixgemm-u4", 300.0, mode="eager"),
            step("bf16", 500.0, batch=4), step("mixgemm-u4", 200.0, batch=4)]
    assert by(meas, "no-gemm").err is None and by(meas, "no-gemm").kv_err is None   # unchecked, still ok:
    pts = analyze_model(meas, BOUND_BW, group_size=64, presets=PRESETS_T)
    assert all(p.status == bench.OK for p in pts), [p.note for p in pts]
    ng = by(pts, "no-gemm")
    assert ng.weight_bytes == 512 and ng.err is None and ng.speedup_vs_bf16 == pytest.approx(10.0)
    assert ng.bound_speedup is None                                       # not its own bound
    assert by(pts, "mixgemm-u4").bound_speedup == pytest.approx(100 / 11, rel=1e-12)
    assert by(pts, "torch-int4").bound_speedup == pytest.approx(100 / 11, rel=1e-12)  # same bytes as u4 (HAND)
    assert by(pts, "bf16").bound_speedup == pytest.approx(100 / (10 + 295_424 / 83_456), rel=1e-12)
    assert M.bound_speedup(100.0, (10.0, 512), 83_968, BOUND_BW) == pytest.approx(100 / 11, rel=1e-12)
    # no no-gemm point in eager mode or at batch 4; none without a read bandwidth
    assert by(pts, "mixgemm-u4", "eager").bound_speedup is None and by(pts, "bf16", "eager").bound_speedup is None
    assert by(pts, "mixgemm-u4", batch=4).bound_speedup is None
    assert all(p.bound_speedup is None for p in analyze_model(meas, None, group_size=64, presets=PRESETS_T))
    # the bound is per layer: a no-gemm run of 2 layers (20 us) gives the same bound
    pts2 = analyze_model([step("bf16", 400.0), step("mixgemm-u4", 120.0), step("no-gemm", 20.0, layers=2)],
                         BOUND_BW, group_size=64, presets=PRESETS_T)
    assert by(pts2, "mixgemm-u4").bound_speedup == pytest.approx(100 / 11, rel=1e-12)


@pytest.mark.parametrize("bad", ["no-gemm", "mixgemm-u4", "bf16"])
def test_no_bound_from_or_for_a_point_that_is_not_ok(bad):
    meas = [step("bf16", 400.0), step("mixgemm-u4", 120.0), step("no-gemm", 40.0)]
    meas = [StepMeasurement(**{**m.__dict__, "output_finite": False}) if m.variant == bad else m for m in meas]
    pts = analyze_model(meas, BOUND_BW, group_size=64, presets=PRESETS_T)
    assert by(pts, bad).status == bench.FAIL
    assert all(p.bound_speedup is None for p in pts if p.variant in ("mixgemm-u4", bad))


def test_bound_in_the_table_and_the_json(tmp_path):
    meas = [step(v, us, mode=mode) for mode in ("graph", "eager")
            for v, us in (("bf16", 400.0), ("mixgemm-u4", 120.0), ("no-gemm", 40.0))]
    meas = [m for m in meas if (m.variant, m.mode) != ("no-gemm", "eager")]   # eager: no bound
    pts = analyze_model(meas, BOUND_BW, group_size=64, presets=PRESETS_T)
    rep = M.ModelReport(machine(read_bw_gbps=BOUND_BW), {}, {}, pts)
    doc = M.model_report_to_dict(rep)
    with_bound = [d for d in doc["points"] if "bound_speedup" in d]
    assert [(d["variant"], d["mode"]) for d in with_bound] == [("bf16", "graph"), ("mixgemm-u4", "graph")]
    keys = list(with_bound[1])
    assert keys.index("bound_speedup") == keys.index("speedup_vs_bf16") + 1
    assert all("bound_speedup" not in d for d in doc["points"] if d["mode"] == "eager" or d["variant"] == "no-gemm")
    path = M.write_model_json(tmp_path / "b.json", rep)
    text = path.read_text()
    back = M.model_report_from_dict(json.loads(text))
    assert back == rep and M.write_model_json(tmp_path / "again.json", back).read_text() == text
    # a document without the field (as written before it existed) loads with None and writes back the same
    old = json.loads(text)
    for d in old["points"]:
        d.pop("bound_speedup", None)
    old_rep = M.model_report_from_dict(old)
    assert all(p.bound_speedup is None for p in old_rep.points)
    assert M.model_report_to_dict(old_rep) == old
    merged = M.merge_model_reports([rep])                                 # merge keeps each point's bound
    assert merged.points == rep.points

    text = M.format_model_table(pts, rep.machine, {"iters": 50, "group_size": 64}, presets=PRESETS_T)
    header = next(line for line in text.splitlines() if line.startswith("step"))
    assert header.split() == " ".join(M.MODEL_TABLE_HEADER).split() and "bound" in M.MODEL_TABLE_HEADER
    cols = header.split()
    rows = {tuple(line.split()[2:4]): line.split() for line in text.splitlines() if line.startswith("decode")}
    u4 = rows[("mixgemm-u4", "graph")]
    # a row's words against the header's: the step is two words ("decode b1"), "x bf16" two titles
    assert u4[cols.index("bound") - 1] == "9.09x" and u4[cols.index("x")] == "3.33x"
    assert rows[("no-gemm", "graph")][cols.index("x")] == "10.00x"
    assert rows[("no-gemm", "graph")][cols.index("bound") - 1] == "-"
    assert rows[("mixgemm-u4", "eager")][cols.index("bound") - 1] == "-"
    assert "no-gemm: the same layers with every projection a broadcast view" in text and "bound = bf16 /" in text
    no_ng = M.format_model_table([p for p in pts if p.variant != "no-gemm"], presets=PRESETS_T)
    assert "bound = bf16 /" not in no_ng


def test_model_plot_with_no_gemm(tmp_path):
    pytest.importorskip("matplotlib")
    meas = [step(v, us, batch=b) for b in (1, 16) for v, us in (("bf16", 400.0), ("mixgemm-u4", 120.0),
                                                                ("no-gemm", 40.0))]
    ok, where = bench.write_model_plot(analyze_model(meas, BOUND_BW, group_size=64, presets=PRESETS_T),
                                       tmp_path / "ng.png")
    assert ok, where
    assert Path(where).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------- report
def report(presets=("small",), **mkw):
    import dataclasses
    meas = [step(v, us, mode=mode, batch=b, preset=p, phase=ph) for p in presets
            for ph, b in (("decode", 1), ("decode", 16), ("prefill", 1))
            for mode in ("graph", "eager")
            for v, us in (("bf16", 400.0), ("mixgemm-u4", 120.0), ("torch-int4", 200.0))]
    meas.append(step("mixgemm-u2", None, preset=presets[0], error="kernel failed to build"))
    pts = analyze_model(meas, 3200.0, group_size=64, presets=PRESETS_T)
    cfg = M.ModelConfig(presets=tuple(presets), layers=4, batches=(1, 16), context=10, prefill=8)
    return M.ModelReport(machine(**{"read_bw_gbps": 3200.0, **mkw}), cfg.to_json(), {p: dataclasses.asdict(PRESETS_T[p]) for p in presets}, pts)


def test_table_lists_every_step_variant_and_mode():
    rep = report()
    text = M.format_model_table(rep.points, rep.machine, rep.config, presets=PRESETS_T)
    for col in M.MODEL_TABLE_HEADER:
        assert col in text
    assert "read 3200 GB/s" in text and "small: hidden 128, intermediate 256, heads 4/2 x 32, qkv bias" in text
    for label in ("decode b1", "decode b16", "prefill 8"):
        assert label in text
    rows = [line for line in text.splitlines() if line.startswith(("decode", "prefill"))]
    assert len(rows) == 3 * 2 * 3 + 1
    assert "mixgemm-u2 graph decode b1: error: kernel failed to build" in text
    assert any("3.33x" in r and "mixgemm-u4" in r for r in rows)      # 400 / 120


def test_model_json_round_trip_split_and_merge(tmp_path):
    rep = report(presets=("small", "llama3-8b"))
    path = M.write_model_json(tmp_path / "sub" / "m.json", rep)
    back = M.model_report_from_dict(json.loads(path.read_text()))
    assert back == rep and back.machine.read_bw_gbps == 3200.0
    parts = M.split_by_preset(rep)
    assert list(parts) == ["small", "llama3-8b"]
    assert {p.preset for p in parts["small"].points} == {"small"} and parts["small"].config["presets"] == ["small"]
    merged = M.merge_model_reports([parts["small"], parts["llama3-8b"]])
    assert len(merged.points) == len(rep.points) and set(merged.presets) == {"small", "llama3-8b"}
    assert len(merged.config["runs"]) == 2
    with pytest.raises(ValueError, match="more than one run"):
        M.merge_model_reports([parts["small"], parts["small"]])
    with pytest.raises(ValueError, match="different GPUs"):
        M.merge_model_reports([parts["small"], report(presets=("llama3-8b",), gpu_name="H200")])
    with pytest.raises(ValueError, match="nothing"):
        M.merge_model_reports([])
    with pytest.raises(ValueError, match="mixgemm.bench.model/1"):
        M.model_report_from_dict({"schema": "mixgemm.bench/1"})


def test_save_writes_one_file_per_preset(tmp_path):
    rep = report(presets=("small", "llama3-8b"))
    cfg = M.ModelConfig(save=True, results_root=str(tmp_path), json_path=str(tmp_path / "all.json"))
    logs = []
    written = bench.write_model_outputs(rep, cfg, log=logs.append)
    folder = tmp_path / "nvidia-h100-80gb-hbm3"
    assert (folder / "model-small.json").is_file() and (folder / "model-llama3-8b.json").is_file()
    assert M.model_report_from_dict(json.loads((folder / "model-small.json").read_text())).presets.keys() == {"small"}
    assert tmp_path / "all.json" in written
    try:
        import matplotlib  # noqa: F401
        assert (folder / "model-small.png").is_file()
    except ImportError:
        assert any("plot not written" in line for line in logs)
    assert not list(folder.glob(".*tmp*"))          # no temporary left behind


def test_model_plot(tmp_path):
    pytest.importorskip("matplotlib")
    ok, where = bench.write_model_plot(report(presets=("small", "llama3-8b")).points, tmp_path / "p" / "m.png",
                                       title="t")
    assert ok, where
    data = Path(where).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    ok, why = bench.write_model_plot([], tmp_path / "none.png")
    assert not ok and not (tmp_path / "none.png").exists()


def test_model_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    ok, why = bench.write_model_plot(report().points, tmp_path / "x.png")
    assert not ok and "matplotlib" in why


def test_merge_cli_takes_model_reports(tmp_path, capsys):
    parts = M.split_by_preset(report(presets=("small", "llama3-8b")))
    paths = [str(M.write_model_json(tmp_path / f"{k}.json", v)) for k, v in parts.items()]
    out = tmp_path / "merged.json"
    assert bench.main(["--merge", *paths, "--json", str(out)]) == 0
    merged = M.model_report_from_dict(json.loads(out.read_text()))
    assert merged.presets.keys() == {"small", "llama3-8b"} and len(merged.config["runs"]) == 2
    grid = bench.write_json(tmp_path / "grid.json", bench.BenchReport(machine(), {}, []))
    capsys.readouterr()
    assert bench.main(["--merge", paths[1], str(grid), "--json", str(out)]) == 1
    assert "one kind" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- options
def test_model_defaults():
    cfg = bench.model_config_from_args(parse("--model", "llama3-8b"))
    assert cfg.presets == ("llama3-8b",) and cfg.layers == 8 and cfg.batches == (1, 16, 64, 256)
    assert (cfg.context, cfg.prefill, cfg.iters, cfg.warmup) == (1024, 2048, 50, 5)
    assert [v.name for v in cfg.variants] == ["bf16", "mixgemm-u4", "mixgemm-u2", "mixgemm-s8", "torch-int4",
                                              "no-gemm"]
    assert cfg.modes == ("graph", "eager") and cfg.max_error == 5e-2 and cfg.group_size == 128
    assert [s.label for s in cfg.shapes()] == ["decode b1", "decode b16", "decode b64", "decode b256", "prefill 2048"]


def test_model_overrides():
    cfg = bench.model_config_from_args(parse(
        "--model", "llama3-8b,qwen2.5-7b", "--layers", "2", "--batch", "1,4", "--context", "512", "--prefill", "0",
        "--variants", "int4,mixgemm-s4", "--modes", "eager", "--iters", "60", "--warmup", "2", "--group-size", "64",
        "--model-max-error", "0.1", "--point-budget", "2", "--seed", "3"))
    assert cfg.presets == ("llama3-8b", "qwen2.5-7b") and (cfg.layers, cfg.batches, cfg.context) == (2, (1, 4), 512)
    assert cfg.prefill == 0 and [s.phase for s in cfg.shapes()] == ["decode", "decode"]
    assert [v.name for v in cfg.variants] == ["bf16", "mixgemm-u4", "mixgemm-s4"]
    assert (cfg.modes, cfg.iters, cfg.warmup, cfg.group_size, cfg.max_error, cfg.point_budget_s, cfg.seed) == (
        ("eager",), 60, 2, 64, 0.1, 2.0, 3)
    assert bench.model_config_from_args(parse("--model", "all")).presets == tuple(PRESETS)
    quick = bench.model_config_from_args(parse("--model", "llama3-8b", "--quick", "--iters", "5"))
    assert quick.quick and quick.iters == 5 and quick.to_json()["quick"]


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama3-8b", "--iters", "10"], "--quick"),
    (["--model", "llama3-8b", "--layers", "0"], "--layers"),
    (["--model", "llama3-8b", "--variants", "int3"], "unknown variant"),
    (["--model", "llama3-8b", "--modes", "graph,lazy"], "--modes"),
    (["--model", "llama3-8b", "--dtype", "fp16"], "bf16"),
    (["--model", "llama3-8b", "--model-max-error", "0"], "positive"),
    (["--model", "llama3-8b", "--point-budget", "-1"], "positive"),
])
def test_bad_model_options(argv, needle):
    with pytest.raises(bench.BenchError, match=needle):
        bench.model_config_from_args(parse(*argv))


@pytest.mark.parametrize("argv", [["--layers", "2"], ["--batch", "1"], ["--prefill", "0", "--block"],
                                  ["--moe", "qwen3-30b-a3b", "--context", "8"]])
def test_model_options_need_model(argv, capsys):
    assert bench.main(["--quick", *argv]) == 1
    assert "only apply to --model and --host" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--variants", "int4"], ["--point-budget", "1", "--block"]])
def test_shared_options_need_model_host_or_moe(argv, capsys):
    assert bench.main(["--quick", *argv]) == 1
    assert "only apply to --model, --host and --moe" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama4"], "unknown model preset 'llama4'"),
    (["--model", ""], "expected preset names"),
    (["--model", "llama3-8b", "--block"], "not allowed with"),
    (["--host", "--model", "llama3-8b"], "not allowed with"),
    (["--model", "llama3-8b", "--prefill", "-1"], "integer >= 0"),
    (["--model", "llama3-8b", "--batch", "0"], "positive integer"),
])
def test_model_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--model", "llama3-8b", "--quick"], ["--host", "--quick"],
                                  ["--model", "all", "--layers", "1"]])
def test_no_gpu_is_a_clear_error(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(argv) == 1
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err


def test_host_plot_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--host", "--quick", "--plot", "x.png"]) == 1
    assert "--host draws no plot" in capsys.readouterr().err


def test_list_kernels_needs_no_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--model", "llama3-8b", "--batch", "1", "--prefill", "0", "--variants", "int4",
                       "--list-kernels"]) == 0
    names = capsys.readouterr().out.split()
    # batch 1: every linear through the 8-token decode kernel, gate/up with the swiglu epilogue;
    # the layer's two RMSNorm kernels (the second with the residual add) and its rotary / KV-cache
    # kernel
    dec8 = next(tc for tc in TILE_CONFIGS if tc.label == "dec8")
    layer_kernels = ["mixgemm_add_rmsnorm_bf16", "mixgemm_rmsnorm_bf16", "mixgemm_rope_kv_bf16"]
    assert names == sorted([dec8.spec(ActType.BF16, WeightType.U4).name,
                            dec8.spec(ActType.BF16, WeightType.U4, Activation.SWIGLU).name] + layer_kernels)
    assert bench.main(["--model", "llama3-70b", "--batch", "256", "--prefill", "2048", "--variants", "int2",
                       "--list-kernels"]) == 0
    names = capsys.readouterr().out.split()
    # batch 256: the 128x256 stream-K kernels (every llama3-70b layer is above 48M weights);
    # the 2048-token prefill: the clustered persistent 128x256 kernels (above 512 tokens)
    assert names == sorted(["mixgemm_gemm_bf16_u2_t128x256x64_coop_streamk_biasact_s0",
                            "mixgemm_gemm_bf16_u2_t128x256x64_coop_streamk_swiglu_s0",
                            "mixgemm_gemm_bf16_u2_t128x256x64_c2_coop_persistent_biasact_s0",
                            "mixgemm_gemm_bf16_u2_t128x256x64_c2_coop_persistent_swiglu_s0"] + layer_kernels)
    assert bench.main(["--host", "--list-kernels"]) == 0
    names = capsys.readouterr().out.split()
    from mixgemm.ops.dense import select_spec
    import mixgemm
    w = mixgemm.prepack(mixgemm.quantize(torch.zeros(4096, 4096, dtype=torch.bfloat16), 4, 128))
    assert select_spec(256, w).name in names                                        # M = 256
    dec16 = next(tc for tc in TILE_CONFIGS if tc.label == "dec16")
    assert dec16.spec(ActType.BF16, WeightType.U4).name in names                    # M = 16
    assert dec8.spec(ActType.BF16, WeightType.U4, Activation.SWIGLU).name in names   # the step at batch 1
    assert not any("_u2_" in n or "_s8_" in n for n in names)
    assert bench.main(["--m", "1", "--impls", "mixgemm-s8", "--list-kernels"]) == 0
    assert capsys.readouterr().out.split() == [dec8.spec(ActType.BF16, WeightType.S8).name]


def test_add_arguments_on_a_subcommand_parser_takes_the_new_modes():
    top = argparse.ArgumentParser(prog="mixgemm")
    sub = top.add_subparsers(dest="command")
    p = bench.add_arguments(sub.add_parser("bench"))
    p.set_defaults(func=bench.run_cli)
    args = top.parse_args(["bench", "--model", "qwen2.5-32b", "--layers", "3"])
    assert args.model == ("qwen2.5-32b",) and args.layers == 3 and args.func is bench.run_cli
    assert top.parse_args(["bench", "--host"]).host


def test_budgeted_iters():
    assert budgeted_iters(1000.0, 50, 5, 4.0) == (50, 5)           # 55 ms: fits
    assert budgeted_iters(1e6, 50, 5, 4.0) == (10, 1)              # 1 s a run: the floor of 10
    assert budgeted_iters(100e3, 50, 5, 4.0) == (35, 5)            # 40 runs fit: 5 warm-up, 35 timed
    assert budgeted_iters(0.0, 50, 5, 4.0) == (50, 5)
    assert budgeted_iters(1e6, 5, 2, 1.0) == (5, 1)                # never more than asked


# ------------------------------------------------------------------------- the run, on the CPU


def test_the_run_on_the_cpu():
    """run_model end to end on a small preset, eager mode, on the CPU: bf16 and (with PyTorch's CPU
    tinygemm) torch-int4 are built, checked against their references and timed; mixgemm, which
    needs a GPU, is reported n/a; every step and mode has its point."""
    from mixgemm.bench.model_run import run_model

    cfg = M.ModelConfig(presets=("small",), layers=2, batches=(1, 3), context=6, prefill=5,
                        variants=V.parse_variants(["int4", "torch-int4"]), modes=("eager",), iters=3, warmup=1,
                        quick=True, group_size=128)
    logs = []
    meas = run_model(cfg, CPU, log=logs.append, make_clock=lambda mode: WallClock(), presets=[SMALL])
    pts = analyze_model(meas, 100.0, cfg.max_error, cfg.group_size, presets=PRESETS_T)
    assert {(p.variant, p.phase, p.batch) for p in pts} == {
        (v, ph, b) for v in ("bf16", "mixgemm-u4", "torch-int4") for ph, b in (("decode", 1), ("decode", 3),
                                                                                ("prefill", 1))}
    for p in pts:
        assert p.layers == 2 and p.mode == "eager"
        if p.variant == "mixgemm-u4":
            assert p.status == bench.UNAVAILABLE and "GPU" in p.note
            continue
        if p.variant == "torch-int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            continue
        assert p.status == bench.OK, (p.variant, p.phase, p.note)
        assert p.iters == 3 and p.time_us > 0 and p.us_per_layer == pytest.approx(p.time_us / 2)
        assert p.weight_bytes == V.layer_weight_bytes(SMALL, V.parse_variant(p.variant), 128)
        assert p.speedup_vs_bf16 is not None
        if p.variant == "torch-int4":
            assert 0 < p.err < cfg.max_error and 0 < p.kv_err < cfg.max_error
    assert any("layers built" in line for line in logs)


def test_the_no_gemm_run_on_the_cpu(monkeypatch):
    """run_model with no-gemm on the CPU, eager and compiled (Dynamo's "eager" backend): its
    points run the very same stack, are ok without err / kv_err (nothing to check against), the
    compiled step traces as one graph and replays the eager output, and the bf16 points get a
    bound from them."""
    from mixgemm.bench import model_run
    from mixgemm.bench.model_run import run_model

    monkeypatch.setattr(model_run, "COMPILE_BACKEND", "eager")
    cfg = M.ModelConfig(presets=("small",), layers=2, batches=(1, 3), context=6, prefill=0,
                        variants=V.parse_variants(["no-gemm"]), modes=("eager", "compiled"), iters=2, warmup=1,
                        quick=True, group_size=128)
    meas = run_model(cfg, CPU, log=lambda line: None, make_clock=lambda mode: WallClock(), presets=[SMALL])
    pts = analyze_model(meas, 100.0, cfg.max_error, cfg.group_size, presets=PRESETS_T)
    ng = [p for p in pts if p.variant == "no-gemm"]
    assert len(ng) == 4 and all(p.status == bench.OK for p in ng), [p.note for p in ng]
    for p in ng:
        assert p.err is None and p.kv_err is None and p.time_us > 0 and p.speedup_vs_bf16 is not None
        assert p.weight_bytes == V.layer_weight_bytes(SMALL, V.NO_GEMM, 128) == 512 and p.bound_speedup is None
    compiled = next(m for m in meas if m.variant == "no-gemm" and m.mode == "compiled")
    assert compiled.replay_err is not None and compiled.replay_err < 1e-2
    bf16 = [p for p in pts if p.variant == "bf16"]
    assert len(bf16) == 4 and all(p.bound_speedup is not None and p.bound_speedup > 0 for p in bf16)
    p = bf16[0]
    ref = next(q for q in ng if (q.batch, q.mode) == (p.batch, p.mode))
    assert p.bound_speedup == pytest.approx(p.us_per_layer / (ref.us_per_layer + (p.weight_bytes - 512) / 1e5))


def test_the_compiled_mode_traces_the_whole_step_as_one_graph(monkeypatch):
    """The ``compiled`` mode on the CPU: Dynamo traces the whole step (norms, rotary, attention,
    cache writes, the linears) with fullgraph=True, so a graph break fails the point; the step it
    runs matches the eager one, and it is timed. (Dynamo's "eager" backend: inductor's CPU compile
    would only cost CI time; the GPU run uses inductor.)"""
    from mixgemm.bench import model_run
    from mixgemm.bench.model_run import run_model

    monkeypatch.setattr(model_run, "COMPILE_BACKEND", "eager")
    cfg = M.ModelConfig(presets=("small",), layers=2, batches=(2,), context=6, prefill=0,
                        variants=V.parse_variants(["torch-int4"]), modes=("eager", "compiled"), iters=2, warmup=1,
                        quick=True, group_size=128)
    meas = run_model(cfg, CPU, log=lambda line: None, make_clock=lambda mode: WallClock(), presets=[SMALL])
    pts = analyze_model(meas, 100.0, cfg.max_error, cfg.group_size, presets=PRESETS_T)
    compiled = [p for p in pts if p.mode == "compiled" and p.variant == "bf16"]
    assert len(compiled) == 1 and compiled[0].status == bench.OK, compiled[0].note
    assert compiled[0].time_us > 0
    by_mode = {m.mode: m for m in meas if m.variant == "bf16"}
    assert by_mode["compiled"].replay_err is not None and by_mode["compiled"].replay_err < 1e-2


def test_modes_default_to_graph_and_eager_and_take_compiled():
    assert M.ModelConfig().modes == M.DEFAULT_MODES == ("graph", "eager")
    assert bench.model_config_from_args(parse("--model", "llama3-8b")).modes == ("graph", "eager")
    assert bench.model_config_from_args(parse("--model", "llama3-8b", "--modes", "compiled,graph")).modes == (
        "compiled", "graph")
