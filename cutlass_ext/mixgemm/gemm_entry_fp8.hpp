// mixgemm: the two faces of one generated e4m3-activation GEMM kernel (collective/
// sm90_mma_prepacked_fp8.hpp), as gemm_entry.hpp is for the bf16/fp16 ones.
//
//   MIXGEMM_FP8_GEMM_ENTRY(Name, Kernel)
//
// The C ABI is gemm_entry.hpp's abi::GemmArgs (x: the e4m3 activations, in the MMA's K order;
// scales, zeros, bias, y: bf16/fp16) plus the per-token scales, in abi::Fp8GemmArgs:
// * device build: the extern "C" __global__ `Name` taking the kernel's Params by value;
// * host build (-DMIXGEMM_HOST_HELPER): gemm_entry.hpp's functions over abi::GemmArgs (every
//   check but the token scales'; `mixgemm_gemm_prepare` refuses, naming the function to call),
//   and over abi::Fp8GemmArgs mixgemm_fp8_gemm_check, mixgemm_fp8_gemm_memory (the workspace
//   and the zeroed lock bytes a launch needs: {workspace, locks}) and mixgemm_fp8_gemm_prepare.
#pragma once

#include <cstdint>
#include <cstring>

#include "mixgemm/abi.hpp"
#include "mixgemm/gemm_entry.hpp"

namespace mixgemm::abi {

// Mirrored by ctypes in python/mixgemm/jit/driver.py (Fp8GemmArgs).
struct Fp8GemmArgs {
  GemmArgs gemm;          // x: e4m3 [m, k] (row stride ldx bytes), in the MMA's K order
  uint64_t x_scales;      // float32 [m]: x's row r is x_scales[r] * x[r]
};

}  // namespace mixgemm::abi

namespace mixgemm::host {

// The e4m3 kernels on the stream-K scheduler take the split-K factor the call chooses
// (abi::GemmArgs::splits): more than 1 splits each output tile's k-tiles into that many units
// whose partial sums are reduced in k order, 1 is a data-parallel launch (a whole output tile per
// work unit), and 0 leaves the choice to CUTLASS's heuristic. The persistent kernels launch whole
// tiles and take no split factor.
template <class Kernel>
typename Kernel::Arguments make_fp8_arguments(abi::Fp8GemmArgs const& a) {
  auto args = make_arguments<Kernel>(a.gemm);
  args.mainloop.ptr_XS = reinterpret_cast<float const*>(a.x_scales);
  using SchedulerArgs = typename Kernel::TileSchedulerArguments;
  if constexpr (has_splits<SchedulerArgs>::value) {
    if (a.gemm.splits == 1) {
      args.scheduler.decomposition_mode = decltype(args.scheduler.decomposition_mode)::DataParallel;
    }
  }
  return args;
}

template <class Kernel>
char const* check_fp8(abi::Fp8GemmArgs const* a) {
  if (a == nullptr) return "null argument";
  if (char const* why = check<Kernel>(&a->gemm)) return why;
  if (a->x_scales == 0) return "null per-token scale pointer (x_scales)";
  if (a->x_scales % 16) return "the per-token scales must be 16-byte aligned";
  if (a->gemm.splits < 0) return "the split-K factor must be 0 (the scheduler's choice) or positive";
  if (!has_splits<typename Kernel::TileSchedulerArguments>::value && a->gemm.splits > 1)
    return "this kernel launches whole output tiles: a split launch takes the e4m3 GEMM's stream-K kernel";
  return nullptr;
}

// The zeroed lock memory a launch of `args` needs apart from its workspace (streamk_scheduler.hpp;
// 0: none).
template <class Kernel>
uint64_t fp8_lock_bytes(typename Kernel::Arguments const& args) {
  if constexpr (has_locks<typename Kernel::TileSchedulerArguments>::value) {
    return uint64_t(Kernel::TileScheduler::template lock_bytes<typename Kernel::ProblemShape,
                                                               typename Kernel::ElementAccumulator>(
        args.scheduler, args.problem_shape, args.hw_info, Kernel::NumMmaWarpGroups));
  } else {
    return 0;
  }
}

// Params bytes and launch geometry (gemm_entry.hpp's prepare, with the token scales and the split
// factor's decomposition): a split launch's workspace holds the partial sums only, and its locks
// are apart, zeroed once by the caller and left zeroed.
template <class Kernel>
int prepare_fp8(abi::Fp8GemmArgs const* a, void* dst, uint32_t capacity, abi::Launch* out, char* err, int errlen) {
  if (char const* why = check_fp8<Kernel>(a)) return fail(err, errlen, why);
  if (dst == nullptr || out == nullptr) return fail(err, errlen, "null output buffer");
  if (capacity < sizeof(typename Kernel::Params)) return fail(err, errlen, "params buffer too small");
  auto args = make_fp8_arguments<Kernel>(*a);
  std::memset(out, 0, sizeof(*out));
  out->workspace_bytes = Kernel::get_workspace_size(args);
  constexpr bool kLocks = has_locks<typename Kernel::TileSchedulerArguments>::value;
  out->workspace_zero_bytes = kLocks ? 0 : 0xffffffffu;   // (the persistent scheduler's: none)
  out->lock_bytes = fp8_lock_bytes<Kernel>(args);
  if (out->workspace_bytes && a->gemm.workspace == 0) return fail(err, errlen, "this launch needs a workspace");
  if (out->lock_bytes && a->gemm.locks == 0) return fail(err, errlen, "this launch needs its zeroed lock memory");
  auto params = Kernel::to_underlying_arguments(args, reinterpret_cast<void*>(a->gemm.workspace));
  if constexpr (kLocks) {
    if (char const* why = Kernel::TileScheduler::why_not(params.scheduler, out->lock_bytes)) return fail(err, errlen, why);
  }
  return write_params<Kernel>(params, dst, out);
}

}  // namespace mixgemm::host

