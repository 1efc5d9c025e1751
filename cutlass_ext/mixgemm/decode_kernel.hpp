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
//   once and shared by the CTA's warps; ldmatrix gives the mma.sync B fragments directly. Or,
//   with an x ring (Config::kXRing: the 16-token kernels, where a resident x tile is half the
//   bytes of the int4 weight a CTA streams and bounds the CTAs per SM), x streams through a few
//   shared-memory slots of 2-4 atoms, one TMA box each (128-byte swizzle), which warp 0 refills
//   once every warp has read them (docs/decode.md);
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
// * scale / zero rows: the CTA's [groups x rows] block of the [G][N] tensors arrives as one TMA
//   box (a 2-D tensor copy; descriptors encoded by the host helper on every call) rather than a
//   bulk copy per group row: a CTA's copies are issued one after another, ~40 ns each;
// * programmatic dependent launch: the kernel requests constant operands (the scale / zero rows
//   and the first stage of each warp's ring) at once, then waits for the previous kernel in the
//   stream (griddepcontrol.wait) before it reads anything that kernel may write (the x tile; the
//   bias and the output in the epilogue). The x tile goes out before the rest of the ring: it is
//   an L2 hit, but it lands behind whatever the SM requested before it (docs/decode.md). The weights,
//   scales and zeros must therefore not be written by the kernels just before it in the stream
//   (the one before may itself be running ahead of its own predecessor): they are written when
//   a model is loaded (mixgemm.gemm's docstring says so).
//   Behind a kernel that lets it launch early (the RMSNorm kernel, at its start), its first
//   weights arrive while that kernel runs. It lets the next kernel launch
//   (griddepcontrol.launch_dependents) as each CTA ends, so that the next kernel's launch and
//   set-up overlap this one's last CTAs and memory flush. (Triggering earlier, when a CTA's
//   weight stream is done, placed the next kernel's CTAs on the SMs that happened to be free
//   and made the MLP block 6% slower: docs/decode.md.) Launched without the
//   attribute, both are no-ops.
//
// * k-slices: the W warps of a CTA are W / KS stripes x KS slices of the CTA's k-range. The KS
//   warps of a stripe stream its k-range side by side and add their float32 sums through shared
//   memory (in slice order: deterministic) before the split-K reduction and the epilogue: more
//   warps in flight, with shorter chains, without a cluster or a global reduction. Measured
//   (docs/decode.md): faster for 8-bit codes at M <= 8; one warp per stripe is
//   as fast for 4- and 2-bit codes, whose small layers are bound by fixed costs, not chains;
//
// Layout of one CTA: W warps; warp w owns stripe (W / KS) * blockIdx.x + w / KS (weight rows
// [16 * stripe, +16)) and slice w % KS of the CTA's k-atoms [blockIdx.y * atoms_per_split,
// +atoms_per_split).
#pragma once

#include <cstdint>

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm75.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm80.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/numeric_types.h"

#include "mixgemm/chunk.hpp"
#include "mixgemm/decode_config.hpp"   // Params, Config
#include "mixgemm/decode_plan.hpp"     // Plan, Host: the host helper's side
#include "mixgemm/pdl.hpp"

