"""The grouped GEMMs over stacked experts (re-exported by :mod:`mixgemm.moe`).

* :func:`grouped_gemm` / :func:`grouped_gemm_with_spec`: ``y[rows of e] = act(x[rows of e] @
  dequant(W_e).T)`` for every expert, x's rows sorted by expert, the row ranges given by
  ``expert_offsets`` on the GPU; nothing is read back to the host, so the call can be captured in
  a CUDA graph with routing that changes between replays.
* Two grouped kernels, picked by rows per expert with rows (:func:`select_grouped_spec`):

  - the grouped decode kernel (``cutlass_ext/mixgemm/grouped_decode_kernel.hpp``) handles an
    expert's rows in tiles of 8 or 16 rows, streaming the expert's weights once per tile: the
    decode regime (a few rows per expert); experts without rows are skipped on the GPU;
  - the grouped sm90 GEMM (``cutlass_ext/mixgemm/grouped_scheduler.hpp``, the prepacked wgmma
    mainloop of the dense GEMM; :func:`launch_tiles`) for many rows per expert: x's rows laid
    out in token tiles of 64, 128 or 256 rows of one expert each (:mod:`mixgemm.moe.tiles`: one
    launch of the layout kernel), each weight tile converted once per token tile. The tile table
    is read on the GPU, so this path too needs no host sync.

``torch.ops.mixgemm.grouped_gemm`` is registered with a fake implementation, so
``torch.compile(fullgraph=True)`` traces it.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from ..dispatch import checks, heuristic
from ..dispatch.library import custom_op
from ..dtypes import WeightType
from ..errors import KernelError
from ..jit import driver, loader as runtime, torch_ops
from ..jit.catalog import GROUPED_GEMM_TILES, TILE_CONFIGS
from ..jit.driver import GemmArgs, Launch
from ..jit.loader import aligned_contiguous
from ..jit.specs import Activation, Epilogue, GroupedDecodeSpec, GroupedGemmSpec, KernelKind, Raster
from ..weights.experts import PackedExperts
from .tiles import TokenTiles, token_tiles

__all__ = ["grouped_gemm", "grouped_gemm_with_spec", "grouped_gemm_op", "grouped_gemm_routed", "launch_tiles",
           "select_grouped_spec", "grouped_spec_for", "decode_spec_for", "routed_supports", "decode_ctas",
           "routed_handover"]

#: grouped_gemm's ``activation`` values
ACTIVATIONS = ("silu", "gelu", "swiglu")


#: Rows per expert with rows (``rows / min(E, rows)``) from which the grouped sm90 GEMM replaces the
#: grouped decode kernel (:data:`TILES_FROM_ROWS_LONG_K` when K is at least :data:`LONG_K`: a
#: longer k-loop per tile), and from which it takes its 128- and 256-row token tiles. Measured on
#: the three bench --moe presets (docs/moe.md).
TILES_FROM_ROWS = 32
#: Rows per expert with rows up to which the grouped decode kernel takes the 8-row token tile
#: (above 8 rows in all). mixtral-8x7b at 16 tokens (32 rows, 4 an expert) and qwen3-30b-a3b at
#: 4-16 tokens (1-2 an expert), uniform routing: fused_moe 15-22% faster than with the 16-row
#: tile, whose second token tile only doubles the MMAs and the x tile (docs/moe.md);
#: under Zipf routing, where one expert takes more than 8 rows and streams its
#: weights twice, from 5% faster to 5% slower. Not for 8-bit codes, whose 8-row tile is the k-sliced
#: kernel of one stripe per CTA: qwen3-30b-a3b at 16 tokens took 258 us with it against 155 with the
#: 16-row tile (docs/moe.md).
DEC8_ROWS_PER_EXPERT = 4
TILES_FROM_ROWS_LONG_K = 16
LONG_K = 4096
TILE128_FROM_ROWS = 64
TILE256_FROM_ROWS = 192
#: The grouped sm90 GEMM's walk of its tiles: weight-row tiles first, so that the CTAs running at
#: once share a token tile's rows of x through L2 (token tiles first, the other order, measured
#: 0-35% slower on every preset: docs/moe.md).
TILES_RASTER = Raster.WEIGHT_ROWS


def tiles_from_rows(k: int) -> int:
    """Rows per expert from which the grouped GEMM of reduction length ``k`` replaces the grouped
    decode kernel: :data:`TILES_FROM_ROWS`, or :data:`TILES_FROM_ROWS_LONG_K` from :data:`LONG_K`."""
    return TILES_FROM_ROWS_LONG_K if k >= LONG_K else TILES_FROM_ROWS


def select_grouped_spec(rows: int, experts: PackedExperts, activation: Optional[str] = None):
    """The grouped kernel for ``rows`` rows of x over ``experts``. By rows per expert with rows
    (``rows / min(E, rows)``): below :data:`TILES_FROM_ROWS` the grouped decode kernel (the 8-row
    tile, 8-bit codes with 8 k-slices as the dense "dec8", up to :data:`DEC8_ROWS_PER_EXPERT`
    rows per expert or 8 rows in all, else the 16-row tile), which streams an expert's weights
    once per token tile of its rows; from there the grouped sm90 GEMM
    (:class:`mixgemm.jit.specs.GroupedGemmSpec`), which converts each weight tile once per token
    tile of 64, 128 or 256 rows."""
    return grouped_spec_for(rows, experts.act_type, experts.weight_type, activation, experts.num_experts, experts.n,
                            experts.k)


def grouped_spec_for(rows: int, act_type, weight_type: WeightType, activation: Optional[str] = None,
                     num_experts: int = 1, n: Optional[int] = None, k: int = 0):
    """:func:`select_grouped_spec` from the activation and weight types, the number of experts and
    their N and K alone (no weights needed: e.g. to list or build a run's kernels beforehand). The
    grouped GEMM needs N to be a multiple of its 128-row weight tile (a tile must not straddle
    two experts); without ``n`` that is assumed."""

    per_expert = rows / max(1, min(num_experts, rows))
    if per_expert >= tiles_from_rows(k) and (n is None or n % GROUPED_GEMM_TILES["g64"][0] == 0):
        label = ("g256" if per_expert >= TILE256_FROM_ROWS else "g128" if per_expert >= TILE128_FROM_ROWS
                 else "g64")
        epilogue = Epilogue.SWIGLU if activation == "swiglu" else Epilogue.BIAS_ACT
        return GroupedGemmSpec(act_type, weight_type, *GROUPED_GEMM_TILES[label], epilogue)
    return decode_spec_for(rows, act_type, weight_type, activation, num_experts)


def decode_spec_for(rows: int, act_type, weight_type: WeightType, activation: Optional[str] = None,
                    num_experts: int = 1):
    """The grouped decode kernel for ``rows`` rows over ``num_experts`` experts: the 8-row tile
    (8-bit codes with 8 k-slices, as the dense "dec8") when ``rows <= 8`` or, for 4- and 2-bit
    codes, at most :data:`DEC8_ROWS_PER_EXPERT` rows per expert with rows (``rows / min(E, rows)``),
    else the 16-row tile. (An expert with more rows than the tile streams its weights once per
    tile.)"""

    per_expert = rows / max(1, min(num_experts, rows))
    # (8-bit codes: the 8-row tile is the k-sliced one, a stripe per CTA; by rows in all only)
    by_expert = weight_type.bits < 8 and per_expert <= DEC8_ROWS_PER_EXPERT
    label = "dec8" if rows <= 8 or by_expert else "dec16"
    tc = next(t for t in TILE_CONFIGS if t.label == label)
    d = tc.spec(act_type, weight_type, Activation(activation or "none"))
    return GroupedDecodeSpec(d.act, d.weight, d.tokens, d.warps, d.stage_bytes, d.stages, d.activation, d.kslices)


def _check(x, experts, expert_offsets, out, activation, rows: Optional[int] = None) -> int:
    """Every check of a grouped_gemm call; returns the output width. ``expert_offsets`` None: the
    routed mode (no offsets), whose output has ``rows`` rows (x's rows otherwise)."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(experts, PackedExperts):
        raise TypeError(f"experts must be a mixgemm.moe.PackedExperts, got {type(experts).__name__}")
    if not isinstance(x, torch.Tensor) or not isinstance(expert_offsets, (torch.Tensor, type(None))):
        raise TypeError("x and expert_offsets must be torch.Tensors")
    if x.dtype != experts.dtype:
        raise TypeError(f"x is {x.dtype} but the experts were packed for {experts.dtype}")
    if x.dim() != 2 or x.shape[1] != experts.k:
        raise ValueError(f"x must be [T, K={experts.k}], got {list(x.shape)}")
    if x.shape[0] >= 2 ** 31:
        raise ValueError(f"T={x.shape[0]} rows is too many for one call")
    e = experts.num_experts
    rows = x.shape[0] if rows is None else rows
    if expert_offsets is not None and (expert_offsets.dtype != torch.int32 or tuple(expert_offsets.shape) != (e + 1,)):
        raise ValueError(f"expert_offsets must be int32 of shape [E + 1] = [{e + 1}], got "
                         f"{expert_offsets.dtype} {list(expert_offsets.shape)}")
    if activation == "swiglu" and experts.n % 16:
        raise ValueError(f"activation='swiglu' needs gate/up interleaved experts with N % 16 == 0, got N={experts.n}")
    why = checks.device_problem(experts.device)
    if why:
        raise ValueError(why)
    for name, t in (("x", x), ("expert_offsets", expert_offsets)):
        if t is not None and t.device != experts.device:
            raise ValueError(f"{name} is on {t.device} but the experts are on {experts.device}")
    if expert_offsets is not None and not expert_offsets.is_contiguous():
        raise ValueError("expert_offsets must be contiguous")
    for name, t in (("qdata", experts.qdata), ("scales", experts.scales), ("zeros", experts.zeros)):
        if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
            raise ValueError(f"experts.{name} must be contiguous and 16-byte aligned")
    n_out = experts.n // 2 if activation == "swiglu" else experts.n
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, n_out) or out.dtype != x.dtype:
            raise ValueError(f"out must be a {x.dtype} tensor of shape [{rows}, {n_out}]")
        if out.device != x.device or not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError("out must be on x's device, contiguous and 16-byte aligned")
    return n_out


def _check_splits(splits) -> None:
    if not isinstance(splits, int) or isinstance(splits, bool) or not 0 <= splits <= 8:
        raise ValueError(f"splits must be an int from 0 (the kernel's choice) to 8, got {splits!r}")


def _check_spec_types(spec, experts: PackedExperts) -> None:
    if (spec.act, spec.weight) != (experts.act_type, experts.weight_type):
        raise ValueError(f"{spec.name} is for {spec.act.value} x {spec.weight.value}, the experts are "
                         f"{experts.act_type.value} x {experts.weight_type.value}")


def grouped_gemm(x: torch.Tensor, experts: PackedExperts, expert_offsets: torch.Tensor,
                 out: Optional[torch.Tensor] = None, activation: Optional[str] = None) -> torch.Tensor:
    """``y[r] = act(x[r] @ dequant(W_e).T)`` for the rows ``r`` of each expert ``e``.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, K]``, bfloat16 or float16 (the experts' dtype), on an sm_90 CUDA device; its rows
        sorted by expert. Copied first if not contiguous and 16-byte aligned.
    experts : PackedExperts
        E experts ``[N, K]`` on x's device.
    expert_offsets : torch.Tensor
        ``int32 [E + 1]`` on x's device: expert ``e`` owns rows ``[offsets[e], offsets[e+1])``;
        ``offsets[0] == 0``, non-decreasing, ``offsets[E] <= T`` (not checked: that would need a
        host sync; rows past ``offsets[E]`` are left as they are). Read on the GPU.
    out : torch.Tensor, optional
        ``[T, N]`` (``[T, N/2]`` for swiglu), x's dtype, contiguous and 16-byte aligned.
    activation : {None, "silu", "gelu", "swiglu"}, optional
        Fused in the epilogue as in :func:`mixgemm.gemm`; swiglu takes gate/up interleaved
        experts (:func:`mixgemm.weights.quantize.interleave_gate_up` per expert).

    Returns
    -------
    torch.Tensor
        ``[T, N]`` (``[T, N/2]`` for swiglu), x's dtype. Accumulation in float32, one rounding.
    """
    return grouped_gemm_with_spec(x, experts, expert_offsets, None, out, activation)


def grouped_gemm_with_spec(x: torch.Tensor, experts: PackedExperts, expert_offsets: torch.Tensor, spec,
                           out: Optional[torch.Tensor] = None, activation: Optional[str] = None, *,
                           splits: int = 0) -> torch.Tensor:
    """:func:`grouped_gemm` on the grouped kernel ``spec`` (a :class:`mixgemm.jit.specs.GroupedDecodeSpec`
    or :class:`mixgemm.jit.specs.GroupedGemmSpec`; None: :func:`select_grouped_spec`'s), e.g. to
    test or time every kernel. ``splits``: 0 lets the grouped decode kernel choose its split-K
    factor; 1-8 forces it (the splits of a row block are one cluster); the grouped GEMM takes 0 only."""
    _check_splits(splits)
    n_out = _check(x, experts, expert_offsets, out, activation)
    if spec is None:
        spec = select_grouped_spec(x.shape[0], experts, activation)
    elif spec.kind not in (KernelKind.GROUPED_DECODE, KernelKind.GROUPED_GEMM):
        raise TypeError(f"not a grouped kernel: {spec.name}")
    else:
        _check_spec_types(spec, experts)
    fixed = spec.fixed_activation
    if (fixed is Activation.SWIGLU) != (activation == "swiglu") or (
            spec.kind is KernelKind.GROUPED_DECODE and fixed is not Activation(activation or "none")):
        raise ValueError(f"{spec.name} computes {fixed.value if fixed else 'none / silu / gelu'}, the call asks "
                         f"for {activation or 'none'}")
    y = out if out is not None else torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    if spec.kind is KernelKind.GROUPED_GEMM:
        if splits:
            raise ValueError(f"{spec.name}: the grouped GEMM has no split-K factor to force (splits={splits})")
        # the grouped sm90 GEMM: x's rows into token tiles of one expert each, and back
        tiles = token_tiles(expert_offsets, x.shape[0], spec.tile_n)
        xp = x.new_empty((tiles.capacity + 1, x.shape[1]))
        xp.index_copy_(0, tiles.positions, x)
        yp = launch_tiles(xp, experts, tiles, activation, spec)
        kept = (tiles.positions < tiles.capacity).unsqueeze(1)
        y.copy_(torch.where(kept, yp.index_select(0, tiles.positions), y))
        return y
    return _launch(x, experts.qdata, experts.scales, experts.zeros, expert_offsets, y, experts.weight_type,
                   experts.group_size, experts.n, experts.k, activation, spec, splits)


def launch_tiles(xp: torch.Tensor, experts: PackedExperts, tiles: TokenTiles, activation: Optional[str],
                 spec, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One launch of the grouped sm90 GEMM ``spec`` (:class:`mixgemm.jit.specs.GroupedGemmSpec`) on x
    laid out in token tiles (:mod:`mixgemm.moe.tiles`): ``xp [tiles.capacity + 1, K]`` (contiguous,
    16-byte aligned; the last row is the spare row). Returns ``yp [tiles.capacity + 1, N]`` (N/2
    for swiglu), or writes ``out`` of that shape; its padding rows hold whatever the kernel
    computed from the padding rows of x, the spare row is not written. Nothing is read back
    from the GPU."""

    if spec.tile_n != tiles.tile:
        raise ValueError(f"{spec.name} takes token tiles of {spec.tile_n} rows, the layout has {tiles.tile}")
    if experts.n % spec.tile_m:
        raise ValueError(f"{spec.name} needs every expert's N to be a multiple of {spec.tile_m}, got {experts.n}")
    if tuple(xp.shape) != (tiles.capacity + 1, experts.k) or xp.dtype != experts.dtype:
        raise ValueError(f"xp must be {experts.dtype} [{tiles.capacity + 1}, {experts.k}], got {xp.dtype} "
                         f"{list(xp.shape)}")
    n_out = experts.n // 2 if activation == "swiglu" else experts.n
    yp = out if out is not None else xp.new_empty((tiles.capacity + 1, n_out))
    if tuple(yp.shape) != (tiles.capacity + 1, n_out) or not yp.is_contiguous() or yp.data_ptr() % 16:
        raise ValueError(f"out must be contiguous, 16-byte aligned, [{tiles.capacity + 1}, {n_out}]")
    xp = aligned_contiguous(xp)
    kernel = runtime.KERNELS.get(spec, xp.device)
    helper = kernel.helper
    a = driver.GemmArgs()
    a.abi_version = driver.ABI_VERSION
    a.m, a.n, a.k, a.group_size = tiles.capacity, experts.n, experts.k, experts.group_size
    a.sm_count = heuristic.sm_count(xp.get_device())
    a.activation = Activation(activation or "none").abi
    a.swizzle = 1
    a.raster = TILES_RASTER.abi
    a.weight, a.scales = experts.qdata.data_ptr(), experts.scales.data_ptr()
    a.zeros = 0 if experts.zeros is None else experts.zeros.data_ptr()
    a.x, a.y = xp.data_ptr(), yp.data_ptr()
    a.ldx, a.ldy = experts.k, n_out
    params = ctypes.create_string_buffer(helper.params_size)
    launch = driver.Launch()
    err = ctypes.create_string_buffer(512)
    prepare = _prepare_symbol(helper.lib, "mixgemm_grouped_gemm_prepare")
    rc = prepare(ctypes.byref(a), tiles.table.data_ptr(), experts.num_experts, params, helper.params_size,
                 ctypes.byref(launch), err, len(err))
    if rc != 0:
        raise KernelError(f"{spec.name}: {err.value.decode()}")
    if launch.workspace_bytes:
        raise KernelError(f"{spec.name}: asks for a {launch.workspace_bytes}-byte workspace; the grouped GEMM has none")
    runtime.launch_prepared(kernel, params, launch)
    return yp


# ---------------------------------------------------------------------------------------------
# The routed mode of the grouped decode kernel
# ---------------------------------------------------------------------------------------------
#: The most top-k assignments (``T * topk``) the routed grouped decode kernel ranks (its threads:
#: one id each; ``grouped_decode_kernel.hpp``), and the most experts.
ROUTED_MAX_ASSIGNMENTS = 256
ROUTED_MAX_EXPERTS = 512


class _Routed(ctypes.Structure):
    """``mixgemm::grouped_decode::Routed``."""
    _fields_ = [("ids", ctypes.c_uint64), ("ids_bytes", ctypes.c_int32), ("topk", ctypes.c_int32),
                ("x_by_token", ctypes.c_int32), ("y_by_assignment", ctypes.c_int32)]


def routed_supports(rows: int, num_experts: int, spec) -> Optional[str]:
    """None if the routed grouped decode kernel ``spec`` takes ``rows = T * topk`` assignments over
    ``num_experts`` experts, else the reason."""
    if spec.kind is not KernelKind.GROUPED_DECODE:
        return f"{spec.name} is not a grouped decode kernel"
    most = min(ROUTED_MAX_ASSIGNMENTS, 32 * spec.warps)   # one id per thread
    if rows > most:
        return f"{rows} assignments: the routed kernel ranks at most {most}"
    if num_experts > ROUTED_MAX_EXPERTS:
        return f"{num_experts} experts: the routed kernel takes at most {ROUTED_MAX_EXPERTS}"
    return None


def decode_ctas(spec, n: int, rows: int, num_experts: int) -> int:
    """The CTAs of one launch of the grouped decode kernel ``spec`` over experts of ``n`` weight rows
    for ``rows`` rows of x, split-K aside: its row blocks times the ``min(E, rows)`` ranks."""
    per_cta = 16 * (spec.warps // spec.kslices)
    return -(-n // per_cta) * min(num_experts, rows)


def grouped_gemm_routed(x: torch.Tensor, experts: PackedExperts, topk_ids: torch.Tensor, spec=None,
                        out: Optional[torch.Tensor] = None, activation: Optional[str] = None, *,
                        x_by_token: bool = False, y_by_assignment: bool = False, splits: int = 0) -> torch.Tensor:
    """:func:`grouped_gemm` on the grouped decode kernel in its routed mode: no expert offsets and no
    sorted copy of x; every CTA ranks the top-k ids itself (at most :data:`ROUTED_MAX_ASSIGNMENTS`),
    so a MoE layer needs no routing launch (:func:`mixgemm.moe.fused_moe` at decode).

    Parameters
    ----------
    x : torch.Tensor
        With ``x_by_token``: ``[T, K]``, the layer's input, an assignment ``(t, s)`` reads row ``t``.
        Without: ``[T * topk, K]``, rows sorted by expert (stable: an expert's assignments in flat
        order ``t * topk + s``), as :func:`mixgemm.moe.route` orders them.
    experts : PackedExperts
        E experts ``[N, K]`` on x's device, ``E <=`` :data:`ROUTED_MAX_EXPERTS`.
    topk_ids : torch.Tensor
        ``[T, topk]`` int32 / int64 expert ids on x's device, contiguous. An id outside ``[0, E)``
        is dropped: its output row is not written.
    spec : GroupedDecodeSpec, optional
        The kernel (None: :func:`decode_spec_for`'s for ``T * topk`` rows).
    out : torch.Tensor, optional
        ``[T * topk, N]`` (``N/2`` for swiglu), x's dtype, contiguous, 16-byte aligned.
    activation : {None, "silu", "gelu", "swiglu"}, optional
        As in :func:`grouped_gemm`.
    x_by_token, y_by_assignment : bool
        Where x's rows come from (above) and where y's go: by assignment, row ``t * topk + s``
        (what :func:`mixgemm.moe.combine_by_assignment` reads), or sorted by expert.
    splits : int
        As in :func:`grouped_gemm_with_spec`.

    Returns
    -------
    torch.Tensor
        ``[T * topk, N]`` (``N/2`` for swiglu), x's dtype.
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError("topk_ids must be a [T, topk] tensor")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    t, topk = topk_ids.shape
    rows = t * topk
    _check_splits(splits)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != (t if x_by_token else rows):
        want = f"[T={t}, K]" if x_by_token else f"[T * topk = {rows}, K]"
        raise ValueError(f"x must be {want}, got {list(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
    n_out = _check(x, experts, None, out, activation, rows)
    if topk_ids.device != x.device or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous on {x.device}")
    if spec is None:
        spec = decode_spec_for(rows, experts.act_type, experts.weight_type, activation, experts.num_experts)
    why = routed_supports(rows, experts.num_experts, spec)
    if why:
        raise ValueError(why)
    _check_spec_types(spec, experts)
    if spec.fixed_activation is not Activation(activation or "none"):
        raise ValueError(f"{spec.name} computes {spec.fixed_activation.value}, the call asks for {activation or 'none'}")
    y = out if out is not None else torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    routed = _Routed(topk_ids.data_ptr(), topk_ids.element_size(), topk, int(x_by_token), int(y_by_assignment))
    return _launch(x, experts.qdata, experts.scales, experts.zeros, None, y, experts.weight_type,
                   experts.group_size, experts.n, experts.k, activation, spec, splits, routed=routed, rows=rows)


@functools.lru_cache(maxsize=None)
def _prepare_symbol(lib_handle, symbol: str):
    """A grouped kernel's prepare function in its helper library: ``mixgemm_grouped_prepare`` (the
    grouped decode kernels: the device offsets) or ``mixgemm_grouped_gemm_prepare`` (the grouped
    GEMM: the device token-tile table), both ``(GemmArgs*, uint64 device pointer, int32 experts,
    params, capacity, Launch*, err, errlen) -> int``."""
    f = getattr(lib_handle, symbol)
    f.argtypes = [ctypes.POINTER(GemmArgs), ctypes.c_uint64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint32,
                  ctypes.POINTER(Launch), ctypes.c_char_p, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def _prepare_fn(lib_handle):
    """The grouped decode kernels' prepare function."""
    return _prepare_symbol(lib_handle, "mixgemm_grouped_prepare")


@functools.lru_cache(maxsize=None)
def _routed_prepare_fn(lib_handle):
    """The grouped decode kernels' routed prepare function: ``(GemmArgs*, Routed*, int32 experts,
    params, capacity, Launch*, err, errlen) -> int``."""
    f = lib_handle.mixgemm_grouped_routed_prepare
    f.argtypes = [ctypes.POINTER(GemmArgs), ctypes.POINTER(_Routed), ctypes.c_int32, ctypes.c_void_p,
                  ctypes.c_uint32, ctypes.POINTER(Launch), ctypes.c_char_p, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def _grouped_args(qdata, scales, zeros, m: int, n: int, k: int, group_size: int, n_out: int,
                  activation: Optional[str], splits: int, device_index: int) -> GemmArgs:
    """A grouped decode launch's GemmArgs but for x and y (left 0): ``m`` rows of x (routed: the
    assignments), experts ``[n, k]``, y of ``n_out`` columns."""
    a = driver.GemmArgs()
    a.abi_version = driver.ABI_VERSION
    a.m, a.n, a.k, a.group_size = m, n, k, group_size
    a.sm_count = heuristic.sm_count(device_index)
    a.splits = splits
    a.activation = Activation(activation or "none").abi
    a.weight, a.scales = qdata.data_ptr(), scales.data_ptr()
    a.zeros = 0 if zeros is None else zeros.data_ptr()
    a.ldx, a.ldy = k, n_out
    return a


def routed_handover(experts: PackedExperts, spec, rows: int, activation: Optional[str], *, x_by_token: bool,
                    y_by_assignment: bool, device: torch.device) -> torch_ops.MoeGemm:
    """What :func:`grouped_gemm_routed` launches for ``rows`` assignments over ``experts`` on
    ``spec`` (default split-K), as the torch operator library's ``MixgemmMoeGemm``: the loaded
    kernel, its helper's routed prepare function and params size, the GemmArgs but for x and y,
    the routed flags, y's columns and the shapes of the weight's tensors. The kernel is loaded
    here if it is not already."""
    kernel = runtime.KERNELS.get(spec, device)
    helper = kernel.helper
    n_out = experts.n // 2 if activation == "swiglu" else experts.n
    g = torch_ops.MoeGemm()
    g.function = int(kernel.function)
    g.prepare = ctypes.cast(_routed_prepare_fn(helper.lib), ctypes.c_void_p).value
    g.programmatic = int(bool(kernel.spec.programmatic_launch))
    g.params_size = helper.params_size
    g.x_by_token, g.y_by_assignment = int(x_by_token), int(y_by_assignment)
    g.n_out = n_out
    g.qdata_sizes[:] = tuple(experts.qdata.shape)
    g.scales_sizes[:] = tuple(experts.scales.shape)
    g.args = _grouped_args(experts.qdata, experts.scales, experts.zeros, rows, experts.n, experts.k,
                           experts.group_size, n_out, activation, 0, device.index)
    return g


def _launch(x, qdata, scales, zeros, offsets, y, weight_type: WeightType, group_size: int, n: int, k: int,
            activation: Optional[str], spec, splits: int = 0, routed: Optional[_Routed] = None,
            rows: int = 0) -> torch.Tensor:
    """One grouped launch (checked arguments): the helper's params, then cuLaunchKernelEx on the
    current stream. Nothing is read back from the GPU. ``routed``: the routed mode (no offsets;
    ``rows`` assignments)."""

    x = aligned_contiguous(x)
    kernel = runtime.KERNELS.get(spec, x.device)
    helper = kernel.helper
    a = _grouped_args(qdata, scales, zeros, rows if routed is not None else x.shape[0], n, k, group_size, y.shape[1],
                      activation, splits, x.get_device())
    a.x, a.y = x.data_ptr(), y.data_ptr()
    params = ctypes.create_string_buffer(helper.params_size)
    launch = driver.Launch()
    err = ctypes.create_string_buffer(512)
    if routed is not None:
        rc = _routed_prepare_fn(helper.lib)(ctypes.byref(a), ctypes.byref(routed), qdata.shape[0], params,
                                            helper.params_size, ctypes.byref(launch), err, len(err))
    else:
        rc = _prepare_fn(helper.lib)(ctypes.byref(a), offsets.data_ptr(), qdata.shape[0], params, helper.params_size,
                                     ctypes.byref(launch), err, len(err))
    if rc != 0:
        raise KernelError(f"{spec.name}: {err.value.decode()}")
    runtime.launch_prepared(kernel, params, launch)
    return y


# ---------------------------------------------------------------------------------------------
# The custom op
# ---------------------------------------------------------------------------------------------
@custom_op("mixgemm::grouped_gemm", mutates_args=())
def _grouped_op(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                expert_offsets: torch.Tensor, weight_type: str, group_size: int, n: int, k: int,
                activation: str = "none") -> torch.Tensor:
    experts = PackedExperts(qdata, scales, zeros, WeightType(weight_type), group_size, n, k)
    return grouped_gemm(x, experts, expert_offsets, activation=None if activation == "none" else activation)


@_grouped_op.register_fake
def _grouped_fake(x, qdata, scales, zeros, expert_offsets, weight_type, group_size, n, k, activation="none"):
    return x.new_empty((x.shape[0], n // 2 if activation == "swiglu" else n))


def grouped_gemm_op(x: torch.Tensor, experts: PackedExperts, expert_offsets: torch.Tensor,
                    activation: Optional[str] = None) -> torch.Tensor:
    """:func:`grouped_gemm` through the registered custom op (traceable by torch.compile)."""
    return torch.ops.mixgemm.grouped_gemm(x, experts.qdata, experts.scales, experts.zeros, expert_offsets,
                                          experts.weight_type.value, experts.group_size, experts.n, experts.k,
                                          activation or "none")
