"""A stand-in, on the CPU, for a C++ kernel of the torch operator library (mixgemm.jit.torch_ops).

The library's kernels sit at the CUDA key of ``mixgemm::rms_norm``, ``add_rms_norm`` and
``rotary_kv_cache``, and hand every call they cannot take to the operator's Python kernel
(``mixgemm::<name>_py``). :func:`cpu_stand_in` registers, for as long as its ``with`` lasts, a
kernel at the CPU key of ``mixgemm::<name>`` that records each call's arguments and hands the
call to ``mixgemm::<name>_py`` as the C++ kernel does with one it cannot take: a CPU test sees
which calls reach the operator, and gets the Python kernel's results and errors through the
dispatcher.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def cpu_stand_in(name: str):
    """Within the block, CPU calls of ``torch.ops.mixgemm.<name>`` are recorded (the list the
    block gets: one tuple of arguments per call) and run by ``mixgemm::<name>_py``."""
    calls: list[tuple] = []
    fallback = getattr(torch.ops.mixgemm, f"{name}_py").default

    def kernel(*args):
        calls.append(args)
        return fallback(*args)

    lib = torch.library.Library("mixgemm", "IMPL")
    lib.impl(name, kernel, "CPU")
    try:
        yield calls
    finally:
        lib._destroy()   # (the registration goes with it)
