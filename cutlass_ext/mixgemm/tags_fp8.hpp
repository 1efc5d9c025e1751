// mixgemm: the tags that route CUTLASS's CollectiveBuilder to the e4m3 (FP8-activation) mainloop
// (collective/sm90_mma_prepacked_fp8.hpp, built by collective/builder_fp8.hpp).
//
// A kernel whose operand A names mixgemm::layout::PrepackedSm90 (tags.hpp), whose operand B is
// cutlass::float_e4m3_t and whose schedule is mixgemm::KernelPrepackedFp8Cooperative gets
// CollectiveMmaPrepackedFp8. The schedule derives from CUTLASS's cooperative one, so the kernel
// layer (GemmUniversal) is the warp-specialized cooperative kernel; the dispatch policy is the
// bf16 mainloop's (tags.hpp's MainloopSm90Prepacked, which names the schedule).
#pragma once

#include "cutlass/gemm/dispatch_policy.hpp"

#include "mixgemm/tags.hpp"

namespace mixgemm {

struct KernelPrepackedFp8Cooperative : cutlass::gemm::KernelTmaWarpSpecializedCooperative {};

}  // namespace mixgemm
