// mixgemm: the FP8 activation quantizer (MIXGEMM_QUANT_FP8_ENTRY), the input of the e4m3 GEMMs
// (collective/sm90_mma_prepacked_fp8.hpp).
//
// For each row m of x [M, K] (bf16 or fp16, row stride ldx elements, K % 32 == 0, rows 16-byte
// aligned), all in float32:
//   amax    = max_k |x[m, k]|                             (exact: a max of exact values)
//   s[m]    = amax / 448 (IEEE division), or 1 where amax == 0
//   q[m, k] = e4m3(clamp(x[m, k] / s[m], -448, 448))      (IEEE division, then round to nearest
//                                                          even into e4m3, OCP E4M3 / float8_e4m3fn)
// or, given a static scale (a float32 scalar in device memory, e.g. a checkpoint's per-tensor
// input_scale), s[m] = that scale for every row, no max taken, and q as above: the clamp then
// saturates the values beyond 448 s.
// and q is written in the wgmma's K order: inside every block of 32 columns,
//   xq[m, 32 b + F] = q[m, 32 b + L],   F = 16 p + 4 t + j,  L = 8 j + 2 t + p
// (converters/mixgemm/e4m3.hpp, mma_to_weight_col), the order in which the e4m3 weight
// fragments hold their columns, so that the GEMM's activation tile is a plain K-major operand.
// mixgemm.ops.fp8.quantize_fp8_reference is this definition in torch, bit for bit: every step is
// an exactly rounded float32 operation (no fused multiply-add, no reciprocal), and the clamp only
// guards the rounding of s (|x| / s <= 448 up to an ulp).
//
// Grid (M), block kQuantThreads: one CTA per row. Thread i takes the 32-column blocks i,
// i + kQuantThreads, ...: 4 16-byte loads per block, 2 16-byte stores. Its first kQuantCached
// blocks stay in registers between the max and the quantization (K <= 32 * kQuantThreads *
// kQuantCached = 16384 reads x once); a longer row reads its other blocks twice (the second time
// from L2). The max is reduced with warp shuffles and one shared-memory round.
//
// Programmatic dependent launch: it waits for the previous grid before its first global access,
// and lets the next one (the e4m3 GEMM, whose producer waits for this grid before its first load)
// launch as each CTA starts, so that the GEMM's set-up overlaps this kernel.
#pragma once

#include <cstdint>

#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/half.h"

#include "mixgemm/pdl.hpp"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace mixgemm::quant {

constexpr int kQuantThreads = 128;
constexpr int kQuantCached = 4;
constexpr float kE4M3Max = 448.0f;

#if defined(__CUDACC__)

// One block of 32 columns: 64 bytes of bf16/fp16.
struct Block {
  uint4 v[4];
};

template <class Act>
CUTLASS_DEVICE float value(Block const& b, int l) {
  Act const* a = reinterpret_cast<Act const*>(&b.v[0]);
  return float(a[l]);
}

template <class Act>
CUTLASS_DEVICE float block_amax(Block const& b) {
  float m = 0.0f;
  CUTLASS_PRAGMA_UNROLL
  for (int l = 0; l < 32; ++l) m = fmaxf(m, fabsf(value<Act>(b, l)));
  return m;
}

// Two e4m3 bytes (lo, hi) of x / s, clamped, rounded to nearest even.
CUTLASS_DEVICE uint32_t e4m3x2(float lo, float hi, float s) {
  float2 f;
  f.x = fminf(fmaxf(__fdiv_rn(lo, s), -kE4M3Max), kE4M3Max);
  f.y = fminf(fmaxf(__fdiv_rn(hi, s), -kE4M3Max), kE4M3Max);
  return uint32_t(__nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3));
}

