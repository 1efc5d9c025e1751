// mixgemm: CUTLASS's sm90 stream-K tile scheduler with self-resetting locks, kept apart from the
// partial sums, so that a launch needs no zeroed workspace.
//
// CUTLASS's stream-K scheduler (PersistentTileSchedulerSm90StreamK) keeps one workspace: the
// partial accumulators of the split tiles, then one lock (an arrival counter) per split tile and
// consumer warp group, which must be zero when the kernel starts. So every launch is preceded by a
// memset of the workspace, a second node in a CUDA graph and a dependency before the kernel
// (docs/kernels.md: ~3.5 us per launch in a one-launch graph, ~2.2 us inside a decode step).
//
// This scheduler is that scheduler with two changes:
//   * the locks live in their own device memory (Arguments::locks, lock_bytes() of it), which the
//     caller zeroes once: the unit that finishes a tile (the final split, which waits until every
//     earlier split of the tile has arrived) sets the tile's lock back to zero after that wait, and
//     nothing touches the lock afterwards in the launch. So the locks are zero again when the
//     kernel ends, and the next launch in stream order may use the same memory with no memset;
//   * the workspace holds the partial sums only (get_workspace_size()), which need no zeroing: the
//     first split of a tile stores, the later ones add.
// Everything else (the decomposition, the walk, the reduction order: ReductionMode::Deterministic)
// is CUTLASS's. Separate-reduction units (disabled in CUTLASS 4.2) are refused at launch
// (separate_reduction()).
//
// The runtime keeps one lock region per stream, zeroed when it is made (python/mixgemm/plans.py:
// LockArenas), and one per CUDA graph capture, zeroed by one memset node at the capture's first
// stream-K launch. Two launches may share locks only in stream order: never concurrently.
#pragma once

#include "cutlass/barrier.h"
#include "cutlass/block_striped.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler_stream_k.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace mixgemm {

// The scheduler tag (registered in cutlass_library's TileSchedulerTag table by
// python/mixgemm/codegen.py).
struct StreamKSelfResetting {};

namespace kernel {

template <class TileShape, class ClusterShape>
class StreamKSelfResettingScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape>;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using BarrierType = typename Base::BarrierType;
  using RasterOrder = typename Base::RasterOrder;
  using RasterOrderOptions = typename Base::RasterOrderOptions;

  struct Arguments : Base::Arguments {
    BarrierType* locks = nullptr;   // lock_bytes() of zeroed device memory, left zeroed
  };

