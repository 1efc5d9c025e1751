// mixgemm: the decode GEMM for few tokens (M <= 8 * NTiles), a CuTe/CUTLASS kernel of its own.
//
// At decode, y[M, N] = x[M, K] @ dequant(W)[N, K]^T is a stream over the weight: every byte of
// it is read once and used M times. The sm90 GEMM path (a 128-row wgmma tile per warpgroup,
// stream-K) spends most of its issue slots on bookkeeping at these sizes; this kernel instead
// keeps each warp on one 16-row stripe of the weight and does only what the stream needs:
//
// * weights: each warp streams its stripe's k-range, which is contiguous in the prepacked layout
//   ([N/16][K/64] atoms), through its own ring of shared-memory stages filled by bulk copies
//   (cp.async.bulk + an mbarrier per stage): no registers held for loads in flight, one
//   instruction per stage to issue;
// * activations: the CTA's x[:, k-range] (at most 8*NTiles rows) is bulk-copied to shared memory
//   once and shared by the CTA's warps; ldmatrix gives the mma.sync B fragments directly;
// * math: the prepacked atom is exactly the m16n8k16 A fragment (the wgmma A fragment of one
//   warp), so a lane's 16-byte chunk becomes 4 k16 blocks of A registers through
//   converters/mixgemm/raw_decode.hpp (a lop3 per register, x = E + F c, F = 4 on row g + 8 of
//   2-bit codes so that both rows share shifted words; minus E + F z when not folded: F (q - z),
//   exact) and feeds mma.sync m16n8k16 with float32 accumulation. The group's scale (over F) is
//   applied in float32 to the partial sum of the group (one FFMA per accumulator per group)
//   instead of to every weight;
// * bookkeeping off the per-atom path: the ring's slot, phase and source advance by one per
//   stage, the group's scale/zero/x-sum pointers by one per flush, and a group boundary is one
//   compare against a countdown; the warp index goes through a shuffle so that the compiler sees
//   it warp-uniform and keeps the ring's addresses in uniform registers (no per-issue R2UR loop);
// * split-K across CTAs when the stripes alone cannot fill the GPU. Up to 8 splits, the splits
//   of a row block are one thread-block cluster (1 x splits): each CTA leaves its float32 sums
//   in its own shared memory, and after a cluster barrier the CTAs read each other's sums
//   through distributed shared memory and add them in split order (deterministic), each CTA
//   finishing its share of the warps -- no global workspace, nothing to zero. Beyond 8 (long K
//   with many tokens, where the x tile limits the k-range of a CTA), each split writes float32
//   partials to a global workspace and the last CTA of a row block to finish (an atomic counter,
//   reset by that CTA) adds them in split order and runs the epilogue;
// * programmatic dependent launch: the kernel waits for the previous kernel in the stream
//   (griddepcontrol.wait) before its first global memory access, and lets the next one launch
//   (griddepcontrol.launch_dependents) as each CTA ends, so that the next kernel's launch and
//   set-up overlap this one's last CTAs and memory flush. (Triggering earlier, when a CTA's
//   weight stream is done, placed the next kernel's CTAs on the SMs that happened to be free
//   and made the MLP block 6% slower: benchmarks/NOTES.md section 4.) Launched without the
//   attribute, both are no-ops.
//
// * k-slices: the W warps of a CTA are W / KS stripes x KS slices of the CTA's k-range. The KS
//   warps of a stripe stream its k-range side by side and add their float32 sums through shared
//   memory (in slice order: deterministic) before the split-K reduction and the epilogue: more
//   warps in flight, with shorter chains, without a cluster or a global reduction. Measured
//   (benchmarks/NOTES.md section 9b): faster for 8-bit codes at M <= 8; one warp per stripe is
//   as fast for 4- and 2-bit codes, whose small layers are bound by fixed costs, not chains;
//
// Layout of one CTA: W warps; warp w owns stripe (W / KS) * blockIdx.x + w / KS (weight rows
// [16 * stripe, +16)) and slice w % KS of the CTA's k-atoms [blockIdx.y * atoms_per_split,
// +atoms_per_split).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm75.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm80.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/numeric_types.h"

#include "mixgemm/abi.hpp"
#include "mixgemm/activation.hpp"
#include "mixgemm/chunk.hpp"
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

// Compile-time shape of one kernel.
template <class Code_, class Act_, int NTiles_, int Warps_, int StageBytes_, int Stages_, int KSlices_ = 1>
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
  static constexpr bool kFold = half_of<Act_>::value == Half::kBF16 && !Dequant::Decoder::kTwoPart;

  // Shared memory: [ring: warps x stages x stage bytes][x tile][scales][zeros][barriers]
  static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
  static constexpr int kMaxSmem = 227 * 1024;
  // Split-K: the CTA's float32 sums, [warp][lane][tile][4], reuse the ring once it is drained.
  static constexpr int kSumsBytes = kThreads * kNTiles * 4 * 4;
  static constexpr int kRingRegion = kRingBytes > kSumsBytes ? kRingBytes : kSumsBytes;
  static constexpr int kMaxClusterSplits = 8;   // the portable cluster size

  // The carve-up of dynamic shared memory, shared by the host plan and the kernel:
  //   [weight rings: warps x stages x stage bytes, or the split sums][x: rows x x_row_bytes]
  //   [scales][zeros][xsum: slices x segments x tokens float32, kFold only][barriers]
  // x rows: min(M, tokens); x_row_bytes = 128 * atoms_per_split + 16 (16 mod 128: the 8 rows an
  // ldmatrix reads fall in distinct banks); scales/zeros: groups x rows-per-CTA.
  struct Carve {
    int x, scales, zeros, xsum, bars, total;
  };
  CUTLASS_HOST_DEVICE static int x_row_bytes(int atoms_per_split) { return atoms_per_split * 128 + 16; }
  CUTLASS_HOST_DEVICE static Carve carve(int x_rows, int atoms_per_split, int groups, int segments) {
    Carve c;
    int const group_bytes = groups * kRowsPerCta * int(sizeof(Act));
    c.x = kRingRegion;
    c.scales = c.x + x_rows * x_row_bytes(atoms_per_split);
    c.zeros = c.scales + group_bytes;
    c.xsum = (c.zeros + (kHasZero ? group_bytes : 0) + 15) / 16 * 16;
    c.bars = c.xsum + (kFold ? kKSlices * segments * kTokens * 4 : 0);
    c.total = c.bars + 8 * (kWarps * kStages + 1) + 16;   // + the last-CTA flag of the global reduction
    return c;
  }
};

