"""Kernel specs and rendering (no compiler needed)."""
from __future__ import annotations

import dataclasses

import pytest

from mixgemm.jit import catalog
from mixgemm.jit import render as codegen
from mixgemm.jit.render import render
from mixgemm.jit.catalog import ALL_ACTS, ALL_WEIGHTS, TILE_CONFIGS, TileConfig, default_specs
from mixgemm.jit.specs import (Activation, DecodeSpec, DequantSpec, Epilogue, GemmSpec, Raster, Schedule, Scheduler,
                           parse_name)
from mixgemm.dtypes import ActType, WeightType

SPECS = default_specs()


def test_every_type_has_every_kernel():
    """Every (activation, weight) pair has a kernel for every tile config and a dequantizer."""
    names = {s.name for s in SPECS}
    for act in ALL_ACTS:
        for wt in ALL_WEIGHTS:
            for tc in TILE_CONFIGS:
                assert tc.spec(act, wt).name in names
                # swiglu on every path: a decode kernel that fixes it, or a GEMM with the gated epilogue
                assert tc.spec(act, wt, Activation.SWIGLU).name in names
            assert DequantSpec(act, wt).name in names
    assert len(names) == len(SPECS), "kernel names must be unique"
    # the grouped (MoE) decode kernels: `mixgemm generate --list / --build` covers them
    assert {s.name for s in catalog.grouped_specs()} <= names
    assert len(catalog.grouped_specs()) == 2 * 6 * 2 * 2          # acts x weights x (dec8, dec16) x (none, swiglu)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_name_encodes_every_field(spec):
    assert parse_name(spec.name) == spec


def test_name_distinguishes_fields():
    base = GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64)
    variants = [
        GemmSpec(ActType.FP16, WeightType.U4, 128, 64, 64),
        GemmSpec(ActType.BF16, WeightType.S4, 128, 64, 64),
        GemmSpec(ActType.BF16, WeightType.U4, 256, 64, 64),
        GemmSpec(ActType.BF16, WeightType.U4, 128, 128, 64),
        GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 128),
        GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64, Schedule.PINGPONG),
        GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64, scheduler=Scheduler.STREAMK),
        GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64, stages=4),
        GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64, cluster_m=2),
    ]
    assert len({base.name, *(v.name for v in variants)}) == len(variants) + 1


@pytest.mark.parametrize("kw,match", [
    (dict(tile_m=96), "tile_m"),
    (dict(tile_m=64), "cooperative"),
    (dict(tile_n=12), "tile_n"),
    (dict(tile_k=32), "tile_k"),
    (dict(stages=1), "stages"),
    (dict(cluster_m=3), "cluster_m"),
])
def test_invalid_specs_rejected(kw, match):
    args = dict(act=ActType.BF16, weight=WeightType.U4, tile_m=128, tile_n=64, tile_k=64)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        GemmSpec(**args)


def test_decode_kslices_in_name_and_validated():
    """k-slices (warps per weight stripe) are a decode kernel field: in the name, in the rendered
    Config, and checked (a power of two that divides the warps)."""
    one = DecodeSpec(ActType.BF16, WeightType.U4, 8)
    eight = DecodeSpec(ActType.BF16, WeightType.U4, 8, kslices=8)
    assert one.name != eight.name and "_k8_" in eight.name and "_k1_" in one.name
    assert parse_name(eight.name) == eight
    assert render(eight).rstrip().splitlines()[-2].endswith("1024, 4, 8, 0>;")
    for bad in (3, 16, 0):
        with pytest.raises(ValueError, match="kslices"):
            DecodeSpec(ActType.BF16, WeightType.U4, 8, warps=8 if bad != 16 else 4, kslices=bad)


def test_decode_x_ring_in_name_and_validated():
    """The x ring (x_stages slots streaming x) is a decode kernel field: in the name only when on
    (the resident-x kernels keep their names), in the rendered Config, parsed back, and checked
    (2-8 slots, one warp per stripe)."""
    plain = DecodeSpec(ActType.BF16, WeightType.U4, 16)
    ring = DecodeSpec(ActType.BF16, WeightType.U4, 16, activation=Activation.SWIGLU, x_stages=4)
    assert "_x" not in plain.name and ring.name.endswith("_k1_x4_swiglu")
    assert parse_name(ring.name) == ring and parse_name(plain.name) == plain
    assert render(ring).rstrip().splitlines()[-2].endswith("1024, 4, 1, 4>;")
    for bad, ks in ((1, 1), (9, 1), (4, 8)):
        with pytest.raises(ValueError, match="x_stages"):
            DecodeSpec(ActType.BF16, WeightType.S8, 8, kslices=ks, x_stages=bad)


