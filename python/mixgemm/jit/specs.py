"""Kernel specs: what a kernel is.

Every kernel mixgemm can run is described by a frozen spec dataclass (:class:`GemmSpec`,
:class:`DecodeSpec`, :class:`GroupedDecodeSpec`, :class:`GroupedGemmSpec`, :class:`DequantSpec`,
:class:`MoeRouteSpec`, :class:`MoeCombineSpec`, :class:`MoeLayoutSpec`, :class:`NormSpec`,
:class:`RopeSpec`, :class:`Fp8GemmSpec`, :class:`QuantFp8Spec`: together :data:`KernelSpec`) whose
``name`` encodes every field; :func:`parse_name` is its inverse. That name is the cubin's kernel
symbol, the generated file's name, the cache-key prefix and the test id. The enums here
(:class:`Schedule`, :class:`Scheduler`, :class:`Epilogue`, :class:`Activation`, :class:`Raster`, ...)
are the specs' fields and the kernels' launch options.

Which specs exist and their C++ sources are :mod:`mixgemm.jit.render`'s; building and loading are
separate steps (:mod:`mixgemm.jit.build`, :mod:`mixgemm.jit.loader`).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import re
from typing import Union

from ..dtypes import ActType, WeightType


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
    (:func:`mixgemm.weights.quantize.interleave_gate_up`): ``silu(gate + b) * (up + b)``, N/2 outputs."""

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
    NORM = "norm"
    ROPE = "rope"
    FP8_GEMM = "f8gemm"
    QUANT_FP8 = "quant_fp8"


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


def _check_sm90_tile(tile_n: int, tile_k: int, stages: int) -> None:
    """The token tile, k-tile and stage count checks of the sm90 prepacked GEMMs (bf16 and e4m3)."""
    if tile_n % 8 or not 8 <= tile_n <= 256:
        raise ValueError(f"tile_n must be a multiple of 8 in [8, 256], got {tile_n}")
    if tile_k not in (64, 128):
        raise ValueError(f"tile_k must be 64 or 128, got {tile_k}")
    if stages < 0 or stages == 1:
        raise ValueError("stages must be 0 (auto) or >= 2")


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """One GEMM kernel: ``y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias)``.

    ``tile_m`` tiles the weight rows N (the MMA's M mode), ``tile_n`` the tokens M (the MMA's
    N mode), ``tile_k`` the reduction. ``stages = 0`` lets the builder fill shared memory.
    ``cluster_m`` > 1: thread-block clusters of that many neighbouring weight tiles of one token
    tile, which load the activation tile once per cluster (TMA multicast) instead of once per CTA.
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
    cluster_m: int = 1

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
        _check_sm90_tile(self.tile_n, self.tile_k, self.stages)
        if self.cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {self.cluster_m}")

    @property
    def fixed_activation(self) -> "Activation | None":
        """The activation the kernel computes whatever the call asks: swiglu for the gated
        epilogue; None when the call chooses (none / silu / gelu)."""
        return Activation.SWIGLU if self.epilogue is Epilogue.SWIGLU else None

    @property
    def self_resetting_locks(self) -> bool:
        """Whether a launch takes zeroed locks apart from its workspace and leaves them zeroed:
        the stream-K kernels (cutlass_ext/mixgemm/streamk_scheduler.hpp), so that no launch needs
        a memset."""
        return self.scheduler is Scheduler.STREAMK

    @functools.cached_property
    def name(self) -> str:
        cluster = f"_c{self.cluster_m}" if self.cluster_m > 1 else ""
        return (f"mixgemm_gemm_{self.act.value}_{self.weight.value}_"
                f"t{self.tile_m}x{self.tile_n}x{self.tile_k}{cluster}_{self.schedule.value}_"
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
    CTAs is chosen at launch. ``x_stages`` > 0: x streams through that many shared-memory slots
    (TMA boxes of a few atoms, refilled as the warps go) instead of the CTA's whole x[:, k-range]
    resident, which at 16 tokens bounds the CTAs per SM (docs/decode.md).
    """

    act: ActType
    weight: WeightType
    tokens: int = 16
    warps: int = 8
    stage_bytes: int = 1024
    stages: int = 4
    activation: Activation = Activation.NONE
    kslices: int = 1
    x_stages: int = 0

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
        if self.x_stages and not (2 <= self.x_stages <= 8 and self.kslices == 1):
            raise ValueError(f"x_stages must be 0, or 2-8 with kslices=1, got {self.x_stages} (kslices={self.kslices})")

    @property
    def fixed_activation(self) -> Activation:
        """The activation the kernel computes whatever the call asks (fixed at compile time)."""
        return self.activation

    @functools.cached_property
    def name(self) -> str:
        xring = f"_x{self.x_stages}" if self.x_stages else ""
        return (f"mixgemm_decode_{self.act.value}_{self.weight.value}_m{self.tokens}_w{self.warps}_"
                f"b{self.stage_bytes}_s{self.stages}_k{self.kslices}{xring}_{self.activation.value}")

    @property
    def max_tokens(self) -> int:
        return self.tokens