namespace mixgemm::decode {

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

using pdl::launch_next_grid;     // (mixgemm/pdl.hpp)
using pdl::wait_previous_grid;

// Phase trace, in experiment builds only (MIXGEMM_NVCC_FLAGS=-DMIXGEMM_DECODE_TRACE, a cache key
// of its own; tools/decode_trace.py reads it back): thread 0 of every CTA
// records %globaltimer and clock64 at the kernel's phases (TracePhase) into record
// [launch of this CTA index % kTraceSlots][CTA index], with the shape, the output pointer, the SM and
// the grid size to tell the launches apart. Without the macro the marks compile to nothing.
enum TracePhase : int {
  kEntry, kInit, kScalesIssued, kRingIssued, kGridWait, kXTile, kXSum, kScales, kFirstStage, kStream, kReduce, kExit,
  kPhases
};
#if defined(MIXGEMM_DECODE_TRACE)
constexpr int kTraceSlots = 32, kTraceCtas = 2048, kTraceFields = 3 + 2 * kPhases;
extern "C" {
__device__ unsigned long long mixgemm_decode_trace[kTraceSlots][kTraceCtas][kTraceFields];
__device__ unsigned int mixgemm_decode_trace_seq[kTraceCtas];
}
struct Trace {
  unsigned long long* rec = nullptr;
  template <class P>
  CUTLASS_DEVICE void begin(P const& p) {
    unsigned const cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);   // (z: the grouped kernel)
    if (threadIdx.x != 0 || cta >= unsigned(kTraceCtas)) return;
    unsigned const slot = atomicAdd(&mixgemm_decode_trace_seq[cta], 1u) % kTraceSlots;
    rec = mixgemm_decode_trace[slot][cta];
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    rec[0] = (unsigned long long)(unsigned(p.n)) | ((unsigned long long)(unsigned(p.m)) << 32);
    rec[1] = reinterpret_cast<unsigned long long>(p.y);
    rec[2] = smid | ((unsigned long long)(gridDim.x * gridDim.y * gridDim.z) << 32);
  }
  CUTLASS_DEVICE void mark(TracePhase e) {
    if (rec == nullptr) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    rec[3 + e] = t;
    rec[3 + kPhases + e] = clock64();
  }
};
// The grouped kernel's marks before run() (its entry and its grid wait; run()'s entry comes after
// the expert's ranking): %globaltimer by CTA index, [slot][CTA][mark], the slot as run()'s.
extern "C" {
__device__ unsigned long long mixgemm_grouped_trace[kTraceSlots][kTraceCtas][2];
__device__ unsigned int mixgemm_grouped_trace_seq[kTraceCtas];
}
CUTLASS_DEVICE void grouped_mark(int which) {
  unsigned const cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x != 0 || cta >= unsigned(kTraceCtas)) return;
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  unsigned const slot = (which == 0 ? atomicAdd(&mixgemm_grouped_trace_seq[cta], 1u)
                                    : mixgemm_grouped_trace_seq[cta] - 1u) % kTraceSlots;
  mixgemm_grouped_trace[slot][cta][which] = t;
}
#else
CUTLASS_DEVICE void grouped_mark(int) {}
struct Trace {
  template <class P>
  CUTLASS_DEVICE void begin(P const&) {}
  CUTLASS_DEVICE void mark(TracePhase) {}
};
#endif

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

