"""Mixture of experts: stacked expert weights, the grouped GEMMs over them, and the fused MoE layer.

The public face of four modules, each holding one concern:

* :class:`PackedExperts` (:mod:`mixgemm.weights.experts`): E prepacked weights of one shape and type.
* :func:`grouped_gemm` (:mod:`mixgemm.moe.grouped`): ``y[rows of e] = act(x[rows of e] @
  dequant(W_e).T)`` for every expert, x's rows sorted by expert, the row ranges given by
  ``expert_offsets`` on the GPU; the grouped decode kernel for a few rows per expert, the grouped
  sm90 GEMM for many (:func:`select_grouped_spec`). Nothing is read back to the host, so the call
  can be captured in a CUDA graph with routing that changes between replays.
* :func:`route`, :func:`route_and_gather`, :func:`combine` (:mod:`mixgemm.moe.routing`): the
  routing of top-k ids (sort by expert) and the gather of x's rows, and the weighted sum of the
  top-k outputs; on an sm_90 GPU one launch each of mixgemm's own kernels, no host sync.
* :func:`fused_moe` (:mod:`mixgemm.moe.layer`): vLLM's ``fused_experts`` calling convention:
  routing and gather, gate/up with the swiglu epilogue, down, and the weighted sum of the top-k;
  three launches at decode sizes (:func:`grouped_gemm_routed`: the grouped decode kernel ranks the
  top-k ids itself, so there is no routing launch), the plan (:func:`plan_fused_moe`) by rows per
  expert.
"""
from __future__ import annotations

from ..weights.experts import PackedExperts
from .grouped import (DEC8_ROWS_PER_EXPERT, LONG_K, TILE128_FROM_ROWS, TILE256_FROM_ROWS, TILES_FROM_ROWS, TILES_FROM_ROWS_LONG_K,
                          TILES_RASTER, decode_spec_for, grouped_gemm, grouped_gemm_op, grouped_gemm_routed,
                          grouped_gemm_with_spec, grouped_spec_for, launch_tiles, select_grouped_spec)
from .layer import MoePlan, fused_moe, fused_moe_op, fused_moe_reference, plan_fused_moe
from .routing import (ROUTE_MAX_ASSIGNMENTS, Routing, combine, combine_by_assignment, route,
                          route_and_gather)

__all__ = ["PackedExperts", "grouped_gemm", "grouped_gemm_with_spec", "grouped_gemm_op", "grouped_gemm_routed",
           "launch_tiles", "fused_moe", "fused_moe_op", "fused_moe_reference", "plan_fused_moe", "MoePlan", "route",
           "route_and_gather", "combine", "combine_by_assignment", "Routing",
           "select_grouped_spec", "grouped_spec_for", "decode_spec_for", "ROUTE_MAX_ASSIGNMENTS", "TILES_FROM_ROWS",
           "TILES_FROM_ROWS_LONG_K", "LONG_K", "TILE128_FROM_ROWS", "TILE256_FROM_ROWS", "TILES_RASTER",
           "DEC8_ROWS_PER_EXPERT"]
