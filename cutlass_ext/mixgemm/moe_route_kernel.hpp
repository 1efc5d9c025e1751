// mixgemm: the two small kernels around the grouped GEMMs of a mixture-of-experts layer.
//
// * route (MIXGEMM_MOE_ROUTE_ENTRY): the top-k assignments sorted by expert, and the rows of x
//   gathered in that order, in one launch, with no host sync. Input: topk_ids [n = T * topk]
//   (int32 or int64: the template parameter), x [T, H] (any 2-byte type, moved as 16-byte
//   vectors). Output:
//     offsets int32 [E + 1]  expert e owns sorted rows [offsets[e], offsets[e + 1]);
//     order   int64 [n]      sorted row j -> flat index token * topk + slot;
//     tokens  int64 [n]      sorted row j -> token (order[j] / topk);
//     inv     int32 [n]      flat index -> sorted row (what combine reads);
//     xs      [n, H]         xs[j] = x[tokens[j]].
//   The order is stable, exactly what a stable sort by expert gives (python/mixgemm/moe_routing.py
//   route()): within an expert, rows in flat-index order. No atomics decide a position: the
//   assignments are ranked in chunks of kRouteThreads; in a chunk, a lane's rank among the lanes
//   of its warp with the same expert comes from __match_any_sync, and the rank of its warp among
//   the chunk's warps (plus the expert's count in the earlier chunks) from a table of per-warp
//   per-expert counts in shared memory, scanned per expert by one thread.
//   An id outside [0, E) is dropped: counted nowhere, given no sorted row (inv = -1); the sorted
//   rows past offsets[E] (one per dropped assignment) hold order = tokens = -1 and zeros in xs.
//   Nothing is written out of bounds for any id.
//   Bounds: n <= kRouteMaxAssignments, 1 <= E <= kRouteMaxExperts (the Python side checks them
//   and keeps the torch path beyond). Grid: G CTAs of kRouteThreads threads. Every CTA ranks all
//   n assignments (the same deterministic computation: no inter-CTA communication); CTA 0 writes
//   offsets, order, tokens and inv; CTA b gathers its share of the n rows of xs. One CTA is
//   enough at decode sizes (a few dozen rows); more spread a larger gather over SMs.
//
// * combine (MIXGEMM_MOE_COMBINE_ENTRY): out[t, :] = sum_s w[t, s] * y[inv[t * topk + s], :]:
//   each product rounded to float32, then added in slot order starting from 0 (the float32
//   operations of torch's y.float() * w.float() followed by a sequential sum), one rounding to the
//   output type. Slots with inv < 0 (dropped assignments) add nothing. Without inv (null), y's rows
//   are by assignment (the routed grouped kernel's output: row t * topk + s) and a slot adds
//   nothing when its id (ids, int32 or int64) is outside [0, E). Grid (ceil(H / 8 / 128), T),
//   128 threads, one 16-byte vector of 8 outputs per thread.
//
// Both wait for the previous grid before their first global access (programmatic dependent
// launch) and let the next one launch as each CTA ends, as the decode kernels do; without the
// launch attribute both are no-ops.
#pragma once

#include <cstdint>

#include "cutlass/array.h"
#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/half.h"

#include "mixgemm/pdl.hpp"