// Waited: the caller has already waited for the previous grid (the grouped decode kernel reads
// its expert offsets first); then nothing is gained by requesting the constants before the x
// tile, and the x tile goes first (it is what the first MMA waits for).
// Maps: the scale / zero rows come as TMA boxes through `maps` (Args), their group rows from
// map_group0 on (the grouped kernel's descriptors cover every expert's rows, stacked: expert e's
// start at e * G); otherwise one bulk copy per group row.
// x_rows / y_rows (grouped kernel only, Waited; null: row r): the row of x that token column r
// reads, and the row of y it writes (the routed grouped kernel gathers x by token and scatters y
// by top-k assignment: grouped_decode_kernel.hpp).
template <class Cfg, Activation Act_, bool Group32, bool Waited = false, bool Maps = false>
CUTLASS_DEVICE void run(Params<typename Cfg::Act> const& p, char* smem, Args<typename Cfg::Act> const* maps = nullptr,
                        uint16_t const* x_rows = nullptr, uint16_t const* y_rows = nullptr, int map_group0 = 0) {
  using Act = typename Cfg::Act;
  using D = typename Cfg::Dequant;
  using Raw = typename Cfg::Raw;
  constexpr int NT = Cfg::kNTiles;
  constexpr int S = Cfg::kStages;
  constexpr int APS = Cfg::kAtomsPerStage;
  constexpr int KS = Cfg::kKSlices;
  constexpr Half H = half_of<Act>::value;

  Trace trace;
  trace.begin(p);
  trace.mark(kEntry);
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
  uint64_t* xbar = bars + Cfg::kWarps * S;   // the x tile
  uint64_t* sbar = xbar + 1;                  // the scale / zero rows
  uint64_t* xfull = sbar + 1;                 // x ring: slot filled (kXStages), then slot free (kXStages)
  uint64_t* xempty = xfull + Cfg::kXStages;
  constexpr int XS = Cfg::kXStages;
  constexpr int XA = Cfg::kXAtoms;
  static_assert(!Cfg::kXRing || (Maps && !Waited), "the x ring: the dense kernel (its x descriptor is in Args)");
  int const n_xchunks = (n_atoms + XA - 1) / XA;
  uint64_t* wbar = bars + warp * S;
  int* last_flag = reinterpret_cast<int*>(bars + Cfg::kBarriers);

  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kBarriers; ++i) {
      Barrier::init(&bars[i], 1);
    }
    if constexpr (Cfg::kXRing) {
      // a slot is free again once every warp that streams has read it (KS = 1: one per stripe)
      int const consumers = n_atoms > 0 ? min(Cfg::kStripesPerCta, stripes - blockIdx.x * Cfg::kStripesPerCta) : 1;
      for (int i = 0; i < XS; ++i) {
        Barrier::init(&xempty[i], consumers);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  int const n_stages = (w_atoms + APS - 1) / APS;
  uint8_t const* wsrc = p.weight + (int64_t(stripe) * k_atoms + wk0) * Cfg::kAtomBytes;
  // Stages [lo, hi) of each warp's first pass over its ring (its slice of its stripe) are
  // contiguous in the prepacked weight and in the warp's ring: one bulk copy, completing stage
  // lo's barrier, fills them all (a CTA's copies are issued one after another, ~40 ns each:
  // docs/decode.md), and the other stages' barriers complete their phase 0 at once (the stream waits for
  // stage lo first, which covers their bytes).
  auto issue_ring = [&](int lo, int hi) {
    hi = min(hi, n_stages);
    if (streams && lane == 0 && lo < hi) {
      uint32_t const bytes = uint32_t((min(hi * APS, w_atoms) - lo * APS) * Cfg::kAtomBytes);
      Barrier::arrive_and_expect_tx(&wbar[lo], bytes);
      cute::SM90_BULK_COPY_G2S::copy(wsrc + int64_t(lo) * Cfg::kStageBytes, &wbar[lo], ring + lo * Cfg::kStageBytes, bytes);
      for (int s = lo + 1; s < hi; ++s) {
        Barrier::arrive(&wbar[s]);
      }
    }
  };
  // The scale/zero rows complete one barrier (sbar), the x tile another (xbar); the copies are
  // spread over warp 0's lanes.
  int const x_bytes = n_atoms * 128;
  auto issue_scales = [&]() {   // warp 0: the barrier's byte count, then the scale / zero rows
    if constexpr (Maps) {
      // boxes of box_groups x rows per CTA from (group grp0, row row0): the full box's bytes
      // arrive whatever part of it lies outside the tensor (zero-filled)
      if (lane == 0) {
        int const copies = Cfg::scale_copies(p.groups_per_split), bg = Cfg::box_groups(p.groups_per_split);
        int const box_bytes = bg * Cfg::kRowsPerCta * int(sizeof(Act));
        Barrier::arrive_and_expect_tx(sbar, uint32_t(copies * box_bytes * (Cfg::kHasZero ? 2 : 1)));
        uint64_t const hint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);
        for (int c = 0; c < copies; ++c) {
          if constexpr (Waited) {   // (the grouped kernel: its expert's rows of the stacked descriptors)
            int const g = map_group0 + grp0 + c * bg;
            cute::SM90_TMA_LOAD_2D::copy(&maps->scales_map, sbar, hint, ss + c * bg * Cfg::kRowsPerCta, row0, g);
            if constexpr (Cfg::kHasZero) {
              cute::SM90_TMA_LOAD_2D::copy(&maps->zeros_map, sbar, hint, zs + c * bg * Cfg::kRowsPerCta, row0, g);
            }
          } else {   // (spelled out as before map_group0: the dense kernels' machine code unchanged)
            cute::SM90_TMA_LOAD_2D::copy(&maps->scales_map, sbar, hint, ss + c * bg * Cfg::kRowsPerCta, row0,
                                         grp0 + c * bg);
            if constexpr (Cfg::kHasZero) {
              cute::SM90_TMA_LOAD_2D::copy(&maps->zeros_map, sbar, hint, zs + c * bg * Cfg::kRowsPerCta, row0,
                                           grp0 + c * bg);
            }
          }
        }
      }
      return;
    }
    int const g_bytes = rows_valid * int(sizeof(Act));
    int const n_groups = grp1 - grp0;
    if (lane == 0) {
      Barrier::arrive_and_expect_tx(sbar, uint32_t(n_groups * g_bytes * (Cfg::kHasZero ? 2 : 1)));
    }
    __syncwarp();
    for (int i = lane; i < n_groups; i += 32) {
      int64_t src = int64_t(grp0 + i) * p.n + row0;
      cute::SM90_BULK_COPY_G2S::copy(p.scales + src, sbar, ss + i * Cfg::kRowsPerCta, g_bytes);
      if constexpr (Cfg::kHasZero) {
        cute::SM90_BULK_COPY_G2S::copy(p.zeros + src, sbar, zs + i * Cfg::kRowsPerCta, g_bytes);
      }
    }
  };
  auto issue_xchunk = [&](int c) {   // one lane: x ring chunk c (atoms [c XA, c XA + XA) of the CTA) into its slot
    if constexpr (Cfg::kXRing) {
      int const slot = c % XS;
      Barrier::arrive_and_expect_tx(&xfull[slot], uint32_t(Cfg::kXChunkBytes));
      uint64_t const hint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);
      cute::SM90_TMA_LOAD_3D::copy(&static_cast<ArgsX<Act> const*>(maps)->x_map, &xfull[slot], hint,
                                   xs + slot * Cfg::kXChunkBytes, 0, 0, ka0 + c * XA);
    }
  };
  auto issue_x = [&]() {   // warp 0: the x tile (the previous kernel's output)
    if constexpr (Cfg::kXRing) {
      if (lane == 0) {
        for (int c = 0; c < XS && c < n_xchunks; ++c) issue_xchunk(c);
      }
      return;
    }
    if (lane == 0) {
      Barrier::arrive_and_expect_tx(xbar, uint32_t(m_rows * x_bytes));
    }
    __syncwarp();
    for (int r = lane; r < m_rows; r += 32) {
      int64_t src = r;
      if constexpr (Waited) {
        if (x_rows) src = x_rows[r];
      }
      cute::SM90_BULK_COPY_G2S::copy(p.x + src * p.ldx + int64_t(ka0) * 64, xbar, xs + r * x_pitch, x_bytes);
    }
  };
  // Constant operands first: the scale rows and the weight ring do not come from the previous
  // kernel, so some are requested before the grid wait. When the previous kernel lets this one
  // launch early (the RMSNorm kernel does at its start), they are in flight while it runs; only
  // the x tile waits for it. But the x tile, an L2 hit, lands behind whatever the SM requested
  // before it (the SM's share of the DRAM bandwidth is ~23 KB per us): so only the scale rows
  // and each warp's first stage go before the wait, and the rest of the ring after the x tile
  // (docs/decode.md: qkv's x tile landed 0.5 instead of 1.4 us after the wait).
  __syncthreads();
  trace.mark(kInit);
  if constexpr (Waited) {
    if (warp == 0) { issue_x(); issue_scales(); }
    // One copy per stage, spelled out: through issue_ring (per stage or all at once), ptxas gave
    // this kernel 16 more registers and mixtral's MoE layer took 1-3% longer (docs/decode.md).
    if (streams && lane == 0) {
      for (int s = 0; s < S && s < n_stages; ++s) {
        int const atoms = min(APS, w_atoms - s * APS);
        Barrier::arrive_and_expect_tx(&wbar[s], uint32_t(atoms * Cfg::kAtomBytes));
        cute::SM90_BULK_COPY_G2S::copy(wsrc + int64_t(s) * Cfg::kStageBytes, &wbar[s], ring + s * Cfg::kStageBytes,
                                       atoms * Cfg::kAtomBytes);
      }
    }
  } else {
    if (warp == 0) issue_scales();
    trace.mark(kScalesIssued);
    issue_ring(0, 1);
    trace.mark(kRingIssued);
    wait_previous_grid();
    trace.mark(kGridWait);
    if (warp == 0) issue_x();
    __syncthreads();
    issue_ring(1, S);
  }

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
  // With the x ring: the same rows and columns in a slot's swizzled atom (tokens rows of 128 bytes,
  // 16-byte unit u of row r at u ^ (line of r % 8): the 128-byte swizzle, a function of the
  // address; rows past M are the box's zero fill), as offsets from the atom.
  uint32_t xs_row[NT];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < NT; ++i) {
    if constexpr (Cfg::kXRing) {
      int const line = int(cute::cast_smem_ptr_to_uint(xs) >> 7) + lane % 8;
      xs_row[i] = uint32_t((8 * i + lane % 8) * 128 + (((lane / 8) ^ (line % 8)) << 4));
    } else {
      int const r = min(8 * i + lane % 8, p.m - 1);
      xs_row[i] = cute::cast_smem_ptr_to_uint(xs) + r * x_pitch + (lane / 8) * 16;
    }
  }
  // (the x tile starts at the CTA's first atom; the warp's atoms at wa0)

  if constexpr (!Cfg::kXRing) {
    Barrier::wait(xbar, 0);
  }
  trace.mark(kXTile);

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
  trace.mark(kXSum);
  Barrier::wait(sbar, 0);
  trace.mark(kScales);

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
    // The x ring's running state: the current chunk, its slot and phase, and its atoms read.
    int xchunk = 0, xslot = 0, x_read = 0;
    uint32_t xphase = 0;
    uint32_t const xs_base = cute::cast_smem_ptr_to_uint(xs);
    // Whole-atom groups: atoms per group, and the first atom of the next group counted from the
    // current stage's first atom (a group spanning K, shift 30, never ends inside the range).
    int const gshift_atoms = Group32 ? 0 : p.group_shift - 6;
    int next_group = Group32 ? 0 : ((sgrp0 + 1) << gshift_atoms) - wk0;
    // One stage of the ring: APS atoms (Full), or the short last one.
    auto stage_body = [&](int s, auto full_const) {
      constexpr bool kFull = decltype(full_const)::value;
      Barrier::wait(&wbar[slot], phase);
      if (s == 0) trace.mark(kFirstStage);
      if constexpr (Cfg::kXRing) {
        if (x_read == 0) Barrier::wait(&xfull[xslot], xphase);
      }
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
            if constexpr (Cfg::kXRing) {
              uint32_t const addr = xs_base + xslot * Cfg::kXChunkBytes + (x_read + a) * Cfg::kXAtomBytes + xs_row[i];
              ldsm_x4(addr, b[i][0][0], b[i][0][1], b[i][1][0], b[i][1][1]);
              ldsm_x4(addr ^ 64u, b[i][2][0], b[i][2][1], b[i][3][0], b[i][3][1]);   // units 4-7: u ^ 4
            } else {
              uint32_t const addr = xs_row[i] + (wa0 + la) * 128;
              ldsm_x4(addr, b[i][0][0], b[i][0][1], b[i][1][0], b[i][1][1]);
              ldsm_x4(addr + 64, b[i][2][0], b[i][2][1], b[i][3][0], b[i][3][1]);
            }
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
      if constexpr (Cfg::kXRing) {
        // (a chunk is whole stages; the last, short chunk is never released: nothing refills it)
        x_read += APS;
        if (x_read == XA) {
          if (lane == 0) Barrier::arrive(&xempty[xslot]);
          // warp 0 refills the slot of the chunk before this one (every warp done with it) with
          // the chunk XS further: the slot of its own last chunk may still be read by the others
          if (warp == 0 && xchunk >= 1 && xchunk - 1 + XS < n_xchunks) {
            int const prev = xchunk - 1;
            Barrier::wait(&xempty[prev % XS], uint32_t((prev / XS) & 1));
            if (lane == 0) issue_xchunk(prev + XS);
          }
          x_read = 0;
          ++xchunk;
          xslot = xslot + 1 == XS ? 0 : xslot + 1;
          xphase ^= xslot == 0 ? 1u : 0u;
        }
      }
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
  trace.mark(kStream);

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
          int64_t dst = tok;
          if constexpr (Waited) {
            if (y_rows) dst = y_rows[tok];
          }
          put(i, e, dst * p.ldy);
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
    trace.mark(kReduce);
    finish(true);
    trace.mark(kExit);
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
    trace.mark(kReduce);
    finish(mine);
    trace.mark(kExit);
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
  if (!*last_flag) {
    trace.mark(kReduce);
    trace.mark(kExit);
    return;
  }
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
  trace.mark(kReduce);
  finish(true);
  if (threadIdx.x == 0) {
    p.counters[blockIdx.x] = 0;   // leave the counter as found: zero
  }
  trace.mark(kExit);
}

