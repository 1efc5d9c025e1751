// mixgemm's compiled launcher: one GEMM launch -- params from the kernel's host helper, the
// workspace's zeroed prefix, cuLaunchKernelEx -- from one C call (python/mixgemm/jit/launcher.py).
// A stream-K launch's locks (streamk_scheduler.hpp) come from the caller, zeroed once and left
// zeroed by the kernel: no memset.
//
// Host code only. The caller hands over every entry point it uses: the helper's
// mixgemm_gemm_prepare (helper.so, unchanged) and the driver's cuLaunchKernelEx and
// cuMemsetD8Async (from cuGetProcAddress, through cuda-python, which loads the modules and owns
// the contexts). So this library links nothing but the C++ runtime, loads without a GPU, and
// launches into whichever driver cuda-python opened.
//
// A plan (MixgemmLaunchPlan) is filled once per launch plan by Python; a call
// (MixgemmLaunchCall) carries what changes per call: the token count, the activation and output
// pointers and strides, the bias, the workspace on offer and the stream. The kernel parameters
// are encoded into a buffer on this function's stack on every call (the GEMM kernels' TMA
// descriptors embed the x and y pointers), so nothing is shared between calls or threads.
#include <cuda.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "mixgemm/abi.hpp"
#include "mixgemm/launcher_abi.hpp"

namespace {

using mixgemm::launcher::kLauncherVersion;
// The most bytes of kernel parameters a launch may take (the driver's by-value limit).
constexpr uint32_t kMaxParamsBytes = 4096;

using Prepare = int (*)(mixgemm::abi::GemmArgs const*, void*, uint32_t, mixgemm::abi::Launch*, char*, int);
using LaunchKernelEx = CUresult (*)(CUlaunchConfig const*, CUfunction, void**, void**);
using MemsetD8Async = CUresult (*)(CUdeviceptr, unsigned char, size_t, CUstream);

}  // namespace

// The structures (MixgemmLaunchPlan, MixgemmLaunchCall) are in mixgemm/launcher_abi.hpp.
extern "C" {

int32_t mixgemm_launcher_version() { return kLauncherVersion; }
int32_t mixgemm_launcher_abi_version() { return mixgemm::abi::kAbiVersion; }
uint32_t mixgemm_launcher_plan_size() { return uint32_t(sizeof(MixgemmLaunchPlan)); }
uint32_t mixgemm_launcher_call_size() { return uint32_t(sizeof(MixgemmLaunchCall)); }
uint32_t mixgemm_launcher_max_params() { return kMaxParamsBytes; }

int32_t mixgemm_launch(MixgemmLaunchPlan const* plan, MixgemmLaunchCall* call) {
  mixgemm::abi::GemmArgs a = plan->args;
  a.m = call->m;
  a.x = call->x;
  a.ldx = call->ldx;
  a.y = call->y;
  a.ldy = call->ldy;
  a.bias = call->bias;
  a.workspace = call->workspace_capacity ? call->workspace : 0;
  a.locks = call->locks_capacity ? call->locks : 0;
  call->workspace_bytes = 0;
  call->lock_bytes = 0;
  call->cuda_error = 0;
  call->failed_call = 0;
  call->message[0] = '\0';

  alignas(128) unsigned char params[kMaxParamsBytes];
  mixgemm::abi::Launch launch;
  std::memset(&launch, 0, sizeof(launch));
  int const rc = reinterpret_cast<Prepare>(plan->prepare)(&a, params, kMaxParamsBytes, &launch, call->message,
                                                         int(sizeof(call->message)));
  // The helpers set workspace_bytes only once the arguments passed their checks, so a launch
  // that asks for more workspace than is on offer is that, not a refusal.
  call->workspace_bytes = launch.workspace_bytes;
  call->lock_bytes = launch.lock_bytes;
  if (launch.workspace_bytes > call->workspace_capacity) return kNeedWorkspace;
  if (launch.lock_bytes > call->locks_capacity) return kNeedLocks;
  if (rc != 0) return kRefused;

  CUstream const stream = reinterpret_cast<CUstream>(call->stream);
  if (launch.workspace_bytes) {
    uint64_t zero = launch.workspace_zero_bytes == 0xffffffffu ? launch.workspace_bytes
                                                                : uint64_t(launch.workspace_zero_bytes);
    if (zero > launch.workspace_bytes) zero = launch.workspace_bytes;
    if (zero) {   // a memset on the stream (a memset node under graph capture), not a fill kernel
      CUresult const e = reinterpret_cast<MemsetD8Async>(plan->memset_d8_async)(CUdeviceptr(a.workspace), 0,
                                                                               size_t(zero), stream);
      if (e != CUDA_SUCCESS) {
        call->cuda_error = int32_t(e);
        call->failed_call = 1;
        return kDriverError;
      }
    }
  }

  CUlaunchAttribute attrs[2];
  std::memset(attrs, 0, sizeof(attrs));
  attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  attrs[0].value.clusterDim.x = launch.cluster[0];
  attrs[0].value.clusterDim.y = launch.cluster[1];
  attrs[0].value.clusterDim.z = launch.cluster[2];
  unsigned int num_attrs = 1;
  if (plan->programmatic) {
    // The kernel may start (and set up) while the previous kernel in the stream finishes; it
    // waits for it before touching global memory.
    attrs[1].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[1].value.programmaticStreamSerializationAllowed = 1;
    num_attrs = 2;
  }
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof(config));
  config.gridDimX = launch.grid[0];
  config.gridDimY = launch.grid[1];
  config.gridDimZ = launch.grid[2];
  config.blockDimX = launch.block[0];
  config.blockDimY = launch.block[1];
  config.blockDimZ = launch.block[2];
  config.sharedMemBytes = launch.smem_bytes;
  config.hStream = stream;
  config.attrs = attrs;
  config.numAttrs = num_attrs;
  void* argv[1] = {params};
  CUresult const e = reinterpret_cast<LaunchKernelEx>(plan->launch_kernel_ex)(
      &config, reinterpret_cast<CUfunction>(plan->function), argv, nullptr);
  if (e != CUDA_SUCCESS) {
    call->cuda_error = int32_t(e);
    call->failed_call = 2;
    return kDriverError;
  }
  return kLaunched;
}

}  // extern "C"