#if defined(__CUDACC__) && !defined(MIXGEMM_HOST_HELPER)

using Barrier = cutlass::arch::ClusterTransactionBarrier;

// ldmatrix.x4: four 8x8 b16 matrices, lanes 8i..8i+7 give the row addresses of matrix i.
CUTLASS_DEVICE void ldsm_x4(uint32_t addr, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}

// Another CTA's 16 bytes of shared memory, through distributed shared memory: the same offset in
// the shared window of cluster rank `rank`.
CUTLASS_DEVICE float4 ld_cluster_f4(float const* local, uint32_t rank) {
  uint32_t const remote = cute::set_block_rank(cute::cast_smem_ptr_to_uint(local), rank);
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

// Programmatic dependent launch (sm_90): wait until the previous grid in the stream has completed
// and its memory is visible; let the next grid launch. No-ops for a launch without the attribute.
CUTLASS_DEVICE void wait_previous_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
CUTLASS_DEVICE void launch_next_grid() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// A lane's 4 A registers of k16 block KB: F (q - z) as exact half-precision integers (no scale:
// the kernel applies the scale in float32 per group; F = Raw::row_factor of the register's row).
// bias2: Raw::bias of rows g and g + 8. With Fold, the decoded E + F c itself (bias2 unused).
template <class Raw, int KB, bool Fold>
CUTLASS_DEVICE void centered_kblock(uint32_t const* chunk, uint32_t const (&bias2)[2], uint32_t (&out)[4]) {
  if constexpr (Fold) {
    Raw::template kblock<KB>(chunk, out);             // E + F c; the flush removes E + F z
  } else {
    Raw::template centered<KB>(chunk, bias2, out);    // (E + F c) - (E + F z) = F (q - z), exact
  }
}

template <class Cfg, Activation Act_, bool Group32>
CUTLASS_DEVICE void run(Params<typename Cfg::Act> const& p, char* smem) {
  using Act = typename Cfg::Act;
  using D = typename Cfg::Dequant;
  using Raw = typename Cfg::Raw;
  constexpr int NT = Cfg::kNTiles;
  constexpr int S = Cfg::kStages;
  constexpr int APS = Cfg::kAtomsPerStage;
  constexpr int KS = Cfg::kKSlices;
  constexpr Half H = half_of<Act>::value;

  int const warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0);   // warp-uniform, as the compiler sees it
  int const lane = threadIdx.x % 32;
  int const g = lane / 4, t = lane % 4;
  int const wstripe = warp / KS;   // the warp's stripe within the CTA
  int const slice = warp % KS;     // and its slice of the CTA's k-range

  int const stripes = p.n / 16;
  int const k_atoms = p.k / 64;
  int const stripe = blockIdx.x * Cfg::kStripesPerCta + wstripe;
  bool const has_stripe = stripe < stripes;
  int const row0 = blockIdx.x * Cfg::kRowsPerCta;                 // first weight row of the CTA
  int const rows_valid = min(Cfg::kRowsPerCta, p.n - row0);
  int const ka0 = blockIdx.y * p.atoms_per_split;
  int const ka1 = min(ka0 + p.atoms_per_split, k_atoms);
  int const n_atoms = ka1 - ka0;
  int const grp0 = (ka0 * 64) >> p.group_shift;
  int const grp1 = ((ka1 * 64 - 1) >> p.group_shift) + 1;
  // The warp's slice: atoms [wa0, wa0 + w_atoms) of the CTA's range (some slices may be empty).
  // (spelled out for KS = 1, where the slice is the CTA's range: the compiler then keeps no
  // slice state, as the kernel had before k-slices)
  int const per_slice = KS == 1 ? n_atoms : (n_atoms + KS - 1) / KS;
  int const wa0 = KS == 1 ? 0 : min(slice * per_slice, n_atoms);
  int const w_atoms = KS == 1 ? n_atoms : min(per_slice, n_atoms - wa0);
  int const wk0 = ka0 + wa0;                                        // its first k-atom
  int const sgrp0 = KS == 1 ? grp0 : (wk0 * 64) >> p.group_shift;   // its first group
  bool const streams = has_stripe && w_atoms > 0;

  // ---- shared memory carve-up (Config::carve, as the host planned it) ----
  int const m_rows = min(p.m, Cfg::kTokens);
  auto const carve = Cfg::carve(m_rows, p.atoms_per_split, p.groups_per_split, p.segments_per_slice);
  char* ring = smem + warp * S * Cfg::kStageBytes;
  char* xs = smem + carve.x;
  int const x_pitch = Cfg::x_row_bytes(p.atoms_per_split);
  Act* ss = reinterpret_cast<Act*>(smem + carve.scales);
  Act* zs = reinterpret_cast<Act*>(smem + carve.zeros);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + carve.bars);
  uint64_t* xbar = bars + Cfg::kWarps * S;
  uint64_t* wbar = bars + warp * S;
  int* last_flag = reinterpret_cast<int*>(xbar + 1);

  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kWarps * S + 1; ++i) {
      Barrier::init(&bars[i], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  int const n_stages = (w_atoms + APS - 1) / APS;
  uint8_t const* wsrc = p.weight + (int64_t(stripe) * k_atoms + wk0) * Cfg::kAtomBytes;
  auto issue = [&](int s) {
    int const atoms = min(APS, w_atoms - s * APS);
    Barrier::arrive_and_expect_tx(&wbar[s % S], uint32_t(atoms * Cfg::kAtomBytes));
    cute::SM90_BULK_COPY_G2S::copy(wsrc + int64_t(s) * Cfg::kStageBytes, &wbar[s % S],
                                   ring + (s % S) * Cfg::kStageBytes, atoms * Cfg::kAtomBytes);
  };
  auto issue_ring = [&]() {   // each warp's first weight stages (its slice of its stripe)
    if (streams && lane == 0) {
      for (int s = 0; s < S && s < n_stages; ++s) {
        issue(s);
      }
    }
  };
  // The x tile and the scale/zero rows complete one barrier; copies spread over warp 0's lanes.
  int const x_bytes = n_atoms * 128;
  auto issue_scales = [&]() {   // warp 0: the barrier's byte count, then the scale / zero rows
    int const g_bytes = rows_valid * int(sizeof(Act));
    int const n_groups = grp1 - grp0;
    if (lane == 0) {
      uint32_t total = uint32_t(m_rows * x_bytes + n_groups * g_bytes * (Cfg::kHasZero ? 2 : 1));
      Barrier::arrive_and_expect_tx(xbar, total);
    }
    __syncwarp();
    for (int i = lane; i < n_groups; i += 32) {
      int64_t src = int64_t(grp0 + i) * p.n + row0;
      cute::SM90_BULK_COPY_G2S::copy(p.scales + src, xbar, ss + i * Cfg::kRowsPerCta, g_bytes);
      if constexpr (Cfg::kHasZero) {
        cute::SM90_BULK_COPY_G2S::copy(p.zeros + src, xbar, zs + i * Cfg::kRowsPerCta, g_bytes);
      }
    }
  };
  auto issue_x = [&]() {   // warp 0: the x tile (the previous kernel's output)
    for (int r = lane; r < m_rows; r += 32) {
      cute::SM90_BULK_COPY_G2S::copy(p.x + r * p.ldx + int64_t(ka0) * 64, xbar, xs + r * x_pitch, x_bytes);
    }
  };
  // wait for the previous kernel, then x and the scale rows, then the weights (issuing the
  // constant data before the wait measured no faster, NOTES 9c)
  __syncthreads();
  wait_previous_grid();
  if (warp == 0) { issue_scales(); issue_x(); }
  issue_ring();

  float acc[NT][4];
  // The group's partial sums, in two independent chains (even / odd k16 blocks) so that
  // consecutive mma.sync do not wait on each other; added together when the group is flushed.
  float part[2][NT][4];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < NT; ++i) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < 4; ++c) { acc[i][c] = 0.f; part[0][i][c] = 0.f; part[1][i][c] = 0.f; }
  }
  auto mma = [&](float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (H == Half::kBF16) {
      cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1,
                                                 c[0], c[1], c[2], c[3]);
    } else {
      cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1,
                                               c[0], c[1], c[2], c[3]);
    }
  };

  // ldmatrix row addresses: lane l reads token row (l % 8) of tile i, 8 k at column 8 * (l / 8)
  // (+32 for the second half of an atom). Rows past the last token repeat the last token: they
  // only feed accumulator columns of tokens that are never stored.
  uint32_t xs_row[NT];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < NT; ++i) {
    int const r = min(8 * i + lane % 8, p.m - 1);
    xs_row[i] = cute::cast_smem_ptr_to_uint(xs) + r * x_pitch + (lane / 8) * 16;
  }
  // (the x tile starts at the CTA's first atom; the warp's atoms at wa0)

  Barrier::wait(xbar, 0);

  // ---- kFold: sum(x) per (slice, group, token) over the part of the group that the slice
  // streams, by the tensor cores (an all-ones A operand); segment j of slice s is the slice's
  // j-th group, at xsum[s][j][token], float32. Warps take the segments round-robin. ----
  float* xsum = reinterpret_cast<float*>(smem + carve.xsum);
  int const sps = p.segments_per_slice;
  if constexpr (Cfg::kFold) {
    uint32_t const ones[4] = {arith::splat(D::half_bits(1)), arith::splat(D::half_bits(1)),
                              arith::splat(D::half_bits(1)), arith::splat(D::half_bits(1))};
    for (int seg = warp; seg < KS * sps; seg += Cfg::kWarps) {
      // (one slice: the segments are the CTA's groups)
      int const s = KS == 1 ? 0 : seg / sps, j = KS == 1 ? seg : seg % sps;
      int const sa0 = KS == 1 ? 0 : min(s * per_slice, n_atoms);
      int const sa1 = KS == 1 ? n_atoms : min(sa0 + per_slice, n_atoms);
      if (KS > 1 && sa0 >= sa1) continue;
      int const sg0 = KS == 1 ? grp0 : ((ka0 + sa0) * 64) >> p.group_shift;
      int const sg1 = KS == 1 ? grp1 : (((ka0 + sa1) * 64 - 1) >> p.group_shift) + 1;
      if (j >= sg1 - sg0) continue;
      // the segment's k-range within the CTA's x tile
      int const k_lo = int(max(int64_t(sg0 + j) << p.group_shift, int64_t(ka0 + sa0) * 64)) - ka0 * 64;
      int const k_hi = int(min(int64_t(sg0 + j + 1) << p.group_shift, int64_t(ka0 + sa1) * 64)) - ka0 * 64;
      float sums[2][NT][4] = {};
      for (int k32 = k_lo; k32 < k_hi; k32 += 32) {        // group ranges are whole 32-k halves
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NT; ++i) {
          uint32_t b[4];
          ldsm_x4(xs_row[i] + k32 * 2, b[0], b[1], b[2], b[3]);
          mma(sums[0][i], ones, b[0], b[1]);
          mma(sums[1][i], ones, b[2], b[3]);
        }
      }
      if (g == 0) {   // every row of the all-ones product is the same sum: lanes 0-3 store theirs
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NT; ++i) {
          float2 v{sums[0][i][0] + sums[1][i][0], sums[0][i][1] + sums[1][i][1]};
          *reinterpret_cast<float2*>(xsum + seg * Cfg::kTokens + 8 * i + 2 * t) = v;
        }
      }
    }
    __syncthreads();
  }

  int const lrow = wstripe * 16 + g;   // the lane's rows in the CTA's scale rows: lrow, lrow + 8
  float const* wxsum = KS == 1 ? xsum : xsum + slice * sps * Cfg::kTokens;   // the warp's slice's segments
  // The current group's scale and zero (row lrow; row lrow + 8 is 8 further) and x-sums (the
  // lane's tokens 2t, 2t + 1 of tile 0), one group further after each flush
  Act const* gs = ss + (sgrp0 - grp0) * Cfg::kRowsPerCta + lrow;
  Act const* gz = zs + (sgrp0 - grp0) * Cfg::kRowsPerCta + lrow;
  float const* gx = wxsum + 2 * t;
  uint32_t bias2[2] = {0u, 0u};
  auto load_bias = [&]() {
    if constexpr (Cfg::kFold) {
      // the flush removes E + F z
    } else if constexpr (Cfg::kHasZero) {
      bias2[0] = Raw::template bias<0>(arith::splat(reinterpret_cast<uint16_t const&>(gz[0])));
      bias2[1] = Raw::template bias<1>(arith::splat(reinterpret_cast<uint16_t const&>(gz[8])));
    } else {
      bias2[0] = Raw::template bias<0>(0u);
      bias2[1] = Raw::template bias<1>(0u);
    }
  };
  // acc += (scale(group) / F) * (part - (E + F z) * xsum(group)); part = 0 (F: Raw::row_factor,
  // a power of two, so the division is exact); then on to the next group
  auto flush = [&]() {
    float const s0 = float(gs[0]), s1 = float(gs[8]) * (1.f / float(Raw::row_factor(1)));
    float ez0 = 0.f, ez1 = 0.f;
    if constexpr (Cfg::kFold) {
      if constexpr (Cfg::kHasZero) {
        ez0 = Raw::template offset<0>(float(gz[0]));
        ez1 = Raw::template offset<1>(float(gz[8]));
      } else {
        ez0 = Raw::template offset<0>(0.f);
        ez1 = Raw::template offset<1>(0.f);
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < NT; ++i) {
      float p0 = part[0][i][0] + part[1][i][0], p1 = part[0][i][1] + part[1][i][1];
      float p2 = part[0][i][2] + part[1][i][2], p3 = part[0][i][3] + part[1][i][3];
      if constexpr (Cfg::kFold) {
        float2 const xv = *reinterpret_cast<float2 const*>(gx + 8 * i);
        p0 = fmaf(-ez0, xv.x, p0); p1 = fmaf(-ez0, xv.y, p1);
        p2 = fmaf(-ez1, xv.x, p2); p3 = fmaf(-ez1, xv.y, p3);
      }
      acc[i][0] = fmaf(s0, p0, acc[i][0]);
      acc[i][1] = fmaf(s0, p1, acc[i][1]);
      acc[i][2] = fmaf(s1, p2, acc[i][2]);
      acc[i][3] = fmaf(s1, p3, acc[i][3]);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 4; ++c) { part[0][i][c] = 0.f; part[1][i][c] = 0.f; }
    }
    gs += Cfg::kRowsPerCta;
    gz += Cfg::kRowsPerCta;
    gx += Cfg::kTokens;
  };

  if (streams) {
    int cur = sgrp0;   // (32-wide groups)
    load_bias();
    // The ring's running state, so that a stage computes no index: the slot of stage s (s % S),
    // its barrier phase ((s / S) & 1), and the source of stage s + S.
    int slot = 0;
    uint32_t phase = 0;
    uint8_t const* next_src = wsrc + int64_t(S) * Cfg::kStageBytes;
    // Whole-atom groups: atoms per group, and the first atom of the next group counted from the
    // current stage's first atom (a group spanning K, shift 30, never ends inside the range).
    int const gshift_atoms = Group32 ? 0 : p.group_shift - 6;
    int next_group = Group32 ? 0 : ((sgrp0 + 1) << gshift_atoms) - wk0;
    // One stage of the ring: APS atoms (Full), or the short last one.
    auto stage_body = [&](int s, auto full_const) {
      constexpr bool kFull = decltype(full_const)::value;
      Barrier::wait(&wbar[slot], phase);
      char const* stage = ring + slot * Cfg::kStageBytes;
      int const atoms = kFull ? APS : w_atoms - s * APS;
      // All of the stage's chunks first, so their shared-memory latency overlaps (a short last
      // stage leaves stale bytes in its unused slots, never used).
      uint32_t chunks[APS][Cfg::kBits];
      CUTLASS_PRAGMA_UNROLL
      for (int a = 0; a < APS; ++a) {
        load_chunk<Cfg::kChunkBytes>(stage + a * Cfg::kAtomBytes + lane * Cfg::kChunkBytes, chunks[a]);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int a = 0; a < APS; ++a) {
        if (kFull || a < atoms) {
          uint32_t const* chunk = chunks[a];
          int const la = s * APS + a;          // atom index within the warp's slice
          // B fragments of the atom: [tile][k16 block][b0, b1]
          uint32_t b[NT][4][2];
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < NT; ++i) {
            uint32_t const addr = xs_row[i] + (wa0 + la) * 128;
            ldsm_x4(addr, b[i][0][0], b[i][0][1], b[i][1][0], b[i][1][1]);
            ldsm_x4(addr + 64, b[i][2][0], b[i][2][1], b[i][3][0], b[i][3][1]);
          }
          if constexpr (!Group32) {
            // one group spans whole atoms: flush the partial sum when the atom starts a new group
            if (next_group == a) {
              flush();
              load_bias();
              next_group += 1 << gshift_atoms;
            }
          }
          auto kblock = [&](auto kb_const) {
            constexpr int kb = decltype(kb_const)::value;
            if constexpr (Group32 && (kb == 0 || kb == 2)) {
              // 32-wide groups: k16 blocks 0-1 and 2-3 of an atom belong to different groups
              int const grp = ((wk0 + la) * 64 + kb * 16) >> p.group_shift;
              if (grp != cur) {   // (the next group: groups are contiguous)
                flush();
                cur = grp;
                load_bias();
              }
            }
            uint32_t a_regs[4];
            centered_kblock<typename Cfg::Raw, kb, Cfg::kFold>(chunk, bias2, a_regs);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < NT; ++i) {
              mma(part[kb % 2][i], a_regs, b[i][kb][0], b[i][kb][1]);
            }
          };
          kblock(cute::Int<0>{});
          kblock(cute::Int<1>{});
          kblock(cute::Int<2>{});
          kblock(cute::Int<3>{});
        }
      }
      next_group -= APS;
      __syncwarp();
      if (lane == 0 && s + S < n_stages) {   // refill this slot with stage s + S
        uint32_t const bytes = uint32_t(min(APS, w_atoms - (s + S) * APS) * Cfg::kAtomBytes);
        Barrier::arrive_and_expect_tx(&wbar[slot], bytes);
        cute::SM90_BULK_COPY_G2S::copy(next_src, &wbar[slot], ring + slot * Cfg::kStageBytes, bytes);
      }
      next_src += Cfg::kStageBytes;
      slot = slot + 1 == S ? 0 : slot + 1;
      phase ^= slot == 0 ? 1u : 0u;
    };
    int const full_stages = w_atoms / APS;
    for (int s = 0; s < full_stages; ++s) {
      stage_body(s, cute::true_type{});
    }
    if (full_stages < n_stages) {
      stage_body(full_stages, cute::false_type{});
    }
    flush();
  }

  // ---- epilogue: lane holds rows (g, g + 8) x tokens (8i + 2t, 8i + 2t + 1) of its stripe ----
  int const rows[2] = {stripe * 16 + g, stripe * 16 + g + 8};
  auto token = [&](int i, int c) { return 8 * i + 2 * t + (c % 2); };
  // put(i, e, offset of the token's output row) for each of the lane's token columns 8i + 2t + e
  // that is below M
  auto for_each_token = [&](auto&& put) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < NT; ++i) {
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 2; ++e) {
        int const tok = token(i, e);
        if (tok < p.m) {
          put(i, e, int64_t(tok) * p.ldy);
        }
      }
    }
  };
  auto store = [&]() {
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      float const bias = p.bias ? float(p.bias[rows[h]]) : 0.f;
      for_each_token([&](int i, int e, int64_t y_row) {
        p.y[y_row + rows[h]] = Act(activate<Act_>(acc[i][2 * h + e] + bias));
      });
    }
  };
  // The gated form: lane (g, t) holds gate row g and up row g + 8 of its stripe, and writes
  // silu(gate) * up at output row 8 * stripe + g.
  auto store_gated = [&]() {
    int const out = stripe * 8 + g;
    float const bias_g = p.bias ? float(p.bias[rows[0]]) : 0.f;
    float const bias_u = p.bias ? float(p.bias[rows[1]]) : 0.f;
    for_each_token([&](int i, int e, int64_t y_row) {
      p.y[y_row + out] = Act(silu(acc[i][e] + bias_g) * (acc[i][2 + e] + bias_u));
    });
  };
  // Only the stripe's first slice holds its total after the slice reduction below.
  bool const lead = slice == 0 && has_stripe;
  auto finish = [&](bool const mine) {
    if (mine && lead) {
      if constexpr (Act_ == Activation::kSwiglu) {
        store_gated();
      } else {
        store();
      }
    }
  };
  if constexpr (KS > 1) {
    // ---- the k-slices of a stripe: each warp publishes its sums in shared memory (the drained
    // rings), and the stripe's first slice adds them in slice order ----
    float* sums = reinterpret_cast<float*>(smem);
    __syncthreads();                                 // every warp is done with its ring
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < NT; ++i) {
      *reinterpret_cast<float4*>(sums + (threadIdx.x * NT + i) * 4) =
          make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    }
    __syncthreads();
    if (slice == 0) {
      for (int s = 1; s < KS; ++s) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NT; ++i) {
          float4 const v = *reinterpret_cast<float4 const*>(sums + ((threadIdx.x + 32 * s) * NT + i) * 4);
          acc[i][0] += v.x; acc[i][1] += v.y; acc[i][2] += v.z; acc[i][3] += v.w;
        }
      }
    }
    __syncthreads();                                 // the sums are read: the region is free again
  }
  if (p.splits == 1) {
    finish(true);
    return;
  }
  if (p.splits <= Cfg::kMaxClusterSplits) {
    // ---- split-K in the cluster: publish the CTA's sums in its own shared memory (the drained
    // rings), then CTA `rank` adds the splits of the warps it owns in split order, and
    // finishes them ----
    float* sums = reinterpret_cast<float*>(smem) + threadIdx.x * NT * 4;
    __syncthreads();                                 // every warp is done with its ring
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < NT; ++i) {
      *reinterpret_cast<float4*>(sums + 4 * i) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    }
    cute::cluster_sync();                            // release the sums, acquire the peers'
    bool const mine = wstripe % p.splits == int(cute::block_rank_in_cluster());
    if (mine && lead) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < NT; ++i) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;
      }
      for (int sp = 0; sp < p.splits; ++sp) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NT; ++i) {
          float4 const v = ld_cluster_f4(sums + 4 * i, uint32_t(sp));
          acc[i][0] += v.x; acc[i][1] += v.y; acc[i][2] += v.z; acc[i][3] += v.w;
        }
      }
    }
    cute::cluster_sync();                            // the peers are done reading: smem is free again
    finish(mine);
    return;
  }
  // ---- split-K through global memory: publish this split's float32 partials, then the last CTA
  // of the row block adds all splits in order (deterministic) and runs the epilogue ----
  if (lead) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < NT; ++i) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 4; ++c) {
        if (token(i, c) < p.m) {
          p.partials[(int64_t(blockIdx.y) * p.n + rows[c / 2]) * p.m + token(i, c)] = acc[i][c];
        }
      }
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    *last_flag = atomicAdd(&p.counters[blockIdx.x], 1) == p.splits - 1;
  }
  __syncthreads();
  if (!*last_flag) return;
  __threadfence();
  if (lead) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < NT; ++i) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 4; ++c) {
        float sum = 0.f;
        if (token(i, c) < p.m) {
          for (int sp = 0; sp < p.splits; ++sp) {
            sum += __ldcg(&p.partials[(int64_t(sp) * p.n + rows[c / 2]) * p.m + token(i, c)]);
          }
        }
        acc[i][c] = sum;
      }
    }
  }
  finish(true);
  if (threadIdx.x == 0) {
    p.counters[blockIdx.x] = 0;   // leave the counter as found: zero
  }
}

