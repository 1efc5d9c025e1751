// mixgemm: the grouped decode GEMM over experts (mixture of experts), built on the decode kernel.
//
// y[rows of e] = x[rows of e] @ dequant(W_e)^T for every expert e, where x's rows are sorted by
// expert and expert e owns rows [offsets[e], offsets[e + 1]). The weights are E prepacked
// weights of one shape stacked (python/mixgemm/experts.py): expert e's codes, scales and zeros
// are at a fixed stride from expert 0's.
//
// Grid: (row blocks, k-splits, min(E, T)); the k-splits of a row block are one cluster, as in the
// dense decode kernel. Grid index z is a rank among the experts that have rows: at most min(E, T)
// of them do (T = the rows of x), so at decode (T = tokens x top-k, a few) the launch has a few
// CTAs per row block instead of one per expert, most of which would only read the offsets and
// exit (measured: 128 experts x 12 row blocks x 2 splits for 8 rows). A CTA finds its expert from
// the offsets in device memory (after the programmatic-launch wait: the routing kernels that
// wrote them may still be finishing), so a launch needs no host sync and can be captured in a
// CUDA graph with routing that changes between replays. A CTA whose rank has no expert exits at
// once, before it reads any weight; every CTA of a cluster has the same rank, hence the same
// expert and row count, so they exit (and loop) together.
//
// The body is the dense decode kernel's run() (decode_kernel.hpp), unchanged, called on the
// expert's pointers: once per tile of at most 8 * NTiles rows. Its scale / zero rows come as the
// dense kernel's TMA boxes, from descriptors of every expert's rows stacked ([E * G][N]: one copy
// per tensor where one bulk copy per group row took ~40 ns each, docs/moe.md). An expert with more
// rows than the tile streams its weights once per tile (the row loop: correct at any token count,
// but the many-tokens regime wants the sm90 grouped GEMM instead). Between tiles the CTA's
// mbarriers are invalidated and run() initialises them again. The global split-K reduction (more
// than 8 splits) is not used here: its counters would race between tiles.
//
// Routed mode (Params::ids set; at decode sizes, at most kThreads top-k assignments): no offsets
// and no sorted copy of x. Every CTA ranks the top-k ids itself (routed_expert: one id per
// thread, a bitmask of the experts with rows, two ballots), which takes the routing kernel's
// launch out of a fused MoE layer (docs/moe.md). The expert of rank z, its
// first sorted row (the assignments with a smaller id) and its assignments in flat order
// (token * topk + slot, the stable order of the routing kernel) come out of it; x's rows are
// read either sorted (x + first) or by token (x[flat / topk]: gate/up reads the layer's input),
// and y's rows written either sorted (y + first: gate/up's output, down's input) or by flat
// index (down's output, which the combine kernel reads by assignment). An id outside [0, E) is
// dropped: no CTA reads or writes its rows.
#pragma once

#include "mixgemm/decode_kernel.hpp"

