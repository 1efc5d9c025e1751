"""FP8 (e4m3) activations on the CPU: the quantizer's definition (mixgemm.ops.fp8.quantize_fp8_reference)
against an independent e4m3 rounding and the K permutation's definition, its bounds, the e4m3
GEMM's specs and C++, the argument checks of ``mixgemm.gemm(..., act_format="fp8")`` and
``supports``, and both launches on a faked GPU (what the quantizer and the GEMM are given).

The kernels themselves: tests/jit/test_fp8_build.py (nvcc) and tests/ops/test_gpu_fp8.py (GPU).
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import struct
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import fake_driver
from fake_gpu import FakeGpu, function_handle

import mixgemm
from mixgemm.dispatch import heuristic
from mixgemm.dtypes import ActType, WeightType
from mixgemm.jit import driver
from mixgemm.jit.catalog import FP8_TOKEN_TILES
from mixgemm.jit.render import render
from mixgemm.jit.specs import (HELPER_KINDS, Epilogue, Fp8GemmSpec, GemmSpec, QuantFp8Spec, Schedule, Scheduler,
                               parse_name)
from mixgemm.ops import fp8

DTYPES = [torch.bfloat16, torch.float16]
FP8_WEIGHTS = [WeightType.U4, WeightType.S4, WeightType.U2, WeightType.S2]


# ---------------------------------------------------------------------------------------------
# The K permutation
# ---------------------------------------------------------------------------------------------
def test_k_permutation_is_the_fragment_order():
    """MMA column F = 16 p + 4 t + j holds column L = 8 j + 2 t + p, inside each block of 32."""
    perm = fp8.k_permutation(96).tolist()
    for block in range(3):
        for p in range(2):
            for t in range(4):
                for j in range(4):
                    f, col = 32 * block + 16 * p + 4 * t + j, 32 * block + 8 * j + 2 * t + p
                    assert perm[f] == col == fp8.mma_to_weight_col(f)
                    assert fp8.weight_to_mma_col(col) == f
    assert sorted(perm) == list(range(96))


def test_k_permutation_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8.k_permutation(48)


# ---------------------------------------------------------------------------------------------
# The quantizer's definition
# ---------------------------------------------------------------------------------------------
def _e4m3_values() -> np.ndarray:
    """Every finite e4m3 (float8_e4m3fn) value by its bit pattern (NaN for 0x7f, 0xff), decoded
    from the format's definition: bias 7, 3 mantissa bits, subnormals at exponent field 0."""
    vals = np.empty(256)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            vals[b] = np.nan
        elif e == 0:
            vals[b] = (-1) ** s * m * 2.0 ** -9
        else:
            vals[b] = (-1) ** s * (1 + m / 8) * 2.0 ** (e - 7)
    return vals


