// mixgemm's torch operator library: the CUDA kernels of the operator mixgemm::gemm (and of the
// norm and rotary operators, below), in C++.
//
// torch.compile's default mode calls mixgemm::gemm through the dispatcher on every step. With
// only a Python kernel, each call crosses from the dispatcher back into Python, which costs more
// host time than the launch. This library registers a C++ kernel for the operator's CUDA key
// that does what the Python fast path (python/mixgemm/dispatch/plans.py, run) does, without
// Python: it checks the call, finds the launch plan that Python made for this weight, token
// bucket, activation, dtype and device, allocates the output, and launches through the compiled
// launcher (csrc/launcher.cpp, whose driver entry points come from cuda-python).
//
// Python owns every decision. It hands over each launch plan it makes (a copy of the plan's
// bytes: nothing here points into Python), drops it when Python drops it (its weight freed, or
// plans cleared), and mirrors the per-stream workspace and lock buffers. Whenever this kernel
// has no plan, or a call is anything but the plain case (zero offsets, a strided or misaligned
// x, more tokens than the bucket table, a launch that asks for more memory, an error), it calls
// the operator mixgemm::gemm_py: the Python kernel, which validates, raises the errors, makes the
// plan (and hands it over) and launches.
//
// The RMSNorm operators (mixgemm::rms_norm, mixgemm::add_rms_norm) and the rotary / KV-cache
// operator (mixgemm::rotary_kv_cache) get the same treatment: Python hands over each loaded norm
// kernel (per dtype, residual or not, and device) and rope kernel (per dtype and device), and the
// C++ kernels launch it on plain calls, calling mixgemm::rms_norm_py / add_rms_norm_py /
// rotary_kv_cache_py for the rest.
//
// mixgemm::decode_layer is one decoder layer's decode step (python/mixgemm/ops/layer.py): the
// kernels above in the order Python's fused layer calls them, and torch's attention, in one call
// from Python instead of about twenty. Each part falls back as its own operator does.
//
// Python talks to this library through the extern "C" functions below (ctypes).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "mixgemm/abi.hpp"
#include "mixgemm/launcher_abi.hpp"

// Bump on any change of the C functions or structures below (python/mixgemm/jit/torch_ops.py
// checks it).
#define MIXGEMM_TORCH_OPS_VERSION 5

extern "C" {

// The key of a plan: everything that decides the launch (python/mixgemm/jit/torch_ops.py
// fills it from a LaunchPlan; the kernel fills it from a call).
struct MixgemmOpKey {
  uint64_t qdata;
  uint64_t scales;
  uint64_t zeros;         // 0: symmetric
  int64_t n;
  int64_t k;
  int64_t group_size;
  int32_t weight_type;    // index into the weight-type names given to mixgemm_ops_init
  int32_t activation;     // index into the activation names
  int32_t dtype;          // 0: float16, 1: bfloat16 (x, y, scales, bias)
  int32_t device;         // CUDA device index
  int32_t bucket;         // the token-count bucket (the bucket table given to mixgemm_ops_init)
  int32_t capturing;      // 1: the plan for launches under CUDA-graph capture
};

}  // extern "C"

namespace {

using CUstreamHandle = void*;
using StreamIsCapturing = int (*)(CUstreamHandle, int*);   // cuStreamIsCapturing

struct KeyHash {
  size_t operator()(MixgemmOpKey const& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) {
      h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix(key.qdata);
    mix(key.scales);
    mix(key.zeros);
    mix(uint64_t(key.n) * 131071u + uint64_t(key.k));
    mix(uint64_t(key.group_size));
    mix((uint64_t(key.weight_type) << 48) ^ (uint64_t(key.activation) << 32) ^ (uint64_t(key.dtype) << 24) ^
        (uint64_t(uint32_t(key.device)) << 8) ^ uint64_t(key.capturing));
    mix(uint64_t(key.bucket));
    return size_t(h);
  }
};

struct KeyEqual {
  bool operator()(MixgemmOpKey const& a, MixgemmOpKey const& b) const noexcept {
    return std::memcmp(&a, &b, sizeof(MixgemmOpKey)) == 0;
  }
};

struct Plan {
  MixgemmLaunchPlan launch;   // a copy of Python's
  int64_t n_out;              // output columns
  int64_t bias_len;           // a bias has this many elements
  bool uses_locks;            // the kernel takes zeroed stream-K locks
};

struct Arena {
  uint64_t ptr = 0;
  uint64_t bytes = 0;
};

struct ArenaKey {
  int32_t kind;     // 0: workspaces, 1: locks
  int32_t device;
  uint64_t stream;
  bool operator==(ArenaKey const& o) const noexcept {
    return kind == o.kind && device == o.device && stream == o.stream;
  }
};

struct ArenaHash {
  size_t operator()(ArenaKey const& a) const noexcept {
    return std::hash<uint64_t>()(a.stream) ^ (size_t(a.kind) << 1) ^ (size_t(uint32_t(a.device)) << 8);
  }
};

// A kernel Python loaded, launched here with plain arguments: one CTA per row.
struct RowKernel {
  uint64_t function = 0;        // CUfunction
  bool programmatic = false;    // launch with programmatic stream serialization
};
constexpr unsigned kNormThreads = 256;   // norm_kernel.hpp's
constexpr unsigned kRopeThreads = 256;   // rope_kernel.hpp's
using LaunchKernelEx = CUresult (*)(CUlaunchConfig const*, CUfunction, void**, void**);

int64_t norm_key(int32_t device, int32_t dtype, bool residual) {
  return (int64_t(device) << 8) | (int64_t(dtype) << 1) | int64_t(residual);
}

int64_t rope_key(int32_t device, int32_t dtype) {
  return (int64_t(device) << 8) | int64_t(dtype);
}

// Everything Python handed over (one per process).
struct State {
  std::shared_mutex mutex;
  bool ready = false;
  MixgemmLaunchFn launch = nullptr;
  StreamIsCapturing is_capturing = nullptr;
  std::vector<int32_t> buckets;                 // M -> bucket, for M < buckets.size()
  std::vector<std::string> weight_types;
  std::vector<std::string> activations;
  std::unordered_map<MixgemmOpKey, Plan, KeyHash, KeyEqual> plans;
  std::unordered_map<ArenaKey, Arena, ArenaHash> arenas;
  std::unordered_map<int64_t, RowKernel> norms;
  std::unordered_map<int64_t, RowKernel> ropes;
  LaunchKernelEx launch_kernel_ex = nullptr;
  std::atomic<uint64_t> hits{0};
  std::atomic<uint64_t> fallbacks{0};
  std::atomic<uint64_t> layers{0};   // mixgemm::decode_layer calls
};

State& state() {
  static State* s = new State();   // never destroyed: a kernel may run during interpreter shutdown
  return *s;
}

int32_t index_of(std::vector<std::string> const& names, c10::string_view name) {
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i].size() == name.size() && std::memcmp(names[i].data(), name.data(), name.size()) == 0) {
      return int32_t(i);
    }
  }
  return -1;
}

int32_t dtype_code(at::ScalarType t) {
  return t == at::kHalf ? 0 : t == at::kBFloat16 ? 1 : -1;
}

bool aligned_contiguous(at::Tensor const& t) {
  return t.is_contiguous() && (reinterpret_cast<uintptr_t>(t.const_data_ptr()) & 15) == 0;
}

