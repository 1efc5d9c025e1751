// mixgemm: the C structures of the compiled launcher (python/mixgemm/jit/csrc/launcher.cpp),
// shared with the torch operator library (csrc/torch_ops.cpp), which launches through it.
//
// Mirrored by ctypes structures in python/mixgemm/jit/launcher.py; bump kLauncherVersion on any
// change (the Python side refuses a launcher whose version differs).
#pragma once

#include <cstdint>

#include "mixgemm/abi.hpp"

namespace mixgemm::launcher {

constexpr int32_t kLauncherVersion = 2;

}  // namespace mixgemm::launcher

extern "C" {

// Filled once per launch plan by Python.
struct MixgemmLaunchPlan {
  int32_t version;                // kLauncherVersion
  int32_t programmatic;           // 1: launch with programmatic stream serialization (PDL)
  uint64_t function;              // CUfunction
  uint64_t prepare;               // the helper's mixgemm_gemm_prepare
  uint64_t launch_kernel_ex;      // the driver's cuLaunchKernelEx
  uint64_t memset_d8_async;       // the driver's cuMemsetD8Async
  mixgemm::abi::GemmArgs args;    // every field but those of the call
};

// Status codes of mixgemm_launch.
enum MixgemmLaunchResult : int32_t {
  kLaunched = 0,
  kRefused = 1,         // the helper refused the arguments: `message`
  kNeedWorkspace = 2,   // the launch needs `workspace_bytes` > `workspace_capacity`; nothing ran
  kDriverError = 3,     // a driver call failed: `cuda_error` from `failed_call`
  kNeedLocks = 4,       // the launch needs `lock_bytes` > `locks_capacity` of zeroed locks; nothing ran
};

// What changes per call (in), and what the launch answered (out).
struct MixgemmLaunchCall {
  // in
  int32_t m;
  int32_t reserved;
  uint64_t x;
  int64_t ldx;
  uint64_t y;
  int64_t ldy;
  uint64_t bias;
  uint64_t workspace;             // device memory on offer (0: none) ...
  uint64_t workspace_capacity;    // ... of this many bytes
  uint64_t locks;                 // zeroed lock memory on offer (0: none), left zeroed ...
  uint64_t locks_capacity;        // ... of this many bytes
  uint64_t stream;                // CUstream
  // out
  uint64_t workspace_bytes;       // what the launch needs (0: none)
  uint64_t lock_bytes;            // the zeroed lock memory the launch needs (0: none)
  int32_t cuda_error;             // CUresult of the failed driver call
  int32_t failed_call;            // 1: cuMemsetD8Async, 2: cuLaunchKernelEx
  char message[256];              // the helper's reason for refusing
};

// The launcher's entry point: one launch of `plan` with `call`'s arguments.
typedef int32_t (*MixgemmLaunchFn)(MixgemmLaunchPlan const* plan, MixgemmLaunchCall* call);

}  // extern "C"
