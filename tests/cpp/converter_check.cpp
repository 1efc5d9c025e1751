// Host driver for the exhaustive converter tests (tests/jit/test_converters.py).
//
// Runs mixgemm's converters -- the very header the kernels include, on its host path -- over
// lane chunks supplied by the test, and writes the converted values back for a bit-exact
// comparison with the Python decode of the same prepacked bits.
//
//   converter_check BITS SIGNED {bf16|fp16} MODE IN OUT
//
// IN:  uint32 n, then n chunks of BITS uint32 words; for `dequant` and `centered` also n x 2
//      uint16 zero points and n x 2 uint16 scales (index 0: the lane's row g, 1: row g + 8), H
//      bit patterns; for `e4m3` and `e4m3_lut` the n x 2 zero points only.
// OUT: n x 32 uint16, the chunk's values in wgmma A-fragment order (k16 block, then value).
//   dequant:  (q - z) * s, the fused mainloop conversion (PrepackedDequant::kblock)
//   values:   the code as an exact integer (PrepackedDequant::kblock_values)
//   cutlass:  the same through cutlass::NumericArrayConverter<D, mixgemm::prepacked<T>, 32>
//   raw:      the decode kernels' E + F c (RawDecode::kblock)
//   centered: the decode kernels' F (q - z) (RawDecode::centered with RawDecode::bias)
// The e4m3 modes (BITS 4 or 2) write n x 32 uint8 instead, e4m3 bit patterns in the 8-bit
// fragment order of mixgemm/e4m3.hpp (k32 block, register, byte); H is the zero points' format.
//   e4m3:         q, or u - z with each row's table built in registers from its zero point
//                 (PrepackedE4M3::zero_code, ::table, ::convert)
//   e4m3_lut:     the same with the tables from PrepackedE4M3::table_word (a staged table)
//   e4m3_values:  q or u (PrepackedE4M3::values)
//   e4m3_cutlass: the same through cutlass::NumericArrayConverter<float_e4m3_t, prepacked<T>, 32>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "mixgemm/dequant.hpp"
#include "mixgemm/e4m3.hpp"
#include "mixgemm/raw_decode.hpp"
#if defined(MIXGEMM_WITH_CUTLASS)
#include "mixgemm/numeric_conversion.hpp"
#endif

