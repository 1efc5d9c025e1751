"""Routing of a MoE layer's top-k assignments, and the weighted sum of the top-k outputs.

* :func:`route`: the assignments sorted by expert with torch ops (a stable sort, counts, a
  cumsum), on their device, no host sync: any size, any device.
* :func:`route_and_gather`: the same routing and the rows of x gathered in sorted order, in one
  launch of mixgemm's routing kernel (``cutlass_ext/mixgemm/moe_route_kernel.hpp``,
  :class:`mixgemm.jit.specs.MoeRouteSpec`) on an sm_90 GPU when ``T * topk <=``
  :data:`ROUTE_MAX_ASSIGNMENTS` and ``E <=`` :data:`ROUTE_MAX_EXPERTS`; else :func:`route` and a
  torch gather. Both give the same order, offsets and rows, bit for bit.
* :func:`combine`: ``out[t] = sum_s w[t, s] * y[row of (t, s)]``, float32 in slot order, one
  rounding; one launch of mixgemm's combine kernel (:class:`mixgemm.jit.specs.MoeCombineSpec`)
  on an sm_90 GPU when the routing carries ``inv`` (:func:`route_and_gather`'s does) and
  ``T <=`` :data:`COMBINE_MAX_TOKENS`, else torch ops.
* :func:`combine_by_assignment`: the same sum on expert outputs by assignment (row ``t * topk +
  s``, as the routed grouped decode kernel writes them), ids out of range dropped; the same
  combine kernel, given the ids instead of ``inv``.

``torch.ops.mixgemm.route_and_gather`` and ``torch.ops.mixgemm.combine`` are registered with fake
implementations, so ``torch.compile(fullgraph=True)`` traces them.
Under CUDA-graph capture the kernels must be loaded already: any call of :func:`route_and_gather`
on the GPU loads the routing kernel (even when it takes the torch path), and any call of
:func:`combine` with ``inv`` (or of :func:`combine_by_assignment`) its combine kernel, so one
warm-up call of the layer at the captured size suffices.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch

from ..dispatch import checks, heuristic
from ..dispatch.library import custom_op
from ..dtypes import ActType
from ..jit import loader as runtime
from ..jit.loader import aligned_contiguous
from ..jit.specs import IndexType, MoeCombineSpec, MoeRouteSpec, RoutingWeightType

__all__ = ["Routing", "route", "route_and_gather", "combine", "combine_by_assignment", "routing_specs",
           "assignment_combine_kernel", "ROUTE_MAX_ASSIGNMENTS", "ROUTE_MAX_EXPERTS", "COMBINE_MAX_TOKENS"]

#: The most assignments (``T * topk``) the routing kernel takes in one launch (mirrors
#: ``kRouteMaxAssignments``); above it :func:`route_and_gather` takes the torch path.
ROUTE_MAX_ASSIGNMENTS = 4096
#: The most experts the routing kernel takes (``kRouteMaxExperts``).
ROUTE_MAX_EXPERTS = 512
#: The most tokens the combine kernel takes (its grid's y dimension); beyond, torch ops.
COMBINE_MAX_TOKENS = 65535
#: Bytes of x a CTA of the routing kernel gathers before another CTA is added (up to the SM count).
_GATHER_BYTES_PER_CTA = 64 * 1024
_ROUTE_THREADS, _COMBINE_THREADS = 1024, 128


class Routing(NamedTuple):
    """The top-k assignments sorted by expert. ``order[j]`` (int64) is the flat index (``token *
    topk + slot``) of sorted row j, ``tokens[j] = order[j] // topk`` (int64) its token, and
    ``expert_offsets`` (int32 ``[E + 1]``) the row range of each expert. ``inv`` (int32, or None
    from :func:`route`) is the inverse permutation: flat index -> sorted row (-1: an id out of
    range, dropped by the routing kernel)."""

    order: torch.Tensor
    tokens: torch.Tensor
    expert_offsets: torch.Tensor
    inv: Optional[torch.Tensor] = None


def _check_ids(topk_ids: torch.Tensor) -> None:
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, topk], got {list(getattr(topk_ids, 'shape', []))}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")


def route(topk_ids: torch.Tensor, num_experts: int) -> Routing:
    """Sort the top-k assignments ``topk_ids`` (``[T, topk]``, integer expert ids in
    ``[0, num_experts)``) by expert, with torch ops on their device and no host sync (a stable
    sort: rows of one expert stay in token order). Ids out of range are not checked (that would
    need a sync); they make the counts wrong. ``inv`` is left None."""
    _check_ids(topk_ids)
    topk = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0, dtype=torch.int32)
    return Routing(order, torch.div(order, topk, rounding_mode="floor"), offsets)


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------
def route_spec(topk_ids: torch.Tensor):
    """The routing kernel for ``topk_ids``' dtype (int32 or int64), or None for other dtypes."""
    index = {torch.int32: IndexType.I32, torch.int64: IndexType.I64}.get(topk_ids.dtype)
    return None if index is None else MoeRouteSpec(index)


