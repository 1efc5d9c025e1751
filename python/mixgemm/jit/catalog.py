"""The kernel catalog: the tile configs the heuristic picks from (:data:`TILE_CONFIGS`) and their
launch order (:func:`launch_order`), the grouped GEMM's tiles (:data:`GROUPED_GEMM_TILES`), and the
specs built by default (:func:`default_specs` and its parts).

Which kernels exist is decided here; :mod:`mixgemm.jit.render` writes one spec's C++ and
:mod:`mixgemm.jit.build` compiles it.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Union

from ..dtypes import ActType, WeightType
from .specs import (SWIZZLES, Activation, DecodeSpec, DequantSpec, Epilogue, Fp8GemmSpec, GemmSpec,
                    GroupedDecodeSpec, GroupedGemmSpec, IndexType, KernelSpec, MoeCombineSpec, MoeLayoutSpec,
                    MoeRouteSpec, NormSpec, QuantFp8Spec, Raster, RopeSpec, RoutingWeightType, Schedule, Scheduler)


# ---------------------------------------------------------------------------------------------
# The kernel matrix
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A tile/schedule choice shared by all type configs; the heuristic picks among these.
    ``raster`` and ``swizzle`` are the launch's tile order (not part of the kernel); ``cluster_m``
    is :attr:`mixgemm.jit.specs.GemmSpec.cluster_m` (part of the kernel)."""

    label: str
    tile_m: int
    tile_n: int
    tile_k: int
    schedule: Schedule
    scheduler: Scheduler
    raster: Raster = Raster.HEURISTIC
    swizzle: int = 1
    cluster_m: int = 1

    def __post_init__(self):
        if self.swizzle not in SWIZZLES:
            raise ValueError(f"swizzle must be one of {SWIZZLES}, got {self.swizzle!r}")

    def runs(self, spec: "KernelSpec") -> bool:
        """True if ``spec`` is one of this config's kernels."""
        return isinstance(spec, GemmSpec) and \
            (spec.tile_m, spec.tile_n, spec.tile_k, spec.schedule, spec.scheduler, spec.cluster_m) \
            == (self.tile_m, self.tile_n, self.tile_k, self.schedule, self.scheduler, self.cluster_m)

    #: any number of tokens
    max_tokens = None

    def spec(self, act: ActType, weight: WeightType, activation: Activation = Activation.NONE) -> GemmSpec:
        """The config's kernel for a type pair: the gated epilogue for swiglu, else the one that
        takes none / silu / gelu per call."""
        epilogue = Epilogue.SWIGLU if activation is Activation.SWIGLU else Epilogue.BIAS_ACT
        return GemmSpec(act, weight, self.tile_m, self.tile_n, self.tile_k, self.schedule, self.scheduler,
                        epilogue, cluster_m=self.cluster_m)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """A decode-kernel choice shared by all type configs. Every code type gets the same bytes per
    stage (at least one atom: int8's is 1 KiB)."""

    label: str
    tokens: int
    warps: int = 8
    stage_bytes: int = 1024
    stages: int = 4
    #: k-slices (warps per weight stripe) for 8-bit codes; the narrower codes use one warp per stripe
    int8_kslices: int = 1
    #: x ring slots (:attr:`mixgemm.jit.specs.DecodeSpec.x_stages`; 0: x resident) for codes without k-slices
    x_stages: int = 0

    @property
    def max_tokens(self) -> int:
        return self.tokens

    def spec(self, act: ActType, weight: WeightType, activation: Activation = Activation.NONE) -> DecodeSpec:
        stage_bytes = max(self.stage_bytes, 128 * weight.bits)
        kslices = self.int8_kslices if weight.bits == 8 else 1
        x_stages = self.x_stages if kslices == 1 else 0
        return DecodeSpec(act, weight, self.tokens, self.warps, stage_bytes, self.stages, activation, kslices, x_stages)


