"""Kernel generation: frozen kernel specs and their CUTLASS C++ instantiations.

Every kernel mixgemm can run is described by a frozen spec dataclass whose ``name`` encodes
every field. That name is the cubin's kernel symbol, the generated file's name, the cache-key
prefix and the test id. ``render(spec)`` returns the C++ source of exactly one instantiation;
building and loading are separate steps (:mod:`mixgemm.build`, :mod:`mixgemm.runtime`).

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
import re
from typing import Iterable, Union

from ._version import __version__
from .types import ActType, WeightType


class Schedule(enum.Enum):
    """sm90 warp-specialized kernel schedule."""

    COOPERATIVE = "coop"   # two consumer warpgroups share one 128-row (or larger) tile
    PINGPONG = "pp"        # two consumer warpgroups alternate whole tiles


class Scheduler(enum.Enum):
    """Tile scheduler: how output tiles (and K) are spread over the SMs."""

    PERSISTENT = "persistent"  # one persistent CTA per SM walks the output tiles
    STREAMK = "streamk"        # stream-K: K is split across CTAs so every SM has work (needs a workspace)


class Epilogue(enum.Enum):
    """Epilogue fusion. BIAS reads an optional per-output-feature bias (null pointer = none);
    BIAS_ACT also applies the activation the call names (none, silu or gelu: chosen at run time,
    so one kernel serves all three); SWIGLU is the gated epilogue of a gate/up interleaved weight
    (:func:`mixgemm.quantize.interleave_gate_up`): ``silu(gate + b) * (up + b)``, N/2 outputs."""

    BIAS = "bias"
    BIAS_ACT = "biasact"
    SWIGLU = "swiglu"


class Activation(enum.Enum):
    """Elementwise function applied in float32 to ``acc + bias`` before the output rounding."""

    NONE = "none"
    SILU = "silu"
    GELU = "gelu"   # exact (erf) GELU, torch's default
    SWIGLU = "swiglu"   # silu(gate) * up over a gate/up 8-row-stripe interleaved weight: N/2 outputs

    @property
    def cpp(self) -> str:
        """The C++ enumerator (``mixgemm::Activation``, cutlass_ext/mixgemm/activation.hpp)."""
        return _ACTIVATION_CPP[self][0]

    @property
    def abi(self) -> int:
        """Its value in the kernels' C ABI (``abi::GemmArgs::activation``)."""
        return _ACTIVATION_CPP[self][1]


#: mirrors cutlass_ext/mixgemm/activation.hpp's enum
_ACTIVATION_CPP = {Activation.NONE: ("kNone", 0), Activation.SILU: ("kSilu", 1),
                   Activation.GELU: ("kGelu", 2), Activation.SWIGLU: ("kSwiglu", 3)}


class Raster(enum.Enum):
    """The order in which a GEMM's tile scheduler walks the output tiles (a launch argument)."""

    HEURISTIC = "heuristic"         # CUTLASS's choice from the tile counts
    WEIGHT_ROWS = "weight_rows"     # consecutive CTAs take consecutive weight-row blocks
    TOKENS = "tokens"               # consecutive CTAs take consecutive token blocks

    @property
    def abi(self) -> int:
        """Its value in the kernels' C ABI (``abi::GemmArgs::raster``)."""
        return {Raster.HEURISTIC: 0, Raster.WEIGHT_ROWS: 1, Raster.TOKENS: 2}[self]


#: the tile schedulers' swizzle sizes (CUTLASS ``max_swizzle_size``): a wave of CTAs covers
#: blocks of this many tiles along the raster's minor mode, for L2 reuse
SWIZZLES = (1, 2, 4, 8)


class KernelKind(enum.Enum):
    GEMM = "gemm"
    DECODE = "decode"
    GROUPED_DECODE = "gdecode"
    GROUPED_GEMM = "ggemm"
    DEQUANT = "dequant"
    MOE_ROUTE = "moe_route"
    MOE_COMBINE = "moe_combine"
    MOE_LAYOUT = "moe_layout"


