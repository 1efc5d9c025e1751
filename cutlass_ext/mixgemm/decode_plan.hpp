// mixgemm: the decode kernel's launch plan (split-K factor, shared memory) and argument checks:
// pure host logic, no driver call, compiled into the kernel's host helper library
// (MIXGEMM_DECODE_ENTRY in decode_kernel.hpp) and used by the grouped decode kernel's.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cuda.h>
#include <cudaTypedefs.h>   // PFN_cuTensorMapEncodeTiled

#include "mixgemm/abi.hpp"
#include "mixgemm/decode_config.hpp"

namespace mixgemm::decode {

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

// The driver's cuTensorMapEncodeTiled, handed over by mixgemm's runtime when it loads the helper
// (mixgemm_set_tensor_map_encoder, from cuGetProcAddress through cuda-python: the driver that owns
// the contexts; the helper itself links no CUDA library). Null until then.
inline PFN_cuTensorMapEncodeTiled_v12000& tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  return fn;
}

// The TMA descriptor of a [groups][n] tensor of 16-bit values (scales or zeros), read in boxes
// of box_groups x rows_per_cta. Null: a zeroed descriptor (unused). Returns why not, or nullptr.
inline char const* encode_group_rows(cute::TmaDescriptor* map, void const* base, int n, int groups, int rows_per_cta,
                                     int box_groups) {
  std::memset(map, 0, sizeof(*map));
  if (base == nullptr) return nullptr;
  auto encode = tensor_map_encoder();
  if (encode == nullptr) {
    return "no tensor-map encoder: mixgemm's runtime hands the helper the driver's cuTensorMapEncodeTiled "
           "(mixgemm_set_tensor_map_encoder) when it loads the kernel";
  }
  cuuint64_t const dims[2] = {cuuint64_t(n), cuuint64_t(groups)};
  cuuint64_t const strides[1] = {cuuint64_t(n) * 2};
  cuuint32_t const box[2] = {cuuint32_t(rows_per_cta), cuuint32_t(box_groups)};
  cuuint32_t const elem_strides[2] = {1, 1};
  CUresult const r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(base), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? nullptr
                           : "cuTensorMapEncodeTiled refused the scale / zero rows (their address must be 16-byte aligned)";
}

// The TMA descriptor of x [M][ldx] (16-bit values) as a 3-D tensor [K/64 atoms][M rows][64], read in
// boxes of `atoms` atoms x `rows` rows with the 128-byte swizzle (the decode kernel's x ring; rows past
// M and atoms past K arrive as zeros). Returns why not, or nullptr.
inline char const* encode_x_chunks(cute::TmaDescriptor* map, void const* x, int m, int k, int64_t ldx, int rows,
                                   int atoms) {
  std::memset(map, 0, sizeof(*map));
  auto encode = tensor_map_encoder();
  if (encode == nullptr) {
    return "no tensor-map encoder: mixgemm's runtime hands the helper the driver's cuTensorMapEncodeTiled "
           "(mixgemm_set_tensor_map_encoder) when it loads the kernel";
  }
  cuuint64_t const dims[3] = {64, cuuint64_t(m), cuuint64_t(k / 64)};
  cuuint64_t const strides[2] = {cuuint64_t(ldx) * 2, 128};
  cuuint32_t const box[3] = {64, cuuint32_t(rows), cuuint32_t(atoms)};
  cuuint32_t const elem_strides[3] = {1, 1, 1};
  CUresult const r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(x), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled refused x (its address and row stride must be 16-byte aligned)";
}

// The CTAs an H100 SXM (132 SMs) runs at once by CTAs per SM (1-4, shared memory and registers) and
// cluster size (1-8): cuOccupancyMaxActiveClusters times the size, measured for the 8-token decode
// kernel (a cluster sweep on an H100, docs/decode.md). Other SM counts scale it.
inline constexpr short kClusterCtas[4][8] = {{132, 132, 117, 120, 110, 102, 105, 120},
                                             {264, 264, 237, 248, 235, 234, 224, 240},
                                             {396, 396, 372, 368, 345, 372, 329, 360},
                                             {528, 528, 489, 496, 470, 474, 483, 496}};

// The split-K factors the planners try (Host::plan; the grouped kernel's up to a cluster's 8): the
// split sweep's (tools/sweep_decode.py, 1-16), then coarser ones for when nothing fits shared memory.
inline constexpr int kSplitFactors[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128};

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

  // Split-K factor, from a cost model in nanoseconds fitted to the measured split sweeps of the
  // preset layers (H100: 16 shapes x u4 / u2 / s8, at M = 1 with the 8-token kernels and at M = 16
  // with the 16-token x-ring kernels, every factor of the sweep; docs/decode.md):
  //   waves x (start + atom x the atoms on a warp's chain)     a warp's chain is serial and
  //                                                             latency-bound; the launch's CTAs
  //                                                             run in waves of the resident ones
  //   + (split K) reduce x tokens / 8 + split x splits          the cluster's wait and partials
  //   + cta x the CTAs on the busiest SM                        each CTA's copies and set-up
  //   (+ weight, scale and zero bytes / 3.49 TB/s               the stream: the same for every
  //                                                             factor, so left out)
  // with atom 147 ns for one 8-token tile and 50% more per further tile, and waves of the CTAs the
  // GPU holds at once, clusters of `splits` CTAs counted as the hardware places them (kClusterCtas:
  // on an H100 a cluster of 4 CTAs at 2 per SM holds 248 of 264). The factors tried are the
  // sweep's (1-16; coarser ones only while nothing fits shared memory), the ones measured: the
  // picks in between (5, 7, 14) split K unevenly and were never timed. Ties go to fewer splits; an
  // explicit a.splits >= 1 wins. On the sweeps it was fitted to, its picks are 2.1% slower than the
  // best factor (geometric mean; at most 1.17x; the constants were fitted before the cluster
  // waves, which took it from 3.3%), 2.4% on 18 layer shapes of other models (at most 1.20x) and
  // 2.9% on the H200's 16-token sweep (at most 1.14x); the model it replaces (in units of a warp's
  // atom step, a max of chain, bytes and issue) picked 11% (H100, at most 1.91x on 3584x3584 at
  // M = 16), 19% and 15% (H200) slower factors.
  //
  // plan_cost() is the model, also used by the grouped decode kernel's plan (its row blocks are
  // the dense ones times the experts that may have rows).
  // max_resident > 0: the CTAs per SM the kernel's registers allow, where the caller knows better
  // (the grouped 16-token kernels: two, docs/decode.md).
  static long plan_cost(long row_blocks, int splits, int atoms_per_split, int smem, int tokens, long sms,
                        long max_resident = 0) {
    // 256-thread CTAs: three at <= 80 registers (the 8- and 16-token kernels), two for the 32-token ones
    long const kMaxResident = max_resident > 0 ? max_resident : Cfg::kNTiles >= 4 ? 2 : 3;
    constexpr long kStartNs = 1050;                                    // per wave
    constexpr long kAtomNs = 147 * (2 + (Cfg::kNTiles - 1)) / 2;      // per atom of a warp's chain
    constexpr long kReduceNsPer8Tokens = 950;
    constexpr long kSplitNs = 620;
    constexpr long kCtaNs = 350;                                       // per CTA of the busiest SM
    long const fit = (228L * 1024) / (smem + 1024);
    long const resident = fit < 1 ? 1 : fit < kMaxResident ? fit : kMaxResident;
    long const apw = (atoms_per_split + Cfg::kKSlices - 1) / Cfg::kKSlices;   // atoms on one warp's chain
    long const ctas = row_blocks * splits;
    long const per_sm = (ctas + sms - 1) / sms;                               // CTAs of the busiest SM
    // the CTAs resident at once: a cluster's CTAs (the splits, up to 8) share a GPC, whose SMs do
    // not divide evenly into clusters of 3 or more
    long const at_once = splits <= Cfg::kMaxClusterSplits ? long(kClusterCtas[resident - 1][splits - 1]) * sms / 132
                                                          : resident * sms;
    long const waves = (ctas + at_once - 1) / at_once;
    long const reduce = splits == 1 ? 0 : kReduceNsPer8Tokens * tokens / 8 + kSplitNs * splits;
    return waves * (kStartNs + kAtomNs * apw) + reduce + kCtaNs * per_sm;
  }

  // The plan of split factor s for `a` (its shared memory for min(a.m, tokens) rows of x): the
  // atoms per split, the splits that gives (se <= s: K split evenly), the groups and x-sum
  // segments a split touches. Both planners (this one and the grouped kernel's) build on it.
  static Plan split_plan(abi::GemmArgs const& a, int s) {
    constexpr int KS = Cfg::kKSlices;
    int const k_atoms = a.k / 64;
    int const gshift = group_shift_of(a.group_size, a.k);
    int const aps = (k_atoms + s - 1) / s;
    int const groups = max_groups(k_atoms, aps, gshift);
    // (only the folded zero point keeps x-sums per segment; the walk over every split's slices
    // is not free, and plan() runs on every launch of a shape without a tuned split factor)
    int const segments = !Cfg::kFold ? 0 : KS == 1 ? groups : max_segments(k_atoms, aps, gshift);
    int const row_blocks = (a.n / 16 + Cfg::kStripesPerCta - 1) / Cfg::kStripesPerCta;
    return Plan{(k_atoms + aps - 1) / aps, aps, groups, segments, smem_for(a, aps, groups, segments), row_blocks};
  }

  static char const* plan(abi::GemmArgs const& a, Plan& out) {
    int const k_atoms = a.k / 64;
    long const sms = a.sm_count > 0 ? a.sm_count : 132;
    int const tokens = a.m < Cfg::kTokens ? a.m : Cfg::kTokens;
    long best_cost = -1;
    int const forced = a.splits >= 1 ? a.splits : 0;
    int const n_factors = forced ? 1 : int(sizeof(kSplitFactors) / sizeof(kSplitFactors[0]));
    int prev_se = 0;
    for (int i = 0; i < n_factors; ++i) {
      int const s = forced ? forced : kSplitFactors[i];
      if (s > k_atoms) break;
      // past 16 only while nothing has fit (long K with a full token tile: the x tile caps a CTA's k-range)
      if (!forced && s > 16 && best_cost >= 0) break;
      int const aps = (k_atoms + s - 1) / s;
      int const se = (k_atoms + aps - 1) / aps;
      bool const same = se == prev_se;                 // the same plan as the previous factor
      prev_se = se;
      if (!forced && same) continue;
      Plan const p = split_plan(a, s);
      if (p.smem_bytes <= Cfg::kMaxSmem) {
        long const cost = plan_cost(p.row_blocks, p.splits, p.atoms_per_split, p.smem_bytes, tokens, sms);
        if (best_cost < 0 || cost < best_cost) {
          best_cost = cost;
          out = p;
        }
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

  // The kernel's parameters for `a` under plan `pl` (the global reduction's counters and partials
  // carved from a.workspace); the grouped decode kernel's host starts from them too.
  static Params<Act> params(abi::GemmArgs const& a, Plan const& pl) {
    Params<Act> p{};
    p.weight = reinterpret_cast<uint8_t const*>(a.weight);
    p.scales = reinterpret_cast<Act const*>(a.scales);
    p.zeros = reinterpret_cast<Act const*>(a.zeros);
    p.x = reinterpret_cast<Act const*>(a.x);
    p.bias = reinterpret_cast<Act const*>(a.bias);
    p.y = reinterpret_cast<Act*>(a.y);
    p.counters = global_reduce(pl) ? reinterpret_cast<int32_t*>(a.workspace) : nullptr;
    p.partials = global_reduce(pl) ? reinterpret_cast<float*>(a.workspace + counters_bytes(pl)) : nullptr;
    p.m = a.m; p.n = a.n; p.k = a.k;
    p.group_shift = group_shift_of(a.group_size, a.k);
    p.atoms_per_split = pl.atoms_per_split;
    p.splits = pl.splits;
    p.groups_per_split = pl.groups_per_split;
    p.segments_per_slice = pl.segments_per_slice;
    p.ldx = a.ldx; p.ldy = a.ldy;
    return p;
  }

  static int prepare(abi::GemmArgs const* a, void* dst, uint32_t capacity, abi::Launch* out, char* err, int errlen) {
    auto fail = [&](char const* msg) {
      if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", msg);
      return 1;
    };
    Plan pl;
    if (char const* why = check(a, pl)) return fail(why);
    if (dst == nullptr || out == nullptr) return fail("null output buffer");
    using KernelArgs = ArgsOf<Cfg>;
    if (capacity < sizeof(KernelArgs)) return fail("params buffer too small");
    std::memset(out, 0, sizeof(*out));
    out->workspace_bytes = workspace_bytes(*a, pl);
    out->workspace_zero_bytes = uint32_t(counters_bytes(pl));
    if (out->workspace_bytes && a->workspace == 0) return fail("this launch needs a workspace");
    out->grid[0] = uint32_t(pl.row_blocks); out->grid[1] = uint32_t(pl.splits); out->grid[2] = 1;
    out->block[0] = Cfg::kThreads; out->block[1] = 1; out->block[2] = 1;
    out->cluster[0] = 1;    // the splits of a row block are one cluster, up to kMaxClusterSplits
    out->cluster[1] = global_reduce(pl) ? 1u : uint32_t(pl.splits);
    out->cluster[2] = 1;
    out->smem_bytes = uint32_t(pl.smem_bytes);
    out->params_bytes = uint32_t(sizeof(KernelArgs));
    // (the launch's geometry is filled first: without the driver's encoder, as on a build
    // machine, the descriptors cannot be encoded and the call fails here, its plan still readable)
    KernelArgs args;
    std::memset(&args, 0, sizeof(args));   // (the padding too: the params bytes are compared and cached)
    args.p = params(*a, pl);
    int const gshift = args.p.group_shift;
    int const groups = gshift >= 30 ? 1 : (a->k + (1 << gshift) - 1) >> gshift;
    int const bg = Cfg::box_groups(pl.groups_per_split);
    if (char const* why = encode_group_rows(&args.scales_map, args.p.scales, a->n, groups, Cfg::kRowsPerCta, bg)) {
      return fail(why);
    }
    if (char const* why = encode_group_rows(&args.zeros_map, Cfg::kHasZero ? args.p.zeros : nullptr, a->n, groups,
                                            Cfg::kRowsPerCta, bg)) {
      return fail(why);
    }
    if constexpr (Cfg::kXRing) {
      if (char const* why = encode_x_chunks(&args.x_map, args.p.x, a->m, a->k, a->ldx, Cfg::kTokens, Cfg::kXAtoms)) {
        return fail(why);
      }
    }
    std::memcpy(dst, &args, sizeof(args));
    return 0;
  }
};

}  // namespace mixgemm::decode