@dataclasses.dataclass(frozen=True)
class GroupedDecodeSpec:
    """One grouped decode kernel (``cutlass_ext/mixgemm/grouped_decode_kernel.hpp``): the decode
    kernel of :class:`DecodeSpec` with the same fields, over E stacked experts
    (:class:`mixgemm.weights.experts.PackedExperts`): x's rows sorted by expert, expert e's rows
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

    @functools.cached_property
    def name(self) -> str:
        return "mixgemm_gdecode_" + self.dense.name[len("mixgemm_decode_"):]

    @property
    def max_tokens(self) -> None:
        """Any number of rows (the row loop)."""
        return None


@dataclasses.dataclass(frozen=True)
class GroupedGemmSpec:
    """One grouped (MoE) sm90 GEMM kernel: the GEMM of :class:`GemmSpec` (cooperative, persistent)
    over E stacked experts (:class:`mixgemm.weights.experts.PackedExperts`), for many rows per expert.
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

    @functools.cached_property
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

    @functools.cached_property
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

    @functools.cached_property
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

    @functools.cached_property
    def name(self) -> str:
        return f"mixgemm_moe_combine_{self.act.value}_w{self.weight.value}"


@dataclasses.dataclass(frozen=True)
class MoeLayoutSpec:
    """The MoE layout kernel (``cutlass_ext/mixgemm/moe_layout_kernel.hpp``): the sorted rows'
    layout for the grouped GEMMs (token tiles, and in the split plan the cold experts' offsets),
    the positions and the routing's inverse through them, one CTA, no host sync. Launched by
    :func:`mixgemm.moe.tiles.token_tiles` and :func:`mixgemm.moe.tiles.split_layout`."""

    kind = KernelKind.MOE_LAYOUT
    programmatic_launch = False

    @functools.cached_property
    def name(self) -> str:
        return "mixgemm_moe_layout"


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """The RMSNorm kernel (``cutlass_ext/mixgemm/norm_kernel.hpp``) for rows of type ``act``, with
    the residual add fused in front of it when ``residual``: ``s = x + residual`` (written out),
    ``y = rms_norm(s) * w``. Launched by :func:`mixgemm.rms_norm`."""

    act: ActType
    residual: bool

    kind = KernelKind.NORM
    programmatic_launch = True   # griddepcontrol.wait precedes every global access

    @functools.cached_property
    def name(self) -> str:
        return f"mixgemm_{'add_' if self.residual else ''}rmsnorm_{self.act.value}"


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding and KV-cache write kernel (``cutlass_ext/mixgemm/rope_kernel.hpp``)
    for a qkv projection's output of type ``act``: q and k turned by their position, q written
    out, k and v written into the cache. Launched by :func:`mixgemm.rotary_kv_cache`."""

    act: ActType

    kind = KernelKind.ROPE
    programmatic_launch = True   # griddepcontrol.wait precedes every global access

    @functools.cached_property
    def name(self) -> str:
        return f"mixgemm_rope_kv_{self.act.value}"


@dataclasses.dataclass(frozen=True)
class Fp8GemmSpec:
    """One GEMM kernel with e4m3 (FP8) activations (``cutlass_ext/mixgemm/collective/
    sm90_mma_prepacked_fp8.hpp``, docs/fp8.md): ``y[M, N] = s_x[M] * (xq[M, K] @ dequant(W)[N, K]^T)
    (+ bias)``, xq the activations quantized per token by :class:`QuantFp8Spec`'s kernel (in the
    MMA's K order), the 4- and 2-bit codes converted to e4m3 exactly, wgmma ``m64nNk32`` e4m3 x
    e4m3 into float32, the group scales applied to the float32 accumulator once per k-tile.

    ``act`` is the type of the weight's scales and zero points and of the output (bf16 or fp16);
    ``tile_m`` tiles the weight rows N (the MMA's M mode), ``tile_n`` the tokens, ``tile_k`` the
    reduction (64 or 128). Cooperative schedule, no cluster (docs/fp8.md says what is left).
    ``scheduler``: the persistent one (whole output tiles), or the stream-K one with
    self-resetting locks, launched split-K with the factor the call chooses (a few us more per
    launch of whole tiles, so only split launches take it). ``stages = 0`` lets the builder
    fill shared memory. ``epilogue``: the bf16 kernels' bias + runtime activation (none / silu /
    gelu, ``BIAS_ACT``), or their gated epilogue (``SWIGLU``: gate/up interleaved in 8-row
    stripes, ``N/2`` outputs), which reads the float32 accumulator after the per-token scales.
    """

    act: ActType
    weight: WeightType
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    stages: int = 0
    epilogue: Epilogue = Epilogue.BIAS_ACT
    scheduler: Scheduler = Scheduler.PERSISTENT

    kind = KernelKind.FP8_GEMM
    schedule = Schedule.COOPERATIVE
    cluster_m = 1
    #: the producer waits for the previous grid (griddepcontrol.wait) before its first load, and
    #: nothing else reads what an earlier kernel writes before that load has landed: the launch
    #: and the set-up overlap the quantizer before it
    programmatic_launch = True
    #: the weight types whose codes (and codes minus zero points) e4m3 holds exactly
    WEIGHTS = ("s4", "u4", "s2", "u2")

    def __post_init__(self) -> None:
        if self.weight.value not in self.WEIGHTS:
            raise ValueError(f"the e4m3 GEMM takes {', '.join(self.WEIGHTS)} weights (every code and code minus "
                             f"zero point is exact in e4m3), got {self.weight.value}")
        if self.tile_m not in (128, 256):
            raise ValueError(f"tile_m must be 128 or 256 (two consumer warp groups), got {self.tile_m}")
        if self.epilogue not in (Epilogue.BIAS_ACT, Epilogue.SWIGLU):
            raise ValueError(f"the e4m3 GEMM's epilogue is bias + activation or swiglu, got {self.epilogue.value}")
        if self.scheduler not in (Scheduler.PERSISTENT, Scheduler.STREAMK):
            raise ValueError(f"the e4m3 GEMM's scheduler is persistent or streamk, got {self.scheduler!r}")
        _check_sm90_tile(self.tile_n, self.tile_k, self.stages)

    @property
    def fixed_activation(self) -> "Activation | None":
        """Swiglu for the gated epilogue; None: the call chooses none / silu / gelu."""
        return Activation.SWIGLU if self.epilogue is Epilogue.SWIGLU else None

    @property
    def self_resetting_locks(self) -> bool:
        """Whether a launch takes zeroed locks apart from its workspace and leaves them zeroed
        (the stream-K kernels)."""
        return self.scheduler is Scheduler.STREAMK

    @functools.cached_property
    def name(self) -> str:
        gated = "_swiglu" if self.epilogue is Epilogue.SWIGLU else ""
        split = "_streamk" if self.scheduler is Scheduler.STREAMK else ""
        return (f"mixgemm_f8gemm_{self.act.value}_{self.weight.value}_"
                f"t{self.tile_m}x{self.tile_n}x{self.tile_k}{split}{gated}_s{self.stages}")

    #: any number of tokens
    max_tokens = None


@dataclasses.dataclass(frozen=True)
class QuantFp8Spec:
    """The FP8 activation quantizer (``cutlass_ext/mixgemm/quant_fp8_kernel.hpp``) for rows of
    type ``act``: per-token scales ``amax / 448`` and the e4m3 codes in the MMA's K order, one
    launch. Launched by :func:`mixgemm.ops.fp8.quantize_fp8`."""

    act: ActType

    kind = KernelKind.QUANT_FP8
    programmatic_launch = True   # griddepcontrol.wait precedes every global access

    @functools.cached_property
    def name(self) -> str:
        return f"mixgemm_quant_fp8_{self.act.value}"


KernelSpec = Union[GemmSpec, DecodeSpec, GroupedDecodeSpec, GroupedGemmSpec, DequantSpec, MoeRouteSpec,
                   MoeCombineSpec, MoeLayoutSpec, NormSpec, RopeSpec, Fp8GemmSpec, QuantFp8Spec]
#: The kernels that compute a GEMM (and have a host helper): what gemm_with_spec takes.
GEMM_KINDS = (GemmSpec, DecodeSpec)
#: The kernels built with a host helper library (helper.so).
HELPER_KINDS = (GemmSpec, DecodeSpec, GroupedDecodeSpec, GroupedGemmSpec, Fp8GemmSpec)

_GEMM_NAME = re.compile(
    r"^mixgemm_gemm_(?P<act>bf16|fp16)_(?P<weight>[su][248])_t(?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+)(?:_c(?P<cluster>\d+))?_"
    r"(?P<schedule>\w+?)_(?P<scheduler>persistent|streamk)_(?P<epilogue>\w+)_s(?P<stages>\d+)$")
_DECODE_NAME = re.compile(
    r"^mixgemm_decode_(?P<act>bf16|fp16)_(?P<weight>[su][248])_m(?P<tokens>\d+)_w(?P<warps>\d+)_"
    r"b(?P<stage_bytes>\d+)_s(?P<stages>\d+)_k(?P<kslices>\d+)(?:_x(?P<x_stages>\d+))?_"
    r"(?P<activation>none|silu|gelu|swiglu)$")
_GROUPED_DECODE_NAME = re.compile(
    r"^mixgemm_gdecode_(?P<act>bf16|fp16)_(?P<weight>[su][248])_m(?P<tokens>\d+)_w(?P<warps>\d+)_"
    r"b(?P<stage_bytes>\d+)_s(?P<stages>\d+)_k(?P<kslices>\d+)_(?P<activation>none|silu|gelu|swiglu)$")
_GROUPED_GEMM_NAME = re.compile(
    r"^mixgemm_ggemm_(?P<act>bf16|fp16)_(?P<weight>[su][248])_t(?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+)_"
    r"(?P<epilogue>biasact|swiglu)_s(?P<stages>\d+)$")
_DEQUANT_NAME = re.compile(r"^mixgemm_dequant_(?P<act>bf16|fp16)_(?P<weight>[su][248])$")
_MOE_ROUTE_NAME = re.compile(r"^mixgemm_moe_route_(?P<index>i32|i64)$")
_MOE_COMBINE_NAME = re.compile(r"^mixgemm_moe_combine_(?P<act>bf16|fp16)_w(?P<weight>f32|bf16|f16)$")
_NORM_NAME = re.compile(r"^mixgemm_(?P<add>add_)?rmsnorm_(?P<act>bf16|fp16)$")
_ROPE_NAME = re.compile(r"^mixgemm_rope_kv_(?P<act>bf16|fp16)$")
_FP8_GEMM_NAME = re.compile(
    r"^mixgemm_f8gemm_(?P<act>bf16|fp16)_(?P<weight>[su][248])_t(?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+)"
    r"(?P<streamk>_streamk)?(?P<gated>_swiglu)?_s(?P<stages>\d+)$")
_QUANT_FP8_NAME = re.compile(r"^mixgemm_quant_fp8_(?P<act>bf16|fp16)$")


def parse_name(name: str) -> KernelSpec:
    """Inverse of ``spec.name``."""
    m = _GEMM_NAME.match(name)
    if m:
        return GemmSpec(ActType(m["act"]), WeightType(m["weight"]), int(m["m"]), int(m["n"]), int(m["k"]),
                        Schedule(m["schedule"]), Scheduler(m["scheduler"]), Epilogue(m["epilogue"]),
                        int(m["stages"]), int(m["cluster"] or 1))
    m = _DECODE_NAME.match(name)
    if m:
        return DecodeSpec(ActType(m["act"]), WeightType(m["weight"]), int(m["tokens"]), int(m["warps"]),
                          int(m["stage_bytes"]), int(m["stages"]), Activation(m["activation"]), int(m["kslices"]),
                          int(m["x_stages"] or 0))
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
    m = _NORM_NAME.match(name)
    if m:
        return NormSpec(ActType(m["act"]), m["add"] is not None)
    m = _ROPE_NAME.match(name)
    if m:
        return RopeSpec(ActType(m["act"]))
    m = _FP8_GEMM_NAME.match(name)
    if m:
        return Fp8GemmSpec(ActType(m["act"]), WeightType(m["weight"]), int(m["m"]), int(m["n"]), int(m["k"]),
                           int(m["stages"]), Epilogue.SWIGLU if m["gated"] else Epilogue.BIAS_ACT,
                           Scheduler.STREAMK if m["streamk"] else Scheduler.PERSISTENT)
    m = _QUANT_FP8_NAME.match(name)
    if m:
        return QuantFp8Spec(ActType(m["act"]))
    raise ValueError(f"not a mixgemm kernel name: {name!r}")