namespace mixgemm::grouped_decode {

using mixgemm::Activation;

template <class Act>
struct Params {
  // base.p: expert 0's weight, scales, zeros, bias; x and y of row 0; m unused. base.scales_map /
  // zeros_map: every expert's scale / zero rows as one 2-D tensor [E * G][N] (the experts' [G][N]
  // stacked), read in the dense kernel's boxes from row e * G (a box running past an expert's
  // last group reads the next expert's rows or zeros, which no MMA uses)
  decode::Args<Act> base;
  int32_t const* offsets;     // [experts + 1] int32 on the device: expert e owns rows [offsets[e], offsets[e+1])
  int64_t weight_stride;      // bytes of one expert's prepacked codes
  int64_t group_stride;       // elements of one expert's scales (and zeros)
  int64_t bias_stride;        // elements of one expert's bias (N), 0 without a bias
  int32_t experts;
  int32_t expert_groups;      // G: the group rows of one expert
  // routed mode (ids non-null; offsets unused): the top-k ids, and where x and y rows live
  void const* ids;            // [assignments] int32 or int64 expert ids, flat index token * topk + slot
  int32_t ids_bytes;          // 4 or 8
  int32_t assignments;        // T * topk (<= the kernel's threads)
  int32_t topk;
  int32_t x_by_token;         // 1: x is [T, K], an assignment reads x[flat / topk]; 0: x's rows sorted
  int32_t y_by_assignment;    // 1: an assignment's output row is its flat index; 0: y's rows sorted
};

// The most experts the routed mode ranks (a bitmask of 16 words).
constexpr int kRoutedMaxExperts = 512;

// Shared memory of the routed mode: the experts with rows, per-warp counts, and the CTA's expert's
// assignments (flat index, and its token for the gather of x).
template <int Threads>
struct RoutedSmem {
  uint32_t present[kRoutedMaxExperts / 32];
  int32_t below[Threads / 32];   // per warp: its ids below the CTA's expert
  int32_t equal[Threads / 32];   // per warp: its ids equal to it
  int32_t expert;
  uint16_t token[Threads];
  uint16_t flat[Threads];
};

#if defined(__CUDACC__) && !defined(MIXGEMM_HOST_HELPER)

// The expert of rank `rank` among those with rows (offsets[e + 1] > offsets[e]), in expert order,
// with its first row and row count: {e, first, rows}, or {-1, 0, 0} if fewer experts have rows.
// Called by all 32 lanes of one warp. The experts are taken 256 at a time (one pass for E <= 256):
// lane l loads the 9 offsets around its 8 experts at once (independent loads, one round trip),
// the warp's prefix sum of the lanes' counts finds the lane holding the rank, and that lane picks
// the expert from its registers.
CUTLASS_DEVICE int3 expert_of_rank(int32_t const* offsets, int experts, int rank, int lane) {
  constexpr int kPer = 8;
  int found = -1, first = 0, rows = 0;
  int seen = 0;   // experts with rows in the earlier passes (the same in every lane)
  for (int base = 0; base < experts; base += 32 * kPer) {
    int const lo = base + lane * kPer;
    int v[kPer + 1];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i <= kPer; ++i) {
      v[i] = lo + i <= experts ? offsets[lo + i] : 0;   // offsets holds experts + 1 entries
    }
    int active = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kPer; ++i) {
      active += (lo + i < experts && v[i + 1] > v[i]) ? 1 : 0;
    }
    int incl = active;
    CUTLASS_PRAGMA_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      int const u = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += u;
    }
    int const excl = seen + incl - active;
    if (rank >= excl && rank < excl + active) {
      int want = rank - excl;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kPer; ++i) {
        if (lo + i < experts && v[i + 1] > v[i]) {
          if (want == 0) {
            found = lo + i;
            first = v[i];
            rows = v[i + 1] - v[i];
          }
          --want;
        }
      }
    }
    seen += __shfl_sync(0xffffffffu, incl, 31);
    if (seen > rank) break;   // warp-uniform: the rank was in this pass
  }
  unsigned const holder = __ballot_sync(0xffffffffu, found >= 0);
  if (holder == 0) return make_int3(-1, 0, 0);
  int const src = __ffs(holder) - 1;
  return make_int3(__shfl_sync(0xffffffffu, found, src), __shfl_sync(0xffffffffu, first, src),
                   __shfl_sync(0xffffffffu, rows, src));
}

