// mixgemm: the register-direct decode GEMM for at most 8 tokens (a GEMV-shaped kernel).
//
// The decode kernel of decode_kernel.hpp streams each weight stripe through a shared-memory ring
// filled by bulk copies, behind an x tile and the scale rows that wait for the previous kernel,
// and splits K across CTAs (a cluster or a global reduction). On the small layers of a 7-8B
// model that machinery is the cost: each launch carries ~4.5-7.5 us of fixed cost in a chain of
// decode GEMMs against a byte floor of 3-13 us (benchmarks/NOTES.md 9b-9d). This kernel keeps only
// what a stream over the weight needs:
//
// * weights: each lane loads its 4 * bits bytes of an atom (the m16n8k16 A fragment of the
//   prepacked layout) straight into registers with streaming global loads, a batch of
//   kBatchAtoms atoms at a time (128 bytes per lane for int8 / int4, 64 for int2), together
//   with the CTA's scale / zero rows (cp.async into shared memory). All of it after
//   griddepcontrol.wait, as every global read of the ring kernel: the kernel just before in the
//   stream may have written the weights (an in-place weight update), and PDL would let this one
//   read them early;
// * activations: after the wait, each lane reads its B fragments of x[token g] directly from
//   global memory (L1/L2 hits: x is a few KB, read by every warp): no x tile, no barrier;
// * math: the converters' exact q - z in half precision (no folded offset: no x-sums needed),
//   mma.sync m16n8k16 with float32 accumulation in two chains, the group's scale applied in float32
//   once per group, as in decode_kernel.hpp;
// * no split-K across CTAs: the KS warps of a stripe (KS chosen at launch from {1, 2, 4, 8, ...}
//   up to the CTA's warps, so that the grid holds enough warps to keep the DRAM busy) stream
//   slices of its k-range and add their float32 sums through shared memory in slice order
//   (deterministic), then the stripe's first warp runs the epilogue. No workspace, no cluster.
//
// Layout of one CTA: W warps = (W / KS) stripes x KS slices; warp w owns stripe
// (W / KS) * blockIdx.x + w / KS and k-atoms [(w % KS) * aps, +aps) of it.
#pragma once

#include "cute/arch/copy_sm80.hpp"
#include "mixgemm/decode_kernel.hpp"

namespace mixgemm::decode {

template <class Act>
struct DirectParams {
  uint8_t const* weight;    // [N/16][K/64][128*bits] prepacked
  Act const* scales;        // [G][N]
  Act const* zeros;         // [G][N] or null (signed codes)
  Act const* x;             // [M][ldx]
  Act const* bias;          // [N] or null
  Act* y;                   // [M][ldy]
  int32_t m, n, k;
  int32_t group_shift;      // log2(group size); 30 for one group spanning K (per-channel)
  int32_t groups;           // G: scale rows
  int32_t kslices;          // KS: warps per stripe (a power of two dividing the CTA's warps)
  int32_t atoms_per_slice;  // k-atoms per warp
  int64_t ldx, ldy;
};

// Compile-time shape: Warps per CTA, BatchBytes of weights per warp per batch (whole atoms).
template <class Code_, class Act_, int Warps_, int BatchBytes_>
struct DirectConfig {
  using Code = Code_;
  using Act = Act_;
  using Dequant = PrepackedDequantFor<Code, Act>;
  static constexpr int kTokens = 8;
  static constexpr int kWarps = Warps_;
  static constexpr int kThreads = 32 * Warps_;
  static constexpr int kBits = Dequant::kBits;
  static constexpr bool kHasZero = !Dequant::kSigned;
  static constexpr int kAtomBytes = 128 * kBits;
  static constexpr int kChunkBytes = 4 * kBits;
  static constexpr int kChunkWords = kChunkBytes / 4;
  static constexpr int kBatchAtoms = BatchBytes_ / kAtomBytes;
  static constexpr int kMaxSmem = 227 * 1024;
  static_assert(BatchBytes_ % kAtomBytes == 0 && kBatchAtoms >= 1 && kBatchAtoms <= 16,
                "a batch is 1 to 16 whole atoms");
  static_assert(Warps_ >= 1 && Warps_ <= 16 && (Warps_ & (Warps_ - 1)) == 0, "1, 2, 4, 8 or 16 warps");

