// mixgemm: GPU dequantization of a prepacked weight to a dense bf16/fp16 [N, K] matrix.
//
// Uses the very converter the GEMM mainloop uses (PrepackedDequant::kblock), so its output is the
// weight the GEMM multiplies by -- the reference for "what did the kernel see". Straight from the
// codes to the activation type: lop3 + sub + mul per register, no float32 round trip.
//
// One warp converts one 16x64 atom: lane l loads its 4*bits-byte chunk (one 8- or 16-byte load,
// two for int8), then writes its fragment values to their (row, k) places (pairs of adjacent k as
// one 32-bit store).
#pragma once

#include <cstdint>

#include "cute/numeric/integral_constant.hpp"
#include "cutlass/cutlass.h"

#include "mixgemm/chunk.hpp"
#include "mixgemm/numeric_conversion.hpp"

namespace mixgemm::kernels {

constexpr int kDequantThreads = 128;

template <class Code, class Act, bool HasZero>
__device__ __forceinline__ void dequantize_atoms(uint8_t const* __restrict__ qdata, Act const* __restrict__ scales,
                                                 Act const* __restrict__ zeros, Act* __restrict__ out,
                                                 int n, int k, int group_size) {
  using D = PrepackedDequantFor<Code, Act>;
  constexpr int kChunkBytes = 4 * D::kBits;
  int const lane = threadIdx.x % 32;
  int64_t const atom = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  int const k_atoms = k / 64;
  if (atom >= int64_t(n / 16) * k_atoms) {
    return;
  }
  int const na = int(atom / k_atoms);
  int const ka = int(atom % k_atoms);

  uint32_t chunk[D::kWordsPerLane];
  load_chunk<kChunkBytes>(qdata + (atom * 32 + lane) * kChunkBytes, chunk);

  // The lane's rows (g, g + 8) and first column pair (2t) inside the atom: the wgmma A fragment.
  int const g = lane / 4, t = lane % 4;
  int const rows[2] = {na * 16 + g, na * 16 + g + 8};

  auto convert = [&](auto kb_const) {
    constexpr int kb = decltype(kb_const)::value;
    int const k0 = ka * 64 + kb * 16;
    int const grp = k0 / group_size;
    uint32_t scale2[2], bias2[2];
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      int64_t idx = int64_t(grp) * n + rows[h];
      scale2[h] = arith::splat(reinterpret_cast<uint16_t const&>(scales[idx]));
      uint32_t z2 = 0;
      if constexpr (HasZero) {
        z2 = arith::splat(reinterpret_cast<uint16_t const&>(zeros[idx]));
      }
      bias2[h] = D::bias(z2);
    }
    uint32_t regs[4];
    D::template kblock<kb>(chunk, bias2, scale2, regs);
    // regs: (row g, k0+2t) (row g+8, k0+2t) (row g, k0+2t+8) (row g+8, k0+2t+8), two k each
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) {
      int64_t row = rows[i % 2];
      int col = k0 + 2 * t + 8 * (i / 2);
      *reinterpret_cast<uint32_t*>(out + row * k + col) = regs[i];
    }
  };
  convert(cute::Int<0>{});
  convert(cute::Int<1>{});
  convert(cute::Int<2>{});
  convert(cute::Int<3>{});
}

}  // namespace mixgemm::kernels

// extern "C" entry: NAME(qdata, scales, zeros, out, n, k, group_size); grid of 4 atoms per block.
#define MIXGEMM_DEQUANT_ENTRY(NAME, CODE, ACT, HAS_ZERO)                                              \
  extern "C" __global__ void __launch_bounds__(mixgemm::kernels::kDequantThreads)                     \
  NAME(uint8_t const* qdata, ACT const* scales, ACT const* zeros, ACT* out, int n, int k, int group) { \
    mixgemm::kernels::dequantize_atoms<CODE, ACT, HAS_ZERO>(qdata, scales, zeros, out, n, k, group);  \
  }