// Routed mode: the CTA's expert, {e, first sorted row, rows}, or {-1, 0, 0}; its assignments' flat
// indices and tokens in s.flat / s.token (flat order). With a grid of E along z (by_rank false)
// the expert is blockIdx.z; else it is the one of rank `rank` among those the ids name, found from
// a bitmask of them (s.present, zeroed before a barrier). Called by every thread of the CTA
// (barriers: two, four by rank), after the grid wait.
template <int Threads, class Act>
CUTLASS_DEVICE int3 routed_expert(Params<Act> const& gp, int rank, bool by_rank, RoutedSmem<Threads>& s) {
  int const tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  int id = -1;
  if (tid < gp.assignments) {
    int64_t const v = gp.ids_bytes == 8 ? static_cast<int64_t const*>(gp.ids)[tid]
                                        : int64_t(static_cast<int32_t const*>(gp.ids)[tid]);
    if (v >= 0 && v < gp.experts) id = int(v);
  }
  int e = rank;
  if (by_rank) {
    // the mask (one shared atomic per id: measured 1-2 us faster per fused_moe call at 1-4 tokens
    // on qwen3-30b-a3b than one atomic per warp and word with every warp scanning the mask), then
    // the rank-th set bit of it in expert order, by the first warp
    if (id >= 0) atomicOr(&s.present[id >> 5], 1u << (id & 31));
    __syncthreads();
    if (warp == 0) {
      uint32_t mask = lane < kRoutedMaxExperts / 32 ? s.present[lane] : 0u;
      int const c = __popc(mask);
      int incl = c;
      CUTLASS_PRAGMA_UNROLL
      for (int d = 1; d < 32; d *= 2) {
        int const u = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += u;
      }
      bool const here = rank >= incl - c && rank < incl;
      if (here) {
        for (int j = rank - (incl - c); j > 0; --j) mask &= mask - 1;   // clear the lower set bits
        s.expert = lane * 32 + __ffs(mask) - 1;
      }
      if (__ballot_sync(0xffffffffu, here) == 0 && lane == 0) s.expert = -1;
    }
    __syncthreads();
    e = s.expert;
    if (e < 0) return make_int3(-1, 0, 0);   // (uniform)
  }
  unsigned const below = __ballot_sync(0xffffffffu, id >= 0 && id < e);
  unsigned const equal = __ballot_sync(0xffffffffu, id == e);
  if (lane == 0) {
    s.below[warp] = __popc(below);
    s.equal[warp] = __popc(equal);
  }
  __syncthreads();
  int first = 0, count = 0, before = 0;
  CUTLASS_PRAGMA_UNROLL
  for (int w = 0; w < Threads / 32; ++w) {
    first += s.below[w];
    count += s.equal[w];
    before += w < warp ? s.equal[w] : 0;
  }
  if (id == e) {
    int const pos = before + __popc(equal & ((1u << lane) - 1u));
    s.flat[pos] = uint16_t(tid);
    s.token[pos] = uint16_t(tid / gp.topk);
  }
  __syncthreads();
  return make_int3(e, first, count);
}

template <class Cfg, Activation A>
CUTLASS_DEVICE void kernel_body(Params<typename Cfg::Act> const& gp) {
  using Act = typename Cfg::Act;
  extern __shared__ __align__(128) char smem[];
  __shared__ RoutedSmem<Cfg::kThreads> routed;
  bool const is_routed = gp.ids != nullptr;
  bool const by_rank = gridDim.z != unsigned(gp.experts);
  decode::grouped_mark(0);   // (trace builds only)
  if (is_routed && by_rank) {
    if (threadIdx.x < kRoutedMaxExperts / 32) routed.present[threadIdx.x] = 0u;
    __syncthreads();   // (before the wait: off the critical path)
  }
  decode::wait_previous_grid();   // the offsets (or the ids) may come from the kernel before this one
  decode::grouped_mark(1);
  // With a grid of E along z, blockIdx.z is the expert. With fewer (min(E, rows) < E: no CTA is
  // launched for most empty experts), blockIdx.z is the rank of the CTA's expert among the
  // experts that have rows, found by the first warp from the offsets; a rank past the last such
  // expert has nothing to do. Routed: the rank among the experts the ids name, from the ids.
  int e, first, count;
  if (is_routed) {
    int3 const efr = routed_expert<Cfg::kThreads>(gp, int(blockIdx.z), by_rank, routed);
    e = efr.x;
    first = efr.y;
    count = efr.z;
  } else if (!by_rank) {
    e = int(blockIdx.z);
    first = gp.offsets[e];
    count = gp.offsets[e + 1] - first;
  } else {
    __shared__ int3 expert_rows;
    if (threadIdx.x < 32) {
      int3 const efr = expert_of_rank(gp.offsets, gp.experts, int(blockIdx.z), int(threadIdx.x));
      if (threadIdx.x == 0) expert_rows = efr;
    }
    __syncthreads();
    e = expert_rows.x;
    first = expert_rows.y;
    count = expert_rows.z;
  }
  if (count > 0) {
    // The expert's tile parameters live in shared memory, not registers: run() reads them
    // where the dense kernel reads its grid constants (a register copy of the struct measured
    // +30 registers and spills under the 128-register bound of two CTAs per SM).
    __shared__ decode::Params<Act> tile;
    if (threadIdx.x == 0) {
      tile = gp.base.p;
      tile.weight += int64_t(e) * gp.weight_stride;
      tile.scales += int64_t(e) * gp.group_stride;
      if (tile.zeros) tile.zeros += int64_t(e) * gp.group_stride;
      if (tile.bias) tile.bias += int64_t(e) * gp.bias_stride;
      if (!(is_routed && gp.x_by_token)) tile.x += int64_t(first) * tile.ldx;
      if (!(is_routed && gp.y_by_assignment)) tile.y += int64_t(first) * tile.ldy;
      tile.m = min(Cfg::kTokens, count);
    }
    __syncthreads();
    // routed: the tile's rows of x by token, of y by assignment (advanced by a tile per pass)
    uint16_t const* x_rows = is_routed && gp.x_by_token ? routed.token : nullptr;
    uint16_t const* y_rows = is_routed && gp.y_by_assignment ? routed.flat : nullptr;
    for (int t0 = 0; t0 < count; t0 += Cfg::kTokens) {
      if (gp.base.p.group_shift == 5) {
        decode::run<Cfg, A, true, true, true>(tile, smem, &gp.base, x_rows, y_rows, e * gp.expert_groups);
      } else {
        decode::run<Cfg, A, false, true, true>(tile, smem, &gp.base, x_rows, y_rows, e * gp.expert_groups);
      }
      if (t0 + Cfg::kTokens < count) {
        // another tile: every thread is done with this one's barriers and shared memory
        // (run() waited for every copy it issued); invalidate the barriers where this tile's
        // carve-up put them, so that the next run() may initialise them afresh
        __syncthreads();
        if (threadIdx.x == 0) {
          auto const carve = Cfg::carve(tile.m, tile.atoms_per_split, tile.groups_per_split, tile.segments_per_slice);
          uint64_t* bars = reinterpret_cast<uint64_t*>(smem + carve.bars);
          for (int i = 0; i < Cfg::kBarriers; ++i) {
            decode::Barrier::invalidate(&bars[i]);
          }
          if (!x_rows) tile.x += int64_t(Cfg::kTokens) * tile.ldx;
          if (!y_rows) tile.y += int64_t(Cfg::kTokens) * tile.ldy;
          tile.m = min(Cfg::kTokens, count - (t0 + Cfg::kTokens));
        }
        if (x_rows) x_rows += Cfg::kTokens;
        if (y_rows) y_rows += Cfg::kTokens;
        __syncthreads();
      }
    }
  }
  decode::launch_next_grid();
}

#endif  // device

// ---------------------------------------------------------------------------------------------
// Host side: checks and the launch plan. a.m is the total row count T of x (all experts): the
// host knows it without a sync, and at most min(E, T) experts have rows.
// ---------------------------------------------------------------------------------------------
// The CTAs per SM a kernel is compiled for (__launch_bounds__): three for the 8-token tile, whose
// waves the planner counts at three resident CTAs (at most 80 registers: decode_plan.hpp); two
// otherwise. (Bounded by two, ptxas gave the 2-bit swiglu kernel 82 registers once its scale rows
// came as TMA boxes, and two CTAs per SM: docs/moe.md.)
template <class Cfg>
constexpr int kMinCtasPerSm = Cfg::kTokens == 8 ? 3 : 2;

// The routed mode's arguments (mixgemm_grouped_routed_prepare).
struct Routed {
  uint64_t ids;              // device pointer to the top-k ids [T * topk]
  int32_t ids_bytes;         // 4 (int32) or 8 (int64)
  int32_t topk;
  int32_t x_by_token;        // x is [T, K]: an assignment reads its token's row
  int32_t y_by_assignment;   // an assignment's output row is its flat index token * topk + slot
};