at::Tensor gemm_py(at::Tensor const& x, at::Tensor const& qdata, at::Tensor const& scales,
                   std::optional<at::Tensor> const& zeros, std::optional<at::Tensor> const& zero_offsets,
                   std::optional<at::Tensor> const& bias, c10::string_view weight_type, int64_t group_size,
                   int64_t n, int64_t k, c10::string_view activation) {
  state().fallbacks.fetch_add(1, std::memory_order_relaxed);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mixgemm::gemm_py", "")
                       .typed<at::Tensor(at::Tensor const&, at::Tensor const&, at::Tensor const&,
                                         std::optional<at::Tensor> const&, std::optional<at::Tensor> const&,
                                         std::optional<at::Tensor> const&, c10::string_view, int64_t, int64_t,
                                         int64_t, c10::string_view)>();
  return op.call(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k, activation);
}

// The plan for `key` (its bucket, names and capture state filled in here from the call), and the
// stream's buffers; false when there is none (or the library is not initialized).
bool find_plan(State& s, MixgemmOpKey& key, int64_t m, c10::string_view weight_type, c10::string_view activation,
               uint64_t stream, Plan& plan, Arena& workspace, Arena& locks) {
  std::shared_lock<std::shared_mutex> lock(s.mutex);
  if (!s.ready || m >= int64_t(s.buckets.size())) return false;
  key.bucket = s.buckets[size_t(m)];
  key.weight_type = index_of(s.weight_types, weight_type);
  key.activation = index_of(s.activations, activation);
  if (key.weight_type < 0 || key.activation < 0) return false;
  int capturing = 0;
  // CU_STREAM_CAPTURE_STATUS_NONE (0) or _ACTIVE (1); an invalidated capture goes to Python
  if (s.is_capturing(reinterpret_cast<CUstreamHandle>(stream), &capturing) != 0 || capturing > 1) return false;
  key.capturing = capturing;
  auto const it = s.plans.find(key);
  if (it == s.plans.end()) return false;
  plan = it->second;
  auto const ws = s.arenas.find(ArenaKey{0, key.device, stream});
  if (ws != s.arenas.end()) workspace = ws->second;
  if (plan.uses_locks) {
    auto const lk = s.arenas.find(ArenaKey{1, key.device, stream});
    if (lk != s.arenas.end()) locks = lk->second;
  }
  return true;
}

// The CUDA kernel of mixgemm::gemm (see the file's comment).
at::Tensor gemm_cuda(at::Tensor const& x, at::Tensor const& qdata, at::Tensor const& scales,
                     std::optional<at::Tensor> const& zeros, std::optional<at::Tensor> const& zero_offsets,
                     std::optional<at::Tensor> const& bias, c10::string_view weight_type, int64_t group_size,
                     int64_t n, int64_t k, c10::string_view activation) {
  auto fallback = [&]() {
    return gemm_py(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k, activation);
  };
  State& s = state();
  int64_t const ndim = x.dim();
  if (zero_offsets.has_value() || ndim < 1 || !x.is_cuda() || k <= 0 || x.size(ndim - 1) != k) return fallback();
  auto const scalar = x.scalar_type();
  int32_t const dtype = dtype_code(scalar);
  if (dtype < 0 || !aligned_contiguous(x)) return fallback();
  int64_t const m = x.numel() / k;
  if (m <= 0) return fallback();

  MixgemmOpKey key;
  std::memset(&key, 0, sizeof(key));
  key.qdata = reinterpret_cast<uint64_t>(qdata.const_data_ptr());
  key.scales = reinterpret_cast<uint64_t>(scales.const_data_ptr());
  key.zeros = zeros.has_value() ? reinterpret_cast<uint64_t>(zeros->const_data_ptr()) : 0;
  key.n = n;
  key.k = k;
  key.group_size = group_size;
  key.dtype = dtype;
  key.device = x.get_device();
  c10::cuda::CUDAStream const torch_stream = c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(key.device));
  uint64_t const stream = reinterpret_cast<uint64_t>(torch_stream.stream());

  // Under the lock: no fallback (the Python kernel hands plans over, which takes the lock).
  Plan plan;
  Arena workspace, locks;
  if (!find_plan(s, key, m, weight_type, activation, stream, plan, workspace, locks)) return fallback();
  uint64_t bias_ptr = 0;
  if (bias.has_value()) {
    at::Tensor const& b = *bias;
    if (b.scalar_type() != scalar || !b.is_cuda() || b.get_device() != key.device || b.dim() != 1 ||
        b.size(0) != plan.bias_len || !b.is_contiguous()) {
      return fallback();
    }
    bias_ptr = reinterpret_cast<uint64_t>(b.const_data_ptr());
  }

  c10::SmallVector<int64_t, 6> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = plan.n_out;
  at::Tensor y = at::empty(sizes, x.options());

  MixgemmLaunchCall call;
  call.m = int32_t(m);
  call.reserved = 0;
  call.x = reinterpret_cast<uint64_t>(x.const_data_ptr());
  call.ldx = k;
  call.y = reinterpret_cast<uint64_t>(y.data_ptr());
  call.ldy = plan.n_out;
  call.bias = bias_ptr;
  call.workspace = workspace.ptr;
  call.workspace_capacity = workspace.bytes;
  call.locks = locks.ptr;
  call.locks_capacity = locks.bytes;
  call.stream = stream;
  int32_t const rc = s.launch(&plan.launch, &call);
  if (rc == kNeedWorkspace || rc == kNeedLocks) return fallback();   // nothing ran: Python finds the memory
  if (rc != kLaunched) return fallback();                          // Python launches again and raises the error
  s.hits.fetch_add(1, std::memory_order_relaxed);
  return y;
}



// The kernel held under `key` in `kernels`, and cuLaunchKernelEx; false where either is missing.
bool find_kernel(State& s, std::unordered_map<int64_t, RowKernel> const& kernels, int64_t key, RowKernel& kernel,
                 LaunchKernelEx& launch) {
  std::shared_lock<std::shared_mutex> lock(s.mutex);
  auto const it = kernels.find(key);
  if (it == kernels.end() || s.launch_kernel_ex == nullptr) return false;
  kernel = it->second;
  launch = s.launch_kernel_ex;
  return true;
}

// Launch `kernel` with `rows` CTAs of `threads` on the current stream of `device`; false where it
// did not launch (nothing ran).
bool launch_rows(LaunchKernelEx launch, RowKernel const& kernel, int64_t rows, unsigned threads, int32_t device,
                 void** argv) {
  if (rows <= 0 || rows > 0x7fffffff) return false;
  CUlaunchAttribute attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof(config));
  config.gridDimX = unsigned(rows);
  config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = threads;
  config.blockDimY = config.blockDimZ = 1;
  config.hStream = reinterpret_cast<CUstream>(c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(device)).stream());
  config.attrs = kernel.programmatic ? &attr : nullptr;
  config.numAttrs = kernel.programmatic ? 1 : 0;
  return launch(&config, reinterpret_cast<CUfunction>(kernel.function), argv, nullptr) == CUDA_SUCCESS;
}

