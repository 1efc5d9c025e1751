"""mixgemm.rotary_kv_cache: the rotary / KV-cache kernel's specs and C++, its torch path and
argument checks on the CPU (against a per-token loop over the models' formula), the custom op and
its Python fallback op, the eager calls' route to the operator once the torch operator library
holds the kernel (its C++ kernel stood in for on the CPU), the launch on a faked GPU, the kernels
built with nvcc, and on an sm_90 GPU the kernel equal bit for bit to the torch formula over head
layouts, batch / token counts, positions and both dtypes, eagerly, with a position tensor and in a
CUDA graph."""
from __future__ import annotations

import struct

import pytest
import torch

import fake_driver
from fake_gpu import FakeGpu, function_handle
from stand_in_ops import cpu_stand_in

import mixgemm
from mixgemm.dispatch import plans
from mixgemm.jit import catalog
from mixgemm.jit import env as paths
from mixgemm.ops import rotary
from mixgemm.jit.catalog import default_specs
from mixgemm.jit.render import render
from mixgemm.jit.specs import HELPER_KINDS, RopeSpec, parse_name
from mixgemm.dtypes import ActType


def tables(d, positions, dtype, device=None, theta=10000.0):
    """LLaMA's cos / sin tables [positions, D] (computed in float64, kept in dtype)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    ang = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def loop_reference(qkv, cos, sin, k_cache, v_cache, pos, heads, kv_heads):
    """Token by token, head by head: q, and the caches written (in place)."""
    b, t, w = qkv.shape
    d = w // (heads + 2 * kv_heads)
    half = d // 2
    q = torch.empty(b, t, heads, d, dtype=qkv.dtype, device=qkv.device)
    for i in range(b):
        for j in range(t):
            p = int(pos[i, j]) if isinstance(pos, torch.Tensor) else pos + j
            c, s = cos[p], sin[p]
            for h in range(heads + 2 * kv_heads):
                x = qkv[i, j, h * d:(h + 1) * d]
                if h < heads + kv_heads:
                    y = x * c + torch.cat((-x[half:], x[:half])) * s
                    if h < heads:
                        q[i, j, h] = y
                    else:
                        k_cache[i, h - heads, p] = y
                else:
                    v_cache[i, h - heads - kv_heads, p] = x
    return q


def inputs(b, t, heads, kv_heads, d, length, dtype, device=None, batch_cache=None, seed=0):
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=g, device=device).to(dtype)
    cos, sin = tables(d, length + 3, dtype, device)
    shape = (batch_cache or b, kv_heads, length, d)
    k_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=g, device=device).to(dtype)
    return qkv, cos, sin, k_cache, v_cache


# ---------------------------------------------------------------------------------------------- specs
def test_specs_name_every_field_and_parse_back():
    specs = catalog.rope_specs()
    assert [s.name for s in specs] == ["mixgemm_rope_kv_bf16", "mixgemm_rope_kv_fp16"]
    for s in specs:
        assert parse_name(s.name) == s
        assert s.programmatic_launch and not isinstance(s, HELPER_KINDS)
    assert set(specs) <= set(default_specs())
    assert rotary.rope_spec(torch.float16) == RopeSpec(ActType.FP16)
    with pytest.raises(ValueError, match="not a mixgemm kernel name"):
        parse_name("mixgemm_rope_kv_fp32")


def test_render_instantiates_one_kernel():
    src = render(RopeSpec(ActType.BF16))
    assert '#include "mixgemm/rope_kernel.hpp"' in src and src.count("MIXGEMM_ROPE_KV_ENTRY(") == 1
    assert "MIXGEMM_ROPE_KV_ENTRY(mixgemm_rope_kv_bf16, cutlass::bfloat16_t)" in src


def test_header_matches_python():
    text = (paths.cutlass_ext_dir() / "mixgemm" / "rope_kernel.hpp").read_text()
    assert f"kRopeThreads = {rotary._THREADS};" in text
    entry = text[text.index("#define MIXGEMM_ROPE_KV_ENTRY"):]
    entry = entry[entry.index("  NAME(") + 7:]
    args = entry[:entry.index(")")]
    assert len(args.split(",")) == len(rotary._ARG_TYPES)


# ---------------------------------------------------------------------------------------------- torch path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,t,heads,kv_heads,d", [(1, 1, 4, 2, 16), (2, 3, 6, 2, 8), (3, 2, 4, 4, 12)])
def test_cpu_path_is_the_models_formula(dtype, b, t, heads, kv_heads, d):
    qkv, cos, sin, kc, vc = inputs(b, t, heads, kv_heads, d, 20, dtype, batch_cache=b + 1, seed=b * t + d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qkv0 = qkv.clone()
    want = loop_reference(qkv, cos, sin, kc_ref, vc_ref, 7, heads, kv_heads)
    got = mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, 7, heads, kv_heads)
    assert got.shape == (b, t, heads, d) and got.is_contiguous()
    assert torch.equal(got, want) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert torch.equal(qkv, qkv0)
    # a position per token
    pos = torch.randint(0, 20, (b, t), generator=torch.Generator().manual_seed(d))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = loop_reference(qkv, cos, sin, kc_ref, vc_ref, pos, heads, kv_heads)
    got = mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, pos.int(), heads, kv_heads)
    assert torch.equal(got, want) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_decoder_layer_math_is_unchanged():
    """The bench decoder's rotary (Rotary, the models' formula) is what the op computes."""
    from mixgemm.bench.decoder import Rotary

    qkv, _, _, kc, vc = inputs(2, 3, 8, 2, 32, 64, torch.bfloat16)
    rot = Rotary(32, 10000.0, 64, torch.bfloat16)
    q = mixgemm.rotary_kv_cache(qkv, rot.cos, rot.sin, kc, vc, 5, 8, 2)
    qq, kk, vv = qkv.view(2, 3, 12, 32).split((8, 2, 2), dim=2)
    assert torch.equal(q, rot(qq, 5))
    assert torch.equal(kc[:, :, 5:8], rot(kk, 5).transpose(1, 2)) and torch.equal(vc[:, :, 5:8], vv.transpose(1, 2))


def _args():
    return inputs(2, 1, 4, 2, 16, 10, torch.bfloat16)


BAD_CALLS = [   # (call, exception, message, whether the eager route hands it to the operator)
    (lambda a: mixgemm.rotary_kv_cache(a[0][0], *a[1:], 0, 4, 2), TypeError, "qkv must be", True),
    (lambda a: mixgemm.rotary_kv_cache(a[0].int(), *a[1:], 0, 4, 2), TypeError, "qkv must be", True),
    (lambda a: mixgemm.rotary_kv_cache(*a, 0, 4, 3), ValueError, "multiple of kv_heads", True),
    (lambda a: mixgemm.rotary_kv_cache(*a, 0, 5, 1), ValueError, "is not .* heads of an even head size", True),
    (lambda a: mixgemm.rotary_kv_cache(*a, 0, 0, 2), ValueError, "heads must be a positive int", False),
    (lambda a: mixgemm.rotary_kv_cache(a[0], a[1][:, :8], *a[2:], 0, 4, 2), ValueError, r"cos must be a table", True),
    (lambda a: mixgemm.rotary_kv_cache(a[0], a[1], a[2].half(), *a[3:], 0, 4, 2), ValueError, "sin must have", True),
    (lambda a: mixgemm.rotary_kv_cache(*a[:2], a[2][:5], *a[3:], 0, 4, 2), ValueError, "one shape", True),
    (lambda a: mixgemm.rotary_kv_cache(*a[:3], a[3][:1], a[4], 0, 4, 2), ValueError, r"k_cache must be \[batch >= 2",
     True),
    (lambda a: mixgemm.rotary_kv_cache(*a[:4], a[4][:, :, :5], 0, 4, 2), ValueError, "one shape", True),
    (lambda a: mixgemm.rotary_kv_cache(*a[:4], a[4].half(), 0, 4, 2), ValueError, "v_cache must have", True),
    (lambda a: mixgemm.rotary_kv_cache(*a, 10, 4, 2), ValueError, "outside the 10 positions", True),
    (lambda a: mixgemm.rotary_kv_cache(*a, -1, 4, 2), ValueError, "outside", False),
    (lambda a: mixgemm.rotary_kv_cache(*a, 1.0, 4, 2), TypeError, "positions must be an int", False),
    (lambda a: mixgemm.rotary_kv_cache(*a, torch.zeros(2, 2, dtype=torch.int64), 4, 2), ValueError,
     r"positions must be an int32 / int64 tensor \[B=2, T=1\]", True),
    (lambda a: mixgemm.rotary_kv_cache(*a, torch.zeros(2, 1), 4, 2), ValueError, "positions must be", True),
    (lambda a: mixgemm.rotary_kv_cache(*a, torch.full((2, 1), 10), 4, 2), ValueError, r"must lie in \[0, 10\)", True),
    (lambda a: mixgemm.rotary_kv_cache(*a, 2 ** 40, 4, 2), ValueError, "outside the 10 positions", False),
    (lambda a: mixgemm.rotary_kv_cache(*a, 0, 2 ** 70, 2), ValueError, "is not .* heads of an even head size", False),
    (lambda a: mixgemm.rotary_kv_cache(*a, 0, True, 2), ValueError, "heads must be a positive int", False),
    (lambda a: mixgemm.rotary_kv_cache(a[0], a[1].tolist(), *a[2:], 0, 4, 2), ValueError, "cos must be a table", False),
]


@pytest.mark.parametrize("call,exc,msg,routed", BAD_CALLS)
def test_bad_arguments_are_refused(call, exc, msg, routed):
    a = _args()
    k0 = a[3].clone()
    with pytest.raises(exc, match=msg):
        call(a)
    assert torch.equal(a[3], k0)                                     # nothing written


def test_custom_op():
    qkv, cos, sin, kc, vc = _args()
    kc2, vc2 = kc.clone(), vc.clone()
    torch.library.opcheck(torch.ops.mixgemm.rotary_kv_cache.default, (qkv, cos, sin, kc2, vc2, None, 3, 4, 2))
    q = torch.ops.mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, None, 3, 4, 2)
    kc_ref, vc_ref = _args()[3:]
    want = loop_reference(qkv, cos, sin, kc_ref, vc_ref, 3, 4, 2)
    assert torch.equal(q, want) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_python_fallback_op():
    """mixgemm::rotary_kv_cache_py (what the C++ kernel hands its other calls to) is the operator's
    Python kernel: the same results, and both check their arguments as the function does."""
    qkv, cos, sin, kc, vc = _args()
    torch.library.opcheck(torch.ops.mixgemm.rotary_kv_cache_py.default,
                          (qkv, cos, sin, kc.clone(), vc.clone(), None, 3, 4, 2))
    pos = torch.tensor([[4], [1]])
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = mixgemm.rotary_kv_cache(qkv, cos, sin, kc_ref, vc_ref, pos, 4, 2)
    for op in (torch.ops.mixgemm.rotary_kv_cache, torch.ops.mixgemm.rotary_kv_cache_py):
        k2, v2 = kc.clone(), vc.clone()
        assert torch.equal(op(qkv, cos, sin, k2, v2, pos, 0, 4, 2), want)
        assert torch.equal(k2, kc_ref) and torch.equal(v2, vc_ref)
        with pytest.raises(ValueError, match="outside the 10 positions"):
            op(qkv, cos, sin, k2, v2, None, 10, 4, 2)
        with pytest.raises(ValueError, match="multiple of kv_heads"):
            op(qkv, cos, sin, k2, v2, None, 0, 4, 3)


# ---------------------------------------------------------------------------------------------- the eager route
@pytest.fixture
def held(monkeypatch):
    """The torch operator library "holds" every rotary kernel, and the C++ kernel of
    ``mixgemm::rotary_kv_cache`` is stood in for on the CPU (each call recorded, and run by
    ``rotary_kv_cache_py``, as the C++ kernel runs a call it cannot take): the calls made in the
    test."""
    monkeypatch.setattr(plans.OPERATORS, "holds_rope", lambda qkv: True)
    with cpu_stand_in("rotary_kv_cache") as calls:
        yield calls


def test_eager_calls_go_to_the_operator_once_the_kernel_is_held(held):
    """Plain tensors, int head counts and an int or tensor position go to
    torch.ops.mixgemm.rotary_kv_cache with the call's own tensors (an int position as pos0, a
    tensor as the position table), and give what the Python path gives, caches included."""
    qkv, cos, sin, kc, vc = _args()
    pos = torch.tensor([[4], [1]])
    for positions in (3, pos):
        k_want, v_want = kc.clone(), vc.clone()
        want = loop_reference(qkv, cos, sin, k_want, v_want, positions, 4, 2)
        k2, v2 = kc.clone(), vc.clone()
        held.clear()
        q = mixgemm.rotary_kv_cache(qkv, cos, sin, k2, v2, positions, 4, 2)
        table, pos0 = (None, 3) if isinstance(positions, int) else (id(pos), 0)
        assert [tuple(id(a) if isinstance(a, torch.Tensor) else a for a in c) for c in held] == [
            (id(qkv), id(cos), id(sin), id(k2), id(v2), table, pos0, 4, 2)]
        assert torch.equal(q, want) and torch.equal(k2, k_want) and torch.equal(v2, v_want)


class _Sub(torch.Tensor):
    """A tensor subclass (the eager route takes plain tensors only)."""


@pytest.mark.parametrize("which,positions,routed", [(0, 0, False), (5, "table", False), (1, 0, True), (3, 2, True)])
def test_tensor_subclasses(held, which, positions, routed):
    """A tensor subclass for qkv or the position table takes the Python path; for a table or a
    cache it reaches the operator (as a module's buffer may be a subclass); the results are the
    Python path's."""
    pos = torch.tensor([[4], [1]]) if positions == "table" else positions
    a = list(_args())
    want_args = [t.clone() for t in a]
    want = mixgemm.rotary_kv_cache(*want_args, pos, 4, 2)
    held.clear()
    args = a + [pos]
    args[which] = args[which].as_subclass(_Sub)
    got = mixgemm.rotary_kv_cache(*args, 4, 2)
    assert len(held) == int(routed)
    assert torch.equal(got, want)
    assert torch.equal(a[3], want_args[3]) and torch.equal(a[4], want_args[4])


@pytest.mark.parametrize("call,exc,msg,routed", BAD_CALLS)
def test_bad_arguments_raise_the_same_errors_through_the_operator(held, monkeypatch, call, exc, msg, routed):
    """An invalid call that reaches the operator (every bad tensor or value of the types it
    takes) is handed to ``rotary_kv_cache_py`` (as the C++ kernel hands over every call it does
    not take), whose checks raise what the Python path raises: the same type and message, and
    nothing written."""
    a = _args()
    k0, v0 = a[3].clone(), a[4].clone()
    with pytest.raises(exc, match=msg) as routed_error:
        call(a)
    assert len(held) == int(routed)
    assert torch.equal(a[3], k0) and torch.equal(a[4], v0)
    monkeypatch.setattr(plans.OPERATORS, "holds_rope", lambda qkv: False)
    with pytest.raises(exc) as direct:
        call(a)
    assert type(routed_error.value) is type(direct.value) and str(routed_error.value) == str(direct.value)
    assert len(held) == int(routed)


def test_cpu_calls_take_the_python_path():
    """Without a kernel held for the call's device (never for CPU tensors), nothing reaches the
    operator."""
    qkv, cos, sin, kc, vc = _args()
    with cpu_stand_in("rotary_kv_cache") as calls:
        mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, 2, 4, 2)
        mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, torch.tensor([[4], [1]]), 4, 2)
    assert calls == []


