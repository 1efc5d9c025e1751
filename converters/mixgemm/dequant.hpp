// mixgemm: int8/int4/int2 -> bf16/fp16 conversion of prepacked weights, with the group's scale
// and zero point folded in. Written once in terms of arith.hpp's primitives, so the same code is
// the device path (PTX) and the host path (exact emulation) that the CPU tests check.
//
// Input order: the sm90a prepacked layout (python/mixgemm/layout.py). A lane owns a chunk of
// `Bits` 32-bit words per 16x64 atom, 32 values in wgmma A-fragment order; word w holds values
// w*V .. w*V+V-1 (V = 32/Bits), the even ones in its low half-word and the odd ones in its high
// half-word. So `word >> (Bits * p)` brings the pair (2p, 2p+1) of that word to bits [0, Bits)
// and [16, 16+Bits): one register's two lanes, ready for the magic-number trick below.
//
// Output: per k16 block, 4 registers of bf16x2/f16x2 = fragment values (0,1) (2,3) (4,5) (6,7).
// Registers 0 and 2 belong to the lane's row g, registers 1 and 3 to row g + 8 (the two rows a
// lane holds), so each row has one scale register and one bias register (both halves equal).
//
// Arithmetic (per register, two values at a time, all exact except the final product):
//   x   = lop3(word >> shift, mask, magic)    x = E + c, c the code as a small integer
//   t   = x - bias                            bias = E + zero (exact): t = q - z, an integer
//   w   = t * scale                           one rounding, to nearest even
// which is bit for bit `((q - z).to(dtype) * s)` in torch, the reference formula.
#pragma once

#include "mixgemm/arith.hpp"

namespace mixgemm {

// How the codes of one element type become a half-precision integer `x = E + c`.
template <int Bits, bool Signed, Half H>
struct CodeDecoder {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8, "mixgemm decodes 2-, 4- and 8-bit codes");
  static constexpr int kValuesPerWord = 32 / Bits;
  static constexpr uint32_t kMask = ((1u << Bits) - 1u) * 0x00010001u;

  // Magic number E: a power of two whose ulp is 1, so OR-ing an integer c < ulp-range into its
  // mantissa gives the value E + c exactly.
  //   bf16 0x4300 = 128: 7 mantissa bits, exact for c < 128  (int2, int4)
  //   fp16 0x6400 = 1024: 10 mantissa bits, exact for c < 1024 (int2, int4, int8)
  // int8 does not fit bf16's 7 bits; it uses the two-part decode below instead.
  static constexpr bool kTwoPart = (H == Half::kBF16 && Bits == 8);
  static constexpr uint16_t kMagic = (H == Half::kBF16) ? 0x4300 : 0x6400;
  static constexpr int kMagicValue = (H == Half::kBF16) ? 128 : 1024;

  // Signed codes are two's complement; flipping their sign bit turns them into offset binary
  // c = q + 2^(b-1) >= 0. The flip rides along in the same lop3 (the XOR constant), for free.
  static constexpr uint32_t kSignFlip = Signed ? (1u << (Bits - 1)) * 0x00010001u : 0u;

  // E of the decoded x, and the code offset, so that q = x - kBase when Signed, and
  // q = x - kBase - offset is never needed: for unsigned codes bias = kBase + z.
  //   one-part:  x = 128|1024 + c,   c = q (unsigned) or q + 2^(b-1) (signed)
  //   two-part:  x = q (signed) or q - 128 (unsigned), see decode()
  static constexpr int kBase = kTwoPart ? (Signed ? 0 : -128) : kMagicValue;
  static constexpr int kSignedBias = kTwoPart ? 0 : kMagicValue + (Signed ? (1 << (Bits - 1)) : 0);

  // Decode the pair sitting in bits [0, Bits) and [16, 16 + Bits) of `w`.
  MIXGEMM_HD static uint32_t decode(uint32_t w) {
    if constexpr (!kTwoPart) {
      // (w & mask) ^ (magic | signflip): the mask keeps the two codes; the XOR sets E's
      // exponent bits (disjoint from the codes) and flips the sign bit of signed codes.
      return arith::lop3<arith::kLutAndXor>(w, kMask, arith::splat(kMagic) | kSignFlip);
    } else {
      // bf16, 8-bit codes: split the byte into its low 7 bits and its top bit.
      //   lo = 0x4300 | (b & 0x7f)            = 128 + (b & 127)
      //   hi = 0x4300 | (b & 0x80)            = 128 or 256      (0x4380 = 256: bit 7 is an
      //                                                           exponent bit of bf16)
      //   signed:   lo - hi = (b & 127) - 128 * b7 = q                       exactly
      //   unsigned: hi uses 0x4380 ^ (b & 0x80) = 256 or 128, so lo - hi = b - 128 exactly
      uint32_t lo = arith::lop3<arith::kLutAndOr>(w, 0x007f007fu, 0x43004300u);
      uint32_t hi = arith::lop3<arith::kLutAndXor>(w, 0x00800080u, Signed ? 0x43004300u : 0x43804380u);
      return arith::sub2<H>(lo, hi);
    }
  }
};

