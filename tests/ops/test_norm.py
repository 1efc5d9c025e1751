"""mixgemm.rms_norm: the RMSNorm kernel's specs and C++, its torch path and argument checks on the
CPU, the custom ops (fake implementations checked by torch.library.opcheck), the eager calls'
route to the operators once the torch operator library holds the kernel (its C++ kernel stood in
for on the CPU), the launch on a faked GPU, the kernels built with nvcc, and on an sm_90 GPU the
kernel against a float64 reference and torch's F.rms_norm over odd row lengths, row counts and
both dtypes, eagerly and in a CUDA graph."""
from __future__ import annotations

import struct

import pytest
import torch
import torch.nn.functional as F

import fake_driver
from fake_gpu import FakeGpu, function_handle
from stand_in_ops import cpu_stand_in

import mixgemm
from mixgemm.dispatch import plans
from mixgemm.jit import catalog
from mixgemm.jit import env as paths
from mixgemm.ops import norm
from mixgemm.jit.catalog import default_specs
from mixgemm.jit.render import render
from mixgemm.jit.specs import HELPER_KINDS, NormSpec, parse_name
from mixgemm.dtypes import ActType


def reference(x, weight, eps, residual=None):
    """float64 RMSNorm of x (+ residual rounded to x's dtype, as the add in the model is)."""
    s = x if residual is None else (x + residual)
    s64 = s.double()
    y = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return y, s


# ---------------------------------------------------------------------------------------------- specs
def test_specs_name_every_field_and_parse_back():
    specs = catalog.norm_specs()
    assert [s.name for s in specs] == ["mixgemm_rmsnorm_bf16", "mixgemm_add_rmsnorm_bf16",
                                       "mixgemm_rmsnorm_fp16", "mixgemm_add_rmsnorm_fp16"]
    for s in specs:
        assert parse_name(s.name) == s
        assert s.programmatic_launch and not isinstance(s, HELPER_KINDS)
    assert set(specs) <= set(default_specs())
    assert norm.norm_spec(torch.float16, True) == NormSpec(ActType.FP16, True)
    with pytest.raises(ValueError, match="not a mixgemm kernel name"):
        parse_name("mixgemm_add_rmsnorm_fp32")


def test_render_instantiates_one_kernel():
    src = render(NormSpec(ActType.BF16, True))
    assert '#include "mixgemm/norm_kernel.hpp"' in src and src.count("MIXGEMM_RMS_NORM_ENTRY(") == 1
    assert "MIXGEMM_RMS_NORM_ENTRY(mixgemm_add_rmsnorm_bf16, cutlass::bfloat16_t, true)" in src
    assert "MIXGEMM_RMS_NORM_ENTRY(mixgemm_rmsnorm_fp16, cutlass::half_t, false)" in render(
        NormSpec(ActType.FP16, False))


def test_header_threads_match_python():
    text = (paths.cutlass_ext_dir() / "mixgemm" / "norm_kernel.hpp").read_text()
    assert f"kNormThreads = {norm._THREADS};" in text


def test_generate_lists_them(capsys):
    from mixgemm.cli.main import main

    assert main(["generate", "--list", "--kernels", "rmsnorm"]) == 0
    assert capsys.readouterr().out.split() == [s.name for s in catalog.norm_specs()]


# ---------------------------------------------------------------------------------------------- torch path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 5, 136), (7, 24)])
def test_cpu_path_is_the_add_and_torch_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    y = mixgemm.rms_norm(x, w, 1e-5)
    assert torch.equal(y, F.rms_norm(x, (shape[-1],), w, 1e-5))
    y2, s = mixgemm.rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(s, x + r) and torch.equal(y2, F.rms_norm(x + r, (shape[-1],), w, 1e-5))
    want, _ = reference(x, w, 1e-5, r)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(y2.double(), want, rtol=tol, atol=tol)


def test_inputs_are_not_modified():
    x, r, w = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16(), torch.ones(64).bfloat16()
    x0, r0 = x.clone(), r.clone()
    mixgemm.rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(x, x0) and torch.equal(r, r0)


