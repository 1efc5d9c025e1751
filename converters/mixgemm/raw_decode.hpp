// mixgemm: the decode kernels' conversion of prepacked codes: x = E + F * c, without the zero
// point or the scale (the decode kernels apply both per group in float32; see
// cutlass_ext/mixgemm/decode_kernel.hpp). Host and device, like dequant.hpp, so that the CPU
// tests check it bit for bit (tests/cpp/converter_check.cpp, modes `raw` and `centered`).
//
// A lane's register j (0..3) of k16 block kb holds fragment values 8 kb + 2 j and + 1; registers
// 0 and 2 are on the lane's row g, 1 and 3 on row g + 8. In the prepacked word they sit at bit
// P = Bits * ((v % V) / 2) (low half-word) and 16 + P (high half-word), V = 32 / Bits values a
// word. dequant.hpp brings each pair down to bit 0 (one shift, one lop3 per register).
//
// 2-bit codes on row g + 8 are decoded two bits higher instead: from (word >> (P - 2)) with the
// mask 0xC and the sign flip shifted by 2, x = E + 4c exactly (4c <= 12 fits the mantissa under
// E). Row g + 8's registers j = 1, 3 sit at P = P(j - 1) + 2, so they take the very shifted
// words of row g's registers j - 1: a word of 16 codes needs the shifts 0, 4, 8, 12 (three
// shift instructions and eight lop3) instead of 0, 2, ..., 14 (seven and eight). Row g + 8's
// partial sums then carry the factor F = 4 (kRowFactor), which the kernel takes out of its
// group constants: bias E + 4 z and scale s / 4, both exact.
//
// 4- and 8-bit codes keep F = 1: a 4-bit code at bit P - d (d <= 3) would need shifts of its own,
// so nothing is saved, and the two-part int8 decode has no room under E.
#pragma once

#include "mixgemm/dequant.hpp"

namespace mixgemm {

template <int Bits, bool Signed, Half H>
struct RawDecode {
  using D = PrepackedDequant<Bits, Signed, H>;
  using Decoder = typename D::Decoder;
  static constexpr int kValuesPerWord = 32 / Bits;

  // log2 of row g + 8's factor, and the factor of each row (index 0: row g, 1: row g + 8).
  static constexpr int kHiShift = (Bits == 2 && !Decoder::kTwoPart) ? 2 : 0;
  MIXGEMM_HD static constexpr int row_factor(int row) { return row ? (1 << kHiShift) : 1; }

  // x = E + F c of fragment pair j of k16 block KBlock (c: the unsigned code, or the signed code
  // plus 2^(Bits-1)); the two-part int8 decode as dequant.hpp's (q, or u - 128 in bf16).
  template <int KBlock, int J>
  MIXGEMM_HD static uint32_t pair(uint32_t const* chunk) {
    constexpr int v = 8 * KBlock + 2 * J;
    constexpr int word = v / kValuesPerWord;
    constexpr int shift = Bits * ((v % kValuesPerWord) / 2);
    if constexpr (Decoder::kTwoPart) {
      return Decoder::decode(chunk[word] >> shift);
    } else {
      constexpr int d = (J % 2) ? kHiShift : 0;
      static_assert(shift >= d, "row g + 8's codes sit above row g's");
      return arith::lop3<arith::kLutAndXor>(chunk[word] >> (shift - d), Decoder::kMask << d,
                                            arith::splat(Decoder::kMagic) | (Decoder::kSignFlip << d));
    }
  }

  template <int KBlock>
  MIXGEMM_HD static void kblock(uint32_t const* chunk, uint32_t (&out)[4]) {
    out[0] = pair<KBlock, 0>(chunk);
    out[1] = pair<KBlock, 1>(chunk);
    out[2] = pair<KBlock, 2>(chunk);
    out[3] = pair<KBlock, 3>(chunk);
  }

  // What x holds beyond F (q - z) on row `Row`, as a float: E + F z for unsigned codes (z the
  // zero point), E + F 2^(Bits-1) for signed one-part codes, 0 for signed two-part codes.
  template <int Row>
  MIXGEMM_HD static float offset(float z) {
    constexpr float f = float(row_factor(Row));
    if constexpr (Signed) {
      (void)z;
      return Decoder::kTwoPart ? 0.f : float(Decoder::kMagicValue) + f * float(1 << (Bits - 1));
    } else {
      return float(Decoder::kBase) + f * z;
    }
  }

  // The same offset in both halves of a register (zero2: z in both halves, H bits), so that
  // x - bias = F (q - z) exactly: E + F z < 2^8 in bf16 (2-bit: 128 + 12), < 2^11 in fp16.
  template <int Row>
  MIXGEMM_HD static uint32_t bias(uint32_t zero2) {
    if constexpr (Signed) {
      (void)zero2;
      constexpr int b = Decoder::kTwoPart ? 0 : Decoder::kMagicValue + row_factor(Row) * (1 << (Bits - 1));
      return arith::splat(D::half_bits(b));
    } else if constexpr (row_factor(Row) == 1) {
      return arith::add2<H>(zero2, arith::splat(D::half_bits(Decoder::kBase)));
    } else {
      constexpr uint32_t f2 = arith::splat(D::half_bits(row_factor(Row)));
      return arith::add2<H>(arith::mul2<H>(zero2, f2), arith::splat(D::half_bits(Decoder::kBase)));
    }
  }

  // The k16 block's registers as F (q - z), exact (bias2: bias<0>, bias<1>). For signed
  // two-part codes x is q already.
  template <int KBlock>
  MIXGEMM_HD static void centered(uint32_t const* chunk, uint32_t const (&bias2)[2], uint32_t (&out)[4]) {
    kblock<KBlock>(chunk, out);
    if constexpr (!(Signed && Decoder::kTwoPart)) {
      out[0] = arith::sub2<H>(out[0], bias2[0]);
      out[1] = arith::sub2<H>(out[1], bias2[1]);
      out[2] = arith::sub2<H>(out[2], bias2[0]);
      out[3] = arith::sub2<H>(out[3], bias2[1]);
    }
  }
};

}  // namespace mixgemm
