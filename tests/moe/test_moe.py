"""mixgemm.moe on the CPU: the grouped decode spec and its C++, routing against a torch reference,
argument errors, and the launch path through the real host helper on a faked GPU."""
from __future__ import annotations

import ctypes
import struct
import types

import pytest
import torch

import fake_driver
from fake_gpu import FakeGpu, function_handle

from mixgemm.jit import catalog
from mixgemm.jit.render import render
from mixgemm.jit import driver
from mixgemm.jit import env as paths
from mixgemm import moe
from mixgemm.moe import grouped as moe_grouped
from mixgemm.weights.experts import PackedExperts
from mixgemm.weights.quantize import interleave_gate_up, quantize
from mixgemm.jit.specs import Activation, DecodeSpec, GroupedDecodeSpec, KernelKind, parse_name
from mixgemm.dtypes import ActType, WeightType


# ---------------------------------------------------------------------------------------------- specs
def test_grouped_spec_name_encodes_every_field_and_parses_back():
    specs = [GroupedDecodeSpec(a, w, t, warps, sb, 4, act, ks)
             for a in ActType for w in WeightType for t in (8, 16, 32) for warps, ks in ((8, 1), (8, 8))
             for sb in (1024, 2048) for act in Activation]
    names = {s.name for s in specs}
    assert len(names) == len(specs)                       # every field is in the name
    for s in specs:
        assert s.name.startswith("mixgemm_gdecode_") and parse_name(s.name) == s
        assert s.dense.name == "mixgemm_decode_" + s.name[len("mixgemm_gdecode_"):]
        assert isinstance(parse_name(s.dense.name), DecodeSpec)
        assert s.max_tokens is None and s.programmatic_launch


def test_grouped_spec_takes_the_decode_kernels_checks():
    with pytest.raises(ValueError, match="tokens must be 8, 16 or 32"):
        GroupedDecodeSpec(ActType.BF16, WeightType.U4, 24)
    with pytest.raises(ValueError, match="kslices"):
        GroupedDecodeSpec(ActType.BF16, WeightType.U4, 16, kslices=3)


def test_render_instantiates_one_grouped_kernel():
    spec = GroupedDecodeSpec(ActType.FP16, WeightType.S8, 8, kslices=8, activation=Activation.SWIGLU)
    src = render(spec)
    assert '#include "mixgemm/grouped_decode_kernel.hpp"' in src
    assert src.count("MIXGEMM_GROUPED_DECODE_ENTRY(") == 1
    assert f"MIXGEMM_GROUPED_DECODE_ENTRY({spec.name}, {spec.name}_config, mixgemm::Activation::kSwiglu)" in src
    assert "mixgemm::decode::Config<int8_t, cutlass::half_t, 1, 8, 1024, 4, 8>" in src


def test_select_grouped_spec():
    ex = PackedExperts.quantize(torch.randn(2, 32, 128), 8, 64)
    assert moe.select_grouped_spec(8, ex).tokens == 8 and moe.select_grouped_spec(8, ex).kslices == 8
    s = moe.select_grouped_spec(9, ex, "swiglu")
    assert (s.tokens, s.activation, s.weight, s.act) == (16, Activation.SWIGLU, WeightType.U8, ActType.BF16)


@pytest.mark.parametrize("rows,experts,tokens", [
    (8, 1, 8), (9, 1, 16), (16, 2, 16),                  # one or two experts: 8 rows in all, else the 16-row tile
    (32, 8, 8), (33, 8, 16),                             # mixtral at 16 tokens: 4 rows an expert -> 8-row tile
    (128, 128, 8), (4 * 128, 128, 8), (4 * 128 + 1, 128, 16),
    (24, 1000, 8),                                       # fewer rows than experts: rows / rows = 1
])
def test_grouped_decode_tile_by_rows_per_expert(rows, experts, tokens):
    """The grouped decode kernel's token tile follows the rows per expert with rows (up to
    DEC8_ROWS_PER_EXPERT: the 8-row tile), not the call's rows alone; fused_moe's plan agrees."""
    per_expert = rows / min(experts, rows)
    assert (per_expert <= moe.DEC8_ROWS_PER_EXPERT or rows <= 8) == (tokens == 8)
    spec = moe.grouped_spec_for(rows, ActType.BF16, WeightType.U4, "swiglu", experts, 256, 256)
    assert spec.kind is KernelKind.GROUPED_DECODE and spec.tokens == tokens
    assert moe.decode_spec_for(rows, ActType.BF16, WeightType.U4, None, experts).tokens == tokens
    plan = moe.plan_fused_moe(rows, ActType.BF16, WeightType.U4, experts, 256, 128)
    assert plan.gate_up.tokens == tokens and plan.down.tokens == tokens
    # 8-bit codes: the 8-row tile (8 k-slices, a stripe per CTA) only for 8 rows in all
    s8 = moe.decode_spec_for(rows, ActType.BF16, WeightType.S8, None, experts)
    assert s8.tokens == (8 if rows <= 8 else 16)


