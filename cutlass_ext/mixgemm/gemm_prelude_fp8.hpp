// mixgemm: everything a generated e4m3-activation GEMM instantiation (python/mixgemm/jit/render.py)
// needs: gemm_prelude.hpp's, the e4m3 mainloop's builder and the entry point.
#pragma once

#include "mixgemm/gemm_prelude.hpp"
#include "mixgemm/collective/builder_fp8.hpp"
#include "mixgemm/gemm_entry_fp8.hpp"

namespace mixgemm {
// True when a kernel's mainloop is the e4m3 prepacked one. Generated files static_assert it.
template <class Mainloop> struct is_prepacked_fp8_mainloop : cute::false_type {};
template <class Code, class Scale, bool HasZero, class Tile, class Cluster, int Stages, class Schedule, class AtomB>
struct is_prepacked_fp8_mainloop<
    collective::CollectiveMmaPrepackedFp8<Code, Scale, HasZero, Tile, Cluster, Stages, Schedule, AtomB>>
    : cute::true_type {};
template <class Kernel>
constexpr bool uses_prepacked_fp8_mainloop_v = is_prepacked_fp8_mainloop<typename Kernel::CollectiveMainloop>::value;
}  // namespace mixgemm
