// mixgemm: the decode kernel's parameters and compile-time shape (decode_kernel.hpp): what the
// kernel, its host plan (decode_plan.hpp) and the grouped decode kernel share, host and device.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cute/arch/copy_sm90_desc.hpp"   // cute::TmaDescriptor
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"

#include "mixgemm/activation.hpp"
#include "mixgemm/numeric_conversion.hpp"
#include "mixgemm/raw_decode.hpp"

namespace mixgemm::decode {

// The epilogue function (activation.hpp), fixed per kernel. kSwiglu: stripe j of a gate/up
// interleaved weight (gate rows 16j .. 16j+7, up rows 16j+8 .. 16j+15) gives output rows
// [8j, 8j + 8) of y[M, N/2]; each lane holds the gate row g and the up row g + 8 itself.
using mixgemm::Activation;
using mixgemm::activate;

template <class Act>
struct Params {
  uint8_t const* weight;    // [N/16][K/64][128*bits] prepacked
  Act const* scales;        // [G][N]
  Act const* zeros;         // [G][N] or null (signed codes)
  Act const* x;             // [M][ldx]
  Act const* bias;          // [N] or null
  Act* y;                   // [M][ldy]
  float* partials;          // [splits][N][M] float32 (splits > kMaxClusterSplits)
  int32_t* counters;        // [gridDim.x] zero-initialised (idem); every finishing CTA leaves its 0
  int32_t m, n, k;
  int32_t group_shift;      // log2(group size); 30 for one group spanning K (per-channel)
  int32_t atoms_per_split;  // k-atoms (64 K each) per CTA
  int32_t splits;           // <= kMaxClusterSplits: the cluster's size along y
  int32_t groups_per_split; // group rows of scales/zeros staged per CTA
  int32_t segments_per_slice; // (group, slice) x-sum segments per slice (kFold): groups a slice touches
  int64_t ldx, ldy;
};

// The dense decode kernel's arguments: Params, and the TMA descriptors of its scale and zero rows
// as 2-D tensors [G][N] (boxes of Config::box_groups x rows per CTA), encoded by the host helper
// on every call (mixgemm/decode_plan.hpp; ~0.7 us of host time): one copy brings a CTA's scale
// rows where one bulk copy per group row did (a CTA's copies issue one after another, ~40 ns
// each: docs/decode.md).
// (Params first: the kernel reads them from the constant bank; the descriptors only by address.)
template <class Act>
struct Args {
  Params<Act> p;
  cute::TmaDescriptor scales_map;
  cute::TmaDescriptor zeros_map;   // (zeroed for signed codes)
};
// With an x ring (Config::kXRing), the descriptor of x as a 3-D tensor [K/64 atoms][M rows][64]
// (strides 128 bytes and ldx), read in boxes of Config::kXAtoms atoms x kTokens rows with the
// 128-byte swizzle: rows past M arrive as zeros.
template <class Act>
struct ArgsX : Args<Act> {
  cute::TmaDescriptor x_map;
};

// Compile-time shape of one kernel.
template <class Code_, class Act_, int NTiles_, int Warps_, int StageBytes_, int Stages_, int KSlices_ = 1,
          int XStages_ = 0>
struct Config {
  using Code = Code_;
  using Act = Act_;
  using Dequant = PrepackedDequantFor<Code, Act>;
  // x = E + F c per register (converters/mixgemm/raw_decode.hpp): F = 4 on row g + 8 of 2-bit codes
  using Raw = RawDecode<Dequant::kBits, Dequant::kSigned, half_of<Act_>::value>;
  static constexpr int kNTiles = NTiles_;                    // n8 token tiles: M <= 8 * NTiles
  static constexpr int kTokens = 8 * NTiles_;
  static constexpr int kWarps = Warps_;
  static constexpr int kThreads = 32 * Warps_;
  static constexpr int kKSlices = KSlices_;                  // warps per stripe (k-slices)
  static constexpr int kStripesPerCta = Warps_ / KSlices_;
  static constexpr int kRowsPerCta = 16 * kStripesPerCta;
  static constexpr int kBits = Dequant::kBits;
  static constexpr bool kHasZero = !Dequant::kSigned;
  static constexpr int kAtomBytes = 128 * kBits;             // one 16x64 atom
  static constexpr int kChunkBytes = 4 * kBits;              // one lane's share of an atom
  static constexpr int kStageBytes = StageBytes_;
  static constexpr int kAtomsPerStage = StageBytes_ / kAtomBytes;
  static constexpr int kStages = Stages_;
  static_assert(kNTiles == 1 || kNTiles == 2 || kNTiles == 4, "8, 16 or 32 tokens per CTA");
  static_assert(StageBytes_ % kAtomBytes == 0 && kAtomsPerStage >= 1, "a stage holds whole atoms");
  static_assert(kStages >= 2, "at least double buffering");
  static_assert(KSlices_ >= 1 && Warps_ % KSlices_ == 0, "the k-slices divide the warps");
  // Folded offset (bf16, 2- and 4-bit codes): the MMA reads the decoded x = E + c as is (one
  // lop3 per register, no subtraction), and the flush takes (E + z) * sum(x over the group) off
  // the group's float32 partial sum: sum((c - z) x) = sum((E + c) x) - (E + z) sum(x). The
  // float32 partial carries E = 128 times sum(x) more than the result, so this costs ~2^-17
  // relative to sum(|x|) per group, far below bf16's output rounding (2^-9). fp16 (E = 1024:
  // 8x more) and the two-part int8 decode keep the exact in-register subtraction.
  //
  // x ring (XStages_ > 0): instead of the CTA's whole x[:, k-range] resident in shared memory
  // (tokens x 2 bytes per k: at 16 tokens half the bytes of the int4 weight rows the CTA streams,
  // so it bounds the CTAs per SM and forces finer splits of K: docs/decode.md),
  // x streams through kXStages slots of kXAtoms atoms (one TMA box each, 128-byte swizzle),
  // refilled by warp 0 once every warp is done with a slot. The x sums that the folded offset
  // needs are then not at hand before the stream: the x-ring kernels subtract the offset in
  // registers (the exact path of fp16).
  static constexpr int kXStages = XStages_;
  static constexpr bool kXRing = XStages_ > 0;
  static constexpr int kXAtoms = kAtomsPerStage > 2 ? kAtomsPerStage : 2;   // a stage never straddles two chunks
  static constexpr int kXAtomBytes = kTokens * 128;                        // tokens rows x 64 k of 16 bits
  static constexpr int kXChunkBytes = kXAtoms * kXAtomBytes;
  static_assert(!kXRing || (KSlices_ == 1 && XStages_ >= 2), "the x ring: one warp per stripe, >= 2 slots");
  static_assert(kXAtoms % kAtomsPerStage == 0 && kXAtomBytes % 1024 == 0, "chunks of whole stages, 1 KiB-aligned atoms");
  static constexpr bool kFold = half_of<Act_>::value == Half::kBF16 && !Dequant::Decoder::kTwoPart && !kXRing;