def test_torch_compile_on_the_cpu():
    qkv, cos, sin, kc, vc = _args()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = mixgemm.rotary_kv_cache(qkv, cos, sin, kc_ref, vc_ref, 4, 4, 2)
    got = torch.compile(lambda x: mixgemm.rotary_kv_cache(x, cos, sin, kc, vc, 4, 4, 2) * 1, fullgraph=True)(qkv)
    assert torch.equal(got, want) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


# ---------------------------------------------------------------------------------------------- fake GPU
pytest_fake = pytest.mark.skipif(fake_driver.compiler() is None or fake_driver.real_driver_present(),
                                 reason="needs a C compiler for the fake CUDA driver, and no real one")


@pytest_fake
def test_launch_on_a_faked_gpu(tmp_path):
    """On an sm_90 device (faked): one launch per call, one CTA per token of 256 threads, PDL; the
    first argument is qkv; a head size that is not a multiple of 16 takes torch's ops."""
    qkv, cos, sin, kc, vc = inputs(2, 3, 8, 2, 32, 16, torch.bfloat16)
    with FakeGpu(tmp_path) as gpu:
        gpu.driver.reset(params_size=8)
        q = mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, 2, 8, 2)
        launches = gpu.launches()
        a = inputs(1, 1, 4, 2, 8, 16, torch.bfloat16)               # D = 8: not whole vector pairs
        mixgemm.rotary_kv_cache(*a, 0, 4, 2)
        assert len(gpu.launches()) == 1
    assert len(launches) == 1
    L = launches[0]
    assert L["function"] == function_handle(RopeSpec(ActType.BF16))
    assert L["grid"] == (6, 1, 1) and L["block"] == (256, 1, 1) and L["smem"] == 0 and L["pdl"] == 1
    assert struct.unpack("=Q", L["params"])[0] == qkv.data_ptr()
    assert q.shape == (2, 3, 8, 32) and q.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- nvcc
