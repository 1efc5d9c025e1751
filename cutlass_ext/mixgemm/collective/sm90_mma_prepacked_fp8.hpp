// mixgemm: sm90 warp-specialized mainloop for prepacked 4- and 2-bit weights x e4m3 activations.
//
//   D[N_w, M_tok] = s_x[M_tok] * sum_g s_w[N_w, g] * (A_g[N_w, K_g] * B[M_tok, K_g]^T)
//
// A is the weight, operand A of a register-sourced wgmma.m64nNk32 e4m3 x e4m3 -> f32: TMA brings
// whole 16x64 atoms of the prepacked weight (python/mixgemm/weights/layout.py) into shared
// memory, each consumer lane reads its chunk of an atom and converts it into the 8-bit A
// fragment with converters/mixgemm/e4m3.hpp: the codes q (signed) or u - z (unsigned, z the
// group's integer zero point) are exact in e4m3, and no scale is applied to them. B is the
// activation tile, e4m3 quantized per token by mixgemm's quantizer (quant_fp8_kernel.hpp) in the
// MMA's K order (a permutation inside every 32 columns, e4m3.hpp), so it is a plain K-major
// operand: TMA into swizzled shared memory, read by wgmma through descriptors.
//
// Scales (docs/fp8.md):
//   * the weight's group scales s_w [G, N_w] (bf16/fp16, loaded per k-tile by TMA like the bf16
//     mainloop's) are applied in float32: each k-tile's wgmmas accumulate into a group
//     accumulator that starts at zero, and after them accum += s_w[row, g] * acc_g. A k-tile holds
//     one group (groups of BLK_K or more: one segment) or BLK_K / group_size of them (a segment of
//     wgmmas each, with its own promotion). Promoting at least once per k-tile also keeps each
//     tensor-core accumulation short (BLK_K products), which bounds the error of the FP8 tensor
//     cores' reduced-precision accumulation.
//   * the per-token scales s_x [M_tok] (float32) are loaded by TMA with each stage (BLK_N floats)
//     and applied to the accumulator once, after the last k-tile, from that tile's stage; the
//     epilogue (bias, activation, rounding) then runs on the scaled accumulator as for bf16.
//
// Schedule: a k-tile's conversion into one of two register sets runs while the other set's
// wgmmas (the previous k-tile) are in flight; each k-tile then waits for its wgmmas and promotes.
//
// The collective implements the interface of CUTLASS's sm90 warp-specialized cooperative
// GemmUniversal kernel with the persistent tile scheduler (a work unit is a whole output tile:
// the consumer counts k-tiles from 0 to find its groups). No clusters, no grouped form yet.
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
#include "cute/arch/copy_sm90.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"

#include "mixgemm/chunk.hpp"
#include "mixgemm/e4m3.hpp"
#include "mixgemm/collective/sm90_mma_prepacked.hpp"   // the prepacked layout's geometry (kAtomRows, ...)
#include "mixgemm/tags_fp8.hpp"