  struct Params : Base::Params {
    BarrierType* locks = nullptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shape, TileShape tile_shape, ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        void* workspace, const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        problem_shape, tile_shape, cluster_shape, hw_info, args, workspace, epilogue_subtile,
        ktile_start_alignment_count);
    params.locks = args.locks;
    return params;
  }

  // Bytes of (partials, locks) that CUTLASS's stream-K scheduler would lay out in one workspace.
  template <class ProblemShape, class ElementAccumulator>
  static void component_sizes(Arguments const& args, ProblemShape problem_shape,
                              cutlass::KernelHardwareInfo const& hw_info, uint32_t mma_warp_groups,
                              uint32_t epilogue_subtile, size_t& partials, size_t& locks) {
    auto problem_shape_mnkl = cute::append<4>(problem_shape, 1);
    dim3 problem_blocks = Base::get_tiled_cta_shape_mnl(problem_shape_mnkl, TileShape{}, ClusterShape{});
    uint32_t k_tiles = cute::size(cute::ceil_div(cute::shape<2>(problem_shape_mnkl), cute::shape<2>(TileShape{})));
    partials = 0;
    locks = 0;
    Base::Params::get_workspace_component_sizes(
        problem_blocks, k_tiles, cutlass::gemm::to_gemm_coord(TileShape{}),
        cutlass::gemm::to_gemm_coord(ClusterShape{}), locks, partials, hw_info, args.splits,
        args.max_swizzle_size, args.raster_order, args.decomposition_mode, args.reduction_mode, mma_warp_groups,
        cutlass::sizeof_bits<BarrierType>::value, cutlass::sizeof_bits<ElementAccumulator>::value,
        epilogue_subtile);
  }

  // The workspace: the partial sums only.
  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const& args, ProblemShape problem_shape,
                                   cutlass::KernelHardwareInfo const& hw_info, uint32_t mma_warp_groups,
                                   const uint32_t epilogue_subtile = 1, uint32_t = 1) {
    size_t partials, locks;
    component_sizes<ProblemShape, ElementAccumulator>(args, problem_shape, hw_info, mma_warp_groups,
                                                      epilogue_subtile, partials, locks);
    return partials;
  }

  // The zeroed lock memory a launch needs at Arguments::locks (0: no tile is split).
  template <class ProblemShape, class ElementAccumulator>
  static size_t lock_bytes(Arguments const& args, ProblemShape problem_shape,
                           cutlass::KernelHardwareInfo const& hw_info, uint32_t mma_warp_groups,
                           const uint32_t epilogue_subtile = 1) {
    size_t partials, locks;
    component_sizes<ProblemShape, ElementAccumulator>(args, problem_shape, hw_info, mma_warp_groups,
                                                      epilogue_subtile, partials, locks);
    return locks;
  }

  // Nothing to initialize: the partials need no zeroing, and the locks are the caller's.
  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  // Why a launch with these params cannot run (nullptr if it can).
  static char const* why_not(Params const& params, size_t lock_bytes) {
    if (params.requires_separate_reduction()) return "separate-reduction stream-K units are not supported";
    if (lock_bytes && params.locks == nullptr) return "this stream-K launch needs its zeroed lock memory";
    return nullptr;
  }

  CUTLASS_HOST_DEVICE StreamKSelfResettingScheduler() {}

  CUTLASS_DEVICE explicit StreamKSelfResettingScheduler(Params const& params)
      : Base(static_cast<typename Base::Params const&>(params)) {}

  // The reduction across the splits of a tile: CUTLASS's deterministic order (the first split
  // stores its partials, each later one waits for its turn and adds, the final one adds them to its
  // accumulators and runs the epilogue), with the locks at params.locks and the final split
  // setting its tile's lock back to zero.
  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup(Params const& params, WorkTileInfo const& work_tile_info,
                                   FrgTensorC& accumulators, uint32_t num_barriers, uint32_t barrier_idx) {
    static constexpr uint32_t Offset = static_cast<int>(cutlass::arch::ReservedNamedBarriers::StreamkBarrier0);
    static constexpr uint32_t MaxNumNamedBarriers = 2;
    using BarrierManager = cutlass::NamedBarrierManager<cutlass::NumThreadsPerWarpGroup, Offset, MaxNumNamedBarriers>;
    using ElementAccumulator = typename FrgTensorC::value_type;
    using AccumulatorArrayT = cutlass::Array<ElementAccumulator, cute::size(FrgTensorC{})>;
    using BlockStripedReduceT = cutlass::BlockStripedReduce<BarrierManager::ThreadCount, AccumulatorArrayT>;

    if (!Base::requires_fixup(params, work_tile_info)) return;

    uint64_t tile_idx = Base::output_tile_index(params, work_tile_info);
    uint64_t lock_idx = tile_idx * num_barriers + barrier_idx;
    // Each warp group's stripe of the tile's partials (BlockStripedReduce over the group's threads).
    uint64_t offset = uint64_t(cute::size<0>(TileShape{})) * uint64_t(cute::size<1>(TileShape{})) * tile_idx +
                      uint64_t(cute::size(accumulators)) * barrier_idx * BarrierManager::ThreadCount;
    auto* partials = reinterpret_cast<AccumulatorArrayT*>(
        reinterpret_cast<ElementAccumulator*>(params.reduction_workspace_) + offset);
    auto* acc = reinterpret_cast<AccumulatorArrayT*>(accumulators.data());
    BarrierType* locks = params.locks;
    uint32_t thread = threadIdx.x % BarrierManager::ThreadCount;

    if (!Base::compute_epilogue(work_tile_info, params)) {
      if (work_tile_info.K_idx == 0) {
        BlockStripedReduceT::store(partials, *acc, thread);
      } else {
        BarrierManager::wait_eq(barrier_idx, locks, thread, lock_idx, work_tile_info.K_idx);
        BlockStripedReduceT::reduce(partials, *acc, thread);
      }
      BarrierManager::arrive_inc(barrier_idx, locks, thread, lock_idx, work_tile_info.k_tile_count);
    } else {
      // Every earlier split of the tile has arrived (their k tiles sum to K_idx) and none touches
      // the lock again: reset it for the next launch.
      BarrierManager::wait_eq(barrier_idx, locks, thread, lock_idx, work_tile_info.K_idx);
      if (thread == 0) locks[lock_idx] = 0;
      BlockStripedReduceT::load_add(*acc, partials, thread);
    }
  }
};

}  // namespace kernel
}  // namespace mixgemm

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<mixgemm::StreamKSelfResetting, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = mixgemm::kernel::StreamKSelfResettingScheduler<TileShape, ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail
