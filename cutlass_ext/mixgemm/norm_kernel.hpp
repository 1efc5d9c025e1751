// mixgemm: RMSNorm, and the residual add fused into it (MIXGEMM_RMS_NORM_ENTRY).
//
// For each row r of x [rows, H] (bf16 or fp16, H a multiple of 8, rows 16-byte aligned):
//   plain:     y[r] = Act(float(x[r]) * rstd * float(w))
//   residual:  s[r] = Act(float(x[r]) + float(residual[r]))   (written to sum_out: the new residual
//              stream, the same rounding as torch's add in Act), then y[r] from s[r] as above;
//   rstd = rsqrt(sum(float(v)^2) / H + eps), v the row normalized (x, or s rounded to Act).
// Each product is rounded to float32 in the order (v * rstd) * w, as torch's fused rms_norm does
// on CUDA; only the order of the sum of squares differs (a fixed tree here), so y may differ from
// torch's by an ulp of Act where rstd's last float bit does.
//
// Grid (rows), block kNormThreads: one CTA per row, each thread a 16-byte vector of 8 values per
// kNormThreads columns. The first kNormCached vectors of a thread (and of the weight, loaded with
// them: one memory latency before the reduction, none after it) stay in registers between the sum
// and the scaling (H <= 8 * kNormThreads * kNormCached = 16384 reads x once); a longer row reads its
// remaining vectors twice (the second time from L2). The sum of squares is reduced with warp
// shuffles and one shared-memory round, in a fixed order (deterministic).
//
// Programmatic dependent launch: it waits for the previous grid before its first global access,
// and lets the next one launch as each CTA starts: the kernel after a norm is a projection whose
// decode kernel requests its weights and scale rows before its own grid wait (decode_kernel.hpp),
// so those loads overlap this kernel, and only the normalized x waits for it (the dependent's
// grid wait still returns only when every CTA of this grid has finished and its stores are
// visible). A dependent launches once every CTA of this grid has started, so it never holds an
// SM that a CTA of this grid is waiting for.
#pragma once

#include <cstdint>

#include "cutlass/array.h"
#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/half.h"

#include "mixgemm/pdl.hpp"

namespace mixgemm::norm {

constexpr int kNormThreads = 256;
constexpr int kNormCached = 8;

#if defined(__CUDACC__)

using pdl::launch_next_grid;     // (mixgemm/pdl.hpp)
using pdl::wait_previous_grid;

template <class Act>
using Vec = cutlass::Array<Act, 8>;

// a + b per element, each sum rounded to Act
template <class Act>
CUTLASS_DEVICE uint4 add(uint4 a, uint4 b) {
  Vec<Act> const& va = reinterpret_cast<Vec<Act> const&>(a);
  Vec<Act> const& vb = reinterpret_cast<Vec<Act> const&>(b);
  Vec<Act> s;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 8; ++j) s[j] = Act(__fadd_rn(float(va[j]), float(vb[j])));
  return reinterpret_cast<uint4 const&>(s);
}

template <class Act>
CUTLASS_DEVICE float sum_squares(uint4 a) {
  Vec<Act> const& v = reinterpret_cast<Vec<Act> const&>(a);
  float s = 0.0f;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 8; ++j) s = __fmaf_rn(float(v[j]), float(v[j]), s);
  return s;
}

template <class Act>
CUTLASS_DEVICE uint4 scale(uint4 a, uint4 w, float rstd) {
  Vec<Act> const& v = reinterpret_cast<Vec<Act> const&>(a);
  Vec<Act> const& g = reinterpret_cast<Vec<Act> const&>(w);
  Vec<Act> y;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 8; ++j) y[j] = Act(__fmul_rn(__fmul_rn(float(v[j]), rstd), float(g[j])));
  return reinterpret_cast<uint4 const&>(y);
}

// the CTA's sum of v, the same value in every thread; tree order fixed by the thread index
CUTLASS_DEVICE float block_sum(float v) {
  __shared__ float warp_sums[kNormThreads / 32];
  CUTLASS_PRAGMA_UNROLL
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.0f;
  CUTLASS_PRAGMA_UNROLL
  for (int w = 0; w < kNormThreads / 32; ++w) t += warp_sums[w];
  return t;
}

template <class Act, bool kResidual>
CUTLASS_DEVICE void rms_norm(uint4 const* __restrict__ x, uint4 const* __restrict__ residual,
                             uint4 const* __restrict__ weight, uint4* __restrict__ out,
                             uint4* __restrict__ sum_out, int row_vecs, float eps) {
  int64_t const base = int64_t(blockIdx.x) * row_vecs;
  int const tid = threadIdx.x;
  launch_next_grid();
  wait_previous_grid();
  uint4 cache[kNormCached];
  uint4 res[kNormCached];
  uint4 gamma[kNormCached];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kNormCached; ++i) {   // every load in flight before any is used, the weight's too
    int const col = tid + i * kNormThreads;
    if (col < row_vecs) {
      cache[i] = x[base + col];
      if constexpr (kResidual) res[i] = residual[base + col];
      gamma[i] = weight[col];
    }
  }
  float ss = 0.0f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kNormCached; ++i) {
    int const col = tid + i * kNormThreads;
    if (col < row_vecs) {
      if constexpr (kResidual) {
        cache[i] = add<Act>(cache[i], res[i]);
        sum_out[base + col] = cache[i];
      }
      ss += sum_squares<Act>(cache[i]);
    }
  }
  for (int col = tid + kNormCached * kNormThreads; col < row_vecs; col += kNormThreads) {
    uint4 v = x[base + col];
    if constexpr (kResidual) {
      v = add<Act>(v, residual[base + col]);
      sum_out[base + col] = v;
    }
    ss += sum_squares<Act>(v);
  }
  float const rstd = rsqrtf(block_sum(ss) / float(row_vecs * 8) + eps);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kNormCached; ++i) {
    int const col = tid + i * kNormThreads;
    if (col < row_vecs) out[base + col] = scale<Act>(cache[i], gamma[i], rstd);
  }
  for (int col = tid + kNormCached * kNormThreads; col < row_vecs; col += kNormThreads) {
    // this thread wrote sum_out[base + col] above: program order makes it visible to it
    uint4 const v = kResidual ? sum_out[base + col] : x[base + col];
    out[base + col] = scale<Act>(v, weight[col], rstd);
  }
}

#endif  // __CUDACC__

}  // namespace mixgemm::norm

// extern "C" NAME(x, residual, weight, out, sum_out, row_vecs, eps): grid (rows), block
// kNormThreads. ACT: the element type; RESIDUAL: whether residual is added (and sum_out
// written); without it both pointers are ignored (pass null).
#define MIXGEMM_RMS_NORM_ENTRY(NAME, ACT, RESIDUAL)                                                  \
  extern "C" __global__ void __launch_bounds__(mixgemm::norm::kNormThreads)                          \
  NAME(uint4 const* x, uint4 const* residual, uint4 const* weight, uint4* out, uint4* sum_out,       \
       int row_vecs, float eps) {                                                                    \
    mixgemm::norm::rms_norm<ACT, RESIDUAL>(x, residual, weight, out, sum_out, row_vecs, eps);       \
  }
