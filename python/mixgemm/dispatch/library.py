"""mixgemm's operators in the ``torch.ops.mixgemm`` namespace, registered lean.

``torch.library.custom_op`` wraps an operator in Python layers that run on every call: an
autograd function at the Autograd key, a per-backend wrapper, and an aliasing check of the
outputs. A compiled graph (``torch.compile``'s default mode) calls the operator through the
dispatcher on every step, so those layers are host time per GEMM, several times the launch
itself (docs/compile-and-graphs.md has the figures).

:func:`custom_op` registers the same operator with one Python kernel and nothing else: the
schema (inferred from the type hints, as ``torch.library.custom_op`` does), the implementation
at ``CompositeExplicitAutograd`` (every device; autograd takes torch's C++ fallback, which only
checks that no input needs a gradient), and a fake implementation for tracing. The decorated
function keeps ``register_fake`` as ``custom_op`` has it, so a module defines an operator as
before::

    @custom_op("mixgemm::rms_norm", mutates_args=())
    def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @_rms_norm_op.register_fake
    def _(x, weight, eps): ...

These operators have no backward: mixgemm serves inference. An output computed from an input
that needs a gradient carries torch's fallback node, which says at ``backward()`` that "an
autograd kernel was not registered" (a warning, or an error where
``torch._C._set_autograd_fallback_mode("error")`` is set) and passes no gradient through.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable

import torch

__all__ = ["NAMESPACE", "custom_op", "Operator"]

NAMESPACE = "mixgemm"

_lock = threading.Lock()
_libraries: dict[str, torch.library.Library] = {}


def _library(namespace: str) -> torch.library.Library:
    """The namespace's library fragment (one per namespace, kept for the process's life: the
    registrations live as long as it does)."""
    with _lock:
        lib = _libraries.get(namespace)
        if lib is None:
            lib = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
        return lib


def _infer_schema(fn: Callable, mutates_args: Iterable[str]) -> str:
    infer = getattr(torch.library, "infer_schema", None)
    if infer is None:   # torch 2.4
        from torch._library.infer_schema import infer_schema as infer   # (torch 2.4 has it only here)
    return infer(fn, mutates_args=tuple(mutates_args))


class Operator:
    """A registered operator: calling it calls ``torch.ops.<namespace>.<name>``."""

    def __init__(self, qualname: str, fn: Callable, mutates_args: Iterable[str]):
        namespace, sep, name = qualname.partition("::")
        if not sep or not namespace or not name:
            raise ValueError(f"an operator's name is 'namespace::name', got {qualname!r}")
        self.qualname, self.name, self.fn = qualname, name, fn
        lib = _library(namespace)
        lib.define(name + _infer_schema(fn, mutates_args))
        lib.impl(name, fn, "CompositeExplicitAutograd")
        self._lib = lib
        self._packet = getattr(getattr(torch.ops, namespace), name)

    def register_fake(self, fake: Callable) -> Callable:
        """Register ``fake`` as the operator's fake (meta) implementation; returns it."""
        torch.library.register_fake(self.qualname, fake, lib=self._lib)
        return fake

    def __call__(self, *args, **kwargs):
        return self._packet(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Operator({self.qualname})"


def custom_op(qualname: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable], Operator]:
    """Decorator: register the function as the operator ``qualname`` (see the module docstring).

    Parameters
    ----------
    qualname : str
        ``"namespace::name"``.
    mutates_args : iterable of str
        The arguments the function writes in place (their schema entries get ``(a!)``).
    """
    def register(fn: Callable) -> Operator:
        return Operator(qualname, fn, mutates_args)
    return register