  // Shared memory: [scales: G x rows][zeros: G x rows][slice sums: threads x 4 float32]
  struct Carve {
    int scales, zeros, sums, total;
  };
  CUTLASS_HOST_DEVICE static Carve carve(int groups, int rows_per_cta) {
    Carve c;
    int const group_bytes = (groups * rows_per_cta * int(sizeof(Act)) + 15) / 16 * 16;
    c.scales = 0;
    c.zeros = group_bytes;
    c.sums = c.zeros + (kHasZero ? group_bytes : 0);
    c.total = c.sums + kThreads * 16;
    return c;
  }
};

#if defined(__CUDACC__) && !defined(MIXGEMM_HOST_HELPER)

// A lane's chunk of an atom from global memory, streamed (read once: no L1 allocation).
template <int ChunkBytes>
CUTLASS_DEVICE void ldg_chunk_stream(void const* src, uint32_t (&w)[ChunkBytes / 4]) {
  if constexpr (ChunkBytes == 8) {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n"
                 : "=r"(w[0]), "=r"(w[1]) : "l"(src));
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < ChunkBytes / 16; ++q) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w[4 * q]), "=r"(w[4 * q + 1]), "=r"(w[4 * q + 2]), "=r"(w[4 * q + 3])
                   : "l"(static_cast<char const*>(src) + 16 * q));
    }
  }
}

