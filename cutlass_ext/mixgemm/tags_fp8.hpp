// mixgemm: the tags that route CUTLASS's CollectiveBuilder to the e4m3 (FP8-activation) mainloop
// (collective/sm90_mma_prepacked_fp8.hpp, built by collective/builder_fp8.hpp).
//
// A kernel whose operand A names mixgemm::layout::PrepackedSm90 (tags.hpp), whose operand B is
// cutlass::float_e4m3_t and whose schedule is mixgemm::KernelPrepackedFp8Cooperative gets
// CollectiveMmaPrepackedFp8. The schedule derives from CUTLASS's cooperative one, so the kernel
// layer (GemmUniversal) is the warp-specialized cooperative kernel.
#pragma once

#include "cutlass/arch/arch.h"
#include "cutlass/gemm/dispatch_policy.hpp"

#include "mixgemm/tags.hpp"

namespace mixgemm {

struct KernelPrepackedFp8Cooperative : cutlass::gemm::KernelTmaWarpSpecializedCooperative {};

// Dispatch policy of CollectiveMmaPrepackedFp8.
template <int Stages_, class ClusterShape_, class KernelSchedule_>
struct MainloopSm90PrepackedFp8 {
  static constexpr int Stages = Stages_;
  using ClusterShape = ClusterShape_;
  using ArchTag = cutlass::arch::Sm90;
  using Schedule = KernelSchedule_;
};

}  // namespace mixgemm
