// mixgemm: programmatic dependent launch (sm_90), for the kernels written here (decode, grouped
// decode, MoE routing, RMSNorm, rotary / KV cache). Launched with the programmatic stream
// serialization attribute, a kernel may start before the previous kernel in the stream has
// finished; `wait_previous_grid` blocks until that kernel has completed and its memory is
// visible, `launch_next_grid` lets the next kernel launch once every CTA of this one has called
// it (or exited). Without the attribute both are no-ops.
#pragma once

#include "cutlass/cutlass.h"

namespace mixgemm::pdl {

#if defined(__CUDACC__)
CUTLASS_DEVICE void wait_previous_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
CUTLASS_DEVICE void launch_next_grid() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
#endif

}  // namespace mixgemm::pdl