class IndexType(enum.Enum):
    """The integer type of MoE top-k expert ids (:class:`MoeRouteSpec`)."""

    I32 = "i32"
    I64 = "i64"

    @property
    def cpp(self) -> str:
        return {IndexType.I32: "int32_t", IndexType.I64: "int64_t"}[self]


class RoutingWeightType(enum.Enum):
    """The float type of MoE top-k routing weights (:class:`MoeCombineSpec`)."""

    F32 = "f32"
    BF16 = "bf16"
    F16 = "f16"

    @property
    def cpp(self) -> str:
        return {RoutingWeightType.F32: "float", RoutingWeightType.BF16: "cutlass::bfloat16_t",
                RoutingWeightType.F16: "cutlass::half_t"}[self]


_DATATYPE = {
    WeightType.S8: "s8", WeightType.U8: "u8", WeightType.S4: "s4",
    WeightType.U4: "u4", WeightType.S2: "s2", WeightType.U2: "u2",
}
_ACT_DATATYPE = {ActType.BF16: "bf16", ActType.FP16: "f16"}


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """One GEMM kernel: ``y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias)``.

    ``tile_m`` tiles the weight rows N (the MMA's M mode), ``tile_n`` the tokens M (the MMA's
    N mode), ``tile_k`` the reduction. ``stages = 0`` lets the builder fill shared memory.
    """

    act: ActType
    weight: WeightType
    tile_m: int
    tile_n: int
    tile_k: int
    schedule: Schedule = Schedule.COOPERATIVE
    scheduler: Scheduler = Scheduler.PERSISTENT
    epilogue: Epilogue = Epilogue.BIAS_ACT
    stages: int = 0

    kind = KernelKind.GEMM
    #: Whether the kernel waits for the previous grid before its first global access
    #: (``griddepcontrol.wait``), so that it may be launched with programmatic stream
    #: serialization. CUTLASS's sm90 kernels do so only when built with
    #: CUTLASS_ENABLE_GDC_FOR_SM90, which these are not.
    programmatic_launch = False

    def __post_init__(self) -> None:
        if self.tile_m % 64 or self.tile_m not in (64, 128, 256):
            raise ValueError(f"tile_m must be 64, 128 or 256, got {self.tile_m}")
        if self.schedule is Schedule.COOPERATIVE and self.tile_m < 128:
            raise ValueError("the cooperative schedule needs tile_m >= 128")
        if self.tile_n % 8 or not 8 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 8 in [8, 256], got {self.tile_n}")
        if self.tile_k not in (64, 128):
            raise ValueError(f"tile_k must be 64 or 128, got {self.tile_k}")
        if self.stages < 0 or self.stages == 1:
            raise ValueError("stages must be 0 (auto) or >= 2")

    @property
    def fixed_activation(self) -> "Activation | None":
        """The activation the kernel computes whatever the call asks: swiglu for the gated
        epilogue; None when the call chooses (none / silu / gelu)."""
        return Activation.SWIGLU if self.epilogue is Epilogue.SWIGLU else None

    @property
    def name(self) -> str:
        return (f"mixgemm_gemm_{self.act.value}_{self.weight.value}_"
                f"t{self.tile_m}x{self.tile_n}x{self.tile_k}_{self.schedule.value}_"
                f"{self.scheduler.value}_{self.epilogue.value}_s{self.stages}")

    #: any number of tokens
    max_tokens = None


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """One decode kernel (``cutlass_ext/mixgemm/decode_kernel.hpp``): ``y = x @ dequant(W)^T``
    for at most ``tokens`` rows of x, mma.sync m16n8k16, weights streamed through a per-warp ring
    of ``stages`` shared-memory stages of ``stage_bytes`` filled by bulk copies. ``kslices``
    warps share each 16-row weight stripe, each streaming a slice of the CTA's k-range (their
    sums are added in shared memory), so a CTA holds ``warps / kslices`` stripes; split-K across
    CTAs is chosen at launch.
    """

    act: ActType
    weight: WeightType
    tokens: int = 16
    warps: int = 8
    stage_bytes: int = 1024
    stages: int = 4
    activation: Activation = Activation.NONE
    kslices: int = 1

    kind = KernelKind.DECODE
    programmatic_launch = True   # decode_kernel.hpp: wait_previous_grid() precedes every global access

    def __post_init__(self) -> None:
        if self.tokens not in (8, 16, 32):
            raise ValueError(f"tokens must be 8, 16 or 32, got {self.tokens}")
        if not 1 <= self.warps <= 16:
            raise ValueError(f"warps must be in [1, 16], got {self.warps}")
        atom = 128 * self.weight.bits
        if self.stage_bytes % atom or self.stage_bytes <= 0:
            raise ValueError(f"stage_bytes must be a positive multiple of the {atom}-byte atom of "
                             f"{self.weight.value}, got {self.stage_bytes}")
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")
        if self.warps * self.stages * self.stage_bytes > 160 * 1024:
            raise ValueError("the weight rings (warps x stages x stage_bytes) exceed 160 KiB of shared memory")
        if self.kslices not in (1, 2, 4, 8, 16) or self.warps % self.kslices:
            raise ValueError(f"kslices must be 1, 2, 4, 8 or 16 and divide warps={self.warps}, got {self.kslices}")

    @property
    def fixed_activation(self) -> Activation:
        """The activation the kernel computes whatever the call asks (fixed at compile time)."""
        return self.activation

    @property
    def name(self) -> str:
        return (f"mixgemm_decode_{self.act.value}_{self.weight.value}_m{self.tokens}_w{self.warps}_"
                f"b{self.stage_bytes}_s{self.stages}_k{self.kslices}_{self.activation.value}")

    @property
    def max_tokens(self) -> int:
        return self.tokens