template <class Cfg, Activation A>
CUTLASS_DEVICE void kernel_body(Params<typename Cfg::Act> const& p) {
  extern __shared__ __align__(128) char smem[];
  if (p.group_shift == 5) {
    run<Cfg, A, true>(p, smem);
  } else {
    run<Cfg, A, false>(p, smem);
  }
  launch_next_grid();   // this CTA is done: the next kernel may launch once every CTA is
}

#endif  // device

// ---------------------------------------------------------------------------------------------
// Host side: the launch plan (split-K factor, shared memory) and the checks, shared by the
// host helper library. Pure host logic, no driver call.
// ---------------------------------------------------------------------------------------------
struct Plan {
  int splits;
  int atoms_per_split;
  int groups_per_split;
  int segments_per_slice;
  int smem_bytes;
  int row_blocks;
};

inline int group_shift_of(int group_size, int k) {
  for (int s = 5; s <= 16; ++s) {
    if (group_size == (1 << s)) return s;
  }
  return group_size == k ? 30 : -1;
}

template <class Cfg, Activation A = Activation::kNone>
struct Host {
  using Act = typename Cfg::Act;

  static int groups_in(int a0, int a1, int gshift) {   // groups that k-atoms [a0, a1) touch
    return a0 >= a1 ? 0 : (((a1 * 64 - 1) >> gshift) + 1) - ((a0 * 64) >> gshift);
  }
  static int max_groups(int k_atoms, int aps, int gshift) {
    int worst = 0;
    for (int ka0 = 0; ka0 < k_atoms; ka0 += aps) {
      int const n = groups_in(ka0, ka0 + aps < k_atoms ? ka0 + aps : k_atoms, gshift);
      worst = n > worst ? n : worst;
    }
    return worst;
  }
  // The most groups one k-slice touches, over every CTA split (run()'s slicing of a CTA's range).
  static int max_segments(int k_atoms, int aps, int gshift) {
    int worst = 0;
    for (int ka0 = 0; ka0 < k_atoms; ka0 += aps) {
      int const n_atoms = ka0 + aps < k_atoms ? aps : k_atoms - ka0;
      int const per = (n_atoms + Cfg::kKSlices - 1) / Cfg::kKSlices;
      for (int s = 0; s < Cfg::kKSlices; ++s) {
        int const a0 = s * per < n_atoms ? s * per : n_atoms;
        int const a1 = a0 + per < n_atoms ? a0 + per : n_atoms;
        int const n = groups_in(ka0 + a0, ka0 + a1, gshift);
        worst = n > worst ? n : worst;
      }
    }
    return worst;
  }