template <class Cfg, Activation Act_, bool Group32>
CUTLASS_DEVICE void run_direct(DirectParams<typename Cfg::Act> const& p, char* smem) {
  using Act = typename Cfg::Act;
  using D = typename Cfg::Dequant;
  constexpr int U = Cfg::kBatchAtoms;
  constexpr int CW = Cfg::kChunkWords;
  constexpr Half H = half_of<Act>::value;

  int const warp = threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  int const g = lane / 4, t = lane % 4;
  int const ks = p.kslices;
  int const spc = Cfg::kWarps / ks;                 // stripes per CTA
  int const rows_per_cta = 16 * spc;
  int const wstripe = warp / ks, slice = warp % ks;
  int const stripes = p.n / 16;
  int const k_atoms = p.k / 64;
  int const stripe = blockIdx.x * spc + wstripe;
  bool const has_stripe = stripe < stripes;
  int const row0 = blockIdx.x * rows_per_cta;
  int const rows_valid = min(rows_per_cta, p.n - row0);
  int const a0 = min(slice * p.atoms_per_slice, k_atoms);
  int const n_atoms = has_stripe ? min(p.atoms_per_slice, k_atoms - a0) : 0;

  auto const carve = Cfg::carve(p.groups, rows_per_cta);
  Act* ss = reinterpret_cast<Act*>(smem + carve.scales);
  Act* zs = reinterpret_cast<Act*>(smem + carve.zeros);

  // ---- after the grid wait (every global read: the previous kernel in the stream may have
  // written any input, weights included), the warp's first batch of weight chunks, then the
  // CTA's scale / zero rows, 16 bytes per cp.async (a group's rows_valid rows are contiguous and
  // 16-byte aligned: N % 16 == 0), both in flight together ----
  wait_previous_grid();
  uint8_t const* wsrc = p.weight + (int64_t(stripe) * k_atoms + a0) * Cfg::kAtomBytes + lane * Cfg::kChunkBytes;
  uint32_t wb[U][CW];
  auto load_batch = [&](int b) {
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < U; ++u) {
      if (b * U + u < n_atoms) {
        ldg_chunk_stream<Cfg::kChunkBytes>(wsrc + int64_t(b * U + u) * Cfg::kAtomBytes, wb[u]);
      }
    }
  };
  load_batch(0);
  {
    int const vecs = rows_valid * int(sizeof(Act)) / 16;   // per group row
    int const total = p.groups * vecs;
    for (int i = threadIdx.x; i < total; i += Cfg::kThreads) {
      int const grp = i / vecs, v = i % vecs;
      int64_t const src = int64_t(grp) * p.n + row0;
      int const dst = grp * rows_per_cta;
      cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>::copy(
          reinterpret_cast<cute::uint128_t const*>(p.scales + src)[v], reinterpret_cast<cute::uint128_t*>(ss + dst)[v]);
      if constexpr (Cfg::kHasZero) {
        cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>::copy(
            reinterpret_cast<cute::uint128_t const*>(p.zeros + src)[v], reinterpret_cast<cute::uint128_t*>(zs + dst)[v]);
      }
    }
    cute::cp_async_fence();
  }
  cute::cp_async_wait<0>();
  __syncthreads();

  // B fragments: lane (g, t) reads token g (rows past M repeat the last token: their columns are
  // never stored) at k = 16 kb + 2t (+8) of each k16 block
  int const tok = min(g, p.m - 1);
  uint32_t const* xrow = reinterpret_cast<uint32_t const*>(p.x + int64_t(tok) * p.ldx + int64_t(a0) * 64 + 2 * t);

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float part[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  int const lrow = wstripe * 16 + g;     // the lane's rows in the CTA's scale rows: lrow, lrow + 8
  uint32_t bias2[2];
  auto load_bias = [&](int grp) {
    if constexpr (Cfg::kHasZero) {
      Act const* z = zs + grp * rows_per_cta + lrow;
      bias2[0] = D::bias(arith::splat(reinterpret_cast<uint16_t const&>(z[0])));
      bias2[1] = D::bias(arith::splat(reinterpret_cast<uint16_t const&>(z[8])));
    } else {
      (void)grp;
      bias2[0] = bias2[1] = D::bias(0u);
    }
  };
  auto flush = [&](int grp) {   // acc += scale(group) * part; part = 0
    Act const* s = ss + grp * rows_per_cta + lrow;
    float const s0 = float(s[0]), s1 = float(s[8]);
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < 4; ++c) {
      acc[c] = fmaf(c < 2 ? s0 : s1, part[0][c] + part[1][c], acc[c]);
      part[0][c] = 0.f;
      part[1][c] = 0.f;
    }
  };
  auto mma = [&](float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (H == Half::kBF16) {
      cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1,
                                                 c[0], c[1], c[2], c[3]);
    } else {
      cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1,
                                               c[0], c[1], c[2], c[3]);
    }
  };

  if (n_atoms > 0) {
    int cur = (a0 * 64) >> p.group_shift;
    load_bias(cur);
    int const batches = (n_atoms + U - 1) / U;
    for (int b = 0; b < batches; ++b) {
      if (b > 0) load_batch(b);
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < U; ++u) {
        int const la = b * U + u;
        if (la < n_atoms) {
          uint32_t bx[4][2];
          CUTLASS_PRAGMA_UNROLL
          for (int kb = 0; kb < 4; ++kb) {
            bx[kb][0] = xrow[(la * 64 + 16 * kb) / 2];
            bx[kb][1] = xrow[(la * 64 + 16 * kb + 8) / 2];
          }
          if constexpr (!Group32) {
            int const grp = ((a0 + la) * 64) >> p.group_shift;
            if (grp != cur) {
              flush(cur);
              cur = grp;
              load_bias(cur);
            }
          }
          auto kblock = [&](auto kb_const) {
            constexpr int kb = decltype(kb_const)::value;
            if constexpr (Group32 && (kb == 0 || kb == 2)) {
              int const grp = ((a0 + la) * 64 + kb * 16) >> 5;
              if (grp != cur) {
                flush(cur);
                cur = grp;
                load_bias(cur);
              }
            }
            uint32_t a_regs[4];
            centered_kblock<D, H, kb, false>(wb[u], bias2, a_regs);
            mma(part[kb % 2], a_regs, bx[kb][0], bx[kb][1]);
          };
          kblock(cute::Int<0>{});
          kblock(cute::Int<1>{});
          kblock(cute::Int<2>{});
          kblock(cute::Int<3>{});
        }
      }
    }
    flush(cur);
  }

  // ---- the k-slices of a stripe: publish the sums, the first slice adds them in slice order ----
  if (ks > 1) {
    float* sums = reinterpret_cast<float*>(smem + carve.sums);
    *reinterpret_cast<float4*>(sums + threadIdx.x * 4) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (slice == 0) {
      for (int s = 1; s < ks; ++s) {
        float4 const v = *reinterpret_cast<float4 const*>(sums + (threadIdx.x + 32 * s) * 4);
        acc[0] += v.x; acc[1] += v.y; acc[2] += v.z; acc[3] += v.w;
      }
    }
  }
  if (slice != 0 || !has_stripe) return;

  // ---- epilogue: lane holds rows (g, g + 8) x tokens (2t, 2t + 1) of its stripe ----
  int const r0 = stripe * 16 + g;
  CUTLASS_PRAGMA_UNROLL
  for (int e = 0; e < 2; ++e) {
    int const tk = 2 * t + e;
    if (tk < p.m) {
      int64_t const y_row = int64_t(tk) * p.ldy;
      if constexpr (Act_ == Activation::kSwiglu) {
        // gate row g and up row g + 8 of the stripe -> output row 8 * stripe + g
        float const bg = p.bias ? float(p.bias[r0]) : 0.f;
        float const bu = p.bias ? float(p.bias[r0 + 8]) : 0.f;
        p.y[y_row + stripe * 8 + g] = Act(silu(acc[e] + bg) * (acc[2 + e] + bu));
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
          float const bias = p.bias ? float(p.bias[r0 + 8 * h]) : 0.f;
          p.y[y_row + r0 + 8 * h] = Act(activate<Act_>(acc[2 * h + e] + bias));
        }
      }
    }
  }
}