template <class Cfg, Activation A = Activation::kNone>
struct Host {
  using Act = typename Cfg::Act;
  using Dense = decode::Host<Cfg, A>;
  // dynamic shared memory: the kernel's static expert tile parameters come off the budget
  static constexpr int kMaxDynamicSmem =
      Cfg::kMaxSmem - int(sizeof(decode::Params<Act>)) - int(sizeof(RoutedSmem<Cfg::kThreads>)) - 128
#if defined(MIXGEMM_DECODE_TRACE)
      - 256   // (the trace build's kernels hold a little more static shared memory)
#endif
      ;

  // The dense checks on one tile of the problem (at most the token tile), plus the grouped ones.
  static char const* why_not(abi::GemmArgs const& a, uint64_t offsets, int32_t experts, bool routed = false) {
    if (a.m < 1) return "M (the rows of x, all experts together) must be >= 1";
    if (experts < 1) return "the number of experts must be >= 1";
    if (experts > 65535) return "at most 65535 experts";
    if (!routed && (offsets == 0 || offsets % 4))
      return "expert_offsets must be a non-null, 4-byte aligned int32 pointer";
    if (a.splits > Cfg::kMaxClusterSplits)
      return "a grouped decode kernel splits K at most 8 ways (one cluster)";
    abi::GemmArgs tile = a;
    tile.m = a.m < Cfg::kTokens ? a.m : Cfg::kTokens;
    return Dense::why_not(tile);
  }

  // Split-K, up to the 8 splits one cluster holds, within shared memory; an explicit a.splits >= 1
  // wins. The dense kernel's cost model (decode_plan.hpp Host::plan_cost) over the row blocks of
  // the experts that can have rows (at most min(E, T)), among the dense planner's factors, with
  // the kernel's own resident CTAs per SM (kMinCtasPerSm: the 16-token grouped kernels hold 85-106
  // registers, two CTAs, where the model's default counts three). (The rule before the model, the
  // fewest splits that put a CTA on every SM, split mixtral-8x7b's two experts at one token 1 way
  // for gate/up and 3 for down where 2 and 2 took 13-30% less time, docs/moe.md; with three resident
  // CTAs the model split the 16-token launches too finely, and 8-bit codes kept that rule until
  // the residency was counted: mixtral at 24 tokens 18-23% faster, 8-bit codes 3-7%, docs/moe.md.)
  static char const* plan(abi::GemmArgs const& a, int32_t experts, decode::Plan& out) {
    int const k_atoms = a.k / 64;
    int const row_blocks = (a.n / 16 + Cfg::kStripesPerCta - 1) / Cfg::kStripesPerCta;
    long const sms = a.sm_count > 0 ? a.sm_count : 132;
    long const active = experts < a.m ? experts : a.m;
    long const blocks = long(row_blocks) * active;
    int const tokens = a.m < Cfg::kTokens ? a.m : Cfg::kTokens;
    abi::GemmArgs tile = a;
    tile.m = Cfg::kTokens;   // shared memory for a whole tile of rows
    int const max_splits = k_atoms < Cfg::kMaxClusterSplits ? k_atoms : Cfg::kMaxClusterSplits;
    if (a.splits >= 1) {
      if (a.splits > k_atoms) return "a split of K takes at least one 64-column atom per part: more parts than K has atoms";
      if (a.splits <= max_splits) {
        out = Dense::split_plan(tile, a.splits);
        if (out.smem_bytes <= kMaxDynamicSmem) return nullptr;
      }
      return "this split of K does not fit this grouped decode kernel's shared memory";
    }
    long best = -1;
    int prev_se = 0;
    for (int s : decode::kSplitFactors) {
      if (s > max_splits) break;
      decode::Plan const p = Dense::split_plan(tile, s);
      bool const same = p.splits == prev_se;   // the same plan as the previous factor
      prev_se = p.splits;
      if (same || p.smem_bytes > kMaxDynamicSmem) continue;
      long const cost = Dense::plan_cost(blocks, p.splits, p.atoms_per_split, p.smem_bytes, tokens, sms,
                                         kMinCtasPerSm<Cfg>);
      if (best < 0 || cost < best) {
        best = cost;
        out = p;
      }
    }
    if (best >= 0) return nullptr;
    return "no split of K (at most 8) fits this grouped decode kernel's shared memory";
  }

