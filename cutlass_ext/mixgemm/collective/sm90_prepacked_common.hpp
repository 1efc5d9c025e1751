// mixgemm: what the two sm90 prepacked-weight mainloops share -- everything but their consumers'
// conversion and MMA.
//
//   * sm90_mma_prepacked.hpp:     bf16/fp16 activations, the weight dequantized into the A fragment
//                                 (wgmma k16), the grouped (MoE) form;
//   * sm90_mma_prepacked_fp8.hpp: e4m3 activations, the weight's codes converted exactly into e4m3
//                                 (wgmma k32), the group scales applied in float32.
//
// Both take operand A, the weight, from whole 16x64 atoms of the prepacked layout
// (python/mixgemm/weights/layout.py) that TMA brings into shared memory, and operand B, the
// activation tile, through TMA and swizzled shared memory straight into wgmma. The scales and
// zeros ([G, N_w], N_w contiguous) are loaded per k-tile by TMA, one row per group the k-tile
// touches (group_size is a runtime value: 32..256 or K); their transaction bytes are part of the
// stage's barrier, which is a runtime value in Params.
//
// Sm90PrepackedMainloop holds that common half: the tile geometry, the shared-memory layouts and
// pipeline, the arguments and params of the weight, the activations and the scales, their checks,
// the producer (one elected thread of the load warp issues each k-tile's TMA copies), and the
// consumer's reads of the weight chunks. A mainloop derives from it and adds its TiledMma's
// conversion (mma()) and whatever else it loads per stage (the e4m3 one: per-token scales).
//
// Grouped (MoE) form (Grouped = true): with Arguments::tile_expert set, A, the scales and the zeros
// hold num_experts stacked experts, and the producer loads token tile j's weights, scales and
// zeros from expert tile_expert[j] (a device table written by the routing; grouped_scheduler.hpp).
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/detail/layout.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "cutlass/trace.h"

#include "cute/algorithm/functional.hpp"
#include "cute/algorithm/gemm.hpp"
#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"

#include "mixgemm/chunk.hpp"
#include "mixgemm/tags.hpp"

namespace mixgemm::collective {

using namespace cute;

// Geometry of the prepacked layout (must match python/mixgemm/weights/layout.py).
constexpr int kAtomRows = 16;   // weight rows (n) per atom
constexpr int kAtomCols = 64;   // k per atom
constexpr int kLanes = 32;
constexpr int kMinGroup = 32;   // smallest supported group size

// ElementCode: the weight's integer code type (int2b_t .. uint8_t); ElementB: the activations as
// the MMA takes them; ElementScale: the scales' and zero points' type; KBlock: the K of one wgmma
// (16 for 16-bit operands, 32 for 8-bit ones); Grouped: whether the grouped (MoE) form is taken.
template <class ElementCode_, class ElementB_, class ElementScale_, bool HasZero_, class TileShape_,
          class ClusterShape_, int Stages_, class KernelSchedule_, class SmemLayoutAtomB_, int KBlock_,
          bool Grouped_>
struct Sm90PrepackedMainloop {
  //
  // Types the kernel layer reads
  //
  using DispatchPolicy = MainloopSm90Prepacked<Stages_, ClusterShape_, KernelSchedule_>;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using KernelSchedule = KernelSchedule_;
  using ArchTag = cutlass::arch::Sm90;
  using ElementA = ElementCode_;
  using ElementB = ElementB_;
  using ElementScale = ElementScale_;
  static constexpr bool HasZero = HasZero_;
  static constexpr bool Grouped = Grouped_;
  // A is prepacked, not strided; this nominal K-major stride only satisfies the kernel layer.
  using StrideA = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideB = cute::Stride<int64_t, cute::Int<1>, int64_t>;  // x[M_tok, K] row-major: K-major B

  static constexpr bool kCooperative =
      cute::is_base_of_v<cutlass::gemm::KernelTmaWarpSpecializedCooperative, KernelSchedule>;
  using AtomLayoutMNK = cute::conditional_t<kCooperative, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _1, _1>>>;
  using TiledMma = decltype(cute::make_tiled_mma(
      GMMA::rs_op_selector<ElementB, ElementB, float, TileShape, GMMA::Major::K, GMMA::Major::K>(),
      AtomLayoutMNK{}));
  using ElementAccumulator = float;

