"""The e4m3-activation rows of ``mixgemm bench`` without a GPU: ``mixgemm-<wt>-fp8``
(``mixgemm.gemm(x, w, act_format="fp8")``) and ``scaled_mm`` (``torch._scaled_mm`` e4m3 x e4m3):
their names, bytes, error bars, best peers, references (on the CPU, against an independent
rounding), why they do not run, and scaled_mm itself through PyTorch's CPU kernel.
(The ``--model`` variants: test_bench_model_fp8.py.)"""
from __future__ import annotations

import pytest
import torch

from mixgemm import bench
from mixgemm.bench import E4M3, EXACT, FAIL, OK, UNAVAILABLE, analyze, expected_weight_bytes
from mixgemm.bench import grid as G
from mixgemm.dtypes import WeightType
from mixgemm.ops import quantize_fp8
from mixgemm.ops.fp8 import k_permutation, quant_spec
from mixgemm.weights.layout import prepack
from mixgemm.weights.quantize import dequantize_reference, quantize

from bench_helpers import G_TABLE, K, N, by_impl, meas, WallClock


def _scaled_mm_runs_on_the_cpu() -> bool:
    try:
        a = torch.ones(16, 32).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
        return True
    except Exception:   # no float8, no _scaled_mm, or no CPU kernel for it in this PyTorch
        return False


CPU_SCALED_MM = pytest.mark.skipif(not _scaled_mm_runs_on_the_cpu(), reason="no CPU torch._scaled_mm here")


# ------------------------------------------------------------------------------------ names
def test_names_and_kinds():
    assert bench.SCALED_MM == "scaled_mm" and bench.is_peer("scaled_mm") and "scaled_mm" in bench.PEER_NAMES
    assert [wt.value for wt in bench.MIXGEMM_FP8_TYPES] == ["s4", "u4", "s2", "u2"]
    for name in ("scaled_mm", "mixgemm-u4-fp8", "mixgemm-s2-fp8", "mixgemm-s8-fp8"):
        assert bench.activations_of(name) == E4M3
    for name in ("cublas", "torch_int4", "gemlite-u4", "mixgemm-u4", "mixgemm-u4@dec8"):
        assert bench.activations_of(name) == EXACT
    assert not bench.is_peer("mixgemm-u4-fp8")
    impls = bench.make_impls(["scaled_mm", "mixgemm-u4-fp8", "mixgemm-s8-fp8", "mixgemm-u4"], 128, bench.QuantCache())
    assert [i.name for i in impls] == ["scaled_mm", "mixgemm-u4-fp8", "mixgemm-s8-fp8", "mixgemm-u4"]
    assert [i.activations for i in impls] == [E4M3, E4M3, E4M3, EXACT]
    assert [i.kind for i in impls] == ["peer", "mixgemm", "mixgemm", "mixgemm"]
    assert impls[1].act_format == "fp8" and impls[3].act_format == "bf16"
    for bad in ("mixgemm-u4-fp8@dec8", "mixgemm-q4-fp8", "gemlite-u4-fp8", "scaled_mm@dec8"):
        with pytest.raises(ValueError, match="unknown implementation"):
            bench.make_impls([bad], 128, bench.QuantCache())