def _round_e4m3(v: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3 value, ties to the even code (an independent rounding: a search
    over all finite values), for |v| <= 448. Returns the bit patterns."""
    vals = _e4m3_values()
    codes = np.array([b for b in range(128) if not np.isnan(vals[b])])       # +0 .. 448
    mags = vals[codes]
    a = np.abs(v)
    idx = np.searchsorted(mags, a)                                           # mags[idx-1] < a <= mags[idx]
    hi = np.clip(idx, 0, len(mags) - 1)
    lo = np.clip(idx - 1, 0, len(mags) - 1)
    d_hi, d_lo = mags[hi] - a, a - mags[lo]
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(codes[lo] % 2 == 0, lo, hi)))
    out = codes[pick].astype(np.int64)
    return np.where(np.signbit(v), out | 0x80, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_definition(dtype):
    """Scales amax / 448 (1 for a row of zeros); codes x / s rounded to nearest even into e4m3
    (checked against a search over all e4m3 values), in the MMA's K order."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 256, generator=g) * torch.logspace(-6, 4, 6).unsqueeze(1)).to(dtype)
    x[2] = 0
    x[3, 5] = -x[3].abs().max() * 1.5        # the amax is negative
    x[4, :40] = 0                            # zeros (and -0) among values
    x[4, 1] = -0.0
    xq, s = fp8.quantize_fp8_reference(x)
    assert xq.dtype == torch.float8_e4m3fn and xq.shape == x.shape and s.dtype == torch.float32
    amax = x.float().abs().amax(1)
    want_s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert torch.equal(s, want_s) and s[2] == 1
    q = (x.float() / s.unsqueeze(1)).clamp(-448, 448).numpy().astype(np.float64)
    want = _round_e4m3(q)
    got = xq.view(torch.uint8).to(torch.int64).numpy()[:, np.argsort(fp8.k_permutation(256).numpy())]
    assert (got == want).all(), np.argwhere(got != want)[:5]
    nat = xq.float()[:, torch.argsort(fp8.k_permutation(256))]
    peak = x.float().abs().argmax(1)
    for r in (0, 1, 3, 4, 5):                  # each row's amax is exactly +-448
        assert nat[r, peak[r]].abs() == 448


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_bounds(dtype):
    """x ~= dequantize_fp8(quantize_fp8(x)): half an e4m3 ulp, relative 2^-4 for normal codes,
    s * 2^-10 absolute below (the subnormal step is 2^-9)."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 512, generator=g) ** 3).to(dtype)
    xq, s = fp8.quantize_fp8_reference(x)
    back = fp8.dequantize_fp8(xq, s, torch.float64)
    x64 = x.double()
    err = (back - x64).abs()
    bound = torch.maximum(x64.abs() * 2.0 ** -4, s.double().unsqueeze(1) * 2.0 ** -10)
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert fp8.dequantize_fp8(xq.view(torch.uint8), s).dtype == torch.float32


def test_quantize_fp8_shapes_and_cpu_path():
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    xq, s = mixgemm.ops.quantize_fp8(x)
    ref_q, ref_s = fp8.quantize_fp8_reference(x)
    assert xq.shape == (2, 3, 64) and s.shape == (2, 3)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    xq1, s1 = mixgemm.ops.quantize_fp8(x[0, 0])
    assert xq1.shape == (64,) and s1.shape == ()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-d", "1-elem"])
def test_static_scale_reference_is_the_definition(dtype, shape):
    """With a static scale s every token is e4m3(clamp(x / s, -448, 448)) (checked against the
    independent rounding), values beyond 448 s saturate to +-448, a row of zeros stays zero, and
    the returned scales are s repeated (contiguous)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 128, generator=g) * torch.logspace(-3, 2, 5).unsqueeze(1)).to(dtype)
    x[1] = 0
    s = torch.tensor(0.0123, dtype=torch.float32).reshape(shape)
    xq, scales = fp8.quantize_fp8_reference(x, s)
    assert scales.shape == (5,) and scales.is_contiguous() and bool((scales == s.reshape(())).all())
    q = (x.float() / s.reshape(())).clamp(-448, 448).numpy().astype(np.float64)
    got = xq.view(torch.uint8).to(torch.int64).numpy()[:, np.argsort(fp8.k_permutation(128).numpy())]
    assert (got == _round_e4m3(q)).all()
    nat = fp8.dequantize_fp8(xq, scales, torch.float64)
    assert bool((nat[1] == 0).all())
    big = x.float().abs() > 448 * float(s)
    assert bool(big.any()) and bool((nat[big].abs() == 448 * float(s)).all())     # saturated
    # batch dimensions, and the CPU path of quantize_fp8 (the kernel's definition)
    xq3, s3 = mixgemm.ops.quantize_fp8(x.reshape(5, 1, 128), s)
    assert s3.shape == (5, 1) and torch.equal(xq3.reshape(5, 128).view(torch.uint8), xq.view(torch.uint8))


