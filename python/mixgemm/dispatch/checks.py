"""The argument checks that every operator shares: can mixgemm's kernels run on a device.

Callers look these up on the module (``checks.device_problem(...)``) at call time, so that a test
can stand a fake GPU in for the real one by patching this module alone.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch


def device_problem(device: torch.device) -> Optional[str]:
    """Why mixgemm's kernels cannot run on ``device``, or None where they can (a CUDA device of
    compute capability 9.0)."""
    if device.type != "cuda":
        return f"mixgemm kernels run on CUDA tensors, got a tensor on {device}"
    if device.index is None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        device = torch.device("cuda", torch.cuda.current_device())
    return _cuda_device_problem(device.index)


@functools.lru_cache(maxsize=None)
def _cuda_device_problem(index: int) -> Optional[str]:
    """:func:`device_problem` of CUDA device ``index``, once per process (torch's capability query
    took ~20 us of every eager launch's host time on the GPU machine, docs/host-overhead.md)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cap = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        return f"mixgemm's kernels need an sm_90 (Hopper) GPU; cuda:{index} is sm_{cap[0]}{cap[1]}"
    return None


def on_sm90(device: torch.device) -> bool:
    """Whether mixgemm's kernels run on ``device`` (a CUDA device of compute capability 9.0)."""
    return device_problem(device) is None