def test_dec8_slices_only_8bit_codes():
    """The heuristic's 8-token decode kernel uses 8 k-slices for 8-bit codes (measured faster,
    docs/decode.md) and one warp per stripe for 4- and 2-bit codes; the 16- and 32-token tiles never slice."""
    by_label = {tc.label: tc for tc in TILE_CONFIGS}
    for wt in ALL_WEIGHTS:
        assert by_label["dec8"].spec(ActType.BF16, wt).kslices == (8 if wt.bits == 8 else 1)
        assert by_label["dec16"].spec(ActType.BF16, wt).kslices == 1
        assert by_label["dec32"].spec(ActType.BF16, wt).kslices == 1


def test_parse_name_rejects_garbage():
    with pytest.raises(ValueError):
        parse_name("cutlass3x_sm90_tensorop_gemm")


@pytest.mark.parametrize("wt", ALL_WEIGHTS, ids=lambda w: w.value)
def test_render_uses_mixgemm_mainloop_layout_and_converters(wt):
    spec = GemmSpec(ActType.BF16, wt, 128, 64, 64, scheduler=Scheduler.STREAMK)
    src = render(spec)
    code = {WeightType.S8: "int8_t", WeightType.U8: "uint8_t", WeightType.S4: "cutlass::int4b_t",
            WeightType.U4: "cutlass::uint4b_t", WeightType.S2: "cutlass::int2b_t", WeightType.U2: "cutlass::uint2b_t"}[wt]
    # cutlass_library's mixed-input element tuple: (code, scale[, zero])
    if wt.signed:
        assert f"cute::tuple<{code}, cutlass::bfloat16_t>" in src
    else:
        assert f"cute::tuple<{code}, cutlass::bfloat16_t, cutlass::bfloat16_t>" in src
    assert "mixgemm::layout::PrepackedSm90" in src           # our layout tag for operand A
    assert "mixgemm::KernelPrepackedCooperative" in src      # routes the builder to our mainloop
    assert "mixgemm::epilogue::PerRowBias" in src
    # stream-K with its locks apart and self-resetting (no memset per launch)
    assert "mixgemm::StreamKSelfResetting" in src and "cutlass::gemm::StreamKScheduler" not in src
    assert '#include "mixgemm/streamk_scheduler.hpp"' in src
    assert '#include "mixgemm/gemm_prelude.hpp"' in src        # our collective + converters
    assert f"static_assert(mixgemm::uses_prepacked_mainloop_v<{spec.name}_op>" in src
    assert f"MIXGEMM_GEMM_ENTRY({spec.name}, {spec.name}_op)" in src
    assert src.count("CollectiveBuilder<") == 2                # one instantiation per file


def test_render_is_deterministic_and_distinct():
    a = GemmSpec(ActType.FP16, WeightType.S2, 128, 16, 128, scheduler=Scheduler.STREAMK)
    b = GemmSpec(ActType.FP16, WeightType.S2, 128, 16, 64, scheduler=Scheduler.STREAMK)
    assert render(a) == render(a)
    assert render(a) != render(b)
    assert "cute::Shape<cute::_128, cute::_16, cute::_128>" in render(a)
    assert "cutlass::half_t" in render(a)


def test_render_pingpong_uses_pingpong_epilogue():
    src = render(GemmSpec(ActType.BF16, WeightType.U4, 64, 64, 64, Schedule.PINGPONG))
    assert "mixgemm::KernelPrepackedPingpong" in src
    assert "cutlass::epilogue::TmaWarpSpecialized," in src


def test_render_cluster_shape():
    """cluster_m reaches the kernel's cluster shape (the mainloop multicasts the activation tile
    along it); without it the cluster is 1x1x1 and the name carries no cluster field."""
    one = GemmSpec(ActType.BF16, WeightType.U4, 128, 256, 64, scheduler=Scheduler.PERSISTENT)
    two = dataclasses.replace(one, cluster_m=2)
    assert "_c2_" in two.name and "_c" not in one.name.split("_t128x256x64")[1].split("_coop")[0]
    assert "cute::Shape<cute::_2, cute::_1, cute::_1>" in render(two)
    assert "cute::Shape<cute::_2, cute::_1, cute::_1>" not in render(one)
    assert "cute::Shape<cute::_1, cute::_1, cute::_1>" in render(one)
    # the grouped GEMM's scheduler runs without clusters: its kernels never take one
    assert all(s.dense.cluster_m == 1 for s in catalog.grouped_gemm_specs())