@pytest.mark.nvcc
def test_the_kernels_build(tmp_path, monkeypatch):
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    from mixgemm.jit import build

    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    for spec in catalog.rope_specs():
        art = build.build(spec)
        assert art.read_cubin()[:4] == b"\x7fELF" and spec.name.encode() in art.read_cubin()
        assert art.helper_path is None


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,t,heads,kv_heads,d,pos", [
    (1, 1, 32, 8, 128, 1024),      # llama3-8b decode
    (16, 1, 28, 4, 128, 77),       # qwen2.5-7b, batch 16
    (2, 5, 8, 8, 64, 0),           # MHA, a short prefill
    (1, 300, 40, 8, 128, 3),       # a longer prefill
    (3, 2, 6, 2, 16, 9),           # tiny heads
    (1, 1, 64, 8, 256, 17),        # head size 256
])
def test_kernel_equals_the_models_formula(requires_gpu, dtype, b, t, heads, kv_heads, d, pos):
    from mixgemm.jit import loader as runtime

    dev = requires_gpu
    qkv, cos, sin, kc, vc = inputs(b, t, heads, kv_heads, d, pos + t + 5, dtype, dev, batch_cache=b + 2,
                                   seed=b * t + d + pos)
    assert runtime.KERNELS.get(rotary.rope_spec(dtype), dev) is not None
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = rotary._torch(qkv, cos, sin, kc_ref, vc_ref, pos, heads, kv_heads, b, t, d)
    got = mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, pos, heads, kv_heads)
    assert torch.equal(got, want)                                    # bit for bit, q
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)      # the caches: written rows and the rest