#: The kernel configs the heuristic (mixgemm.ops.select_tile) chooses from, by token count M:
#:   M <= 8   : "dec8"    decode kernel, 8-token tile (8-bit codes: 8 k-slices, one stripe per CTA:
#:                        measured 2-13% faster at M = 1 on 5 of 6 layers, docs/dispatch.md)
#:   M <= 16  : "dec16"   decode kernel, 16-token tile, x streamed through 4 slots (an x ring: the
#:                        resident 16-row x tile bounds the CTAs per SM; docs/dispatch.md)
#:   M <= 32  : "dec32"   decode kernel, 32-token tile, on layers of at most 2**25 weights
#:   M <= 128 : "mid"     sm90 GEMM 128x64x64,  stream-K, on small layers (M <= 64: at most 2**26
#:                        weights; M <= 128: at most 2**25)
#:              "tall"    sm90 GEMM 256x64x64,  stream-K, on larger layers (M <= 64; M <= 128 below
#:                        60M weights)
#:              "tall128" sm90 GEMM 256x128x64, stream-K, on layers of 60M weights or more (M <= 128)
#:   M <= 256 : "large"   sm90 GEMM 128x128x64, persistent, on layers of at most 48M weights (docs/dispatch.md;
#:                        slower than "mid" at M = 128 and than "xl" on larger layers, docs/dispatch.md)
#:   M <= 512 : "xl"      sm90 GEMM 128x256x64, stream-K, tiles walked along the weight rows in
#:                        swizzled pairs (L2 reuse of the token blocks at large M), on the other layers
#:   M >  512 : "xlp"     sm90 GEMM 128x256x64, persistent, in clusters of two weight tiles that share
#:                        each activation tile (TMA multicast): 3-12% faster than "xl" at every M from
#:                        640 to 2048 on 3584x3584 .. 4096x14336, 2-5% at M = 4096 (docs/dispatch.md); from
#:                        M = 257 on layers of 16384 rows or more (docs/dispatch.md)
#: The GEMM kernels fuse bias + none / silu / gelu (chosen per call), and each config has a second
#: kernel with the gated epilogue for swiglu; the decode kernels fix their activation.
TILE_CONFIGS = (
    DecodeConfig("dec8", 8, int8_kslices=8),
    DecodeConfig("dec16", 16, x_stages=4),
    DecodeConfig("dec32", 32),
    TileConfig("mid", 128, 64, 64, Schedule.COOPERATIVE, Scheduler.STREAMK),
    TileConfig("tall", 256, 64, 64, Schedule.COOPERATIVE, Scheduler.STREAMK),
    TileConfig("tall128", 256, 128, 64, Schedule.COOPERATIVE, Scheduler.STREAMK),
    TileConfig("large", 128, 128, 64, Schedule.COOPERATIVE, Scheduler.PERSISTENT),
    TileConfig("xl", 128, 256, 64, Schedule.COOPERATIVE, Scheduler.STREAMK, Raster.WEIGHT_ROWS, 2),
    TileConfig("xlp", 128, 256, 64, Schedule.COOPERATIVE, Scheduler.PERSISTENT, cluster_m=2),
)


def launch_order(spec: "KernelSpec") -> tuple[Raster, int]:
    """The (raster, swizzle) a GEMM kernel launches with: its tile config's, else the defaults."""
    for tc in TILE_CONFIGS:
        if isinstance(tc, TileConfig) and tc.runs(spec):
            return tc.raster, tc.swizzle
    return Raster.HEURISTIC, 1


ALL_ACTS = (ActType.BF16, ActType.FP16)
ALL_WEIGHTS = (WeightType.S8, WeightType.U8, WeightType.S4, WeightType.U4, WeightType.S2, WeightType.U2)


def default_specs(acts: Iterable[ActType] = ALL_ACTS,
                  weights: Iterable[WeightType] = ALL_WEIGHTS) -> list[KernelSpec]:
    """Every kernel the runtime may pick: each tile config for each type, the dequantizers, and
    the MoE kernels: the grouped decode kernels of :func:`grouped_specs`, the grouped GEMMs of
    :func:`grouped_gemm_specs` and the routing and
    combine kernels of :func:`moe_specs`. Every type has its kernel on every
    path. What ``mixgemm generate --list / --build`` covers."""
    acts, weights = list(acts), list(weights)
    specs: list[KernelSpec] = [tc.spec(a, w) for a in acts for w in weights for tc in TILE_CONFIGS]
    # the GEMM kernels with the gated (swiglu) epilogue
    specs += [tc.spec(a, w, Activation.SWIGLU) for a in acts for w in weights for tc in TILE_CONFIGS
              if isinstance(tc, TileConfig)]
    # the decode kernels with a fused epilogue activation (gemm(..., activation=...) at M <= 16)
    specs += [tc.spec(a, w, act) for a in acts for w in weights for tc in TILE_CONFIGS
              if isinstance(tc, DecodeConfig) for act in Activation if act is not Activation.NONE]
    specs += [DequantSpec(a, w) for a in acts for w in weights]
    specs += grouped_specs(acts, weights)
    specs += grouped_gemm_specs(acts, weights)
    specs += moe_specs(acts)
    specs += layer_specs(acts)
    specs += fp8_specs(acts, weights)
    return specs


#: The e4m3 GEMM's widest tile (weight rows, tokens, k): 128 weight rows (two consumer warp
#: groups of 64) and 128 of k in every kernel; docs/fp8.md says what is left (wider token tiles,
#: clusters, stream-K).
FP8_TILE = (128, 128, 128)

#: The e4m3 GEMM's token tiles (its ``tile_n``), widest first: one kernel each per (output
#: dtype, weight type, epilogue); a call takes the one
#: :func:`mixgemm.dispatch.heuristic.fp8_launch` picks for its token count and layer. Wider
#: ones (192, 256) make ptxas serialize the wgmmas (the group accumulator doubles the registers).
FP8_TOKEN_TILES = (128, 64, 32)


#: The e4m3 GEMM's epilogues: bias + activation (none / silu / gelu) and the gated swiglu.
FP8_EPILOGUES = (Epilogue.BIAS_ACT, Epilogue.SWIGLU)