// Converter for one element type of the prepacked layout.
//   Bits, Signed: the code type (int8 / uint8 / int4 / uint4 / int2 / uint2)
//   H:            the activation type (bf16 / fp16)
template <int Bits, bool Signed, Half H>
struct PrepackedDequant {
  using Decoder = CodeDecoder<Bits, Signed, H>;
  static constexpr int kBits = Bits;
  static constexpr bool kSigned = Signed;
  static constexpr int kWordsPerLane = Bits;            // 32 values x Bits bits / 32
  static constexpr int kValuesPerWord = 32 / Bits;

  // The per-row bias register for a group: bias = E + z, exact (E + z < 2^8 in bf16 because
  // z < 16 there, < 2^11 in fp16). `zero2` holds the zero point z in both halves (H bits);
  // ignored for signed (symmetric) types, whose zero point is the constant 0.
  MIXGEMM_HD static uint32_t bias(uint32_t zero2) {
    if constexpr (Signed) {
      (void)zero2;
      return arith::splat(Decoder::kSignedBias == 0 ? uint16_t(0) : half_bits(Decoder::kSignedBias));
    } else {
      return arith::add2<H>(zero2, arith::splat(half_bits(Decoder::kBase)));
    }
  }

  // Fragment pair j (0..3) of k16 block `KBlock` (0..3) of a lane's chunk, dequantized.
  template <int KBlock, int J>
  MIXGEMM_HD static uint32_t pair(uint32_t const* chunk, uint32_t bias2, uint32_t scale2) {
    constexpr int v = 8 * KBlock + 2 * J;             // first fragment value of the pair
    constexpr int word = v / kValuesPerWord;
    constexpr int shift = Bits * ((v % kValuesPerWord) / 2);
    uint32_t x = Decoder::decode(chunk[word] >> shift);
    uint32_t t = (Signed && Decoder::kTwoPart) ? x : arith::sub2<H>(x, bias2);  // q - z, exact
    return arith::mul2<H>(t, scale2);
  }

  // The 4 registers of k16 block `KBlock`. bias2/scale2: index 0 = row g, 1 = row g + 8.
  template <int KBlock>
  MIXGEMM_HD static void kblock(uint32_t const* chunk, uint32_t const (&bias2)[2],
                                uint32_t const (&scale2)[2], uint32_t (&out)[4]) {
    out[0] = pair<KBlock, 0>(chunk, bias2[0], scale2[0]);
    out[1] = pair<KBlock, 1>(chunk, bias2[1], scale2[1]);
    out[2] = pair<KBlock, 2>(chunk, bias2[0], scale2[0]);
    out[3] = pair<KBlock, 3>(chunk, bias2[1], scale2[1]);
  }

  // The code values themselves (q for signed types, the unsigned code for unsigned types) as
  // exact half-precision integers: no scale, no zero point. 4 registers per k16 block.
  template <int KBlock>
  MIXGEMM_HD static void kblock_values(uint32_t const* chunk, uint32_t (&out)[4]) {
    // x - bias0 with bias0 = E (+ 2^(b-1) for signed one-part codes); for unsigned two-part
    // codes x = u - 128, so bias0 = -128.
    constexpr int bias0 = Signed ? Decoder::kSignedBias : Decoder::kBase;
    constexpr uint32_t b2 = arith::splat(half_bits(bias0));
    constexpr uint32_t one = arith::splat(half_bits(1));
    uint32_t const bias2[2] = {b2, b2};
    uint32_t const scale2[2] = {one, one};
    kblock<KBlock>(chunk, bias2, scale2, out);
  }

  // Bit pattern of a small integer (|v| <= 2048) in H, computed at compile time.
  MIXGEMM_HD static constexpr uint16_t half_bits(int v) {
    if (v == 0) return 0;
    uint16_t sign = v < 0 ? 0x8000 : 0;
    unsigned a = v < 0 ? unsigned(-v) : unsigned(v);
    int e = 0;
    while ((a >> e) > 1) ++e;                           // a = 2^e * (1.f)
    constexpr int man_bits = (H == Half::kBF16) ? 7 : 10;
    constexpr int bias = (H == Half::kBF16) ? 127 : 15;
    unsigned man = e >= man_bits ? (a >> (e - man_bits)) : (a << (man_bits - e));
    man &= (1u << man_bits) - 1u;
    return uint16_t(sign | (unsigned(e + bias) << man_bits) | man);
  }
};

}  // namespace mixgemm