template <class Cfg, Activation A>
CUTLASS_DEVICE void kernel_body(ArgsOf<Cfg> const& args) {
  extern __shared__ __align__(128) char smem[];
  if (args.p.group_shift == 5) {
    run<Cfg, A, true, false, true>(args.p, smem, &args);
  } else {
    run<Cfg, A, false, false, true>(args.p, smem, &args);
  }
  launch_next_grid();   // this CTA is done: the next kernel may launch once every CTA is
}

#endif  // device

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
  extern "C" uint32_t mixgemm_params_size() { return uint32_t(sizeof(mixgemm::decode::ArgsOf<CFG>)); }     \
  extern "C" uint32_t mixgemm_smem_size() { return uint32_t(CFG::kMaxSmem); }                       \
  extern "C" int mixgemm_gemm_check(mixgemm::abi::GemmArgs const* a, char* err, int errlen) {       \
    char const* why = NAME##_host::check(a);                                                        \
    if (why && err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", why);                    \
    return why ? 1 : 0;                                                                             \
  }                                                                                                 \
  extern "C" uint64_t mixgemm_gemm_workspace_size(mixgemm::abi::GemmArgs const* a) {                \
    return NAME##_host::workspace_size(a);                                                          \
  }                                                                                                 \
  extern "C" void mixgemm_set_tensor_map_encoder(void* fn) {                                         \
    mixgemm::decode::tensor_map_encoder() = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn); \
  }                                                                                                 \
  extern "C" int mixgemm_gemm_prepare(mixgemm::abi::GemmArgs const* a, void* dst, uint32_t cap,      \
                                      mixgemm::abi::Launch* out, char* err, int errlen) {           \
    return NAME##_host::prepare(a, dst, cap, out, err, errlen);                                     \
  }
#else
#define MIXGEMM_DECODE_ENTRY(NAME, CFG, ACTIVATION)                                                 \
  extern "C" __global__ void __launch_bounds__(CFG::kThreads, 2)                                    \
  NAME(CUTLASS_GRID_CONSTANT mixgemm::decode::ArgsOf<CFG> const params) {                           \
    mixgemm::decode::kernel_body<CFG, ACTIVATION>(params);                                          \
  }
#endif

