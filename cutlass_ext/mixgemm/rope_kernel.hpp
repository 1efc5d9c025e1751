// mixgemm: rotary position embedding of q and k and the KV-cache write, in one launch
// (MIXGEMM_ROPE_KV_ENTRY): what a decoder layer does between its qkv projection and attention.
//
// For each token row r of qkv [rows, (H + 2 Hkv) D] (bf16 or fp16; q heads, then k heads, then v
// heads, D values each; row r is token t = r % T of sequence b = r / T, at position p):
//   q_out[r, h, :]          = rope(qkv[r, h, :], p)               for the H query heads
//   k_cache[b, j, p, :]     = rope(qkv[r, H + j, :], p)           for the Hkv key heads
//   v_cache[b, j, p, :]     = qkv[r, H + Hkv + j, :]              for the Hkv value heads
// rope is the "rotate half" form of the LLaMA / Qwen code with the tables cos, sin [P, D] of Act:
//   y[i]       = x[i] cos[p, i] - x[i + D/2] sin[p, i]
//   y[i + D/2] = x[i + D/2] cos[p, i + D/2] + x[i] sin[p, i + D/2]            (i < D/2)
// rounded as the models' torch code rounds `x * cos + rotate_half(x) * sin` in Act: each product
// to Act, then their sum to Act (so the result equals it bit for bit). p is positions[r] when a
// position table is given, else pos0 + t; a row whose p is outside [0, min(P, cache length)) is
// skipped (nothing written).
//
// Grid (rows), block kRopeThreads: one CTA per token row; each item is one 16-byte vector of 8
// values (with its partner D/2 further for q and k). Programmatic dependent launch: it waits
// for the previous grid (the qkv projection) before its first global access and lets the next
// one launch at its start, as the norm kernel does.
#pragma once

#include <cstdint>

#include "cutlass/array.h"
#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/half.h"

#include "mixgemm/pdl.hpp"

namespace mixgemm::rope {

constexpr int kRopeThreads = 256;

// The kernel's arguments (MIXGEMM_ROPE_KV_ENTRY's, gathered).
struct Params {
  void const* qkv;           // [rows][(heads + 2 kv_heads) head_dim]
  void const* cos;           // [positions][head_dim]
  void const* sin;           // [positions][head_dim]
  int64_t const* positions;  // [rows] or null: pos0 + row % tokens
  void* q_out;               // [rows][heads head_dim]
  void* k_cache;             // [batch][kv_heads][length][head_dim], strides below (elements)
  void* v_cache;             // same layout and strides as k_cache
  int64_t cache_stride_b, cache_stride_h, cache_stride_l;
  int32_t tokens;            // T: rows per sequence
  int32_t heads, kv_heads, head_dim;
  int32_t table_positions;   // P
  int32_t cache_length;      // positions the cache holds
  int32_t pos0;
};

#if defined(__CUDACC__)

using pdl::launch_next_grid;     // (mixgemm/pdl.hpp)
using pdl::wait_previous_grid;

template <class Act>
using Vec = cutlass::Array<Act, 8>;

// a * b rounded to Act (torch's elementwise product of two Act tensors: float math, one rounding)
template <class Act>
CUTLASS_DEVICE float mul(Act a, Act b) {
  return float(Act(__fmul_rn(float(a), float(b))));
}

template <class Act>
CUTLASS_DEVICE void rotate(uint4& lo, uint4& hi, uint4 cos_lo, uint4 cos_hi, uint4 sin_lo, uint4 sin_hi) {
  Vec<Act>& x1 = reinterpret_cast<Vec<Act>&>(lo);
  Vec<Act>& x2 = reinterpret_cast<Vec<Act>&>(hi);
  Vec<Act> const& c1 = reinterpret_cast<Vec<Act> const&>(cos_lo);
  Vec<Act> const& c2 = reinterpret_cast<Vec<Act> const&>(cos_hi);
  Vec<Act> const& s1 = reinterpret_cast<Vec<Act> const&>(sin_lo);
  Vec<Act> const& s2 = reinterpret_cast<Vec<Act> const&>(sin_hi);
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 8; ++j) {
    Act const a = x1[j], b = x2[j];
    // x * cos + (-x2, x1) * sin: -(b * s) rounds as (-b) * s does
    x1[j] = Act(__fadd_rn(mul<Act>(a, c1[j]), -mul<Act>(b, s1[j])));
    x2[j] = Act(__fadd_rn(mul<Act>(b, c2[j]), mul<Act>(a, s2[j])));
  }
}

