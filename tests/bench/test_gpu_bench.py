"""``mixgemm bench --model`` and ``--host`` on the GPU: quick runs whose reports must have every
point, measured, and no variant FAILing (a wrong step output, KV write or graph replay)."""
from __future__ import annotations

import json

import pytest
import torch

from mixgemm import bench
from mixgemm.bench import host as H
from mixgemm.bench import model as M

pytestmark = pytest.mark.gpu


def test_model_smoke(requires_gpu, tmp_path):
    out = tmp_path / "model.json"
    rc = bench.main(["--model", "llama3-8b", "--layers", "2", "--batch", "1", "--iters", "5", "--quick",
                     "--json", str(out)])
    rep = M.model_report_from_dict(json.loads(out.read_text()))
    assert rc == 0
    assert rep.machine.read_bw_gbps and rep.machine.read_bw_gbps > 100
    assert set(rep.presets) == {"llama3-8b"}
    # no-gemm: the step with its projections replaced by views of their input (the bound's base)
    variants = ["bf16", "mixgemm-u4", "mixgemm-u2", "mixgemm-s8", "torch-int4", "no-gemm"]
    keys = {(p.variant, p.phase, p.mode) for p in rep.points}
    assert keys == {(v, ph, mode) for v in variants for ph in ("decode", "prefill") for mode in ("graph", "eager")}
    for p in rep.points:
        assert p.status != bench.FAIL, (p.variant, p.phase, p.mode, p.note)
        if p.variant == "torch-int4" and p.status == bench.UNAVAILABLE:
            continue
        assert p.status == bench.OK, (p.variant, p.phase, p.mode, p.note)
        assert p.us_per_layer > 0 and p.layers == 2 and p.speedup_vs_bf16 > 0
        if p.variant == "no-gemm":   # no weights to read: a layer moves its KV cache and activations only
            assert p.bytes_per_layer > p.weight_bytes >= 0
            continue
        assert p.bytes_per_layer > p.weight_bytes > 0 and 0 < p.frac_of_floor
        # the bound (bf16 over no-gemm plus the variant's weight floor) is above 0 wherever no-gemm ran
        assert p.bound_speedup is None or p.bound_speedup > 0
        if p.variant != "bf16":
            assert p.err is not None and p.err < M.DEFAULT_MODEL_MAX_ERROR
            assert p.kv_err is not None and p.kv_err < M.DEFAULT_MODEL_MAX_ERROR
        if p.mode == "graph":
            assert p.replay_err is not None and p.replay_err < M.DEFAULT_MODEL_MAX_ERROR
    # the measured weight bytes are the formula's
    from mixgemm.bench.decoder import PRESETS
    from mixgemm.bench.variants import layer_weight_bytes, parse_variant
    for p in rep.points:
        assert p.weight_bytes == layer_weight_bytes(PRESETS["llama3-8b"], parse_variant(p.variant), 128)


def test_host_smoke(requires_gpu, tmp_path):
    out = tmp_path / "host.json"
    rc = bench.main(["--host", "--layers", "2", "--iters", "5", "--quick", "--json", str(out)])
    rep = H.host_report_from_dict(json.loads(out.read_text()))
    assert rc == 0
    # one call per loop at each M, and the ops chained at M = 1 in each mode
    per_call = {(i, m, "eager", 1) for i in H.HOST_IMPLS for m in H.HOST_MS}
    chained = {(i, 1, mode, H.HOST_CHAIN) for i in H.CHAIN_IMPLS for mode in H.HOST_MODES}
    assert {(c.impl, c.m, c.mode, c.chain) for c in rep.calls} == per_call | chained
    for c in rep.calls:
        if c.impl == "torch-int4" and c.status == bench.UNAVAILABLE:
            continue
        assert c.status == bench.OK, (c.impl, c.m, c.note)
        assert c.host_us > 0 and c.gpu_us > 0 and c.gpu_loop_us > 0 and c.bound in ("host", "gpu")
        assert "CUDA graphs skipped" not in c.note, (c.impl, c.mode, c.note)
    assert {(p.variant, p.mode) for p in rep.step} == {(v, m) for v in ("bf16", "mixgemm-u4")
                                                        for m in ("graph", "eager")}
    assert all(p.status == bench.OK and p.time_us > 0 for p in rep.step), [(p.variant, p.mode, p.note) for p in rep.step]