#if defined(MIXGEMM_HOST_HELPER)
#define MIXGEMM_FP8_GEMM_ENTRY(NAME, KERNEL)                                                      \
  MIXGEMM_GEMM_HELPER_COMMON(NAME, KERNEL)                                                        \
  extern "C" int mixgemm_gemm_prepare(mixgemm::abi::GemmArgs const*, void*, uint32_t,              \
                                      mixgemm::abi::Launch*, char* err, int errlen) {             \
    return mixgemm::host::fail(err, errlen,                                                       \
        "an e4m3 GEMM kernel takes per-token scales: launch it with mixgemm_fp8_gemm_prepare");   \
  }                                                                                               \
  extern "C" int mixgemm_fp8_gemm_check(mixgemm::abi::Fp8GemmArgs const* a, char* err, int errlen) { \
    char const* why = mixgemm::host::check_fp8<KERNEL>(a);                                        \
    return why ? mixgemm::host::fail(err, errlen, why) : 0;                                       \
  }                                                                                               \
  extern "C" int mixgemm_fp8_gemm_memory(mixgemm::abi::Fp8GemmArgs const* a, uint64_t* bytes) {  \
    if (a == nullptr || bytes == nullptr) return 1;                                               \
    auto args = mixgemm::host::make_fp8_arguments<KERNEL>(*a);                                    \
    bytes[0] = uint64_t(KERNEL::get_workspace_size(args));                                        \
    bytes[1] = mixgemm::host::fp8_lock_bytes<KERNEL>(args);                                        \
    return 0;                                                                                     \
  }                                                                                               \
  extern "C" int mixgemm_fp8_gemm_prepare(mixgemm::abi::Fp8GemmArgs const* a, void* dst, uint32_t cap, \
                                          mixgemm::abi::Launch* out, char* err, int errlen) {     \
    return mixgemm::host::prepare_fp8<KERNEL>(a, dst, cap, out, err, errlen);                     \
  }
#else
#define MIXGEMM_FP8_GEMM_ENTRY(NAME, KERNEL) MIXGEMM_GEMM_ENTRY(NAME, KERNEL)
#endif