def test_render_dequant():
    src = render(DequantSpec(ActType.FP16, WeightType.U2))
    assert "MIXGEMM_DEQUANT_ENTRY(mixgemm_dequant_fp16_u2, cutlass::uint2b_t, cutlass::half_t, true)" in src
    assert '#include "mixgemm/dequant_kernel.hpp"' in src


def test_cutlass_library_tag_tables_extended_not_forked():
    from cutlass_library import library as L
    codegen.render(GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64))
    # our entries live in cutlass_library's own tables, next to the stock ones
    assert "mixgemm::layout::PrepackedSm90" in L.LayoutTag.values()
    assert "mixgemm::KernelPrepackedCooperative" in L.KernelScheduleTag.values()
    assert L.LayoutTag[L.LayoutType.RowMajor] == "cutlass::layout::RowMajor"
    n = len(L.KernelScheduleTag)
    codegen.render(GemmSpec(ActType.BF16, WeightType.U4, 128, 64, 64))
    assert len(L.KernelScheduleTag) == n, "registering twice must not add entries"


def test_activation_enum_mirrors_the_header():
    """specs.Activation's C++ names and ABI values are those of cutlass_ext/mixgemm/activation.hpp
    (the GEMM kernels read the value at run time: a mismatch would apply the wrong function)."""
    import re
    from pathlib import Path

    from mixgemm.jit.specs import Activation

    header = (Path(__file__).resolve().parents[2] / "cutlass_ext/mixgemm/activation.hpp").read_text()
    body = re.search(r"enum class Activation : int \{([^}]*)\}", header).group(1)
    cpp = {name: int(value) for name, value in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}
    assert cpp == {a.cpp: a.abi for a in Activation}


def test_gemm_specs_fuse_the_runtime_activation():
    """The default GEMM kernels are, per tile config and type, one with the bias + runtime-activation
    epilogue (none, silu and gelu) and one with the gated (swiglu) epilogue; the bias-only epilogue
    stays renderable."""
    from mixgemm.jit.render import render
    from mixgemm.jit.catalog import default_specs
    from mixgemm.jit.specs import Epilogue, GemmSpec

    gemms = [s for s in default_specs() if isinstance(s, GemmSpec)]
    by_epilogue = {e: [s for s in gemms if s.epilogue is e] for e in Epilogue}
    assert len(by_epilogue[Epilogue.BIAS_ACT]) == len(by_epilogue[Epilogue.SWIGLU]) == len(gemms) // 2 > 0
    assert {dataclasses.replace(s, epilogue=Epilogue.SWIGLU) for s in by_epilogue[Epilogue.BIAS_ACT]} == \
        set(by_epilogue[Epilogue.SWIGLU])
    assert "mixgemm::epilogue::PerRowBiasAct" in render(gemms[0])
    gated = render(by_epilogue[Epilogue.SWIGLU][0])
    # the builder is routed to the gated epilogue by its schedule tag, and the header comes along
    assert "mixgemm::EpilogueGatedNoSmem" in gated and '#include "mixgemm/epilogue_gated.hpp"' in gated
    assert "mixgemm::epilogue::Swiglu<" in gated and "PerRowBias" not in gated
    assert "epilogue_gated.hpp" not in render(gemms[0])
    plain = GemmSpec(gemms[0].act, gemms[0].weight, 128, 64, 64, epilogue=Epilogue.BIAS)
    src = render(plain)
    assert "mixgemm::epilogue::PerRowBias<" in src or "mixgemm::epilogue::PerRowBias," in src
    assert "PerRowBiasAct" not in src


