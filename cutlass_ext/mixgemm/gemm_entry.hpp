// mixgemm: the two faces of one generated GEMM kernel.
//
//   MIXGEMM_GEMM_ENTRY(Name, Kernel)
//
// * device build (the cubin): an extern "C" __global__ `Name` taking the kernel's Params by
//   value -- the symbol the Python runtime launches with cuLaunchKernelEx;
// * host build (-DMIXGEMM_HOST_HELPER, a shared library): C functions that turn
//   mixgemm::abi::GemmArgs into those Params bytes (to_underlying_arguments encodes the TMA
//   descriptors on the host) and report grid, block, cluster, shared memory, workspace size and
//   can_implement, all from the same Kernel type the cubin was built from.
#pragma once

#include <cstdio>
#include <cstring>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"

#include "mixgemm/abi.hpp"
#include "mixgemm/activation.hpp"

namespace mixgemm::host {

template <class T, class = void> struct has_bias_ptr : std::false_type {};
template <class T> struct has_bias_ptr<T, std::void_t<decltype(std::declval<T&>().bias_ptr)>> : std::true_type {};
template <class T, class = void> struct has_activation : std::false_type {};
template <class T> struct has_activation<T, std::void_t<decltype(std::declval<T&>().activation.kind)>> : std::true_type {};
template <class T, class = void> struct has_splits : std::false_type {};
// The gated epilogue (epilogue_gated.hpp) says so with `kGated`; it takes only swiglu.
template <class T, class = void> struct is_gated : std::false_type {};
template <class T> struct is_gated<T, std::void_t<decltype(T::kGated)>> : std::bool_constant<T::kGated> {};
template <class T> struct has_splits<T, std::void_t<decltype(std::declval<T&>().splits)>> : std::true_type {};
// The grouped scheduler (grouped_scheduler.hpp) reads the token tiles' table.
template <class T, class = void> struct has_tiles : std::false_type {};
template <class T> struct has_tiles<T, std::void_t<decltype(std::declval<T&>().tiles)>> : std::true_type {};
// The stream-K scheduler with self-resetting locks (streamk_scheduler.hpp) takes them apart.
template <class T, class = void> struct has_locks : std::false_type {};
template <class T> struct has_locks<T, std::void_t<decltype(std::declval<T&>().locks)>> : std::true_type {};

// The grouped (MoE) form's extra arguments: the device table of token tiles (grouped_scheduler.hpp:
// [U, expert of tile 0, ...]) and the number of stacked experts. Dense launches pass none.
struct Grouping {
  int32_t const* tiles = nullptr;
  int32_t experts = 1;
};

inline int fail(char* err, int errlen, char const* msg) {
  if (err && errlen > 0) { std::snprintf(err, size_t(errlen), "%s", msg); }
  return 1;
}

template <class Kernel>
typename Kernel::Arguments make_arguments(abi::GemmArgs const& a, Grouping const& g = {}) {
  using Mainloop = typename Kernel::CollectiveMainloop;
  using Epilogue = typename Kernel::CollectiveEpilogue;
  using ElementB = typename Mainloop::ElementB;           // the activations
  using ElementScale = typename Mainloop::ElementScale;   // the scales and zero points
  using ElementD = typename Epilogue::ElementD;

  typename Kernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  // The weight is the MMA's M (its rows are the output features), the tokens its N.
  args.problem_shape = typename Kernel::ProblemShape{a.n, a.m, a.k, 1};

  args.mainloop.ptr_A = reinterpret_cast<uint8_t const*>(a.weight);
  args.mainloop.ptr_B = reinterpret_cast<ElementB const*>(a.x);
  args.mainloop.dB = cute::make_stride(int64_t(a.ldx), cute::Int<1>{}, int64_t(0));
  args.mainloop.ptr_S = reinterpret_cast<ElementScale const*>(a.scales);
  args.mainloop.ptr_Z = reinterpret_cast<ElementScale const*>(a.zeros);
  args.mainloop.group_size = a.group_size;
  args.mainloop.tile_expert = g.tiles ? g.tiles + 1 : nullptr;
  args.mainloop.num_experts = g.experts;

  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  if constexpr (has_bias_ptr<std::remove_reference_t<decltype(fusion)>>::value) {
    fusion.bias_ptr = reinterpret_cast<decltype(fusion.bias_ptr)>(a.bias);
  }
  if constexpr (has_activation<std::remove_reference_t<decltype(fusion)>>::value) {
    fusion.activation.kind = Activation(a.activation);
  }
  args.epilogue.ptr_C = nullptr;
  // y[m, n] is D[n, m] column-major: the weight rows are contiguous.
  args.epilogue.ptr_D = reinterpret_cast<ElementD*>(a.y);
  args.epilogue.dD = cute::make_stride(cute::Int<1>{}, int64_t(a.ldy), int64_t(0));
  args.epilogue.dC = args.epilogue.dD;

  args.hw_info.device_id = 0;
  args.hw_info.sm_count = a.sm_count;
  args.hw_info.max_active_clusters = 0;
  using SchedulerArgs = typename Kernel::TileSchedulerArguments;
  using RasterOrder = decltype(std::declval<SchedulerArgs&>().raster_order);
  args.scheduler.raster_order = a.raster == 1 ? RasterOrder::AlongM : a.raster == 2 ? RasterOrder::AlongN : RasterOrder::Heuristic;
  args.scheduler.max_swizzle_size = a.swizzle > 0 ? a.swizzle : 1;
  if constexpr (has_splits<SchedulerArgs>::value) {
    args.scheduler.splits = a.splits > 1 ? a.splits : 1;
  }
  if constexpr (has_tiles<SchedulerArgs>::value) {
    args.scheduler.tiles = g.tiles;
  }
  if constexpr (has_locks<SchedulerArgs>::value) {
    args.scheduler.locks = reinterpret_cast<decltype(args.scheduler.locks)>(a.locks);
  }
  return args;
}

// Why the kernel cannot run these arguments (nullptr if it can). Pure host logic: no driver call.
template <class Kernel>
char const* check(abi::GemmArgs const* a, Grouping const& g = {}) {
  if (a == nullptr) return "null argument";
  constexpr bool kGrouped = has_tiles<typename Kernel::TileSchedulerArguments>::value;
  if (kGrouped && g.tiles == nullptr)
    return "a grouped GEMM kernel launches with mixgemm_grouped_gemm_prepare (a token-tile table)";
  if (!kGrouped && g.tiles != nullptr) return "this GEMM kernel is not a grouped one";
  if (g.experts < 1) return "at least one expert";
  if (kGrouped && a->bias) return "the grouped GEMM takes no bias";
  if (a->abi_version != abi::kAbiVersion) return "ABI version mismatch between the runtime and the kernel's host helper";
  using Fusion = std::remove_reference_t<decltype(std::declval<typename Kernel::Arguments&>().epilogue.thread)>;
  if (a->activation < 0 || a->activation > int(Activation::kSwiglu)) return "unknown activation";
  constexpr bool kGated = is_gated<typename Kernel::CollectiveEpilogue>::value;
  if (kGated) {
    if (a->activation != int(Activation::kSwiglu)) return "this kernel's gated epilogue computes swiglu only";
    if (a->n % 16) return "the gated (swiglu) form needs N % 16 == 0: gate and up in 8-row stripes";
    if (a->ldy < a->n / 2) return "the output row stride must cover the N/2 outputs";
  } else if (a->activation == int(Activation::kSwiglu)) {
    return "this kernel's epilogue does not fuse swiglu; the kernels with the gated epilogue do";
  }
  if (!kGated && a->activation != int(Activation::kNone) && !has_activation<Fusion>::value)
    return "this kernel's epilogue fuses no activation (a bias-only epilogue)";
  if (a->raster < 0 || a->raster > 2) return "unknown raster order (0: heuristic, 1: along weight rows, 2: along tokens)";
  if (a->swizzle != 0 && a->swizzle != 1 && a->swizzle != 2 && a->swizzle != 4 && a->swizzle != 8)
    return "the scheduler swizzle must be 1, 2, 4 or 8";
  auto args = make_arguments<Kernel>(*a, g);
  using Mainloop = typename Kernel::CollectiveMainloop;
  if (char const* why = Mainloop::why_not(args.problem_shape, args.mainloop)) return why;
  if ((a->ldy * int64_t(sizeof(typename Kernel::CollectiveEpilogue::ElementD))) % 16 || a->y % 16)
    return "the output must be 16-byte aligned with a row stride that is a multiple of 16 bytes";
  if (a->bias % 16) return "the bias must be 16-byte aligned";
  if (!Kernel::can_implement(args)) return "the kernel cannot implement this problem (epilogue or scheduler constraint)";
  return nullptr;
}

template <class Kernel>
uint64_t workspace_size(abi::GemmArgs const* a) {
  return a ? uint64_t(Kernel::get_workspace_size(make_arguments<Kernel>(*a))) : 0;
}

// The zeroed lock memory a launch needs apart from its workspace (streamk_scheduler.hpp; 0: none).
template <class Kernel>
uint64_t lock_bytes(abi::GemmArgs const* a) {
  if constexpr (has_locks<typename Kernel::TileSchedulerArguments>::value) {
    if (a == nullptr) return 0;
    auto args = make_arguments<Kernel>(*a);
    return uint64_t(Kernel::TileScheduler::template lock_bytes<typename Kernel::ProblemShape,
                                                               typename Kernel::ElementAccumulator>(
        args.scheduler, args.problem_shape, args.hw_info, Kernel::NumMmaWarpGroups));
  } else {
    return 0;
  }
}

// The last step of a prepare: the Params bytes into `dst` and the launch geometry into `out`.
template <class Kernel>
int write_params(typename Kernel::Params const& params, void* dst, abi::Launch* out) {
  std::memcpy(dst, &params, sizeof(params));
  dim3 grid = Kernel::get_grid_shape(params);
  dim3 block = Kernel::get_block_shape();
  using Cluster = typename Kernel::DispatchPolicy::ClusterShape;
  out->grid[0] = grid.x; out->grid[1] = grid.y; out->grid[2] = grid.z;
  out->block[0] = block.x; out->block[1] = block.y; out->block[2] = block.z;
  out->cluster[0] = cute::size<0>(Cluster{}); out->cluster[1] = cute::size<1>(Cluster{}); out->cluster[2] = cute::size<2>(Cluster{});
  out->smem_bytes = uint32_t(Kernel::SharedStorageSize);
  out->params_bytes = uint32_t(sizeof(typename Kernel::Params));
  return 0;
}

// Params bytes and launch geometry. Encodes the TMA descriptors (a driver call).
template <class Kernel>
int prepare(abi::GemmArgs const* a, void* dst, uint32_t capacity, abi::Launch* out, char* err, int errlen,
            Grouping const& g = {}) {
  if (char const* why = check<Kernel>(a, g)) return fail(err, errlen, why);
  if (dst == nullptr || out == nullptr) return fail(err, errlen, "null output buffer");
  if (capacity < sizeof(typename Kernel::Params)) return fail(err, errlen, "params buffer too small");
  auto args = make_arguments<Kernel>(*a, g);
  std::memset(out, 0, sizeof(*out));
  out->workspace_bytes = Kernel::get_workspace_size(args);
  using Scheduler = typename Kernel::TileScheduler;
  if constexpr (has_locks<typename Kernel::TileSchedulerArguments>::value) {
    // Partials only; the locks are apart, zeroed once by the caller and left zeroed.
    out->workspace_zero_bytes = 0;
    out->lock_bytes = lock_bytes<Kernel>(a);
  } else {
    out->workspace_zero_bytes = 0xffffffffu;  // CUTLASS's stream-K workspace starts zeroed, all of it
  }
  if (out->workspace_bytes && a->workspace == 0) return fail(err, errlen, "this launch needs a workspace");
  if (out->lock_bytes && a->locks == 0) return fail(err, errlen, "this launch needs its zeroed lock memory");
  auto params = Kernel::to_underlying_arguments(args, reinterpret_cast<void*>(a->workspace));
  if constexpr (has_locks<typename Kernel::TileSchedulerArguments>::value) {
    if (char const* why = Scheduler::why_not(params.scheduler, out->lock_bytes)) return fail(err, errlen, why);
  }
  return write_params<Kernel>(params, dst, out);
}

}  // namespace mixgemm::host

