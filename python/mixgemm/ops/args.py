"""The argument checks that the dense GEMMs share (bf16 activations in :mod:`.dense`, e4m3 ones
in :mod:`.fp8`): what a packed weight, the activations, the bias and the output must be before a
kernel is launched. Each returns the reason or raises one line; nothing here launches."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..dispatch import checks
from ..weights.types import LAYOUT_VERSION, SUPPORTED_ARCHS, PackedWeight

#: gemm's ``activation`` values
ACTIVATIONS = ("silu", "gelu", "swiglu")


def weight_problem(w) -> Optional[str]:
    """Why ``w`` cannot be given to a GEMM kernel (not a PackedWeight, no usable GPU for its
    device, another arch or layout version, tensors that are not contiguous and 16-byte aligned,
    N not a multiple of 8), or None."""
    if not isinstance(w, PackedWeight):
        return f"w must be a mixgemm.PackedWeight (see mixgemm.prepack), got {type(w).__name__}"
    why = checks.device_problem(w.device)       # first: without a usable GPU, nothing else matters
    if why:
        return why
    if w.arch not in SUPPORTED_ARCHS:
        return f"w is packed for {w.arch}, this mixgemm runs {SUPPORTED_ARCHS}"
    if w.layout_version != LAYOUT_VERSION:
        return f"w has layout version {w.layout_version}, this mixgemm reads {LAYOUT_VERSION}"
    for name, t in (("qdata", w.qdata), ("scales", w.scales), ("zeros", w.zeros)):
        if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
            return f"w.{name} must be contiguous and 16-byte aligned"
    if w.n % 8:
        return f"N={w.n} must be a multiple of 8"
    return None


def shape_problem(x_shape: Sequence[int], w: PackedWeight, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why activations of shape ``x_shape`` (``[..., K]``) and ``dtype`` cannot multiply ``w``, or None."""
    if len(x_shape) < 1:
        return "x must have at least one dimension [..., K]"
    if x_shape[-1] != w.k:
        return f"x has K={x_shape[-1]} but w has K={w.k}"
    if dtype is not None and dtype != w.dtype:
        return f"x is {dtype} but w was packed for {w.dtype}"
    m = math.prod(x_shape[:-1])
    if m >= 2 ** 31:
        return f"M={m} tokens is too many for one call"
    return None


def check_gemm_inputs(x: torch.Tensor, w: PackedWeight, bias, out, activation: Optional[str] = None) -> None:
    """Raise the one-line TypeError or ValueError that ``gemm(x, w, bias, out, activation)``
    (bf16 or e4m3 activations alike) gives for bad arguments, before anything is launched."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    if activation == "swiglu" and w.n % 16:
        raise ValueError(f"activation='swiglu' needs a gate/up interleaved weight with N % 16 == 0, got N={w.n}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, PackedWeight):
        raise TypeError(f"w must be a mixgemm.PackedWeight (see mixgemm.prepack), got {type(w).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bfloat16 or float16, got {x.dtype}")
    if x.dtype != w.dtype:
        raise TypeError(f"x is {x.dtype} but w was packed for {w.dtype}")
    why = weight_problem(w) or shape_problem(tuple(x.shape), w, x.dtype)
    if why:
        raise ValueError(why)
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but w is on {w.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (w.n,) or bias.dtype != x.dtype:
            raise ValueError(f"bias must be a {x.dtype} tensor of shape [{w.n}]")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
        if not bias.is_contiguous():
            raise ValueError("bias must be contiguous")
    if out is not None:
        want = (*x.shape[:-1], w.n // 2 if activation == "swiglu" else w.n)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != x.dtype:
            raise ValueError(f"out must be a {x.dtype} tensor of shape {list(want)}")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x is on {x.device}")
        if not out.is_contiguous() or out.data_ptr() % 16:
            raise ValueError("out must be contiguous and 16-byte aligned")