BAD_CALLS = [   # (call, exception, message, whether the eager route hands it to the operators)
    (lambda x, w, r: mixgemm.rms_norm(x.int(), w), TypeError, "floating-point tensor", True),
    (lambda x, w, r: mixgemm.rms_norm("x", w), TypeError, "floating-point tensor", False),
    (lambda x, w, r: mixgemm.rms_norm(x, w[:-1]), ValueError, "1-D tensor of H=64", True),
    (lambda x, w, r: mixgemm.rms_norm(x, w.float()), ValueError, "x's dtype and device", True),
    (lambda x, w, r: mixgemm.rms_norm(x, w, -1.0), ValueError, "eps must be", True),
    (lambda x, w, r: mixgemm.rms_norm(x, w, float("nan")), ValueError, "eps must be", True),
    (lambda x, w, r: mixgemm.rms_norm(x, w, True), ValueError, "eps must be", False),
    (lambda x, w, r: mixgemm.rms_norm(x, w, residual=r[:1]), ValueError, "residual must be a tensor of x's shape",
     True),
    (lambda x, w, r: mixgemm.rms_norm(x, w, residual=r.half()), ValueError, "residual must have x's dtype", True),
]


@pytest.mark.parametrize("call,exc,msg,routed", BAD_CALLS)
def test_bad_arguments_are_refused(call, exc, msg, routed):
    x, r, w = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16(), torch.ones(64).bfloat16()
    with pytest.raises(exc, match=msg):
        call(x, w, r)


def test_custom_ops_fake_implementations():
    x, r, w = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16(), torch.rand(64).bfloat16()
    torch.library.opcheck(torch.ops.mixgemm.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.mixgemm.add_rms_norm.default, (x, r, w, 1e-6))
    y, s = torch.ops.mixgemm.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(y, F.rms_norm(x + r, (64,), w, 1e-6))


# ---------------------------------------------------------------------------------------------- the eager route
@pytest.fixture
def held(monkeypatch):
    """The torch operator library "holds" every norm kernel, and the C++ kernels of
    ``mixgemm::rms_norm`` / ``add_rms_norm`` are stood in for on the CPU (each call recorded, and
    run by the ``_py`` operator, as the C++ kernel runs a call it cannot take): the calls made
    in the test, by operator."""
    monkeypatch.setattr(plans.OPERATORS, "holds_norm", lambda x, residual: True)
    with cpu_stand_in("rms_norm") as plain, cpu_stand_in("add_rms_norm") as added:
        yield {"rms_norm": plain, "add_rms_norm": added}


def _ids(args: tuple) -> tuple:
    """A call's arguments, each tensor by its identity."""
    return tuple(id(a) if isinstance(a, torch.Tensor) else a for a in args)


def test_eager_calls_go_to_the_operators_once_the_kernel_is_held(held):
    """Plain tensors and a float eps go to torch.ops.mixgemm.rms_norm / add_rms_norm with the
    call's own tensors, and give what the Python path gives."""
    x, r = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    w = torch.nn.Parameter(torch.rand(64).bfloat16() + 0.5, requires_grad=False)   # (a module's weight)
    y = mixgemm.rms_norm(x, w, 1e-5)
    y2, s = mixgemm.rms_norm(x, w, 1e-5, residual=r)
    assert [_ids(c) for c in held["rms_norm"]] == [(id(x), id(w), 1e-5)]
    assert [_ids(c) for c in held["add_rms_norm"]] == [(id(x), id(r), id(w), 1e-5)]
    assert torch.equal(y, F.rms_norm(x, (64,), w, 1e-5))
    assert torch.equal(s, x + r) and torch.equal(y2, F.rms_norm(x + r, (64,), w, 1e-5))


class _Sub(torch.Tensor):
    """A tensor subclass (the eager route takes plain tensors only)."""