// The 32 bytes of a block in the MMA's K order: word w (bytes F = 4 w .. 4 w + 3) is p = w / 4,
// t = w % 4, bytes j = 0..3 the columns L = 8 j + 2 t + p.
template <class Act>
CUTLASS_DEVICE void quantize_block(Block const& b, float s, uint4 (&out)[2]) {
  uint32_t w[8];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 8; ++i) {
    int const p = i / 4, t = i % 4;
    int const l = 2 * t + p;
    uint32_t const lo = e4m3x2(value<Act>(b, l), value<Act>(b, l + 8), s);
    uint32_t const hi = e4m3x2(value<Act>(b, l + 16), value<Act>(b, l + 24), s);
    w[i] = lo | (hi << 16);
  }
  out[0] = make_uint4(w[0], w[1], w[2], w[3]);
  out[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

CUTLASS_DEVICE Block load_block(uint4 const* __restrict__ row, int b) {
  Block blk;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 4; ++i) blk.v[i] = row[4 * b + i];
  return blk;
}

// the CTA's max of v (v >= 0), the same value in every thread
CUTLASS_DEVICE float block_max(float v) {
  __shared__ float warp_max[kQuantThreads / 32];
  CUTLASS_PRAGMA_UNROLL
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = 0.0f;
  CUTLASS_PRAGMA_UNROLL
  for (int w = 0; w < kQuantThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
  return m;
}

template <class Act>
CUTLASS_DEVICE void quantize_row(uint4 const* __restrict__ x, uint4* __restrict__ xq, float* __restrict__ scales,
                                 float const* __restrict__ static_scale, int64_t ldx_vecs, int64_t ldq_vecs,
                                 int blocks) {
  int64_t const m = blockIdx.x;
  uint4 const* row = x + m * ldx_vecs;      // 8 values per uint4
  uint4* out = xq + m * ldq_vecs;           // 16 bytes per uint4
  int const tid = threadIdx.x;
  pdl::launch_next_grid();
  pdl::wait_previous_grid();
  Block cache[kQuantCached];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kQuantCached; ++i) {   // every load in flight before any is used
    int const b = tid + i * kQuantThreads;
    if (b < blocks) cache[i] = load_block(row, b);
  }
  float s;
  if (static_scale != nullptr) {   // a kernel argument: every thread takes the same branch
    s = *static_scale;
  } else {
    float amax = 0.0f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kQuantCached; ++i) {
      int const b = tid + i * kQuantThreads;
      if (b < blocks) amax = fmaxf(amax, block_amax<Act>(cache[i]));
    }
    for (int b = tid + kQuantCached * kQuantThreads; b < blocks; b += kQuantThreads) {
      amax = fmaxf(amax, block_amax<Act>(load_block(row, b)));
    }
    amax = block_max(amax);
    s = amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
  }
  if (tid == 0) scales[m] = s;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kQuantCached; ++i) {
    int const b = tid + i * kQuantThreads;
    if (b < blocks) {
      uint4 q[2];
      quantize_block<Act>(cache[i], s, q);
      out[2 * b] = q[0];
      out[2 * b + 1] = q[1];
    }
  }
  for (int b = tid + kQuantCached * kQuantThreads; b < blocks; b += kQuantThreads) {
    uint4 q[2];
    quantize_block<Act>(load_block(row, b), s, q);
    out[2 * b] = q[0];
    out[2 * b + 1] = q[1];
  }
}

#endif  // __CUDACC__

}  // namespace mixgemm::quant

// extern "C" NAME(x, xq, scales, static_scale, ldx_vecs, ldq_vecs, blocks): grid (M), block
// kQuantThreads. x: ACT [M, K] with a row stride of ldx_vecs 16-byte vectors (8 values); xq: e4m3
// [M, K] with a row stride of ldq_vecs 16-byte vectors (16 values); scales: float32 [M], written;
// static_scale: null (per-token scales, amax / 448) or a float32 scalar used for every row (and
// written to scales[m], which the GEMM reads either way); blocks = K / 32.
#define MIXGEMM_QUANT_FP8_ENTRY(NAME, ACT)                                                          \
  extern "C" __global__ void __launch_bounds__(mixgemm::quant::kQuantThreads)                       \
  NAME(uint4 const* x, uint4* xq, float* scales, float const* static_scale, int64_t ldx_vecs,       \
       int64_t ldq_vecs, int blocks) {                                                              \
    mixgemm::quant::quantize_row<ACT>(x, xq, scales, static_scale, ldx_vecs, ldq_vecs, blocks);    \
  }