# ------------------------------------------------------------------------------------ bytes
@pytest.mark.parametrize("impl,expected", [
    ("mixgemm-u4-fp8", N * K // 2 + 2 * G_TABLE),          # the packed weight of mixgemm-u4
    ("mixgemm-s4-fp8", N * K // 2 + G_TABLE),
    ("mixgemm-u2-fp8", N * K // 4 + 2 * G_TABLE),
    ("mixgemm-s2-fp8", N * K // 4 + G_TABLE),
    ("scaled_mm", N * K + 4 * N),                           # one e4m3 byte per weight + float32 row scales
])
def test_expected_weight_bytes(impl, expected):
    assert expected_weight_bytes(impl, N, K, 128) == expected
    if impl.startswith("mixgemm"):
        assert expected == expected_weight_bytes(impl[:-len("-fp8")], N, K, 128)


def test_expected_weight_bytes_literal_numbers():
    assert expected_weight_bytes("mixgemm-u4-fp8", N, K, 128) == 8_912_896
    assert expected_weight_bytes("scaled_mm", N, K, 128) == 16_777_216 + 16_384
    with pytest.raises(ValueError):
        expected_weight_bytes("gemlite-u4-fp8", N, K, 128)


def test_traffic_of_an_e4m3_row_by_hand():
    # M = 16, N = K = 4096: x 2*16*4096 = 131,072 bytes, y the same; the codes 16*4096 = 65,536 and
    # the scales 16*4 = 64 bytes are written by the quantizer and read back by the GEMM
    assert bench.traffic_bytes(16, N, K, 1000) == 1000 + 131_072 + 131_072
    assert bench.traffic_bytes(16, N, K, 1000, e4m3=True) == 1000 + 131_072 + 2 * (65_536 + 64) + 131_072
    wb = expected_weight_bytes("mixgemm-u4-fp8", N, K, 128)
    r = by_impl(analyze([meas("mixgemm-u4", 10.0), meas("mixgemm-u4-fp8", 10.0), meas("scaled_mm", 10.0)],
                        copy_bw_gbps=3000.0))
    assert r["mixgemm-u4-fp8"].weight_bytes == r["mixgemm-u4"].weight_bytes == wb
    assert r["mixgemm-u4-fp8"].bytes_moved == r["mixgemm-u4"].bytes_moved + 2 * (65_536 + 64)
    assert r["scaled_mm"].bytes_moved == N * K + 4 * N + 131_072 + 2 * (65_536 + 64) + 131_072
    assert r["scaled_mm"].gbps == pytest.approx(r["scaled_mm"].bytes_moved / 10e-6 / 1e9)


# ---------------------------------------------------------------------------------- the bar
def test_fp8_error_bar_is_the_gpu_tests_bound():
    # 4 * 2^-9 + 64 * 64 * 2^-24 + 2^-12 at K = 4096 (bf16): 7.8125e-3 + 2.44e-4 + 2.44e-4
    assert bench.fp8_error_bar(4096) == pytest.approx(4 * 2**-9 + 64 * 64 * 2**-24 + 2**-12, rel=1e-15)
    assert bench.fp8_error_bar(4096) == pytest.approx(8.3008e-3, rel=1e-4)
    assert bench.fp8_error_bar(4096, "fp16") == pytest.approx(4 * 2**-12 + 64 * 64 * 2**-24 + 2**-12, rel=1e-15)
    assert bench.fp8_error_bar(28672) > bench.fp8_error_bar(4096)           # the float32 sum over K
    assert bench.error_bar("mixgemm-u4", 4096) == bench.DEFAULT_MAX_ERROR
    assert bench.error_bar("torch_int4", 4096) == bench.DEFAULT_PEER_MAX_ERROR
    assert bench.error_bar("scaled_mm", 4096) == bench.error_bar("mixgemm-s2-fp8", 4096) == bench.fp8_error_bar(4096)
    assert bench.error_bar("scaled_mm", 4096, fp8_max_error=0.05) == 0.05


def test_e4m3_rows_fail_above_their_bar():
    """An e4m3 row 1e-2 off its own reference FAILs (above 8.3e-3 at K = 4096), though 1e-2 would
    pass a bf16 mixgemm row and 1e-1 a weight-only peer; scaled_mm, a peer, keeps the e4m3 bar."""
    ms = [meas("cublas", 100.0), meas("mixgemm-u4", 50.0, err_impl=9e-3), meas("mixgemm-u4-fp8", 60.0, err_impl=1e-2),
          meas("scaled_mm", 40.0, err_impl=1e-2), meas("mixgemm-u2-fp8", 60.0, err_impl=8e-3),
          meas("torch_int4", 70.0, err_impl=5e-2)]
    r = by_impl(analyze(ms, None))
    assert r["mixgemm-u4"].status == OK and r["torch_int4"].status == OK and r["mixgemm-u2-fp8"].status == OK
    for name in ("mixgemm-u4-fp8", "scaled_mm"):
        assert r[name].status == FAIL and "error vs own weight 1.00e-02 > 0.0083" in r[name].note
        assert r[name].speedup_vs_cublas is None
    loose = by_impl(analyze(ms, None, fp8_max_error=2e-2))
    assert loose["mixgemm-u4-fp8"].status == OK and loose["scaled_mm"].status == OK
    # fp16 output: the bar follows the output's rounding (2^-12), 8e-3 is far above it
    assert by_impl(analyze(ms, None, dtype="fp16"))["mixgemm-u2-fp8"].status == FAIL
    assert "> 0.0083" in bench.format_table(analyze(ms, None))


def test_each_row_is_compared_with_the_peers_of_its_activations():
    """The e4m3 rows' best peer is scaled_mm (the other row that rounds x to e4m3), the exact
    rows' the fastest of torch_int4 and gemlite, even where scaled_mm is faster."""
    ms = [meas("cublas", 100.0), meas("torch_int4", 80.0), meas("gemlite-u4", 90.0), meas("scaled_mm", 50.0),
          meas("mixgemm-u4", 40.0), meas("mixgemm-u4-fp8", 100.0)]
    r = by_impl(analyze(ms, None))
    assert r["mixgemm-u4"].best_peer == "torch_int4" and r["mixgemm-u4"].speedup_vs_best_peer == pytest.approx(2.0)
    assert r["cublas"].best_peer == "torch_int4"
    assert r["mixgemm-u4-fp8"].best_peer == "scaled_mm"
    assert r["mixgemm-u4-fp8"].speedup_vs_best_peer == pytest.approx(0.5)
    assert r["mixgemm-u4-fp8"].speedup_vs_cublas == pytest.approx(1.0)
    assert r["scaled_mm"].best_peer == "scaled_mm" and r["scaled_mm"].speedup_vs_cublas == pytest.approx(2.0)
    # without scaled_mm the e4m3 rows have no peer
    r = by_impl(analyze([m for m in ms if m.impl != "scaled_mm"], None))
    assert r["mixgemm-u4-fp8"].best_peer is None and r["mixgemm-u4-fp8"].speedup_vs_best_peer is None


# ----------------------------------------------------------------------------- references
def _x(m=6, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, with outliers: each token has its own scale
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)
    x[:, ::37] *= 8
    return x.to(torch.bfloat16)


def test_e4m3_activations_against_an_independent_rounding():
    """The reference's activations: each token rounded to e4m3 with amax / 448, in the natural
    column order; the same as e4m3_rows (no K permutation) and within 2^-4 of each value."""
    x = _x()
    codes, scales = bench.e4m3_rows(x)
    expected = codes.double() * scales.double().unsqueeze(1)
    got = bench.e4m3_activations(x)
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    assert torch.equal(scales, x.float().abs().amax(dim=1) / 448)
    rel = ((got - x.double()).abs() / x.double().abs().clamp(min=1e-30))
    normal = x.double().abs() >= 2**-6 * scales.double().unsqueeze(1)   # e4m3's normal range
    assert float(rel[normal].max()) <= 2**-4 and float(rel[normal].max()) > 2**-6
    assert not torch.equal(got, x.double())
    zero = bench.e4m3_activations(torch.zeros(2, 64, dtype=torch.bfloat16))   # a row of zeros: scale 1
    assert torch.equal(zero, torch.zeros(2, 64, dtype=torch.float64))


def test_reference_product():
    x, g = _x(), torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g).to(torch.bfloat16)
    cs = torch.rand(48, generator=g) + 0.5
    exact = bench.reference_product(x, w)
    torch.testing.assert_close(exact, x.double() @ w.double().t(), rtol=0, atol=0)
    e4 = bench.reference_product(x, w, E4M3)
    torch.testing.assert_close(e4, bench.e4m3_activations(x) @ w.double().t(), rtol=1e-15, atol=0)
    scaled = bench.reference_product(x, w, E4M3, cs)
    torch.testing.assert_close(scaled, e4 * cs.double(), rtol=1e-15, atol=0)
    # e4m3 activations move the product by about 2-3% (3 mantissa bits): far above the e4m3 rows'
    # bar, so a row that multiplied x exactly, or rounded it otherwise, would FAIL
    assert 5e-3 < bench.relative_error(e4, exact) < 5e-2


# ---------------------------------------------------------------------------- the adapters
@pytest.mark.parametrize("wt", ["u4", "s4", "u2", "s2"])
def test_mixgemm_fp8_adapter_on_the_cpu(wt):
    """Prepared on the CPU: the packed weight of mixgemm-<wt> (its bytes), the exact weight
    (q - z) * s as the reference's (whose bf16 rounding is dequantize_reference's), the e4m3
    kernels to build; it does not run here, and says why."""
    wtype = WeightType(wt)
    n, k, g = 256, 512, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    cache = bench.QuantCache()
    impl, plain = bench.make_impls([f"mixgemm-{wt}-fp8", f"mixgemm-{wt}"], g, cache)
    impl.prepare(w, torch.bfloat16)
    plain.prepare(w, torch.bfloat16)
    qw = quantize(w, wtype.bits, g, symmetric=wtype.signed, dtype=torch.bfloat16)
    assert impl.weight_bytes == plain.weight_bytes == prepack(qw).nbytes == expected_weight_bytes(impl.name, n, k, g)
    assert impl.dequantized.dtype == torch.float32 and impl.col_scale is None
    z = 0 if qw.zeros is None else qw.zeros.double().repeat_interleave(g, dim=1)
    w64 = (qw.qweight.double() - z) * qw.scales.double().repeat_interleave(g, dim=1)
    assert torch.equal(impl.dequantized.double(), w64)                       # exact in float32
    assert torch.equal(impl.dequantized.to(torch.bfloat16), dequantize_reference(qw))
    assert torch.equal(plain.dequantized, dequantize_reference(qw))
    specs = impl.kernel_specs(torch.bfloat16, [1, 4096])
    assert [s.name for s in specs] == [quant_spec(torch.bfloat16).name] + [
        f"mixgemm_f8gemm_bf16_{wt}_t128x{t}x128{sk}_s0"
        for sk in ("", "_streamk") for t in (128, 64, 32)]     # every token tile, whole-tile and split-K
    if not torch.cuda.is_available():
        assert impl.available() == (False, "needs a CUDA GPU")
    impl.release()
    assert impl.dequantized is None and impl.weight_bytes is None


@pytest.mark.parametrize("wt", ["s8", "u8"])
def test_eight_bit_weights_with_e4m3_activations_are_not_available(wt):
    (impl,) = bench.make_impls([f"mixgemm-{wt}-fp8"], 128, bench.QuantCache())
    ok, why = impl.available()
    assert not ok and "u4, s4, u2 and s2" in why and wt in why and "\n" not in why
    with pytest.raises(bench.ImplUnavailable, match="u4, s4, u2 and s2"):
        impl.prepare(torch.randn(128, 256) * 0.02, torch.bfloat16)


def test_scaled_mm_adapter_prepares_on_the_cpu():
    n, k = 96, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) * 0.02
    (impl,) = bench.make_impls(["scaled_mm"], 128, bench.QuantCache())
    impl.prepare(w, torch.bfloat16)
    assert impl.weight_bytes == expected_weight_bytes("scaled_mm", n, k, 128) == n * k + 4 * n
    codes, scales = bench.e4m3_rows(w.to(torch.bfloat16))
    assert torch.equal(impl.dequantized.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(impl.col_scale, scales) and impl.col_scale.dtype == torch.float32
    # the weight the GEMM reads: its columns in the quantizer's order (a permutation inside each
    # block of 32 columns), so that the e4m3 activations multiply it as they come
    perm = k_permutation(k)
    assert torch.equal(impl._codes.view(torch.uint8), codes.view(torch.uint8)[:, perm])
    assert not torch.equal(perm, torch.arange(k))
    # 1 byte per weight; the e4m3 weight is within 2^-4 of the bf16 one
    assert bench.relative_error(codes.double() * scales.double().unsqueeze(1), w.to(torch.bfloat16)) < 4e-2
    assert [s.name for s in impl.kernel_specs(torch.bfloat16)] == [quant_spec(torch.bfloat16).name]
    with pytest.raises(bench.ImplUnavailable, match="bf16"):
        impl.prepare(w, torch.float16)
    with pytest.raises(bench.ImplUnavailable, match="K % 32"):
        impl.prepare(torch.randn(96, 208), torch.bfloat16)
    impl.release()
    assert impl.dequantized is None and impl.col_scale is None


def test_scaled_mm_availability_reasons(monkeypatch):
    assert bench.scaled_mm_problem() is None or "PyTorch" in bench.scaled_mm_problem()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    ok, why = bench.ScaledMmImpl().available()
    assert not ok and why == "torch._scaled_mm's e4m3 GEMM needs an sm_89+ GPU, this one is sm_80"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    assert bench.ScaledMmImpl().available() == (True, "")
    monkeypatch.delattr(torch, "_scaled_mm")
    ok, why = bench.ScaledMmImpl().available()
    assert not ok and "has no torch._scaled_mm" in why


def _point(impl, x, w, rows=None):
    """One grid point checked and timed as run_benchmark does it, on the CPU (a wall clock)."""
    cfg = G.BenchConfig(iters=2, warmup=1, quick=True)
    rows = torch.arange(x.shape[0]) if rows is None else rows
    x_rows = x.index_select(0, rows)
    return G._measure_point(impl, x, rows, x_rows, G.reference_matmul(x_rows, w), {}, cfg, WallClock(),
                            w.shape[0], w.shape[1], x.shape[0])


@CPU_SCALED_MM
def test_scaled_mm_checked_against_its_own_operands_on_the_cpu(monkeypatch):
    """torch._scaled_mm (PyTorch's CPU kernel) through the adapter, checked as the grid checks it:
    within the e4m3 bar of float64 on its own operands (e4m3 x and e4m3 weight, the row scales);
    a few percent off the exact product, as W8A8 is."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    n, k = 96, 512
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.02
    (impl,) = bench.make_impls(["scaled_mm"], 128, bench.QuantCache())
    impl.prepare(w, torch.bfloat16)
    x = _x(m=9, k=k, seed=4)
    meas_ = _point(impl, x, w)
    assert meas_.error is None and meas_.timing is not None and meas_.output_finite
    assert meas_.err_impl < bench.fp8_error_bar(k) and 1e-2 < meas_.err_float < 0.1
    (r,) = analyze([meas_], None)
    assert r.status == OK and r.weight_bytes == n * k + 4 * n
    # the permuted weight matters: the natural-order codes against the quantizer's activations are wrong
    xq, xs = quantize_fp8(x)
    wrong = bench.scaled_mm(xq, xs, impl.dequantized.contiguous(), impl.col_scale)
    assert bench.relative_error(wrong, G.reference_product(x, impl.dequantized, E4M3, impl.col_scale)) > 0.5


def test_an_e4m3_row_is_checked_on_the_rounded_activations(monkeypatch):
    """The check of a mixgemm-<wt>-fp8 row, with a CPU stand-in for its kernels: the float64
    product of the e4m3-rounded x and the exact weight, rounded to bf16, passes; a kernel that
    multiplied x exactly (no e4m3 rounding) or its bf16-rounded weight reads its error against
    the wrong reference and FAILs."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    n, k = 128, 512
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.02
    x = _x(m=7, k=k, seed=6)
    results = {}
    stand_ins = {
        "right": lambda impl, x: (bench.e4m3_activations(x) @ impl.dequantized.double().t()).to(x.dtype),
        "exact x": lambda impl, x: (x.double() @ impl.dequantized.double().t()).to(x.dtype),
    }
    for label, run in stand_ins.items():
        (impl,) = bench.make_impls(["mixgemm-u4-fp8"], 128, bench.QuantCache())
        impl.prepare(w, torch.bfloat16)
        monkeypatch.setattr(impl, "run", lambda x, impl=impl, run=run: run(impl, x))
        results[label] = analyze([_point(impl, x, w)], None)[0]
    assert results["right"].status == OK and results["right"].err_impl < 4e-3
    assert results["exact x"].status == FAIL and results["exact x"].err_impl > 1e-2
    # against the float weight both are a quantized weight away (about 0.1 for int4)
    assert 0.05 < results["right"].err_float < 0.2


def test_unavailable_e4m3_rows_in_the_table():
    ms = [meas("cublas", 100.0),
          meas("mixgemm-s8-fp8", error="act_format='fp8' takes u4, s4, u2 and s2 weights", unavailable=True),
          meas("scaled_mm", error="torch._scaled_mm's e4m3 GEMM needs an sm_89+ GPU, this one is sm_80",
               unavailable=True)]
    res = analyze(ms, None)
    assert [r.status for r in res] == [OK, UNAVAILABLE, UNAVAILABLE]
    table = bench.format_table(res)
    assert "mixgemm-s8-fp8: n/a: act_format='fp8' takes u4, s4, u2 and s2 weights" in table
    assert "scaled_mm: n/a: torch._scaled_mm's e4m3 GEMM needs an sm_89+ GPU" in table


def test_list_kernels_of_the_e4m3_rows(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--m", "1,4096", "--impls", "mixgemm-u4-fp8,scaled_mm", "--list-kernels"]) == 0
    assert capsys.readouterr().out.split() == sorted([
        *(f"mixgemm_f8gemm_bf16_u4_t128x{t}x128{sk}_s0" for t in (128, 64, 32) for sk in ("", "_streamk")),
        quant_spec(torch.bfloat16).name])
    assert bench.main(["--m", "1", "--impls", "scaled_mm", "--list-kernels"]) == 0
    assert capsys.readouterr().out.split() == [quant_spec(torch.bfloat16).name]