  static char const* why_not(abi::GemmArgs const& a) {
    if (a.abi_version != abi::kAbiVersion) return "ABI version mismatch between the runtime and the kernel's host helper";
    if (a.activation != int(A))
      return "this decode kernel fuses a different activation than the call asks for (see its name)";
    if (a.m < 1) return "M must be >= 1";
    if (a.m > Cfg::kTokens) return "too many tokens for this decode kernel (M > its token tile)";
    if (a.n < 16 || a.n % 16) return "N must be a positive multiple of 16 (the prepacked atom)";
    if (a.k < 64 || a.k % 64) return "K must be a positive multiple of 64 (the prepacked atom)";
    if (group_shift_of(a.group_size, a.k) < 0)
      return "the decode kernel needs a power-of-two group size >= 32, or one group spanning K";
    if (a.k % a.group_size) return "the group size must divide K";
    if (a.weight % 16 || a.scales % 16 || a.zeros % 16 || a.x % 16)
      return "weight, scales, zeros and x must be 16-byte aligned";
    if ((a.ldx * int64_t(sizeof(Act))) % 16) return "x's row stride must be a multiple of 16 bytes";
    if (A == Activation::kSwiglu && a.n % 16) return "the gated (swiglu) form needs N % 16 == 0: gate and up in 8-row stripes";
    if (a.ldx < a.k || a.ldy < (A == Activation::kSwiglu ? a.n / 2 : a.n)) return "row strides must cover the rows";
    if (a.bias % int64_t(sizeof(Act)) || a.y % int64_t(sizeof(Act))) return "bias and y must be aligned to their element size";
    if (Cfg::kHasZero && a.zeros == 0) return "this weight type needs zero points";
    return nullptr;
  }