// Launch the norm kernel on `rows` rows of `h` values; false where it cannot (nothing ran).
bool launch_norm(int32_t device, int32_t dtype, bool residual, void const* x, void const* res, void const* w,
                 void* out, void* sums, int64_t rows, int64_t h, double eps) {
  State& s = state();
  RowKernel kernel;
  LaunchKernelEx launch = nullptr;
  if (!find_kernel(s, s.norms, norm_key(device, dtype, residual), kernel, launch)) return false;
  if (rows == 0) return true;
  int row_vecs = int(h / 8);
  float eps32 = float(eps);
  void* argv[7] = {&x, &res, &w, &out, &sums, &row_vecs, &eps32};
  return launch_rows(launch, kernel, rows, kNormThreads, device, argv);
}

// The checks a plain norm call passes (anything else goes to Python, which raises or copies).
bool norm_call_ok(at::Tensor const& x, at::Tensor const& weight, double eps) {
  if (!x.is_cuda() || x.dim() < 1 || dtype_code(x.scalar_type()) < 0 || !aligned_contiguous(x)) return false;
  int64_t const h = x.size(x.dim() - 1);
  if (h <= 0 || (h * 2) % 16 != 0) return false;
  if (weight.dim() != 1 || weight.size(0) != h || weight.scalar_type() != x.scalar_type() || !weight.is_cuda() ||
      weight.get_device() != x.get_device() || !aligned_contiguous(weight)) {
    return false;
  }
  return std::isfinite(eps) && eps >= 0;
}

