// mixgemm: one lane's chunk of a prepacked atom, loaded as 32-bit words.
//
// A lane's share of a 16x64 atom is 4 * Bits bytes (python/mixgemm/layout.py): one 8-byte load
// for int2, one 16-byte load for int4, two for int8. `src` must be aligned to the chunk (it is,
// in global memory and in the kernels' shared-memory stages).
#pragma once

#include <cstdint>

#include "mixgemm/arith.hpp"

namespace mixgemm {

template <int ChunkBytes>
MIXGEMM_HD void load_chunk(void const* src, uint32_t (&words)[ChunkBytes / 4]) {
  static_assert(ChunkBytes == 8 || ChunkBytes % 16 == 0, "a chunk is 8 bytes or whole 16-byte vectors");
  if constexpr (ChunkBytes == 8) {
    uint2 v = *reinterpret_cast<uint2 const*>(src);
    words[0] = v.x; words[1] = v.y;
  } else {
    for (int q = 0; q < ChunkBytes / 16; ++q) {
      uint4 v = reinterpret_cast<uint4 const*>(src)[q];
      words[4 * q + 0] = v.x; words[4 * q + 1] = v.y; words[4 * q + 2] = v.z; words[4 * q + 3] = v.w;
    }
  }
}

}  // namespace mixgemm
