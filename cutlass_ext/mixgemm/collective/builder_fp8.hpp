// mixgemm: CollectiveBuilder specialization that builds CollectiveMmaPrepackedFp8.
//
// Selected when operand A names mixgemm::layout::PrepackedSm90 and the schedule is
// mixgemm::KernelPrepackedFp8Cooperative (tags_fp8.hpp); CUTLASS's own sm90 builders and
// mixgemm's bf16 one (builder.hpp) test the schedule against their own tags, so they never match
// it. ElementA is (code, scale) or (code, scale, zero) as for the bf16 builder, the scale and
// zero in the output type (bf16 / fp16); ElementB is cutlass::float_e4m3_t, K-major.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"

#include "mixgemm/collective/builder.hpp"   // mixgemm::detail: operand A, the B atom, the stage count
#include "mixgemm/collective/sm90_mma_prepacked_fp8.hpp"
#include "mixgemm/tags_fp8.hpp"

namespace mixgemm::detail {
// A stage count that leaves Extra more bytes of shared memory to the kernel (a fixed count: itself).
template <class StageCountType, int Extra> struct WithCarveout { using type = StageCountType; };
template <int Bytes, int Extra> struct WithCarveout<cutlass::gemm::collective::StageCountAutoCarveout<Bytes>, Extra> {
  using type = cutlass::gemm::collective::StageCountAutoCarveout<Bytes + Extra>;
};
}  // namespace mixgemm::detail

namespace cutlass::gemm::collective {

template <class ElementPairA, int AlignmentA, class ElementB, class GmemLayoutBTag, int AlignmentB,
          class TileShape_MNK, class ClusterShape_MNK, class StageCountType, class KernelScheduleType>
struct CollectiveBuilder<
    arch::Sm90, arch::OpClassTensorOp,
    ElementPairA, mixgemm::layout::PrepackedSm90, AlignmentA,
    ElementB, GmemLayoutBTag, AlignmentB,
    float, TileShape_MNK, ClusterShape_MNK, StageCountType, KernelScheduleType,
    cute::enable_if_t<cute::is_same_v<KernelScheduleType, mixgemm::KernelPrepackedFp8Cooperative>>> {
  using OperandA = mixgemm::detail::PrepackedElementA<ElementPairA>;
  using ElementScale = typename OperandA::ElementScale;
  static_assert(cute::is_same_v<ElementB, cutlass::float_e4m3_t>, "the activations are e4m3");
  static_assert(cute::is_same_v<GmemLayoutBTag, cutlass::layout::ColumnMajor>,
                "the activations are operand B, K-major (xq[M, K] row-major)");
  static_assert(cute::is_same_v<ElementScale, cutlass::bfloat16_t> || cute::is_same_v<ElementScale, cutlass::half_t>,
                "scales (and the output) are bf16 or fp16");

  template <int Stages>
  using Op = mixgemm::collective::CollectiveMmaPrepackedFp8<typename OperandA::ElementCode, ElementScale,
                                                            OperandA::HasZero, TileShape_MNK, ClusterShape_MNK, Stages,
                                                            KernelScheduleType,
                                                            mixgemm::detail::PrepackedSmemLayoutAtomB<ElementB, TileShape_MNK>>;
  // (the mainloop's shared memory outside its stages, the zero-point tables, carved out with the
  // epilogue's)
  using StageCount = typename mixgemm::detail::WithCarveout<StageCountType, Op<2>::kFixedSmemBytes>::type;
  static constexpr int PipelineStages = mixgemm::detail::prepacked_stages<StageCount, Op<2>::kStageSmemBytes>();
  static_assert(PipelineStages >= 2, "the tile does not fit two pipeline stages in shared memory");

  using CollectiveOp = Op<PipelineStages>;
};

}  // namespace cutlass::gemm::collective