  static constexpr int kBits = cutlass::sizeof_bits<ElementCode_>::value;
  static constexpr int BLK_M = size<0>(TileShape{});
  static constexpr int BLK_N = size<1>(TileShape{});
  static constexpr int BLK_K = size<2>(TileShape{});
  static constexpr int Stages = Stages_;
  static constexpr int KBlock = KBlock_;
  static_assert(KBlock == 16 || KBlock == 32, "wgmma takes k16 (16-bit operands) or k32 (8-bit operands)");
  static_assert(BLK_K % kAtomCols == 0, "the k-tile must hold whole 64-wide atoms");
  static_assert(BLK_M % 64 == 0, "the weight tile must hold whole 64-row wgmma blocks");
  // Clusters run along the weight rows only: the CTAs of a cluster hold neighbouring weight tiles
  // of the same token tile, so each loads 1/kClusterM of the activation tile and multicasts it to
  // all of them (the activations are read from L2 once per cluster instead of once per CTA).
  static constexpr int kClusterM = size<0>(ClusterShape{});
  static_assert(size<1>(ClusterShape{}) == 1 && size<2>(ClusterShape{}) == 1,
                "mixgemm's prepacked mainloop clusters along the weight rows (the MMA's M mode) only");
  static_assert(kClusterM == 1 || kClusterM == 2 || kClusterM == 4, "a cluster of 1, 2 or 4 weight tiles");
  using GmemTiledCopyB = cute::conditional_t<kClusterM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;
  static_assert(Stages >= 2, "at least two pipeline stages");

  static constexpr int kAtomsK = BLK_K / kAtomCols;           // atoms per tile along K
  static constexpr int kAtomsM = BLK_M / kAtomRows;           // atoms per tile along N_w
  static constexpr int kAtomBytes = kAtomRows * kAtomCols * kBits / 8;
  static constexpr int kChunkBytes = kAtomBytes / kLanes;     // one lane's share: 4 * bits bytes
  static constexpr int kAtomWords = kAtomBytes / 8;           // TMA element: uint64
  static constexpr int kKBlocks = BLK_K / KBlock;             // wgmmas per k-tile
  static constexpr int kGroupRowsMax = BLK_K / kMinGroup;     // scale rows a k-tile may need
  static_assert(kGroupRowsMax <= 4, "mma(): the group rows of a k-tile are dispatched up to 4");

  //
  // Shared memory
  //
  using SmemLayoutA = Layout<Shape<Int<kAtomWords>, Int<kAtomsK>, Int<kAtomsM>>>;  // one stage
  using SmemLayoutAtomB = SmemLayoutAtomB_;
  using SmemLayoutB = decltype(tile_to_shape(SmemLayoutAtomB{},
                                             make_shape(Int<BLK_N>{}, Int<BLK_K>{}, Int<Stages>{}),
                                             Step<_1, _2, _3>{}));
  using SmemLayoutScaleRow = Layout<Shape<Int<BLK_M>, _1>>;   // TMA box: one group row of a tile
  static constexpr int kScaleStageElems = BLK_M * kGroupRowsMax;

  static constexpr size_t SmemAlignmentB = cutlass::detail::alignment_for_swizzle(SmemLayoutB{});
  static_assert(SmemAlignmentB >= 128);

  using MainloopPipeline = cutlass::PipelineTmaAsync<Stages>;
  using PipelineState = cutlass::PipelineState<Stages>;
  using PipelineParams = typename MainloopPipeline::Params;
  using PipelineStorage = typename MainloopPipeline::SharedStorage;
  static constexpr int NumProducerThreadEvents = 1;

  // A mainloop that loads more per stage derives its TensorStorage from this one.
  struct TensorStorage : cute::aligned_struct<128, _0> {
    alignas(SmemAlignmentB) cute::array_aligned<ElementB, cute::cosize_v<SmemLayoutB>> smem_B;
    alignas(128) cute::array_aligned<uint64_t, kAtomWords * kAtomsK * kAtomsM * Stages> smem_A;
    alignas(128) cute::array_aligned<ElementScale, kScaleStageElems * Stages> smem_scale;
    alignas(128) cute::array_aligned<ElementScale, HasZero ? kScaleStageElems * Stages : 8> smem_zero;
  };

