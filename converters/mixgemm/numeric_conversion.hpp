// mixgemm: cutlass::NumericArrayConverter specializations for prepacked weight codes.
//
// CUTLASS already converts int2b_t/int4b_t/int8_t (and the unsigned types) to bf16/fp16 for
// arrays in natural order. The prepacked layout stores the same codes in a different order
// (python/mixgemm/layout.py), so instead of redefining those converters this header introduces
// the element tag `mixgemm::prepacked<T>` -- "a T stored in the sm90a prepacked order" -- and
// specializes NumericArrayConverter for it. Reading prepacked data through the stock converter
// (or stock data through this one) is then a type error rather than silently wrong numbers.
//
// The conversion itself is mixgemm::PrepackedDequant (dequant.hpp), shared with the GEMM
// mainloop (which uses its scale/zero-fused form) and with the host-side exhaustive check; to
// e4m3 (FP8) it is mixgemm::PrepackedE4M3 (e4m3.hpp), for the 4- and 2-bit types.
#pragma once

#include <cstdint>

#include "cutlass/array.h"
#include "cutlass/integer_subbyte.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"

#include "mixgemm/dequant.hpp"
#include "mixgemm/e4m3.hpp"

namespace mixgemm {

// Element tag: a value of integer type T (int2b_t .. uint8_t) in the sm90a prepacked order.
template <class T>
struct prepacked {
  using element = T;
};

template <class T> struct code_traits;
template <> struct code_traits<cutlass::int2b_t>  { static constexpr int kBits = 2; static constexpr bool kSigned = true; };
template <> struct code_traits<cutlass::uint2b_t> { static constexpr int kBits = 2; static constexpr bool kSigned = false; };
template <> struct code_traits<cutlass::int4b_t>  { static constexpr int kBits = 4; static constexpr bool kSigned = true; };
template <> struct code_traits<cutlass::uint4b_t> { static constexpr int kBits = 4; static constexpr bool kSigned = false; };
template <> struct code_traits<int8_t>            { static constexpr int kBits = 8; static constexpr bool kSigned = true; };
template <> struct code_traits<uint8_t>           { static constexpr int kBits = 8; static constexpr bool kSigned = false; };

template <class T> struct half_of;
template <> struct half_of<cutlass::bfloat16_t> { static constexpr Half value = Half::kBF16; };
template <> struct half_of<cutlass::half_t>     { static constexpr Half value = Half::kFP16; };

// The converter for (code type T, activation type D).
template <class T, class D>
using PrepackedDequantFor = PrepackedDequant<code_traits<T>::kBits, code_traits<T>::kSigned, half_of<D>::value>;

// The e4m3 converter for code type T (4- and 2-bit types).
template <class T>
using PrepackedE4M3For = PrepackedE4M3<code_traits<T>::kBits, code_traits<T>::kSigned>;

}  // namespace mixgemm

namespace cutlass {

template <class T>
struct sizeof_bits<mixgemm::prepacked<T>> {
  static constexpr int value = sizeof_bits<T>::value;
};

// Converts N prepacked codes (N/32 whole lane chunks, in storage order) to N values in
// wgmma A-fragment order: for each chunk, k16 blocks 0..3, each as fragment values 0..7.
// The result is the integer code itself (q for the signed types, the unsigned code for the
// unsigned types), exact in bf16 and fp16; no scale, no zero point.
template <class D, class T, int N, FloatRoundStyle Round>
struct NumericArrayConverter<D, mixgemm::prepacked<T>, N, Round> {
  static_assert(N % 32 == 0, "prepacked codes are converted in whole lane chunks of 32 values");
  using Dequant = mixgemm::PrepackedDequantFor<T, D>;
  using result_type = Array<D, N>;
  using source_type = Array<mixgemm::prepacked<T>, N>;
  static FloatRoundStyle const round_style = Round;

  CUTLASS_HOST_DEVICE
  static result_type convert(source_type const& source) {
    result_type result;
    uint32_t const* words = reinterpret_cast<uint32_t const*>(&source);
    uint32_t* out = reinterpret_cast<uint32_t*>(&result);
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < N / 32; ++c) {
      uint32_t const* chunk = words + c * Dequant::kWordsPerLane;
      uint32_t* o = out + c * 16;
      Dequant::template kblock_values<0>(chunk, *reinterpret_cast<uint32_t(*)[4]>(o + 0));
      Dequant::template kblock_values<1>(chunk, *reinterpret_cast<uint32_t(*)[4]>(o + 4));
      Dequant::template kblock_values<2>(chunk, *reinterpret_cast<uint32_t(*)[4]>(o + 8));
      Dequant::template kblock_values<3>(chunk, *reinterpret_cast<uint32_t(*)[4]>(o + 12));
    }
    return result;
  }

  CUTLASS_HOST_DEVICE
  result_type operator()(source_type const& s) const { return convert(s); }
};

// Converts N prepacked 4- or 2-bit codes (N/32 whole lane chunks) to e4m3 (mixgemm/e4m3.hpp):
// for each chunk, k32 blocks 0 and 1, each as the 16 bytes of wgmma's 8-bit A fragment, whose
// K order is mixgemm's permutation of the weight's (mixgemm::mma_to_weight_col). The result is
// the integer code itself (q for the signed types, the unsigned code for the unsigned types),
// exact in e4m3; no scale, no zero point.
template <class T, int N, FloatRoundStyle Round>
struct NumericArrayConverter<float_e4m3_t, mixgemm::prepacked<T>, N, Round> {
  static_assert(N % 32 == 0, "prepacked codes are converted in whole lane chunks of 32 values");
  using Convert = mixgemm::PrepackedE4M3For<T>;
  using result_type = Array<float_e4m3_t, N>;
  using source_type = Array<mixgemm::prepacked<T>, N>;
  static FloatRoundStyle const round_style = Round;

  CUTLASS_HOST_DEVICE
  static result_type convert(source_type const& source) {
    result_type result;
    uint32_t const* words = reinterpret_cast<uint32_t const*>(&source);
    uint32_t* out = reinterpret_cast<uint32_t*>(&result);
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < N / 32; ++c) {
      Convert::values(words + c * Convert::kWordsPerLane, *reinterpret_cast<uint32_t(*)[8]>(out + c * 8));
    }
    return result;
  }

  CUTLASS_HOST_DEVICE
  result_type operator()(source_type const& s) const { return convert(s); }
};

}  // namespace cutlass
