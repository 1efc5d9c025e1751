// mixgemm: sm90 warp-specialized mainloop for prepacked low-bit weights x bf16/fp16 activations.
//
//   D[N_w, M_tok] = A[N_w, K] * B[M_tok, K]^T      (A: the weight, B: the activations x)
//
// A is operand A of a register-sourced wgmma: TMA brings whole 16x64 atoms of the prepacked
// weight (python/mixgemm/weights/layout.py) into shared memory, each consumer lane reads its
// 32-value share of an atom with one or two 16-byte loads (8 bytes for int2), and the mixgemm
// converters (converters/mixgemm/dequant.hpp) turn it into the bf16/fp16 A fragment with the
// group's scale and zero point folded in -- lop3 + sub + mul per register, no float32 detour, no
// byte permutes. B goes through TMA + swizzled shared memory straight into wgmma, as in any sm90
// GEMM; with the tokens on the MMA's N mode, a small batch costs a narrow N, not wasted M rows.
//
// The loads (the weight's atoms, the activations, the scales and zeros per k-tile, the grouped
// (MoE) form's experts), the shared memory, the pipeline, the arguments and their checks are
// sm90_prepacked_common.hpp's Sm90PrepackedMainloop, which the e4m3 mainloop shares; this file
// adds the conversion and the wgmma schedule.
//
// The collective implements the interface that CUTLASS's sm90 GemmUniversal kernels
// (warp-specialized cooperative and ping-pong, any tile scheduler incl. stream-K) expect.
#pragma once

#include "mixgemm/collective/sm90_prepacked_common.hpp"
#include "mixgemm/numeric_conversion.hpp"

