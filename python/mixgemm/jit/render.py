"""The C++ of a kernel spec: ``render(spec)``, the CUTLASS instantiation of exactly one kernel.

The specs themselves (frozen dataclasses whose ``name`` encodes every field) are
:mod:`mixgemm.jit.specs`'s, and which ones exist is :mod:`mixgemm.jit.catalog`'s; building and
loading are separate steps (:mod:`mixgemm.jit.build`, :mod:`mixgemm.jit.loader`).

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

import enum
from typing import Optional

from .._version import __version__
from ..dtypes import ActType, WeightType
from .specs import (Activation, DecodeSpec, DequantSpec, Epilogue, Fp8GemmSpec, GemmSpec, GroupedDecodeSpec,
                    GroupedGemmSpec, KernelSpec, MoeCombineSpec, MoeLayoutSpec, MoeRouteSpec, NormSpec, QuantFp8Spec,
                    RopeSpec, Schedule, Scheduler)


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
    from cutlass_library import library   # deferred: heavy: loaded only when a kernel's C++ is rendered
    from cutlass_library import gemm_operation   # deferred: heavy, as above

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


_FP8_CODE = {WeightType.S4: "cutlass::int4b_t", WeightType.U4: "cutlass::uint4b_t",
             WeightType.S2: "cutlass::int2b_t", WeightType.U2: "cutlass::uint2b_t"}
_ACT_CPP = {ActType.BF16: "cutlass::bfloat16_t", ActType.FP16: "cutlass::half_t"}


def _render_fp8_gemm(spec: Fp8GemmSpec) -> str:
    """The e4m3-activation GEMM: CUTLASS's CollectiveBuilders, written here rather than by
    cutlass_library's emitter (whose mixed-input mode takes the scales in the wider operand's
    type, e4m3 here; these kernels keep the weight's bf16/fp16 scales)."""
    n = spec.name
    act = _ACT_CPP[spec.act]
    code = _FP8_CODE[spec.weight]
    pair = f"cute::tuple<{code}, {act}, {act}>" if spec.weight.has_zero else f"cute::tuple<{code}, {act}>"
    tile = f"cute::Shape<cute::_{spec.tile_m}, cute::_{spec.tile_n}, cute::_{spec.tile_k}>"
    cluster = "cute::Shape<cute::_1, cute::_1, cute::_1>"
    align_a = 128 // spec.weight.bits
    stages = (f"cutlass::gemm::collective::StageCount<{spec.stages}>" if spec.stages else
              f"cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename "
              f"{n}_epilogue::SharedStorage))>")
    include = '#include "mixgemm/gemm_prelude_fp8.hpp"'
    scheduler = "cutlass::gemm::PersistentScheduler"
    if spec.scheduler is Scheduler.STREAMK:
        include += '\n#include "mixgemm/streamk_scheduler.hpp"'
        scheduler = "mixgemm::StreamKSelfResetting"
    if spec.epilogue is Epilogue.SWIGLU:   # the bf16 kernels' gated epilogue
        include += '\n#include "mixgemm/epilogue_gated.hpp"'
        schedule, functor = "mixgemm::EpilogueGatedNoSmem", f"mixgemm::epilogue::Swiglu<{act}, float, void, float>"
    else:
        schedule = "cutlass::epilogue::TmaWarpSpecializedCooperative"
        functor = f"mixgemm::epilogue::PerRowBiasAct<{act}, float, void, float>"
    return f"""{include}

using {n}_epilogue =
  typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    {tile},
    {cluster},
    cutlass::epilogue::collective::EpilogueTileAuto,
    float, float,
    void, cutlass::layout::ColumnMajor, 0,
    {act}, cutlass::layout::ColumnMajor, 8,
    {schedule},
    {functor}
  >::CollectiveOp;

using {n}_mainloop =
  typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    {pair}, mixgemm::layout::PrepackedSm90, {align_a},
    cutlass::float_e4m3_t, cutlass::layout::ColumnMajor, 16,
    float,
    {tile},
    {cluster},
    {stages},
    mixgemm::KernelPrepackedFp8Cooperative
  >::CollectiveOp;

struct {n}_op : cutlass::gemm::kernel::GemmUniversal<
    cute::Shape<int, int, int, int>, {n}_mainloop, {n}_epilogue, {scheduler}> {{}};

static_assert(mixgemm::uses_prepacked_fp8_mainloop_v<{n}_op>,
              "{n}: the builder did not select mixgemm's e4m3 prepacked mainloop");

MIXGEMM_FP8_GEMM_ENTRY({n}, {n}_op)
"""


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
    if isinstance(spec, QuantFp8Spec):
        L, _ = _cutlass_library()
        act = L.DataTypeTag[getattr(L.DataType, _ACT_DATATYPE[spec.act])]
        return head + '#include "mixgemm/quant_fp8_kernel.hpp"\n\n' + f"MIXGEMM_QUANT_FP8_ENTRY({spec.name}, {act})\n"
    if isinstance(spec, Fp8GemmSpec):
        return head + _render_fp8_gemm(spec)
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


