// mixgemm: everything a generated GEMM instantiation (python/mixgemm/codegen.py) needs.
// Generated files only fill in types and tile shapes; the logic lives in these headers.
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"

#include "mixgemm/tags.hpp"
#include "mixgemm/collective/builder.hpp"
#include "mixgemm/epilogue.hpp"
#include "mixgemm/gemm_entry.hpp"

namespace mixgemm {
// True when a kernel's mainloop is mixgemm's prepacked one (and so reads the prepacked layout
// through mixgemm's converters). Generated files static_assert it, so a kernel that the builder
// routed to CUTLASS's stock mixed-input mainloop does not compile.
template <class Mainloop> struct is_prepacked_mainloop : cute::false_type {};
template <class Code, class Act, bool HasZero, class Tile, class Cluster, int Stages, class Schedule, class AtomB>
struct is_prepacked_mainloop<collective::CollectiveMmaPrepacked<Code, Act, HasZero, Tile, Cluster, Stages, Schedule, AtomB>>
    : cute::true_type {};
template <class Kernel>
constexpr bool uses_prepacked_mainloop_v = is_prepacked_mainloop<typename Kernel::CollectiveMainloop>::value;
}  // namespace mixgemm
