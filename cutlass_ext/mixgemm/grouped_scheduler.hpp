// mixgemm: the tile scheduler of the grouped (MoE) sm90 GEMM over token tiles of one expert each.
//
//   y[r, :] = x[r, :] @ dequant(W_{e(r)})^T      for the rows r of a padded, expert-sorted x
//
// The routing (python/mixgemm/moe_padding.py) lays x's rows out so that every expert's rows start
// at a multiple of the token tile (BLK_N, the MMA's N mode): each token tile then belongs to one
// expert. It writes a table in device memory,
//
//   tiles[0]      = the number of token tiles in use, U (<= the problem's tile count along N),
//   tiles[1 + j]  = the expert of token tile j, j < U,
//
// which this scheduler and the prepacked mainloop (collective/sm90_mma_prepacked.hpp) read on the
// GPU: the launch needs no host sync and can be replayed in a CUDA graph with routing that
// changes between replays.
//
// The scheduler is CUTLASS's static persistent sm90 scheduler with the walk replaced: the output
// tiles are the U token tiles x the weight-row tiles of one expert, in one of two orders (the
// launch's raster order):
//   * token tiles fastest (RasterOrderOptions::AlongN or Heuristic): CTAs running at the same time
//     share a weight tile through L2 -- for few experts with several token tiles each;
//   * weight-row tiles fastest (AlongM): CTAs running at the same time share a token tile's rows
//     of x through L2 -- for many experts, whose token tiles' x would not stay in L2 while every
//     weight-row tile walks past them.
// Tiles past U are never scheduled (their rows are padding or unused capacity). The work tile's L
// index is always 0: the whole padded x and y are one problem of the kernel; only the mainloop's
// weight, scale and zero loads follow the expert.
#pragma once

#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace mixgemm {

// The scheduler tag (registered in cutlass_library's TileSchedulerTag table by
// python/mixgemm/codegen.py).
struct GroupedTokenTiles {};

namespace kernel {

// (Outside the class: a nested struct with member initializers cannot be a default argument of
// its enclosing class's functions.)
struct GroupedTokenTileArguments {
  using RasterOrderOptions = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::RasterOrderOptions;
  int max_swizzle_size = 1;                                       // unused
  RasterOrderOptions raster_order = RasterOrderOptions::Heuristic;  // AlongM: weight-row tiles fastest
  int32_t const* tiles = nullptr;                                 // device: [U, expert of tile 0, ...]
};

class GroupedTokenTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using RasterOrder = typename Base::RasterOrder;
  using RasterOrderOptions = typename Base::RasterOrderOptions;

  using Arguments = GroupedTokenTileArguments;

  struct Params : Base::Params {
    int32_t const* tiles = nullptr;
    int32_t tiles_m = 0;                                       // weight-row tiles of one expert
    int32_t tiles_n = 0;                                       // token tiles the problem holds (>= U)
    bool weights_fastest = false;                              // the walk's order (see the top)
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    static_assert(cute::size(ClusterShape{}) == 1, "the grouped scheduler runs without clusters");
    typename Base::Arguments base;
    base.max_swizzle_size = 1;
    base.raster_order = RasterOrderOptions::AlongN;
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        problem_shape_mnkl, tile_shape, cluster_shape, hw_info, base, workspace, epilogue_subtile,
        ktile_start_alignment_count);
    params.tiles = arguments.tiles;
    params.tiles_m = int32_t(cute::ceil_div(cute::get<0>(problem_shape_mnkl), cute::get<0>(tile_shape)));
    params.tiles_n = int32_t(cute::ceil_div(cute::get<1>(problem_shape_mnkl), cute::get<1>(tile_shape)));
    params.weights_fastest = arguments.raster_order == RasterOrderOptions::AlongM;
    return params;
  }

  CUTLASS_HOST_DEVICE static bool can_implement(Arguments const& args) { return args.tiles != nullptr; }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, ProblemShape, cutlass::KernelHardwareInfo const&, uint32_t,
                                   const uint32_t = 1, uint32_t = 1) {
    return 0;
  }

  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  // The persistent grid: at most one CTA per SM, at most one per tile the problem may hold.
  template <class ProblemShapeMNKL, class BlockShape, class ClusterShape>
  static dim3 get_grid_shape(Params const& params, ProblemShapeMNKL problem_shape_mnk, BlockShape cta_shape,
                             ClusterShape cluster_shape, cutlass::KernelHardwareInfo hw_info,
                             Arguments arguments = Arguments{}, bool truncate_by_problem_size = true) {
    (void)problem_shape_mnk; (void)cta_shape; (void)cluster_shape; (void)arguments; (void)truncate_by_problem_size;
    int64_t tiles = int64_t(params.tiles_m) * int64_t(params.tiles_n);
    int64_t sms = hw_info.sm_count > 0 ? hw_info.sm_count : 1;
    return dim3(uint32_t(tiles < sms ? (tiles > 0 ? tiles : 1) : sms), 1, 1);
  }

  CUTLASS_HOST_DEVICE GroupedTokenTileScheduler() {}

  CUTLASS_DEVICE explicit GroupedTokenTileScheduler(Params const& params)
      : Base(static_cast<typename Base::Params const&>(params)) {
#if defined(__CUDA_ARCH__)
    linear_idx_ = uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x +
                  uint64_t(blockIdx.z) * gridDim.x * gridDim.y;
    grid_size_ = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
    tiles_m_ = params.tiles_m;
    weights_fastest_ = params.weights_fastest;
    int32_t used = __ldg(params.tiles);
    tiles_n_ = used < 0 ? 0 : (used > params.tiles_n ? params.tiles_n : used);
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) { return get_current_work(); }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return work_for(linear_idx_); }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    linear_idx_ += grid_size_ * uint64_t(advance_count);
  }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    return !work_for(linear_idx_ + grid_size_ * uint64_t(advance_count)).is_valid();
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  // Tile i of the walk: token tile i % U and weight-row tile i / U, or (weights fastest) weight-row
  // tile i % M and token tile i / M.
  CUTLASS_DEVICE WorkTileInfo work_for(uint64_t idx) const {
    if (tiles_n_ <= 0 || idx >= uint64_t(tiles_m_) * uint64_t(tiles_n_)) {
      return WorkTileInfo::invalid_work_tile();
    }
    uint32_t i = uint32_t(idx);
    if (weights_fastest_) {
      return {int32_t(i % uint32_t(tiles_m_)), int32_t(i / uint32_t(tiles_m_)), 0, true};
    }
    return {int32_t(i / uint32_t(tiles_n_)), int32_t(i % uint32_t(tiles_n_)), 0, true};
  }

  uint64_t linear_idx_ = 0;
  uint64_t grid_size_ = 1;
  int32_t tiles_m_ = 0;
  int32_t tiles_n_ = 0;
  bool weights_fastest_ = false;
};

}  // namespace kernel
}  // namespace mixgemm

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<mixgemm::GroupedTokenTiles, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = mixgemm::kernel::GroupedTokenTileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