def fp8_specs(acts: Iterable[ActType] = ALL_ACTS,
              weights: Iterable[WeightType] = ALL_WEIGHTS) -> list[Union[QuantFp8Spec, Fp8GemmSpec]]:
    """The kernels of ``gemm(..., act_format="fp8")``: the activation quantizer of each activation
    type, and the e4m3 GEMM of each token tile (:data:`FP8_TOKEN_TILES`), epilogue
    (:data:`FP8_EPILOGUES`), activation type and weight type whose codes e4m3 holds exactly
    (:attr:`Fp8GemmSpec.WEIGHTS`). Part of :func:`default_specs`."""
    acts, weights = list(acts), list(weights)
    return [QuantFp8Spec(a) for a in acts] + [Fp8GemmSpec(a, w, FP8_TILE[0], tile_n, FP8_TILE[2], epilogue=e)
                                              for e in FP8_EPILOGUES for tile_n in FP8_TOKEN_TILES
                                              for a in acts for w in weights if w.value in Fp8GemmSpec.WEIGHTS]


def norm_specs(acts: Iterable[ActType] = ALL_ACTS) -> list[NormSpec]:
    """The RMSNorm kernels of :func:`mixgemm.rms_norm`, without and with the fused residual add,
    for each activation type. Part of :func:`default_specs`; alone: ``mixgemm generate --build
    --kernels rmsnorm``."""
    return [NormSpec(a, residual) for a in acts for residual in (False, True)]


def rope_specs(acts: Iterable[ActType] = ALL_ACTS) -> list[RopeSpec]:
    """The rotary embedding + KV-cache write kernels of :func:`mixgemm.rotary_kv_cache`, one per
    activation type. Part of :func:`default_specs`; alone: ``mixgemm generate --build --kernels
    rope``."""
    return [RopeSpec(a) for a in acts]


def layer_specs(acts: Iterable[ActType] = ALL_ACTS) -> list[Union[NormSpec, RopeSpec]]:
    """The kernels a decoder layer launches around its GEMMs (``bench --model``'s layer and
    ``benchmarks/tp_bench.py``'s): :func:`norm_specs` and :func:`rope_specs`."""
    acts = list(acts)
    return norm_specs(acts) + rope_specs(acts)


#: The grouped sm90 GEMM's tiles (weight rows x token tile x k) for many rows per expert
#: (:func:`mixgemm.moe.select_grouped_spec` picks by rows per expert with rows): token tiles of
#: 64, 128 and 256 rows, each expert's rows padded to a multiple of it.
GROUPED_GEMM_TILES = {"g64": (128, 64, 64), "g128": (128, 128, 64), "g256": (128, 256, 64)}


def grouped_gemm_specs(acts: Iterable[ActType] = ALL_ACTS,
                       weights: Iterable[WeightType] = ALL_WEIGHTS) -> list[GroupedGemmSpec]:
    """The grouped sm90 GEMM kernels: each tile of :data:`GROUPED_GEMM_TILES` for each type, with
    the epilogue that takes none / silu / gelu and with swiglu. Part of :func:`default_specs`;
    alone: ``mixgemm generate --build --kernels _ggemm_``."""
    return [GroupedGemmSpec(a, w, *tile, epi) for a in acts for w in weights
            for tile in GROUPED_GEMM_TILES.values() for epi in (Epilogue.BIAS_ACT, Epilogue.SWIGLU)]


def moe_specs(acts: Iterable[ActType] = ALL_ACTS) -> list[Union[MoeRouteSpec, MoeCombineSpec, MoeLayoutSpec]]:
    """The MoE routing kernels (int32 and int64 ids) and the combine kernels (each activation
    type x each routing-weight type) and the layout kernel of :func:`mixgemm.moe.fused_moe`. Part of
    :func:`default_specs`; alone: ``mixgemm generate --build --kernels _moe_``."""
    return ([MoeRouteSpec(i) for i in IndexType]
            + [MoeCombineSpec(a, w) for a in acts for w in RoutingWeightType] + [MoeLayoutSpec()])


def grouped_specs(acts: Iterable[ActType] = ALL_ACTS,
                  weights: Iterable[WeightType] = ALL_WEIGHTS) -> list[GroupedDecodeSpec]:
    """The grouped decode kernels :func:`mixgemm.moe.grouped_gemm` may pick: the "dec8" and
    "dec16" decode configs over experts, without an activation and with swiglu (MoE's gate/up).
    Part of :func:`default_specs` (``mixgemm generate --build`` builds them); alone:
    ``mixgemm generate --build --kernels _gdecode_`` or ``build.build_many(catalog.grouped_specs())``."""
    out = []
    for a in acts:
        for w in weights:
            for tc in TILE_CONFIGS:
                if isinstance(tc, DecodeConfig) and tc.label in ("dec8", "dec16"):
                    for act in (Activation.NONE, Activation.SWIGLU):
                        d = tc.spec(a, w, act)
                        out.append(GroupedDecodeSpec(d.act, d.weight, d.tokens, d.warps, d.stage_bytes, d.stages,
                                                     d.activation, d.kslices))
    return out