@dataclasses.dataclass(frozen=True)
class GroupedDecodeSpec:
    """One grouped decode kernel (``cutlass_ext/mixgemm/grouped_decode_kernel.hpp``): the decode
    kernel of :class:`DecodeSpec` with the same fields, over E stacked experts
    (:class:`mixgemm.experts.PackedExperts`): x's rows sorted by expert, expert e's rows
    ``[offsets[e], offsets[e + 1])`` read from device memory. ``tokens`` is the row tile: an
    expert with more rows streams its weights once per tile."""

    act: ActType
    weight: WeightType
    tokens: int = 16
    warps: int = 8
    stage_bytes: int = 1024
    stages: int = 4
    activation: Activation = Activation.NONE
    kslices: int = 1

    kind = KernelKind.GROUPED_DECODE
    programmatic_launch = True   # waits for the previous grid before reading the offsets

    def __post_init__(self) -> None:
        self.dense   # the decode kernel's checks

    @property
    def dense(self) -> DecodeSpec:
        """The decode kernel whose body this one runs per expert."""
        return DecodeSpec(self.act, self.weight, self.tokens, self.warps, self.stage_bytes, self.stages,
                          self.activation, self.kslices)

    @property
    def fixed_activation(self) -> Activation:
        return self.activation

    @property
    def name(self) -> str:
        return "mixgemm_gdecode_" + self.dense.name[len("mixgemm_decode_"):]

    @property
    def max_tokens(self) -> None:
        """Any number of rows (the row loop)."""
        return None