  static int smem_for(abi::GemmArgs const& a, int aps, int groups, int segments) {
    return Cfg::carve(a.m < Cfg::kTokens ? a.m : Cfg::kTokens, aps, groups, segments).total;
  }

  // Split-K factor, from a cost model in units of one atom's step on a warp's chain / 8 (about
  // 90 cycles on an H100, measured: benchmarks/NOTES.md section 9). Each warp's chain is serial
  // and latency-bound (ncu: ~100 instructions per atom at ~7.5 cycles each), so a launch takes
  // about the waves of resident CTAs an SM runs times one warp's chain: 8 per atom of its slice,
  // plus a start-up of 16, plus the split reductions (the k-slices' in shared memory, M/8 for
  // the float32 partials of a cluster's splits, 16 more beyond a cluster's 8 splits for the
  // global reduction's fence and counter). It is at least the time to move the SM's share of
  // the bytes (~1.1 KB per unit and SM on an H100) and to issue its share of the instructions
  // (~0.4 units per warp-atom at the ~2.8 instructions per cycle an SM sustains here). Within
  // the shared-memory budget; ties go to fewer splits. An explicit a.splits >= 1 wins.
  static char const* plan(abi::GemmArgs const& a, Plan& out) {
    constexpr int KS = Cfg::kKSlices;
    constexpr long kMaxResident = 3;                  // 256-thread CTAs at <= 80 registers
    constexpr long kBytesPerUnit = 1100;              // per SM
    // issue cost per warp-atom: ~60 instructions of loop, loads and MMAs plus ~10 per bit of
    // code width (the decode), more MMAs for more token tiles
    constexpr long kIssueMilliUnits = 4L * (60 + 10 * Cfg::kBits) * (Cfg::kNTiles + 3) / 4;
    int const k_atoms = a.k / 64;
    int const gshift = group_shift_of(a.group_size, a.k);
    int const row_blocks = (a.n / 16 + Cfg::kStripesPerCta - 1) / Cfg::kStripesPerCta;
    long const sms = a.sm_count > 0 ? a.sm_count : 132;
    int const tokens = a.m < Cfg::kTokens ? a.m : Cfg::kTokens;
    long const total_bytes = long(a.n / 16) * k_atoms * Cfg::kAtomBytes;
    long best_cost = -1;
    bool const forced = a.splits >= 1;
    int const lo = forced ? a.splits : 1;
    int const hi = forced ? a.splits : 64;
    for (int s = lo; s <= hi && s <= k_atoms; ++s) {
      int const aps = (k_atoms + s - 1) / s;
      int const se = (k_atoms + aps - 1) / aps;
      if (!forced && se != s) continue;                // the same plan as a smaller s
      int const groups = max_groups(k_atoms, aps, gshift);
      // (only the folded zero point keeps x-sums per segment; the walk over every split's slices
      // is not free, and plan() runs on every launch of a shape without a tuned split factor)
      int const segments = !Cfg::kFold ? 0 : KS == 1 ? groups : max_segments(k_atoms, aps, gshift);
      int const smem = smem_for(a, aps, groups, segments);
      if (smem > Cfg::kMaxSmem) continue;
      long const fit = (228L * 1024) / (smem + 1024);
      long const resident = fit < kMaxResident ? fit : kMaxResident;
      int const apw = (aps + KS - 1) / KS;              // atoms on one warp's chain
      long const reduce = (KS > 1 ? 2 : 0) + (se == 1 ? 0 : se <= Cfg::kMaxClusterSplits ? tokens : tokens + 16);
      long const ctas = long(row_blocks) * se;
      long const per_sm = (ctas + sms - 1) / sms;       // CTAs of the busiest SM
      long const waves = (per_sm + resident - 1) / resident;
      long const chain = waves * (8L * apw + 16 + reduce);
      long const dram = (total_bytes / sms) / kBytesPerUnit;
      long const issue = per_sm * Cfg::kWarps * apw * kIssueMilliUnits / 1000;
      long cost = chain > dram ? chain : dram;
      cost = cost > issue ? cost : issue;
      if (best_cost < 0 || cost < best_cost) {
        best_cost = cost;
        out = Plan{se, aps, groups, segments, smem, row_blocks};
      }
    }
    if (best_cost < 0) return "no split of K fits this decode kernel's shared memory (too many tokens x K)";
    return nullptr;
  }

