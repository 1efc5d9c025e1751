// mixgemm: the layout of a MoE layer's sorted rows for the grouped GEMMs, in one launch.
//
//   MIXGEMM_MOE_LAYOUT_ENTRY(NAME): extern "C" NAME(offsets, inv, cold_offsets, table, positions,
//       inv_out, experts, rows, n, tile, hot_from, hot_base, cap_tiles): one CTA of
//       kLayoutThreads threads.
//
// Input: the routing's offsets (int32 [E + 1]: expert e owns sorted rows [offsets[e],
// offsets[e + 1])) and inv (int32 [n]: assignment -> sorted row, -1 dropped; may be null).
// Experts with at least hot_from rows are "hot": their rows go to token tiles of `tile` rows
// starting at row hot_base of the laid-out buffer, each expert's rows from a tile boundary; the
// others are "cold": their rows stay contiguous in expert order from row 0, with offsets
// cold_offsets. Output (python/mixgemm/moe_tiles.py documents the layout, and computes the same
// with torch ops where this kernel does not run):
//   cold_offsets int32 [E + 1]        (may be null: hot_from = 1, every expert with rows is hot)
//   table        int32 [1 + cap_tiles] [U, expert of token tile 0, ...]; entries past U: E - 1
//   positions    int64 [rows]         sorted row -> row of the buffer; rows past offsets[E]
//                                     (dropped assignments): the spare row hot_base + tile * cap_tiles
//   inv_out      int32 [n]            inv through positions (-1 stays -1); null when inv is
// Every expert's counts are scanned in shared memory by the whole CTA: E <= kLayoutMaxExperts.
#pragma once

#include <cstdint>

#include "cutlass/cutlass.h"

namespace mixgemm::moe {

constexpr int kLayoutThreads = 1024;
constexpr int kLayoutMaxExperts = 2048;   // static shared memory: 3 x 2048 ints

#if defined(__CUDACC__)

// Exclusive scan of one value per thread over the CTA; returns the thread's exclusive prefix and
// writes the total to *total. `warp_sums` holds kLayoutThreads / 32 ints of shared memory.
template <class T>
CUTLASS_DEVICE T block_exclusive_scan(T v, T* warp_sums, T* total) {
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T incl = v;
  CUTLASS_PRAGMA_UNROLL
  for (int d = 1; d < 32; d *= 2) {
    T up = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    T w = lane < kLayoutThreads / 32 ? warp_sums[lane] : T(0);
    T wincl = w;
    CUTLASS_PRAGMA_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      T up = __shfl_up_sync(0xffffffffu, wincl, d);
      if (lane >= d) wincl += up;
    }
    if (lane < kLayoutThreads / 32) warp_sums[lane] = wincl - w;   // exclusive prefix of the warps
    if (lane == 31) *total = wincl;
  }
  __syncthreads();
  return warp_sums[warp] + incl - v;
}

CUTLASS_DEVICE void layout(int32_t const* offsets, int32_t const* inv, int32_t* cold_offsets, int32_t* table,
                           int64_t* positions, int32_t* inv_out, int experts, int rows, int n, int tile,
                           int hot_from, int hot_base, int cap_tiles) {
  __shared__ int32_t s_off[kLayoutMaxExperts + 1];
  __shared__ int32_t s_tstart[kLayoutMaxExperts];   // first token tile of a hot expert
  __shared__ int32_t s_cstart[kLayoutMaxExperts];   // first cold row of a cold expert (-1: hot)
  __shared__ int32_t s_warp[kLayoutThreads / 32];
  __shared__ int32_t s_total[2];
  int const tid = threadIdx.x;
  for (int e = tid; e <= experts; e += kLayoutThreads) s_off[e] = offsets[e];
  __syncthreads();

  // Each thread owns a run of consecutive experts: its sums of token tiles and cold rows.
  int const per = (experts + kLayoutThreads - 1) / kLayoutThreads;
  int const e0 = tid * per, e1 = min(experts, e0 + per);
  int tiles_sum = 0, cold_sum = 0;
  for (int e = e0; e < e1; ++e) {
    int const c = s_off[e + 1] - s_off[e];
    if (c >= hot_from) tiles_sum += (c + tile - 1) / tile; else cold_sum += c;
  }
  int tpre = block_exclusive_scan(tiles_sum, s_warp, &s_total[0]);
  int cpre = block_exclusive_scan(cold_sum, s_warp, &s_total[1]);
  for (int e = e0; e < e1; ++e) {
    int const c = s_off[e + 1] - s_off[e];
    bool const hot = c >= hot_from;
    s_tstart[e] = tpre;
    s_cstart[e] = hot ? -1 : cpre;
    if (hot) {
      for (int j = tpre; j < tpre + (c + tile - 1) / tile; ++j) table[1 + j] = e;
      tpre += (c + tile - 1) / tile;
    } else {
      cpre += c;
    }
    if (cold_offsets) cold_offsets[e + 1] = cpre;
  }
  int const used = s_total[0];
  if (tid == 0) {
    table[0] = used;
    if (cold_offsets) cold_offsets[0] = 0;
  }
  for (int j = used + tid; j < cap_tiles; j += kLayoutThreads) table[1 + j] = experts - 1;
  __syncthreads();

  // Each sorted row's expert by binary search over the offsets, then its row of the buffer.
  int64_t const spare = int64_t(hot_base) + int64_t(tile) * cap_tiles;
  for (int r = tid; r < rows; r += kLayoutThreads) {
    int lo = 0, hi = experts;                 // first e with offsets[e + 1] > r
    while (lo < hi) {
      int mid = (lo + hi) / 2;
      if (s_off[mid + 1] > r) hi = mid; else lo = mid + 1;
    }
    int64_t pos = spare;
    if (lo < experts) {
      int const within = r - s_off[lo];
      pos = s_cstart[lo] >= 0 ? int64_t(s_cstart[lo] + within)
                              : int64_t(hot_base) + int64_t(tile) * s_tstart[lo] + within;
    }
    positions[r] = pos;
  }
  if (inv != nullptr) {
    __syncthreads();                           // this CTA's writes of positions are visible to it
    for (int s = tid; s < n; s += kLayoutThreads) {
      int32_t const j = inv[s];
      inv_out[s] = j < 0 ? -1 : int32_t(positions[j]);
    }
  }
}

#endif  // __CUDACC__

}  // namespace mixgemm::moe

#define MIXGEMM_MOE_LAYOUT_ENTRY(NAME)                                                                \
  extern "C" __global__ void __launch_bounds__(mixgemm::moe::kLayoutThreads, 1)                      \
  NAME(int32_t const* offsets, int32_t const* inv, int32_t* cold_offsets, int32_t* table, int64_t* positions, \
       int32_t* inv_out, int experts, int rows, int n, int tile, int hot_from, int hot_base, int cap_tiles) { \
    mixgemm::moe::layout(offsets, inv, cold_offsets, table, positions, inv_out, experts, rows, n, tile, \
                         hot_from, hot_base, cap_tiles);                                              \
  }