  static char const* check(abi::GemmArgs const* a, uint64_t offsets, int32_t experts, decode::Plan& pl,
                           bool routed = false) {
    if (a == nullptr) return "null argument";
    if (char const* why = why_not(*a, offsets, experts, routed)) return why;
    return plan(*a, experts, pl);
  }

  // The routed mode's checks (a.m: the assignments T * topk; x [T, K] when x_by_token, else
  // [a.m, K] sorted; y [a.m, N]).
  static char const* why_not_routed(abi::GemmArgs const& a, Routed const& r, int32_t experts) {
    if (r.ids == 0 || (r.ids_bytes != 4 && r.ids_bytes != 8) || r.ids % uint64_t(r.ids_bytes == 8 ? 8 : 4))
      return "the routed grouped kernel takes a non-null, aligned int32 or int64 pointer to the top-k ids";
    if (r.topk < 1 || a.m % r.topk) return "the rows (T * topk) must be a multiple of topk >= 1";
    if (a.m > Cfg::kThreads) return "the routed grouped kernel ranks at most its threads' number of assignments";
    if (experts > kRoutedMaxExperts) return "the routed grouped kernel takes at most 512 experts";
    return nullptr;
  }

  static int prepare(abi::GemmArgs const* a, uint64_t offsets, int32_t experts, void* dst, uint32_t capacity,
                     abi::Launch* out, char* err, int errlen, Routed const* routed = nullptr) {
    auto fail = [&](char const* msg) {
      if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", msg);
      return 1;
    };
    decode::Plan pl;
    if (routed && a) {
      if (char const* why = why_not_routed(*a, *routed, experts)) return fail(why);
    }
    if (char const* why = check(a, offsets, experts, pl, routed != nullptr)) return fail(why);
    if (dst == nullptr || out == nullptr) return fail("null output buffer");
    if (capacity < sizeof(Params<Act>)) return fail("params buffer too small");
    std::memset(out, 0, sizeof(*out));
    out->grid[0] = uint32_t(pl.row_blocks); out->grid[1] = uint32_t(pl.splits); out->grid[2] = uint32_t(experts < a->m ? experts : a->m);   // at most min(E, rows) experts have rows
    out->block[0] = Cfg::kThreads; out->block[1] = 1; out->block[2] = 1;
    out->cluster[0] = 1; out->cluster[1] = uint32_t(pl.splits); out->cluster[2] = 1;
    out->smem_bytes = uint32_t(pl.smem_bytes);
    out->params_bytes = uint32_t(sizeof(Params<Act>));
    // (the launch's geometry is filled first: without the driver's encoder, as on a build machine,
    // the descriptors cannot be encoded and the call fails below, its plan still readable)
    Params<Act> gp;
    std::memset(&gp, 0, sizeof(gp));   // (the padding too: the params bytes are compared and cached)
    gp.base.p = Dense::params(*a, pl);   // (at most a cluster's splits: no workspace)
    gp.base.p.m = Cfg::kTokens;          // a tile's rows; each CTA sets its expert's count
    gp.offsets = reinterpret_cast<int32_t const*>(offsets);
    gp.weight_stride = int64_t(a->n / 16) * (a->k / 64) * Cfg::kAtomBytes;
    gp.expert_groups = a->k / a->group_size;
    gp.group_stride = int64_t(gp.expert_groups) * a->n;
    gp.bias_stride = a->bias ? a->n : 0;
    gp.experts = experts;
    int const rows = experts * gp.expert_groups, bg = Cfg::box_groups(pl.groups_per_split);
    if (char const* why = decode::encode_group_rows(&gp.base.scales_map, gp.base.p.scales, a->n, rows,
                                                    Cfg::kRowsPerCta, bg)) {
      return fail(why);
    }
    if (char const* why = decode::encode_group_rows(&gp.base.zeros_map, Cfg::kHasZero ? gp.base.p.zeros : nullptr,
                                                    a->n, rows, Cfg::kRowsPerCta, bg)) {
      return fail(why);
    }
    if (routed) {
      gp.offsets = nullptr;
      gp.ids = reinterpret_cast<void const*>(routed->ids);
      gp.ids_bytes = routed->ids_bytes;
      gp.assignments = a->m;
      gp.topk = routed->topk;
      gp.x_by_token = routed->x_by_token ? 1 : 0;
      gp.y_by_assignment = routed->y_by_assignment ? 1 : 0;
    }
    std::memcpy(dst, &gp, sizeof(gp));
    return 0;
  }
};

}  // namespace mixgemm::grouped_decode