@dataclasses.dataclass(frozen=True)
class GroupedGemmSpec:
    """One grouped (MoE) sm90 GEMM kernel: the GEMM of :class:`GemmSpec` (cooperative, persistent)
    over E stacked experts (:class:`mixgemm.experts.PackedExperts`), for many rows per expert.
    x's rows are sorted by expert with every expert's rows starting at a multiple of ``tile_n``
    (:mod:`mixgemm.moe_padding`), so each ``tile_n``-row token tile belongs to one expert; the
    table of token tiles (how many, and each one's expert) is read on the GPU
    (``cutlass_ext/mixgemm/grouped_scheduler.hpp``). Each weight tile is converted once per
    token tile, on wgmma."""

    act: ActType
    weight: WeightType
    tile_m: int
    tile_n: int
    tile_k: int
    epilogue: Epilogue = Epilogue.BIAS_ACT
    stages: int = 0

    kind = KernelKind.GROUPED_GEMM
    programmatic_launch = False   # as GemmSpec

    def __post_init__(self) -> None:
        self.dense   # the GEMM's checks
        if self.epilogue is Epilogue.BIAS:
            raise ValueError("the grouped GEMM takes no bias: its epilogues are biasact (none / silu / gelu) and swiglu")

    @property
    def dense(self) -> GemmSpec:
        """The dense GEMM kernel this one is, but for the grouped scheduler and expert loads."""
        return GemmSpec(self.act, self.weight, self.tile_m, self.tile_n, self.tile_k, Schedule.COOPERATIVE,
                        Scheduler.PERSISTENT, self.epilogue, self.stages)

    @property
    def fixed_activation(self) -> "Activation | None":
        return self.dense.fixed_activation

    @property
    def name(self) -> str:
        return (f"mixgemm_ggemm_{self.act.value}_{self.weight.value}_t{self.tile_m}x{self.tile_n}x{self.tile_k}_"
                f"{self.epilogue.value}_s{self.stages}")

    #: any number of rows
    max_tokens = None


@dataclasses.dataclass(frozen=True)
class DequantSpec:
    """The GPU dequantizer of one (activation type, weight type) pair."""

    act: ActType
    weight: WeightType

    kind = KernelKind.DEQUANT

    @property
    def name(self) -> str:
        return f"mixgemm_dequant_{self.act.value}_{self.weight.value}"


@dataclasses.dataclass(frozen=True)
class MoeRouteSpec:
    """The MoE routing kernel (``cutlass_ext/mixgemm/moe_route_kernel.hpp``) for top-k ids of one
    integer type: the assignments sorted by expert (offsets, order, tokens, inv) and the rows of
    x gathered in that order, one launch, no host sync. x is moved as 16-byte vectors, so one
    kernel serves bf16 and fp16. Launched by :func:`mixgemm.moe.route_and_gather`."""

    index: IndexType

    kind = KernelKind.MOE_ROUTE
    programmatic_launch = True   # griddepcontrol.wait precedes every global access

    @property
    def name(self) -> str:
        return f"mixgemm_moe_route_{self.index.value}"


@dataclasses.dataclass(frozen=True)
class MoeCombineSpec:
    """The MoE combine kernel (``cutlass_ext/mixgemm/moe_route_kernel.hpp``): the weighted sum of
    each token's top-k expert outputs, float32 in slot order, one rounding to ``act``; routing
    weights of type ``weight``. Launched by :func:`mixgemm.moe.combine`."""

    act: ActType
    weight: RoutingWeightType

    kind = KernelKind.MOE_COMBINE
    programmatic_launch = True   # griddepcontrol.wait precedes every global access

    @property
    def name(self) -> str:
        return f"mixgemm_moe_combine_{self.act.value}_w{self.weight.value}"


@dataclasses.dataclass(frozen=True)
class MoeLayoutSpec:
    """The MoE layout kernel (``cutlass_ext/mixgemm/moe_layout_kernel.hpp``): the sorted rows'
    layout for the grouped GEMMs (token tiles, and in the split plan the cold experts' offsets),
    the positions and the routing's inverse through them, one CTA, no host sync. Launched by
    :func:`mixgemm.moe_tiles.token_tiles` and :func:`mixgemm.moe_tiles.split_layout`."""

    kind = KernelKind.MOE_LAYOUT
    programmatic_launch = False

    @property
    def name(self) -> str:
        return "mixgemm_moe_layout"


KernelSpec = Union[GemmSpec, DecodeSpec, GroupedDecodeSpec, GroupedGemmSpec, DequantSpec, MoeRouteSpec,
                   MoeCombineSpec, MoeLayoutSpec]