def test_static_scale_equals_per_token_where_they_agree():
    """A static scale equal to a row's amax / 448 quantizes that row exactly as the per-token
    quantizer does (the same division, the same rounding)."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ref_q, ref_s = fp8.quantize_fp8_reference(x)
    for r in range(3):
        q, s = fp8.quantize_fp8_reference(x[r:r + 1], ref_s[r].clone())
        assert torch.equal(q.view(torch.uint8), ref_q[r:r + 1].view(torch.uint8)) and s[0] == ref_s[r]


@pytest.mark.parametrize("scale,msg", [
    (lambda: torch.tensor([0.5, 0.5]), "input_scale must be a float32 tensor of one element (shape [] or [1]), "
     "got a torch.float32 tensor of shape [2]"),
    (lambda: torch.tensor([[0.5]]), "got a torch.float32 tensor of shape [1, 1]"),
    (lambda: torch.tensor(0.5, dtype=torch.bfloat16),
     "got a torch.bfloat16 tensor of shape [] (convert it with .float())"),
    (lambda: 0.5, "input_scale must be a float32 tensor of one element (shape [] or [1]), got float"),
    (lambda: torch.tensor(0.5, device="meta"), "input_scale is on meta but x is on cpu"),
])
def test_static_scale_refused(scale, msg):
    x = torch.randn(2, 64).bfloat16()
    for call in (mixgemm.ops.quantize_fp8, fp8.quantize_fp8_reference):
        with pytest.raises(ValueError) as excinfo:
            call(x, scale())
        assert msg in str(excinfo.value) and "\n" not in str(excinfo.value), str(excinfo.value)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_check_input_scale_value(value):
    with pytest.raises(ValueError, match="input_scale must be positive and finite"):
        fp8.check_input_scale_value(torch.tensor(value))
    fp8.check_input_scale_value(torch.tensor([2.0 ** -20]))


@pytest.mark.parametrize("x,exc,msg", [
    (lambda: torch.randn(2, 48).bfloat16(), ValueError, "K % 32 == 0"),
    (lambda: torch.randn(2, 64), TypeError, "bfloat16 or float16"),
    (lambda: "x", TypeError, "torch.Tensor"),
])
def test_quantizer_refuses(x, exc, msg):
    with pytest.raises(exc, match=msg):
        mixgemm.ops.quantize_fp8(x())


# ---------------------------------------------------------------------------------------------
# Specs and C++
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wt", FP8_WEIGHTS, ids=lambda w: w.value)
@pytest.mark.parametrize("act", list(ActType), ids=lambda a: a.value)
def test_fp8_gemm_spec_name_and_source(act, wt):
    spec = Fp8GemmSpec(act, wt, 128, 128, 128)
    assert spec.name == f"mixgemm_f8gemm_{act.value}_{wt.value}_t128x128x128_s0"
    assert parse_name(spec.name) == spec and isinstance(spec, HELPER_KINDS)
    assert spec.name != GemmSpec(act, wt, 128, 128, 128).name
    src = render(spec)
    code = {WeightType.S4: "cutlass::int4b_t", WeightType.U4: "cutlass::uint4b_t",
            WeightType.S2: "cutlass::int2b_t", WeightType.U2: "cutlass::uint2b_t"}[wt]
    half = {ActType.BF16: "cutlass::bfloat16_t", ActType.FP16: "cutlass::half_t"}[act]
    pair = f"cute::tuple<{code}, {half}>" if wt.signed else f"cute::tuple<{code}, {half}, {half}>"
    assert pair in src and "cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, 16" in src
    assert "mixgemm::KernelPrepackedFp8Cooperative" in src and "mixgemm::layout::PrepackedSm90" in src
    assert '#include "mixgemm/gemm_prelude_fp8.hpp"' in src and "cutlass::gemm::PersistentScheduler>" in src
    assert "streamk_scheduler.hpp" not in src and not spec.self_resetting_locks
    assert spec.programmatic_launch   # the producer waits for the previous grid (the collective's load)
    # the split-K kernel: the same mainloop on the stream-K scheduler with self-resetting locks
    split = Fp8GemmSpec(act, wt, 128, 128, 128, scheduler=Scheduler.STREAMK)
    assert split.name == f"mixgemm_f8gemm_{act.value}_{wt.value}_t128x128x128_streamk_s0" and parse_name(split.name) == split
    split_src = render(split)
    assert "mixgemm::StreamKSelfResetting>" in split_src and '#include "mixgemm/streamk_scheduler.hpp"' in split_src
    code = [line for line in split_src.replace(split.name, spec.name).replace(
        "mixgemm::StreamKSelfResetting>", "cutlass::gemm::PersistentScheduler>").replace(
        '\n#include "mixgemm/streamk_scheduler.hpp"', "").splitlines() if not line.startswith("//")]
    assert split.self_resetting_locks and code == [line for line in src.splitlines() if not line.startswith("//")]
    assert f"mixgemm::epilogue::PerRowBiasAct<{half}, float, void, float>" in src
    assert f"static_assert(mixgemm::uses_prepacked_fp8_mainloop_v<{spec.name}_op>" in src
    assert src.rstrip().endswith(f"MIXGEMM_FP8_GEMM_ENTRY({spec.name}, {spec.name}_op)")
    assert spec.schedule is Schedule.COOPERATIVE and spec.scheduler is Scheduler.PERSISTENT
    assert spec.epilogue is Epilogue.BIAS_ACT and spec.fixed_activation is None
    assert "StageCount<3>" in render(Fp8GemmSpec(act, wt, stages=3))


@pytest.mark.parametrize("kw,match", [
    (dict(weight=WeightType.S8), "s4, u4, s2, u2"),
    (dict(weight=WeightType.U8), "s4, u4, s2, u2"),
    (dict(tile_m=64), "tile_m"),
    (dict(tile_n=12), "tile_n"),
    (dict(tile_k=32), "tile_k"),
    (dict(stages=1), "stages"),
])
def test_invalid_fp8_specs(kw, match):
    args = dict(act=ActType.BF16, weight=WeightType.U4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        Fp8GemmSpec(**args)


def test_quantizer_spec_name_and_source():
    for act in ActType:
        spec = QuantFp8Spec(act)
        assert parse_name(spec.name) == spec and spec.name == f"mixgemm_quant_fp8_{act.value}"
        assert not isinstance(spec, HELPER_KINDS)
        src = render(spec)
        assert '#include "mixgemm/quant_fp8_kernel.hpp"' in src and f"MIXGEMM_QUANT_FP8_ENTRY({spec.name}, " in src
    assert fp8.quant_spec(torch.float16) == QuantFp8Spec(ActType.FP16)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def _packed(bits=4, symmetric=False, group=64, n=32, k=128, dtype=torch.bfloat16):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    return mixgemm.prepack(mixgemm.quantize(w, bits, group, symmetric=symmetric, dtype=dtype))


def _with_offsets(w):
    return dataclasses.replace(w, zero_offsets=torch.zeros(w.scales.shape, dtype=torch.float32))


@pytest.fixture
def on_gpu(monkeypatch):
    """The CPU passes for an sm_90 device (the checks after the device's are reached)."""
    monkeypatch.setattr(mixgemm.dispatch.checks, "device_problem", lambda device: None)


@pytest.mark.parametrize("case,weight,kw,exc,message", [
    ("an s8 weight", lambda: _packed(8, True), {}, ValueError,
     "act_format='fp8' takes u4, s4, u2 and s2 weights (their codes, minus integer zero points, are exact in e4m3); "
     "w is s8: use act_format='bf16'"),
    ("a u8 weight", lambda: _packed(8, False), {}, ValueError,
     "act_format='fp8' takes u4, s4, u2 and s2 weights (their codes, minus integer zero points, are exact in e4m3); "
     "w is u8: use act_format='bf16'"),
    ("fractional zero points", lambda: _with_offsets(_packed()), {}, ValueError,
     "act_format='fp8' needs integer zero points; w has fractional ones (zero_offsets): use act_format='bf16'"),
    ("act_format='e4m3'", lambda: _packed(), dict(act_format="e4m3"), ValueError,
     "act_format must be one of ('bf16', 'fp8', 'auto'), got 'e4m3'"),
    ("a bf16 input_scale", lambda: _packed(), dict(input_scale=torch.tensor(1.0).bfloat16()), ValueError,
     "input_scale must be a float32 tensor of one element (shape [] or [1]), got a torch.bfloat16 tensor of "
     "shape [] (convert it with .float())"),
    ("act_format='bf16' with an input_scale", lambda: _packed(),
     dict(act_format="bf16", input_scale=torch.tensor(1.0)), ValueError,
     "input_scale is the static scale of act_format='fp8'; act_format='bf16' uses x exactly and takes none"),
])
def test_gemm_fp8_refuses(on_gpu, case, weight, kw, exc, message, pin_case):
    w = weight()
    x = torch.randn(2, 128).to(torch.bfloat16)
    kw = {"act_format": "fp8", **kw}
    with pytest.raises(exc) as excinfo:
        mixgemm.gemm(x, w, **kw)
    assert str(excinfo.value).splitlines()[0] == message
    if "activation" not in kw and "input_scale" not in kw:
        ok, why = mixgemm.supports(tuple(x.shape), w, x.dtype, act_format=kw["act_format"])
        assert not ok and why == message
    pin_case("API", f"gemm(act_format='fp8') with {case}", "mixgemm.gemm(x, w, act_format='fp8')",
             type(excinfo.value).__name__, message)


def test_supports_fp8(on_gpu):
    for bits, sym in ((4, False), (4, True), (2, False), (2, True)):
        assert mixgemm.supports((3, 128), _packed(bits, sym), torch.bfloat16, act_format="fp8") == (True, "")
    # the bf16 path keeps every weight
    assert mixgemm.supports((3, 128), _packed(8, True), torch.bfloat16) == (True, "")


def test_gemm_fp8_on_cpu_names_the_device():
    with pytest.raises(ValueError, match="mixgemm kernels run on CUDA tensors"):
        mixgemm.gemm(torch.randn(2, 128).bfloat16(), _packed(), act_format="fp8")


# ---------------------------------------------------------------------------------------------
# The launches, on a faked GPU
# ---------------------------------------------------------------------------------------------
pytest_fake = pytest.mark.skipif(fake_driver.compiler() is None or fake_driver.real_driver_present(),
                                 reason="needs a C compiler for the fake CUDA driver, and no real one")


class _Fp8Helper:
    """An e4m3 GEMM kernel's helper that records the arguments it was given and returns them as
    the params (no compiler needed)."""

    def __init__(self, spec):
        self.name = spec.name
        self.params_size = ctypes.sizeof(driver.Fp8GemmArgs)
        self.smem_size = 200 * 1024
        self.given = []

    def memory_fp8(self, args):
        """A split launch's workspace and lock bytes; a whole-tile kernel is never asked."""
        assert "_streamk" in self.name, f"{self.name} launches whole tiles: no workspace to ask for"
        return 4096 * args.gemm.splits, 64

    def prepare_fp8(self, args):
        self.given.append(driver.Fp8GemmArgs.from_buffer_copy(args))
        launch = driver.Launch()
        launch.grid[:] = (132, 1, 1)
        launch.block[:] = (384, 1, 1)
        launch.cluster[:] = (1, 1, 1)
        launch.smem_bytes = self.smem_size
        launch.params_bytes = self.params_size
        buf = ctypes.create_string_buffer(bytes(args), self.params_size)
        return buf, launch


@pytest_fake
def test_quantizer_launch_on_a_faked_gpu(tmp_path):
    """One CTA of 128 threads per token; the arguments: x, xq, scales, row strides in 16-byte
    vectors, K / 32; a row stride that is not whole vectors is copied first."""
    x = torch.randn(2, 3, 4096).to(torch.bfloat16)
    wide = torch.randn(3, 4100).to(torch.float16)
    with FakeGpu(tmp_path) as gpu:
        gpu.driver.reset(params_size=8)
        xq, s = mixgemm.ops.quantize_fp8(x)
        mixgemm.ops.quantize_fp8(wide[:, :4064])          # row stride 8200 bytes: copied
        mixgemm.ops.quantize_fp8(x[0, :, :4064])          # row stride 8192 bytes: read in place
        launches = gpu.launches()
    assert len(launches) == 3
    L = launches[0]
    assert L["function"] == function_handle(QuantFp8Spec(ActType.BF16))
    # programmatic dependent launch: the kernel waits for the previous grid before any global access
    assert L["grid"] == (6, 1, 1) and L["block"] == (128, 1, 1) and L["smem"] == 0 and L["pdl"] == 1
    assert struct.unpack("=Q", L["params"])[0] == x.data_ptr()
    assert xq.shape == x.shape and xq.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    assert launches[1]["function"] == function_handle(QuantFp8Spec(ActType.FP16))
    assert struct.unpack("=Q", launches[1]["params"])[0] != wide.data_ptr()
    assert struct.unpack("=Q", launches[2]["params"])[0] == x.data_ptr() and launches[2]["grid"] == (3, 1, 1)


class _RecordingLaunch:
    """A plain launch that records its arguments (what the quantizer kernel would be given)."""

    def __init__(self):
        self.calls = []

    def __call__(self, grid, stream, *args):
        self.calls.append((grid, args))


@pytest.fixture
def recorded_quantizer(on_gpu, monkeypatch):
    """The quantizer's launches, recorded instead of made (the CPU passes for an sm_90 device)."""
    rec = _RecordingLaunch()
    monkeypatch.setattr(fp8.loader.KERNELS, "plain_launch", lambda spec, device, types, block: rec)
    monkeypatch.setattr(fp8.driver, "current_stream", lambda index: 0)
    return rec


def test_quantizer_arguments_with_and_without_a_static_scale(recorded_quantizer):
    """The kernel's arguments: x, xq, scales, the static scale's address (0 without one), the row
    strides in 16-byte vectors and K / 32; one CTA per token either way."""
    x = torch.randn(4, 256).to(torch.bfloat16)
    scale = torch.tensor([0.25])
    mixgemm.ops.quantize_fp8(x)
    xq, s = mixgemm.ops.quantize_fp8(x, scale)
    (g0, a0), (g1, a1) = recorded_quantizer.calls
    assert g0 == g1 == 4 and len(a0) == len(fp8._ARG_TYPES) == 7
    assert a0[0] == x.data_ptr() and a0[3] == 0 and a0[4:] == (256 // 8, 256 // 16, 256 // 32)
    assert a1[0] == x.data_ptr() and a1[1] == xq.data_ptr() and a1[2] == s.data_ptr() and a1[3] == scale.data_ptr()
    assert xq.shape == (4, 256) and s.shape == (4,)


@pytest_fake
@pytest.mark.parametrize("wt", [WeightType.U4, WeightType.S2], ids=lambda w: w.value)
def test_gemm_launches_on_a_faked_gpu(tmp_path, wt):
    """act_format='fp8': the quantizer, then the e4m3 GEMM with its arguments (xq as x, its row
    stride K bytes, the token scales, the weight's tensors, bias, y, the activation)."""
    w = _packed(wt.bits, wt.signed, group=32, n=64, k=256)
    x = torch.randn(5, 256).to(torch.bfloat16)
    bias = torch.randn(64).to(torch.bfloat16)
    helpers = {}

    def helper(spec):
        helpers[spec.name] = _Fp8Helper(spec)
        return helpers[spec.name]

    with FakeGpu(tmp_path, helpers=helper) as gpu:
        gpu.driver.reset(params_size=ctypes.sizeof(driver.Fp8GemmArgs))
        y = mixgemm.gemm(x, w, bias=bias, activation="gelu", act_format="fp8")
        launches = gpu.launches()
        xq, xs = fp8.quantize_fp8(x)
        fp8.gemm_quantized(xq, xs, w, splits=1)
        spec = Fp8GemmSpec(ActType.BF16, wt, 128, 32, 128)   # 5 tokens: the narrowest token tile
        split_spec = fp8.fp8_gemm_spec(ActType.BF16, wt, None, 32, splits=3)
        fp8.gemm_quantized(xq, xs, w, spec=split_spec, splits=3)
        with pytest.raises(ValueError, match="launches whole output tiles; splits=3 takes the stream-K kernel"):
            fp8.gemm_quantized(xq, xs, w, spec=spec, splits=3)
        with pytest.raises(ValueError, match="splits must be an int from 1 to 8"):
            fp8.gemm_quantized(xq, xs, w, splits=9)
        with pytest.raises(ValueError, match="splits must be an int"):
            fp8.gemm_quantized(xq, xs, w, splits=True)
    assert [L["function"] for L in launches] == [function_handle(QuantFp8Spec(ActType.BF16)), function_handle(spec)]
    a, whole = helpers[spec.name].given                                          # K = 256: two k-tiles, no split
    (split,) = helpers[split_spec.name].given
    assert (a.gemm.splits, whole.gemm.splits, split.gemm.splits) == (1, 1, 3)
    assert a.gemm.workspace == a.gemm.locks == whole.gemm.workspace == whole.gemm.locks == 0
    assert split.gemm.workspace != 0 and split.gemm.locks != 0                   # the stream's buffers
    g = a.gemm
    assert (g.abi_version, g.m, g.n, g.k, g.group_size) == (driver.ABI_VERSION, 5, 64, 256, 32)
    assert g.ldx == 256 and g.ldy == 64 and g.y == y.data_ptr() and g.bias == bias.data_ptr()
    assert g.weight == w.qdata.data_ptr() and g.scales == w.scales.data_ptr()
    assert g.zeros == (0 if w.zeros is None else w.zeros.data_ptr())
    assert g.activation == 2 and a.x_scales != 0 and g.x != x.data_ptr()
    gemm_launch = launches[1]
    assert gemm_launch["block"] == (384, 1, 1) and gemm_launch["smem"] == 200 * 1024 and gemm_launch["pdl"] == 1
    assert driver.Fp8GemmArgs.from_buffer_copy(gemm_launch["params"]).x_scales == a.x_scales
    assert y.shape == (5, 64) and y.dtype == torch.bfloat16


def test_gemm_hands_the_static_scale_to_the_quantizer(recorded_quantizer, monkeypatch):
    """gemm(..., act_format='fp8', input_scale=s): the quantizer is given s's address, and the
    GEMM the token scales it writes (s repeated), as for per-token scales."""
    w = _packed(4, False, group=32, n=64, k=256)
    x = torch.randn(5, 256).to(torch.bfloat16)
    scale = torch.tensor(0.5)
    given = []
    monkeypatch.setattr(fp8, "_launch_gemm", lambda spec, splits, w, xq, xs, bias, y, act: given.append((xq, xs)))
    mixgemm.gemm(x, w, act_format="fp8", input_scale=scale)
    ((_, args),) = recorded_quantizer.calls
    ((xq, xs),) = given
    assert args[3] == scale.data_ptr() and args[2] == xs.data_ptr() and args[1] == xq.data_ptr()
    assert xs.shape == (5,) and xq.shape == (5, 256)


@pytest.mark.parametrize("call,exc,msg", [
    (lambda w, q, s: fp8.gemm_quantized(q.float(), s, w), TypeError, "float8_e4m3fn"),
    (lambda w, q, s: fp8.gemm_quantized(q[:, :64], s, w), ValueError, "contiguous"),
    (lambda w, q, s: fp8.gemm_quantized(q, s[:2], w), ValueError, "x_scales must be"),
    (lambda w, q, s: fp8.gemm_quantized(q, s.double(), w), ValueError, "x_scales must be"),
    (lambda w, q, s: fp8.gemm_quantized(q, s, w, activation="relu"), ValueError, "not 'relu'"),
    (lambda w, q, s: fp8.gemm_quantized(q, s, w, activation="swiglu", out=torch.empty(3, 32).bfloat16()), ValueError,
     r"out must be .* shape \[3, 16\]"),
    (lambda w, q, s: fp8.gemm_quantized(q, s, w, spec=fp8.select_fp8_spec(1, w, "swiglu")), ValueError,
     "computes swiglu, the call asks for none"),
    (lambda w, q, s: fp8.gemm_quantized(q, s, w, activation="swiglu", spec=fp8.select_fp8_spec(1, w)), ValueError,
     "the call asks for swiglu"),
    (lambda w, q, s: fp8.gemm_quantized(q, s, w, bias=torch.zeros(31).bfloat16()), ValueError, "bias must be"),
    (lambda w, q, s: fp8.gemm_quantized(q, s, w, out=torch.empty(3, 32)), ValueError, "out must be"),
    (lambda w, q, s: fp8.gemm_quantized(q, s, _packed(8, True)), ValueError, "w is s8"),
    (lambda w, q, s: fp8.gemm_quantized(q, s, w, spec=Fp8GemmSpec(ActType.FP16, WeightType.U4)), ValueError,
     "is for fp16 x u4"),
])
def test_gemm_quantized_refuses(on_gpu, call, exc, msg):
    w = _packed()
    q, s = fp8.quantize_fp8_reference(torch.randn(3, 128).bfloat16())
    with pytest.raises(exc, match=msg):
        call(w, q, s)


def test_swiglu_takes_the_gated_e4m3_kernel():
    """activation="swiglu" selects the e4m3 GEMM with the gated epilogue (N/2 outputs), in the
    catalogue beside the bias + activation one for every type (test_gemm_quantized_refuses: a
    kernel whose epilogue is not the call's is refused)."""
    from mixgemm.jit.catalog import fp8_specs
    from mixgemm.jit.specs import Epilogue, Fp8GemmSpec, parse_name
    from mixgemm.ops.fp8 import select_fp8_spec

    w = _packed()
    gated, plain = select_fp8_spec(1, w, "swiglu"), select_fp8_spec(1, w, "silu")
    assert gated.epilogue is Epilogue.SWIGLU and gated.name.endswith("_swiglu_s0") and parse_name(gated.name) == gated
    assert plain.epilogue is Epilogue.BIAS_ACT and plain == select_fp8_spec(1, w)
    specs = [s for s in fp8_specs() if isinstance(s, Fp8GemmSpec)]
    assert {(s.act, s.weight) for s in specs if s.epilogue is Epilogue.SWIGLU} == \
        {(s.act, s.weight) for s in specs if s.epilogue is Epilogue.BIAS_ACT}


def test_fp8_gemm_specs_are_the_kernels_select_fp8_spec_picks():
    """The kernel list without a weight (a benchmark's prebuild) names every kernel the calls
    launch, at any token count and SM count, and nothing they never launch."""
    for wt in ("u4", "s4", "u2", "s2"):
        # (the fields select_fp8_launch reads, of LLaMA-3-8B's layer shapes and a small one)
        weights = [types.SimpleNamespace(n=n, k=k, act_type=ActType.BF16, weight_type=WeightType(wt))
                   for n, k in ((128, 4096), (4096, 4096), (4096, 14336), (28672, 4096))]
        for activation in (None, "silu", "swiglu"):
            listed = fp8.fp8_gemm_specs(ActType.BF16, WeightType(wt), activation)
            picked = {fp8.select_fp8_spec(m, w, activation, sms) for m in (1, 40, 70, 130, 300, 5000)
                      for sms in (1, 2, 132) for w in weights}
            assert picked == set(listed)
            assert fp8.fp8_gemm_spec(ActType.BF16, WeightType(wt), activation) == listed[0]   # the widest
    with pytest.raises(ValueError, match="e4m3"):
        fp8.fp8_gemm_spec(ActType.BF16, WeightType.S8)


def _launch_cost_terms(m, n, k, sms, tile_n, splits):
    """(waves, k-tiles one after another per wave) of a launch, as the scheduler runs it."""
    tiles = -(-n // 128) * -(-m // tile_n) * splits
    return -(-tiles // sms), -(-(-(-k // 128)) // splits)


def test_the_e4m3_launch_splits_only_where_whole_tiles_leave_sms_idle():
    """fp8_launch splits the k-loop where whole output tiles leave most SMs idle (few tokens on few
    weight rows), never where whole tiles fill every wave, and its choice never runs more
    k-tiles one after another on an SM than the whole-tile launch of the same tile."""
    for sms in (78, 114, 132, 264):
        for n, k in ((1024, 4096), (4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096), (57344, 8192)):
            for m in (1, 16, 64, 100, 128, 256, 1000, 4096, 16384):
                tile_n, splits = heuristic.fp8_launch(m, n, k, sms)
                assert tile_n in FP8_TOKEN_TILES and 1 <= splits <= heuristic.FP8_MAX_SPLITS
                assert splits == 1 or -(-k // 128) >= 2 * splits               # at least two k-tiles a split
                waves, ktiles = _launch_cost_terms(m, n, k, sms, tile_n, splits)
                whole = _launch_cost_terms(m, n, k, sms, tile_n, 1)
                assert waves * ktiles <= whole[0] * whole[1], (n, k, m, sms)
                tiles = -(-n // 128) * -(-m // tile_n)
                if tiles % sms == 0:                                  # whole tiles fill every wave
                    assert splits == 1, (n, k, m, sms, tile_n, splits)
            # one row tile of 128 tokens per 128 rows: a quarter of the SMs or fewer busy unsplit
            if -(-n // 128) * 4 <= sms:
                assert heuristic.fp8_launch(16, n, k, sms)[1] > 1, (n, k, sms)
    assert heuristic.fp8_launch(16, 4096, 4096, 132, (64,))[0] == 64          # the tile given


def _measured_launches():
    """{(weight, kernel, n, k, m): {(tile_n, splits): us}} of the committed H200 sweep
    (``tools/fp8_check.py --tiles --splits 1,2,3,4,6,8``: the e4m3 GEMM alone, CUDA graphs)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks/results/nvidia-h200/fp8-splits.json"
    points: dict = {}
    for r in json.loads(path.read_text())["rows"]:
        name = r["impl"]
        if "@t" in name:
            tile_n, splits = name.split("@t")[1].split("s")
            key = (name.split("-")[1], "swiglu" if "swiglu" in name else "gemm", r["n"], r["k"], r["m"])
            points.setdefault(key, {})[(int(tile_n), int(splits))] = r["us"]
    return points


def test_the_e4m3_launch_is_the_fastest_measured_within_7_percent():
    """On an H200 (132 SMs), at each of the 70 measured points (LLaMA-3-8B's q/k/v, o, gate/up
    and down shapes and the gated gate/up kernel, u4 and u2, M = 16 to 4096), the token tile and
    split that fp8_launch picks ran within 7% of the fastest of every tile x 1 to 8 splits (whole
    tiles on the persistent kernel, splits on the stream-K one; the worst: 6.2%, u2 6144x4096 at
    M = 16 split in 2 where whole 32-token tiles were faster)."""
    points = _measured_launches()
    assert len(points) == 70
    for (wt, kernel, n, k, m), times in points.items():
        assert len(times) == 18
        picked = heuristic.fp8_launch(m, n, k, 132)
        assert min(times.values()) >= 0.93 * times[picked], (wt, kernel, n, k, m, picked, min(times, key=times.get))


def test_the_e4m3_launch_weighs_waves_against_the_time_per_tile():
    """Unsplit, a narrower token tile costs less per tile and makes more tiles: it is taken where it
    adds no wave, never where it adds one."""
    for sms in (78, 114, 132, 264):
        for n in (128, 1024, 4096, 6144, 14336, 28672, 57344):
            row_tiles = -(-n // 128)
            waves = {t: -(-row_tiles * -(-100 // t) // sms) for t in FP8_TOKEN_TILES}
            t, splits = heuristic.fp8_launch(100, n, 256, sms)     # two k-tiles: no splits
            assert splits == 1
            assert waves[t] <= waves[128], (n, sms)    # never more waves than the widest tile
            if waves[32] == waves[128]:
                assert t == 32, (n, sms)               # as many waves: the cheapest tile
            elif waves[32] >= 2 * waves[128]:
                assert t != 32, (n, sms)               # twice the waves never pay
            assert heuristic.fp8_launch(16, n, 256, sms)[0] == 32   # one token tile in any case


def test_select_fp8_spec_takes_the_token_tile_and_every_tile_is_built():
    w = _packed(4, False, group=32, n=64, k=256)
    assert fp8.select_fp8_spec(5, w).tile_n == 32 and fp8.select_fp8_spec(5000, w, sm_count=2).tile_n == 128
    assert fp8.select_fp8_launch(5000, w, sm_count=2) == (fp8.select_fp8_spec(5000, w, sm_count=2), 1)
    assert fp8.select_fp8_spec(300, w, "swiglu", sm_count=2).epilogue is Epilogue.SWIGLU
    names = {s.name for s in fp8.fp8_gemm_specs(ActType.BF16, WeightType.U4, "swiglu")}
    for m in (1, 50, 100, 200, 400, 5000):
        for sms in (2, 132):
            assert fp8.select_fp8_spec(m, w, "swiglu", sm_count=sms).name in names
