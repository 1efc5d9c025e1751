// mixgemm: sm90 warp-specialized mainloop for prepacked 4- and 2-bit weights x e4m3 activations.
//
//   D[N_w, M_tok] = s_x[M_tok] * sum_g s_w[N_w, g] * (A_g[N_w, K_g] * B[M_tok, K_g]^T)
//
// A is the weight, operand A of a register-sourced wgmma.m64nNk32 e4m3 x e4m3 -> f32: TMA brings
// whole 16x64 atoms of the prepacked weight (python/mixgemm/weights/layout.py) into shared
// memory, each consumer lane reads its chunk of an atom and converts it into the 8-bit A
// fragment with converters/mixgemm/e4m3.hpp: the codes q (signed) or u - z (unsigned, z the
// group's integer zero point) are exact in e4m3, and no scale is applied to them. B is the
// activation tile, e4m3 quantized per token by mixgemm's quantizer (quant_fp8_kernel.hpp) in the
// MMA's K order (a permutation inside every 32 columns, e4m3.hpp), so it is a plain K-major
// operand: TMA into swizzled shared memory, read by wgmma through descriptors.
//
// Scales (docs/fp8.md):
//   * the weight's group scales s_w [G, N_w] (bf16/fp16, loaded per k-tile by TMA like the bf16
//     mainloop's) are applied in float32: each k-tile's wgmmas accumulate into a group
//     accumulator that starts at zero, and after them accum += s_w[row, g] * acc_g. A k-tile holds
//     one group (groups of BLK_K or more: one segment) or BLK_K / group_size of them (a segment of
//     wgmmas each, with its own promotion). Promoting at least once per k-tile also keeps each
//     tensor-core accumulation short (BLK_K products), which bounds the error of the FP8 tensor
//     cores' reduced-precision accumulation.
//   * the per-token scales s_x [M_tok] (float32) are loaded by TMA with each stage (BLK_N floats)
//     and applied to the accumulator once, after the last k-tile, from that tile's stage; the
//     epilogue (bias, activation, rounding) then runs on the scaled accumulator as for bf16.
//
// Schedule: a k-tile's conversion into one of two register sets runs while the other set's
// wgmmas (the previous k-tile) are in flight; each k-tile then waits for its wgmmas and promotes.
//
// The loads (the weight's atoms, the activations, the scales and zeros per k-tile), the shared
// memory, the pipeline, the arguments and their checks are sm90_prepacked_common.hpp's
// Sm90PrepackedMainloop, the bf16 mainloop's too; this file adds the per-token scales (one more
// TMA per stage), the conversion, the wgmma schedule and the promotions.
//
// The collective implements the interface of CUTLASS's sm90 warp-specialized cooperative
// GemmUniversal kernel; the kernels run it on the stream-K scheduler (streamk_scheduler.hpp), so a
// work unit is a whole output tile or, split-K, a run of its k-tiles: the per-token scales are
// applied to each unit's partial sums (they are linear), and a partial unit finds no group
// boundaries by counting. No clusters, no grouped form yet.
#pragma once

#include "mixgemm/collective/sm90_prepacked_common.hpp"
#include "mixgemm/e4m3.hpp"
#include "mixgemm/pdl.hpp"

// Ablation switches, for measuring what the conversion and the promotion cost (docs/fp8.md,
// "Where the time goes"): built with -DMIXGEMM_FP8_ABLATE=N (MIXGEMM_NVCC_FLAGS, which is part of
// the kernel cache's key), bit 1 leaves out the promotion's FMAs (each k-tile's group sums are
// still waited for; the last one is the result) and bit 2 the conversion of the codes (the raw
// chunk words, masked, go to the tensor cores). The results are wrong; only their time means
// something. 0, the default, is the kernel.
#ifndef MIXGEMM_FP8_ABLATE
#define MIXGEMM_FP8_ABLATE 0
#endif

