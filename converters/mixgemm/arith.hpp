// mixgemm: the few bit and half-precision primitives the converters are written in.
//
// Every primitive has two implementations with identical results:
//   * device: one PTX instruction (lop3.b32, prmt.b32, sub/mul.rn.{bf16x2,f16x2}, sm_90);
//   * host:   portable C++ that reproduces it bit for bit, so that the converters (which are
//             written once, in terms of these primitives) can be checked exhaustively on a CPU.
//
// Host half-precision arithmetic is done in float and rounded once to bf16/fp16 with
// round-to-nearest-even. float has p = 24 significant bits; double rounding through a format
// with p >= 2q + 2 is innocuous for +, -, * (q = 8 for bf16, 11 for fp16), so the host result
// equals the correctly rounded result that the single PTX instruction produces.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#define MIXGEMM_HD __host__ __device__ __forceinline__
#else
#define MIXGEMM_HD inline
#endif

namespace mixgemm {

// Activation element type of a converter's output, as a compile-time tag. Kept independent of
// CUTLASS so that the host check builds with a plain C++ compiler.
enum class Half { kBF16, kFP16 };

namespace arith {

// -------------------------------------------------------------------------------------------
// lop3: an arbitrary three-input bitwise function. The immediate LUT is F(0xF0, 0xCC, 0xAA)
// for the function F(a, b, c); bit i of the result is LUT bit ((a_i << 2) | (b_i << 1) | c_i).
// -------------------------------------------------------------------------------------------
constexpr uint8_t kLutAndXor = (0xF0 & 0xCC) ^ 0xAA;  // (a & b) ^ c
constexpr uint8_t kLutAndOr  = (0xF0 & 0xCC) | 0xAA;  // (a & b) | c

template <uint8_t Lut>
MIXGEMM_HD uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(Lut));
  return d;
#else
  uint32_t d = 0;
  for (int m = 0; m < 8; ++m) {  // sum of the minterms selected by the LUT
    if ((Lut >> m) & 1) {
      d |= ((m & 4) ? a : ~a) & ((m & 2) ? b : ~b) & ((m & 1) ? c : ~c);
    }
  }
  return d;
#endif
}

// -------------------------------------------------------------------------------------------
// prmt: byte permute. Result byte i is byte (c >> 4i) & 7 of the 8-byte value b:a (a holds
// bytes 0-3); if bit 3 of that nibble is set, the byte's sign bit is replicated instead (0x00
// or 0xff). Only the low 16 bits of the selector c are read (the default mode of prmt.b32).
// -------------------------------------------------------------------------------------------
MIXGEMM_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  uint64_t const src = (uint64_t(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    uint32_t const nib = (c >> (4 * i)) & 0xfu;
    uint32_t byte = uint32_t(src >> (8 * (nib & 7u))) & 0xffu;
    if (nib & 8u) byte = (byte & 0x80u) ? 0xffu : 0x00u;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

// -------------------------------------------------------------------------------------------
// Host-side float <-> bf16/fp16 bit conversions (round to nearest even).
// -------------------------------------------------------------------------------------------
inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t bits_from_f32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round half to even on the 16 dropped bits
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));            // inf, NaN
  if (exp == 0) {                                                                       // zero, subnormal
    float mag = float(man) * f32_from_bits(0x33800000u);                                // man * 2^-24, exact
    return f32_from_bits(sign | bits_from_f32(mag));
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));                     // rebias 15 -> 127
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = bits_from_f32(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= 0x47800000u) {                        // |f| >= 65536 (or inf / NaN)
    return uint16_t(sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (u < 0x38800000u) {                         // |f| < 2^-14: fp16 subnormal or zero
    // Adding 0.5 puts the binary point so that the float's last mantissa bit weighs 2^-24,
    // the fp16 subnormal step: the float addition itself rounds to nearest even.
    float shifted = f32_from_bits(u) + 0.5f;
    return uint16_t(sign | (bits_from_f32(shifted) - 0x3f000000u));
  }
  uint32_t odd = (u >> 13) & 1u;                 // round half to even on the 13 dropped bits
  u += 0xc8000fffu + odd;                        // rebias 127 -> 15 (mod 2^32) plus rounding
  return uint16_t(sign | (u >> 13));             // a carry into the exponent gives inf at 65520
}

template <Half H> inline float to_f32(uint16_t h) { return H == Half::kBF16 ? bf16_to_f32(h) : f16_to_f32(h); }
template <Half H> inline uint16_t from_f32(float f) { return H == Half::kBF16 ? f32_to_bf16(f) : f32_to_f16(f); }

template <Half H, class Op>
inline uint32_t host_binary2(uint32_t a, uint32_t b, Op op) {
  uint16_t lo = from_f32<H>(op(to_f32<H>(uint16_t(a)), to_f32<H>(uint16_t(b))));
  uint16_t hi = from_f32<H>(op(to_f32<H>(uint16_t(a >> 16)), to_f32<H>(uint16_t(b >> 16))));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// -------------------------------------------------------------------------------------------
// Packed half-precision arithmetic on two lanes held in one 32-bit register.
// -------------------------------------------------------------------------------------------
template <Half H>
MIXGEMM_HD uint32_t sub2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  if constexpr (H == Half::kBF16) {
    asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  } else {
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
#else
  return host_binary2<H>(a, b, [](float x, float y) { return x - y; });
#endif
}

template <Half H>
MIXGEMM_HD uint32_t add2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  if constexpr (H == Half::kBF16) {
    asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  } else {
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
#else
  return host_binary2<H>(a, b, [](float x, float y) { return x + y; });
#endif
}

template <Half H>
MIXGEMM_HD uint32_t mul2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  if constexpr (H == Half::kBF16) {
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  } else {
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
#else
  return host_binary2<H>(a, b, [](float x, float y) { return x * y; });
#endif
}

// Both halves of a register set to the same 16-bit pattern.
MIXGEMM_HD constexpr uint32_t splat(uint16_t h) { return uint32_t(h) | (uint32_t(h) << 16); }

}  // namespace arith
}  // namespace mixgemm