namespace mixgemm::collective {

using namespace cute;

namespace fp8 {

// Bits and signedness of a CUTLASS code type.
template <class Code> struct CodeTraits;
template <int Bits, bool Signed> struct CodeBits {
  static constexpr int kBits = Bits;
  static constexpr bool kSigned = Signed;
};
template <> struct CodeTraits<cutlass::int4b_t> : CodeBits<4, true> {};
template <> struct CodeTraits<cutlass::uint4b_t> : CodeBits<4, false> {};
template <> struct CodeTraits<cutlass::int2b_t> : CodeBits<2, true> {};
template <> struct CodeTraits<cutlass::uint2b_t> : CodeBits<2, false> {};

template <class T> struct HalfOf;
template <> struct HalfOf<cutlass::bfloat16_t> { static constexpr Half value = Half::kBF16; };
template <> struct HalfOf<cutlass::half_t> { static constexpr Half value = Half::kFP16; };

}  // namespace fp8

template <class ElementCode_, class ElementScale_, bool HasZero_, class TileShape_, class ClusterShape_,
          int Stages_, class KernelSchedule_, class SmemLayoutAtomB_>
struct CollectiveMmaPrepackedFp8 {
  //
  // Types the kernel layer reads
  //
  using DispatchPolicy = MainloopSm90PrepackedFp8<Stages_, ClusterShape_, KernelSchedule_>;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using KernelSchedule = KernelSchedule_;
  using ArchTag = cutlass::arch::Sm90;
  using ElementA = ElementCode_;                 // the integer code type (int2b_t .. uint4b_t)
  using ElementB = cutlass::float_e4m3_t;
  // What abi::GemmArgs::x points to: gemm_entry.hpp's make_arguments casts it to this type.
  using ElementAct = ElementB;
  using ElementScale = ElementScale_;            // the weight's scales and zero points (bf16 / fp16)
  static constexpr bool HasZero = HasZero_;
  // A is prepacked, not strided; this nominal K-major stride only satisfies the kernel layer.
  using StrideA = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideB = cute::Stride<int64_t, cute::Int<1>, int64_t>;  // xq[M_tok, K] row-major: K-major B

  static_assert(cute::is_base_of_v<cutlass::gemm::KernelTmaWarpSpecializedCooperative, KernelSchedule>,
                "the e4m3 mainloop runs in the cooperative kernel");
  using AtomLayoutMNK = Layout<Shape<_2, _1, _1>>;
  using TiledMma = decltype(cute::make_tiled_mma(
      GMMA::rs_op_selector<ElementB, ElementB, float, TileShape, GMMA::Major::K, GMMA::Major::K>(),
      AtomLayoutMNK{}));
  using ElementAccumulator = float;

  using Codes = fp8::CodeTraits<ElementCode_>;
  static constexpr int kBits = Codes::kBits;
  static constexpr bool kSigned = Codes::kSigned;
  static_assert(HasZero != kSigned, "unsigned codes have zero points, signed codes none");
  using Conv = mixgemm::PrepackedE4M3<kBits, kSigned>;
  static constexpr Half kHalf = fp8::HalfOf<ElementScale>::value;
  static constexpr int kTableWords = Conv::kTableWords;

  static constexpr int BLK_M = size<0>(TileShape{});
  static constexpr int BLK_N = size<1>(TileShape{});
  static constexpr int BLK_K = size<2>(TileShape{});
  static constexpr int Stages = Stages_;
  static_assert(BLK_K % kAtomCols == 0, "the k-tile must hold whole 64-wide atoms");
  static_assert(BLK_M % 128 == 0, "each consumer warp group takes whole 64-row wgmma blocks");
  static_assert(size(ClusterShape{}) == 1, "the e4m3 mainloop has no cluster form yet");
  static_assert(Stages >= 2, "at least two pipeline stages");

  static constexpr int kAtomsK = BLK_K / kAtomCols;           // atoms per tile along K
  static constexpr int kAtomsM = BLK_M / kAtomRows;           // atoms per tile along N_w
  static constexpr int kAtomBytes = kAtomRows * kAtomCols * kBits / 8;
  static constexpr int kChunkBytes = kAtomBytes / kLanes;     // one lane's share: 4 * bits bytes
  static constexpr int kAtomWords = kAtomBytes / 8;           // TMA element: uint64
  static constexpr int kKBlocks = BLK_K / 32;                 // wgmma k32 blocks per tile
  static constexpr int kGroupRowsMax = BLK_K / kMinGroup;     // scale rows a k-tile may need
  static_assert(kGroupRowsMax <= 4, "mma(): the group rows of a k-tile are dispatched up to 4");
  // Per-token scales of a stage: BLK_N floats, each stage's row 128-byte aligned (TMA).
  static constexpr int kTokenStride = (BLK_N + 31) / 32 * 32;

