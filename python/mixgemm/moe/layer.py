"""The fused MoE layer: routing, gate/up with swiglu, down and the weighted top-k sum, on the
grouped kernels of :mod:`mixgemm.moe.grouped` (re-exported by :mod:`mixgemm.moe`:
``mixgemm.moe.fused_moe``).

:func:`plan_fused_moe` picks, from what the host knows (the rows ``T * topk``, the number of
experts, the shapes), one of three plans (:class:`MoePlan`):

* **decode**: both GEMMs on the grouped decode kernel (a few rows per expert);
* **tiles**: both GEMMs on the grouped sm90 GEMM over x's rows in token tiles (many rows per
  expert; :func:`mixgemm.moe.tiles.token_tiles`);
* **split**: in between, the experts with fewer than ``hot_from`` rows on the grouped decode
  kernel and the others on the grouped GEMM (:func:`mixgemm.moe.tiles.split_layout`). Which
  experts are hot is decided on the GPU from the routing, so skewed routing (one expert with
  hundreds of rows among many with a few) costs the hot experts one token-tile pass each instead
  of one weight pass per 16 rows, with no host sync. Both kernels are launched; the one with
  nothing to do exits at once.

At decode sizes :func:`fused_moe` takes the routed decode plan (:func:`routed_plan`): three
launches. The custom op ``mixgemm::fused_moe`` (:func:`fused_moe_op`, :class:`mixgemm.nn.QuantMoE`)
also has a C++ kernel at its CUDA key (:mod:`mixgemm.jit.torch_ops`): its Python kernel hands the
torch operator library a MoE plan for each routed call it runs, and the C++ kernel launches the
three kernels of every later plain call with the same weights, sizes and dtypes without Python.
Every other call reaches the Python kernel, registered as ``mixgemm::fused_moe_py``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..dispatch import heuristic, plans
from ..dispatch.library import custom_op
from ..dtypes import WeightType
from ..jit import torch_ops
from ..jit.catalog import GROUPED_GEMM_TILES
from ..jit.driver import capturing
from ..jit.specs import Epilogue, GroupedGemmSpec, KernelKind
from ..weights.experts import PackedExperts
from ..weights.quantize import deinterleave_rows
from . import grouped
from .routing import assignment_combine_kernel, combine, combine_by_assignment, route_and_gather
from .tiles import split_layout, token_tiles

__all__ = ["MoePlan", "plan_fused_moe", "routed_plan", "routed_fits", "fused_moe", "fused_moe_op", "fused_moe_reference",
           "ROUTED_MAX_CTAS_PER_SM"]

#: Rows per expert with rows (mean) from which :func:`plan_fused_moe` splits the experts between the
#: grouped decode kernel and the grouped GEMM, below the grouped GEMM's own threshold
#: (docs/moe.md).
SPLIT_FROM_ROWS = 8


@dataclasses.dataclass(frozen=True)
class MoePlan:
    """The grouped kernels of one :func:`fused_moe` call. ``gate_up`` / ``down``: the grouped decode
    kernels (plan "decode" and the cold experts of "split") or the grouped GEMMs (plan "tiles").
    ``hot_gate_up`` / ``hot_down``: the grouped GEMMs of plan "split" for the experts with at least
    ``hot_from`` rows."""

    gate_up: object
    down: object
    hot_gate_up: Optional[object] = None
    hot_down: Optional[object] = None
    hot_from: int = 0

    @property
    def kind(self) -> str:
        """"split" (hot experts on the grouped GEMM), "tiles" (both GEMMs on the grouped GEMM over
        one token-tile layout) or "each" (one :func:`mixgemm.moe.grouped.grouped_gemm_with_spec` call per
        GEMM: the grouped decode kernels, or gate/up and down on different token tiles)."""
        if self.hot_gate_up is not None:
            return "split"
        if (self.gate_up.kind is KernelKind.GROUPED_GEMM and self.down.kind is KernelKind.GROUPED_GEMM
                and self.gate_up.tile_n == self.down.tile_n):
            return "tiles"
        return "each"

    @property
    def specs(self) -> tuple:
        """Every kernel the plan launches (gate/up, down, then the hot ones)."""
        return tuple(s for s in (self.gate_up, self.down, self.hot_gate_up, self.hot_down) if s is not None)


@functools.lru_cache(maxsize=1024)
def plan_fused_moe(rows: int, act_type, weight_type: WeightType, num_experts: int, hidden: int,
                   intermediate: int) -> MoePlan:
    """The :class:`MoePlan` of :func:`fused_moe` for ``rows = T * topk`` assignments over experts
    ``[2 * intermediate, hidden]`` (gate/up) and ``[hidden, intermediate]`` (down). Gate/up's
    kernel (:func:`mixgemm.moe.grouped.grouped_spec_for`) decides; down follows on the same layout. Below
    the grouped GEMM's threshold but from :data:`SPLIT_FROM_ROWS` rows per expert: "split", the
    experts with at least that threshold's rows on the 64-row grouped GEMM. A pure function of its
    arguments (every one hashable, the plan frozen), cached: it took ~43 us of host time per
    fused_moe call. (An experiment that patches this module's or :mod:`mixgemm.moe.grouped`'s
    thresholds calls ``plan_fused_moe.cache_clear()``.)"""
    tile_m = GROUPED_GEMM_TILES["g64"][0]
    spec13 = grouped.grouped_spec_for(rows, act_type, weight_type, "swiglu", num_experts, 2 * intermediate, hidden)
    if spec13.kind is KernelKind.GROUPED_GEMM and hidden % tile_m == 0:
        return MoePlan(spec13, GroupedGemmSpec(act_type, weight_type, spec13.tile_m, spec13.tile_n, spec13.tile_k))
    spec2 = grouped.decode_spec_for(rows, act_type, weight_type, None, num_experts)
    per_expert = rows / max(1, min(num_experts, rows))
    if spec13.kind is KernelKind.GROUPED_DECODE and per_expert >= SPLIT_FROM_ROWS \
            and (2 * intermediate) % tile_m == 0 and hidden % tile_m == 0:
        tile = GROUPED_GEMM_TILES["g64"]
        hot_from = grouped.tiles_from_rows(hidden)
        return MoePlan(spec13, spec2, GroupedGemmSpec(act_type, weight_type, *tile, Epilogue.SWIGLU),
                       GroupedGemmSpec(act_type, weight_type, *tile), hot_from)
    if spec13.kind is KernelKind.GROUPED_GEMM:   # gate/up on the grouped GEMM, down cannot follow
        spec2 = grouped.grouped_spec_for(rows, act_type, weight_type, None, num_experts, hidden, intermediate)
    return MoePlan(spec13, spec2)


def fused_moe(x: torch.Tensor, w13: PackedExperts, w2: PackedExperts, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """A MoE block's experts: ``out[t] = sum_s topk_weights[t, s] * expert_{topk_ids[t, s]}(x[t])``
    with ``expert_e(v) = (silu(v @ gate_e.T) * (v @ up_e.T)) @ down_e.T``.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, H]`` hidden states, bf16 / fp16.
    w13 : PackedExperts
        ``E x [2I, H]``: each expert's gate and up projections interleaved in 8-row stripes
        (:func:`mixgemm.weights.quantize.interleave_gate_up`), as the swiglu epilogue reads them.
    w2 : PackedExperts
        ``E x [H, I]``: the down projections.
    topk_weights : torch.Tensor
        ``[T, topk]`` routing weights (any float dtype; applied in float32).
    topk_ids : torch.Tensor
        ``[T, topk]`` integer expert ids in ``[0, E)``.

    Returns
    -------
    torch.Tensor
        ``[T, H]`` in x's dtype. Routing runs on the GPU, no host sync. At decode sizes
        (:func:`routed_plan`: both GEMMs on the grouped decode kernel, ``T * topk <=``
        :data:`mixgemm.moe.grouped.ROUTED_MAX_ASSIGNMENTS`) three launches: the two routed grouped
        GEMMs (:func:`mixgemm.moe.grouped_gemm_routed`: each CTA ranks the top-k ids itself; gate/up
        reads x by token, down writes by assignment) and :func:`mixgemm.moe.combine_by_assignment`.
        Otherwise routing and gather (:func:`mixgemm.moe.route_and_gather`) first, then the GEMMs
        and :func:`mixgemm.moe.combine`. With more rows per expert (:func:`plan_fused_moe`) the GEMMs
        run on the grouped sm90 GEMM over x's rows in token tiles, for all experts or for those
        the routing gave many rows (one more launch, the layout kernel, lays the rows out on the GPU).
    """
    if not isinstance(w13, PackedExperts) or not isinstance(w2, PackedExperts):
        raise TypeError("w13 and w2 must be mixgemm.moe.PackedExperts")
    if w13.num_experts != w2.num_experts:
        raise ValueError(f"w13 has {w13.num_experts} experts, w2 has {w2.num_experts}")
    if x.dim() != 2 or w13.k != x.shape[1] or w2.n != x.shape[1] or w2.k * 2 != w13.n:
        raise ValueError(f"shapes disagree: x {list(x.shape)}, w13 E x [{w13.n}, {w13.k}] (want [2I, H]), "
                         f"w2 E x [{w2.n}, {w2.k}] (want [H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_weights and topk_ids must both be [T={x.shape[0]}, topk], got "
                         f"{list(topk_weights.shape)} and {list(topk_ids.shape)}")
    rows = topk_ids.numel()
    plan = plan_fused_moe(rows, w13.act_type, w13.weight_type, w13.num_experts, w2.n, w2.k)
    if routed_plan(plan, w13, w2, x, topk_ids):
        # three launches: gate/up reads x by token and ranks the ids itself, down writes by assignment
        ids = topk_ids.contiguous()
        h = grouped.grouped_gemm_routed(x, w13, ids, plan.gate_up, activation="swiglu", x_by_token=True)
        y = grouped.grouped_gemm_routed(h, w2, ids, plan.down, y_by_assignment=True)
        return combine_by_assignment(y, ids, topk_weights, w13.num_experts)
    routing, xs = route_and_gather(x, topk_ids, w13.num_experts)
    if rows == 0 or plan.kind == "each":
        h = grouped.grouped_gemm_with_spec(xs, w13, routing.expert_offsets, plan.gate_up, activation="swiglu")
        y = grouped.grouped_gemm_with_spec(h, w2, routing.expert_offsets, plan.down)
        return combine(y, routing, topk_weights)
    if plan.kind == "tiles":
        # both GEMMs on the grouped sm90 GEMM over one token-tile layout
        tiles = token_tiles(routing.expert_offsets, rows, plan.gate_up.tile_n, routing.inv)
        xp = xs.new_empty((tiles.capacity + 1, xs.shape[1]))
        xp.index_copy_(0, tiles.positions, xs)
        hp = grouped.launch_tiles(xp, w13, tiles, "swiglu", plan.gate_up)
        yp = grouped.launch_tiles(hp, w2, tiles, None, plan.down)
        return combine(yp, routing._replace(inv=tiles.inv), topk_weights)
    # split: one buffer, the cold experts' rows first (grouped decode), then the hot experts' tiles
    lay = split_layout(routing.expert_offsets, rows, plan.hot_gate_up.tile_n, plan.hot_from, routing.inv)
    total = rows + lay.tiles.capacity + 1
    xb = xs.new_empty((total, xs.shape[1]))
    xb.index_copy_(0, lay.tiles.positions, xs)
    hb = xs.new_empty((total, w13.n // 2))
    yb = xs.new_empty((total, w2.n))
    grouped.grouped_gemm_with_spec(xb[:rows], w13, lay.cold_offsets, plan.gate_up, out=hb[:rows], activation="swiglu")
    grouped.launch_tiles(xb[rows:], w13, lay.tiles, "swiglu", plan.hot_gate_up, out=hb[rows:])
    grouped.grouped_gemm_with_spec(hb[:rows], w2, lay.cold_offsets, plan.down, out=yb[:rows])
    grouped.launch_tiles(hb[rows:], w2, lay.tiles, None, plan.hot_down, out=yb[rows:])
    return combine(yb, routing._replace(inv=lay.tiles.inv), topk_weights)


#: The most CTAs per SM (the two grouped decode launches together, split-K aside) for which
#: :func:`fused_moe` takes the routed path (docs/moe.md).
ROUTED_MAX_CTAS_PER_SM = 8


def routed_plan(plan: MoePlan, w13: PackedExperts, w2: PackedExperts, x: torch.Tensor,
                topk_ids: torch.Tensor) -> bool:
    """Whether :func:`fused_moe` runs ``plan`` on the routed grouped decode kernels (three launches:
    gate/up ranks the top-k ids itself and reads x by token, down writes by assignment, then
    :func:`mixgemm.moe.combine_by_assignment`) instead of routing first (four): both GEMMs on the
    grouped decode kernel, at most :data:`mixgemm.moe.grouped.ROUTED_MAX_ASSIGNMENTS` assignments
    and :data:`mixgemm.moe.grouped.ROUTED_MAX_EXPERTS` experts, int32 / int64 ids, on the GPU, and
    at most :data:`ROUTED_MAX_CTAS_PER_SM` CTAs per SM in the two launches.

    Every CTA of a routed launch ranks the ids before it streams its expert, which costs each CTA
    a little more than reading the offsets. With a few CTAs per SM that is less than the routing
    launch it saves (measured 2.3-4.2 us faster per call on qwen3-30b-a3b at 1 and 4 tokens and
    mixtral-8x7b at one token, 4 and 2-bit codes); with many, more (mixtral-8x7b at 4 and 16
    tokens, 1-2% slower; 8-bit codes at one token, whose k-sliced tile runs a CTA per 16 weight
    rows, 5%; docs/moe.md)."""
    if not (x.is_cuda and topk_ids.dtype in (torch.int32, torch.int64) and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    return routed_fits(plan, topk_ids.numel(), w13.num_experts, w13.n, w2.n, heuristic.sm_count(x.get_device()))


def routed_fits(plan: MoePlan, rows: int, num_experts: int, n_gate_up: int, n_down: int, sm_count: int) -> bool:
    """:func:`routed_plan`'s rule on the plan and the shapes alone: ``plan`` runs both GEMMs on the
    grouped decode kernel, the routed kernel takes ``rows`` assignments over ``num_experts``
    experts, and the two launches (gate/up of ``n_gate_up`` weight rows per expert, down of
    ``n_down``) have at most :data:`ROUTED_MAX_CTAS_PER_SM` CTAs per SM of ``sm_count``, split-K aside."""
    if not (plan.kind == "each" and rows > 0
            and grouped.routed_supports(rows, num_experts, plan.gate_up) is None
            and grouped.routed_supports(rows, num_experts, plan.down) is None):
        return False
    ctas = (grouped.decode_ctas(plan.gate_up, n_gate_up, rows, num_experts)
            + grouped.decode_ctas(plan.down, n_down, rows, num_experts))
    return ctas <= ROUTED_MAX_CTAS_PER_SM * sm_count


# ---------------------------------------------------------------------------------------------
# The custom ops
# ---------------------------------------------------------------------------------------------
def _fused_moe_dispatched(x, w13_qdata, w13_scales, w13_zeros, w2_qdata, w2_scales, w2_zeros, weight_type,
                          w13_group_size, w2_group_size, hidden, intermediate, topk_weights, topk_ids):
    """The Python kernel of the operators ``mixgemm::fused_moe`` and ``mixgemm::fused_moe_py``:
    :func:`fused_moe`, and on a CUDA call that took the routed plan the torch operator library
    loaded and handed the call's MoE plan (:func:`_hand_over`), so that its C++ kernel launches
    every later plain call with these weights, sizes and dtypes
    (:class:`mixgemm.dispatch.plans.OperatorLibrary`)."""
    wt = WeightType(weight_type)
    w13 = PackedExperts(w13_qdata, w13_scales, w13_zeros, wt, w13_group_size, 2 * intermediate, hidden)
    w2 = PackedExperts(w2_qdata, w2_scales, w2_zeros, wt, w2_group_size, hidden, intermediate)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    if x.is_cuda and plans.OPERATORS.attach() is not None:
        _hand_over(x, w13, w2, topk_weights, topk_ids)
    return out


def _weight_pointers(experts: PackedExperts) -> tuple[int, int, int]:
    return (experts.qdata.data_ptr(), experts.scales.data_ptr(),
            0 if experts.zeros is None else experts.zeros.data_ptr())


def _hand_over(x: torch.Tensor, w13: PackedExperts, w2: PackedExperts, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> None:
    """Hand the torch operator library the MoE plan of a call :func:`fused_moe` has just run (its
    kernels loaded), if it ran the routed plan with the combine kernel: the two routed grouped
    decode launches (:func:`mixgemm.moe.grouped.routed_handover`) and the combine kernel, keyed by
    the weights' pointers and shapes, the rows and top-k, x's, the ids' and the weights' dtypes,
    the device and the capture state. Once per key; nothing for any other call."""
    lib = plans.OPERATORS.lib
    if lib is None or topk_weights.dtype not in torch_ops.WEIGHTS_DTYPE_CODES:
        return
    rows = topk_ids.numel()
    plan = plan_fused_moe(rows, w13.act_type, w13.weight_type, w13.num_experts, w2.n, w2.k)
    if not routed_plan(plan, w13, w2, x, topk_ids):
        return
    tokens, topk = topk_ids.shape
    summing = assignment_combine_kernel(x.dtype, w2.n, tokens, topk_weights.dtype, x.device)
    if summing is None:
        return
    key = lib.moe_key(w13=_weight_pointers(w13), w2=_weight_pointers(w2), hidden=w2.n, intermediate=w2.k,
                      w13_group_size=w13.group_size, w2_group_size=w2.group_size, num_experts=w13.num_experts,
                      rows=rows, topk=topk, weight_type=w13.weight_type.value, dtype=x.dtype,
                      ids_bytes=topk_ids.element_size(), weights_dtype=topk_weights.dtype, device=x.get_device(),
                      capturing=capturing())
    if plans.OPERATORS.holds_moe(key):
        return
    kernel, weights_dtype, threads = summing
    moe_plan = torch_ops.MoePlan()
    moe_plan.gate_up = grouped.routed_handover(w13, plan.gate_up, rows, "swiglu", x_by_token=True,
                                               y_by_assignment=False, device=x.device)
    moe_plan.down = grouped.routed_handover(w2, plan.down, rows, None, x_by_token=False, y_by_assignment=True,
                                            device=x.device)
    moe_plan.combine = int(kernel.function)
    moe_plan.combine_programmatic = int(bool(kernel.spec.programmatic_launch))
    moe_plan.combine_threads = threads
    moe_plan.combine_weights = torch_ops.WEIGHTS_DTYPE_CODES[weights_dtype]
    plans.OPERATORS.put_moe(key, moe_plan, (w13.qdata, w13.scales, w13.zeros, w2.qdata, w2.scales, w2.zeros))


@custom_op("mixgemm::fused_moe", mutates_args=())
def _fused_moe_op(x: torch.Tensor, w13_qdata: torch.Tensor, w13_scales: torch.Tensor, w13_zeros: Optional[torch.Tensor],
                  w2_qdata: torch.Tensor, w2_scales: torch.Tensor, w2_zeros: Optional[torch.Tensor], weight_type: str,
                  w13_group_size: int, w2_group_size: int, hidden: int, intermediate: int,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    return _fused_moe_dispatched(x, w13_qdata, w13_scales, w13_zeros, w2_qdata, w2_scales, w2_zeros, weight_type,
                                 w13_group_size, w2_group_size, hidden, intermediate, topk_weights, topk_ids)


@custom_op("mixgemm::fused_moe_py", mutates_args=())
def _fused_moe_py_op(x: torch.Tensor, w13_qdata: torch.Tensor, w13_scales: torch.Tensor,
                     w13_zeros: Optional[torch.Tensor], w2_qdata: torch.Tensor, w2_scales: torch.Tensor,
                     w2_zeros: Optional[torch.Tensor], weight_type: str, w13_group_size: int, w2_group_size: int,
                     hidden: int, intermediate: int, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """The Python kernel of ``mixgemm::fused_moe``, for the calls its C++ kernel hands over."""
    return _fused_moe_dispatched(x, w13_qdata, w13_scales, w13_zeros, w2_qdata, w2_scales, w2_zeros, weight_type,
                                 w13_group_size, w2_group_size, hidden, intermediate, topk_weights, topk_ids)


def _fused_moe_fake(x, w13_qdata, w13_scales, w13_zeros, w2_qdata, w2_scales, w2_zeros, weight_type, w13_group_size,
                    w2_group_size, hidden, intermediate, topk_weights, topk_ids):
    return torch.empty_like(x)


for _op in (_fused_moe_op, _fused_moe_py_op):
    _op.register_fake(_fused_moe_fake)


def fused_moe_op(x: torch.Tensor, w13: PackedExperts, w2: PackedExperts, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """:func:`fused_moe` through the registered custom op ``mixgemm::fused_moe`` (traceable by
    torch.compile; :class:`mixgemm.nn.moe.QuantMoE`). w13 and w2 must share their weight type."""
    if not isinstance(w13, PackedExperts) or not isinstance(w2, PackedExperts):
        raise TypeError("w13 and w2 must be mixgemm.moe.PackedExperts")
    if w13.weight_type != w2.weight_type:
        raise ValueError(f"w13 is {w13.weight_type.value}, w2 is {w2.weight_type.value}: the op takes one weight type")
    return torch.ops.mixgemm.fused_moe(x, w13.qdata, w13.scales, w13.zeros, w2.qdata, w2.scales, w2.zeros,
                                       w13.weight_type.value, w13.group_size, w2.group_size, w2.n, w2.k,
                                       topk_weights, topk_ids)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """The unfused MoE in torch, token by token and slot by slot, for tests: ``w13 [E, 2I, H]``
    gate/up interleaved in 8-row stripes, ``w2 [E, H, I]`` (dense, e.g. dequantized), the
    intermediate rounded to x's dtype as the fused path rounds it, float32 accumulation."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        gate, up = deinterleave_rows(w13[e])
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        v = x[tok].float()
        h = (torch.nn.functional.silu(v @ gate.float().T) * (v @ up.float().T)).to(x.dtype)
        y = (h.float() @ w2[e].float().T).to(x.dtype)
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot].float().unsqueeze(-1))
    return out.to(x.dtype)
