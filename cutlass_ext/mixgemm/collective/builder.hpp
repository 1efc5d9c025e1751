// mixgemm: CollectiveBuilder specialization that builds CollectiveMmaPrepacked.
//
// Selected when operand A names the layout tag mixgemm::layout::PrepackedSm90 and the schedule is
// mixgemm::KernelPrepacked{Cooperative,Pingpong}. CUTLASS's own sm90 builders test the schedule
// with is_same on their own tags, so they never match these and there is no ambiguity.
//
// ElementA is CUTLASS's mixed-input tuple: cute::tuple<Code, Scale> (symmetric, scale only) or
// cute::tuple<Code, Scale, Zero> (asymmetric), exactly what cutlass_library emits for the
// ScaleOnly / ScaleWithZeroPoint mixed-input modes.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"

#include "mixgemm/collective/sm90_mma_prepacked.hpp"
#include "mixgemm/tags.hpp"

namespace mixgemm::detail {
template <class T> struct is_stage_count : cute::false_type {};
template <int N> struct is_stage_count<cutlass::gemm::collective::StageCount<N>> : cute::true_type {};

// What the prepacked builders (this one and builder_fp8.hpp) read off operand A's element:
// cute::tuple<Code, Scale> or cute::tuple<Code, Scale, Zero>.
template <class ElementPairA>
struct PrepackedElementA {
  static_assert(cute::is_tuple<ElementPairA>::value,
                "operand A must be cute::tuple<code, scale> or cute::tuple<code, scale, zero>");
  static constexpr int kTuple = cute::tuple_size_v<ElementPairA>;
  static_assert(kTuple == 2 || kTuple == 3, "operand A must be (code, scale) or (code, scale, zero)");
  using ElementCode = cute::tuple_element_t<0, ElementPairA>;
  using ElementScale = cute::tuple_element_t<1, ElementPairA>;
  static constexpr bool HasZero = kTuple == 3;
};

// The swizzled shared-memory atom of a K-major activation tile.
template <class ElementB, class TileShape_MNK>
using PrepackedSmemLayoutAtomB = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
    cute::GMMA::Major::K, ElementB, decltype(cute::get<1>(TileShape_MNK{})), decltype(cute::get<2>(TileShape_MNK{}))>());

// The pipeline stages: StageCount<N> as given, else as many as fit (at most 12) beside the
// epilogue's storage (StageCountAutoCarveout's bytes) and the kernel's own. kKernelCarveout: what
// the kernel keeps besides the stages and the epilogue's storage -- its pipelines' barriers,
// placed before the tensors (which align to 1024 bytes), and the padding between the tensor
// arrays. 1024 was enough while every epilogue's own storage brought slack; with the gated
// epilogue (no shared memory) a 128x128 int4 tile took 11 stages and overran the 227 KiB opt-in
// limit.
template <class StageCountType, int StageSmemBytes>
constexpr int prepacked_stages() {
  if constexpr (is_stage_count<StageCountType>::value) {
    return StageCountType::value;
  } else {
    constexpr int kKernelCarveout = 2048;
    constexpr int bytes = cutlass::gemm::collective::detail::sm90_smem_capacity_bytes - StageCountType::bytes -
                          kKernelCarveout;
    constexpr int stages = bytes / StageSmemBytes;
    return stages > 12 ? 12 : stages;
  }
}
}  // namespace mixgemm::detail

namespace cutlass::gemm::collective {

template <class ElementPairA, int AlignmentA, class ElementB, class GmemLayoutBTag, int AlignmentB,
          class TileShape_MNK, class ClusterShape_MNK, class StageCountType, class KernelScheduleType>
struct CollectiveBuilder<
    arch::Sm90, arch::OpClassTensorOp,
    ElementPairA, mixgemm::layout::PrepackedSm90, AlignmentA,
    ElementB, GmemLayoutBTag, AlignmentB,
    float, TileShape_MNK, ClusterShape_MNK, StageCountType, KernelScheduleType,
    cute::enable_if_t<cute::is_any_of_v<KernelScheduleType, mixgemm::KernelPrepackedCooperative,
                                        mixgemm::KernelPrepackedPingpong>>> {
  using OperandA = mixgemm::detail::PrepackedElementA<ElementPairA>;
  static_assert(cute::is_same_v<typename OperandA::ElementScale, ElementB>, "scales are stored in the activation type");
  static_assert(cute::is_same_v<GmemLayoutBTag, cutlass::layout::ColumnMajor>,
                "the activations are operand B, K-major (x[M, K] row-major)");
  static_assert(cute::is_same_v<ElementB, cutlass::bfloat16_t> || cute::is_same_v<ElementB, cutlass::half_t>,
                "activations are bf16 or fp16");

  template <int Stages>
  using Op = mixgemm::collective::CollectiveMmaPrepacked<typename OperandA::ElementCode, ElementB, OperandA::HasZero,
                                                         TileShape_MNK, ClusterShape_MNK, Stages, KernelScheduleType,
                                                         mixgemm::detail::PrepackedSmemLayoutAtomB<ElementB, TileShape_MNK>>;
  static constexpr int PipelineStages = mixgemm::detail::prepacked_stages<StageCountType, Op<2>::kStageSmemBytes>();
  static_assert(PipelineStages >= 2, "the tile does not fit two pipeline stages in shared memory");

  using CollectiveOp = Op<PipelineStages>;
};

}  // namespace cutlass::gemm::collective