  // Why the kernel cannot run `a` (nullptr if it can), and its plan.
  static char const* check(abi::GemmArgs const* a, Plan& pl) {
    if (a == nullptr) return "null argument";
    if (char const* why = why_not(*a)) return why;
    return plan(*a, pl);
  }
  static char const* check(abi::GemmArgs const* a) {
    Plan pl;
    return check(a, pl);
  }

  // The global reduction's workspace: beyond kMaxClusterSplits only.
  static bool global_reduce(Plan const& pl) { return pl.splits > Cfg::kMaxClusterSplits; }
  static uint64_t counters_bytes(Plan const& pl) {
    return global_reduce(pl) ? (uint64_t(pl.row_blocks) * 4 + 255) / 256 * 256 : 0;
  }
  static uint64_t workspace_bytes(abi::GemmArgs const& a, Plan const& pl) {
    return global_reduce(pl) ? counters_bytes(pl) + uint64_t(pl.splits) * a.n * a.m * 4 : 0;
  }
  static uint64_t workspace_size(abi::GemmArgs const* a) {
    Plan pl;
    return check(a, pl) ? 0 : workspace_bytes(*a, pl);
  }

  static int prepare(abi::GemmArgs const* a, void* dst, uint32_t capacity, abi::Launch* out, char* err, int errlen) {
    auto fail = [&](char const* msg) {
      if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", msg);
      return 1;
    };
    Plan pl;
    if (char const* why = check(a, pl)) return fail(why);
    if (dst == nullptr || out == nullptr) return fail("null output buffer");
    if (capacity < sizeof(Params<Act>)) return fail("params buffer too small");
    std::memset(out, 0, sizeof(*out));
    out->workspace_bytes = workspace_bytes(*a, pl);
    out->workspace_zero_bytes = uint32_t(counters_bytes(pl));
    if (out->workspace_bytes && a->workspace == 0) return fail("this launch needs a workspace");
    Params<Act> p{};
    p.weight = reinterpret_cast<uint8_t const*>(a->weight);
    p.scales = reinterpret_cast<Act const*>(a->scales);
    p.zeros = reinterpret_cast<Act const*>(a->zeros);
    p.x = reinterpret_cast<Act const*>(a->x);
    p.bias = reinterpret_cast<Act const*>(a->bias);
    p.y = reinterpret_cast<Act*>(a->y);
    p.counters = global_reduce(pl) ? reinterpret_cast<int32_t*>(a->workspace) : nullptr;
    p.partials = global_reduce(pl) ? reinterpret_cast<float*>(a->workspace + counters_bytes(pl)) : nullptr;
    p.m = a->m; p.n = a->n; p.k = a->k;
    p.group_shift = group_shift_of(a->group_size, a->k);
    p.atoms_per_split = pl.atoms_per_split;
    p.splits = pl.splits;
    p.groups_per_split = pl.groups_per_split;
    p.segments_per_slice = pl.segments_per_slice;
    p.ldx = a->ldx; p.ldy = a->ldy;
    std::memcpy(dst, &p, sizeof(p));
    out->grid[0] = uint32_t(pl.row_blocks); out->grid[1] = uint32_t(pl.splits); out->grid[2] = 1;
    out->block[0] = Cfg::kThreads; out->block[1] = 1; out->block[2] = 1;
    out->cluster[0] = 1;    // the splits of a row block are one cluster, up to kMaxClusterSplits
    out->cluster[1] = global_reduce(pl) ? 1u : uint32_t(pl.splits);
    out->cluster[2] = 1;
    out->smem_bytes = uint32_t(pl.smem_bytes);
    out->params_bytes = uint32_t(sizeof(Params<Act>));
    return 0;
  }
};

}  // namespace mixgemm::decode

// The two faces of one decode kernel (cf. MIXGEMM_GEMM_ENTRY): the cubin's extern "C" kernel,
// and the host helper's C functions (same ABI as the GEMM kernels').
#define MIXGEMM_DECODE_STR2(x) #x
#define MIXGEMM_DECODE_STR(x) MIXGEMM_DECODE_STR2(x)
#if defined(MIXGEMM_HOST_HELPER)
#define MIXGEMM_DECODE_ENTRY(NAME, CFG, ACTIVATION)                                                 \
  using NAME##_host = mixgemm::decode::Host<CFG, ACTIVATION>;                                                   \
  extern "C" int32_t mixgemm_abi_version() { return mixgemm::abi::kAbiVersion; }                    \
  extern "C" char const* mixgemm_kernel_name() { return MIXGEMM_DECODE_STR(NAME); }                 \
  extern "C" uint32_t mixgemm_params_size() { return uint32_t(sizeof(mixgemm::decode::Params<CFG::Act>)); } \
  extern "C" uint32_t mixgemm_smem_size() { return uint32_t(CFG::kMaxSmem); }                       \
  extern "C" int mixgemm_gemm_check(mixgemm::abi::GemmArgs const* a, char* err, int errlen) {       \
    char const* why = NAME##_host::check(a);                                                        \
    if (why && err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", why);                    \
    return why ? 1 : 0;                                                                             \
  }                                                                                                 \
  extern "C" uint64_t mixgemm_gemm_workspace_size(mixgemm::abi::GemmArgs const* a) {                \
    return NAME##_host::workspace_size(a);                                                          \
  }                                                                                                 \
  extern "C" int mixgemm_gemm_prepare(mixgemm::abi::GemmArgs const* a, void* dst, uint32_t cap,      \
                                      mixgemm::abi::Launch* out, char* err, int errlen) {           \
    return NAME##_host::prepare(a, dst, cap, out, err, errlen);                                     \
  }
#else
#define MIXGEMM_DECODE_ENTRY(NAME, CFG, ACTIVATION)                                                 \
  extern "C" __global__ void __launch_bounds__(CFG::kThreads, 2)                                    \
  NAME(CUTLASS_GRID_CONSTANT mixgemm::decode::Params<CFG::Act> const params) {                      \
    mixgemm::decode::kernel_body<CFG, ACTIVATION>(params);                                          \
  }
#endif