namespace {

template <int Bits, bool Signed, mixgemm::Half H>
void run_chunks(std::string const& mode, uint32_t n, std::vector<uint32_t> const& words,
                std::vector<uint16_t> const& zeros, std::vector<uint16_t> const& scales,
                std::vector<uint16_t>& out) {
  using D = mixgemm::PrepackedDequant<Bits, Signed, H>;
  using R = mixgemm::RawDecode<Bits, Signed, H>;
  for (uint32_t c = 0; c < n; ++c) {
    uint32_t const* chunk = words.data() + size_t(c) * Bits;
    uint32_t regs[16];
    if (mode == "dequant") {
      uint32_t bias2[2], scale2[2];
      for (int r = 0; r < 2; ++r) {
        bias2[r] = D::bias(mixgemm::arith::splat(zeros[2 * c + r]));
        scale2[r] = mixgemm::arith::splat(scales[2 * c + r]);
      }
      D::template kblock<0>(chunk, bias2, scale2, *reinterpret_cast<uint32_t(*)[4]>(regs + 0));
      D::template kblock<1>(chunk, bias2, scale2, *reinterpret_cast<uint32_t(*)[4]>(regs + 4));
      D::template kblock<2>(chunk, bias2, scale2, *reinterpret_cast<uint32_t(*)[4]>(regs + 8));
      D::template kblock<3>(chunk, bias2, scale2, *reinterpret_cast<uint32_t(*)[4]>(regs + 12));
    } else if (mode == "raw") {
      R::template kblock<0>(chunk, *reinterpret_cast<uint32_t(*)[4]>(regs + 0));
      R::template kblock<1>(chunk, *reinterpret_cast<uint32_t(*)[4]>(regs + 4));
      R::template kblock<2>(chunk, *reinterpret_cast<uint32_t(*)[4]>(regs + 8));
      R::template kblock<3>(chunk, *reinterpret_cast<uint32_t(*)[4]>(regs + 12));
    } else if (mode == "centered") {
      uint32_t const bias2[2] = {R::template bias<0>(mixgemm::arith::splat(zeros[2 * c])),
                                 R::template bias<1>(mixgemm::arith::splat(zeros[2 * c + 1]))};
      R::template centered<0>(chunk, bias2, *reinterpret_cast<uint32_t(*)[4]>(regs + 0));
      R::template centered<1>(chunk, bias2, *reinterpret_cast<uint32_t(*)[4]>(regs + 4));
      R::template centered<2>(chunk, bias2, *reinterpret_cast<uint32_t(*)[4]>(regs + 8));
      R::template centered<3>(chunk, bias2, *reinterpret_cast<uint32_t(*)[4]>(regs + 12));
    } else if (mode == "values") {
      D::template kblock_values<0>(chunk, *reinterpret_cast<uint32_t(*)[4]>(regs + 0));
      D::template kblock_values<1>(chunk, *reinterpret_cast<uint32_t(*)[4]>(regs + 4));
      D::template kblock_values<2>(chunk, *reinterpret_cast<uint32_t(*)[4]>(regs + 8));
      D::template kblock_values<3>(chunk, *reinterpret_cast<uint32_t(*)[4]>(regs + 12));
    } else {
#if defined(MIXGEMM_WITH_CUTLASS)
      using T = std::conditional_t<Bits == 8, std::conditional_t<Signed, int8_t, uint8_t>,
                cutlass::integer_subbyte<Bits, Signed>>;
      using Dst = std::conditional_t<H == mixgemm::Half::kBF16, cutlass::bfloat16_t, cutlass::half_t>;
      using Conv = cutlass::NumericArrayConverter<Dst, mixgemm::prepacked<T>, 32>;
      typename Conv::source_type src;
      static_assert(sizeof(src) == 4 * Bits, "a 32-value prepacked array is one lane chunk");
      std::memcpy(&src, chunk, sizeof(src));
      typename Conv::result_type res = Conv::convert(src);
      std::memcpy(regs, &res, sizeof(regs));
#else
      std::fprintf(stderr, "built without CUTLASS (MIXGEMM_WITH_CUTLASS)\n");
      std::exit(3);
#endif
    }
    std::memcpy(out.data() + size_t(c) * 32, regs, sizeof(regs));
  }
}

template <int Bits, bool Signed, mixgemm::Half H>
void run_e4m3(std::string const& mode, uint32_t n, std::vector<uint32_t> const& words,
              std::vector<uint16_t> const& zeros, std::vector<uint8_t>& out) {
  using E = mixgemm::PrepackedE4M3<Bits, Signed>;
  for (uint32_t c = 0; c < n; ++c) {
    uint32_t const* chunk = words.data() + size_t(c) * Bits;
    uint32_t regs[8];
    if (mode == "e4m3" || mode == "e4m3_lut") {
      uint32_t t[2][E::kTableWords];
      for (int r = 0; r < 2; ++r) {
        uint32_t const z = E::template zero_code<H>(mixgemm::arith::splat(zeros[2 * c + r]));
        if (mode == "e4m3") {
          E::table(z, t[r]);
        } else {
          for (int i = 0; i < E::kTableWords; ++i) t[r][i] = E::table_word(int(z), i);
        }
      }
      E::convert(chunk, t[0], t[1], regs);
    } else if (mode == "e4m3_values") {
      E::values(chunk, regs);
    } else {
#if defined(MIXGEMM_WITH_CUTLASS)
      using T = cutlass::integer_subbyte<Bits, Signed>;
      using Conv = cutlass::NumericArrayConverter<cutlass::float_e4m3_t, mixgemm::prepacked<T>, 32>;
      typename Conv::source_type src;
      static_assert(sizeof(src) == 4 * Bits, "a 32-value prepacked array is one lane chunk");
      std::memcpy(&src, chunk, sizeof(src));
      typename Conv::result_type res = Conv::convert(src);
      static_assert(sizeof(res) == sizeof(regs), "32 e4m3 values");
      std::memcpy(regs, &res, sizeof(regs));
#else
      std::fprintf(stderr, "built without CUTLASS (MIXGEMM_WITH_CUTLASS)\n");
      std::exit(3);
#endif
    }
    std::memcpy(out.data() + size_t(c) * 32, regs, sizeof(regs));
  }
}

using E4M3Runner = void (*)(std::string const&, uint32_t, std::vector<uint32_t> const&,
                            std::vector<uint16_t> const&, std::vector<uint8_t>&);

template <mixgemm::Half H>
E4M3Runner pick_e4m3(int bits, bool is_signed) {
  if (bits == 4) return is_signed ? &run_e4m3<4, true, H> : &run_e4m3<4, false, H>;
  if (bits == 2) return is_signed ? &run_e4m3<2, true, H> : &run_e4m3<2, false, H>;
  return nullptr;
}

using Runner = void (*)(std::string const&, uint32_t, std::vector<uint32_t> const&,
                        std::vector<uint16_t> const&, std::vector<uint16_t> const&, std::vector<uint16_t>&);

template <mixgemm::Half H>
Runner pick(int bits, bool is_signed) {
  if (bits == 8) return is_signed ? &run_chunks<8, true, H> : &run_chunks<8, false, H>;
  if (bits == 4) return is_signed ? &run_chunks<4, true, H> : &run_chunks<4, false, H>;
  if (bits == 2) return is_signed ? &run_chunks<2, true, H> : &run_chunks<2, false, H>;
  return nullptr;
}

template <class T>
bool read_vec(std::FILE* f, std::vector<T>& v, size_t count) {
  v.resize(count);
  return count == 0 || std::fread(v.data(), sizeof(T), count, f) == count;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s BITS SIGNED {bf16|fp16} MODE IN OUT\n", argv[0]);
    return 2;
  }
  int bits = std::atoi(argv[1]);
  bool is_signed = std::atoi(argv[2]) != 0;
  std::string half = argv[3], mode = argv[4];
  bool const with_groups = mode == "dequant" || mode == "centered";
  bool const e4m3 = mode.rfind("e4m3", 0) == 0;
  bool const with_zeros = mode == "e4m3" || mode == "e4m3_lut";
  if (!with_groups && !with_zeros && mode != "values" && mode != "cutlass" && mode != "raw" &&
      mode != "e4m3_values" && mode != "e4m3_cutlass") {
    std::fprintf(stderr, "bad mode\n");
    return 2;
  }
  Runner run = nullptr;
  E4M3Runner run_e4m3 = nullptr;
  if (e4m3) {
    run_e4m3 = half == "bf16" ? pick_e4m3<mixgemm::Half::kBF16>(bits, is_signed)
             : half == "fp16" ? pick_e4m3<mixgemm::Half::kFP16>(bits, is_signed) : nullptr;
  } else {
    run = half == "bf16" ? pick<mixgemm::Half::kBF16>(bits, is_signed)
        : half == "fp16" ? pick<mixgemm::Half::kFP16>(bits, is_signed) : nullptr;
  }
  if (!run && !run_e4m3) { std::fprintf(stderr, "bad bits/dtype\n"); return 2; }