namespace mixgemm::moe {

constexpr int kRouteThreads = 1024;
constexpr int kRouteWarps = kRouteThreads / 32;
// the most assignments (T * topk) one launch routes
constexpr int kRouteMaxAssignments = 4096;
// the most experts
constexpr int kRouteMaxExperts = 512;
constexpr int kRouteChunks = kRouteMaxAssignments / kRouteThreads;
constexpr int kCombineThreads = 128;

static_assert(kRouteMaxAssignments < 0xFFFF, "sorted rows and tokens are kept as uint16 in shared memory");

#if defined(__CUDACC__)

using pdl::launch_next_grid;     // (mixgemm/pdl.hpp)
using pdl::wait_previous_grid;

struct RouteSmem {
  // chunk by chunk: table[w * E + e] = the count of warp w's lanes with expert e, then (scanned
  // per expert) the expert's rows before warp w's: in earlier chunks and earlier warps
  uint16_t table[kRouteWarps * kRouteMaxExperts];
  int32_t cursor[kRouteMaxExperts];         // per expert: rows so far; then the exclusive offsets
  uint16_t token[kRouteMaxAssignments];     // sorted row -> token; 0xFFFF: no row (dropped ids)
  int32_t warp_sums[kRouteWarps];
  int32_t rows;
};

template <class Index>
CUTLASS_DEVICE void route(Index const* __restrict__ ids, uint4 const* __restrict__ x, int32_t* __restrict__ offsets,
                          int64_t* __restrict__ order, int64_t* __restrict__ tokens, int32_t* __restrict__ inv,
                          uint4* __restrict__ xs, int n, int topk, int experts, int row_vecs) {
  __shared__ RouteSmem s;
  int const tid = threadIdx.x;
  int const warp = tid / 32;
  int const lane = tid % 32;
  unsigned const lanes_below = (1u << lane) - 1u;
  bool const writer = blockIdx.x == 0;

  for (int e = tid; e < experts; e += kRouteThreads) {
    s.cursor[e] = 0;
  }
  wait_previous_grid();

  // 1. Rank every assignment within its expert (stable), chunk by chunk.
  int expert_of[kRouteChunks];
  int rank_of[kRouteChunks];
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < kRouteChunks; ++c) {
    expert_of[c] = -1;
    rank_of[c] = 0;
    if (c * kRouteThreads < n) {   // uniform across the CTA: the barriers below are safe
      int const i = c * kRouteThreads + tid;
      int e = -1;
      if (i < n) {
        Index const v = ids[i];
        if (v >= 0 && v < Index(experts)) e = int(v);
      }
      for (int k = tid; k < kRouteWarps * experts; k += kRouteThreads) {
        s.table[k] = 0;
      }
      __syncthreads();
      unsigned const peers = __match_any_sync(0xffffffffu, e);
      int const rank = __popc(peers & lanes_below);
      if (e >= 0 && rank == 0) {
        s.table[warp * experts + e] = uint16_t(__popc(peers));
      }
      __syncthreads();
      for (int e2 = tid; e2 < experts; e2 += kRouteThreads) {
        int run = s.cursor[e2];
        CUTLASS_PRAGMA_UNROLL
        for (int w = 0; w < kRouteWarps; ++w) {
          int const v = s.table[w * experts + e2];
          s.table[w * experts + e2] = uint16_t(run);
          run += v;
        }
        s.cursor[e2] = run;
      }
      __syncthreads();
      if (e >= 0) {
        expert_of[c] = e;
        rank_of[c] = s.table[warp * experts + e] + rank;
      }
      __syncthreads();   // the next chunk clears the table
    }
  }

  // 2. Counts -> exclusive offsets (experts <= kRouteMaxExperts <= kRouteThreads: one per thread).
  int const count = tid < experts ? s.cursor[tid] : 0;
  int incl = count;
  CUTLASS_PRAGMA_UNROLL
  for (int d = 1; d < 32; d *= 2) {
    int const up = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) s.warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int const v = s.warp_sums[lane];
    int vi = v;
    CUTLASS_PRAGMA_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      int const up = __shfl_up_sync(0xffffffffu, vi, d);
      if (lane >= d) vi += up;
    }
    s.warp_sums[lane] = vi - v;   // exclusive: the rows of the warps before
  }
  __syncthreads();
  int const excl = s.warp_sums[warp] + incl - count;
  if (tid < experts) {
    s.cursor[tid] = excl;
    if (writer) offsets[tid] = excl;
    if (tid == experts - 1) {
      if (writer) offsets[experts] = excl + count;
      s.rows = excl + count;
    }
  }
  __syncthreads();
  int const rows = s.rows;   // assignments with an id in range

  // 3. Sorted rows: order, tokens, inv (CTA 0), and row -> token for the gather (every CTA).
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < kRouteChunks; ++c) {
    int const i = c * kRouteThreads + tid;
    if (i < n) {
      int const e = expert_of[c];
      int const token = i / topk;
      if (e >= 0) {
        int const row = s.cursor[e] + rank_of[c];
        s.token[row] = uint16_t(token);
        if (writer) {
          order[row] = i;
          tokens[row] = token;
          inv[i] = row;
        }
      } else if (writer) {
        inv[i] = -1;
      }
    }
  }
  for (int j = rows + tid; j < n; j += kRouteThreads) {
    s.token[j] = 0xFFFF;
    if (writer) {
      order[j] = -1;
      tokens[j] = -1;
    }
  }
  __syncthreads();

  // 4. The gather: this CTA's share of the rows, 16-byte vectors, four loads in flight per thread.
  int const share = (n + gridDim.x - 1) / gridDim.x;
  int const r0 = min(n, int(blockIdx.x) * share);
  int const r1 = min(n, r0 + share);
  int64_t const total = int64_t(r1 - r0) * row_vecs;
  uint4* dst = xs + int64_t(r0) * row_vecs;
  constexpr int kBatch = 4;
  for (int64_t base = tid; base < total; base += int64_t(kBatch) * kRouteThreads) {
    uint4 v[kBatch];
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      int64_t const idx = base + int64_t(b) * kRouteThreads;
      v[b] = make_uint4(0, 0, 0, 0);
      if (idx < total) {
        int const r = int(idx / row_vecs);
        int const col = int(idx - int64_t(r) * row_vecs);
        int const token = s.token[r0 + r];
        if (token != 0xFFFF) v[b] = x[int64_t(token) * row_vecs + col];
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      int64_t const idx = base + int64_t(b) * kRouteThreads;
      if (idx < total) dst[idx] = v[b];
    }
  }
  launch_next_grid();
}