#: The kernels that compute a GEMM (and have a host helper): what gemm_with_spec takes.
GEMM_KINDS = (GemmSpec, DecodeSpec)
#: The kernels built with a host helper library (helper.so).
HELPER_KINDS = (GemmSpec, DecodeSpec, GroupedDecodeSpec, GroupedGemmSpec)

_GEMM_NAME = re.compile(
    r"^mixgemm_gemm_(?P<act>bf16|fp16)_(?P<weight>[su][248])_t(?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+)_"
    r"(?P<schedule>\w+?)_(?P<scheduler>persistent|streamk)_(?P<epilogue>\w+)_s(?P<stages>\d+)$")
_DECODE_NAME = re.compile(
    r"^mixgemm_decode_(?P<act>bf16|fp16)_(?P<weight>[su][248])_m(?P<tokens>\d+)_w(?P<warps>\d+)_"
    r"b(?P<stage_bytes>\d+)_s(?P<stages>\d+)_k(?P<kslices>\d+)_(?P<activation>none|silu|gelu|swiglu)$")
_GROUPED_DECODE_NAME = re.compile("^mixgemm_gdecode_" + _DECODE_NAME.pattern[len("^mixgemm_decode_"):])
_GROUPED_GEMM_NAME = re.compile(
    r"^mixgemm_ggemm_(?P<act>bf16|fp16)_(?P<weight>[su][248])_t(?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+)_"
    r"(?P<epilogue>biasact|swiglu)_s(?P<stages>\d+)$")
_DEQUANT_NAME = re.compile(r"^mixgemm_dequant_(?P<act>bf16|fp16)_(?P<weight>[su][248])$")
_MOE_ROUTE_NAME = re.compile(r"^mixgemm_moe_route_(?P<index>i32|i64)$")
_MOE_COMBINE_NAME = re.compile(r"^mixgemm_moe_combine_(?P<act>bf16|fp16)_w(?P<weight>f32|bf16|f16)$")


def parse_name(name: str) -> KernelSpec:
    """Inverse of ``spec.name``."""
    m = _GEMM_NAME.match(name)
    if m:
        return GemmSpec(ActType(m["act"]), WeightType(m["weight"]), int(m["m"]), int(m["n"]), int(m["k"]),
                        Schedule(m["schedule"]), Scheduler(m["scheduler"]), Epilogue(m["epilogue"]),
                        int(m["stages"]))
    m = _DECODE_NAME.match(name)
    if m:
        return DecodeSpec(ActType(m["act"]), WeightType(m["weight"]), int(m["tokens"]), int(m["warps"]),
                          int(m["stage_bytes"]), int(m["stages"]), Activation(m["activation"]), int(m["kslices"]))
    m = _GROUPED_DECODE_NAME.match(name)
    if m:
        return GroupedDecodeSpec(ActType(m["act"]), WeightType(m["weight"]), int(m["tokens"]), int(m["warps"]),
                                 int(m["stage_bytes"]), int(m["stages"]), Activation(m["activation"]),
                                 int(m["kslices"]))
    m = _GROUPED_GEMM_NAME.match(name)
    if m:
        return GroupedGemmSpec(ActType(m["act"]), WeightType(m["weight"]), int(m["m"]), int(m["n"]), int(m["k"]),
                               Epilogue(m["epilogue"]), int(m["stages"]))
    m = _DEQUANT_NAME.match(name)
    if m:
        return DequantSpec(ActType(m["act"]), WeightType(m["weight"]))
    m = _MOE_ROUTE_NAME.match(name)
    if m:
        return MoeRouteSpec(IndexType(m["index"]))
    if name == MoeLayoutSpec().name:
        return MoeLayoutSpec()
    m = _MOE_COMBINE_NAME.match(name)
    if m:
        return MoeCombineSpec(ActType(m["act"]), RoutingWeightType(m["weight"]))
    raise ValueError(f"not a mixgemm kernel name: {name!r}")