  std::FILE* in = std::fopen(argv[5], "rb");
  if (!in) { std::perror("open IN"); return 1; }
  uint32_t n = 0;
  std::vector<uint32_t> words;
  std::vector<uint16_t> zeros, scales;
  bool ok = std::fread(&n, 4, 1, in) == 1 && read_vec(in, words, size_t(n) * bits);
  if (ok && (with_groups || with_zeros)) ok = read_vec(in, zeros, size_t(n) * 2);
  if (ok && with_groups) ok = read_vec(in, scales, size_t(n) * 2);
  std::fclose(in);
  if (!ok) { std::fprintf(stderr, "short input\n"); return 1; }

  std::FILE* o = std::fopen(argv[6], "wb");
  bool written = false;
  if (o && e4m3) {
    std::vector<uint8_t> out(size_t(n) * 32);
    run_e4m3(mode, n, words, zeros, out);
    written = std::fwrite(out.data(), 1, out.size(), o) == out.size();
  } else if (o) {
    std::vector<uint16_t> out(size_t(n) * 32);
    run(mode, n, words, zeros, scales, out);
    written = std::fwrite(out.data(), 2, out.size(), o) == out.size();
  }
  if (o && std::fclose(o) != 0) written = false;
  if (!written) { std::perror("write OUT"); return 1; }
  return 0;
}
