/* A stand-in for the CUDA driver (libcuda.so.1) for CPU-only tests and host-time profiles.
 *
 * Loaded into a process before cuda-python first touches the driver (tests/fake_driver.py), it
 * answers cuda-python's symbol lookups with functions that do nothing and succeed, except a few
 * that record what they were given:
 *
 *   cuLaunchKernelEx   grid, block, shared memory, stream, cluster / PDL attributes, function
 *                      and the first `params_size` bytes of the kernel's one by-value parameter
 *   cuMemsetD8Async    pointer, value, byte count, stream (and it sets the bytes of memory
 *                      that cuMemAlloc gave)
 *   cuMemAlloc / cuMemFree / cuMemcpyDtoH   host memory standing for device memory (filled with
 *                      0xA5 when allocated, never zero)
 *   cuGetErrorName / cuGetErrorString   fixed strings
 *   cuTensorMapEncodeTiled   a made-up descriptor of its arguments
 *
 * Nothing runs on any device. The structures below mirror cuda.h's (CUlaunchConfig,
 * CUlaunchAttribute) so that this file builds with a plain C compiler, without the toolkit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_RING 64
#define FAKE_PARAMS_MAX 4096

typedef struct {
  uint32_t id;
  uint32_t pad;
  union { uint8_t bytes[64]; struct { uint32_t x, y, z; } cluster; int32_t flag; } value;
} FakeLaunchAttribute;   /* CUlaunchAttribute */

typedef struct {
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t smem;
  uint64_t stream;
  FakeLaunchAttribute* attrs;
  uint32_t num_attrs;
} FakeLaunchConfig;      /* CUlaunchConfig */

/* One recorded driver call (a launch or a memset), in call order. */
typedef struct {
  uint64_t seq;           /* position among all recorded calls, from 1 */
  int32_t kind;           /* 1: cuLaunchKernelEx, 2: cuMemsetD8Async */
  int32_t result;         /* what the call returned */
  uint64_t function;
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t smem;
  uint32_t num_attrs;
  uint32_t cluster[3];    /* the CLUSTER_DIMENSION attribute's value (0 if absent) */
  int32_t pdl;            /* the PROGRAMMATIC_STREAM_SERIALIZATION attribute's value (-1 if absent) */
  uint64_t stream;
  uint64_t dptr;          /* memset: destination, value, count */
  uint32_t value;
  uint64_t count;
  uint32_t params_size;
  uint8_t params[FAKE_PARAMS_MAX];
} FakeCall;

static FakeCall g_calls[FAKE_RING];
static uint64_t g_seq = 0;
static uint32_t g_params_size = 0;
static int g_fail_launch = 0;   /* the CUresult the next cuLaunchKernelEx returns (0: success) */
static int g_fail_memset = 0;

static int fake_ok(void) { return 0; }

static FakeCall* next_call(int kind) {
  FakeCall* c = &g_calls[g_seq % FAKE_RING];
  memset(c, 0, sizeof(*c));
  c->seq = ++g_seq;
  c->kind = kind;
  c->pdl = -1;
  return c;
}

int cuDriverGetVersion(int* version) { *version = 13000; return 0; }
int cuInit(unsigned int flags) { (void)flags; return 0; }

int cuLaunchKernelEx(const FakeLaunchConfig* config, void* f, void** params, void** extra) {
  FakeCall* c = next_call(1);
  c->function = (uint64_t)(uintptr_t)f;
  memcpy(c->grid, config->grid, sizeof(c->grid));
  memcpy(c->block, config->block, sizeof(c->block));
  c->smem = config->smem;
  c->stream = config->stream;
  c->num_attrs = config->num_attrs;
  for (uint32_t i = 0; i < config->num_attrs; ++i) {
    if (config->attrs[i].id == 4) {   /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION */
      c->cluster[0] = config->attrs[i].value.cluster.x;
      c->cluster[1] = config->attrs[i].value.cluster.y;
      c->cluster[2] = config->attrs[i].value.cluster.z;
    } else if (config->attrs[i].id == 6) {   /* ..._PROGRAMMATIC_STREAM_SERIALIZATION */
      c->pdl = config->attrs[i].value.flag;
    }
  }
  if (params && params[0] && g_params_size) {
    c->params_size = g_params_size;
    memcpy(c->params, params[0], g_params_size);
  }
  c->result = extra ? 1 : g_fail_launch;   /* CUDA_ERROR_INVALID_VALUE: mixgemm passes no `extra` */
  g_fail_launch = 0;
  return c->result;
}

/* Device memory: host memory here, remembered so that a memset or copy touches only what
 * cuMemAlloc gave (a launch's workspace may be any address in these tests). Not thread-safe. */
#define FAKE_ALLOCS 256
static struct { uint64_t ptr; size_t size; } g_allocs[FAKE_ALLOCS];
static uint64_t g_alloc_count = 0;   /* cuMemAlloc calls, ever */

static int fake_allocated(uint64_t ptr, size_t count) {
  for (int i = 0; i < FAKE_ALLOCS; ++i)
    if (g_allocs[i].ptr && ptr >= g_allocs[i].ptr && ptr + count <= g_allocs[i].ptr + g_allocs[i].size) return 1;
  return 0;
}