// The two faces of one grouped decode kernel: the cubin's kernel, and the host helper's C
// functions. The helper has the common ones (mixgemm_gemm_check checks a call's arguments but
// for the expert offsets; mixgemm_gemm_prepare refuses: a grouped launch needs the offsets) and
// mixgemm_grouped_prepare, which takes the device pointer of the expert offsets and E.
#if defined(MIXGEMM_HOST_HELPER)
#define MIXGEMM_GROUPED_DECODE_ENTRY(NAME, CFG, ACTIVATION)                                        \
  using NAME##_host = mixgemm::grouped_decode::Host<CFG, ACTIVATION>;                               \
  extern "C" int32_t mixgemm_abi_version() { return mixgemm::abi::kAbiVersion; }                    \
  extern "C" char const* mixgemm_kernel_name() { return MIXGEMM_DECODE_STR(NAME); }                 \
  extern "C" uint32_t mixgemm_params_size() {                                                       \
    return uint32_t(sizeof(mixgemm::grouped_decode::Params<CFG::Act>));                             \
  }                                                                                                 \
  extern "C" uint32_t mixgemm_smem_size() { return uint32_t(NAME##_host::kMaxDynamicSmem); }       \
  extern "C" void mixgemm_set_tensor_map_encoder(void* fn) {                                         \
    mixgemm::decode::tensor_map_encoder() = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn); \
  }                                                                                                 \
  extern "C" int mixgemm_gemm_check(mixgemm::abi::GemmArgs const* a, char* err, int errlen) {       \
    mixgemm::decode::Plan pl;                                                                       \
    char const* why = NAME##_host::check(a, 16, 1, pl);                                             \
    if (why && err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", why);                    \
    return why ? 1 : 0;                                                                             \
  }                                                                                                 \
  extern "C" uint64_t mixgemm_gemm_workspace_size(mixgemm::abi::GemmArgs const*) { return 0; }      \
  extern "C" int mixgemm_gemm_prepare(mixgemm::abi::GemmArgs const*, void*, uint32_t,               \
                                      mixgemm::abi::Launch*, char* err, int errlen) {               \
    if (err && errlen > 0)                                                                          \
      std::snprintf(err, size_t(errlen), "%s", "a grouped kernel launches with mixgemm_grouped_prepare"); \
    return 1;                                                                                       \
  }                                                                                                 \
  extern "C" int mixgemm_grouped_prepare(mixgemm::abi::GemmArgs const* a, uint64_t offsets, int32_t experts, \
                                         void* dst, uint32_t cap, mixgemm::abi::Launch* out, char* err, \
                                         int errlen) {                                              \
    return NAME##_host::prepare(a, offsets, experts, dst, cap, out, err, errlen);                   \
  }                                                                                                 \
  extern "C" int mixgemm_grouped_routed_prepare(mixgemm::abi::GemmArgs const* a,                    \
                                                mixgemm::grouped_decode::Routed const* routed,      \
                                                int32_t experts, void* dst, uint32_t cap,           \
                                                mixgemm::abi::Launch* out, char* err, int errlen) { \
    if (routed == nullptr) {                                                                        \
      if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", "null routed arguments");     \
      return 1;                                                                                     \
    }                                                                                               \
    return NAME##_host::prepare(a, 0, experts, dst, cap, out, err, errlen, routed);                 \
  }
#else
#define MIXGEMM_GROUPED_DECODE_ENTRY(NAME, CFG, ACTIVATION)                                        \
  extern "C" __global__ void __launch_bounds__(CFG::kThreads, mixgemm::grouped_decode::kMinCtasPerSm<CFG>) \
  NAME(CUTLASS_GRID_CONSTANT mixgemm::grouped_decode::Params<CFG::Act> const params) {              \
    mixgemm::grouped_decode::kernel_body<CFG, ACTIVATION>(params);                                  \
  }
#endif
