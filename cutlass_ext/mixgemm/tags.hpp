// mixgemm: tag types that route CUTLASS's CollectiveBuilder to mixgemm's mainloop.
//
// cutlass_library emits ordinary CollectiveBuilder instantiations; mixgemm registers these tags
// in cutlass_library's tag tables (python/mixgemm/codegen.py), so an emitted kernel that names
//   * the layout tag  mixgemm::layout::PrepackedSm90  for operand A, and
//   * a schedule tag  mixgemm::KernelPrepacked{Cooperative,Pingpong}
// gets mixgemm's CollectiveMmaPrepacked (collective/sm90_mma_prepacked.hpp) from the builder
// (collective/builder.hpp) instead of CUTLASS's stock mixed-input mainloop. The schedule tags
// derive from CUTLASS's, so the kernel layer (GemmUniversal) picks the matching warp-specialized
// cooperative or ping-pong kernel.
#pragma once

#include "cutlass/arch/arch.h"
#include "cutlass/detail/layout.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"

namespace mixgemm {
namespace layout {

// Operand A (the weight) in the sm90a prepacked layout: 16x64 atoms of codes, each lane's 32
// values contiguous, atoms [N/16][K/64] (python/mixgemm/layout.py documents the byte map).
struct PrepackedSm90 {};

}  // namespace layout

struct KernelPrepackedCooperative : cutlass::gemm::KernelTmaWarpSpecializedCooperative {};
struct KernelPrepackedPingpong : cutlass::gemm::KernelTmaWarpSpecializedPingpong {};

// Dispatch policy of CollectiveMmaPrepacked.
template <int Stages_, class ClusterShape_, class KernelSchedule_>
struct MainloopSm90Prepacked {
  static constexpr int Stages = Stages_;
  using ClusterShape = ClusterShape_;
  using ArchTag = cutlass::arch::Sm90;
  using Schedule = KernelSchedule_;
};

}  // namespace mixgemm

namespace cutlass::detail {
// To CUTLASS's generic builder machinery the prepacked weight is a K-major operand A (it is,
// atom by atom); the mainloop never uses this stride to address it.
template <>
struct TagToStrideA<mixgemm::layout::PrepackedSm90> {
  using type = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using tag = mixgemm::layout::PrepackedSm90;
};
}  // namespace cutlass::detail