  // Shared memory: [ring: warps x stages x stage bytes][x tile or x ring][scales][zeros][barriers]
  static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
  static constexpr int kMaxSmem = 227 * 1024;
  // Split-K: the CTA's float32 sums, [warp][lane][tile][4], reuse the ring once it is drained.
  static constexpr int kSumsBytes = kThreads * kNTiles * 4 * 4;
  static constexpr int kRingRegion = kRingBytes > kSumsBytes ? kRingBytes : kSumsBytes;
  static constexpr int kMaxClusterSplits = 8;   // the portable cluster size
  // mbarriers: one per ring stage of every warp, the x tile's, the scale rows'
  // (+ the x ring's full and empty barriers)
  static constexpr int kBarriers = kWarps * kStages + 2 + (kXRing ? 2 * kXStages : 0);

  // The carve-up of dynamic shared memory, shared by the host plan and the kernel:
  //   [weight rings: warps x stages x stage bytes, or the split sums][x: rows x x_row_bytes]
  //   [scales][zeros][xsum: slices x segments x tokens float32, kFold only][barriers][flag]
  // x rows: min(M, tokens); x_row_bytes = 128 * atoms_per_split + 16 (16 mod 128: the 8 rows an
  // ldmatrix reads fall in distinct banks); scales/zeros: groups x rows-per-CTA.
  struct Carve {
    int x, scales, zeros, xsum, bars, total;
  };
  CUTLASS_HOST_DEVICE static int x_row_bytes(int atoms_per_split) { return atoms_per_split * 128 + 16; }
  // The scale / zero rows of a CTA's groups arrive in TMA boxes of at most 256 group rows (a box
  // dimension's limit): scale_copies(groups) boxes of box_groups(groups) rows each (the last
  // box may run past the CTA's groups or the tensor's last group: zero-filled or unused rows).
  // A box's rows are a multiple of kBoxAlign, so that every box lands 128-byte aligned.
  static constexpr int kMaxBoxGroups = 256;
  static constexpr int kGroupRowBytes = kRowsPerCta * int(sizeof(Act_));
  static constexpr int kBoxAlign = kGroupRowBytes >= 128 ? 1 : 128 / kGroupRowBytes;
  static_assert(kGroupRowBytes % 128 == 0 || 128 % kGroupRowBytes == 0, "boxes land 128-byte aligned");
  CUTLASS_HOST_DEVICE static int scale_copies(int groups) { return (groups + kMaxBoxGroups - 1) / kMaxBoxGroups; }
  CUTLASS_HOST_DEVICE static int box_groups(int groups) {
    int const c = scale_copies(groups);
    return c == 0 ? 0 : ((groups + c - 1) / c + kBoxAlign - 1) / kBoxAlign * kBoxAlign;   // (<= 256)
  }
  CUTLASS_HOST_DEVICE static Carve carve(int x_rows, int atoms_per_split, int groups, int segments) {
    Carve c;
    // (128-byte aligned: the boxes' destinations)
    int const group_bytes = (scale_copies(groups) * box_groups(groups) * kRowsPerCta * int(sizeof(Act)) + 127) / 128 * 128;
    if constexpr (kXRing) {
      c.x = (kRingRegion + 1023) / 1024 * 1024;   // (the swizzle's 1 KiB pattern)
      c.scales = c.x + kXStages * kXChunkBytes;
    } else {
      c.x = kRingRegion;
      c.scales = (c.x + x_rows * x_row_bytes(atoms_per_split) + 127) / 128 * 128;
    }
    c.zeros = c.scales + group_bytes;
    c.xsum = (c.zeros + (kHasZero ? group_bytes : 0) + 15) / 16 * 16;
    c.bars = c.xsum + (kFold ? kKSlices * segments * kTokens * 4 : 0);
    c.total = c.bars + 8 * kBarriers + 16;   // + the last-CTA flag of the global reduction
    return c;
  }
};

// The kernel's argument struct: Args, and the x descriptor with an x ring.
template <class Cfg>
using ArgsOf = std::conditional_t<Cfg::kXRing, ArgsX<typename Cfg::Act>, Args<typename Cfg::Act>>;

}  // namespace mixgemm::decode