def combine_spec(y_sorted: torch.Tensor, topk_weights: torch.Tensor):
    """The combine kernel for ``y_sorted``'s dtype and ``topk_weights``' (float32, bfloat16 and
    float16 have their own; other float dtypes are converted to float32 first)."""

    weight = {torch.bfloat16: RoutingWeightType.BF16, torch.float16: RoutingWeightType.F16}.get(
        topk_weights.dtype, RoutingWeightType.F32)
    return MoeCombineSpec(ActType.from_torch(y_sorted.dtype), weight)


def routing_specs(act_type, ids_dtype: torch.dtype = torch.int64, weights_dtype: torch.dtype = torch.float32) -> list:
    """The routing and combine kernels :func:`mixgemm.moe.fused_moe` launches on an sm_90 GPU for
    activations of ``act_type`` (:class:`mixgemm.dtypes.ActType`), top-k ids of ``ids_dtype`` and
    weights of ``weights_dtype`` (e.g. to build a run's kernels beforehand)."""
    spec = route_spec(torch.empty(0, dtype=ids_dtype))
    out = [] if spec is None else [spec]
    return out + [combine_spec(torch.empty(0, dtype=act_type.torch_dtype), torch.empty(0, dtype=weights_dtype))]


def _launch_route(spec, x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    t, topk = topk_ids.shape
    n, h = t * topk, x.shape[1]
    dev = x.device
    x, ids = aligned_contiguous(x), topk_ids.contiguous()
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    order = torch.empty(n, dtype=torch.int64, device=dev)
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    inv = torch.empty(n, dtype=torch.int32, device=dev)
    xs = torch.empty((n, h), dtype=x.dtype, device=dev)
    row_vecs = h * x.element_size() // 16
    ctas = max(1, min(heuristic.sm_count(x.get_device()), -(-n * h * x.element_size() // _GATHER_BYTES_PER_CTA)))
    kernel = runtime.KERNELS.get(spec, dev)
    p, i = ctypes.c_void_p, ctypes.c_int
    runtime.launch_kernel(kernel, (ctas, 1, 1), _ROUTE_THREADS,
                          (p(ids.data_ptr()), p(x.data_ptr()), p(offsets.data_ptr()), p(order.data_ptr()),
                           p(tokens.data_ptr()), p(inv.data_ptr()), p(xs.data_ptr()), i(n), i(topk), i(num_experts),
                           i(row_vecs)))
    return Routing(order, tokens, offsets, inv), xs


def _route_kernel_takes(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, spec) -> bool:
    n = topk_ids.numel()
    return (spec is not None and 1 <= n <= ROUTE_MAX_ASSIGNMENTS and 1 <= num_experts <= ROUTE_MAX_EXPERTS
            and x.dtype in (torch.bfloat16, torch.float16) and (x.shape[1] * x.element_size()) % 16 == 0)


def route_and_gather(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple[Routing, torch.Tensor]:
    """:func:`route` and the rows of x in sorted order, ``xs[j] = x[tokens[j]]``, with ``inv``.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, H]`` hidden states.
    topk_ids : torch.Tensor
        ``[T, topk]`` integer expert ids on x's device.
    num_experts : int
        E.

    Returns
    -------
    (Routing, torch.Tensor)
        The routing (``inv`` set) and ``xs [T * topk, H]`` in x's dtype. On an sm_90 GPU with
        int32 / int64 ids, bf16 / fp16 x, ``H * 2 % 16 == 0``, ``1 <= T * topk <=``
        :data:`ROUTE_MAX_ASSIGNMENTS` and ``E <=`` :data:`ROUTE_MAX_EXPERTS`: one launch of the
        routing kernel, no host sync, the same result as :func:`route` bit for bit; an id out of
        ``[0, E)`` is dropped there (counted in no expert, ``inv = -1``; the sorted rows past
        ``expert_offsets[E]``, one per dropped assignment, hold ``order = tokens = -1`` and zero
        rows in xs). Otherwise :func:`route` and a torch gather (ids out of range are an error
        or wrong counts there, as in :func:`route`).
    """
    _check_ids(topk_ids)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"x must be [T={topk_ids.shape[0]}, H], got {list(getattr(x, 'shape', []))}")
    if x.device != topk_ids.device:
        raise ValueError(f"x is on {x.device} but topk_ids is on {topk_ids.device}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if checks.on_sm90(x.device):
        spec = route_spec(topk_ids)
        if _route_kernel_takes(x, topk_ids, num_experts, spec):
            return _launch_route(spec, x, topk_ids, num_experts)
        if spec is not None:
            runtime.KERNELS.get(spec, x.device)   # loaded for a later call under graph capture
    r = route(topk_ids, num_experts)
    n = r.order.numel()
    inv = torch.empty(n, dtype=torch.int32, device=r.order.device)
    inv.scatter_(0, r.order, torch.arange(n, dtype=torch.int32, device=r.order.device))
    return r._replace(inv=inv), x[r.tokens]


def _combine_torch(y_sorted: torch.Tensor, routing: Routing, topk_weights: torch.Tensor) -> torch.Tensor:
    t, topk = topk_weights.shape
    if routing.inv is not None:
        # each slot's row through inv (which may point into a padded y, moe_tiles); -1 adds nothing
        inv = routing.inv.long()
        y = y_sorted.index_select(0, inv.clamp(min=0)) * (inv >= 0).unsqueeze(1).to(y_sorted.dtype)
        acc = y.view(t, topk, y_sorted.shape[1]).float() * topk_weights.float().unsqueeze(-1)
        return acc.sum(1).to(y_sorted.dtype)
    y = torch.empty_like(y_sorted)
    y[routing.order] = y_sorted
    acc = y.view(t, topk, y_sorted.shape[1]).float() * topk_weights.float().unsqueeze(-1)
    return acc.sum(1).to(y_sorted.dtype)


def _launch_combine(y_sorted: torch.Tensor, inv: Optional[torch.Tensor], topk_weights: torch.Tensor,
                    topk_ids: Optional[torch.Tensor] = None, num_experts: int = 0) -> torch.Tensor:
    """The combine kernel: through ``inv`` (y's rows sorted, or padded), or without it (None) on y's
    rows by assignment, the slots whose ``topk_ids`` lie outside ``[0, num_experts)`` dropped."""
    spec = combine_spec(y_sorted, topk_weights)
    t, topk = topk_weights.shape
    h = y_sorted.shape[1]
    y = aligned_contiguous(y_sorted)
    w = topk_weights.to(_WEIGHT_DTYPES[spec.weight.value]).contiguous()
    inv = None if inv is None else inv.contiguous()
    ids = None if topk_ids is None else topk_ids.contiguous()
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    if t == 0:
        return out
    row_vecs = h * y.element_size() // 16
    kernel = runtime.KERNELS.get(spec, y.device)
    p, i = ctypes.c_void_p, ctypes.c_int
    runtime.launch_kernel(kernel, (-(-row_vecs // _COMBINE_THREADS), t, 1), _COMBINE_THREADS,
                          (p(y.data_ptr()), p(w.data_ptr()), p(0 if inv is None else inv.data_ptr()),
                           p(0 if ids is None else ids.data_ptr()), i(0 if ids is None else ids.element_size()),
                           i(num_experts), p(out.data_ptr()), i(topk), i(row_vecs)))
    return out


def combine_by_assignment(y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          num_experts: int) -> torch.Tensor:
    """:func:`combine` on expert outputs by assignment: ``out[t] = sum_s w[t, s] * y[t * topk + s]``
    over the slots whose id lies in ``[0, num_experts)`` (the others, dropped by the routing, add
    nothing and their rows of y are not read).

    Parameters
    ----------
    y : torch.Tensor
        ``[T * topk, H]`` bf16 / fp16 (or any float dtype on the torch path): row ``t * topk + s``
        is slot ``s`` of token ``t`` (the routed grouped kernel's output,
        :func:`mixgemm.moe.grouped.grouped_gemm_routed` with ``y_by_assignment=True``).
    topk_ids : torch.Tensor
        ``[T, topk]`` int32 / int64 expert ids.
    topk_weights : torch.Tensor
        ``[T, topk]`` routing weights, any float dtype (applied in float32).
    num_experts : int
        E.

    Returns
    -------
    torch.Tensor
        ``[T, H]`` in y's dtype, with :func:`combine`'s float32 arithmetic in slot order.
    """
    if topk_weights.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [T, topk], got {list(topk_ids.shape)} and "
                         f"{list(topk_weights.shape)}")
    if y.dim() != 2 or y.shape[0] != topk_weights.numel():
        raise ValueError(f"y must be [T * topk = {topk_weights.numel()}, H], got {list(y.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != y.device:
            raise ValueError(f"{name} is on {t.device} but y is on {y.device}")
    if _combine_kernel_takes(y.device, y.dtype, y.shape[1], topk_weights.shape[0]):
        return _launch_combine(y, None, topk_weights, topk_ids, num_experts)
    t, topk = topk_weights.shape
    keep = ((topk_ids >= 0) & (topk_ids < num_experts)).reshape(-1, 1)
    yk = torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device))
    acc = yk.view(t, topk, y.shape[1]).float() * topk_weights.float().unsqueeze(-1)
    return acc.sum(1).to(y.dtype)


_WEIGHT_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _combine_kernel_takes(device: torch.device, dtype: torch.dtype, h: int, t: int) -> bool:
    """Whether the combine kernel sums ``t`` tokens' rows of ``h`` values of ``dtype`` on ``device``."""
    return (checks.on_sm90(device) and dtype in (torch.bfloat16, torch.float16) and (h * 2) % 16 == 0
            and t <= COMBINE_MAX_TOKENS)


def assignment_combine_kernel(y_dtype: torch.dtype, h: int, t: int, weights_dtype: torch.dtype,
                              device: torch.device) -> Optional[tuple]:
    """What :func:`combine_by_assignment` launches for ``t`` tokens' rows of ``h`` values of
    ``y_dtype`` and top-k weights of ``weights_dtype`` on ``device``: ``(kernel, the weights'
    dtype it reads, threads per CTA)`` (its grid: ``(ceil(h * itemsize / 16 / threads), t)``;
    the kernel loaded here if it is not already), or None where the call takes torch ops."""
    if not _combine_kernel_takes(device, y_dtype, h, t):
        return None
    spec = combine_spec(torch.empty(0, dtype=y_dtype), torch.empty(0, dtype=weights_dtype))
    return runtime.KERNELS.get(spec, device), _WEIGHT_DTYPES[spec.weight.value], _COMBINE_THREADS


def combine(y_sorted: torch.Tensor, routing: Routing, topk_weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum over the top-k of each token: ``out[t] = sum_s w[t, s] * y[row of (t, s)]``.

    Parameters
    ----------
    y_sorted : torch.Tensor
        ``[T * topk, H]`` expert outputs in sorted order (rows of ``routing``); with ``inv``, any
        number of rows at least ``T * topk`` that ``inv`` points into (e.g. the padded layout of
        :mod:`mixgemm.moe.tiles`).
    routing : Routing
        From :func:`route_and_gather` (``inv`` set: the combine kernel on an sm_90 GPU) or
        :func:`route` (torch ops).
    topk_weights : torch.Tensor
        ``[T, topk]`` routing weights, any float dtype (applied in float32).

    Returns
    -------
    torch.Tensor
        ``[T, H]`` in ``y_sorted``'s dtype: each product ``float(y) * float(w)`` rounded to
        float32, summed in float32 (the kernel: in slot order from 0, deterministic; torch's sum
        may pair the slots differently, so the two may differ by one float32 rounding), rounded
        once. Slots whose ``inv`` is -1 (dropped ids) add nothing.
    """
    rows_ok = (y_sorted.shape[0] >= topk_weights.numel() if routing.inv is not None
               else y_sorted.shape[0] == topk_weights.numel()) if y_sorted.dim() == 2 else False
    if topk_weights.dim() != 2 or y_sorted.dim() != 2 or not rows_ok:
        raise ValueError(f"y_sorted must be [T * topk, H] (or more rows, through routing.inv) for topk_weights "
                         f"[T, topk] = {list(topk_weights.shape)}, got {list(y_sorted.shape)}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a float tensor, got {topk_weights.dtype}")
    for name, t in (("topk_weights", topk_weights), ("routing.order", routing.order), ("routing.inv", routing.inv)):
        if t is not None and t.device != y_sorted.device:
            raise ValueError(f"{name} is on {t.device} but y_sorted is on {y_sorted.device}")
    if routing.inv is not None and _combine_kernel_takes(y_sorted.device, y_sorted.dtype, y_sorted.shape[1],
                                                         topk_weights.shape[0]):
        return _launch_combine(y_sorted, routing.inv, topk_weights)
    return _combine_torch(y_sorted, routing, topk_weights)


# ---------------------------------------------------------------------------------------------
# The custom ops
# ---------------------------------------------------------------------------------------------
@custom_op("mixgemm::route_and_gather", mutates_args=())
def _route_and_gather_op(x: torch.Tensor, topk_ids: torch.Tensor,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r, xs = route_and_gather(x, topk_ids, num_experts)
    return r.order, r.tokens, r.expert_offsets, r.inv, xs


@_route_and_gather_op.register_fake
def _route_and_gather_fake(x, topk_ids, num_experts):
    n = topk_ids.shape[0] * topk_ids.shape[1]
    return (topk_ids.new_empty(n, dtype=torch.int64), topk_ids.new_empty(n, dtype=torch.int64),
            topk_ids.new_empty(num_experts + 1, dtype=torch.int32), topk_ids.new_empty(n, dtype=torch.int32),
            x.new_empty((n, x.shape[1])))


def route_and_gather_op(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple[Routing, torch.Tensor]:
    """:func:`route_and_gather` through the registered custom op (traceable by torch.compile)."""
    order, tokens, offsets, inv, xs = torch.ops.mixgemm.route_and_gather(x, topk_ids, num_experts)
    return Routing(order, tokens, offsets, inv), xs


@custom_op("mixgemm::combine", mutates_args=())
def _combine_op(y_sorted: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor, expert_offsets: torch.Tensor,
                inv: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    return combine(y_sorted, Routing(order, tokens, expert_offsets, inv), topk_weights)


@_combine_op.register_fake
def _combine_fake(y_sorted, order, tokens, expert_offsets, inv, topk_weights):
    return y_sorted.new_empty((topk_weights.shape[0], y_sorted.shape[1]))


def combine_op(y_sorted: torch.Tensor, routing: Routing, topk_weights: torch.Tensor) -> torch.Tensor:
    """:func:`combine` through the registered custom op (a routing with ``inv``)."""
    return torch.ops.mixgemm.combine(y_sorted, routing.order, routing.tokens, routing.expert_offsets, routing.inv,
                                     topk_weights)