@pytest.mark.parametrize("call,error", [
    (lambda x, w, r: mixgemm.rms_norm(x, w, 0), None),                                  # an int eps
    (lambda x, w, r: mixgemm.rms_norm(x, w.tolist()), "weight must be a 1-D tensor"),   # not a tensor
    (lambda x, w, r: mixgemm.rms_norm(x.as_subclass(_Sub), w, 1e-5), None),             # a tensor subclass
    (lambda x, w, r: mixgemm.rms_norm(x, w, 1e-5, residual=r.as_subclass(_Sub)), None),
])
def test_other_argument_types_take_the_python_path(held, call, error):
    x, r, w = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16(), torch.ones(64).bfloat16()
    if error is None:
        call(x, w, r)
    else:
        with pytest.raises(ValueError, match=error):
            call(x, w, r)
    assert held["rms_norm"] == [] and held["add_rms_norm"] == []


@pytest.mark.parametrize("call,exc,msg,routed", BAD_CALLS)
def test_bad_arguments_raise_the_same_errors_through_the_operators(held, monkeypatch, call, exc, msg, routed):
    """An invalid call that reaches an operator (every bad tensor or value of the types it
    takes) is handed to the ``_py`` operator (as the C++ kernel hands over every call it does
    not take), whose checks raise what the Python path raises: the same type and message."""
    x, r, w = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16(), torch.ones(64).bfloat16()
    with pytest.raises(exc, match=msg) as routed_error:
        call(x, w, r)
    assert len(held["rms_norm"]) + len(held["add_rms_norm"]) == int(routed)
    monkeypatch.setattr(plans.OPERATORS, "holds_norm", lambda x, residual: False)
    with pytest.raises(exc) as direct:
        call(x, w, r)
    assert type(routed_error.value) is type(direct.value) and str(routed_error.value) == str(direct.value)
    assert len(held["rms_norm"]) + len(held["add_rms_norm"]) == int(routed)


def test_cpu_calls_take_the_python_path():
    """Without a kernel held for the call's device (never for CPU tensors), nothing reaches the
    operators."""
    x, r, w = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16(), torch.ones(64).bfloat16()
    with cpu_stand_in("rms_norm") as plain, cpu_stand_in("add_rms_norm") as added:
        mixgemm.rms_norm(x, w, 1e-5)
        mixgemm.rms_norm(x, w, 1e-5, residual=r)
    assert plain == [] and added == []


# ---------------------------------------------------------------------------------------------- fake GPU
pytest_fake = pytest.mark.skipif(fake_driver.compiler() is None or fake_driver.real_driver_present(),
                                 reason="needs a C compiler for the fake CUDA driver, and no real one")