template <class Act>
CUTLASS_DEVICE void rope_kv(Params const& p) {
  launch_next_grid();
  wait_previous_grid();
  int64_t const row = blockIdx.x;
  int const t = int(row % p.tokens);
  int64_t const b = row / p.tokens;
  int64_t const pos = p.positions ? p.positions[row] : int64_t(p.pos0) + t;
  if (pos < 0 || pos >= p.table_positions || pos >= p.cache_length) return;
  int const d = p.head_dim;
  int const vpd = d / 8;            // 16-byte vectors per head
  int const half = vpd / 2;         // vector pairs per head
  int const width = (p.heads + 2 * p.kv_heads) * vpd;
  uint4 const* src = reinterpret_cast<uint4 const*>(p.qkv) + row * width;
  uint4 const* cos = reinterpret_cast<uint4 const*>(p.cos) + pos * vpd;
  uint4 const* sin = reinterpret_cast<uint4 const*>(p.sin) + pos * vpd;
  uint4* q_out = reinterpret_cast<uint4*>(p.q_out) + row * int64_t(p.heads) * vpd;
  int64_t const cache_row = (b * p.cache_stride_b + pos * p.cache_stride_l) / 8;   // in vectors
  int64_t const cache_head = p.cache_stride_h / 8;
  uint4* k_cache = reinterpret_cast<uint4*>(p.k_cache) + cache_row;
  uint4* v_cache = reinterpret_cast<uint4*>(p.v_cache) + cache_row;
  int const rotated = (p.heads + p.kv_heads) * half;     // q and k: one item per vector pair
  int const items = rotated + p.kv_heads * vpd;          // then v: one item per vector
  for (int i = threadIdx.x; i < items; i += kRopeThreads) {
    if (i < rotated) {
      int const h = i / half, j = i % half;
      uint4 lo = src[h * vpd + j], hi = src[h * vpd + j + half];
      rotate<Act>(lo, hi, cos[j], cos[j + half], sin[j], sin[j + half]);
      uint4* dst = h < p.heads ? q_out + h * vpd : k_cache + (h - p.heads) * cache_head;
      dst[j] = lo;
      dst[j + half] = hi;
    } else {
      int const v = i - rotated;
      int const h = v / vpd, j = v % vpd;
      v_cache[h * cache_head + j] = src[(p.heads + p.kv_heads + h) * vpd + j];
    }
  }
}

#endif  // __CUDACC__

}  // namespace mixgemm::rope

// extern "C" NAME(the fields of Params, in order): grid (rows), block kRopeThreads. ACT: the element type. The caller
// guarantees head_dim % 16 == 0, 16-byte aligned rows, tables and cache rows, and strides that
// are multiples of 8 elements.
#define MIXGEMM_ROPE_KV_ENTRY(NAME, ACT)                                                             \
  extern "C" __global__ void __launch_bounds__(mixgemm::rope::kRopeThreads)                          \
  NAME(void const* qkv, void const* cos, void const* sin, int64_t const* positions, void* q_out,      \
       void* k_cache, void* v_cache, int64_t stride_b, int64_t stride_h, int64_t stride_l,           \
       int32_t tokens, int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t table_positions,   \
       int32_t cache_length, int32_t pos0) {                                                         \
    mixgemm::rope::rope_kv<ACT>(mixgemm::rope::Params{qkv, cos, sin, positions, q_out, k_cache,       \
                                                      v_cache, stride_b, stride_h, stride_l, tokens,  \
                                                      heads, kv_heads, head_dim, table_positions,     \
                                                      cache_length, pos0});                           \
  }