  static constexpr uint32_t kStageBytesA = kAtomBytes * kAtomsK * kAtomsM;
  static constexpr uint32_t kStageBytesB = BLK_N * BLK_K * sizeof(ElementB);
  static constexpr uint32_t kBytesPerScaleRow = BLK_M * sizeof(ElementScale);
  // Shared memory one stage costs (for the builder's stage count).
  static constexpr int kStageSmemBytes =
      int(kStageBytesA + kStageBytesB + (HasZero ? 2 : 1) * kScaleStageElems * sizeof(ElementScale) +
          sizeof(typename cutlass::PipelineTmaAsync<1>::SharedStorage));

  //
  // Host-side arguments and device-side params
  //
  struct Arguments {
    uint8_t const* ptr_A = nullptr;       // prepacked weight, uint8 [N_w/16, K/64, 128*bits]
    ElementB const* ptr_B = nullptr;      // activations, [M_tok, K] with row stride dB
    StrideB dB{};
    ElementScale const* ptr_S = nullptr;  // scales [G, N_w], N_w contiguous
    ElementScale const* ptr_Z = nullptr;  // zero points [G, N_w] (HasZero only)
    int group_size = 0;
    // Grouped (MoE) form: A, S and Z hold num_experts stacked experts ([E, ...] of the above), and
    // token tile j of B reads expert tile_expert[j] (device memory, written by the routing;
    // grouped_scheduler.hpp). nullptr: one weight, the dense GEMM (the only form without Grouped).
    int32_t const* tile_expert = nullptr;
    int32_t num_experts = 1;
  };

  // TMA over the packed weight viewed as uint64 [atom words, K/64 atoms, N_w/16 atoms].
  using GmemLayoutA = Layout<Shape<Int<kAtomWords>, int32_t, int32_t>, Stride<_1, int64_t, int64_t>>;
  using GmemLayoutScale = Layout<Shape<int32_t, int32_t>, Stride<_1, int64_t>>;   // [N_w, G]
  using GmemLayoutB = Layout<Shape<int32_t, int32_t, int32_t>, StrideB>;