def test_heuristic_by_tokens_and_output_tiles():
    """select_tile: decode kernels up to 16 tokens (32 on small layers); up to 128 tokens the
    128x64 stream-K GEMM on small layers and the 256-row stream-K GEMMs on large ones; then the
    128x256 stream-K GEMM (whatever its tile count: stream-K fills the SMs) up to 512 tokens
    (256 on layers of 16384 rows or more), and above that the same tile persistent in 2x1
    clusters."""
    from mixgemm.ops.dense import select_tile

    assert [select_tile(m, 4096, 4096).label for m in (1, 8, 9, 16, 17, 32, 33, 128)] == \
        ["dec8", "dec8", "dec16", "dec16", "dec32", "dec32", "mid", "mid"]
    assert select_tile(32, 6144, 4096).label == "dec32"     # 25.2M weights
    assert select_tile(32, 4096, 14336).label == "mid"      # 58.7M weights
    assert select_tile(64, 8192, 8192).label == "mid"       # 2**26 weights
    assert select_tile(17, 10240, 8192).label == "tall"     # 83.9M weights
    assert select_tile(64, 28672, 8192).label == "tall"
    assert select_tile(65, 6144, 4096).label == "mid"
    assert select_tile(65, 4096, 14336).label == "tall"
    assert [select_tile(m, 8192, 8192).label for m in (65, 128, 129)] == ["tall128", "tall128", "xl"]
    assert select_tile(129, 28672, 8192).label == "xl"
    assert select_tile(256, 8192, 8192).label == "xl"       # 1 x 64 tiles, stream-K over 132 SMs
    # up to 256 tokens on small layers (<= 48M weights): the persistent 128x128 tile
    assert [select_tile(m, 7168, 5120).label for m in (129, 256, 257)] == ["large", "large", "xl"]
    assert select_tile(256, 3584, 3584).label == "large" and select_tile(256, 4096, 14336).label == "xl"
    assert select_tile(512, 4096, 14336).label == "xl"
    # 257-512 tokens: the clustered persistent tile on layers of at least 16384 rows
    assert [select_tile(m, 28672, 4096).label for m in (256, 257, 512, 513)] == ["xl", "xlp", "xlp", "xlp"]
    assert [select_tile(m, 16384, 4096).label for m in (257, 512)] == ["xlp", "xlp"]
    assert [select_tile(m, 16368, 8192).label for m in (257, 512, 513)] == ["xl", "xl", "xlp"]
    assert [select_tile(m, 4096, 14336).label for m in (513, 4096, 16384)] == ["xlp"] * 3
    assert select_tile(16384, 6144, 4096).label == "xlp"
    tall, tall128 = select_tile(64, 57344, 8192), select_tile(128, 57344, 8192)
    assert (tall.tile_m, tall.tile_n, tall.scheduler) == (256, 64, Scheduler.STREAMK)
    assert (tall128.tile_m, tall128.tile_n, tall128.scheduler) == (256, 128, Scheduler.STREAMK)
    xl = select_tile(512, 6144, 4096)
    assert xl.scheduler is Scheduler.STREAMK and (xl.raster, xl.swizzle) == (Raster.WEIGHT_ROWS, 2)
    xlp = select_tile(4096, 6144, 4096)
    assert (xlp.tile_m, xlp.tile_n, xlp.scheduler, xlp.cluster_m) == (128, 256, Scheduler.PERSISTENT, 2)
    assert xlp.spec(ActType.BF16, WeightType.U4).name == "mixgemm_gemm_bf16_u4_t128x256x64_c2_coop_persistent_biasact_s0"


def test_launch_order_follows_the_tile_config():
    """A GEMM kernel launches with its config's tile order; a kernel outside the configs (or a
    decode kernel) with CUTLASS's defaults."""
    from mixgemm.jit.catalog import TILE_CONFIGS, launch_order
    from mixgemm.jit.specs import SWIZZLES

    for tc in TILE_CONFIGS:
        if isinstance(tc, TileConfig):
            spec = tc.spec(ActType.BF16, WeightType.U4)
            assert launch_order(spec) == (tc.raster, tc.swizzle)
            assert launch_order(tc.spec(ActType.FP16, WeightType.S2, Activation.SWIGLU)) == (tc.raster, tc.swizzle)
    other = GemmSpec(ActType.BF16, WeightType.U4, 128, 256, 64, Schedule.COOPERATIVE, Scheduler.PERSISTENT)
    assert launch_order(other) == (Raster.HEURISTIC, 1)
    assert launch_order(DecodeSpec(ActType.BF16, WeightType.U4)) == (Raster.HEURISTIC, 1)
    assert 2 in SWIZZLES
    with pytest.raises(ValueError, match="swizzle"):
        TileConfig("bad", 128, 128, 64, Schedule.COOPERATIVE, Scheduler.PERSISTENT, Raster.TOKENS, 3)