  //
  // Shared memory
  //
  using SmemLayoutA = Layout<Shape<Int<kAtomWords>, Int<kAtomsK>, Int<kAtomsM>>>;  // one stage
  using SmemLayoutAtomB = SmemLayoutAtomB_;
  using SmemLayoutB = decltype(tile_to_shape(SmemLayoutAtomB{},
                                             make_shape(Int<BLK_N>{}, Int<BLK_K>{}, Int<Stages>{}),
                                             Step<_1, _2, _3>{}));
  using SmemLayoutScaleRow = Layout<Shape<Int<BLK_M>, _1>>;   // TMA box: one group row of a tile
  using SmemLayoutTokenRow = Layout<Shape<Int<BLK_N>, _1>>;   // TMA box: the tile's token scales
  static constexpr int kScaleStageElems = BLK_M * kGroupRowsMax;

  static constexpr size_t SmemAlignmentB = cutlass::detail::alignment_for_swizzle(SmemLayoutB{});
  static_assert(SmemAlignmentB >= 128);

  using MainloopPipeline = cutlass::PipelineTmaAsync<Stages>;
  using PipelineState = cutlass::PipelineState<Stages>;
  using PipelineParams = typename MainloopPipeline::Params;
  static constexpr int NumProducerThreadEvents = 1;

  struct SharedStorage {
    struct TensorStorage : cute::aligned_struct<128, _0> {
      alignas(SmemAlignmentB) cute::array_aligned<ElementB, cute::cosize_v<SmemLayoutB>> smem_B;
      alignas(128) cute::array_aligned<uint64_t, kAtomWords * kAtomsK * kAtomsM * Stages> smem_A;
      alignas(128) cute::array_aligned<ElementScale, kScaleStageElems * Stages> smem_scale;
      alignas(128) cute::array_aligned<ElementScale, HasZero ? kScaleStageElems * Stages : 8> smem_zero;
      alignas(128) cute::array_aligned<float, kTokenStride * Stages> smem_token;
    } tensors;
    using PipelineStorage = typename MainloopPipeline::SharedStorage;
    PipelineStorage pipeline;
  };
  using TensorStorage = typename SharedStorage::TensorStorage;
  using PipelineStorage = typename SharedStorage::PipelineStorage;

  static constexpr uint32_t kStageBytesA = kAtomBytes * kAtomsK * kAtomsM;
  static constexpr uint32_t kStageBytesB = BLK_N * BLK_K * sizeof(ElementB);
  static constexpr uint32_t kBytesPerScaleRow = BLK_M * sizeof(ElementScale);
  static constexpr uint32_t kBytesTokens = BLK_N * sizeof(float);
  // Shared memory one stage costs (for the builder's stage count).
  static constexpr int kStageSmemBytes =
      int(kStageBytesA + kStageBytesB + (HasZero ? 2 : 1) * kScaleStageElems * sizeof(ElementScale) +
          kTokenStride * sizeof(float) + sizeof(typename cutlass::PipelineTmaAsync<1>::SharedStorage));

  //
  // Host-side arguments and device-side params
  //
  struct Arguments {
    uint8_t const* ptr_A = nullptr;       // prepacked weight, uint8 [N_w/16, K/64, 128*bits]
    ElementB const* ptr_B = nullptr;      // quantized activations xq, [M_tok, K] with row stride dB
    StrideB dB{};
    void const* ptr_S = nullptr;          // ElementScale scales [G, N_w], N_w contiguous
    void const* ptr_Z = nullptr;          // ElementScale zero points [G, N_w] (HasZero only)
    int group_size = 0;
    // The grouped (MoE) form of the bf16 mainloop; gemm_entry.hpp sets these. Not supported here:
    // tile_expert must stay null and num_experts 1.
    int32_t const* tile_expert = nullptr;
    int32_t num_experts = 1;
    float const* ptr_XS = nullptr;        // per-token scales s_x [M_tok] (float32)
  };