@pytest.mark.gpu
def test_kernel_with_a_position_tensor_and_strided_caches(requires_gpu):
    """Positions per token (int32), caches that are slices of larger ones (strides of a [4, 8, 64,
    D] buffer viewed [:, 2:6]): the rows outside the view are untouched."""
    dev = requires_gpu
    b, t, heads, kv_heads, d = 3, 2, 8, 4, 128
    qkv, cos, sin, _, _ = inputs(b, t, heads, kv_heads, d, 40, torch.bfloat16, dev)
    big_k = torch.randn(4, 8, 40, d, device=dev).bfloat16()
    big_v = torch.randn(4, 8, 40, d, device=dev).bfloat16()
    kc, vc = big_k[:, 2:6], big_v[:, 2:6]
    pos = torch.tensor([[3, 39], [0, 1], [20, 7]], device=dev, dtype=torch.int32)
    k_ref, v_ref = kc.clone(), vc.clone()
    want = rotary._torch(qkv, cos, sin, k_ref, v_ref, pos, heads, kv_heads, b, t, d)
    big_k0 = big_k.clone()
    got = mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, pos, heads, kv_heads)
    assert torch.equal(got, want) and torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
    assert torch.equal(big_k[:, :2], big_k0[:, :2]) and torch.equal(big_k[:, 6:], big_k0[:, 6:])


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph(requires_gpu):
    """Captured once, replayed at a new position through the position tensor."""
    dev = requires_gpu
    qkv, cos, sin, kc, vc = inputs(1, 1, 32, 8, 128, 64, torch.bfloat16, dev)
    pos = torch.tensor([[5]], device=dev)
    mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, pos, 32, 8)     # loads the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = mixgemm.rotary_kv_cache(qkv, cos, sin, kc, vc, pos, 32, 8)
    qkv.copy_(torch.randn_like(qkv))
    pos.fill_(9)
    k_ref, v_ref = kc.clone(), vc.clone()
    want = rotary._torch(qkv, cos, sin, k_ref, v_ref, 9, 32, 8, 1, 1, 128)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q, want) and torch.equal(kc, k_ref) and torch.equal(vc, v_ref)


@pytest.mark.gpu
def test_torch_compile_traces_the_custom_op(requires_gpu):
    dev = requires_gpu
    qkv, cos, sin, kc, vc = inputs(2, 1, 32, 8, 128, 64, torch.bfloat16, dev)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = mixgemm.rotary_kv_cache(qkv, cos, sin, kc_ref, vc_ref, 30, 32, 8) * 2
    got = torch.compile(lambda x: mixgemm.rotary_kv_cache(x, cos, sin, kc, vc, 30, 32, 8) * 2, fullgraph=True)(qkv)
    assert torch.equal(got, want) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
