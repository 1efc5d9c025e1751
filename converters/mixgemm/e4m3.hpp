// mixgemm: int4/int2 prepacked codes -> e4m3 (FP8), exactly, for the FP8 tensor cores.
//
// Exactness. e4m3 stores 3 mantissa bits under an implicit leading 1, with normal exponents
// from 2^-6 to 2^8 (largest finite 448). An integer v with 1 <= |v| <= 15 = 0b1111 has at most
// four significant bits, so v = +-1.fff x 2^e with e <= 3: a normal e4m3 value, exactly. 0 is
// exact too. Every value produced here has magnitude <= 15:
//   s4: q in [-8, 7]     u4: u in [0, 15], u - z in [-15, 15]   (z in [0, 15])
//   s2: q in [-2, 1]     u2: u in [0, 3],  u - z in [-3, 3]     (z in [0, 3])
// so the conversion is a table of e4m3 bit patterns indexed by the code: no rounding anywhere.
// The tables come from e4m3_bits() (below), which encodes the format's definition; the host
// tests compare every entry with torch's float8_e4m3fn.
//
// Input: a lane's chunk of a 16x64 prepacked atom (python/mixgemm/weights/layout.py), Bits
// 32-bit words, 32 values in the 16-bit wgmma A-fragment order: value v = 8 kb + i of k16 block
// kb, fragment index i: row g for i in {0,1,4,5}, row g + 8 for {2,3,6,7}; lane t holds the
// k16 block's columns 2t, 2t+1 (i = 0,1 / 2,3) and 2t+8, 2t+9 (i = 4,5 / 6,7).
//
// Output: per k32 block m (0, 1) of the chunk, 4 registers of 4 e4m3 bytes: the A fragment of
// wgmma.m64nNk32 for 8-bit types (CUTLASS's GMMA::ALayout_64x32): register r holds row g
// (r = 0, 2) or g + 8 (r = 1, 3), byte j of it the MMA's K column 16 (r / 2) + 4 t + j. An 8-bit
// fragment wants 4 consecutive columns per register, which the 16-bit layout does not give a
// lane, so the MMA's K order is a permutation of the weight's, inside each block of 32 columns:
//
//   MMA column F = 16 p + 4 t + j  holds weight column  L = 8 j + 2 t + p   (p, j, t in range)
//
// (mma_to_weight_col / weight_to_mma_col below). The activations must be given to the MMA in
// the same order: the activation quantizer writes activation column L to position F. Groups of
// 32 or more aligned columns are unions of these blocks, so a k32 MMA block never straddles a
// group and group scales still apply to the accumulator per k32 block. In fragment values:
// register r = 2 p + row, byte j is value 8 (2 m + j / 2) + 4 (j % 2) + 2 row + p.
//
// Device path: prmt (byte permute) and plain bit operations, no branches and no memory.
//   * int2: a row's 4-entry table is one register. The 2-bit fields of a word alternate
//     between the rows, so masking every other field into the nibbles of a register gives 4
//     selector nibbles (the codes) per half-word, and one prmt converts 4 codes. Per k32 block
//     (16 codes, 4 registers): 4 prmt, 2 lop3, 3 shifts (sm_90a SASS: 9 instructions).
//   * int4: a 16-entry table is looked up as two 8-entry halves (prmt on the low 3 bits of the
//     code; bit 3 of a selector nibble would switch prmt to sign replication, so it is cleared)
//     and merged by a mask that is 0xff where the code's bit 3 is set. The mask is itself a
//     prmt, in sign-replication mode, of bytes whose top bit is bit 3 of the code. Row g's
//     codes sit in the low nibbles of the chunk's bytes, row g + 8's in the high nibbles;
//     two prmt and a select bring each row's codes of a k32 block into one register of 8
//     selector nibbles. Per k32 block (16 codes, 4 registers): 14 prmt, 8 lop3, 4 shifts
//     (sm_90a SASS: 26 instructions).
//
// Zero points. Unsigned codes are centered per (row, group): the table of the row is that of
// u - z. It is built once per group: in registers from z (table(z): selects and prmt, about 25
// instructions for int4, 2 for int2), z itself coming from the bf16/fp16 zero point the
// kernels keep (zero_code: an add and a mask); or read from a 16-entry table of tables that a
// kernel stages in shared memory (table_word()), one 16-byte load for int4.
// Signed codes have one constant table; their zero point is 0.
#pragma once