template <class Cfg, Activation A>
CUTLASS_DEVICE void direct_kernel_body(DirectParams<typename Cfg::Act> const& p) {
  extern __shared__ __align__(128) char smem[];
  if (p.group_shift == 5) {
    run_direct<Cfg, A, true>(p, smem);
  } else {
    run_direct<Cfg, A, false>(p, smem);
  }
  launch_next_grid();
}

#endif  // device

// ---------------------------------------------------------------------------------------------
// Host side: the plan (k-slices per stripe) and the checks. Pure host logic, no driver call.
// ---------------------------------------------------------------------------------------------
template <class Cfg, Activation A = Activation::kNone>
struct DirectHost {
  using Act = typename Cfg::Act;

  struct DirectPlan {
    int kslices, atoms_per_slice, groups, row_blocks, smem_bytes;
  };

  // Why the kernel cannot run `a` (nullptr if it can): the checks of the ring decode kernel,
  // with this kernel's 8-token tile, and its own split factor (KS).
  static char const* why_not(abi::GemmArgs const& a) {
    using RingHost = Host<Config<typename Cfg::Code, Act, 1, Cfg::kWarps, Cfg::kAtomBytes, 2, 1>, A>;
    return RingHost::why_not(a);
  }

  // KS: the smallest power of two up to the CTA's warps that puts at least kWarpsPerSm warps
  // per SM on the grid (enough weight bytes in flight to cover the DRAM latency: 16 warps x 4 KB
  // per SM against ~23 KB per microsecond at full bandwidth), within the shared memory; an
  // explicit a.splits (a power of two dividing the CTA's warps) wins.
  static char const* plan(abi::GemmArgs const& a, DirectPlan& out) {
    constexpr long kWarpsPerSm = 16;
    int const stripes = a.n / 16;
    int const k_atoms = a.k / 64;
    int const gshift = group_shift_of(a.group_size, a.k);
    int const groups = gshift == 30 ? 1 : a.k >> gshift;
    long const sms = a.sm_count > 0 ? a.sm_count : 132;
    bool const forced = a.splits >= 1;
    if (forced && (a.splits > Cfg::kWarps || (a.splits & (a.splits - 1))))
      return "the direct decode kernel's split factor (k-slices per stripe) must be a power of two up to its warps";
    int chosen = -1;
    for (int ks = 1; ks <= Cfg::kWarps; ks *= 2) {
      if (forced && ks != a.splits) continue;
      int const spc = Cfg::kWarps / ks;
      int const smem = Cfg::carve(groups, 16 * spc).total;
      if (smem > Cfg::kMaxSmem) continue;
      chosen = ks;
      out = DirectPlan{ks, (k_atoms + ks - 1) / ks, groups, (stripes + spc - 1) / spc, smem};
      if (forced || long(stripes) * ks >= kWarpsPerSm * sms) break;
    }
    if (chosen < 0) return "the scale rows of K do not fit this decode kernel's shared memory";
    return nullptr;
  }

