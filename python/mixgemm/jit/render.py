"""Kernel generation: the kernel matrix and the CUTLASS C++ instantiations of kernel specs.

The specs themselves (frozen dataclasses whose ``name`` encodes every field) are
:mod:`mixgemm.jit.specs`'s. This module chooses and generates: the tile configs the heuristic picks
from (:data:`TILE_CONFIGS`) and their launch order (:func:`launch_order`), the specs built by
default (:func:`default_specs` and its parts), and ``render(spec)``, the C++ source of exactly one
instantiation; building and loading are separate steps (:mod:`mixgemm.jit.build`,
:mod:`mixgemm.jit.loader`).

GEMM kernels are emitted by ``cutlass_library`` (nvidia-cutlass 4.2): its 3.x emitter writes the
CollectiveBuilder instantiations, with mixgemm's own tags registered in its tag tables:

* ``LayoutTag``: the prepacked weight layout ``mixgemm::layout::PrepackedSm90``;
* ``KernelScheduleTag``: ``mixgemm::KernelPrepacked{Cooperative,Pingpong}``, which route the
  builder to mixgemm's mainloop (``cutlass_ext/mixgemm/collective``);
* ``EpilogueFunctor3xTag``: the per-row-bias fusions ``mixgemm::epilogue::PerRowBias`` and
  ``PerRowBiasAct`` (bias, then silu / gelu chosen at run time), and ``Swiglu``;
* ``EpilogueScheduleTag``: ``mixgemm::EpilogueGatedNoSmem``, which routes the epilogue builder to
  mixgemm's gated epilogue (``cutlass_ext/mixgemm/epilogue_gated.hpp``: silu(gate) * up from
  registers, N/2 outputs).

The generated files only name types and tile shapes; all logic lives in ``cutlass_ext/`` and
``converters/``.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Iterable, Optional, Union

from .._version import __version__
from .specs import (SWIZZLES, Activation, DecodeSpec, DequantSpec, Epilogue, GemmSpec, GroupedDecodeSpec,
                    GroupedGemmSpec, IndexType, KernelSpec, MoeCombineSpec, MoeLayoutSpec, MoeRouteSpec, NormSpec,
                    Raster, RopeSpec, RoutingWeightType, Schedule, Scheduler)
from ..weights.types import ActType, WeightType


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
#:                        measured 2-13% faster at M = 1 on 5 of 6 layers, NOTES 9b)
#:   M <= 16  : "dec16"   decode kernel, 16-token tile, x streamed through 4 slots (an x ring: the
#:                        resident 16-row x tile bounds the CTAs per SM; NOTES 23b)
#:   M <= 32  : "dec32"   decode kernel, 32-token tile, on layers of at most 2**25 weights
#:   M <= 128 : "mid"     sm90 GEMM 128x64x64,  stream-K, on small layers (M <= 64: at most 2**26
#:                        weights; M <= 128: at most 2**25)
#:              "tall"    sm90 GEMM 256x64x64,  stream-K, on larger layers (M <= 64; M <= 128 below
#:                        60M weights)
#:              "tall128" sm90 GEMM 256x128x64, stream-K, on layers of 60M weights or more (M <= 128)
#:   M <= 256 : "large"   sm90 GEMM 128x128x64, persistent, on layers of at most 48M weights (NOTES 9g;
#:                        slower than "mid" at M = 128 and than "xl" on larger layers, NOTES 7b)
#:   M <= 512 : "xl"      sm90 GEMM 128x256x64, stream-K, tiles walked along the weight rows in
#:                        swizzled pairs (L2 reuse of the token blocks at large M), on the other layers
#:   M >  512 : "xlp"     sm90 GEMM 128x256x64, persistent, in clusters of two weight tiles that share
#:                        each activation tile (TMA multicast): 3-12% faster than "xl" at every M from
#:                        640 to 2048 on 3584x3584 .. 4096x14336, 2-5% at M = 4096 (NOTES 30c); from
#:                        M = 257 on layers of 16384 rows or more (NOTES 30f)
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
    return specs


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
    ``mixgemm generate --build --kernels _gdecode_`` or ``build.build_many(codegen.grouped_specs())``."""
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