namespace mixgemm::collective {

using namespace cute;

template <class ElementCode_, class ElementAct_, bool HasZero_, class TileShape_, class ClusterShape_,
          int Stages_, class KernelSchedule_, class SmemLayoutAtomB_>
struct CollectiveMmaPrepacked
    : Sm90PrepackedMainloop<ElementCode_, ElementAct_, ElementAct_, HasZero_, TileShape_, ClusterShape_, Stages_,
                            KernelSchedule_, SmemLayoutAtomB_, /*KBlock=*/16, /*Grouped=*/true> {
  using Base = Sm90PrepackedMainloop<ElementCode_, ElementAct_, ElementAct_, HasZero_, TileShape_, ClusterShape_,
                                     Stages_, KernelSchedule_, SmemLayoutAtomB_, 16, true>;
  using ElementAct = ElementAct_;                // the activations, scales, zeros and the A fragment
  using ElementZero = ElementAct_;
  using typename Base::MainloopPipeline, typename Base::PipelineState, typename Base::TensorStorage,
      typename Base::Params, typename Base::TiledMma;
  using Base::BLK_M, Base::BLK_K, Base::kBits, Base::kKBlocks, Base::kGroupRowsMax, Base::HasZero;

  using Dequant = mixgemm::PrepackedDequantFor<ElementCode_, ElementAct_>;
  static_assert(Dequant::kBits == kBits, "the converter's code width is the code type's");

  //
  // Consumer: dequantize A into the wgmma fragments a whole k-tile ahead of the tensor core.
  //
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    int const mma_thread = thread_idx % size(TiledMma{});
    int const lane = thread_idx % kLanes;

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_slice(mma_thread);

    // Two register sets for the converted A fragments, used by alternate k-tiles. ptxas does not
    // follow wgmma.wait_group counts across a loop's back edge: with one set, the conversion at
    // the top of a k-tile redefines registers that (as far as ptxas can tell) the previous
    // k-tile's wgmmas may still read, and it serializes every wgmma of the kernel (C7513: each
    // wgmma waited on before the next conversion starts). With the sets alternating inside one
    // loop iteration, each conversion writes registers whose last readers are provably done.
    Tensor tCrA0 = Base::a_fragment(thr_mma);                                // (MMA,MMA_M,MMA_K) bf16/fp16
    Tensor tCrA1 = Base::a_fragment(thr_mma);
    constexpr int MMA_M = size<1>(tCrA0);
    Tensor tCrB = Base::b_descriptors(thr_mma, shared_tensors);              // (MMA,MMA_N,MMA_K,PIPE)

    int atom_row[MMA_M];
    int tile_row[MMA_M];
    Base::thread_rows(thr_mma, tile_row, atom_row);
    uint8_t const* smem_A = Base::smem_atoms(shared_tensors);
    ElementAct const* smem_S = shared_tensors.smem_scale.data();
    ElementAct const* smem_Z = shared_tensors.smem_zero.data();
    int const gpt = params.group_rows_per_tile;

    PipelineState smem_pipe_release = smem_pipe_read;

    // Wait for the next k-tile's stage and convert all of its A fragments into `frag`; returns
    // the stage (its B tile is read by the wgmmas issued later). `rows_c`: the group rows a
    // k-tile touches (gpt) as a compile-time constant, so that each k16 block's scale and bias
    // registers are picked at compile time (a runtime row index cost a SEL per register).
    auto convert_rows = [&](auto& frag, auto rows_c) {
      constexpr int kRows = decltype(rows_c)::value;
      Tensor tCrA_u32 = recast<uint32_t>(frag);                              // (4,MMA_M,MMA_K)
      auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int const stage = smem_pipe_read.index();
      ++smem_pipe_read;

      uint32_t chunk[MMA_M][Base::kAtomsK][kBits];
      Base::load_chunks(smem_A, stage, atom_row, lane, chunk);

      // Scale and bias registers of the group rows this tile touches.
      uint32_t scale2[kRows][MMA_M][2];
      uint32_t bias2[kRows][MMA_M][2];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        ElementAct const* srow = smem_S + (stage * kGroupRowsMax + r) * BLK_M;
        ElementAct const* zrow = smem_Z + (stage * kGroupRowsMax + r) * BLK_M;
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MMA_M; ++mm) {
          CUTLASS_PRAGMA_UNROLL
          for (int h = 0; h < 2; ++h) {
            int row = tile_row[mm] + 8 * h;
            scale2[r][mm][h] = arith::splat(reinterpret_cast<uint16_t const&>(srow[row]));
            uint32_t z2 = HasZero ? arith::splat(reinterpret_cast<uint16_t const&>(zrow[row])) : 0u;
            bias2[r][mm][h] = Dequant::bias(z2);
          }
        }
      }

      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < kKBlocks; ++kb) {
        // Group row of this k16 block: kb * 16 / group_size, i.e. kb * gpt / kKBlocks.
        int const grow = (kb * kRows) / kKBlocks;   // a constant: kb is unrolled
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MMA_M; ++mm) {
          uint32_t s2[2] = {scale2[grow][mm][0], scale2[grow][mm][1]};
          uint32_t b2[2] = {bias2[grow][mm][0], bias2[grow][mm][1]};
          uint32_t out[4];
          uint32_t const* ch = chunk[mm][kb / 4];
          switch (kb % 4) {
            case 0: Dequant::template kblock<0>(ch, b2, s2, out); break;
            case 1: Dequant::template kblock<1>(ch, b2, s2, out); break;
            case 2: Dequant::template kblock<2>(ch, b2, s2, out); break;
            default: Dequant::template kblock<3>(ch, b2, s2, out); break;
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
    // (gpt is a power of two <= kGroupRowsMax, the same for every warp: a uniform branch)
    auto convert_tile = [&](auto& frag) {
      if constexpr (kGroupRowsMax >= 4) {
        if (gpt == 4) return convert_rows(frag, Int<4>{});
      }
      if constexpr (kGroupRowsMax >= 2) {
        if (gpt == 2) return convert_rows(frag, Int<2>{});
      }
      return convert_rows(frag, Int<1>{});
    };

    // Issue one k-tile's wgmmas (A from `frag`, B from `stage`) as one commit group.
    auto issue_tile = [&](auto& frag, int stage) {
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < kKBlocks; ++kb) {
        cute::gemm(tiled_mma, frag(_, _, kb), tCrB(_, _, kb, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(accum);
    };

    // A whole k-tile ahead: tile t + 1 is converted while tile t's wgmmas run, so the tensor
    // core has a tile's wgmmas queued during each conversion. (Converting one k16 block ahead,
    // each block's conversion first waited for the wgmma four blocks back; the whole-tile
    // schedule measured 3-11% faster at M = 64-256: docs/kernels.md.)
    // The two register sets alternate inside one loop iteration: ptxas does not follow
    // wgmma.wait_group counts across a loop's back edge, and with one set it would serialize
    // every wgmma of the kernel (C7513); here each conversion writes a set whose last readers
    // (the tile two back) a wait<1> in the same iteration has retired.
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);
    int stage = convert_tile(tCrA0);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; k_tile_count > 0; t += 2) {
      issue_tile(tCrA0, stage);
      if (--k_tile_count == 0) {
        if (t > 0) {   // release tile t - 1 (mma_tail releases tile t)
          warpgroup_wait<1>();
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
        }
        break;
      }
      warpgroup_wait<1>();                 // tile t - 1 done: its stage and register set are free
      if (t > 0) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      stage = convert_tile(tCrA1);
      issue_tile(tCrA1, stage);
      warpgroup_wait<1>();                 // tile t done
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      if (--k_tile_count == 0) {
        break;
      }
      stage = convert_tile(tCrA0);
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace mixgemm::collective
