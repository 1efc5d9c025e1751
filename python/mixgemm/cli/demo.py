"""The demo (``mixgemm demo``): quantize and prepack a built-in example layer, report sizes and
errors, check the prepack round trip and, on a Hopper GPU, run the GEMM.

On a GPU, the first run on a machine compiles the GEMM kernel (65-100 s of nvcc, once: it is
cached); the demo says so and shows the elapsed time (:class:`mixgemm.utils.progress.Elapsed`) instead
of a silent minute. Errors are raised as :class:`mixgemm.errors.UserError` (the command line
prints them as one line and exits with status 1).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Union

import torch

from ..errors import BuildError, UserError
from ..jit import build
from ..ops.dense import select_spec
from ..utils.progress import Elapsed
from ..weights import quantize
from ..weights.layout import prepack, unpack
from ..weights.quantize import dequantize_reference
from .args import fmt_bytes
import mixgemm

N = K = 4096
#: Tokens of the GEMM the demo runs.
M = 64
SEED = 0
#: The GEMM result is flagged when its relative error exceeds this (fp32 accumulation and a
#: bf16/fp16 output give ~1e-3).
GEMM_RTOL = 2e-2
NO_GPU_MESSAGE = "the GEMM needs an NVIDIA Hopper (sm_90) GPU; none found, skipping it"
#: What the first use of a kernel costs, as the README says.
COMPILE_TIME_HINT = "65-100 s for a GEMM kernel, once per machine"


def half_ulp(x: torch.Tensor) -> torch.Tensor:
    """Half the spacing of ``x``'s dtype at ``x`` (float64 tensor)."""
    finfo = torch.finfo(x.dtype)
    _, exponent = torch.frexp(x.double().abs().clamp(min=finfo.tiny))  # x = m * 2^e, m in [.5, 1)
    return torch.ldexp(torch.full_like(x, finfo.eps / 2, dtype=torch.float64), exponent - 1)


def find_gpu() -> tuple[Optional[torch.device], str]:
    """(a Hopper device or None, what was found, in words)."""
    if not torch.cuda.is_available():
        return None, ""
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if (major, minor) != (9, 0):
        return None, f"found {name} (sm_{major}{minor}), which is not Hopper"
    return torch.device("cuda", torch.cuda.current_device()), name


def run(bits: int = 4, group_size: Union[int, str] = 128, symmetric: bool = False,
        out: Callable[[str], None] = print) -> int:
    """Run the demo; ``out`` receives the report's lines. Returns 0; raises UserError."""

    n, k = N, K
    group_size = k if group_size == "channel" else group_size
    gen = torch.Generator().manual_seed(SEED)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    kind = "symmetric" if symmetric else "asymmetric"
    out(f"example layer: weight [N={n}, K={k}] bf16, seeded random (seed {SEED}), "
        f"{fmt_bytes(w.numel() * w.element_size())}")
    try:
        qw = quantize.quantize(w, bits, group_size, symmetric=symmetric)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    out(f"quantized: int{bits} {kind} ({qw.weight_type.value}), group size {group_size}, "
        f"round-to-nearest; codes {list(qw.qweight.shape)} {qw.qweight.dtype}, "
        f"scales {list(qw.scales.shape)} {qw.scales.dtype}"
        + ("" if qw.zeros is None else f", zeros {list(qw.zeros.shape)} {qw.zeros.dtype}"))

    packed = prepack(qw)
    before = w.numel() * w.element_size()
    out(f"prepacked for sm90a (layout v{packed.layout_version}): qdata "
        f"{list(packed.qdata.shape)} uint8, scales {list(packed.scales.shape)}"
        + ("" if packed.zeros is None else f", zeros {list(packed.zeros.shape)}"))
    out(f"bytes: {fmt_bytes(before)} -> {fmt_bytes(packed.nbytes)} "
        f"({before / packed.nbytes:.2f}x smaller)")

    deq = dequantize_reference(qw)
    err = (w.double() - deq.double()).abs()
    rel = float(err.norm() / w.double().norm())
    bound = qw.scales.double().repeat_interleave(group_size, dim=1) / 2 + half_ulp(deq)
    out(f"quantization error vs the bf16 weight: max |w - deq| = {float(err.max()):.3e}, "
        f"relative (Frobenius) = {rel:.3e}")
    if not bool((err <= bound).all()):
        raise UserError("the quantization error bound |w - deq| <= s/2 + ulp(deq)/2 is violated")
    out("error bound |w - deq| <= s/2 + ulp(deq)/2 holds for every element")

    back = unpack(packed)
    same = (torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
            and (qw.zeros is None or torch.equal(back.zeros, qw.zeros)))
    if not same:
        raise UserError("unpack(prepack(q)) differs from q")
    out("round trip: unpack(prepack(q)) == q exactly")

    device, found = find_gpu()
    if device is None:
        if found:
            out(found)
        out(NO_GPU_MESSAGE)
        return 0
    return run_gemm(packed, deq, gen, device, found, out)


def ensure_built(spec, out: Callable[[str], None] = print, stream=None) -> bool:
    """Build ``spec`` into the kernel cache unless it is there, saying so with a progress
    indicator on ``stream`` (default stderr). Returns True if it compiled the kernel.
    Raises UserError when the kernel cannot be built (no nvcc, a failed build)."""

    try:
        if build.is_cached(spec):
            return False
        out(f"first use of kernel {spec.name} on this machine: compiling it with nvcc "
            f"({COMPILE_TIME_HINT}; cached in {build.cache_dir()}; "
            f"`mixgemm generate --build` compiles every kernel ahead of time)")
        with Elapsed(f"compiling {spec.name}", stream if stream is not None else sys.stderr):
            build.build(spec)
    except BuildError as e:
        raise UserError(f"cannot build the GEMM kernel {spec.name}: {e}") from None
    return True


def run_gemm(packed, deq: torch.Tensor, gen: torch.Generator, device: torch.device, name: str,
             out: Callable[[str], None] = print) -> int:
    """The demo's GPU part: ``mixgemm.gemm`` on ``M`` tokens, checked against float64."""

    out(f"found {name} (sm_90): running the GEMM via mixgemm.gemm(x, packed), "
        f"x [M={M}, K={packed.k}] {deq.dtype}")
    ensure_built(select_spec(M, packed), out)
    x = torch.randn(M, packed.k, generator=gen).to(deq.dtype).to(device)
    try:
        y = mixgemm.gemm(x, packed.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # the one line says what failed; --debug has the traceback
        raise UserError(f"mixgemm.gemm failed: {type(e).__name__}: {e}") from e
    ref = x.double() @ deq.to(device).double().t()
    diff = (y.double() - ref).abs()
    rel = float(diff.norm() / ref.norm())
    out(f"GEMM result {list(y.shape)} {y.dtype}: max |y - x @ deq^T| = {float(diff.max()):.3e}, "
        f"relative = {rel:.3e} (reference in float64)")
    if not rel <= GEMM_RTOL:
        raise UserError(f"the GEMM's relative error {rel:.3e} exceeds {GEMM_RTOL}")
    return 0