# ---------------------------------------------------------------------------------------------
# The kernel matrix
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A tile/schedule choice shared by all type configs; the heuristic picks among these.
    ``raster`` and ``swizzle`` are the launch's tile order (not part of the kernel)."""

    label: str
    tile_m: int
    tile_n: int
    tile_k: int
    schedule: Schedule
    scheduler: Scheduler
    raster: Raster = Raster.HEURISTIC
    swizzle: int = 1

    def __post_init__(self):
        if self.swizzle not in SWIZZLES:
            raise ValueError(f"swizzle must be one of {SWIZZLES}, got {self.swizzle!r}")

    def runs(self, spec: "KernelSpec") -> bool:
        """True if ``spec`` is one of this config's kernels."""
        return isinstance(spec, GemmSpec) and (spec.tile_m, spec.tile_n, spec.tile_k, spec.schedule, spec.scheduler) \
            == (self.tile_m, self.tile_n, self.tile_k, self.schedule, self.scheduler)

    #: any number of tokens
    max_tokens = None

    def spec(self, act: ActType, weight: WeightType, activation: Activation = Activation.NONE) -> GemmSpec:
        """The config's kernel for a type pair: the gated epilogue for swiglu, else the one that
        takes none / silu / gelu per call."""
        epilogue = Epilogue.SWIGLU if activation is Activation.SWIGLU else Epilogue.BIAS_ACT
        return GemmSpec(act, weight, self.tile_m, self.tile_n, self.tile_k, self.schedule, self.scheduler,
                        epilogue)


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

    @property
    def max_tokens(self) -> int:
        return self.tokens

    def spec(self, act: ActType, weight: WeightType, activation: Activation = Activation.NONE) -> DecodeSpec:
        stage_bytes = max(self.stage_bytes, 128 * weight.bits)
        kslices = self.int8_kslices if weight.bits == 8 else 1
        return DecodeSpec(act, weight, self.tokens, self.warps, stage_bytes, self.stages, activation, kslices)