  static char const* check(abi::GemmArgs const* a, DirectPlan& pl) {
    if (a == nullptr) return "null argument";
    if (char const* why = why_not(*a)) return why;
    return plan(*a, pl);
  }
  static char const* check(abi::GemmArgs const* a) {
    DirectPlan pl;
    return check(a, pl);
  }
  static uint64_t workspace_size(abi::GemmArgs const*) { return 0; }

  static int prepare(abi::GemmArgs const* a, void* dst, uint32_t capacity, abi::Launch* out, char* err, int errlen) {
    auto fail = [&](char const* msg) {
      if (err && errlen > 0) std::snprintf(err, size_t(errlen), "%s", msg);
      return 1;
    };
    DirectPlan pl;
    if (char const* why = check(a, pl)) return fail(why);
    if (dst == nullptr || out == nullptr) return fail("null output buffer");
    if (capacity < sizeof(DirectParams<Act>)) return fail("params buffer too small");
    std::memset(out, 0, sizeof(*out));
    DirectParams<Act> p{};
    p.weight = reinterpret_cast<uint8_t const*>(a->weight);
    p.scales = reinterpret_cast<Act const*>(a->scales);
    p.zeros = reinterpret_cast<Act const*>(a->zeros);
    p.x = reinterpret_cast<Act const*>(a->x);
    p.bias = reinterpret_cast<Act const*>(a->bias);
    p.y = reinterpret_cast<Act*>(a->y);
    p.m = a->m; p.n = a->n; p.k = a->k;
    p.group_shift = group_shift_of(a->group_size, a->k);
    p.groups = pl.groups;
    p.kslices = pl.kslices;
    p.atoms_per_slice = pl.atoms_per_slice;
    p.ldx = a->ldx; p.ldy = a->ldy;
    std::memcpy(dst, &p, sizeof(p));
    out->grid[0] = uint32_t(pl.row_blocks); out->grid[1] = 1; out->grid[2] = 1;
    out->block[0] = Cfg::kThreads; out->block[1] = 1; out->block[2] = 1;
    out->cluster[0] = 1; out->cluster[1] = 1; out->cluster[2] = 1;
    out->smem_bytes = uint32_t(pl.smem_bytes);
    out->params_bytes = uint32_t(sizeof(DirectParams<Act>));
    return 0;
  }
};

}  // namespace mixgemm::decode

#if defined(MIXGEMM_HOST_HELPER)
#define MIXGEMM_DECODE_DIRECT_ENTRY(NAME, CFG, ACTIVATION)                                          \
  using NAME##_host = mixgemm::decode::DirectHost<CFG, ACTIVATION>;                                 \
  extern "C" int32_t mixgemm_abi_version() { return mixgemm::abi::kAbiVersion; }                    \
  extern "C" char const* mixgemm_kernel_name() { return MIXGEMM_DECODE_STR(NAME); }                 \
  extern "C" uint32_t mixgemm_params_size() { return uint32_t(sizeof(mixgemm::decode::DirectParams<CFG::Act>)); } \
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
#define MIXGEMM_DECODE_DIRECT_ENTRY(NAME, CFG, ACTIVATION)                                          \
  extern "C" __global__ void __launch_bounds__(CFG::kThreads, 2)                                    \
  NAME(CUTLASS_GRID_CONSTANT mixgemm::decode::DirectParams<CFG::Act> const params) {                \
    mixgemm::decode::direct_kernel_body<CFG, ACTIVATION>(params);                                   \
  }
#endif