#define MIXGEMM_STR2(x) #x
#define MIXGEMM_STR(x) MIXGEMM_STR2(x)

// A kernel that asks for more shared memory than an SM can give would fail only at load time.
#define MIXGEMM_CHECK_SMEM(KERNEL)                                                                \
  static_assert(KERNEL::SharedStorageSize <= cutlass::gemm::collective::detail::sm90_smem_capacity_bytes, \
                "the kernel's shared memory exceeds the sm90 opt-in limit (227 KiB)");

#if defined(MIXGEMM_HOST_HELPER)
// The host helper's functions of every GEMM kernel but mixgemm_gemm_prepare (gemm_entry_fp8.hpp's
// entry has its own).
#define MIXGEMM_GEMM_HELPER_COMMON(NAME, KERNEL)                                                  \
  MIXGEMM_CHECK_SMEM(KERNEL)                                                                      \
  extern "C" int32_t mixgemm_abi_version() { return mixgemm::abi::kAbiVersion; }                  \
  extern "C" char const* mixgemm_kernel_name() { return MIXGEMM_STR(NAME); }                       \
  extern "C" uint32_t mixgemm_params_size() { return uint32_t(sizeof(KERNEL::Params)); }          \
  extern "C" uint32_t mixgemm_smem_size() { return uint32_t(KERNEL::SharedStorageSize); }        \
  extern "C" int mixgemm_gemm_check(mixgemm::abi::GemmArgs const* a, char* err, int errlen) {     \
    char const* why = mixgemm::host::check<KERNEL>(a);                                            \
    return why ? mixgemm::host::fail(err, errlen, why) : 0;                                       \
  }                                                                                               \
  extern "C" uint64_t mixgemm_gemm_workspace_size(mixgemm::abi::GemmArgs const* a) {              \
    return mixgemm::host::workspace_size<KERNEL>(a);                                              \
  }                                                                                               \
  extern "C" uint64_t mixgemm_gemm_lock_bytes(mixgemm::abi::GemmArgs const* a) {                  \
    return mixgemm::host::lock_bytes<KERNEL>(a);                                                  \
  }