  // TMA over the packed weight viewed as uint64 [atom words, K/64 atoms, N_w/16 atoms].
  using GmemLayoutA = Layout<Shape<Int<kAtomWords>, int32_t, int32_t>, Stride<_1, int64_t, int64_t>>;
  using GmemLayoutScale = Layout<Shape<int32_t, int32_t>, Stride<_1, int64_t>>;   // [N_w, G]
  using GmemLayoutTokens = Layout<Shape<int32_t, int32_t>, Stride<_1, int64_t>>;  // [M_tok, 1]
  using GmemLayoutB = Layout<Shape<int32_t, int32_t, int32_t>, StrideB>;

  struct Params {
    using TMA_A = decltype(make_tma_copy(SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<uint64_t const*>(nullptr)), GmemLayoutA{}),
        SmemLayoutA{}));
    using TMA_B = decltype(make_tma_copy_B_sm90(SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<ElementB const*>(nullptr)), GmemLayoutB{}),
        SmemLayoutB{}(_, _, Int<0>{}), TileShape{}, ClusterShape{}));
    using TMA_S = decltype(make_tma_copy(SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<ElementScale const*>(nullptr)), GmemLayoutScale{}),
        SmemLayoutScaleRow{}));
    using TMA_X = decltype(make_tma_copy(SM90_TMA_LOAD{},
        make_tensor(make_gmem_ptr(static_cast<float const*>(nullptr)), GmemLayoutTokens{}),
        SmemLayoutTokenRow{}));
    TMA_A tma_load_a;
    TMA_B tma_load_b;
    TMA_S tma_load_scale;
    TMA_S tma_load_zero;
    TMA_X tma_load_token;
    uint32_t tma_transaction_bytes = 0;
    int32_t group_size = 0;
    int32_t group_rows_per_tile = 1;    // scale rows loaded per k-tile (power of two)
    int32_t k_atoms = 0;                // K / 64
    int32_t m_atoms = 0;                // N_w / 16
    int32_t groups = 0;                 // K / group_size
    int32_t tokens = 0;                 // M_tok
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

    auto gA = make_tensor(make_gmem_ptr(reinterpret_cast<uint64_t const*>(args.ptr_A)),
                          GmemLayoutA{make_shape(Int<kAtomWords>{}, k_atoms, m_atoms),
                                      make_stride(_1{}, int64_t(kAtomWords), int64_t(kAtomWords) * k_atoms)});
    auto gB = make_tensor(make_gmem_ptr(args.ptr_B), make_layout(make_shape(int32_t(N), int32_t(K), int32_t(L)), args.dB));
    auto gS = make_tensor(make_gmem_ptr(static_cast<ElementScale const*>(args.ptr_S)),
                          GmemLayoutScale{make_shape(int32_t(M), groups), make_stride(_1{}, int64_t(M))});
    // With no zero points the zero TMA is a copy of the scale one and is never issued.
    auto gZ = make_tensor(make_gmem_ptr(static_cast<ElementScale const*>(HasZero ? args.ptr_Z : args.ptr_S)),
                          GmemLayoutScale{make_shape(int32_t(M), groups), make_stride(_1{}, int64_t(M))});
    // The token scales as [M_tok, 1]; the second stride is never used (one row) but must be a
    // multiple of 16 bytes for the descriptor.
    int64_t const token_pitch = (int64_t(N) + 3) / 4 * 4;
    auto gX = make_tensor(make_gmem_ptr(args.ptr_XS),
                          GmemLayoutTokens{make_shape(int32_t(N), int32_t(1)), make_stride(_1{}, token_pitch)});

    int gpt = group_rows_per_tile(args.group_size);
    uint32_t tx = kStageBytesA + kStageBytesB + uint32_t(gpt) * kBytesPerScaleRow * (HasZero ? 2u : 1u) + kBytesTokens;
    return {
      make_tma_copy(SM90_TMA_LOAD{}, gA, SmemLayoutA{}),
      make_tma_copy_B_sm90(SM90_TMA_LOAD{}, gB, SmemLayoutB{}(_, _, Int<0>{}), TileShape{}, ClusterShape{}),
      make_tma_copy(SM90_TMA_LOAD{}, gS, SmemLayoutScaleRow{}),
      make_tma_copy(SM90_TMA_LOAD{}, gZ, SmemLayoutScaleRow{}),
      make_tma_copy(SM90_TMA_LOAD{}, gX, SmemLayoutTokenRow{}),
      tx, int32_t(args.group_size), int32_t(gpt), k_atoms, m_atoms, groups, int32_t(N)};
  }

  // Why an argument set cannot run, or nullptr if it can. The per-token scales are checked by the
  // entry point (gemm_entry_fp8.hpp), which sets them after gemm_entry.hpp's make_arguments.
  template <class ProblemShape>
  static char const* why_not(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    auto aligned16 = [](void const* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; };
    if (L != 1) return "batched (L > 1) problems are not supported";
    if (args.tile_expert || args.num_experts != 1) return "the e4m3 GEMM has no grouped (MoE) form yet";
    if (M <= 0 || N <= 0 || K <= 0) return "empty problem";
    if (M % kAtomRows) return "N (weight rows) must be a multiple of 16";
    if (K % kAtomCols) return "K must be a multiple of 64";
    if (args.group_size <= 0 || K % args.group_size) return "group_size must divide K";
    if (args.group_size % kMinGroup) return "group_size must be a multiple of 32 (the e4m3 MMA's k-block)";
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
    cute::prefetch_tma_descriptor(params.tma_load_token.get_tma_descriptor());
  }

  // The kernel layer reads the tile counts off gA_mkl/gB_nkl. A's tiles are addressed in atom
  // coordinates inside load(), so gA_mkl is only a coordinate tensor of the logical shape.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
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
    (void)block_rank_in_cluster;
    if (!cute::elect_one_sync()) {
      return;
    }
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;

    // A: uint64 [atom words, k atoms, m atoms]; one tile = (all words, kAtomsK, kAtomsM).
    Tensor mA = params.tma_load_a.get_tma_tensor(make_shape(Int<kAtomWords>{}, params.k_atoms, params.m_atoms));
    Tensor gA = local_tile(mA, shape(SmemLayoutA{}), make_coord(_0{}, _, m_coord));      // (W,KA,MA,k)
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            append(SmemLayoutA{}, Layout<Int<Stages>, Int<cosize_v<SmemLayoutA>>>{}));  // (W,KA,MA,PIPE)
    auto tma_a = params.tma_load_a.get_slice(0);
    Tensor tAgA = tma_a.partition_S(gA);
    Tensor tAsA = tma_a.partition_D(sA);

    // B: the activation tile of this CTA's tokens.
    Tensor gB_nkl = get<1>(load_inputs);
    Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);                                           // (BLK_N,BLK_K,k)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});    // (BLK_N,BLK_K,PIPE)
    auto tma_b = params.tma_load_b.get_slice(0);
    Tensor tBgB = tma_b.partition_S(gB);
    Tensor tBsB = tma_b.partition_D(sB);

    // Scales (and zeros): rows of [G, N_w]; a tile's rows land at [stage][row][BLK_M].
    Tensor mS = params.tma_load_scale.get_tma_tensor(make_shape(params.m_atoms * kAtomRows, params.groups));
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

    // Token scales: the tile's BLK_N floats, into every stage.
    Tensor mX = params.tma_load_token.get_tma_tensor(make_shape(params.tokens, 1));
    Tensor gX = local_tile(mX, shape(SmemLayoutTokenRow{}), make_coord(n_coord, _));       // (BLK_N,1,1)
    Tensor sX = make_tensor(make_smem_ptr(shared_tensors.smem_token.data()),
                            make_layout(make_shape(Int<BLK_N>{}, _1{}, Int<Stages>{}),
                                        make_stride(_1{}, Int<kTokenStride>{}, Int<kTokenStride>{})));
    auto tma_x = params.tma_load_token.get_slice(0);
    Tensor tXgX = tma_x.partition_S(gX);
    Tensor tXsX = tma_x.partition_D(sX);

    int const gpt = params.group_rows_per_tile;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      int stage = smem_pipe_write.index();
      int k_tile = *k_tile_iter;

      copy(params.tma_load_a.with(*tma_barrier), tAgA(_, _, _, _, k_tile), tAsA(_, _, _, _, stage));
      copy(params.tma_load_b.with(*tma_barrier), tBgB(_, _, _, k_tile), tBsB(_, _, _, stage));
      int row0 = (k_tile * BLK_K) / params.group_size;
      for (int r = 0; r < gpt; ++r) {
        copy(params.tma_load_scale.with(*tma_barrier), tSgS(_, _, _, row0 + r), tSsS(_, _, _, stage * kGroupRowsMax + r));
        if constexpr (HasZero) {
          copy(params.tma_load_zero.with(*tma_barrier), tZgZ(_, _, _, row0 + r), tZsZ(_, _, _, stage * kGroupRowsMax + r));
        }
      }
      copy(params.tma_load_token.with(*tma_barrier), tXgX(_, _, _, 0), tXsX(_, _, _, stage));
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
  // Consumer: convert A into the wgmma fragments a k-tile ahead of the tensor core, accumulate
  // each group in float32 apart, and scale it into the output accumulator.
  //
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& params) {
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    int const mma_thread = thread_idx % size(TiledMma{});
    int const lane = thread_idx % kLanes;

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_slice(mma_thread);

    // Which tile rows this thread's A fragment values sit at: read off the MMA's own
    // thread-value layout.
    Tensor cA = make_identity_tensor(make_shape(Int<BLK_M>{}, Int<BLK_K>{}));
    Tensor tCcA = thr_mma.partition_A(cA);                                   // (MMA,MMA_M,MMA_K) -> (m,k)
    Tensor tileA = make_tensor(make_smem_ptr(static_cast<ElementB*>(nullptr)),
                               make_layout(make_shape(Int<BLK_M>{}, Int<BLK_K>{})));  // shape only
    // Two register sets for the converted A fragments, used by alternate k-tiles: a conversion
    // writes the set whose wgmmas (two k-tiles back) have been waited for.
    Tensor tCrA0 = thr_mma.partition_fragment_A(tileA);                      // (MMA,MMA_M,MMA_K) e4m3
    Tensor tCrA1 = thr_mma.partition_fragment_A(tileA);
    constexpr int MMA_M = size<1>(tCrA0);
    constexpr int MMA_K = size<2>(tCrA0);
    static_assert(MMA_K == kKBlocks, "one wgmma per k32 block");
    static_assert(decltype(size<0>(recast<uint32_t>(tCrA0)))::value == 4,
                  "a k32 e4m3 A fragment is four 32-bit registers");

    // wgmma B descriptors over the swizzled activation tile.
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    Tensor tCsB = thr_mma.partition_B(sB);
    Tensor tCrB = thr_mma.make_fragment_B(tCsB);                             // (MMA,MMA_N,MMA_K,PIPE)

    // The group accumulator, and each accumulator value's token column in the tile. In the
    // 64xN accumulator layout (GMMA::CLayout_64xN) value v of an MMA holds row g + 8 * ((v / 2) % 2)
    // of the thread's rows g, g + 8: promote() reads the scale of that row.
    Tensor acc_g = make_fragment_like(accum);                                // (MMA,MMA_M,MMA_N)
    Tensor cC = make_identity_tensor(make_shape(Int<BLK_M>{}, Int<BLK_N>{}));
    Tensor tCcC = thr_mma.partition_C(cC);                                   // (MMA,MMA_M,MMA_N) -> (m,n)
    static_assert(cute::is_same_v<typename TiledMma::Atom::Traits::CLayout, GMMA::CLayout_64xN<BLK_N>>,
                  "promote() assumes the 64xN accumulator layout");

    // Per 64-row block: the thread's atom row and the two tile rows (g, g + 8) it holds.
    int atom_row[MMA_M];
    int tile_row[MMA_M];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < MMA_M; ++mm) {
      tile_row[mm] = get<0>(tCcA(0, mm, 0));
      atom_row[mm] = tile_row[mm] / kAtomRows;
    }
    uint8_t const* smem_A = reinterpret_cast<uint8_t const*>(shared_tensors.smem_A.data());
    ElementScale const* smem_S = shared_tensors.smem_scale.data();
    ElementScale const* smem_Z = shared_tensors.smem_zero.data();
    float const* smem_T = shared_tensors.smem_token.data();
    int const gpt = params.group_rows_per_tile;
    int const group_size = params.group_size;

    PipelineState smem_pipe_release = smem_pipe_read;
    clear(accum);

    // The whole k-loop for kRows group rows per k-tile (a compile-time constant: 1 for groups of
    // BLK_K or more, BLK_K / group_size below), so that every k32 block's table and every
    // segment's scale row is picked at compile time.
    auto k_loop = [&](auto rows_c) {
      constexpr int kRows = decltype(rows_c)::value;
      constexpr int kSegBlocks = kKBlocks / kRows;      // k32 blocks per segment (one group row)

      // The e4m3 tables of the thread's rows (g, g + 8) per 64-row block, for the group row in
      // use: rebuilt at each group row of a k-tile (kRows > 1) or when a k-tile starts a group.
      uint32_t tab[MMA_M][2][kTableWords];
      if constexpr (kSigned) {
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MMA_M; ++mm) {
          Conv::table(0u, tab[mm][0]);
          Conv::table(0u, tab[mm][1]);
        }
      }

      // Wait for k-tile t's stage and convert its A fragments into `frag`; returns the stage.
      auto convert = [&](auto& frag, int t) {
        Tensor tCrA_u32 = recast<uint32_t>(frag);                            // (4,MMA_M,MMA_K)
        auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
        pipeline.consumer_wait(smem_pipe_read, barrier_token);
        int const stage = smem_pipe_read.index();
        ++smem_pipe_read;

        uint32_t chunk[MMA_M][kAtomsK][kBits];
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MMA_M; ++mm) {
          CUTLASS_PRAGMA_UNROLL
          for (int ka = 0; ka < kAtomsK; ++ka) {
            uint8_t const* src = smem_A + size_t(stage) * kStageBytesA +
                                 size_t((atom_row[mm] * kAtomsK + ka) * kAtomBytes + lane * kChunkBytes);
            load_chunk<kChunkBytes>(src, chunk[mm][ka]);
          }
        }
        // (uniform across the warp group: t and group_size are)
        bool const new_group = kRows > 1 || (t * BLK_K) % group_size == 0;

        CUTLASS_PRAGMA_UNROLL
        for (int kb = 0; kb < kKBlocks; ++kb) {
          if constexpr (!kSigned) {
            if (kb % kSegBlocks == 0 && new_group) {
              ElementScale const* zrow = smem_Z + (stage * kGroupRowsMax + kb / kSegBlocks) * BLK_M;
              CUTLASS_PRAGMA_UNROLL
              for (int mm = 0; mm < MMA_M; ++mm) {
                CUTLASS_PRAGMA_UNROLL
                for (int h = 0; h < 2; ++h) {
                  uint32_t const z2 = arith::splat(reinterpret_cast<uint16_t const&>(zrow[tile_row[mm] + 8 * h]));
                  Conv::table(Conv::template zero_code<kHalf>(z2), tab[mm][h]);
                }
              }
            }
          }
          CUTLASS_PRAGMA_UNROLL
          for (int mm = 0; mm < MMA_M; ++mm) {
            uint32_t out[4];
            uint32_t const* ch = chunk[mm][kb / 2];
            if (kb % 2 == 0) {
              Conv::template kblock<0>(ch, tab[mm][0], tab[mm][1], out);
            } else {
              Conv::template kblock<1>(ch, tab[mm][0], tab[mm][1], out);
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

      // accum += s_w[row, group row r of the stage] * acc_g
      auto promote = [&](int stage, int r) {
        ElementScale const* srow = smem_S + (stage * kGroupRowsMax + r) * BLK_M;
        float s[MMA_M][2];
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MMA_M; ++mm) {
          s[mm][0] = float(srow[tile_row[mm]]);
          s[mm][1] = float(srow[tile_row[mm] + 8]);
        }
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < size<1>(accum); ++mm) {
          CUTLASS_PRAGMA_UNROLL
          for (int nn = 0; nn < size<2>(accum); ++nn) {
            CUTLASS_PRAGMA_UNROLL
            for (int v = 0; v < size<0>(accum); ++v) {
              accum(v, mm, nn) = fmaf(s[mm][(v / 2) % 2], acc_g(v, mm, nn), accum(v, mm, nn));
            }
          }
        }
      };

      // k-tile t: its wgmmas (A from `cur`), the next k-tile's conversion into `next` while the
      // last segment's wgmmas run, then each segment's promotion. Returns the next tile's stage.
      auto step = [&](auto& cur, auto& next, int stage, int t) {
        bool const last = t + 1 == k_tile_count;
        int next_stage = stage;
        CUTLASS_PRAGMA_UNROLL
        for (int seg = 0; seg < kRows; ++seg) {
          warpgroup_fence_operand(acc_g);
          warpgroup_arrive();
          CUTLASS_PRAGMA_UNROLL
          for (int b = 0; b < kSegBlocks; ++b) {
            int const kb = seg * kSegBlocks + b;
            tiled_mma.accumulate_ = b == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
            cute::gemm(tiled_mma, cur(_, _, kb), tCrB(_, _, kb, stage), acc_g);
          }
          warpgroup_commit_batch();
          warpgroup_fence_operand(acc_g);
          if (seg == kRows - 1 && !last) {
            next_stage = convert(next, t + 1);
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_g);
          promote(stage, seg);
        }
        if (!last) {   // the last k-tile's stage is released by mma_tail, after its token scales are read
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
        }
        return next_stage;
      };

      int stage = convert(tCrA0, 0);
      int last_stage = stage;
      CUTLASS_PRAGMA_NO_UNROLL
      for (int t = 0; t < k_tile_count; t += 2) {
        last_stage = stage;
        stage = step(tCrA0, tCrA1, stage, t);
        if (t + 1 == k_tile_count) {
          break;
        }
        last_stage = stage;
        stage = step(tCrA1, tCrA0, stage, t + 1);
      }
      return last_stage;
    };

    // (gpt is a power of two <= kGroupRowsMax, the same for every thread: a uniform branch)
    int last_stage;
    if constexpr (kGroupRowsMax >= 4) {
      if (gpt == 4) {
        last_stage = k_loop(Int<4>{});
      } else if (gpt == 2) {
        last_stage = k_loop(Int<2>{});
      } else {
        last_stage = k_loop(Int<1>{});
      }
    } else {
      if (gpt == 2) {
        last_stage = k_loop(Int<2>{});
      } else {
        last_stage = k_loop(Int<1>{});
      }
    }

    // The per-token scales, from the last k-tile's stage (still held: mma_tail releases it).
    float const* token_scale = smem_T + last_stage * kTokenStride;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) {
      accum(i) *= token_scale[get<1>(tCcC(i))];
    }
  }

  // Release the last k-tile's stage (its wgmmas were waited for in mma; all earlier stages were
  // released there).
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release, int k_tile_count) {
    smem_pipe_release.advance(k_tile_count - 1);
    warpgroup_wait<0>();
    pipeline.consumer_release(smem_pipe_release);
  }
};

}  // namespace mixgemm::collective
