// mixgemm: epilogue fusions, in the 4-parameter form cutlass_library's 3.x emitter instantiates
// (`Functor<ElementD, ElementCompute, ElementC, ElementScalar>`), registered in its
// EpilogueFunctor3xTag table by python/mixgemm/codegen.py.
//
// The weight rows are the MMA's M mode, so nn.Linear's bias (one value per output feature) is a
// per-row bias of D. A null bias pointer reads as zero, so one kernel serves with and without.
#pragma once

#include "cutlass/epilogue/fusion/operations.hpp"

#include "mixgemm/activation.hpp"

namespace mixgemm::epilogue {

// D = acc + bias[row]   (alpha = 1, beta = 0; C is not read)
template <class ElementD, class ElementCompute, class ElementC, class ElementScalar>
using PerRowBias = cutlass::epilogue::fusion::LinCombPerRowBias<
    ElementD, ElementCompute, /*ElementBias=*/ElementD, /*ElementSource=*/ElementD, ElementScalar>;

// D = act(acc + bias[row]), act chosen at run time (none / silu / gelu: RuntimeActivation,
// set from abi::GemmArgs::activation by gemm_entry.hpp), in float32 before the rounding to D.
template <class ElementD, class ElementCompute, class ElementC, class ElementScalar>
using PerRowBiasAct = cutlass::epilogue::fusion::LinCombPerRowBiasEltAct<
    RuntimeActivation, ElementD, ElementCompute, /*ElementBias=*/ElementD, /*ElementSource=*/ElementD,
    ElementScalar>;

}  // namespace mixgemm::epilogue
