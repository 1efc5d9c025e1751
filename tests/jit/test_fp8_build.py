"""The FP8-activation kernels built by the real nvcc (no GPU needed): the quantizers, one e4m3
GEMM kernel with its host helper (whose checks are exercised), and the layout facts the e4m3
mainloop relies on, read off CUTLASS's own layouts on the host (tests/cpp/fp8_layout_check.cu).

The GEMM kernel takes a few minutes on two cores (marked ``slow``); a ptxas report of a
serialized wgmma pipeline fails its build (mixgemm.jit.build), so the test also proves that the
e4m3 mainloop keeps its wgmmas asynchronous.
"""
from __future__ import annotations

import subprocess

import pytest

from mixgemm.dtypes import ActType, WeightType
from mixgemm.errors import KernelError
from mixgemm.jit import build, driver
from mixgemm.jit import env as paths
from mixgemm.jit.catalog import FP8_TOKEN_TILES
from mixgemm.jit.specs import Activation, Epilogue, Fp8GemmSpec, QuantFp8Spec

pytestmark = pytest.mark.nvcc


@pytest.fixture
def nvcc(tmp_path, monkeypatch):
    nvcc = paths.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    return nvcc


def test_quantizer_kernels_build(nvcc):
    for act in ActType:
        spec = QuantFp8Spec(act)
        art = build.build(spec)
        cubin = art.read_cubin()
        assert cubin[:4] == b"\x7fELF" and spec.name.encode() in cubin
        assert art.helper_path is None


def test_layout_facts_of_the_e4m3_mainloop(nvcc, tmp_path):
    """The e4m3 A fragment's rows and K columns are e4m3.hpp's order, and the accumulator's rows
    and token columns are what promote() and the token scaling read (for several tiles)."""
    exe = tmp_path / "fp8_layout_check"
    res = subprocess.run([nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-I{paths.cutlass_include_dir()}",
                          str(paths.repo_file("tests/cpp/fp8_layout_check.cu")), "-o", str(exe)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout


def _args(**kw) -> driver.Fp8GemmArgs:
    a = driver.Fp8GemmArgs()
    g = a.gemm
    g.abi_version = driver.ABI_VERSION
    g.m, g.n, g.k, g.group_size, g.sm_count, g.swizzle = 256, 4096, 4096, 128, 132, 1
    g.weight, g.scales, g.zeros, g.x, g.y = 1 << 20, 2 << 20, 5 << 20, 3 << 20, 4 << 20
    g.ldx, g.ldy = 4096, 4096
    a.x_scales = 6 << 20
    for field, value in kw.items():
        setattr(a if field == "x_scales" else g, field, value)
    return a


@pytest.mark.slow
def test_fp8_gemm_kernel_and_helper_build(nvcc):
    """One e4m3 GEMM kernel (u4 with zero points, bf16 out: the tables, the zero rows and the
    group promotion all compiled) and its helper: the checks of abi::Fp8GemmArgs, and the plain
    GemmArgs prepare refused."""
    spec = Fp8GemmSpec(ActType.BF16, WeightType.U4, 128, 128, 128)
    art = build.build(spec)
    cubin = art.read_cubin()
    assert cubin[:4] == b"\x7fELF" and spec.name.encode() in cubin
    helper = driver.HostHelper(str(art.helper_path), spec.name)    # loads without a GPU
    assert helper.params_size > 0 and 48 * 1024 < helper.smem_size <= 227 * 1024
    assert helper.check_fp8(_args()) is None
    assert helper.workspace_size(_args().gemm) == 0 and helper.lock_bytes(_args().gemm) == 0
    for groups in (32, 64, 256, 4096):
        assert helper.check_fp8(_args(group_size=groups)) is None, groups
    for act in (Activation.SILU, Activation.GELU):
        assert helper.check_fp8(_args(activation=act.abi)) is None, act
    assert helper.check_fp8(_args(k=4096 + 64, group_size=4096 + 64)) is None   # a half k-tile at the end
    for field, value, msg in (("group_size", 16, "multiple of 32"), ("group_size", 96, "group_size must divide K"),
                              ("k", 4000, "multiple of 64"), ("n", 4104, "multiple of 16"),
                              ("x", (3 << 20) + 8, "16-byte aligned"), ("ldx", 4100, "row stride"),
                              ("zeros", 0, "zero points"), ("abi_version", 99, "ABI"),
                              ("activation", Activation.SWIGLU.abi, "swiglu"),
                              ("x_scales", 0, "per-token scale pointer"), ("x_scales", (6 << 20) + 4, "16-byte aligned"),
                              ("y", (4 << 20) + 4, "16-byte aligned")):
        why = helper.check_fp8(_args(**{field: value}))
        assert why is not None and msg in why, (field, value, why)
    assert helper.check(_args().gemm) is None        # the plain check: all but the token scales
    with pytest.raises(KernelError, match="mixgemm_fp8_gemm_prepare"):
        helper.prepare(_args().gemm)


@pytest.mark.slow
@pytest.mark.parametrize("tile_n", [t for t in FP8_TOKEN_TILES if t != 128])
def test_the_narrower_token_tiles_build(nvcc, tile_n):
    """The e4m3 GEMM's narrower token tiles (gated, 2-bit: the other epilogue and code width than
    the test above) compile with an asynchronous wgmma pipeline (the build refuses ptxas's
    serialization notes) and their helpers take the same arguments."""
    spec = Fp8GemmSpec(ActType.BF16, WeightType.S2, 128, tile_n, 128, epilogue=Epilogue.SWIGLU)
    art = build.build(spec)
    assert spec.name.encode() in art.read_cubin()
    helper = driver.HostHelper(str(art.helper_path), spec.name)
    assert helper.check_fp8(_args(activation=Activation.SWIGLU.abi)) is None
    assert helper.check_fp8(_args()) == "this kernel's gated epilogue computes swiglu only"