#: The kernel configs the heuristic (mixgemm.ops.select_tile) chooses from, by token count M:
#:   M <= 8   : "dec8"    decode kernel, 8-token tile (8-bit codes: 8 k-slices, one stripe per CTA:
#:                        measured 2-13% faster at M = 1 on 5 of 6 layers, NOTES 9b)
#:   M <= 16  : "dec16"   decode kernel, 16-token tile
#:   M <= 32  : "dec32"   decode kernel, 32-token tile, on layers of at most 2**25 weights
#:   M <= 128 : "mid"     sm90 GEMM 128x64x64,  stream-K, on small layers (M <= 64: at most 2**26
#:                        weights; M <= 128: at most 2**25)
#:              "tall"    sm90 GEMM 256x64x64,  stream-K, on larger layers (M <= 64; M <= 128 below
#:                        60M weights)
#:              "tall128" sm90 GEMM 256x128x64, stream-K, on layers of 60M weights or more (M <= 128)
#:   M <= 256 : "large"   sm90 GEMM 128x128x64, persistent, on layers of at most 48M weights (NOTES 9g;
#:                        slower than "mid" at M = 128 and than "xl" on larger layers, NOTES 7b)
#:   M >  128 : "xl"      sm90 GEMM 128x256x64, stream-K, tiles walked along the weight rows in
#:                        swizzled pairs (L2 reuse of the token blocks at large M), on the other layers
#: The GEMM kernels fuse bias + none / silu / gelu (chosen per call), and each config has a second
#: kernel with the gated epilogue for swiglu; the decode kernels fix their activation.
TILE_CONFIGS = (
    DecodeConfig("dec8", 8, int8_kslices=8),
    DecodeConfig("dec16", 16),
    DecodeConfig("dec32", 32),
    TileConfig("mid", 128, 64, 64, Schedule.COOPERATIVE, Scheduler.STREAMK),
    TileConfig("tall", 256, 64, 64, Schedule.COOPERATIVE, Scheduler.STREAMK),
    TileConfig("tall128", 256, 128, 64, Schedule.COOPERATIVE, Scheduler.STREAMK),
    TileConfig("large", 128, 128, 64, Schedule.COOPERATIVE, Scheduler.PERSISTENT),
    TileConfig("xl", 128, 256, 64, Schedule.COOPERATIVE, Scheduler.STREAMK, Raster.WEIGHT_ROWS, 2),
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
    return specs


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
    "TileSchedulerTag": {_MixgemmTileScheduler.GroupedTokenTiles: "mixgemm::GroupedTokenTiles"},
    "TileSchedulerSuffixes": {_MixgemmTileScheduler.GroupedTokenTiles: "_grouped_token_tiles"},
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


def _gemm_operation(spec: GemmSpec, grouped: bool = False):
    """cutlass_library's operation for ``spec``; ``grouped``: with mixgemm's grouped scheduler."""
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
                             [1, 1, 1])
    if spec.schedule is Schedule.COOPERATIVE:
        kernel_schedule = _MixgemmKernelSchedule.PrepackedCooperative
        epilogue_schedule = L.EpilogueScheduleType.TmaWarpSpecializedCooperative
    else:
        kernel_schedule = _MixgemmKernelSchedule.PrepackedPingpong
        epilogue_schedule = L.EpilogueScheduleType.TmaWarpSpecialized
    if spec.epilogue is Epilogue.SWIGLU:
        epilogue_schedule = _MixgemmEpilogueSchedule.GatedNoSmem
    scheduler = {Scheduler.PERSISTENT: L.TileSchedulerType.Persistent,
                 Scheduler.STREAMK: L.TileSchedulerType.StreamK}[spec.scheduler]
    if grouped:
        scheduler = _MixgemmTileScheduler.GroupedTokenTiles
    mode = L.MixedInputMode.ScaleOnly if spec.weight.signed else L.MixedInputMode.ScaleWithZeroPoint
    align_a = 128 // spec.weight.bits
    return _NamedGemmOperation(
        f"{spec.name}_op",
        gemm_kind=L.GemmKind.Universal3x, arch=90, tile_description=tile,
        A=L.TensorDescription(code, _MixgemmLayout.PrepackedSm90, align_a),
        B=L.TensorDescription(act, L.LayoutType.ColumnMajor, 8),
        C=L.TensorDescription(L.DataType.void, L.LayoutType.ColumnMajor, 8),
        D=L.TensorDescription(act, L.LayoutType.ColumnMajor, 8),
        element_epilogue=L.DataType.f32, epilogue_functor=_EPILOGUE_FUNCTOR[spec.epilogue],
        kernel_schedule=kernel_schedule, epilogue_schedule=epilogue_schedule,
        tile_scheduler=scheduler, mixed_input_mode=mode)


_HEADER = """\
// Generated by mixgemm {version} (python/mixgemm/codegen.py). Do not edit.
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
                f"{spec.stage_bytes}, {spec.stages}, {spec.kslices}>;\n"
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
    grouped = isinstance(spec, GroupedGemmSpec)
    if not isinstance(spec, GemmSpec) and not grouped:
        raise TypeError(f"not a kernel spec: {spec!r}")
    _, G = _cutlass_library()
    dense = spec.dense if grouped else spec
    op = _gemm_operation(dense, grouped)
    op._mixgemm_name = f"{spec.name}_op"
    body = G.EmitGemmUniversal3xInstance().emit(op)
    op_name = op.procedural_name()
    include = '#include "mixgemm/gemm_prelude.hpp"\n'
    if grouped:
        include += '#include "mixgemm/grouped_scheduler.hpp"\n'
    if dense.epilogue is Epilogue.SWIGLU:
        include += '#include "mixgemm/epilogue_gated.hpp"\n'
    entry = "MIXGEMM_GROUPED_GEMM_ENTRY" if grouped else "MIXGEMM_GEMM_ENTRY"
    return (head + include + body +
            f"\nstatic_assert(mixgemm::uses_prepacked_mainloop_v<{op_name}>,\n"
            f'              "{spec.name}: the builder did not select mixgemm\'s prepacked mainloop");\n\n'
            f"{entry}({spec.name}, {op_name})\n")