def test_moe_smoke(requires_gpu, tmp_path):
    """``--moe`` quick run: every (routing, tokens, variant) point measured and correct against
    bf16 on the variant's own dequantized weights; bf16 through torch._grouped_mm where this torch
    has it; the bytes of the experts touched as the formula says."""
    from mixgemm.bench import moe as B
    from mixgemm.bench.variants import parse_variant

    out = tmp_path / "moe.json"
    rc = bench.main(["--moe", "qwen3-30b-a3b", "--tokens", "1,16,256", "--iters", "5", "--quick",
                     "--json", str(out)])
    rep = B.moe_report_from_dict(json.loads(out.read_text()))
    assert rc == 0
    assert rep.machine.read_bw_gbps and rep.machine.read_bw_gbps > 100
    variants = ["bf16", "mixgemm-u4", "mixgemm-u2", "mixgemm-s8", "torch-int4"]
    assert {(p.variant, p.routing, p.tokens) for p in rep.points} == {
        (v, r, t) for v in variants for r in ("uniform", "zipf") for t in (1, 16, 256)}
    preset = B.MOE_PRESETS["qwen3-30b-a3b"]
    for p in rep.points:
        assert p.status != bench.FAIL, (p.variant, p.routing, p.tokens, p.note)
        if p.variant == "torch-int4" and p.status == bench.UNAVAILABLE:
            continue
        assert p.status == bench.OK, (p.variant, p.routing, p.tokens, p.note)
        assert p.time_us > 0 and p.frac_of_floor > 0 and p.speedup_vs_bf16 > 0
        assert p.err is not None and p.err < B.DEFAULT_MOE_MAX_ERROR and p.replay_err < B.DEFAULT_MOE_MAX_ERROR
        assert p.expert_bytes == B.expert_weight_bytes(preset, parse_variant(p.variant), 128)
        assert p.weight_bytes == p.experts_touched * p.expert_bytes
        if p.tokens == 1:
            assert p.experts_touched == 8
        if p.variant == "bf16" and hasattr(torch, "_grouped_mm"):
            assert p.impl == "torch._grouped_mm", p.impl


def test_grid_fp8_smoke(requires_gpu, tmp_path):
    """The grid's e4m3 rows on the GPU: mixgemm-<wt>-fp8 and scaled_mm measured, within the e4m3
    bar of float64 on their own operands, compared with scaled_mm as their best peer, with their
    formula's bytes; the 8-bit type with fp8 n/a with the reason."""
    out = tmp_path / "grid.json"
    impls = ["cublas", "torch_int4", "scaled_mm", "mixgemm-u4", "mixgemm-u4-fp8", "mixgemm-s2-fp8", "mixgemm-s8-fp8"]
    rc = bench.main(["--shapes", "4096x4096,4096x14336", "--m", "1,16,256,1024", "--impls", ",".join(impls),
                     "--quick", "--json", str(out)])
    rep = bench.read_json(out)
    assert rc == 0
    points = {(p.impl, p.k, p.m): p for p in rep.results}
    assert set(points) == {(i, k, m) for i in impls for k in (4096, 14336) for m in (1, 16, 256, 1024)}
    for (impl, k, m), p in points.items():
        if impl == "mixgemm-s8-fp8":
            assert p.status == bench.UNAVAILABLE and "u4, s4, u2 and s2" in p.note
            continue
        if impl == "torch_int4" and p.status == bench.UNAVAILABLE:
            continue
        assert p.status == bench.OK, (impl, k, m, p.note)
        assert p.weight_bytes == bench.expected_weight_bytes(impl, 4096, k, 128)
        assert p.time_us > 0 and p.speedup_vs_cublas > 0
        if bench.activations_of(impl) == bench.E4M3:
            assert p.err_impl < bench.fp8_error_bar(k), (impl, k, m, p.err_impl)
            assert p.best_peer == "scaled_mm" and p.bytes_moved > bench.traffic_bytes(m, 4096, k, p.weight_bytes)
        else:
            assert p.best_peer in (None, "torch_int4")


