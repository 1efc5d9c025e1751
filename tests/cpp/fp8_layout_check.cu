// The layout facts the e4m3 mainloop (cutlass_ext/mixgemm/collective/sm90_mma_prepacked_fp8.hpp)
// relies on, read off CUTLASS's own layouts on the host (tests/jit/test_fp8_gemm_build.py builds
// and runs this with nvcc; it prints "ok" or the first mismatch and exits non-zero):
//   * the A fragment of wgmma.m64nNk32 e4m3 (its TiledMma, two warp groups along M): value v of
//     MMA block (mm, kb) of thread x sits at row tile_row(x, mm) + 8 * ((v / 4) % 2) and K column
//     32 kb + 16 (v / 8) + 4 (lane % 4) + v % 4 -- e4m3.hpp's register order (register r = v / 4:
//     rows g, g + 8, g, g + 8; byte j = v % 4), with tile_row = 64 * (x / 128) + 16 * (warp % 4) +
//     lane / 4 + 128 * mm, and whole 16-row atoms per warp;
//   * the accumulator: value v of (mm, nn) sits at row tile_row(x, mm) + 8 * ((v / 2) % 2)
//     (promote() picks the scale of that row) and token column 2 (lane % 4) + v % 2 + 8 (v / 4)
//     + nn * BLK_N.
#include <cstdio>

#include "cute/tensor.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/arch/mma_sm90.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"

using namespace cute;

template <int BLK_M, int BLK_N, int BLK_K>
int check() {
  using TileShape = Shape<Int<BLK_M>, Int<BLK_N>, Int<BLK_K>>;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<float_e4m3_t, float_e4m3_t, float, TileShape, GMMA::Major::K, GMMA::Major::K>(),
      Layout<Shape<_2, _1, _1>>{}));
  TiledMma mma;
  for (int x = 0; x < 256; ++x) {
    auto thr = mma.get_slice(x);
    Tensor cA = make_identity_tensor(make_shape(Int<BLK_M>{}, Int<BLK_K>{}));
    Tensor tCcA = thr.partition_A(cA);
    Tensor cC = make_identity_tensor(make_shape(Int<BLK_M>{}, Int<BLK_N>{}));
    Tensor tCcC = thr.partition_C(cC);
    int const lane = x % 32, warp = (x / 32) % 4, wg = x / 128;
    if (size<0>(tCcA) != 16 || size<2>(tCcA) != BLK_K / 32 || size<1>(tCcA) != BLK_M / 128) {
      std::printf("A fragment shape: %d %d %d\n", int(size<0>(tCcA)), int(size<1>(tCcA)), int(size<2>(tCcA)));
      return 1;
    }
    for (int mm = 0; mm < size<1>(tCcA); ++mm) {
      int const tile_row = 64 * wg + 16 * warp + lane / 4 + 128 * mm;
      if (get<0>(tCcA(0, mm, 0)) != tile_row) {
        std::printf("thread %d mm %d: A row %d, expected %d\n", x, mm, int(get<0>(tCcA(0, mm, 0))), tile_row);
        return 1;
      }
      for (int kb = 0; kb < size<2>(tCcA); ++kb) {
        for (int v = 0; v < 16; ++v) {
          int const row = tile_row + 8 * ((v / 4) % 2);
          int const col = 32 * kb + 16 * (v / 8) + 4 * (lane % 4) + v % 4;
          auto c = tCcA(v, mm, kb);
          if (get<0>(c) != row || get<1>(c) != col) {
            std::printf("tile %dx%dx%d thread %d A(%d,%d,%d) at (%d,%d), expected (%d,%d)\n", BLK_M, BLK_N, BLK_K,
                        x, v, mm, kb, int(get<0>(c)), int(get<1>(c)), row, col);
            return 1;
          }
        }
      }
      for (int nn = 0; nn < size<2>(tCcC); ++nn) {
        for (int v = 0; v < size<0>(tCcC); ++v) {
          int const row = tile_row + 8 * ((v / 2) % 2);
          int const col = 2 * (lane % 4) + v % 2 + 8 * (v / 4) + nn * BLK_N;
          auto c = tCcC(v, mm, nn);
          if (get<0>(c) != row || get<1>(c) != col) {
            std::printf("tile %dx%dx%d thread %d C(%d,%d,%d) at (%d,%d), expected (%d,%d)\n", BLK_M, BLK_N, BLK_K,
                        x, v, mm, nn, int(get<0>(c)), int(get<1>(c)), row, col);
            return 1;
          }
        }
      }
    }
  }
  return 0;
}

int main() {
  int bad = check<128, 128, 128>() || check<128, 64, 128>() || check<256, 128, 64>() || check<128, 256, 128>() ||
            check<128, 8, 64>();
  std::printf(bad ? "mismatch\n" : "ok\n");
  return bad;
}