#include <cstdint>

#include "mixgemm/arith.hpp"

namespace mixgemm {

// e4m3 (OCP FP8 E4M3, torch.float8_e4m3fn) bit pattern of an integer v, |v| <= 15: exact, see
// above. Compile-time or host use; the device path reads it from tables.
MIXGEMM_HD constexpr uint32_t e4m3_bits(int v) {
  if (v == 0) return 0u;
  uint32_t const sign = v < 0 ? 0x80u : 0u;
  unsigned const a = unsigned(v < 0 ? -v : v);
  int e = 0;
  while ((a >> e) > 1u) ++e;                       // a = 1.fff x 2^e, e <= 3
  unsigned const man = (a << (3 - e)) & 7u;        // the 3 bits under the leading 1
  return sign | (unsigned(e + 7) << 3) | man;      // exponent bias 7
}

// The K permutation inside each 32-column block (see above). Inverse of each other.
MIXGEMM_HD constexpr int mma_to_weight_col(int f) {
  return (f & ~31) + 8 * (f % 4) + 2 * ((f / 4) % 4) + (f % 32) / 16;
}
MIXGEMM_HD constexpr int weight_to_mma_col(int l) {
  return (l & ~31) + 16 * (l % 2) + 4 * ((l / 2) % 4) + (l % 32) / 8;
}

namespace detail {
constexpr bool k_permutation_is_a_bijection() {
  for (int f = 0; f < 64; ++f) {
    if (weight_to_mma_col(mma_to_weight_col(f)) != f || mma_to_weight_col(f) / 32 != f / 32) return false;
  }
  return true;
}
static_assert(k_permutation_is_a_bijection(), "the K permutation stays inside 32-column blocks");
static_assert(e4m3_bits(1) == 0x38 && e4m3_bits(15) == 0x57 && e4m3_bits(-8) == 0xd0, "e4m3 encoding");
}  // namespace detail

template <int Bits, bool Signed>
struct PrepackedE4M3 {
  static_assert(Bits == 2 || Bits == 4, "e4m3 holds 2- and 4-bit codes (and their differences) exactly");
  static constexpr int kBits = Bits;
  static constexpr bool kSigned = Signed;
  static constexpr int kWordsPerLane = Bits;              // 32 values x Bits bits / 32
  static constexpr int kTableWords = Bits == 4 ? 4 : 1;   // 16 or 4 one-byte entries
  static constexpr uint32_t kCodeMask = (1u << Bits) - 1u;

  // Value of code c: two's complement for signed types.
  MIXGEMM_HD static constexpr int code_value(int c) {
    return Signed ? ((c ^ (1 << (Bits - 1))) - (1 << (Bits - 1))) : c;
  }

  // Word i of the table for zero point z: byte j is e4m3(code_value(4 i + j) - z). z is
  // ignored (0) for signed types. A compile-time definition, for staging tables in memory.
  MIXGEMM_HD static constexpr uint32_t table_word(int z, int i) {
    uint32_t w = 0;
    for (int j = 0; j < 4; ++j) {
      w |= e4m3_bits(code_value(4 * i + j) - (Signed ? 0 : z)) << (8 * j);
    }
    return w;
  }

  // The integer zero point z from the zero2 register the bf16/fp16 converters take (z in both
  // halves, in H). E + z is exact in H (E = 128 in bf16, 1024 in fp16, where the ulp is 1), so
  // its low mantissa bits are z: one add2 and a mask.
  template <Half H>
  MIXGEMM_HD static uint32_t zero_code(uint32_t zero2) {
    constexpr uint16_t kMagic = (H == Half::kBF16) ? 0x4300 : 0x6400;
    return arith::add2<H>(zero2, arith::splat(kMagic)) & kCodeMask;
  }

