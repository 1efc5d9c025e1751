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
//   and mixgemm_fp8_gemm_check / mixgemm_fp8_gemm_prepare over abi::Fp8GemmArgs.
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

template <class Kernel>
typename Kernel::Arguments make_fp8_arguments(abi::Fp8GemmArgs const& a) {
  auto args = make_arguments<Kernel>(a.gemm);
  args.mainloop.ptr_XS = reinterpret_cast<float const*>(a.x_scales);
  return args;
}

template <class Kernel>
char const* check_fp8(abi::Fp8GemmArgs const* a) {
  if (a == nullptr) return "null argument";
  if (char const* why = check<Kernel>(&a->gemm)) return why;
  if (a->x_scales == 0) return "null per-token scale pointer (x_scales)";
  if (a->x_scales % 16) return "the per-token scales must be 16-byte aligned";
  return nullptr;
}

// Params bytes and launch geometry (gemm_entry.hpp's prepare, with the token scales).
template <class Kernel>
int prepare_fp8(abi::Fp8GemmArgs const* a, void* dst, uint32_t capacity, abi::Launch* out, char* err, int errlen) {
  if (char const* why = check_fp8<Kernel>(a)) return fail(err, errlen, why);
  if (dst == nullptr || out == nullptr) return fail(err, errlen, "null output buffer");
  if (capacity < sizeof(typename Kernel::Params)) return fail(err, errlen, "params buffer too small");
  auto args = make_fp8_arguments<Kernel>(*a);
  std::memset(out, 0, sizeof(*out));
  out->workspace_bytes = Kernel::get_workspace_size(args);
  out->workspace_zero_bytes = 0xffffffffu;
  if (out->workspace_bytes && a->gemm.workspace == 0) return fail(err, errlen, "this launch needs a workspace");
  auto params = Kernel::to_underlying_arguments(args, reinterpret_cast<void*>(a->gemm.workspace));
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
  extern "C" int mixgemm_fp8_gemm_prepare(mixgemm::abi::Fp8GemmArgs const* a, void* dst, uint32_t cap, \
                                          mixgemm::abi::Launch* out, char* err, int errlen) {     \
    return mixgemm::host::prepare_fp8<KERNEL>(a, dst, cap, out, err, errlen);                     \
  }
#else
#define MIXGEMM_FP8_GEMM_ENTRY(NAME, KERNEL) MIXGEMM_GEMM_ENTRY(NAME, KERNEL)
#endif
