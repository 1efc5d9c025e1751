// Session-12 experiment: prefetch byte ranges into L2 from a side stream, so that a later decode
// GEMM reads its weights from L2. Fire-and-forget: the kernel issues the prefetches and exits.
#include <cstdint>

struct Ranges {
  unsigned long long ptr[8];
  unsigned long long bytes[8];
  unsigned keep_lo[8];  // a range's chunk c is prefetched iff keep_lo <= c % 8 < keep_hi
  unsigned keep_hi[8];
  int count;
  int mode;            // 0: cp.async.bulk.prefetch.L2 (normal), 1: same, evict_last, 2: prefetch.global.L2::evict_last per line
  unsigned chunk;      // bytes per bulk prefetch
};

extern "C" __global__ void l2_prefetch(Ranges r) {
  unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  unsigned long long nthreads = (unsigned long long)gridDim.x * blockDim.x;
  uint64_t policy = 0;
  if (r.mode == 1) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  }
  for (int i = 0; i < r.count; ++i) {
    unsigned long long base = r.ptr[i], n = r.bytes[i];
    if (r.mode == 2) {
      for (unsigned long long off = tid * 128; off < n; off += nthreads * 128) {
        unsigned c8 = unsigned((off / r.chunk) % 8);
        if (c8 < r.keep_lo[i] || c8 >= r.keep_hi[i]) continue;
        asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(base + off));
      }
      continue;
    }
    unsigned long long chunks = (n + r.chunk - 1) / r.chunk;
    for (unsigned long long c = tid; c < chunks; c += nthreads) {
      if (unsigned(c % 8) < r.keep_lo[i] || unsigned(c % 8) >= r.keep_hi[i]) continue;
      unsigned long long off = c * r.chunk;
      unsigned long long len = n - off < r.chunk ? n - off : r.chunk;
      unsigned len16 = (unsigned)(len & ~15ull);
      if (len16) {
        if (r.mode == 1) {
          asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" :: "l"(base + off), "r"(len16), "l"(policy) : "memory");
        } else {
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(base + off), "r"(len16) : "memory");
        }
      }
    }
  }
}
