// Device build of the e4m3 converters (converters/mixgemm/e4m3.hpp): compiled for sm_90a by
// tests/jit/test_converters.py (compile only; the host build checks the values). One kernel per
// entry point and code type, so that the SASS of each can be read on its own:
//   e4m3_convert: a lane chunk -> 8 registers of e4m3, with the rows' tables given
//   e4m3_table:   a row's table from its zero point (bf16 bits), built in registers
//   e4m3_cutlass: cutlass::NumericArrayConverter<float_e4m3_t, mixgemm::prepacked<T>, 32>
#include <cstdint>

#include "mixgemm/chunk.hpp"
#include "mixgemm/numeric_conversion.hpp"

namespace {

template <int Bits, bool Signed>
using Conv = mixgemm::PrepackedE4M3<Bits, Signed>;

}  // namespace

template <int Bits, bool Signed>
__global__ void e4m3_convert(uint32_t const* __restrict__ chunks, uint32_t const* __restrict__ tables,
                             uint4* __restrict__ out) {
  using C = Conv<Bits, Signed>;
  int const i = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t chunk[Bits];
  mixgemm::load_chunk<4 * Bits>(chunks + i * Bits, chunk);
  uint32_t tg[C::kTableWords], t8[C::kTableWords];
  for (int w = 0; w < C::kTableWords; ++w) {
    tg[w] = tables[w];
    t8[w] = tables[C::kTableWords + w];
  }
  uint32_t r[8];
  C::convert(chunk, tg, t8, r);
  out[2 * i] = make_uint4(r[0], r[1], r[2], r[3]);
  out[2 * i + 1] = make_uint4(r[4], r[5], r[6], r[7]);
}

template <int Bits, bool Signed>
__global__ void e4m3_table(uint16_t const* __restrict__ zeros, uint32_t* __restrict__ out) {
  using C = Conv<Bits, Signed>;
  int const i = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t t[C::kTableWords];
  C::table(C::template zero_code<mixgemm::Half::kBF16>(mixgemm::arith::splat(zeros[i])), t);
  for (int w = 0; w < C::kTableWords; ++w) out[i * C::kTableWords + w] = t[w];
}

template <class T>
__global__ void e4m3_cutlass(cutlass::Array<mixgemm::prepacked<T>, 32> const* __restrict__ in,
                             cutlass::Array<cutlass::float_e4m3_t, 32>* __restrict__ out) {
  int const i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = cutlass::NumericArrayConverter<cutlass::float_e4m3_t, mixgemm::prepacked<T>, 32>::convert(in[i]);
}

#define MIXGEMM_E4M3_KERNELS(BITS, SIGNED, T)                                                            \
  template __global__ void e4m3_convert<BITS, SIGNED>(uint32_t const* __restrict__, uint32_t const* __restrict__, \
                                                      uint4* __restrict__);                              \
  template __global__ void e4m3_table<BITS, SIGNED>(uint16_t const* __restrict__, uint32_t* __restrict__); \
  template __global__ void e4m3_cutlass<T>(cutlass::Array<mixgemm::prepacked<T>, 32> const* __restrict__,  \
                                           cutlass::Array<cutlass::float_e4m3_t, 32>* __restrict__);

MIXGEMM_E4M3_KERNELS(4, false, cutlass::uint4b_t)
MIXGEMM_E4M3_KERNELS(4, true, cutlass::int4b_t)
MIXGEMM_E4M3_KERNELS(2, false, cutlass::uint2b_t)
MIXGEMM_E4M3_KERNELS(2, true, cutlass::int2b_t)