template <class Act, class Weight>
CUTLASS_DEVICE void combine(uint4 const* __restrict__ y, Weight const* __restrict__ weights,
                            int32_t const* __restrict__ inv, void const* __restrict__ ids, int ids_bytes, int experts,
                            uint4* __restrict__ out, int topk, int row_vecs) {
  using Vec = cutlass::Array<Act, 8>;
  static_assert(sizeof(Vec) == sizeof(uint4), "8 outputs per 16-byte vector");
  int const t = blockIdx.y;
  int const col = blockIdx.x * kCombineThreads + threadIdx.x;
  wait_previous_grid();
  if (col < row_vecs) {
    float acc[8];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
    constexpr int kBatch = 8;   // slots whose vectors are loaded before any is added
    for (int s0 = 0; s0 < topk; s0 += kBatch) {
      uint4 v[kBatch];
      float w[kBatch];
      bool use[kBatch];
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kBatch; ++b) {
        int const slot = s0 + b;
        use[b] = false;
        w[b] = 0.0f;
        v[b] = make_uint4(0, 0, 0, 0);
        if (slot < topk) {
          int64_t const flat = int64_t(t) * topk + slot;
          int row;
          if (inv) {
            row = inv[flat];
          } else {   // rows by assignment: the slot's own row, if its id is in range
            int64_t const id = ids_bytes == 8 ? static_cast<int64_t const*>(ids)[flat]
                                              : int64_t(static_cast<int32_t const*>(ids)[flat]);
            row = id >= 0 && id < experts ? int(flat) : -1;
          }
          if (row >= 0) {
            use[b] = true;
            w[b] = float(weights[flat]);
            v[b] = y[int64_t(row) * row_vecs + col];
          }
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kBatch; ++b) {
        if (use[b]) {
          Vec const& a = reinterpret_cast<Vec const&>(v[b]);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 8; ++j) {
            acc[j] = __fadd_rn(acc[j], __fmul_rn(float(a[j]), w[b]));   // no FMA: torch's two roundings
          }
        }
      }
    }
    Vec o;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 8; ++j) o[j] = Act(acc[j]);
    out[int64_t(t) * row_vecs + col] = reinterpret_cast<uint4 const&>(o);
  }
  launch_next_grid();
}

#endif  // __CUDACC__

}  // namespace mixgemm::moe

// extern "C" NAME(ids, x, offsets, order, tokens, inv, xs, n, topk, experts, row_vecs):
// grid (G), block kRouteThreads. INDEX: int32_t or int64_t.
#define MIXGEMM_MOE_ROUTE_ENTRY(NAME, INDEX)                                                          \
  extern "C" __global__ void __launch_bounds__(mixgemm::moe::kRouteThreads, 1)                       \
  NAME(INDEX const* ids, uint4 const* x, int32_t* offsets, int64_t* order, int64_t* tokens, int32_t* inv, \
       uint4* xs, int n, int topk, int experts, int row_vecs) {                                       \
    mixgemm::moe::route<INDEX>(ids, x, offsets, order, tokens, inv, xs, n, topk, experts, row_vecs);  \
  }

// extern "C" NAME(y, weights, inv, ids, ids_bytes, experts, out, topk, row_vecs): grid
// (ceil(row_vecs / 128), T), block kCombineThreads. ACT: the type of y and out; WEIGHT: of the
// top-k weights. inv null: y by assignment, ids (ids_bytes 4 or 8) say which slots count.
#define MIXGEMM_MOE_COMBINE_ENTRY(NAME, ACT, WEIGHT)                                                  \
  extern "C" __global__ void __launch_bounds__(mixgemm::moe::kCombineThreads)                        \
  NAME(uint4 const* y, WEIGHT const* weights, int32_t const* inv, void const* ids, int ids_bytes, int experts, \
       uint4* out, int topk, int row_vecs) {                                                          \
    mixgemm::moe::combine<ACT, WEIGHT>(y, weights, inv, ids, ids_bytes, experts, out, topk, row_vecs); \
  }