def test_model_fp8_smoke(requires_gpu, tmp_path):
    """--model with the e4m3 variants: every step measured in graph and eager mode, within the e4m3
    bar of the bf16 step on their own weights and further from it than the exact variant; the
    8-bit e4m3 variant n/a; their bytes the formula's and their activations' codes counted."""
    from mixgemm.bench.decoder import PRESETS
    from mixgemm.bench.variants import layer_weight_bytes, parse_variant

    out = tmp_path / "model.json"
    rc = bench.main(["--model", "llama3-8b", "--layers", "2", "--batch", "1,64", "--prefill", "256",
                     "--variants", "int4,int4-fp8,int2-fp8,scaled-mm,int8-fp8", "--iters", "5", "--quick",
                     "--json", str(out)])
    rep = M.model_report_from_dict(json.loads(out.read_text()))
    assert rc == 0
    variants = ["bf16", "mixgemm-u4", "mixgemm-u4-fp8", "mixgemm-u2-fp8", "scaled-mm", "mixgemm-s8-fp8"]
    assert {(p.variant, p.phase, p.batch, p.mode) for p in rep.points} == {
        (v, ph, b, mode) for v in variants for ph, b in (("decode", 1), ("decode", 64), ("prefill", 1))
        for mode in ("graph", "eager")}
    err = {}
    for p in rep.points:
        if p.variant == "mixgemm-s8-fp8":
            assert p.status == bench.UNAVAILABLE and "u4, s4, u2 and s2" in p.note
            continue
        assert p.status == bench.OK, (p.variant, p.phase, p.batch, p.mode, p.note)
        assert p.weight_bytes == layer_weight_bytes(PRESETS["llama3-8b"], parse_variant(p.variant), 128)
        assert p.speedup_vs_bf16 > 0 and p.frac_of_floor > 0
        if p.variant in ("mixgemm-u4-fp8", "mixgemm-u2-fp8", "scaled-mm"):
            assert p.err < M.DEFAULT_MODEL_FP8_MAX_ERROR and p.kv_err < M.DEFAULT_MODEL_FP8_MAX_ERROR
            assert p.act_bytes > next(q.act_bytes for q in rep.points if q.variant == "bf16" and q.key[1:5] == p.key[1:5])
        if p.variant != "bf16":
            err[(p.variant, p.phase, p.batch, p.mode)] = p.err
    for key, e in err.items():
        if key[0] != "mixgemm-u4":
            assert e > err[("mixgemm-u4",) + key[1:]], (key, e)   # the e4m3 rounding shows


def test_model_fp8_compiled_smoke(requires_gpu, tmp_path):
    """--modes compiled: scaled-mm's step (its quantizer fused by inductor) and mixgemm's e4m3 step
    (the op mixgemm::gemm_fp8) compile whole, are captured and replayed, within the e4m3 bar."""
    out = tmp_path / "model.json"
    rc = bench.main(["--model", "llama3-8b", "--layers", "2", "--batch", "16", "--prefill", "0",
                     "--variants", "scaled-mm,int4-fp8", "--modes", "compiled", "--iters", "5", "--quick",
                     "--json", str(out)])
    rep = M.model_report_from_dict(json.loads(out.read_text()))
    assert rc == 0
    by_variant = {p.variant: p for p in rep.points}
    assert set(by_variant) == {"bf16", "scaled-mm", "mixgemm-u4-fp8"}
    for name in ("scaled-mm", "mixgemm-u4-fp8"):
        p = by_variant[name]
        assert p.status == bench.OK, (name, p.note)
        assert p.replay_err is not None and p.replay_err < M.DEFAULT_MODEL_FP8_MAX_ERROR
        assert p.err < M.DEFAULT_MODEL_FP8_MAX_ERROR