#define MIXGEMM_GEMM_ENTRY(NAME, KERNEL)                                                          \
  MIXGEMM_GEMM_HELPER_COMMON(NAME, KERNEL)                                                        \
  extern "C" int mixgemm_gemm_prepare(mixgemm::abi::GemmArgs const* a, void* dst, uint32_t cap,    \
                                      mixgemm::abi::Launch* out, char* err, int errlen) {         \
    return mixgemm::host::prepare<KERNEL>(a, dst, cap, out, err, errlen);                         \
  }
// A grouped (MoE) GEMM kernel (grouped_scheduler.hpp): the entry above, plus the prepare that takes
// the device table of token tiles and the number of stacked experts.
#define MIXGEMM_GROUPED_GEMM_ENTRY(NAME, KERNEL)                                                  \
  MIXGEMM_GEMM_ENTRY(NAME, KERNEL)                                                                \
  extern "C" int mixgemm_grouped_gemm_prepare(mixgemm::abi::GemmArgs const* a, uint64_t tiles,    \
                                              int32_t experts, void* dst, uint32_t cap,           \
                                              mixgemm::abi::Launch* out, char* err, int errlen) {  \
    mixgemm::host::Grouping g{reinterpret_cast<int32_t const*>(tiles), experts};                  \
    return mixgemm::host::prepare<KERNEL>(a, dst, cap, out, err, errlen, g);                      \
  }
#else
#define MIXGEMM_GROUPED_GEMM_ENTRY(NAME, KERNEL) MIXGEMM_GEMM_ENTRY(NAME, KERNEL)
#define MIXGEMM_GEMM_ENTRY(NAME, KERNEL)                                                          \
  MIXGEMM_CHECK_SMEM(KERNEL)                                                                      \
  extern "C" __global__ void __launch_bounds__(KERNEL::MaxThreadsPerBlock,                        \
                                               KERNEL::MinBlocksPerMultiprocessor)                \
  NAME(CUTLASS_GRID_CONSTANT KERNEL::Params const params) {                                       \
    extern __shared__ char smem[];                                                                \
    KERNEL op;                                                                                    \
    op(params, smem);                                                                             \
  }
#endif