# ---------------------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("t,topk,e", [(1, 1, 1), (7, 2, 8), (33, 8, 128), (5, 3, 256)])
def test_route_matches_a_per_expert_reference(t, topk, e):
    g = torch.Generator().manual_seed(t * e)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
    r = moe.route(ids, e)
    flat = ids.reshape(-1)
    # the reference: expert by expert, the (token, slot) pairs in token order
    want = [i for ex in range(e) for i in range(flat.numel()) if flat[i] == ex]
    assert r.order.tolist() == want
    assert r.tokens.tolist() == [i // topk for i in want]
    counts = [int((flat == ex).sum()) for ex in range(e)]
    assert r.expert_offsets.dtype == torch.int32
    assert r.expert_offsets.tolist() == [sum(counts[:ex]) for ex in range(e + 1)]


def test_combine_is_the_weighted_sum_of_the_topk():
    t, topk, h = 5, 3, 16
    ids = torch.tensor([[0, 2, 1], [1, 0, 2], [2, 2, 0], [0, 1, 1], [1, 2, 0]])
    w = torch.rand(t, topk)
    r = moe.route(ids, 3)
    y_flat = torch.randn(t * topk, h).to(torch.bfloat16)       # the expert outputs per (token, slot)
    y_sorted = y_flat[r.order]
    want = (y_flat.view(t, topk, h).float() * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    assert torch.equal(moe.combine(y_sorted, r, w), want)


def test_route_refuses_bad_ids():
    with pytest.raises(ValueError, match=r"\[T, topk\]"):
        moe.route(torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(TypeError, match="integer"):
        moe.route(torch.zeros(4, 2), 2)


# ---------------------------------------------------------------------------------------------- errors
def _experts(e=3, n=32, k=128, bits=4, symmetric=False, dtype=torch.bfloat16):
    return PackedExperts.quantize(torch.randn(e, n, k), bits, 64, symmetric=symmetric, dtype=dtype)


@pytest.mark.parametrize("call,err,msg", [
    (lambda ex: moe.grouped_gemm(torch.zeros(4, 128, dtype=torch.bfloat16), ex, torch.zeros(4, dtype=torch.int32),
                                 activation="relu"), ValueError, "activation must be"),
    (lambda ex: moe.grouped_gemm(torch.zeros(4, 128, dtype=torch.bfloat16), ex.expert(0),
                                 torch.zeros(4, dtype=torch.int32)), TypeError, "PackedExperts"),
    (lambda ex: moe.grouped_gemm(torch.zeros(4, 128, dtype=torch.float16), ex, torch.zeros(4, dtype=torch.int32)),
     TypeError, "packed for torch.bfloat16"),
    (lambda ex: moe.grouped_gemm(torch.zeros(4, 64, dtype=torch.bfloat16), ex, torch.zeros(4, dtype=torch.int32)),
     ValueError, r"x must be \[T, K=128\]"),
    (lambda ex: moe.grouped_gemm(torch.zeros(4, 128, dtype=torch.bfloat16), ex, torch.zeros(4, dtype=torch.int64)),
     ValueError, r"expert_offsets must be int32 of shape \[E \+ 1\] = \[4\]"),
    (lambda ex: moe.grouped_gemm(torch.zeros(4, 128, dtype=torch.bfloat16), ex, torch.zeros(3, dtype=torch.int32)),
     ValueError, "expert_offsets must be int32"),
])
def test_grouped_gemm_argument_errors(call, err, msg):
    with pytest.raises(err, match=msg):
        call(_experts())


@pytest.mark.parametrize("splits", (-1, 9, 2.0, True))
def test_grouped_gemm_refuses_a_bad_split_factor(splits):
    with pytest.raises(ValueError, match="splits must be an int from 0"):
        moe.grouped_gemm_with_spec(torch.zeros(4, 128, dtype=torch.bfloat16), _experts(),
                                   torch.zeros(4, dtype=torch.int32), None, splits=splits)


def test_grouped_gemm_needs_a_gpu():
    with pytest.raises(ValueError, match="CUDA tensors"):
        moe.grouped_gemm(torch.zeros(4, 128, dtype=torch.bfloat16), _experts(), torch.zeros(4, dtype=torch.int32))


def test_fused_moe_shape_errors():
    w13 = _experts(n=128, k=128)
    w2 = _experts(n=128, k=64)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="shapes disagree"):
        moe.fused_moe(x, w13, _experts(n=64, k=128), torch.ones(3, 2), ids)
    with pytest.raises(ValueError, match="w13 has 3 experts, w2 has 2"):
        moe.fused_moe(x, w13, _experts(e=2, n=128, k=64), torch.ones(3, 2), ids)
    with pytest.raises(ValueError, match="topk_weights and topk_ids"):
        moe.fused_moe(x, w13, w2, torch.ones(3, 1), ids)


# ---------------------------------------------------------------------------------------------- fake GPU
pytest_fake = pytest.mark.skipif(fake_driver.compiler() is None or fake_driver.real_driver_present(),
                                 reason="needs a C compiler for the fake CUDA driver, and no real one")

#: grouped_decode::Params: decode::Args (decode::Params: 8 pointers, 8 int32, ldx, ldy; padding to
#: the descriptors' 64-byte alignment; the scale and zero rows' TMA descriptors), then offsets, the
#: three strides, experts, the group rows of one expert, and the routed mode's ids pointer,
#: ids_bytes, assignments, topk, x_by_token, y_by_assignment (the struct padded to 64 bytes)
_PARAMS = struct.Struct("=8Q8i2q16x128s128sQ3qiiQ5i60x")


def _descriptor(raw: bytes) -> tuple:
    """The fake driver's descriptor (tests/cpp/fake_libcuda.c): address, dims[0], dims[1],
    strides[0], box (inner, outer), as encoded; all zero when none was encoded."""
    w = struct.unpack("=16Q", raw)
    return w[0], w[1], w[2], w[3], (w[4] & 0xFFFFFFFF, w[4] >> 32)


@pytest_fake
@pytest.mark.nvcc
@pytest.mark.parametrize("bits,symmetric,activation", [(4, False, None), (8, True, "swiglu")])
def test_grouped_launch_through_the_real_helper(tmp_path, monkeypatch, bits, symmetric, activation):
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    e, n, k, t = 5, 64, 256, 6
    gate_up = [interleave_gate_up(quantize(torch.randn(n // 2, k), bits, 64, symmetric),
                                  quantize(torch.randn(n // 2, k), bits, 64, symmetric)) for _ in range(e)]
    ex = PackedExperts.from_quantized(gate_up)
    x = torch.randn(t, k).to(torch.bfloat16)
    offsets = torch.tensor([0, 2, 2, 5, 6, 6], dtype=torch.int32)
    with FakeGpu(tmp_path / "fake") as gpu:
        spec = moe.select_grouped_spec(t, ex, activation)
        helper_size = driver.HostHelper(str(__import__("fake_gpu").build_helper(spec, gpu.kernels.helper_dir)),
                                         spec.name).params_size
        assert helper_size == _PARAMS.size
        gpu.driver.reset(params_size=helper_size)
        y = moe.grouped_gemm(x, ex, offsets, activation=activation)
        launches = gpu.launches()
    n_out = n // 2 if activation else n
    assert y.shape == (t, n_out) and y.dtype == torch.bfloat16
    assert len(launches) == 1
    L = launches[0]
    assert L["function"] == function_handle(spec) and L["pdl"]
    splits = L["grid"][1]
    assert L["grid"][0] == n // 16 // (spec.warps // spec.kslices) + (n // 16 % (spec.warps // spec.kslices) > 0)
    assert L["grid"][2] == e and L["cluster"] == (1, splits, 1) and 1 <= splits <= 8
    f = _PARAMS.unpack(L["params"])
    weight, scales, zeros, xp, bias, yp, partials, counters = f[:8]
    m, pn, pk, gshift, aps, psplits = f[8:14]
    ldx, ldy, scales_map, zeros_map, offs, wstride, gstride, bstride, experts, expert_groups = f[16:26]
    assert (weight, scales, xp, yp) == (ex.qdata.data_ptr(), ex.scales.data_ptr(), x.data_ptr(), y.data_ptr())
    assert zeros == (0 if symmetric else ex.zeros.data_ptr()) and bias == partials == counters == 0
    assert (pn, pk, gshift, psplits, ldx, ldy) == (n, k, 6, splits, k, n_out)
    assert aps * splits >= k // 64
    assert offs == offsets.data_ptr() and experts == e and expert_groups == k // 64
    assert wstride == ex.qdata[0].numel() and gstride == ex.scales[0].numel() and bstride == 0
    # every expert's scale (and zero) rows in one descriptor: [E * G][N], boxes of the CTA's rows
    rows_per_cta = 16 * (spec.warps // spec.kslices)
    addr, dim0, dim1, stride0, box = _descriptor(scales_map)
    assert (addr, dim0, dim1, stride0, box[0]) == (ex.scales.data_ptr(), n, e * (k // 64), n * 2, rows_per_cta)
    assert box[1] >= 1
    if symmetric:
        assert zeros_map == bytes(128)
    else:
        assert _descriptor(zeros_map) == (ex.zeros.data_ptr(), n, e * (k // 64), n * 2, box)
    assert f[26:] == (0, 0, 0, 0, 0, 0)   # not routed


@pytest_fake
@pytest.mark.nvcc
@pytest.mark.parametrize("ids_dtype", (torch.int32, torch.int64))
@pytest.mark.parametrize("x_by_token,y_by_assignment", [(True, False), (False, True)])
def test_routed_launch_through_the_real_helper(tmp_path, monkeypatch, ids_dtype, x_by_token, y_by_assignment):
    """The routed grouped decode launch: no offsets, the ids and how x and y are laid out in the
    params, the grid over min(E, T * topk) ranks."""
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    e, n, k, t, topk = 5, 64, 256, 3, 2
    ex = PackedExperts.quantize(torch.randn(e, n, k), 4, 64, symmetric=False)
    x = torch.randn(t if x_by_token else t * topk, k).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 4], [1, 7]], dtype=ids_dtype)   # 7: out of range, dropped
    with FakeGpu(tmp_path / "fake") as gpu:
        spec = moe.decode_spec_for(t * topk, ActType.BF16, WeightType.U4, None, e)
        helper_size = driver.HostHelper(str(__import__("fake_gpu").build_helper(spec, gpu.kernels.helper_dir)),
                                         spec.name).params_size
        assert helper_size == _PARAMS.size
        gpu.driver.reset(params_size=helper_size)
        y = moe.grouped_gemm_routed(x, ex, ids, spec, x_by_token=x_by_token, y_by_assignment=y_by_assignment)
        launches = gpu.launches()
    assert y.shape == (t * topk, n) and len(launches) == 1
    L = launches[0]
    assert L["function"] == function_handle(spec) and L["pdl"]
    assert L["grid"][2] == min(e, t * topk)
    f = _PARAMS.unpack(L["params"])
    assert f[3] == x.data_ptr() and f[5] == y.data_ptr() and f[8] == spec.tokens   # (m: a tile's rows)
    assert f[20] == 0 and f[24] == e                                  # no offsets
    assert _descriptor(f[18])[:3] == (ex.scales.data_ptr(), n, e * (k // 64))
    assert f[26:] == (ids.data_ptr(), ids.element_size(), t * topk, topk, int(x_by_token), int(y_by_assignment))


_ROUTED_PREPARE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(driver.GemmArgs), ctypes.POINTER(moe_grouped._Routed),
                                   ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(driver.Launch),
                                   ctypes.c_char_p, ctypes.c_int)


class _HeldPlans:
    """The torch operator library's MoE functions, holding what they are handed (no library)."""

    def __init__(self):
        from mixgemm.jit import torch_ops

        self.moe_key = types.MethodType(torch_ops.TorchOps.moe_key, self)
        self.weight_types = tuple(wt.value for wt in WeightType)
        self.held = {}

    def put_moe(self, key, plan):
        self.held[key.astuple()] = (key, type(plan).from_buffer_copy(plan))

    def drop_moe(self, key):
        return self.held.pop(key.astuple(), None) is not None


@pytest_fake
@pytest.mark.nvcc
@pytest.mark.parametrize("ids_dtype,weights_dtype,bits,symmetric",
                         [(torch.int64, torch.float32, 4, False), (torch.int32, torch.float64, 2, True)])
def test_handed_over_moe_plan_launches_what_python_launches(tmp_path, monkeypatch, ids_dtype, weights_dtype, bits,
                                                            symmetric):
    """The MoE plan that fused_moe's Python kernel hands the torch operator library, run as its
    C++ kernel runs it (each grouped launch's GemmArgs from the plan with x and y set, the
    plan's routed prepare, the launch shape with the cluster and PDL attributes; the combine
    kernel's grid, block and weights), reproduces the routed plan's three launches byte for byte."""
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    import gc

    from fake_gpu import build_helper
    from mixgemm.dispatch import plans
    from mixgemm.jit import torch_ops
    from mixgemm.moe import layer as moe_layer

    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    e, h, inter, t, topk = 5, 128, 64, 3, 2
    w13 = PackedExperts.quantize(torch.randn(e, 2 * inter, h), bits, 64, symmetric)
    w2 = PackedExperts.quantize(torch.randn(e, h, inter), bits, 64, symmetric)
    x = torch.randn(t, h).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 4], [1, 7]], dtype=ids_dtype)   # 7: out of range, dropped
    tw = torch.softmax(torch.randn(t, topk), -1).to(weights_dtype)
    link, held = plans.OperatorLibrary(), _HeldPlans()
    link.lib = held
    monkeypatch.setattr(plans, "OPERATORS", link)
    # (the routed plan, as on the GPU)
    monkeypatch.setattr(moe_layer, "routed_plan", lambda plan, a, b, xx, ii: plan.kind == "each")
    with FakeGpu(tmp_path / "fake") as gpu:
        plan = moe.plan_fused_moe(t * topk, ActType.BF16, w13.weight_type, e, h, inter)
        size = driver.HostHelper(str(build_helper(plan.gate_up, gpu.kernels.helper_dir)), plan.gate_up.name).params_size
        gpu.driver.reset(params_size=size)
        combine = moe_layer.combine_by_assignment

        def combine_recording_its_first_argument(*args, **kwargs):
            gpu.driver.lib.fake_set_params_size(8)   # (the combine kernel's first argument: y)
            return combine(*args, **kwargs)

        monkeypatch.setattr(moe_layer, "combine_by_assignment", combine_recording_its_first_argument)
        out = torch.ops.mixgemm.fused_moe_py(x, w13.qdata, w13.scales, w13.zeros, w2.qdata, w2.scales, w2.zeros,
                                             w13.weight_type.value, 64, 64, h, inter, tw, ids)
        launches = gpu.launches()
        # (the hand-over of a CUDA call; CPU tensors stand for the GPU's here)
        moe_layer._hand_over(x, w13, w2, tw, ids)
        assert out.shape == (t, h) and len(launches) == 3 and len(held.held) == 1
        (key, moe_plan), = held.held.values()
        x_ptr, h_ptr, y_ptr = x.data_ptr(), _PARAMS.unpack(launches[0]["params"])[5], \
            _PARAMS.unpack(launches[1]["params"])[5]
        for g, (xp, yp), launched in ((moe_plan.gate_up, (x_ptr, h_ptr), launches[0]),
                                      (moe_plan.down, (h_ptr, y_ptr), launches[1])):
            args = driver.GemmArgs.from_buffer_copy(g.args)
            assert args.x == args.y == 0
            args.x, args.y = xp, yp
            routed = moe_grouped._Routed(ids.data_ptr(), ids.element_size(), topk, g.x_by_token, g.y_by_assignment)
            params = ctypes.create_string_buffer(g.params_size)
            shape = driver.Launch()
            err = ctypes.create_string_buffer(256)
            rc = ctypes.cast(g.prepare, _ROUTED_PREPARE)(ctypes.byref(args), ctypes.byref(routed), e, params,
                                                        g.params_size, ctypes.byref(shape), err, 256)
            assert rc == 0 and shape.workspace_bytes == shape.lock_bytes == 0, err.value
            assert params.raw[:size] == launched["params"]
            assert launched["function"] == g.function and launched["pdl"] == (1 if g.programmatic else -1)
            assert (launched["grid"], launched["block"], launched["cluster"], launched["smem"]) == \
                (tuple(shape.grid), tuple(shape.block), tuple(shape.cluster), shape.smem_bytes)
        assert (moe_plan.gate_up.x_by_token, moe_plan.gate_up.y_by_assignment) == (1, 0)
        assert (moe_plan.down.x_by_token, moe_plan.down.y_by_assignment) == (0, 1)
        assert (moe_plan.gate_up.n_out, moe_plan.down.n_out) == (inter, h)
        assert tuple(moe_plan.gate_up.qdata_sizes) == tuple(w13.qdata.shape)
        assert tuple(moe_plan.down.scales_sizes) == tuple(w2.scales.shape)
        launched = launches[2]
        threads = moe_plan.combine_threads
        row_vecs = h * 2 // 16
        assert launched["function"] == moe_plan.combine
        assert launched["pdl"] == (1 if moe_plan.combine_programmatic else -1)
        assert launched["grid"] == (-(-row_vecs // threads), t, 1) and launched["block"] == (threads, 1, 1)
        assert launched["cluster"] == (0, 0, 0) and launched["params"] == struct.pack("=Q", y_ptr)
        assert moe_plan.combine_weights == torch_ops.WEIGHTS_DTYPE_CODES[torch.float32]   # float64: converted
        assert moe_plan.launch_kernel_ex != 0
    pointers = [0 if z is None else z.data_ptr() for z in (w13.qdata, w13.scales, w13.zeros, w2.qdata, w2.scales,
                                                           w2.zeros)]
    assert [getattr(key, f) for f in ("w13_qdata", "w13_scales", "w13_zeros", "w2_qdata", "w2_scales",
                                      "w2_zeros")] == pointers
    assert (key.hidden, key.intermediate, key.num_experts, key.rows, key.topk, key.ids_bytes) == \
        (h, inter, e, t * topk, topk, ids.element_size())
    assert key.weights_dtype == torch_ops.WEIGHTS_DTYPE_CODES[weights_dtype] and key.capturing == 0
    # the plan leaves with its weights
    del w13, w2
    gc.collect()
    assert held.held == {} and link.moe_plan_count() == 0


@pytest_fake
@pytest.mark.nvcc
def test_routed_helper_refuses_what_the_kernel_cannot_rank(tmp_path):
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    from fake_gpu import build_helper

    spec = GroupedDecodeSpec(ActType.BF16, WeightType.U4, 16)
    helper = driver.HostHelper(str(build_helper(spec, tmp_path)), spec.name)
    prepare = moe_grouped._routed_prepare_fn(helper.lib)

    def refusal(experts=4, ids=64, ids_bytes=8, topk=2, **fields):
        a = driver.GemmArgs(abi_version=driver.ABI_VERSION, m=40, n=64, k=256, group_size=64, sm_count=132,
                             weight=256, scales=256, zeros=256, x=256, y=256, ldx=256, ldy=64)
        for key, value in fields.items():
            setattr(a, key, value)
        routed = moe_grouped._Routed(ids, ids_bytes, topk, 1, 0)
        buf = ctypes.create_string_buffer(helper.params_size)
        err = ctypes.create_string_buffer(256)
        rc = prepare(ctypes.byref(a), ctypes.byref(routed), experts, buf, helper.params_size,
                     ctypes.byref(driver.Launch()), err, 256)
        return err.value.decode() if rc else None

    assert refusal() is None
    assert refusal(m=256, topk=8) is None                       # the most assignments: one per thread
    assert "at most its threads" in refusal(m=264, topk=8)
    assert "at most 512 experts" in refusal(experts=513)
    assert "int32 or int64" in refusal(ids=0)
    assert "int32 or int64" in refusal(ids_bytes=2)
    assert "int32 or int64" in refusal(ids=68)                  # not 8-byte aligned for int64
    assert refusal(ids=68, ids_bytes=4) is None
    assert "multiple of topk" in refusal(m=41)
    assert "K must be" in refusal(k=100)                        # and the decode kernel's own checks


def test_grouped_gemm_routed_argument_errors():
    ex = _experts()
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="int32 or int64"):
        moe.grouped_gemm_routed(x, ex, ids.float(), x_by_token=True)
    with pytest.raises(ValueError, match=r"x must be \[T \* topk = 6, K\]"):
        moe.grouped_gemm_routed(x, ex, ids)
    with pytest.raises(ValueError, match=r"x must be \[T=3, K\]"):
        moe.grouped_gemm_routed(torch.zeros(6, 128, dtype=torch.bfloat16), ex, ids, x_by_token=True)
    with pytest.raises(ValueError, match="CUDA tensors"):
        moe.grouped_gemm_routed(x, ex, ids, x_by_token=True)
    with pytest.raises(ValueError, match="splits must be"):
        moe.grouped_gemm_routed(x, ex, ids, x_by_token=True, splits=9)


def test_routed_supports_gives_the_reason():
    from mixgemm.moe.grouped import routed_supports

    spec = moe.decode_spec_for(16, ActType.BF16, WeightType.U4, None, 8)
    assert routed_supports(16, 8, spec) is None
    assert "at most 256" in routed_supports(257, 8, spec)
    assert "at most 512" in routed_supports(16, 513, spec)
    tiles = moe.grouped_spec_for(4096, ActType.BF16, WeightType.U4, None, 8, 256, 256)
    assert "not a grouped decode kernel" in routed_supports(16, 8, tiles)


_QWEN3, _MIXTRAL, _WIDE = (2048, 768, 128, 8), (4096, 14336, 8, 2), (256, 128, 600, 1)


@pytest.mark.parametrize("preset,tokens,wt,want", [
    (_QWEN3, 1, WeightType.U4, True), (_QWEN3, 4, WeightType.U2, True), (_MIXTRAL, 1, WeightType.U4, True),
    (_QWEN3, 16, WeightType.U4, False),     # 128 experts' row blocks: ~27 CTAs per SM
    (_MIXTRAL, 4, WeightType.U4, False),    # 8 experts x (224 + 32) row blocks
    (_MIXTRAL, 1, WeightType.S8, False),    # the k-sliced tile: a CTA per 16 weight rows
    (_QWEN3, 64, WeightType.U4, False),     # 512 assignments: past the kernel's bound
    (_WIDE, 1, WeightType.U4, False),       # 600 experts: more than the kernel ranks
    (_MIXTRAL, 256, WeightType.U4, False),  # not a decode plan
])
def test_routed_fits(preset, tokens, wt, want):
    """fused_moe's choice of the routed path (three launches) on a 132-SM GPU."""
    from mixgemm.moe.layer import routed_fits

    h, inter, e, topk = preset
    plan = moe.plan_fused_moe(tokens * topk, ActType.BF16, wt, e, h, inter)
    assert routed_fits(plan, tokens * topk, e, 2 * inter, h, 132) is want


def test_combine_by_assignment_on_the_cpu_drops_ids_out_of_range():
    t, topk, h, e = 3, 2, 16, 4
    y = torch.randn(t * topk, h)
    y[3] = float("nan")                        # the row of a dropped slot: never read
    ids = torch.tensor([[0, 1], [2, 9], [3, 0]])
    w = torch.rand(t, topk)
    got = moe.combine_by_assignment(y, ids, w, e)
    keep = (ids < e).float().unsqueeze(-1)
    want = (y.view(t, topk, h).nan_to_num() * keep * w.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match=r"y must be \[T \* topk = 6, H\]"):
        moe.combine_by_assignment(y[:5], ids, w, e)
    with pytest.raises(TypeError, match="int32 or int64"):
        moe.combine_by_assignment(y, ids.float(), w, e)


@pytest_fake
@pytest.mark.nvcc
def test_grouped_helper_refuses_what_the_kernel_cannot_run(tmp_path, monkeypatch):
    if paths.find_nvcc() is None:
        pytest.skip("nvcc not found")
    from fake_gpu import build_helper

    spec = GroupedDecodeSpec(ActType.BF16, WeightType.U4, 16)
    helper = driver.HostHelper(str(build_helper(spec, tmp_path)), spec.name)
    prepare = moe_grouped._prepare_fn(helper.lib)

    def refusal(offsets=64, experts=4, **fields):
        a = driver.GemmArgs(abi_version=driver.ABI_VERSION, m=40, n=64, k=256, group_size=64, sm_count=132,
                             weight=256, scales=256, zeros=256, x=256, y=256, ldx=256, ldy=64)
        for key, value in fields.items():
            setattr(a, key, value)
        buf = ctypes.create_string_buffer(helper.params_size)
        err = ctypes.create_string_buffer(256)
        rc = prepare(ctypes.byref(a), offsets, experts, buf, helper.params_size, ctypes.byref(driver.Launch()),
                     err, 256)
        return err.value.decode() if rc else None

    assert refusal() is None                       # 40 rows: more than the 16-row tile is fine (row loop)
    assert "expert_offsets" in refusal(offsets=0)
    assert "expert_offsets" in refusal(offsets=66)
    assert "number of experts" in refusal(experts=0)
    assert "at most 8 ways" in refusal(splits=9)
    assert "more parts than K has atoms" in refusal(k=128, splits=3)   # 2 atoms of 64
    assert refusal(k=128, splits=2) is None
    assert "zero points" in refusal(zeros=0)
    assert "K must be" in refusal(k=100)
    assert "must be >= 1" in refusal(m=0)
    assert helper.check(driver.GemmArgs(abi_version=driver.ABI_VERSION, m=1, n=64, k=256, group_size=64,
                                         weight=256, scales=256, zeros=256, x=256, y=256, ldx=256, ldy=64)) is None


def test_quant_moe_from_mlps_packs_the_experts():
    from torch import nn

    from mixgemm.nn.moe import QuantMoE

    class Mlp(nn.Module):
        def __init__(self, h, i, bias=False):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(h, i, bias=bias), nn.Linear(h, i, bias=bias)
            self.down_proj = nn.Linear(i, h, bias=bias)

    torch.manual_seed(0)
    mlps = [Mlp(128, 64) for _ in range(3)]
    layer = QuantMoE.from_mlps(mlps, 4, 64, dtype=torch.bfloat16)
    assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (3, 128, 64)
    w13, w2 = layer.experts("w13"), layer.experts("w2")
    assert (w13.n, w13.k, w2.n, w2.k) == (128, 128, 128, 64)
    # expert 1's down projection is exactly the quantized weight, and w13 its interleaved gate/up
    assert torch.equal(w2.expert(1).qdata, PackedExperts.quantize(
        torch.stack([m.down_proj.weight.detach() for m in mlps]), 4, 64, dtype=torch.bfloat16).qdata[1])
    want13 = interleave_gate_up(quantize(mlps[2].gate_proj.weight.detach(), 4, 64, dtype=torch.bfloat16),
                                quantize(mlps[2].up_proj.weight.detach(), 4, 64, dtype=torch.bfloat16))
    assert torch.equal(w13.unpack()[2].qweight, want13.qweight)
    assert set(dict(layer.named_buffers())) == {"w13_qdata", "w13_scales", "w13_zeros", "w2_qdata", "w2_scales",
                                                "w2_zeros"}
    with pytest.raises(ValueError, match="has a bias"):
        QuantMoE.from_mlps([Mlp(128, 64, bias=True)], 4, 64)
    with pytest.raises(ValueError, match=r"must be E x \[2I, H\]"):
        QuantMoE(w2, w13)


def test_quant_moe_forward_is_one_fused_moe_op(monkeypatch):
    """QuantMoE.forward hands its buffers to the mixgemm::fused_moe op, which calls fused_moe on
    PackedExperts built from them (recorded here on the CPU, fused_moe itself replaced)."""
    from mixgemm.moe import layer as moe_layer
    from mixgemm.nn.moe import QuantMoE

    w13 = PackedExperts.quantize(torch.randn(3, 128, 128), 2, 32, symmetric=True, dtype=torch.bfloat16)
    w2 = PackedExperts.quantize(torch.randn(3, 128, 64), 2, 64, symmetric=True, dtype=torch.bfloat16)
    layer = QuantMoE(w13, w2)
    seen = []

    def fake(x, a, b, tw, ids):
        seen.append((x, a, b, tw, ids))
        return torch.full_like(x, 2.0)

    monkeypatch.setattr(moe_layer, "fused_moe", fake)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    tw, ids = torch.rand(6, 2), torch.randint(0, 3, (6, 2))
    out = layer(x, tw, ids)
    assert out.shape == x.shape and torch.equal(out, torch.full_like(x, 2.0))
    (x2, a, b, tw2, ids2), = seen
    assert x2.shape == (6, 128) and tw2 is tw and ids2 is ids
    for got, want in ((a, w13), (b, w2)):
        assert (got.weight_type, got.group_size, got.n, got.k) == (want.weight_type, want.group_size, want.n, want.k)
        assert torch.equal(got.qdata, want.qdata) and torch.equal(got.scales, want.scales) and got.zeros is None
    # and dynamo traces it whole (the op's fake implementation; the eager backend: no GPU needed)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, tw, ids), torch.full_like(x, 2.0)) and len(seen) == 2


def test_grouped_specs_cover_what_grouped_gemm_picks():
    specs = set(catalog.grouped_specs())
    assert len(specs) == 2 * 6 * 2 * 2
    for act in ActType:
        for wt in WeightType:
            ex = PackedExperts.quantize(torch.randn(1, 32, 128), wt.bits, 64, wt.signed, act.torch_dtype)
            for rows in (1, 8, 9, 1000):
                for activation in (None, "swiglu"):
                    assert moe.select_grouped_spec(rows, ex, activation) in specs
