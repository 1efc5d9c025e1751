// mixgemm: the elementwise functions fused into the kernels' epilogues, applied in float32 to
// (accumulator + bias) before the one rounding to the activation type.
//
// One definition serves both kernel families:
// * the decode kernels (decode_kernel.hpp) fix the function at compile time (`activate<A>`);
// * the sm90 GEMM kernels take it at run time (`RuntimeActivation`, a CUTLASS epilogue compute
//   functor with an Arguments member, which the sm90 fusion callbacks pass through), so one
//   kernel serves none / silu / gelu.
// The values of `Activation` are the ABI's (abi::GemmArgs::activation) and the Python
// `mixgemm.codegen.Activation` enum's order.
#pragma once

#include "cutlass/array.h"
#include "cutlass/cutlass.h"

namespace mixgemm {

// kSwiglu is the gated MLP's silu(gate) * up over a weight whose 8-row stripes alternate gate,
// up, gate, up, ... (python/mixgemm/quantize.py interleave_gate_up): it pairs rows r and r + 8,
// which the mma.sync and wgmma accumulator layouts give to the same thread. The decode kernels
// fix it at compile time; the GEMM kernels have an epilogue of their own for it
// (epilogue_gated.hpp).
enum class Activation : int { kNone = 0, kSilu = 1, kGelu = 2, kSwiglu = 3 };

CUTLASS_HOST_DEVICE float silu(float v) {
#if defined(__CUDA_ARCH__)
  return v / (1.0f + __expf(-v));
#else
  return v / (1.0f + expf(-v));
#endif
}

// exact (erf) GELU, torch's default
CUTLASS_HOST_DEVICE float gelu(float v) { return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f)); }

template <Activation A>
CUTLASS_HOST_DEVICE float activate(float v) {
  if constexpr (A == Activation::kSilu || A == Activation::kSwiglu) {
    return silu(v);   // kSwiglu: the gate's half; the kernel multiplies by up
  } else if constexpr (A == Activation::kGelu) {
    return gelu(v);
  } else {
    return v;
  }
}

CUTLASS_HOST_DEVICE float activate(Activation a, float v) {
  return a == Activation::kSilu ? silu(v) : a == Activation::kGelu ? gelu(v) : v;
}

// The sm90 epilogue's activation node with the function chosen at run time (uniform across the
// grid, so the branch costs nothing measurable). T: the epilogue's compute type (float).
template <class T>
struct RuntimeActivation {
  struct Arguments {
    Activation kind = Activation::kNone;
  };
  CUTLASS_HOST_DEVICE T operator()(T const& v, Arguments const& args = Arguments()) const {
    return T(activate(args.kind, float(v)));
  }
};

// One branch per fragment, each arm a loop of one function: written per element, the compiler
// if-converts the choice and evaluates both silu and gelu for every element (measured: 4-7%
// slower GEMMs at large M even with no activation).
template <class T, int N>
struct RuntimeActivation<cutlass::Array<T, N>> {
  using Arguments = typename RuntimeActivation<T>::Arguments;
  template <Activation A>
  CUTLASS_HOST_DEVICE static cutlass::Array<T, N> apply(cutlass::Array<T, N> const& v) {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = T(activate<A>(float(v[i])));
    return out;
  }
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& v,
                                                      Arguments const& args = Arguments()) const {
    if (args.kind == Activation::kNone) return v;
    if (args.kind == Activation::kSilu) return apply<Activation::kSilu>(v);
    return apply<Activation::kGelu>(v);
  }
};

}  // namespace mixgemm