  // The table of a row for zero point z (an integer in [0, 2^Bits)), built in registers.
  MIXGEMM_HD static void table(uint32_t z, uint32_t (&t)[kTableWords]) {
    if constexpr (Signed) {
      (void)z;
      constant_table(t);
    } else if constexpr (Bits == 2) {
      // The bytes e4m3(-3) .. e4m3(3) in a prmt source pair; the window starting at byte
      // 3 - z is e4m3(u - z) for u = 0..3: selector nibbles 3 - z + u.
      constexpr uint32_t lo = e4m3_bits(-3) | e4m3_bits(-2) << 8 | e4m3_bits(-1) << 16 | e4m3_bits(0) << 24;
      constexpr uint32_t hi = e4m3_bits(1) | e4m3_bits(2) << 8 | e4m3_bits(3) << 16;
      t[0] = arith::prmt(lo, hi, 0x6543u - 0x1111u * (z & kCodeMask));
    } else {
      // E = e4m3(k - 15), k = 0..30, as 8 words; the table is E's 16 bytes from s = 15 - z.
      // Two levels of selects pick the words s / 4 .. s / 4 + 4 (by bits 3 and 2 of s), and a
      // prmt per word takes 4 bytes from s % 4 on.
      constexpr uint32_t e0 = window_word(0), e1 = window_word(1), e2 = window_word(2), e3 = window_word(3);
      constexpr uint32_t e4 = window_word(4), e5 = window_word(5), e6 = window_word(6), e7 = window_word(7);
      uint32_t const s = 15u - (z & kCodeMask);
      bool const by8 = (s & 8u) != 0, by4 = (s & 4u) != 0;
      uint32_t const w0 = by8 ? e2 : e0, w1 = by8 ? e3 : e1, w2 = by8 ? e4 : e2;
      uint32_t const w3 = by8 ? e5 : e3, w4 = by8 ? e6 : e4, w5 = by8 ? e7 : e5;
      uint32_t const v0 = by4 ? w1 : w0, v1 = by4 ? w2 : w1, v2 = by4 ? w3 : w2;
      uint32_t const v3 = by4 ? w4 : w3, v4 = by4 ? w5 : w4;
      uint32_t const sel = 0x3210u + 0x1111u * (s & 3u);
      t[0] = arith::prmt(v0, v1, sel);
      t[1] = arith::prmt(v1, v2, sel);
      t[2] = arith::prmt(v2, v3, sel);
      t[3] = arith::prmt(v3, v4, sel);
    }
  }