namespace mixgemm::collective {

using namespace cute;

namespace fp8 {

// Bits and signedness of a CUTLASS code type.
template <class Code> struct CodeTraits;
template <int Bits, bool Signed> struct CodeBits {
  static constexpr int kBits = Bits;
  static constexpr bool kSigned = Signed;
};
template <> struct CodeTraits<cutlass::int4b_t> : CodeBits<4, true> {};
template <> struct CodeTraits<cutlass::uint4b_t> : CodeBits<4, false> {};
template <> struct CodeTraits<cutlass::int2b_t> : CodeBits<2, true> {};
template <> struct CodeTraits<cutlass::uint2b_t> : CodeBits<2, false> {};

template <class T> struct HalfOf;
template <> struct HalfOf<cutlass::bfloat16_t> { static constexpr Half value = Half::kBF16; };
template <> struct HalfOf<cutlass::half_t> { static constexpr Half value = Half::kFP16; };

}  // namespace fp8

template <class ElementCode_, class ElementScale_, bool HasZero_, class TileShape_, class ClusterShape_,
          int Stages_, class KernelSchedule_, class SmemLayoutAtomB_>
struct CollectiveMmaPrepackedFp8
    : Sm90PrepackedMainloop<ElementCode_, cutlass::float_e4m3_t, ElementScale_, HasZero_, TileShape_, ClusterShape_,
                            Stages_, KernelSchedule_, SmemLayoutAtomB_, /*KBlock=*/32, /*Grouped=*/false> {
  using Base = Sm90PrepackedMainloop<ElementCode_, cutlass::float_e4m3_t, ElementScale_, HasZero_, TileShape_,
                                     ClusterShape_, Stages_, KernelSchedule_, SmemLayoutAtomB_, 32, false>;
  using typename Base::ElementB, typename Base::ElementScale, typename Base::MainloopPipeline,
      typename Base::PipelineState, typename Base::TiledMma;
  using Base::BLK_M, Base::BLK_N, Base::BLK_K, Base::Stages, Base::kBits, Base::kKBlocks, Base::kGroupRowsMax;

  static_assert(cute::is_base_of_v<cutlass::gemm::KernelTmaWarpSpecializedCooperative, typename Base::KernelSchedule>,
                "the e4m3 mainloop runs in the cooperative kernel");
  static_assert(BLK_M % 128 == 0, "each consumer warp group takes whole 64-row wgmma blocks");
  static_assert(size(typename Base::ClusterShape{}) == 1, "the e4m3 mainloop has no cluster form yet");

  using Codes = fp8::CodeTraits<ElementCode_>;
  static constexpr bool kSigned = Codes::kSigned;
  static_assert(Codes::kBits == kBits, "the converter's code width is the code type's");
  static_assert(HasZero_ != kSigned, "unsigned codes have zero points, signed codes none");
  using Conv = mixgemm::PrepackedE4M3<kBits, kSigned>;
  static constexpr Half kHalf = fp8::HalfOf<ElementScale>::value;
  static constexpr int kTableWords = Conv::kTableWords;

  //
  // The per-token scales s_x [M_tok] (float32): BLK_N of them with every stage, each stage's row
  // 128-byte aligned (TMA).
  //
  static constexpr int kTokenStride = (BLK_N + 31) / 32 * 32;
  using SmemLayoutTokenRow = Layout<Shape<Int<BLK_N>, _1>>;   // TMA box: the tile's token scales
  using GmemLayoutTokens = Layout<Shape<int32_t, int32_t>, Stride<_1, int64_t>>;  // [M_tok, 1]
  static constexpr uint32_t kBytesTokens = BLK_N * sizeof(float);
  static constexpr int kStageSmemBytes = Base::kStageSmemBytes + int(kTokenStride * sizeof(float));

  //
  // The zero-point tables of 4-bit unsigned codes: table(z) (16 e4m3 bytes) for each of the 16
  // zero points, read with one 16-byte load per row and group where building it in registers
  // takes about 25 instructions. One copy per consumer warp, written by the warp at the start,
  // so that no barrier beyond __syncwarp orders the writes before the reads.
  //
  static constexpr bool kZeroTablesInSmem = !kSigned && kBits == 4;
  static constexpr int kConsumerWarps = int(size(TiledMma{})) / 32;
  static constexpr int kZeroTableWords = 16 * kTableWords;                     // per warp
  static constexpr int kFixedSmemBytes = kZeroTablesInSmem ? kConsumerWarps * kZeroTableWords * 4 : 0;

  struct TensorStorage : Base::TensorStorage {
    alignas(128) cute::array_aligned<float, kTokenStride * Stages> smem_token;
    alignas(16) cute::array_aligned<uint32_t, kZeroTablesInSmem ? kConsumerWarps * kZeroTableWords : 4> smem_ztab;
  };

  struct Arguments : Base::Arguments {
    float const* ptr_XS = nullptr;        // per-token scales s_x [M_tok] (gemm_entry_fp8.hpp sets them)
  };

  struct Params : Base::Params {
    using TMA_X = decltype(make_tma_copy(SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<float const*>(nullptr)), GmemLayoutTokens{}),
        SmemLayoutTokenRow{}));
    TMA_X tma_load_token;
    int32_t tokens = 0;                 // M_tok
  };

  // The per-token scales are checked by the entry point (gemm_entry_fp8.hpp), which sets them
  // after gemm_entry.hpp's make_arguments; Base::why_not checks the rest.
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);    // M = N_w (weight rows), N = M_tok
    // The token scales as [M_tok, 1]; the second stride is never used (one row) but must be a
    // multiple of 16 bytes for the descriptor.
    int64_t const token_pitch = (int64_t(N) + 3) / 4 * 4;
    auto gX = make_tensor(make_gmem_ptr(args.ptr_XS),
                          GmemLayoutTokens{make_shape(int32_t(N), int32_t(1)), make_stride(_1{}, token_pitch)});
    Params params{Base::to_underlying_arguments(problem_shape, args, workspace),
                  make_tma_copy(SM90_TMA_LOAD{}, gX, SmemLayoutTokenRow{}), int32_t(N)};
    params.tma_transaction_bytes += kBytesTokens;
    return params;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    cute::prefetch_tma_descriptor(params.tma_load_token.get_tma_descriptor());
  }

  //
  // Producer: Base's loads, and with each stage the tile's token scales.
  //
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    (void)thread_idx;
    if (!cute::elect_one_sync()) {
      return;
    }
    // Launched with programmatic stream serialization: wait here for the previous grid (the
    // quantizer that wrote the activations and their scales) before the first load. Nothing in
    // the kernel reads memory an earlier kernel writes before this load has landed (the consumers
    // wait on its stages, the epilogue and the split-K reduction come after them).
    pdl::wait_previous_grid();
    Tensor mX = params.tma_load_token.get_tma_tensor(make_shape(params.tokens, 1));
    Tensor gX = local_tile(mX, shape(SmemLayoutTokenRow{}), make_coord(get<1>(blk_coord), _));  // (BLK_N,1,1)
    Tensor sX = make_tensor(make_smem_ptr(shared_tensors.smem_token.data()),
                            make_layout(make_shape(Int<BLK_N>{}, _1{}, Int<Stages>{}),
                                        make_stride(_1{}, Int<kTokenStride>{}, Int<kTokenStride>{})));
    auto tma_x = params.tma_load_token.get_slice(0);
    Tensor tXgX = tma_x.partition_S(gX);
    Tensor tXsX = tma_x.partition_D(sX);
    this->load_stages(params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count,
                      block_rank_in_cluster, shared_tensors, [&](auto& tma_barrier, int stage) {
                        copy(params.tma_load_token.with(tma_barrier), tXgX(_, _, _, 0), tXsX(_, _, _, stage));
                      });
  }

  //
  // Consumer: convert A into the wgmma fragments a k-tile ahead of the tensor core, accumulate
  // each group in float32 apart, and scale it into the output accumulator.
  //
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    int const mma_thread = thread_idx % size(TiledMma{});
    int const lane = thread_idx % kLanes;

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_slice(mma_thread);

    // Two register sets for the converted A fragments, used by alternate k-tiles: a conversion
    // writes the set whose wgmmas (two k-tiles back) have been waited for.
    Tensor tCrA0 = Base::a_fragment(thr_mma);                                // (MMA,MMA_M,MMA_K) e4m3
    Tensor tCrA1 = Base::a_fragment(thr_mma);
    constexpr int MMA_M = size<1>(tCrA0);
    Tensor tCrB = Base::b_descriptors(thr_mma, shared_tensors);              // (MMA,MMA_N,MMA_K,PIPE)

    // The group accumulator, and each accumulator value's token column in the tile. In the
    // 64xN accumulator layout (GMMA::CLayout_64xN) value v of an MMA holds row g + 8 * ((v / 2) % 2)
    // of the thread's rows g, g + 8: promote() reads the scale of that row.
    Tensor acc_g = make_fragment_like(accum);                                // (MMA,MMA_M,MMA_N)
    Tensor cC = make_identity_tensor(make_shape(Int<BLK_M>{}, Int<BLK_N>{}));
    Tensor tCcC = thr_mma.partition_C(cC);                                   // (MMA,MMA_M,MMA_N) -> (m,n)
    static_assert(cute::is_same_v<typename TiledMma::Atom::Traits::CLayout, GMMA::CLayout_64xN<BLK_N>>,
                  "promote() assumes the 64xN accumulator layout");

    int atom_row[MMA_M];
    int tile_row[MMA_M];
    Base::thread_rows(thr_mma, tile_row, atom_row);
    // This warp's copy of the zero-point tables (4-bit unsigned codes), written before its first use.
    uint32_t* ztab = shared_tensors.smem_ztab.data() + (kZeroTablesInSmem ? (mma_thread / 32) * kZeroTableWords : 0);
    if constexpr (kZeroTablesInSmem) {
      CUTLASS_PRAGMA_UNROLL
      for (int w = lane; w < kZeroTableWords; w += kLanes) {
        ztab[w] = Conv::table_word(w / kTableWords, w % kTableWords);
      }
      __syncwarp();
    }
    uint8_t const* smem_A = Base::smem_atoms(shared_tensors);
    ElementScale const* smem_S = shared_tensors.smem_scale.data();
    ElementScale const* smem_Z = shared_tensors.smem_zero.data();
    float const* smem_T = shared_tensors.smem_token.data();
    int const gpt = params.group_rows_per_tile;
    int const group_size = params.group_size;
    int const k_tiles_total = (params.k_atoms * kAtomCols + BLK_K - 1) / BLK_K;

    PipelineState smem_pipe_release = smem_pipe_read;
    clear(accum);

    // The whole k-loop for kRows group rows per k-tile (a compile-time constant: 1 for groups of
    // BLK_K or more, BLK_K / group_size below), so that every k32 block's table and every
    // segment's scale row is picked at compile time.
    auto k_loop = [&](auto rows_c) {
      constexpr int kRows = decltype(rows_c)::value;
      constexpr int kSegBlocks = kKBlocks / kRows;      // k32 blocks per segment (one group row)

      // The e4m3 tables of the thread's rows (g, g + 8) per 64-row block, for the group row in
      // use: rebuilt at each group row of a k-tile (kRows > 1) or when a k-tile starts a group.
      uint32_t tab[MMA_M][2][kTableWords];
      if constexpr (kSigned) {
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MMA_M; ++mm) {
          Conv::table(0u, tab[mm][0]);
          Conv::table(0u, tab[mm][1]);
        }
      }

      // With one group row per k-tile, a group spans tiles_per_group whole k-tiles (a group of K
      // that is not a multiple of BLK_K: every k-tile), so a countdown finds the k-tiles that
      // start one, where (t * BLK_K) % group_size would be a runtime division per k-tile. A
      // split-K or stream-K unit that is not the whole tile may start inside a group, so it
      // takes each of its k-tiles as the start of one (the zero-point tables read again; the
      // scales are read per k-tile anyway).
      int const tiles_per_group = k_tile_count == k_tiles_total ? (group_size + BLK_K - 1) / BLK_K : 1;
      int group_tiles_left = 0;

      // Wait for the next k-tile's stage and convert its A fragments into `frag` (called once
      // per k-tile, in order); returns the stage.
      auto convert = [&](auto& frag) {
        Tensor tCrA_u32 = recast<uint32_t>(frag);                            // (4,MMA_M,MMA_K)
        auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
        pipeline.consumer_wait(smem_pipe_read, barrier_token);
        int const stage = smem_pipe_read.index();
        ++smem_pipe_read;

        uint32_t chunk[MMA_M][Base::kAtomsK][kBits];
        Base::load_chunks(smem_A, stage, atom_row, lane, chunk);
        // (uniform across the warp group: the countdown depends on group_size only)
        bool new_group = true;
        if constexpr (kRows == 1) {
          new_group = group_tiles_left == 0;
          group_tiles_left = (new_group ? tiles_per_group : group_tiles_left) - 1;
        }

        if constexpr ((MIXGEMM_FP8_ABLATE & 2) != 0) {
          CUTLASS_PRAGMA_UNROLL
          for (int kb = 0; kb < kKBlocks; ++kb) {
            CUTLASS_PRAGMA_UNROLL
            for (int mm = 0; mm < MMA_M; ++mm) {
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < 4; ++i) {
                tCrA_u32(i, mm, kb) = chunk[mm][kb / 2][(i + kb) % kBits] & 0x3f3f3f3fu;
              }
            }
          }
          warpgroup_fence_operand(frag);
          return stage;
        }
        CUTLASS_PRAGMA_UNROLL
        for (int kb = 0; kb < kKBlocks; ++kb) {
          if constexpr (!kSigned) {
            if (kb % kSegBlocks == 0 && new_group) {
              ElementScale const* zrow = smem_Z + (stage * kGroupRowsMax + kb / kSegBlocks) * BLK_M;
              CUTLASS_PRAGMA_UNROLL
              for (int mm = 0; mm < MMA_M; ++mm) {
                CUTLASS_PRAGMA_UNROLL
                for (int h = 0; h < 2; ++h) {
                  uint32_t const z2 = arith::splat(reinterpret_cast<uint16_t const&>(zrow[tile_row[mm] + 8 * h]));
                  uint32_t const z = Conv::template zero_code<kHalf>(z2);
                  if constexpr (kZeroTablesInSmem) {
                    uint4 const t = reinterpret_cast<uint4 const*>(ztab)[z];
                    tab[mm][h][0] = t.x;
                    tab[mm][h][1] = t.y;
                    tab[mm][h][2] = t.z;
                    tab[mm][h][3] = t.w;
                  } else {
                    Conv::table(z, tab[mm][h]);
                  }
                }
              }
            }
          }
          CUTLASS_PRAGMA_UNROLL
          for (int mm = 0; mm < MMA_M; ++mm) {
            uint32_t out[4];
            uint32_t const* ch = chunk[mm][kb / 2];
            if (kb % 2 == 0) {
              Conv::template kblock<0>(ch, tab[mm][0], tab[mm][1], out);
            } else {
              Conv::template kblock<1>(ch, tab[mm][0], tab[mm][1], out);
            }
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < 4; ++i) {
              tCrA_u32(i, mm, kb) = out[i];
            }
          }
        }
        warpgroup_fence_operand(frag);
        return stage;
      };

      // The scales s_w of the thread's rows (g, g + 8) per 64-row block, group row r of the stage.
      // Read before the wgmmas are waited for (warpgroup_wait is a memory barrier to the compiler:
      // a load after it would put its latency between the wait and the promotion).
      auto load_scales = [&](int stage, int r, float (&s)[MMA_M][2]) {
        ElementScale const* srow = smem_S + (stage * kGroupRowsMax + r) * BLK_M;
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MMA_M; ++mm) {
          s[mm][0] = float(srow[tile_row[mm]]);
          s[mm][1] = float(srow[tile_row[mm] + 8]);
        }
      };

      // accum += s_w * acc_g, s from load_scales
      auto promote = [&](float const (&s)[MMA_M][2]) {
        if constexpr ((MIXGEMM_FP8_ABLATE & 1) != 0) {
          return;
        }
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < size<1>(accum); ++mm) {
          CUTLASS_PRAGMA_UNROLL
          for (int nn = 0; nn < size<2>(accum); ++nn) {
            CUTLASS_PRAGMA_UNROLL
            for (int v = 0; v < size<0>(accum); ++v) {
              accum(v, mm, nn) = fmaf(s[mm][(v / 2) % 2], acc_g(v, mm, nn), accum(v, mm, nn));
            }
          }
        }
      };

      // k-tile t: its wgmmas (A from `cur`), the next k-tile's conversion into `next` while the
      // last segment's wgmmas run, then each segment's promotion. Returns the next tile's stage.
      auto step = [&](auto& cur, auto& next, int stage, int t) {
        bool const last = t + 1 == k_tile_count;
        int next_stage = stage;
        float s[kRows][MMA_M][2];
        CUTLASS_PRAGMA_UNROLL
        for (int seg = 0; seg < kRows; ++seg) {
          load_scales(stage, seg, s[seg]);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int seg = 0; seg < kRows; ++seg) {
          warpgroup_fence_operand(acc_g);
          warpgroup_arrive();
          CUTLASS_PRAGMA_UNROLL
          for (int b = 0; b < kSegBlocks; ++b) {
            int const kb = seg * kSegBlocks + b;
            tiled_mma.accumulate_ = b == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
            cute::gemm(tiled_mma, cur(_, _, kb), tCrB(_, _, kb, stage), acc_g);
          }
          warpgroup_commit_batch();
          warpgroup_fence_operand(acc_g);
          if (seg == kRows - 1 && !last) {
            next_stage = convert(next);
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_g);
          promote(s[seg]);
        }
        if (!last) {   // the last k-tile's stage is released by mma_tail, after its token scales are read
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
        }
        return next_stage;
      };

      int stage = convert(tCrA0);
      int last_stage = stage;
      CUTLASS_PRAGMA_NO_UNROLL
      for (int t = 0; t < k_tile_count; t += 2) {
        last_stage = stage;
        stage = step(tCrA0, tCrA1, stage, t);
        if (t + 1 == k_tile_count) {
          break;
        }
        last_stage = stage;
        stage = step(tCrA1, tCrA0, stage, t + 1);
      }
      return last_stage;
    };

    // (gpt is a power of two <= kGroupRowsMax, the same for every thread: a uniform branch)
    int last_stage;
    if constexpr (kGroupRowsMax >= 4) {
      if (gpt == 4) {
        last_stage = k_loop(Int<4>{});
      } else if (gpt == 2) {
        last_stage = k_loop(Int<2>{});
      } else {
        last_stage = k_loop(Int<1>{});
      }
    } else {
      if (gpt == 2) {
        last_stage = k_loop(Int<2>{});
      } else {
        last_stage = k_loop(Int<1>{});
      }
    }

    if constexpr ((MIXGEMM_FP8_ABLATE & 1) != 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) {
        accum(i) = acc_g(i);
      }
    }
    // The per-token scales, from the last k-tile's stage (still held: mma_tail releases it).
    float const* token_scale = smem_T + last_stage * kTokenStride;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) {
      accum(i) *= token_scale[get<1>(tCcC(i))];
    }
  }
};

}  // namespace mixgemm::collective