int cuMemAlloc(uint64_t* dptr, size_t size) {
  for (int i = 0; i < FAKE_ALLOCS; ++i) {
    if (!g_allocs[i].ptr) {
      void* p = aligned_alloc(256, (size + 255) / 256 * 256);
      if (!p) return 2;   /* CUDA_ERROR_OUT_OF_MEMORY */
      memset(p, 0xA5, size);   /* never zeroed by the allocation */
      g_allocs[i].ptr = (uint64_t)(uintptr_t)p;
      g_allocs[i].size = size;
      *dptr = g_allocs[i].ptr;
      ++g_alloc_count;
      return 0;
    }
  }
  return 2;
}

int cuMemFree(uint64_t dptr) {
  for (int i = 0; i < FAKE_ALLOCS; ++i) {
    if (g_allocs[i].ptr == dptr && dptr) {
      free((void*)(uintptr_t)dptr);
      g_allocs[i].ptr = 0;
      return 0;
    }
  }
  return 1;   /* CUDA_ERROR_INVALID_VALUE */
}

int cuMemcpyDtoH(void* dst, uint64_t src, size_t count) {
  if (!fake_allocated(src, count)) return 1;
  memcpy(dst, (void*)(uintptr_t)src, count);
  return 0;
}

int cuMemsetD8Async(uint64_t dptr, unsigned char value, size_t count, uint64_t stream) {
  if (fake_allocated(dptr, count)) memset((void*)(uintptr_t)dptr, value, count);
  FakeCall* c = next_call(2);
  c->dptr = dptr;
  c->value = value;
  c->count = count;
  c->stream = stream;
  c->result = g_fail_memset;
  g_fail_memset = 0;
  return c->result;
}

int cuGetErrorName(int error, const char** name) {
  *name = error == 0 ? "CUDA_SUCCESS" : "CUDA_ERROR_FAKE";
  return 0;
}

int cuGetErrorString(int error, const char** text) {
  *text = error == 0 ? "no error" : "an error the fake driver was told to return";
  return 0;
}

/* cuTensorMapEncodeTiled: a made-up 128-byte descriptor of its arguments (address, the first two
 * dimensions, the first stride, the box, the data type and rank), so that params compare equal
 * exactly when they describe the same tensor the same way. */
int cuTensorMapEncodeTiled(void* map, int dtype, uint32_t rank, void* address, const uint64_t* dims,
                           const uint64_t* strides, const uint32_t* box, const uint32_t* element_strides,
                           int interleave, int swizzle, int l2_promotion, int oob_fill) {
  (void)element_strides; (void)interleave; (void)swizzle; (void)l2_promotion; (void)oob_fill;
  uint64_t w[16] = {0};
  w[0] = (uint64_t)address;
  w[1] = dims[0];
  w[2] = rank > 1 ? dims[1] : 0;
  w[3] = rank > 1 ? strides[0] : 0;
  w[4] = (uint64_t)box[0] | (rank > 1 ? (uint64_t)box[1] << 32 : 0);
  w[5] = (uint64_t)(uint32_t)dtype | (uint64_t)rank << 32;
  memcpy(map, w, sizeof(w));
  return 0;
}

int cuGetProcAddress_v2(const char* symbol, void** pfn, int version, uint64_t flags, int* status) {
  (void)version; (void)flags;
  static const struct { const char* name; void* fn; } known[] = {
    {"cuDriverGetVersion", (void*)cuDriverGetVersion}, {"cuInit", (void*)cuInit},
    {"cuLaunchKernelEx", (void*)cuLaunchKernelEx}, {"cuMemsetD8Async", (void*)cuMemsetD8Async},
    {"cuGetErrorName", (void*)cuGetErrorName}, {"cuGetErrorString", (void*)cuGetErrorString},
    {"cuGetProcAddress", (void*)cuGetProcAddress_v2}, {"cuTensorMapEncodeTiled", (void*)cuTensorMapEncodeTiled},
    {"cuMemAlloc", (void*)cuMemAlloc}, {"cuMemAlloc_v2", (void*)cuMemAlloc},
    {"cuMemFree", (void*)cuMemFree}, {"cuMemFree_v2", (void*)cuMemFree},
    {"cuMemcpyDtoH", (void*)cuMemcpyDtoH}, {"cuMemcpyDtoH_v2", (void*)cuMemcpyDtoH},
  };
  *pfn = (void*)fake_ok;
  for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); ++i)
    if (!strcmp(symbol, known[i].name)) *pfn = known[i].fn;
  if (status) *status = 0;
  return 0;
}

int cuGetProcAddress(const char* symbol, void** pfn, int version, uint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, 0);
}

/* --- the test's side ---------------------------------------------------------------------- */
void fake_reset(void) { g_seq = 0; g_fail_launch = g_fail_memset = 0; memset(g_calls, 0, sizeof(g_calls)); }
uint64_t fake_call_count(void) { return g_seq; }
uint64_t fake_alloc_count(void) { return g_alloc_count; }
/* Bytes of device memory held now. */
uint64_t fake_allocated_bytes(void) {
  uint64_t n = 0;
  for (int i = 0; i < FAKE_ALLOCS; ++i) if (g_allocs[i].ptr) n += g_allocs[i].size;
  return n;
}
/* The i-th recorded call (from 1), if it is still in the ring; 0 when it is not. */
int fake_get_call(uint64_t seq, FakeCall* out) {
  if (seq == 0 || seq > g_seq || g_seq - seq >= FAKE_RING) return 0;
  *out = g_calls[(seq - 1) % FAKE_RING];
  return 1;
}
void fake_set_params_size(uint32_t n) { g_params_size = n < FAKE_PARAMS_MAX ? n : FAKE_PARAMS_MAX; }
void fake_fail_next_launch(int result) { g_fail_launch = result; }
void fake_fail_next_memset(int result) { g_fail_memset = result; }