@pytest_fake
@pytest.mark.parametrize("residual", [False, True])
def test_launch_on_a_faked_gpu(tmp_path, residual):
    """On an sm_90 device (faked): one launch per call, one CTA per row of 256 threads, PDL; the
    first argument is x's rows; rows that are not 16-byte vectors take torch's ops."""
    x = torch.randn(2, 3, 4096).to(torch.bfloat16)
    r = torch.randn(2, 3, 4096).to(torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    with FakeGpu(tmp_path) as gpu:
        gpu.driver.reset(params_size=8)
        out = mixgemm.rms_norm(x, w, 1e-6, residual=r if residual else None)
        launches = gpu.launches()
        mixgemm.rms_norm(x[..., :4092], w[:4092], 1e-6)        # 4092 * 2 bytes: not whole vectors
        assert len(gpu.launches()) == 1
    assert len(launches) == 1
    L = launches[0]
    assert L["function"] == function_handle(NormSpec(ActType.BF16, residual))
    assert L["grid"] == (6, 1, 1) and L["block"] == (256, 1, 1) and L["smem"] == 0 and L["pdl"] == 1
    assert struct.unpack("=Q", L["params"])[0] == x.data_ptr()
    y = out[0] if residual else out
    assert y.shape == x.shape and y.dtype == x.dtype


# ---------------------------------------------------------------------------------------------- nvcc
@pytest.mark.nvcc
def test_the_kernels_build(tmp_path, monkeypatch):
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    from mixgemm.jit import build

    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    for spec in catalog.norm_specs():
        art = build.build(spec)
        cubin = art.read_cubin()
        assert cubin[:4] == b"\x7fELF" and spec.name.encode() in cubin
        assert art.helper_path is None


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,h", [(1, 8192), (1, 4096), (3, 3584), (16, 5120), (2, 16384), (5, 24), (1, 20480),
                                    (64, 2056)])
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_against_float64_and_torch(requires_gpu, dtype, rows, h, residual):
    from mixgemm.jit import loader as runtime

    dev = requires_gpu
    g = torch.Generator(device=dev).manual_seed(rows * h + residual)
    x = (torch.randn(rows, h, device=dev, generator=g) * 3).to(dtype)
    r = torch.randn(rows, h, device=dev, generator=g).to(dtype) if residual else None
    w = (torch.rand(h, device=dev, generator=g) + 0.5).to(dtype)
    launched = runtime.KERNELS.get(norm.norm_spec(dtype, residual), dev)
    assert launched is not None
    out = mixgemm.rms_norm(x, w, 1e-5, residual=r)
    y, s = out if residual else (out, x)
    want, want_s = reference(x, w, 1e-5, r)
    assert torch.equal(s, want_s)                                   # the add: torch's rounding exactly
    ulp = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    err = ((y.double() - want).abs() / want.abs().clamp(min=1e-3)).max().item()
    assert err <= ulp, err                                          # one rounding of the float32 value
    torch_y = F.rms_norm(want_s, (h,), w, 1e-5)
    differ = (y != torch_y).float().mean().item()
    assert differ < 0.01, differ                                    # torch's result but for the sum order
    steps = ((y.float() - torch_y.float()).abs() / torch_y.float().abs().clamp(min=1e-3)).max().item()
    assert steps <= 2 * ulp


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph(requires_gpu):
    dev = requires_gpu
    x = torch.randn(1, 8192, device=dev, dtype=torch.bfloat16)
    r = torch.randn(1, 8192, device=dev, dtype=torch.bfloat16)
    w = torch.rand(8192, device=dev, dtype=torch.bfloat16) + 0.5
    eager_y, eager_s = mixgemm.rms_norm(x, w, 1e-6, residual=r)      # loads the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, s = mixgemm.rms_norm(x, w, 1e-6, residual=r)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want_y, want_s = mixgemm.rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(s, want_s) and torch.equal(y, want_y) and not torch.equal(y, eager_y)


@pytest.mark.gpu
def test_torch_compile_traces_the_custom_op(requires_gpu):
    dev = requires_gpu
    x = torch.randn(2, 4096, device=dev, dtype=torch.bfloat16)
    r = torch.randn(2, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.rand(4096, device=dev, dtype=torch.bfloat16) + 0.5

    def f(x, r):
        y, s = mixgemm.rms_norm(x, w, 1e-6, residual=r)
        return y * 2, s

    got = torch.compile(f, fullgraph=True)(x, r)
    want = f(x, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_decode_gemm_after_the_norm_reads_its_output(requires_gpu):
    """The norm kernel lets the next kernel launch at its start, and the decode kernel requests its
    weights and scale rows before its grid wait: it must still read x only once the norm has
    written it. A chain of add + norm -> decode GEMM steps (each GEMM's input the norm's output)
    queued without synchronisation, and replayed from a CUDA graph, equals the chain run one
    kernel at a time, bit for bit."""
    import math

    dev = requires_gpu
    n = k = 4096
    g = torch.Generator(device=dev).manual_seed(5)
    w = torch.randn(n, k, device=dev, generator=g) / math.sqrt(k)
    packed = mixgemm.prepack(mixgemm.quantize(w, 4, 128, symmetric=False, dtype=torch.bfloat16))
    weight = torch.rand(k, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16) + 0.5
    x = torch.randn(1, k, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)

    def chain(sync: bool):
        h, r = x, torch.zeros_like(x)
        for _ in range(16):
            y, r = mixgemm.rms_norm(h, weight, 1e-6, residual=r)
            h = mixgemm.gemm(y, packed)
            if sync:
                torch.cuda.synchronize()
        return h, r

    one_at_a_time = chain(True)
    queued = chain(False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain(False)
    graph.replay()
    torch.cuda.synchronize()
    for got in (queued, replayed):
        assert torch.equal(got[0], one_at_a_time[0]) and torch.equal(got[1], one_at_a_time[1])
    assert one_at_a_time[0].abs().max().item() > 1e-3