  struct Params {
    using TMA_A = decltype(make_tma_copy(SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<uint64_t const*>(nullptr)), GmemLayoutA{}),
        SmemLayoutA{}));
    using TMA_B = decltype(make_tma_copy_B_sm90(GmemTiledCopyB{},
        make_tensor(make_gmem_ptr(static_cast<ElementB const*>(nullptr)), GmemLayoutB{}),
        SmemLayoutB{}(_, _, Int<0>{}), TileShape{}, ClusterShape{}));
    using TMA_S = decltype(make_tma_copy(SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<ElementScale const*>(nullptr)), GmemLayoutScale{}),
        SmemLayoutScaleRow{}));
    TMA_A tma_load_a;
    TMA_B tma_load_b;
    TMA_S tma_load_scale;
    TMA_S tma_load_zero;
    uint32_t tma_transaction_bytes = 0;
    int32_t group_size = 0;
    int32_t group_rows_per_tile = 1;    // scale rows loaded per k-tile (power of two)
    int32_t k_atoms = 0;                // K / 64
    int32_t m_atoms = 0;                // N_w / 16
    int32_t groups = 0;                 // K / group_size
    int32_t const* tile_expert = nullptr;  // expert of each token tile (grouped form), or nullptr
    int32_t num_experts = 1;
  };

  // Scale rows a k-tile needs: BLK_K / group_size when the group is smaller than the tile, else 1.
  CUTLASS_HOST_DEVICE static int group_rows_per_tile(int group_size) {
    return group_size < BLK_K ? BLK_K / group_size : 1;
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    (void)workspace;
    auto [M, N, K, L] = append<4>(problem_shape, 1);    // M = N_w (weight rows), N = M_tok
    int32_t k_atoms = int32_t(K) / kAtomCols;
    int32_t m_atoms = int32_t(M) / kAtomRows;
    int32_t groups = int32_t(K) / args.group_size;
    int32_t experts = args.num_experts > 0 ? args.num_experts : 1;

    // Stacked experts are one taller weight ([E * N_w/16] atom rows) and E * G scale rows.
    auto gA = make_tensor(make_gmem_ptr(reinterpret_cast<uint64_t const*>(args.ptr_A)),
                          GmemLayoutA{make_shape(Int<kAtomWords>{}, k_atoms, m_atoms * experts),
                                      make_stride(_1{}, int64_t(kAtomWords), int64_t(kAtomWords) * k_atoms)});
    auto gB = make_tensor(make_gmem_ptr(args.ptr_B), make_layout(make_shape(int32_t(N), int32_t(K), int32_t(L)), args.dB));
    auto gS = make_tensor(make_gmem_ptr(args.ptr_S),
                          GmemLayoutScale{make_shape(int32_t(M), groups * experts), make_stride(_1{}, int64_t(M))});
    // With no zero points the zero TMA is a copy of the scale one and is never issued.
    auto gZ = make_tensor(make_gmem_ptr(HasZero ? args.ptr_Z : args.ptr_S),
                          GmemLayoutScale{make_shape(int32_t(M), groups * experts), make_stride(_1{}, int64_t(M))});

    int gpt = group_rows_per_tile(args.group_size);
    uint32_t tx = kStageBytesA + kStageBytesB + uint32_t(gpt) * kBytesPerScaleRow * (HasZero ? 2u : 1u);
    return {
      make_tma_copy(SM90_TMA_LOAD{}, gA, SmemLayoutA{}),
      make_tma_copy_B_sm90(GmemTiledCopyB{}, gB, SmemLayoutB{}(_, _, Int<0>{}), TileShape{}, ClusterShape{}),
      make_tma_copy(SM90_TMA_LOAD{}, gS, SmemLayoutScaleRow{}),
      make_tma_copy(SM90_TMA_LOAD{}, gZ, SmemLayoutScaleRow{}),
      tx, int32_t(args.group_size), int32_t(gpt), k_atoms, m_atoms, groups, args.tile_expert, experts};
  }

  // Why an argument set cannot run, or nullptr if it can. (can_implement's reason, for the
  // host helper's error message.)
  template <class ProblemShape>
  static char const* why_not(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    auto aligned16 = [](void const* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; };
    if (L != 1) return "batched (L > 1) problems are not supported";
    if constexpr (Grouped) {
      if (args.num_experts < 1) return "num_experts must be at least 1";
      if (args.tile_expert && M % BLK_M) return "the grouped form needs every expert's N to be a multiple of the weight tile";
    } else {
      if (args.tile_expert || args.num_experts != 1) return "this GEMM has no grouped (MoE) form yet";
    }
    if (M <= 0 || N <= 0 || K <= 0) return "empty problem";
    if (M % kAtomRows) return "N (weight rows) must be a multiple of 16";
    if (K % kAtomCols) return "K must be a multiple of 64";
    if (args.group_size <= 0 || K % args.group_size) return "group_size must divide K";
    if (args.group_size % KBlock) {
      return KBlock == 16 ? "group_size must be a multiple of 16"
                          : "group_size must be a multiple of 32 (the e4m3 MMA's k-block)";
    }
    if (!(args.group_size == K || BLK_K % args.group_size == 0 || args.group_size % BLK_K == 0))
      return "group_size must divide the k-tile, be a multiple of it, or equal K";
    if (!args.ptr_A || !args.ptr_B || !args.ptr_S) return "null weight, activation or scale pointer";
    if (HasZero && !args.ptr_Z) return "this kernel needs zero points";
    if (!aligned16(args.ptr_A) || !aligned16(args.ptr_B) || !aligned16(args.ptr_S) ||
        (HasZero && !aligned16(args.ptr_Z)))
      return "weight, activation, scale and zero pointers must be 16-byte aligned";
    if ((get<0>(args.dB) * int64_t(sizeof(ElementB))) % 16) return "the activations' row stride must be a multiple of 16 bytes";
    if ((int64_t(M) * int64_t(sizeof(ElementScale))) % 16) return "N must be a multiple of 8";
    return nullptr;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    char const* why = why_not(problem_shape, args);
    if (why) { CUTLASS_TRACE_HOST("  CAN IMPLEMENT: " << why << "\n"); }
    return why == nullptr;
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_b.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_scale.get_tma_descriptor());
    if constexpr (HasZero) {
      cute::prefetch_tma_descriptor(params.tma_load_zero.get_tma_descriptor());
    }
  }

  // The kernel layer reads the tile counts off gA_mkl/gB_nkl. A's tiles are addressed in atom
  // coordinates inside load(), so gA_mkl is only a coordinate tensor of the logical shape.
  template <class ProblemShape_MNKL, class AnyParams>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, AnyParams const& params) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    Tensor cA_mkl = make_identity_tensor(make_shape(M, K, L));
    Tensor mB_nkl = params.tma_load_b.get_tma_tensor(make_shape(N, K, L));
    Tensor gA_mkl = local_tile(cA_mkl, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BLK_M,BLK_K,m,k,l)
    Tensor gB_nkl = local_tile(mB_nkl, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BLK_N,BLK_K,n,k,l)
    return cute::make_tuple(gA_mkl, gB_nkl);
  }

  //
  // Producer: one elected thread of the load warp issues the TMA copies of a k-tile.
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
    load_stages(params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count,
                block_rank_in_cluster, shared_tensors, [](auto&, int) {});
  }

  // load()'s k-loop, run by the elected thread: A, B, the scales and the zeros of each k-tile,
  // then `more(tma_barrier, stage)`, where a derived mainloop issues the copies of its own
  // per-stage data on the stage's barrier.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord, class MoreCopies>
  CUTLASS_DEVICE void load_stages(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                  cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                                  KTileIterator k_tile_iter, int k_tile_count, uint32_t block_rank_in_cluster,
                                  TensorStorage& shared_tensors, MoreCopies&& more) {
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    // Grouped form: this token tile's expert, whose weight-row tiles follow the earlier experts'.
    int expert = 0;
    if constexpr (Grouped) {
      expert = params.tile_expert ? params.tile_expert[n_coord] : 0;
    }
    int const experts = Grouped ? params.num_experts : 1;
    int const m_tile = m_coord + expert * (params.m_atoms / kAtomsM);
    int const group0 = expert * params.groups;

    // A: uint64 [atom words, k atoms, m atoms]; one tile = (all words, kAtomsK, kAtomsM).
    Tensor mA = params.tma_load_a.get_tma_tensor(
        make_shape(Int<kAtomWords>{}, params.k_atoms, params.m_atoms * experts));
    Tensor gA = local_tile(mA, shape(SmemLayoutA{}), make_coord(_0{}, _, m_tile));       // (W,KA,MA,k)
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            append(SmemLayoutA{}, Layout<Int<Stages>, Int<cosize_v<SmemLayoutA>>>{}));  // (W,KA,MA,PIPE)
    auto tma_a = params.tma_load_a.get_slice(0);
    Tensor tAgA = tma_a.partition_S(gA);
    Tensor tAsA = tma_a.partition_D(sA);

    // B: the activation tile of this CTA's tokens. In a cluster this CTA loads its 1/kClusterM
    // slice of it and multicasts the slice to every CTA of the cluster (all hold the same tokens).
    Tensor gB_nkl = get<1>(load_inputs);
    Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);                                           // (BLK_N,BLK_K,k)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});    // (BLK_N,BLK_K,PIPE)
    auto tma_b = params.tma_load_b.get_slice(block_rank_in_cluster % kClusterM);
    uint16_t const mcast_mask_b = uint16_t((1u << kClusterM) - 1u);   // ignored without a cluster
    Tensor tBgB = tma_b.partition_S(gB);
    Tensor tBsB = tma_b.partition_D(sB);

    // Scales (and zeros): rows of [G, N_w]; a tile's rows land at [stage][row][BLK_M].
    Tensor mS = params.tma_load_scale.get_tma_tensor(
        make_shape(params.m_atoms * kAtomRows, params.groups * experts));
    Tensor gS = local_tile(mS, shape(SmemLayoutScaleRow{}), make_coord(m_coord, _));        // (BLK_M,1,g)
    Tensor sS = make_tensor(make_smem_ptr(shared_tensors.smem_scale.data()),
                            make_layout(make_shape(Int<BLK_M>{}, _1{}, Int<kGroupRowsMax * Stages>{})));
    auto tma_s = params.tma_load_scale.get_slice(0);
    Tensor tSgS = tma_s.partition_S(gS);
    Tensor tSsS = tma_s.partition_D(sS);
    Tensor mZ = params.tma_load_zero.get_tma_tensor(shape(mS));
    Tensor gZ = local_tile(mZ, shape(SmemLayoutScaleRow{}), make_coord(m_coord, _));
    Tensor sZ = make_tensor(make_smem_ptr(shared_tensors.smem_zero.data()),
                            make_layout(make_shape(Int<BLK_M>{}, _1{}, Int<kGroupRowsMax * Stages>{})));
    auto tma_z = params.tma_load_zero.get_slice(0);
    Tensor tZgZ = tma_z.partition_S(gZ);
    Tensor tZsZ = tma_z.partition_D(sZ);

    int const gpt = params.group_rows_per_tile;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      int stage = smem_pipe_write.index();
      int k_tile = *k_tile_iter;

      copy(params.tma_load_a.with(*tma_barrier), tAgA(_, _, _, _, k_tile), tAsA(_, _, _, _, stage));
      copy(params.tma_load_b.with(*tma_barrier, mcast_mask_b), tBgB(_, _, _, k_tile), tBsB(_, _, _, stage));
      int row0 = group0 + (k_tile * BLK_K) / params.group_size;
      for (int r = 0; r < gpt; ++r) {
        copy(params.tma_load_scale.with(*tma_barrier), tSgS(_, _, _, row0 + r), tSsS(_, _, _, stage * kGroupRowsMax + r));
        if constexpr (HasZero) {
          copy(params.tma_load_zero.with(*tma_barrier), tZgZ(_, _, _, row0 + r), tZsZ(_, _, _, stage * kGroupRowsMax + r));
        }
      }
      more(*tma_barrier, stage);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    if (cute::elect_one_sync()) {
      pipeline.producer_tail(smem_pipe_write);
    }
  }

  //
  // Consumer pieces
  //

  // A register set for one k-tile's converted A fragments, (MMA,MMA_M,MMA_K) of ElementB: one
  // wgmma per k-block, each taking four 32-bit registers of A.
  template <class ThrMma>
  CUTLASS_DEVICE static auto a_fragment(ThrMma const& thr_mma) {
    Tensor tileA = make_tensor(make_smem_ptr(static_cast<ElementB*>(nullptr)),
                               make_layout(make_shape(Int<BLK_M>{}, Int<BLK_K>{})));  // shape only
    auto frag = thr_mma.partition_fragment_A(tileA);
    static_assert(decltype(size<2>(frag))::value == kKBlocks, "one wgmma per k-block");
    static_assert(decltype(size<0>(recast<uint32_t>(frag)))::value == 4, "a wgmma's A fragment is four 32-bit registers");
    return frag;
  }

  // wgmma B descriptors over the swizzled activation tile: (MMA,MMA_N,MMA_K,PIPE).
  template <class ThrMma>
  CUTLASS_DEVICE static auto b_descriptors(ThrMma const& thr_mma, TensorStorage& shared_tensors) {
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    Tensor tCsB = thr_mma.partition_B(sB);
    return thr_mma.make_fragment_B(tCsB);
  }

  // Per 64-row block: the thread's atom row and the two tile rows (g, g + 8) it holds. Read off
  // the MMA's own thread-value layout, so the code follows whatever tiling TiledMma has.
  template <class ThrMma, int MMA_M>
  CUTLASS_DEVICE static void thread_rows(ThrMma const& thr_mma, int (&tile_row)[MMA_M], int (&atom_row)[MMA_M]) {
    Tensor cA = make_identity_tensor(make_shape(Int<BLK_M>{}, Int<BLK_K>{}));
    Tensor tCcA = thr_mma.partition_A(cA);                                   // (MMA,MMA_M,MMA_K) -> (m,k)
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < MMA_M; ++mm) {
      tile_row[mm] = get<0>(tCcA(0, mm, 0));
      atom_row[mm] = tile_row[mm] / kAtomRows;
    }
  }

  // The weight's stages in shared memory, as bytes (what load_chunks reads).
  CUTLASS_DEVICE static uint8_t const* smem_atoms(TensorStorage const& shared_tensors) {
    return reinterpret_cast<uint8_t const*>(shared_tensors.smem_A.data());
  }

  // The lane's chunks of a stage's atoms: kBits 32-bit words per (row block, k atom).
  template <int MMA_M>
  CUTLASS_DEVICE static void load_chunks(uint8_t const* smem_A, int stage, int const (&atom_row)[MMA_M], int lane,
                                         uint32_t (&chunk)[MMA_M][kAtomsK][kBits]) {
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < MMA_M; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int ka = 0; ka < kAtomsK; ++ka) {
        uint8_t const* src = smem_A + size_t(stage) * kStageBytesA +
                             size_t((atom_row[mm] * kAtomsK + ka) * kAtomBytes + lane * kChunkBytes);
        load_chunk<kChunkBytes>(src, chunk[mm][ka]);
      }
    }
  }

  // Wait for the last tile's wgmmas and release its stage (mma() released all earlier ones).
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release, int k_tile_count) {
    smem_pipe_release.advance(k_tile_count - 1);
    warpgroup_wait<0>();
    pipeline.consumer_release(smem_pipe_release);
  }
};

}  // namespace mixgemm::collective