# ---------------------------------------------------------------------------------------------
# cutlass_library integration
# ---------------------------------------------------------------------------------------------
#: cutlass_library ``DataType`` names of the weight codes and activations
_DATATYPE = {
    WeightType.S8: "s8", WeightType.U8: "u8", WeightType.S4: "s4",
    WeightType.U4: "u4", WeightType.S2: "s2", WeightType.U2: "u2",
}
_ACT_DATATYPE = {ActType.BF16: "bf16", ActType.FP16: "f16"}


class _MixgemmLayout(enum.Enum):
    PrepackedSm90 = enum.auto()


class _MixgemmKernelSchedule(enum.Enum):
    PrepackedCooperative = enum.auto()
    PrepackedPingpong = enum.auto()


class _MixgemmEpilogueFunctor(enum.Enum):
    PerRowBias = enum.auto()
    PerRowBiasAct = enum.auto()
    Swiglu = enum.auto()


class _MixgemmEpilogueSchedule(enum.Enum):
    GatedNoSmem = enum.auto()


class _MixgemmTileScheduler(enum.Enum):
    GroupedTokenTiles = enum.auto()
    StreamKSelfResetting = enum.auto()


_TAGS = {
    "LayoutTag": {_MixgemmLayout.PrepackedSm90: "mixgemm::layout::PrepackedSm90"},
    "KernelScheduleTag": {
        _MixgemmKernelSchedule.PrepackedCooperative: "mixgemm::KernelPrepackedCooperative",
        _MixgemmKernelSchedule.PrepackedPingpong: "mixgemm::KernelPrepackedPingpong",
    },
    "EpilogueFunctor3xTag": {_MixgemmEpilogueFunctor.PerRowBias: "mixgemm::epilogue::PerRowBias",
                             _MixgemmEpilogueFunctor.PerRowBiasAct: "mixgemm::epilogue::PerRowBiasAct",
                             _MixgemmEpilogueFunctor.Swiglu: "mixgemm::epilogue::Swiglu"},
    "EpilogueScheduleTag": {_MixgemmEpilogueSchedule.GatedNoSmem: "mixgemm::EpilogueGatedNoSmem"},
    "TileSchedulerTag": {_MixgemmTileScheduler.GroupedTokenTiles: "mixgemm::GroupedTokenTiles",
                         _MixgemmTileScheduler.StreamKSelfResetting: "mixgemm::StreamKSelfResetting"},
    "TileSchedulerSuffixes": {_MixgemmTileScheduler.GroupedTokenTiles: "_grouped_token_tiles",
                              _MixgemmTileScheduler.StreamKSelfResetting: "_stream_k_self_resetting"},
}


_EPILOGUE_FUNCTOR = {Epilogue.BIAS: _MixgemmEpilogueFunctor.PerRowBias,
                     Epilogue.BIAS_ACT: _MixgemmEpilogueFunctor.PerRowBiasAct,
                     Epilogue.SWIGLU: _MixgemmEpilogueFunctor.Swiglu}


def _cutlass_library():
    """Import cutlass_library and extend its tag tables with mixgemm's tags (idempotent: the
    entries are keyed by mixgemm's own enums, so registering twice changes nothing)."""
    from cutlass_library import library
    from cutlass_library import gemm_operation

    for table, entries in _TAGS.items():
        getattr(library, table).update(entries)
    return library, gemm_operation


def _gemm_operation(spec: GemmSpec, grouped: bool = False, name: Optional[str] = None):
    """cutlass_library's operation for ``spec``, named ``name`` (default: the spec's name + "_op");
    ``grouped``: with mixgemm's grouped scheduler."""
    L, G = _cutlass_library()

    class _NamedGemmOperation(G.GemmOperation):
        """cutlass_library's GemmOperation, named after the spec instead of its procedural name."""

        def __init__(self, name: str, **kw):
            super().__init__(**kw)
            self._mixgemm_name = name

        def procedural_name(self) -> str:
            return self._mixgemm_name

    act = getattr(L.DataType, _ACT_DATATYPE[spec.act])
    code = getattr(L.DataType, _DATATYPE[spec.weight])
    math = L.MathInstruction([64, spec.tile_n, 16], act, act, L.DataType.f32,
                             L.OpcodeClass.TensorOp, L.MathOperation.multiply_add)
    tile = L.TileDescription([spec.tile_m, spec.tile_n, spec.tile_k], spec.stages, [4, 1, 1], math, 90, 90,
                             [spec.cluster_m, 1, 1])
    if spec.schedule is Schedule.COOPERATIVE:
        kernel_schedule = _MixgemmKernelSchedule.PrepackedCooperative
        epilogue_schedule = L.EpilogueScheduleType.TmaWarpSpecializedCooperative
    else:
        kernel_schedule = _MixgemmKernelSchedule.PrepackedPingpong
        epilogue_schedule = L.EpilogueScheduleType.TmaWarpSpecialized
    if spec.epilogue is Epilogue.SWIGLU:
        epilogue_schedule = _MixgemmEpilogueSchedule.GatedNoSmem
    # stream-K: CUTLASS's scheduler with its locks apart and self-resetting (streamk_scheduler.hpp)
    scheduler = {Scheduler.PERSISTENT: L.TileSchedulerType.Persistent,
                 Scheduler.STREAMK: _MixgemmTileScheduler.StreamKSelfResetting}[spec.scheduler]
    if grouped:
        scheduler = _MixgemmTileScheduler.GroupedTokenTiles
    mode = L.MixedInputMode.ScaleOnly if spec.weight.signed else L.MixedInputMode.ScaleWithZeroPoint
    align_a = 128 // spec.weight.bits
    return _NamedGemmOperation(
        name or f"{spec.name}_op",
        gemm_kind=L.GemmKind.Universal3x, arch=90, tile_description=tile,
        A=L.TensorDescription(code, _MixgemmLayout.PrepackedSm90, align_a),
        B=L.TensorDescription(act, L.LayoutType.ColumnMajor, 8),
        C=L.TensorDescription(L.DataType.void, L.LayoutType.ColumnMajor, 8),
        D=L.TensorDescription(act, L.LayoutType.ColumnMajor, 8),
        element_epilogue=L.DataType.f32, epilogue_functor=_EPILOGUE_FUNCTOR[spec.epilogue],
        kernel_schedule=kernel_schedule, epilogue_schedule=epilogue_schedule,
        tile_scheduler=scheduler, mixed_input_mode=mode)


_HEADER = """\
// Generated by mixgemm {version} (python/mixgemm/jit/render.py). Do not edit.
// Kernel: {name}
// Spec:   {spec!r}
"""


def render(spec: KernelSpec) -> str:
    """C++ source of exactly one kernel instantiation (types and tiles only)."""
    head = _HEADER.format(version=__version__, name=spec.name, spec=spec)
    if isinstance(spec, DecodeSpec):
        L, _ = _cutlass_library()
        code = L.DataTypeTag[getattr(L.DataType, _DATATYPE[spec.weight])]
        act = L.DataTypeTag[getattr(L.DataType, _ACT_DATATYPE[spec.act])]
        ntiles = spec.tokens // 8
        return (head + '#include "mixgemm/decode_kernel.hpp"\n\n'
                f"using {spec.name}_config = mixgemm::decode::Config<{code}, {act}, {ntiles}, {spec.warps}, "
                f"{spec.stage_bytes}, {spec.stages}, {spec.kslices}, {spec.x_stages}>;\n"
                f"MIXGEMM_DECODE_ENTRY({spec.name}, {spec.name}_config, mixgemm::Activation::{spec.activation.cpp})\n")
    if isinstance(spec, GroupedDecodeSpec):
        L, _ = _cutlass_library()
        code = L.DataTypeTag[getattr(L.DataType, _DATATYPE[spec.weight])]
        act = L.DataTypeTag[getattr(L.DataType, _ACT_DATATYPE[spec.act])]
        return (head + '#include "mixgemm/grouped_decode_kernel.hpp"\n\n'
                f"using {spec.name}_config = mixgemm::decode::Config<{code}, {act}, {spec.tokens // 8}, "
                f"{spec.warps}, {spec.stage_bytes}, {spec.stages}, {spec.kslices}>;\n"
                f"MIXGEMM_GROUPED_DECODE_ENTRY({spec.name}, {spec.name}_config, "
                f"mixgemm::Activation::{spec.activation.cpp})\n")
    if isinstance(spec, DequantSpec):
        L, _ = _cutlass_library()
        code = L.DataTypeTag[getattr(L.DataType, _DATATYPE[spec.weight])]
        act = L.DataTypeTag[getattr(L.DataType, _ACT_DATATYPE[spec.act])]
        return (head + '#include "mixgemm/dequant_kernel.hpp"\n\n'
                f"MIXGEMM_DEQUANT_ENTRY({spec.name}, {code}, {act}, {str(spec.weight.has_zero).lower()})\n")
    if isinstance(spec, MoeRouteSpec):
        return (head + '#include "mixgemm/moe_route_kernel.hpp"\n\n'
                f"MIXGEMM_MOE_ROUTE_ENTRY({spec.name}, {spec.index.cpp})\n")
    if isinstance(spec, MoeLayoutSpec):
        return head + '#include "mixgemm/moe_layout_kernel.hpp"\n\n' + f"MIXGEMM_MOE_LAYOUT_ENTRY({spec.name})\n"
    if isinstance(spec, MoeCombineSpec):
        L, _ = _cutlass_library()
        act = L.DataTypeTag[getattr(L.DataType, _ACT_DATATYPE[spec.act])]
        return (head + '#include "mixgemm/moe_route_kernel.hpp"\n\n'
                f"MIXGEMM_MOE_COMBINE_ENTRY({spec.name}, {act}, {spec.weight.cpp})\n")
    if isinstance(spec, NormSpec):
        L, _ = _cutlass_library()
        act = L.DataTypeTag[getattr(L.DataType, _ACT_DATATYPE[spec.act])]
        return (head + '#include "mixgemm/norm_kernel.hpp"\n\n'
                f"MIXGEMM_RMS_NORM_ENTRY({spec.name}, {act}, {str(spec.residual).lower()})\n")
    if isinstance(spec, RopeSpec):
        L, _ = _cutlass_library()
        act = L.DataTypeTag[getattr(L.DataType, _ACT_DATATYPE[spec.act])]
        return head + '#include "mixgemm/rope_kernel.hpp"\n\n' + f"MIXGEMM_ROPE_KV_ENTRY({spec.name}, {act})\n"
    grouped = isinstance(spec, GroupedGemmSpec)
    if not isinstance(spec, GemmSpec) and not grouped:
        raise TypeError(f"not a kernel spec: {spec!r}")
    _, G = _cutlass_library()
    dense = spec.dense if grouped else spec
    op = _gemm_operation(dense, grouped, f"{spec.name}_op")
    body = G.EmitGemmUniversal3xInstance().emit(op)
    op_name = op.procedural_name()
    include = '#include "mixgemm/gemm_prelude.hpp"\n'
    if grouped:
        include += '#include "mixgemm/grouped_scheduler.hpp"\n'
    elif dense.scheduler is Scheduler.STREAMK:
        include += '#include "mixgemm/streamk_scheduler.hpp"\n'
    if dense.epilogue is Epilogue.SWIGLU:
        include += '#include "mixgemm/epilogue_gated.hpp"\n'
    entry = "MIXGEMM_GROUPED_GEMM_ENTRY" if grouped else "MIXGEMM_GEMM_ENTRY"
    return (head + include + body +
            f"\nstatic_assert(mixgemm::uses_prepacked_mainloop_v<{op_name}>,\n"
            f'              "{spec.name}: the builder did not select mixgemm\'s prepacked mainloop");\n\n'
            f"{entry}({spec.name}, {op_name})\n")