  // The 4 registers of k32 block KBlock (0, 1) of a lane's chunk: tg, t8 are the tables of
  // rows g and g + 8 (equal, and constant, for signed types).
  template <int KBlock>
  MIXGEMM_HD static void kblock(uint32_t const* chunk, uint32_t const (&tg)[kTableWords],
                                uint32_t const (&t8)[kTableWords], uint32_t (&out)[4]) {
    static_assert(KBlock == 0 || KBlock == 1, "a lane chunk holds two k32 blocks");
    if constexpr (Bits == 2) {
      // Word KBlock holds values 16 KBlock + 0..15: the even ones in 2-bit fields 0..7 of its
      // low half, the odd ones in its high half, in increasing order. Field f is on row g for
      // f even, g + 8 for f odd (values 0, 4, 8, 12 / 2, 6, 10, 14), so the fields 2n of a
      // half, masked into nibble n, are row g's register bytes in order (values 0, 4, 8, 12:
      // weight columns 2t, 2t + 8, 2t + 16, 2t + 24), and the fields 2n + 1 row g + 8's.
      uint32_t const w = chunk[KBlock];
      uint32_t const sg = w & 0x33333333u;          // row g's codes, one per nibble
      uint32_t const s8 = (w >> 2) & 0x33333333u;   // row g + 8's
      out[0] = arith::prmt(tg[0], tg[0], sg);
      out[1] = arith::prmt(t8[0], t8[0], s8);
      out[2] = arith::prmt(tg[0], tg[0], sg >> 16);
      out[3] = arith::prmt(t8[0], t8[0], s8 >> 16);
    } else {
      // Words 2 KBlock (a) and 2 KBlock + 1 (b) hold k16 blocks 2 KBlock and 2 KBlock + 1
      // (values +0 and +8); their nibbles are values 0 2 4 6 1 3 5 7, so bytes 0..3 of a word
      // hold row g's values 0, 4, 1, 5 in their low nibbles and row g + 8's 2, 6, 3, 7 in their
      // high nibbles.
      uint32_t const a = chunk[2 * KBlock], b = chunk[2 * KBlock + 1];
      uint32_t const x = arith::prmt(a, b, 0x6240u);   // bytes a0 b0 a2 b2: values 0 8 1 9 (+2)
      uint32_t const y = arith::prmt(a, b, 0x7351u);   // bytes a1 b1 a3 b3: values 4 12 5 13 (+2)
      uint32_t const y4 = y << 4;
      uint32_t const x4 = (x >> 4) | (x << 28);        // rotate: x's bit 3 becomes bit 31
      // Selector nibbles, bit 3 cleared. Row g: low nibbles of x (nibble 2n) and y (2n + 1):
      // values 0 4 8 12 | 1 5 9 13. Row g + 8: the high nibbles, values 2 6 10 14 | 3 7 11 15.
      uint32_t const ig = ((x & 0x0f0f0f0fu) | (y4 & 0xf0f0f0f0u)) & 0x77777777u;
      uint32_t const i8 = ((x4 & 0x0f0f0f0fu) | (y & 0xf0f0f0f0u)) & 0x77777777u;
      // 0xff where the code's bit 3 is set, by sign replication (selector nibbles 8..f) of the
      // byte whose top bit is that bit: for row g, x's bit 8n + 3 is x4's bit 8n - 5 (mod 32)
      // and y's is y4's 8n + 7; for row g + 8, the top bits of x's and y's bytes.
      uint32_t const mg_lo = arith::prmt(x4, y4, 0xd8cbu);
      uint32_t const mg_hi = arith::prmt(x4, y4, 0xfae9u);
      uint32_t const m8_lo = arith::prmt(x, y, 0xd9c8u);
      uint32_t const m8_hi = arith::prmt(x, y, 0xfbeau);
      out[0] = lookup16(tg, ig, mg_lo);
      out[1] = lookup16(t8, i8, m8_lo);
      out[2] = lookup16(tg, ig >> 16, mg_hi);
      out[3] = lookup16(t8, i8 >> 16, m8_hi);
    }
  }

  // The whole chunk: 8 registers, k32 block 0 then 1.
  MIXGEMM_HD static void convert(uint32_t const* chunk, uint32_t const (&tg)[kTableWords],
                                 uint32_t const (&t8)[kTableWords], uint32_t (&out)[8]) {
    kblock<0>(chunk, tg, t8, *reinterpret_cast<uint32_t(*)[4]>(out + 0));
    kblock<1>(chunk, tg, t8, *reinterpret_cast<uint32_t(*)[4]>(out + 4));
  }

  // The codes' own values (q for signed types, u for unsigned): the tables of z = 0.
  MIXGEMM_HD static void values(uint32_t const* chunk, uint32_t (&out)[8]) {
    uint32_t t[kTableWords];
    constant_table(t);
    convert(chunk, t, t, out);
  }

 private:
  // The table of z = 0, as compile-time constants.
  MIXGEMM_HD static void constant_table(uint32_t (&t)[kTableWords]) {
    constexpr uint32_t t0 = table_word(0, 0);
    t[0] = t0;
    if constexpr (Bits == 4) {
      constexpr uint32_t t1 = table_word(0, 1), t2 = table_word(0, 2), t3 = table_word(0, 3);
      t[1] = t1;
      t[2] = t2;
      t[3] = t3;
    }
  }

  // Word j of E (bytes e4m3(4 j + n - 15), n = 0..3; byte 31 is never read).
  MIXGEMM_HD static constexpr uint32_t window_word(int j) {
    uint32_t w = 0;
    for (int n = 0; n < 4 && 4 * j + n <= 30; ++n) w |= e4m3_bits(4 * j + n - 15) << (8 * n);
    return w;
  }

  // Table t at the 4 selector nibbles idx (low 3 bits of the codes), the upper half where the
  // mask m is 0xff.
  MIXGEMM_HD static uint32_t lookup16(uint32_t const (&t)[4], uint32_t idx, uint32_t m) {
    uint32_t const lo = arith::prmt(t[0], t[1], idx);
    uint32_t const hi = arith::prmt(t[2], t[3], idx);
    return (lo & ~m) | (hi & m);
  }
};

}  // namespace mixgemm