at::Tensor rms_norm_cuda(at::Tensor const& x, at::Tensor const& weight, double eps) {
  if (norm_call_ok(x, weight, eps)) {
    at::Tensor out = at::empty(x.sizes(), x.options());
    int64_t const h = x.size(x.dim() - 1);
    if (launch_norm(x.get_device(), dtype_code(x.scalar_type()), false, x.const_data_ptr(), nullptr,
                    weight.const_data_ptr(), out.data_ptr(), nullptr, x.numel() / h, h, eps)) {
      state().hits.fetch_add(1, std::memory_order_relaxed);
      return out;
    }
  }
  state().fallbacks.fetch_add(1, std::memory_order_relaxed);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mixgemm::rms_norm_py", "")
                       .typed<at::Tensor(at::Tensor const&, at::Tensor const&, double)>();
  return op.call(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(at::Tensor const& x, at::Tensor const& residual,
                                                     at::Tensor const& weight, double eps) {
  if (norm_call_ok(x, weight, eps) && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
      residual.is_cuda() && residual.get_device() == x.get_device() && aligned_contiguous(residual)) {
    at::Tensor out = at::empty(x.sizes(), x.options());
    at::Tensor sums = at::empty(x.sizes(), x.options());
    int64_t const h = x.size(x.dim() - 1);
    if (launch_norm(x.get_device(), dtype_code(x.scalar_type()), true, x.const_data_ptr(), residual.const_data_ptr(),
                    weight.const_data_ptr(), out.data_ptr(), sums.data_ptr(), x.numel() / h, h, eps)) {
      state().hits.fetch_add(1, std::memory_order_relaxed);
      return {out, sums};
    }
  }
  state().fallbacks.fetch_add(1, std::memory_order_relaxed);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mixgemm::add_rms_norm_py", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(at::Tensor const&, at::Tensor const&,
                                                                 at::Tensor const&, double)>();
  return op.call(x, residual, weight, eps);
}

// What a plain rotary call launches with (rope_kernel.hpp's MIXGEMM_ROPE_KV_ENTRY arguments).
struct RopeCall {
  int32_t device;
  int32_t dtype;
  int64_t b, t, d;
  int64_t const* positions;   // [B, T], or null: the token at index i of a sequence is at pos0 + i
  int64_t stride_b, stride_h, stride_l;
  int32_t table_positions, cache_length, pos0;
};

bool fits_int32(int64_t v) { return v >= 0 && v <= 0x7fffffff; }

bool like_qkv(at::Tensor const& t, at::Tensor const& qkv) {
  return t.scalar_type() == qkv.scalar_type() && t.is_cuda() && t.get_device() == qkv.get_device();
}

bool aligned_data(at::Tensor const& t) {
  return (reinterpret_cast<uintptr_t>(t.const_data_ptr()) & 15) == 0;
}

// The checks a plain rotary call passes: those of python/mixgemm/ops/rotary.py (_check, and
// _kernel_takes for the kernel), with every input as the kernel reads it (nothing to copy or
// convert). Anything else goes to Python, which raises, copies or runs the torch formula.
bool rope_call_ok(at::Tensor const& qkv, at::Tensor const& cos, at::Tensor const& sin, at::Tensor const& k_cache,
                  at::Tensor const& v_cache, std::optional<at::Tensor> const& positions, int64_t pos0, int64_t heads,
                  int64_t kv_heads, RopeCall& call) {
  if (!qkv.is_cuda() || qkv.dim() != 3 || dtype_code(qkv.scalar_type()) < 0 || !aligned_contiguous(qkv)) return false;
  if (!fits_int32(heads) || !fits_int32(kv_heads) || heads < 1 || kv_heads < 1 || heads % kv_heads != 0) return false;
  int64_t const b = qkv.size(0), t = qkv.size(1), width = qkv.size(2);
  int64_t const groups = heads + 2 * kv_heads;
  if (width % groups != 0) return false;
  int64_t const d = width / groups;
  if (d % 16 != 0) return false;   // the kernel's: whole 16-byte vector pairs (so D is even too)
  for (at::Tensor const* table : {&cos, &sin}) {
    if (table->dim() != 2 || table->size(1) != d || !like_qkv(*table, qkv) || !aligned_contiguous(*table)) return false;
  }
  if (cos.sizes() != sin.sizes()) return false;
  for (at::Tensor const* cache : {&k_cache, &v_cache}) {
    if (cache->dim() != 4 || cache->size(0) < b || cache->size(1) != kv_heads || cache->size(3) != d ||
        !like_qkv(*cache, qkv) || !aligned_data(*cache)) {
      return false;
    }
  }
  if (k_cache.sizes() != v_cache.sizes() || k_cache.strides() != v_cache.strides()) return false;
  if (k_cache.stride(3) != 1 || k_cache.stride(0) % 8 != 0 || k_cache.stride(1) % 8 != 0 ||
      k_cache.stride(2) % 8 != 0) {
    return false;
  }
  int64_t const table_positions = cos.size(0), cache_length = k_cache.size(2);
  if (!fits_int32(t) || !fits_int32(d) || !fits_int32(table_positions) || !fits_int32(cache_length)) return false;
  call.positions = nullptr;
  call.pos0 = 0;
  if (positions.has_value()) {
    // an int64 table as it is; an int32 one Python converts
    at::Tensor const& pos = *positions;
    if (pos.scalar_type() != at::kLong || !pos.is_cuda() || pos.get_device() != qkv.get_device() || pos.dim() != 2 ||
        pos.size(0) != b || pos.size(1) != t || !pos.is_contiguous()) {
      return false;
    }
    call.positions = pos.const_data_ptr<int64_t>();
  } else {
    // positions outside the tables or the cache: Python raises
    if (pos0 < 0 || pos0 > std::min(table_positions, cache_length) - t) return false;
    call.pos0 = int32_t(pos0);
  }
  call.device = qkv.get_device();
  call.dtype = dtype_code(qkv.scalar_type());
  call.b = b;
  call.t = t;
  call.d = d;
  call.stride_b = k_cache.stride(0);
  call.stride_h = k_cache.stride(1);
  call.stride_l = k_cache.stride(2);
  call.table_positions = int32_t(table_positions);
  call.cache_length = int32_t(cache_length);
  return true;
}

// The CUDA kernel of mixgemm::rotary_kv_cache: the rope kernel Python loaded, launched on a plain
// call (see rope_call_ok); anything else, and a call before Python handed the kernel over, goes to
// the Python kernel mixgemm::rotary_kv_cache_py.
at::Tensor rotary_kv_cache_cuda(at::Tensor const& qkv, at::Tensor const& cos, at::Tensor const& sin,
                                at::Tensor& k_cache, at::Tensor& v_cache, std::optional<at::Tensor> const& positions,
                                int64_t pos0, int64_t heads, int64_t kv_heads) {
  State& s = state();
  RopeCall call;
  RowKernel kernel;
  LaunchKernelEx launch = nullptr;
  if (rope_call_ok(qkv, cos, sin, k_cache, v_cache, positions, pos0, heads, kv_heads, call) &&
      find_kernel(s, s.ropes, rope_key(call.device, call.dtype), kernel, launch)) {
    at::Tensor q = at::empty({call.b, call.t, heads, call.d}, qkv.options());
    int64_t const rows = call.b * call.t;
    if (rows == 0) {
      s.hits.fetch_add(1, std::memory_order_relaxed);
      return q;
    }
    void const* qkv_ptr = qkv.const_data_ptr();
    void const* cos_ptr = cos.const_data_ptr();
    void const* sin_ptr = sin.const_data_ptr();
    int64_t const* pos_ptr = call.positions;
    void* q_ptr = q.data_ptr();
    void* k_ptr = k_cache.data_ptr();
    void* v_ptr = v_cache.data_ptr();
    int32_t tokens = int32_t(call.t), heads32 = int32_t(heads), kv_heads32 = int32_t(kv_heads);
    int32_t head_dim = int32_t(call.d);
    void* argv[17] = {&qkv_ptr, &cos_ptr, &sin_ptr, &pos_ptr, &q_ptr, &k_ptr, &v_ptr,
                      &call.stride_b, &call.stride_h, &call.stride_l, &tokens, &heads32, &kv_heads32,
                      &head_dim, &call.table_positions, &call.cache_length, &call.pos0};
    if (launch_rows(launch, kernel, rows, kRopeThreads, call.device, argv)) {
      s.hits.fetch_add(1, std::memory_order_relaxed);
      return q;
    }
  }
  s.fallbacks.fetch_add(1, std::memory_order_relaxed);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mixgemm::rotary_kv_cache_py", "")
                       .typed<at::Tensor(at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor&,
                                         at::Tensor&, std::optional<at::Tensor> const&, int64_t, int64_t,
                                         int64_t)>();
  return op.call(qkv, cos, sin, k_cache, v_cache, positions, pos0, heads, kv_heads);
}


// aten::_flash_attention_forward through its schema, by argument name (its C++ signature differs
// between torch versions; the arguments used here are in every version that has seqused_k). The
// schema's arguments are matched to what each one takes once, on the first call.
namespace flash {

enum class Arg : uint8_t { kQuery, kKey, kValue, kCumQ, kCumK, kMaxQ, kMaxK, kDropout, kFalse, kScale, kSeqUsedK,
                           kDefault };

struct Plan {
  c10::OperatorHandle op;
  std::vector<Arg> args;             // what each schema argument takes, in order
  std::vector<c10::IValue> defaults; // the schema's default where args[i] is kDefault
};

inline Plan make_plan() {
  Plan plan{c10::Dispatcher::singleton().findSchemaOrThrow("aten::_flash_attention_forward", ""), {}, {}};
  for (auto const& a : plan.op.schema().arguments()) {
    std::string const& name = a.name();
    Arg kind = Arg::kDefault;
    if (name == "query") kind = Arg::kQuery;
    else if (name == "key") kind = Arg::kKey;
    else if (name == "value") kind = Arg::kValue;
    else if (name == "cum_seq_q") kind = Arg::kCumQ;
    else if (name == "cum_seq_k") kind = Arg::kCumK;
    else if (name == "max_q") kind = Arg::kMaxQ;
    else if (name == "max_k") kind = Arg::kMaxK;
    else if (name == "dropout_p") kind = Arg::kDropout;
    else if (name == "is_causal" || name == "return_debug_mask") kind = Arg::kFalse;
    else if (name == "scale") kind = Arg::kScale;
    else if (name == "seqused_k") kind = Arg::kSeqUsedK;
    else TORCH_CHECK(a.default_value().has_value(), "mixgemm::decode_layer: aten::_flash_attention_forward has an "
                     "argument '", name, "' without a default");
    plan.args.push_back(kind);
    plan.defaults.push_back(kind == Arg::kDefault ? *a.default_value() : c10::IValue());
  }
  return plan;
}

}  // namespace flash

at::Tensor flash_by_length(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& q_offsets,
                           at::Tensor const& k_offsets, int64_t slots, double scale, at::Tensor const& lengths) {
  static flash::Plan const plan = flash::make_plan();
  std::vector<c10::IValue> stack;
  stack.reserve(plan.args.size());
  for (size_t i = 0; i < plan.args.size(); ++i) {
    switch (plan.args[i]) {
      case flash::Arg::kQuery: stack.emplace_back(q); break;
      case flash::Arg::kKey: stack.emplace_back(k); break;
      case flash::Arg::kValue: stack.emplace_back(v); break;
      case flash::Arg::kCumQ: stack.emplace_back(q_offsets); break;
      case flash::Arg::kCumK: stack.emplace_back(k_offsets); break;
      case flash::Arg::kMaxQ: stack.emplace_back(int64_t(1)); break;
      case flash::Arg::kMaxK: stack.emplace_back(slots); break;
      case flash::Arg::kDropout: stack.emplace_back(0.0); break;
      case flash::Arg::kFalse: stack.emplace_back(false); break;
      case flash::Arg::kScale: stack.emplace_back(scale); break;
      case flash::Arg::kSeqUsedK: stack.emplace_back(lengths); break;
      case flash::Arg::kDefault: stack.push_back(plan.defaults[i]); break;
    }
  }
  plan.op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The CUDA kernel of mixgemm::decode_layer (python/mixgemm/ops/layer.py has the definition, which
// the Python kernel runs): rms_norm, the qkv GEMM, rotary_kv_cache, the counter, the attention
// (FlashAttention over `lengths` slots, or SDPA with the query heads of a KV head as its rows and
// `mask`), the o GEMM, add + rms_norm, gate/up with swiglu, down, the residual add. The GEMMs,
// norms and rotary call this library's kernels, each handing what it cannot take to its Python
// kernel; the rest are torch's own operators.
at::Tensor decode_layer_cuda(at::Tensor const& x, at::TensorList norms, c10::ArrayRef<double> eps,
                             c10::List<std::optional<at::Tensor>> const& weights, c10::string_view weight_types,
                             c10::IntArrayRef shapes, at::Tensor const& cos, at::Tensor const& sin, at::Tensor& k_cache,
                             at::Tensor& v_cache, at::Tensor const& positions,
                             std::optional<at::Tensor> const& counter, int64_t heads, int64_t kv_heads,
                             double scaling, std::optional<at::Tensor> const& mask,
                             std::optional<at::Tensor> const& lengths, std::optional<at::Tensor> const& q_offsets,
                             std::optional<at::Tensor> const& k_offsets) {
  TORCH_CHECK(norms.size() == 2 && eps.size() == 2 && weights.size() == 16 && shapes.size() == 12 && x.dim() == 3,
              "mixgemm::decode_layer: 2 norms and eps, 16 weight tensors and 12 sizes, x [B, T, H]");
  // "u4,u4,u4,u4": the weight types of qkv, o, gate/up and down
  c10::string_view types[4];
  size_t start = 0;
  for (int i = 0; i < 4; ++i) {
    size_t const end = i < 3 ? weight_types.find(',', start) : weight_types.size();
    TORCH_CHECK(end != c10::string_view::npos, "mixgemm::decode_layer: four weight types, got ", weight_types);
    types[i] = weight_types.substr(start, end - start);
    start = end + 1;
  }
  auto linear = [&](int i, at::Tensor const& in, c10::string_view activation) {
    std::optional<at::Tensor> const zeros = weights.get(size_t(4 * i + 2));
    std::optional<at::Tensor> const bias = weights.get(size_t(4 * i + 3));
    return gemm_cuda(in, *weights.get(size_t(4 * i)), *weights.get(size_t(4 * i + 1)), zeros, std::nullopt, bias,
                     types[i], shapes[3 * i], shapes[3 * i + 1], shapes[3 * i + 2], activation);
  };
  int64_t const b = x.size(0), t = x.size(1);
  at::Tensor const h = rms_norm_cuda(x, norms[0], eps[0]);
  at::Tensor const qkv = linear(0, h, "none");
  at::Tensor q = rotary_kv_cache_cuda(qkv, cos, sin, k_cache, v_cache, positions, 0, heads, kv_heads);   // [B, T, heads, D]
  if (counter.has_value()) {
    at::Tensor c = *counter;
    c.add_(t);
  }
  int64_t const d = q.size(3);
  at::Tensor out;
  if (lengths.has_value()) {
    out = flash_by_length(q.reshape({b * t, heads, d}), k_cache.select(0, 0).transpose(0, 1),
                          v_cache.select(0, 0).transpose(0, 1), *q_offsets, *k_offsets, k_cache.size(2), scaling,
                          *lengths);
  } else {
    at::Tensor const packed = q.transpose(1, 2).reshape({b, kv_heads, heads / kv_heads, d});
    out = at::scaled_dot_product_attention(packed, k_cache, v_cache, mask, 0.0, false, scaling)
              .reshape({b, heads, 1, d})
              .transpose(1, 2);
  }
  at::Tensor const a = linear(1, out.reshape({b, t, heads * d}).contiguous(), "none");
  auto [h2, residual] = add_rms_norm_cuda(a, x, norms[1], eps[1]);
  at::Tensor const y = linear(3, linear(2, h2, "swiglu"), "none");
  state().layers.fetch_add(1, std::memory_order_relaxed);
  return at::add(residual, y);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixgemm, CUDA, m) {
  m.impl("gemm", TORCH_FN(gemm_cuda));
  m.impl("rms_norm", TORCH_FN(rms_norm_cuda));
  m.impl("add_rms_norm", TORCH_FN(add_rms_norm_cuda));
  m.impl("rotary_kv_cache", TORCH_FN(rotary_kv_cache_cuda));
  m.impl("decode_layer", TORCH_FN(decode_layer_cuda));
}

extern "C" {

int32_t mixgemm_ops_version() { return MIXGEMM_TORCH_OPS_VERSION; }
int32_t mixgemm_ops_launcher_version() { return mixgemm::launcher::kLauncherVersion; }
uint32_t mixgemm_ops_plan_size() { return uint32_t(sizeof(MixgemmLaunchPlan)); }
uint32_t mixgemm_ops_key_size() { return uint32_t(sizeof(MixgemmOpKey)); }

// Once, before anything else: the launcher's mixgemm_launch, the driver's cuStreamIsCapturing,
// the bucket table (M -> bucket for M < n_buckets), and the weight-type and activation names
// (each a '\0'-terminated string, one after the other, ended by an empty one).
void mixgemm_ops_init(uint64_t launch, uint64_t stream_is_capturing, int32_t const* buckets, int32_t n_buckets,
                      char const* weight_types, char const* activations) {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  auto names = [](char const* p) {
    std::vector<std::string> out;
    for (; *p; p += std::strlen(p) + 1) out.emplace_back(p);
    return out;
  };
  s.launch = reinterpret_cast<MixgemmLaunchFn>(launch);
  s.is_capturing = reinterpret_cast<StreamIsCapturing>(stream_is_capturing);
  s.buckets.assign(buckets, buckets + n_buckets);
  s.weight_types = names(weight_types);
  s.activations = names(activations);
  s.plans.clear();
  s.arenas.clear();
  s.ready = s.launch != nullptr && s.is_capturing != nullptr;
}

// Hand over a plan (a copy is kept), replacing any of the same key.
void mixgemm_ops_put(MixgemmOpKey const* key, MixgemmLaunchPlan const* plan, int64_t n_out, int64_t bias_len,
                     int32_t uses_locks) {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  s.plans[*key] = Plan{*plan, n_out, bias_len, uses_locks != 0};
}

// Forget a plan (Python dropped it). Returns 1 if it was held.
int32_t mixgemm_ops_drop(MixgemmOpKey const* key) {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  return int32_t(s.plans.erase(*key));
}

// Forget every plan.
void mixgemm_ops_clear_plans() {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  s.plans.clear();
}

// The buffer of `kind` (0: workspaces, 1: zeroed locks) on offer to launches on (device, stream);
// bytes 0 forgets it.
void mixgemm_ops_set_arena(int32_t kind, int32_t device, uint64_t stream, uint64_t ptr, uint64_t bytes) {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  if (bytes == 0) {
    s.arenas.erase(ArenaKey{kind, device, stream});
  } else {
    s.arenas[ArenaKey{kind, device, stream}] = Arena{ptr, bytes};
  }
}

// Forget every buffer.
void mixgemm_ops_clear_arenas() {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  s.arenas.clear();
}

// Hand over a loaded norm kernel: `function` (a CUfunction) of the kernel for `dtype` rows (0:
// float16, 1: bfloat16), with the residual add or not, on `device`; `launch_kernel_ex` is the
// driver's cuLaunchKernelEx.
void mixgemm_ops_put_norm(int32_t residual, int32_t dtype, int32_t device, uint64_t function, int32_t programmatic,
                          uint64_t launch_kernel_ex) {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  s.norms[norm_key(device, dtype, residual != 0)] = RowKernel{function, programmatic != 0};
  s.launch_kernel_ex = reinterpret_cast<LaunchKernelEx>(launch_kernel_ex);
}

// Forget every norm kernel.
void mixgemm_ops_clear_norms() {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  s.norms.clear();
}

// Hand over a loaded rotary / KV-cache kernel: `function` (a CUfunction) of the kernel for a qkv
// of `dtype` (0: float16, 1: bfloat16) on `device`; `launch_kernel_ex` is the driver's
// cuLaunchKernelEx.
void mixgemm_ops_put_rope(int32_t dtype, int32_t device, uint64_t function, int32_t programmatic,
                          uint64_t launch_kernel_ex) {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  s.ropes[rope_key(device, dtype)] = RowKernel{function, programmatic != 0};
  s.launch_kernel_ex = reinterpret_cast<LaunchKernelEx>(launch_kernel_ex);
}

// Forget every rotary / KV-cache kernel.
void mixgemm_ops_clear_ropes() {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  s.ropes.clear();
}

uint64_t mixgemm_ops_plan_count() {
  State& s = state();
  std::shared_lock<std::shared_mutex> lock(s.mutex);
  return uint64_t(s.plans.size());
}

// Calls launched here, and calls handed to the Python kernel, since the process started.
uint64_t mixgemm_ops_hits() { return state().hits.load(); }
uint64_t mixgemm_ops_fallbacks() { return state().fallbacks.load(); }
// mixgemm::decode_layer calls taken here, since the process started.
uint64_t mixgemm_ops_layers() { return state().layers.load(); }

}  // extern "C"


// =============================================================================================
// mixgemm::fused_moe: the routed decode plan in C++
// =============================================================================================
//
// At decode sizes python/mixgemm/moe/layer.py's fused_moe makes three launches (its "routed"
// plan): gate/up on the grouped decode kernel in its routed mode (x read by token, h written
// sorted by expert), down on it (h read sorted, y written by assignment), and the combine kernel
// (out[t] = sum_s w[t, s] * y[t * topk + s] over the slots whose id is in [0, E)). Python hands
// over a MoE plan for each (weights, rows, ids, weights' dtype, device, capture state) it ran
// that way: both grouped kernels (CUfunction, its helper's routed prepare function, the GemmArgs
// of the launch but for x and y, the Routed flags) and the combine kernel. The C++ kernel of
// mixgemm::fused_moe checks a call, finds its plan, allocates h, y and the output, prepares both
// grouped launches' params through the helpers and launches the three kernels with the driver's
// cuLaunchKernelEx, as Python does (moe/grouped.py's _launch, jit/loader.py's launch_prepared
// and launch_kernel, moe/routing.py's _launch_combine). Every other call (no plan, a strided or
// misaligned x, non-contiguous ids or weights, a prepare that refuses, a launch that asks for a
// workspace or locks, a driver error) goes to mixgemm::fused_moe_py, the Python kernel, which
// validates, raises the errors, runs the call and hands the plan over.
//
// topk_weights of a dtype the combine kernel does not read (float64: its float32 kernel) are
// converted here with at::Tensor::to, as Python converts them.
//
// A plan is keyed by the six weight pointers, the shapes, group sizes and weight type, the rows
// (T * topk) and top-k, x's dtype, the ids' element size, the weights' dtype, the device and the
// capture state; it holds the shapes of the weight tensors it was made for, which every call
// checks too. Python drops a plan when any of its weight tensors is freed.

extern "C" {

// The key of a MoE plan (python/mixgemm/jit/torch_ops.py MoeKey).
struct MixgemmMoeKey {
  uint64_t w13_qdata;
  uint64_t w13_scales;
  uint64_t w13_zeros;       // 0: symmetric
  uint64_t w2_qdata;
  uint64_t w2_scales;
  uint64_t w2_zeros;        // 0: symmetric
  int64_t hidden;
  int64_t intermediate;
  int64_t w13_group_size;
  int64_t w2_group_size;
  int64_t num_experts;
  int32_t rows;             // T * topk
  int32_t topk;
  int32_t weight_type;      // index into the weight-type names given to mixgemm_ops_init
  int32_t dtype;            // x's: 0 float16, 1 bfloat16
  int32_t ids_bytes;        // topk_ids' element size: 4 (int32) or 8 (int64)
  int32_t weights_dtype;    // topk_weights': 0 float16, 1 bfloat16, 2 float32, 3 float64
  int32_t device;           // CUDA device index
  int32_t capturing;        // 1: the plan for launches under CUDA-graph capture
};

// One routed grouped decode launch of a MoE plan.
struct MixgemmMoeGemm {
  uint64_t function;                // CUfunction
  uint64_t prepare;                 // the helper's mixgemm_grouped_routed_prepare
  int32_t programmatic;             // 1: launch with programmatic stream serialization (PDL)
  uint32_t params_size;             // the helper's mixgemm_params_size()
  int32_t x_by_token;               // Routed::x_by_token
  int32_t y_by_assignment;          // Routed::y_by_assignment
  int64_t n_out;                    // y's columns (I for gate/up with swiglu, H for down)
  int64_t qdata_sizes[4];           // the weight's qdata [E, N/16, K/64, 128*bits]
  int64_t scales_sizes[3];          // its scales (and zeros) [E, G, N]
  mixgemm::abi::GemmArgs args;      // every field but x and y
};

// A MoE plan: gate/up, down and the combine kernel.
struct MixgemmMoePlan {
  MixgemmMoeGemm gate_up;
  MixgemmMoeGemm down;
  uint64_t combine;                 // CUfunction of the combine kernel
  uint64_t launch_kernel_ex;        // the driver's cuLaunchKernelEx
  int32_t combine_programmatic;     // 1: launch with programmatic stream serialization (PDL)
  int32_t combine_threads;          // threads per CTA
  int32_t combine_weights;          // the weights' dtype the kernel reads (MixgemmMoeKey's codes)
  int32_t reserved;
};

}  // extern "C"

namespace {

// mixgemm::grouped_decode::Routed (cutlass_ext/mixgemm/grouped_decode_kernel.hpp)
struct MoeRouted {
  uint64_t ids;
  int32_t ids_bytes;
  int32_t topk;
  int32_t x_by_token;
  int32_t y_by_assignment;
};
using RoutedPrepare = int (*)(mixgemm::abi::GemmArgs const*, MoeRouted const*, int32_t, void*, uint32_t,
                              mixgemm::abi::Launch*, char*, int);

// The most assignments the routed grouped kernels rank (moe/grouped.py ROUTED_MAX_ASSIGNMENTS).
constexpr int64_t kMoeMaxRows = 256;

struct MoeKeyHash {
  size_t operator()(MixgemmMoeKey const& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    uint64_t words[sizeof(MixgemmMoeKey) / 8];
    static_assert(sizeof(MixgemmMoeKey) % 8 == 0, "MixgemmMoeKey: whole words");
    std::memcpy(words, &key, sizeof(key));
    for (uint64_t w : words) h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return size_t(h);
  }
};

struct MoeKeyEqual {
  bool operator()(MixgemmMoeKey const& a, MixgemmMoeKey const& b) const noexcept {
    return std::memcmp(&a, &b, sizeof(MixgemmMoeKey)) == 0;
  }
};

// The MoE plans Python handed over (one per process), under a lock of their own.
struct MoeState {
  std::shared_mutex mutex;
  std::unordered_map<MixgemmMoeKey, MixgemmMoePlan, MoeKeyHash, MoeKeyEqual> plans;
};

MoeState& moe_state() {
  static MoeState* s = new MoeState();   // never destroyed (as state())
  return *s;
}

int32_t moe_weights_code(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return 0;
    case at::kBFloat16: return 1;
    case at::kFloat: return 2;
    case at::kDouble: return 3;
    default: return -1;
  }
}

at::ScalarType moe_weights_type(int32_t code) {
  return code == 0 ? at::kHalf : code == 1 ? at::kBFloat16 : at::kFloat;
}

bool same_sizes(at::Tensor const& t, int64_t const* sizes, int64_t dims) {
  if (t.dim() != dims) return false;
  for (int64_t i = 0; i < dims; ++i) {
    if (t.size(i) != sizes[i]) return false;
  }
  return true;
}

// A weight's tensors are those the plan was made for: shapes, dtypes, contiguous, on x's device.
bool moe_weight_ok(MixgemmMoeGemm const& g, at::Tensor const& qdata, at::Tensor const& scales,
                   std::optional<at::Tensor> const& zeros, at::ScalarType act, c10::Device device) {
  auto ok = [&](at::Tensor const& t, at::ScalarType type, int64_t const* sizes, int64_t dims) {
    return t.scalar_type() == type && t.device() == device && t.is_contiguous() && same_sizes(t, sizes, dims);
  };
  return ok(qdata, at::kByte, g.qdata_sizes, 4) && ok(scales, act, g.scales_sizes, 3) &&
         (!zeros.has_value() || ok(*zeros, act, g.scales_sizes, 3));
}

// The grouped launch's params into `params` and its shape into `launch`; false where the helper
// refuses or the launch asks for memory (nothing is launched here).
bool moe_prepare(MixgemmMoeGemm const& g, uint64_t x, uint64_t y, MoeRouted const& routed, int32_t experts,
                 unsigned char* params, mixgemm::abi::Launch& launch) {
  mixgemm::abi::GemmArgs args = g.args;
  args.x = x;
  args.y = y;
  char err[256];
  std::memset(&launch, 0, sizeof(launch));
  int const rc = reinterpret_cast<RoutedPrepare>(g.prepare)(&args, &routed, experts, params, g.params_size, &launch,
                                                            err, int(sizeof(err)));
  return rc == 0 && launch.workspace_bytes == 0 && launch.lock_bytes == 0;
}

// cuLaunchKernelEx of `function` with `argv`: the cluster shape if given, then PDL where allowed
// (jit/loader.py _launch_config's attributes, in its order).
bool moe_launch(LaunchKernelEx launch_ex, uint64_t function, bool programmatic, uint32_t const grid[3],
                uint32_t const block[3], uint32_t const* cluster, uint32_t smem, CUstream stream, void** argv) {
  CUlaunchAttribute attrs[2];
  std::memset(attrs, 0, sizeof(attrs));
  unsigned n = 0;
  if (cluster != nullptr) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[n].value.clusterDim.x = cluster[0];
    attrs[n].value.clusterDim.y = cluster[1];
    attrs[n].value.clusterDim.z = cluster[2];
    ++n;
  }
  if (programmatic) {
    attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[n].value.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof(config));
  config.gridDimX = grid[0];
  config.gridDimY = grid[1];
  config.gridDimZ = grid[2];
  config.blockDimX = block[0];
  config.blockDimY = block[1];
  config.blockDimZ = block[2];
  config.sharedMemBytes = smem;
  config.hStream = stream;
  config.attrs = n ? attrs : nullptr;
  config.numAttrs = n;
  return launch_ex(&config, reinterpret_cast<CUfunction>(function), argv, nullptr) == CUDA_SUCCESS;
}

// The plan of `key` (its weight type and capture state filled in here), copied into `plan`; false
// when there is none (or the library is not initialized).
bool moe_find(MixgemmMoeKey& key, c10::string_view weight_type, CUstream stream, MixgemmMoePlan& plan) {
  StreamIsCapturing is_capturing = nullptr;
  {
    State& s = state();
    std::shared_lock<std::shared_mutex> lock(s.mutex);
    if (!s.ready) return false;
    key.weight_type = index_of(s.weight_types, weight_type);
    is_capturing = s.is_capturing;
  }
  if (key.weight_type < 0) return false;
  int capturing = 0;
  // CU_STREAM_CAPTURE_STATUS_NONE (0) or _ACTIVE (1); an invalidated capture goes to Python
  if (is_capturing(reinterpret_cast<CUstreamHandle>(stream), &capturing) != 0 || capturing > 1) return false;
  key.capturing = capturing;
  MoeState& m = moe_state();
  std::shared_lock<std::shared_mutex> lock(m.mutex);
  auto const it = m.plans.find(key);
  if (it == m.plans.end()) return false;
  plan = it->second;
  return true;
}

at::Tensor fused_moe_py(at::Tensor const& x, at::Tensor const& w13_qdata, at::Tensor const& w13_scales,
                        std::optional<at::Tensor> const& w13_zeros, at::Tensor const& w2_qdata,
                        at::Tensor const& w2_scales, std::optional<at::Tensor> const& w2_zeros,
                        c10::string_view weight_type, int64_t w13_group_size, int64_t w2_group_size, int64_t hidden,
                        int64_t intermediate, at::Tensor const& topk_weights, at::Tensor const& topk_ids) {
  state().fallbacks.fetch_add(1, std::memory_order_relaxed);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mixgemm::fused_moe_py", "")
                       .typed<at::Tensor(at::Tensor const&, at::Tensor const&, at::Tensor const&,
                                         std::optional<at::Tensor> const&, at::Tensor const&, at::Tensor const&,
                                         std::optional<at::Tensor> const&, c10::string_view, int64_t, int64_t,
                                         int64_t, int64_t, at::Tensor const&, at::Tensor const&)>();
  return op.call(x, w13_qdata, w13_scales, w13_zeros, w2_qdata, w2_scales, w2_zeros, weight_type, w13_group_size,
                 w2_group_size, hidden, intermediate, topk_weights, topk_ids);
}

uint64_t ptr_of(at::Tensor const& t) { return reinterpret_cast<uint64_t>(t.const_data_ptr()); }

// The CUDA kernel of mixgemm::fused_moe (see the section's comment).
at::Tensor fused_moe_cuda(at::Tensor const& x, at::Tensor const& w13_qdata, at::Tensor const& w13_scales,
                          std::optional<at::Tensor> const& w13_zeros, at::Tensor const& w2_qdata,
                          at::Tensor const& w2_scales, std::optional<at::Tensor> const& w2_zeros,
                          c10::string_view weight_type, int64_t w13_group_size, int64_t w2_group_size,
                          int64_t hidden, int64_t intermediate, at::Tensor const& topk_weights,
                          at::Tensor const& topk_ids) {
  auto fallback = [&]() {
    return fused_moe_py(x, w13_qdata, w13_scales, w13_zeros, w2_qdata, w2_scales, w2_zeros, weight_type,
                        w13_group_size, w2_group_size, hidden, intermediate, topk_weights, topk_ids);
  };
  // the plain call: x [T, H] contiguous, aligned, bf16 / fp16 on a GPU; ids and weights [T, topk]
  // contiguous on x's device; 1 <= T * topk <= the routed kernels' most
  if (!x.is_cuda() || x.dim() != 2 || x.size(1) != hidden || !aligned_contiguous(x)) return fallback();
  int32_t const dtype = dtype_code(x.scalar_type());
  int32_t const ids_bytes = topk_ids.scalar_type() == at::kInt ? 4 : topk_ids.scalar_type() == at::kLong ? 8 : 0;
  int32_t const weights_code = moe_weights_code(topk_weights.scalar_type());
  c10::Device const device = x.device();
  if (dtype < 0 || ids_bytes == 0 || weights_code < 0 || topk_ids.dim() != 2 || topk_ids.size(0) != x.size(0) ||
      !topk_ids.is_contiguous() || topk_ids.device() != device || topk_weights.sizes() != topk_ids.sizes() ||
      !topk_weights.is_contiguous() || topk_weights.device() != device || w13_qdata.dim() != 4) {
    return fallback();
  }
  int64_t const tokens = x.size(0), topk = topk_ids.size(1), rows = tokens * topk;
  if (rows < 1 || rows > kMoeMaxRows) return fallback();
  if ((w13_zeros.has_value() && w13_zeros->const_data_ptr() == nullptr) ||
      (w2_zeros.has_value() && w2_zeros->const_data_ptr() == nullptr)) {
    return fallback();
  }

  MixgemmMoeKey key;
  std::memset(&key, 0, sizeof(key));
  key.w13_qdata = ptr_of(w13_qdata);
  key.w13_scales = ptr_of(w13_scales);
  key.w13_zeros = w13_zeros.has_value() ? ptr_of(*w13_zeros) : 0;
  key.w2_qdata = ptr_of(w2_qdata);
  key.w2_scales = ptr_of(w2_scales);
  key.w2_zeros = w2_zeros.has_value() ? ptr_of(*w2_zeros) : 0;
  key.hidden = hidden;
  key.intermediate = intermediate;
  key.w13_group_size = w13_group_size;
  key.w2_group_size = w2_group_size;
  key.num_experts = w13_qdata.size(0);
  key.rows = int32_t(rows);
  key.topk = int32_t(topk);
  key.dtype = dtype;
  key.ids_bytes = ids_bytes;
  key.weights_dtype = weights_code;
  key.device = x.get_device();
  CUstream const stream = reinterpret_cast<CUstream>(
      c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(key.device)).stream());

  // Under the locks: no fallback (the Python kernel hands plans over, which takes them).
  MixgemmMoePlan plan;
  if (!moe_find(key, weight_type, stream, plan)) return fallback();
  at::ScalarType const act = x.scalar_type();
  if (!moe_weight_ok(plan.gate_up, w13_qdata, w13_scales, w13_zeros, act, device) ||
      !moe_weight_ok(plan.down, w2_qdata, w2_scales, w2_zeros, act, device)) {
    return fallback();
  }

  at::Tensor h = at::empty({rows, plan.gate_up.n_out}, x.options());
  at::Tensor y = at::empty({rows, plan.down.n_out}, x.options());
  uint64_t const ids = ptr_of(topk_ids);
  int32_t const experts = int32_t(key.num_experts);
  // both launches prepared before either is queued: a refusal leaves nothing launched
  uint32_t const p13 = plan.gate_up.params_size, p2 = plan.down.params_size;
  thread_local std::vector<unsigned char> params;
  if (params.size() < size_t(p13) + p2) params.resize(size_t(p13) + p2);
  mixgemm::abi::Launch l13, l2;
  MoeRouted const r13{ids, ids_bytes, int32_t(topk), plan.gate_up.x_by_token, plan.gate_up.y_by_assignment};
  MoeRouted const r2{ids, ids_bytes, int32_t(topk), plan.down.x_by_token, plan.down.y_by_assignment};
  if (!moe_prepare(plan.gate_up, ptr_of(x), ptr_of(h), r13, experts, params.data(), l13) ||
      !moe_prepare(plan.down, ptr_of(h), ptr_of(y), r2, experts, params.data() + p13, l2)) {
    return fallback();
  }
  // the weights as the combine kernel reads them (float64: its float32 kernel, as Python converts)
  at::Tensor const weights = weights_code == plan.combine_weights
                                 ? topk_weights
                                 : topk_weights.to(moe_weights_type(plan.combine_weights));
  at::Tensor out = at::empty({tokens, hidden}, x.options());

  auto const launch_ex = reinterpret_cast<LaunchKernelEx>(plan.launch_kernel_ex);
  void* argv13[1] = {params.data()};
  void* argv2[1] = {params.data() + p13};
  void const* y_ptr = y.const_data_ptr();
  void const* w_ptr = weights.const_data_ptr();
  void const* inv_ptr = nullptr;
  void const* ids_ptr = topk_ids.const_data_ptr();
  int ids_size = ids_bytes, num_experts = experts, topk_i = int(topk);
  void* out_ptr = out.data_ptr();
  int row_vecs = int(hidden * x.element_size() / 16);
  void* argv_combine[9] = {&y_ptr, &w_ptr, &inv_ptr, &ids_ptr, &ids_size, &num_experts, &out_ptr, &topk_i,
                           &row_vecs};
  uint32_t const threads = uint32_t(plan.combine_threads);
  uint32_t const grid[3] = {(uint32_t(row_vecs) + threads - 1) / threads, uint32_t(tokens), 1};
  uint32_t const block[3] = {threads, 1, 1};
  // (a driver error: Python runs the call again and raises it)
  if (!moe_launch(launch_ex, plan.gate_up.function, plan.gate_up.programmatic != 0, l13.grid, l13.block,
                  l13.cluster, l13.smem_bytes, stream, argv13) ||
      !moe_launch(launch_ex, plan.down.function, plan.down.programmatic != 0, l2.grid, l2.block, l2.cluster,
                  l2.smem_bytes, stream, argv2) ||
      !moe_launch(launch_ex, plan.combine, plan.combine_programmatic != 0, grid, block, nullptr, 0, stream,
                  argv_combine)) {
    return fallback();
  }
  state().hits.fetch_add(1, std::memory_order_relaxed);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mixgemm, CUDA, m) {
  m.impl("fused_moe", TORCH_FN(fused_moe_cuda));
}

extern "C" {

uint32_t mixgemm_ops_moe_key_size() { return uint32_t(sizeof(MixgemmMoeKey)); }
uint32_t mixgemm_ops_moe_plan_size() { return uint32_t(sizeof(MixgemmMoePlan)); }

// Hand over a MoE plan (a copy is kept), replacing any of the same key.
void mixgemm_ops_put_moe(MixgemmMoeKey const* key, MixgemmMoePlan const* plan) {
  MoeState& m = moe_state();
  std::unique_lock<std::shared_mutex> lock(m.mutex);
  m.plans[*key] = *plan;
}

// Forget a MoE plan (one of its weights was freed). Returns 1 if it was held.
int32_t mixgemm_ops_drop_moe(MixgemmMoeKey const* key) {
  MoeState& m = moe_state();
  std::unique_lock<std::shared_mutex> lock(m.mutex);
  return int32_t(m.plans.erase(*key));
}

// Forget every MoE plan.
void mixgemm_ops_clear_moe() {
  MoeState& m = moe_state();
  std::unique_lock<std::shared_mutex> lock(m.mutex);
  m.plans.clear();
}

uint64_t mixgemm_ops_moe_plan_count() {
  MoeState& m = moe_state();
  std::shared_lock<std::shared_mutex> lock(m.mutex);
  return uint64_t(m.plans.size());
}

}  // extern "C"
