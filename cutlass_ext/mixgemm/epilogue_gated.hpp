// mixgemm: the gated (swiglu) epilogue of the sm90 GEMM kernels.
//
// The weight of a gated MLP's input layer holds gate and up interleaved in 8-row stripes (rows
// 16j .. 16j+7 are gate rows 8j .. 8j+7, rows 16j+8 .. 16j+15 the up rows of the same features:
// python/mixgemm/quantize.py interleave_gate_up). The wgmma accumulator layout gives each thread
// rows r and r + 8 of its warp's 16-row band at the same token columns (the C layout of an sm90
// GMMA atom: value mode (2, 2, N/8), its middle mode is row + 8), so every thread holds gate and
// up of the same feature and token: the epilogue computes
//
//   y[token, 8j + i] = silu(acc[16j + i] + bias[16j + i]) * (acc[16j + 8 + i] + bias[16j + 8 + i])
//
// in float32, rounds once to D, and stores it straight from registers -- no shared memory, no
// exchange between threads, no second launch. D has N/2 rows (features, contiguous) per token.
//
// The collective has the interface of CUTLASS's DefaultEpilogue (an operator-style epilogue) and
// runs in the warp-specialized kernels through Sm90TmaWarpSpecializedAdapter, selected by the
// schedule tag mixgemm::EpilogueGatedNoSmem (registered in cutlass_library's EpilogueScheduleTag
// table by python/mixgemm/codegen.py). Its Arguments mirror the fields of the fusion arguments
// that gemm_entry.hpp fills (alpha, beta, bias pointer, activation), so one host helper serves
// both epilogue families; `kGated` tells the helper which activation the kernel takes.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"

#include "mixgemm/activation.hpp"

namespace mixgemm {

// Epilogue schedule tag: the gated epilogue, no shared memory.
struct EpilogueGatedNoSmem {};

namespace epilogue {

// The fusion named in generated files (cutlass_library's 4-parameter functor form). It carries
// the types only; the collective below implements it.
template <class ElementD_, class ElementCompute_, class ElementC_, class ElementScalar_>
struct Swiglu {
  using ElementOutput = ElementD_;
  using ElementCompute = ElementCompute_;
};

// Rows per stripe of a gate/up interleaved weight: half the 16-row band of one warp.
constexpr int kGateUpStripe = 8;

template <class ElementD_, class StrideD_>
class GatedEpilogue {
 public:
  using EpilogueSchedule = EpilogueGatedNoSmem;
  using DispatchPolicy = EpilogueGatedNoSmem;
  using ElementD = ElementD_;
  using ElementC = ElementD_;   // C is never read
  using StrideD = StrideD_;
  using StrideC = StrideD_;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  static constexpr bool kGated = true;

  struct SharedStorage {};
  using TensorStorage = SharedStorage;

  struct ThreadArguments {
    float alpha = 1.0f;              // unused: the host helper sets 1
    float beta = 0.0f;               // unused: C is not read
    ElementD const* bias_ptr = nullptr;  // [N] interleaved like the weight rows, or null
    struct {
      Activation kind = Activation::kSwiglu;
    } activation;
  };

  struct Arguments {
    ThreadArguments thread{};
    ElementC const* ptr_C = nullptr;
    StrideC dC{};
    ElementD* ptr_D = nullptr;       // [tokens][ldy] with N/2 features per token
    StrideD dD{};
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  // Weight rows (the problem's M) in whole 16-row gate/up bands.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return cute::get<0>(problem_shape) % (2 * kGateUpStripe) == 0 && args.ptr_C == nullptr;
  }

  CUTLASS_HOST_DEVICE
  GatedEpilogue(Params const& params_, SharedStorage const& = SharedStorage()) : params(params_) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "the accumulator layout must be static");
    // The sm90 GMMA accumulator of one thread: ((2 tokens, 2 row halves, tokens / 8), MMA_M, MMA_N).
    using ValueShape = decltype(shape<0>(FrgLayout{}));
    static_assert(rank(ValueShape{}) == 3 && size<0>(ValueShape{}) == 2 && size<1>(ValueShape{}) == 2,
                  "the gated epilogue needs the sm90 GMMA accumulator layout (value mode (2, 2, N/8))");

    int const M = int(get<0>(problem_shape_mnkl));   // weight rows (gate and up)
    int const N = int(get<1>(problem_shape_mnkl));   // tokens
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;

    // The coordinates of each accumulator value in the (weight row, token) problem.
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCcD = thr_mma.partition_C(cD);
    CUTE_STATIC_ASSERT_V(size(tCcD) == size(accumulators), "one coordinate per accumulator value");

    // Row half 0 (rows 16j + i, i < 8: gate) and row half 1 (rows 16j + 8 + i: up)
    Tensor gate = accumulators(make_coord(_, Int<0>{}, _), _, _);
    Tensor up = accumulators(make_coord(_, Int<1>{}, _), _, _);
    Tensor crd = tCcD(make_coord(_, Int<0>{}, _), _, _);

    ElementD const* bias = params.thread.bias_ptr;
    ElementD* ptr_D = params.ptr_D;
    int64_t const ldd = int64_t(get<1>(params.dD));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(gate); ++i) {
      int const row = get<0>(crd(i));   // a gate row: 16j + (0..7)
      int const tok = get<1>(crd(i));
      if (row < M && tok < N) {
        float g = float(gate(i));
        float u = float(up(i));
        if (bias != nullptr) {
          g += float(bias[row]);
          u += float(bias[row + kGateUpStripe]);
        }
        int const out_row = (row >> 4) * kGateUpStripe + (row & (kGateUpStripe - 1));
        ptr_D[tok * ldd + out_row] = ElementD(silu(g) * u);
      }
    }
  }

 private:
  Params params;
};

}  // namespace epilogue
}  // namespace mixgemm

namespace cutlass::epilogue::collective {

// The builder's route to the gated epilogue: schedule mixgemm::EpilogueGatedNoSmem, D column-major
// (the weight rows, i.e. the output features, contiguous).
template <class OpClass, class TileShape_MNK, class ClusterShape_MNK, class EpilogueTileType,
          class ElementAccumulator, class ElementCompute, class ElementC_, class GmemLayoutTagC_, int AlignmentC,
          class ElementD, class GmemLayoutTagD, int AlignmentD, class FusionOp>
struct CollectiveBuilder<arch::Sm90, OpClass, TileShape_MNK, ClusterShape_MNK, EpilogueTileType, ElementAccumulator,
                         ElementCompute, ElementC_, GmemLayoutTagC_, AlignmentC, ElementD, GmemLayoutTagD, AlignmentD,
                         mixgemm::EpilogueGatedNoSmem, FusionOp, void> {
  static_assert(cute::is_void_v<ElementC_>, "the gated epilogue reads no source C");
  static_assert(cute::is_same_v<GmemLayoutTagD, cutlass::layout::ColumnMajor>,
                "the gated epilogue writes D with the weight rows contiguous");
  static_assert(cute::is_same_v<ElementAccumulator, float> && cute::is_same_v<ElementCompute, float>,
                "the gated epilogue computes in float32");
  using CollectiveOp = detail::Sm90TmaWarpSpecializedAdapter<
      mixgemm::epilogue::GatedEpilogue<ElementD, cutlass::detail::TagToStrideC_t<GmemLayoutTagD>>>;
};

}  // namespace cutlass::epilogue::collective
