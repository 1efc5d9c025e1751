"""The register-direct decode kernel (cutlass_ext/mixgemm/decode_direct.hpp) on the CPU: its spec,
name and source, and its host plan through the real helper.so (built by nvcc from the same
header; a few seconds). What runs on the GPU is checked by tests/test_gpu_gemm.py, which runs
every generated kernel, these included."""
from __future__ import annotations

import ctypes
import shutil

import pytest

from mixgemm import codegen, runtime
from mixgemm.codegen import Activation, DecodeSpec, Loads
from mixgemm.types import ActType, WeightType

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the helper is built from the header)")

SMS = 132


class DirectParamsBf16(ctypes.Structure):
    """decode::DirectParams<bfloat16_t>, field for field."""

    _fields_ = [("weight", ctypes.c_uint64), ("scales", ctypes.c_uint64), ("zeros", ctypes.c_uint64),
                ("x", ctypes.c_uint64), ("bias", ctypes.c_uint64), ("y", ctypes.c_uint64),
                ("m", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("group_shift", ctypes.c_int32), ("groups", ctypes.c_int32), ("kslices", ctypes.c_int32),
                ("atoms_per_slice", ctypes.c_int32), ("ldx", ctypes.c_int64), ("ldy", ctypes.c_int64)]


@pytest.fixture(scope="module")
def helper(tmp_path_factory):
    from fake_gpu import build_helper

    spec = codegen.TILE_CONFIGS[[tc.label for tc in codegen.TILE_CONFIGS].index("direct8")].spec(
        ActType.BF16, WeightType.U4)
    path = build_helper(spec, tmp_path_factory.mktemp("direct-helper"))
    return runtime.HostHelper(str(path), spec.name)


def _args(m, n, k, group, splits=0) -> runtime.GemmArgs:
    a = runtime.GemmArgs()
    a.abi_version = runtime.ABI_VERSION
    a.m, a.n, a.k, a.group_size, a.sm_count, a.splits = m, n, k, group, SMS, splits
    a.weight, a.scales, a.zeros, a.x, a.y = 1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20
    a.ldx, a.ldy = k, n
    return a


def _expected_kslices(n, k, group, warps=8, max_smem=227 * 1024):
    """The documented rule: the smallest power of two up to the warps that gives 16 warps per
    SM, among those whose scale and zero rows fit in shared memory."""
    groups = 1 if group == k else k // group
    chosen = None
    ks = 1
    while ks <= warps:
        rows = 16 * (warps // ks)
        group_bytes = (groups * rows * 2 + 15) // 16 * 16
        if 2 * group_bytes + 32 * warps * 16 <= max_smem:
            chosen = ks
            if (n // 16) * ks >= 16 * SMS:
                break
        ks *= 2
    return chosen


def test_direct_spec_name_and_source():
    spec = DecodeSpec(ActType.BF16, WeightType.U4, 8, 8, 4096, 1, Activation.SWIGLU, 1, Loads.DIRECT)
    assert spec.name == "mixgemm_decode_bf16_u4_m8_w8_b4096_s1_k1_swiglu_direct"
    assert codegen.parse_name(spec.name) == spec
    ring = DecodeSpec(ActType.BF16, WeightType.U4, 8)
    assert not ring.name.endswith("_direct") and codegen.parse_name(ring.name) == ring
    src = codegen.render(spec)
    assert '#include "mixgemm/decode_direct.hpp"' in src
    assert "DirectConfig<cutlass::uint4b_t, cutlass::bfloat16_t, 8, 4096>" in src
    assert src.count("MIXGEMM_DECODE_DIRECT_ENTRY(") == 1
    # the grouped (MoE) kernels have no direct form
    with pytest.raises(ValueError):
        codegen.parse_name("mixgemm_gdecode_bf16_u4_m8_w8_b4096_s1_k1_none_direct")


@pytest.mark.parametrize("bad,match", [
    (dict(tokens=16), "at most 8 tokens"),
    (dict(stages=2), "stages=1"),
    (dict(kslices=2), "kslices=1"),
    (dict(stage_bytes=17 * 512), "at most 16 atoms"),
    (dict(warps=6), "power of two"),
])
def test_direct_spec_refuses_what_the_kernel_cannot_be(bad, match):
    fields = dict(act=ActType.BF16, weight=WeightType.U4, tokens=8, warps=8, stage_bytes=4096, stages=1,
                  kslices=1, loads=Loads.DIRECT)
    fields.update(bad)
    with pytest.raises(ValueError, match=match):
        DecodeSpec(**fields)


def test_every_type_and_activation_has_a_direct_kernel():
    direct = [s for s in codegen.default_specs() if isinstance(s, DecodeSpec) and s.loads is Loads.DIRECT]
    got = {(s.act, s.weight, s.activation) for s in direct}
    assert got == {(a, w, act) for a in codegen.ALL_ACTS for w in codegen.ALL_WEIGHTS for act in Activation}
    for s in direct:   # 128 bytes per lane per batch, 64 for 2-bit codes
        assert s.stage_bytes == 32 * (64 if s.weight.bits == 2 else 128) and s.tokens == 8


@pytest.mark.parametrize("n,k,group", [
    (4096, 4096, 128),      # 256 stripes: 8 warps per stripe
    (6144, 4096, 128),      # 384: 8 (4 would give 1536 warps < 16 per SM)
    (28672, 4096, 128),     # 1792: 2
    (57344, 8192, 128),     # 3584: 1
    (4096, 28672, 32),      # 896 groups: the scale rows of 8 stripes do not fit; 8 warps per stripe
    (1552, 2304, 32),       # 97 stripes: a partial last CTA
    (256, 512, 512),        # per-channel
])
def test_plan_picks_the_documented_kslices(helper, n, k, group):
    buf, launch = helper.prepare(_args(1, n, k, group))
    p = DirectParamsBf16.from_buffer_copy(buf.raw[:ctypes.sizeof(DirectParamsBf16)])
    ks = _expected_kslices(n, k, group)
    assert p.kslices == ks
    assert p.atoms_per_slice == -(-(k // 64) // ks)
    assert p.groups == (1 if group == k else k // group)
    assert (p.m, p.n, p.k, p.ldx, p.ldy) == (1, n, k, k, n)
    spc = 8 // ks
    assert tuple(launch.grid) == (-(-(n // 16) // spc), 1, 1)
    assert tuple(launch.block) == (256, 1, 1) and tuple(launch.cluster) == (1, 1, 1)
    assert launch.workspace_bytes == 0 and helper.workspace_size(_args(1, n, k, group)) == 0
    rows = 16 * spc
    assert launch.smem_bytes == 2 * ((p.groups * rows * 2 + 15) // 16 * 16) + 256 * 16
    assert helper.params_size == ctypes.sizeof(DirectParamsBf16)


@pytest.mark.parametrize("splits", (1, 2, 4, 8))
def test_forced_split_factor_is_the_kslices(helper, splits):
    buf, launch = helper.prepare(_args(3, 1552, 2304, 128, splits=splits))
    p = DirectParamsBf16.from_buffer_copy(buf.raw[:ctypes.sizeof(DirectParamsBf16)])
    assert p.kslices == splits and tuple(launch.grid)[0] == -(-97 // (8 // splits))


@pytest.mark.parametrize("args,match", [
    (_args(1, 1552, 2304, 128, splits=3), "power of two"),
    (_args(1, 1552, 2304, 128, splits=16), "power of two"),
    (_args(9, 1552, 2304, 128), "too many tokens"),
    (_args(1, 1544, 2304, 128), "multiple of 16"),
    (_args(1, 1552, 2300, 128), "multiple of 64"),
    (_args(1, 1552, 2304, 96), "group size"),
])
def test_helper_refuses_with_a_reason(helper, args, match):
    assert match in (helper.check(args) or "")
    with pytest.raises(runtime.KernelError, match=match):
        helper.prepare(args)
