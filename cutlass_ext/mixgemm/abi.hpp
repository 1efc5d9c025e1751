// mixgemm: the C ABI between the Python runtime and a kernel's host helper library.
//
// Mirrored field by field by ctypes structures in python/mixgemm/jit/driver.py; bump kAbiVersion on
// any change (the runtime refuses a helper whose version differs).
#pragma once

#include <cstdint>

namespace mixgemm::abi {

constexpr int32_t kAbiVersion = 5;

// y[m, n] = x[m, k] @ dequant(W)[n, k]^T (+ bias[n])
struct GemmArgs {
  int32_t abi_version;
  int32_t m;              // tokens: rows of x and y
  int32_t n;              // weight rows: out features
  int32_t k;              // in features
  int32_t group_size;     // K elements per scale group (k for per-channel)
  int32_t sm_count;       // SMs the persistent grid may use
  int32_t splits;         // 0: the kernel's choice; decode: the split-K factor; stream-K: > 1 forces split-K
  int32_t raster;         // 0: heuristic, 1: along weight rows, 2: along tokens
  int32_t activation;     // mixgemm::Activation applied to acc + bias (activation.hpp)
  int32_t swizzle;        // the tile scheduler's max_swizzle_size: 1, 2, 4 or 8 (0: 1)
  uint64_t weight;        // uint8 [n/16, k/64, 128*bits] (prepacked)
  uint64_t scales;        // act [k/group_size, n]
  uint64_t zeros;         // act [k/group_size, n] or 0
  uint64_t x;             // act [m, k], row stride ldx
  uint64_t bias;          // act [n] or 0
  uint64_t y;             // act [m, n], row stride ldy
  uint64_t workspace;     // workspace_bytes of device memory (its leading workspace_zero_bytes zeroed), or 0
  int64_t ldx;            // elements
  int64_t ldy;            // elements
  uint64_t locks;         // lock_bytes of zeroed device memory, which the kernel leaves zeroed, or 0
};

struct Launch {
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t cluster[3];
  uint32_t smem_bytes;        // dynamic shared memory
  uint32_t params_bytes;      // sizeof(Params)
  uint32_t workspace_zero_bytes;  // leading workspace bytes that must be zero (UINT32_MAX: all of it)
  uint64_t workspace_bytes;
  // Self-resetting locks (streamk_scheduler.hpp): zeroed memory at GemmArgs::locks that the launch
  // needs and leaves zeroed, so that it can be zeroed once and reused in stream order (0: none).
  uint64_t lock_bytes;
};

}  // namespace mixgemm::abi
