"""RMSNorm, with the residual add fused in front of it: :func:`rms_norm`.

A decoder layer at decode time normalizes one row of ``hidden`` values twice, and each time the
row is the sum of the residual stream and a projection's output. torch runs that as an add and
``F.rms_norm``: two launches, and ``F.rms_norm``'s kernel takes 6-11 us on a single row on an
H100 / H200 (one CTA that walks the row in small steps; docs/kernels.md). On an
sm_90 GPU :func:`rms_norm` is one launch of mixgemm's kernel (:class:`mixgemm.jit.specs.NormSpec`,
``cutlass_ext/mixgemm/norm_kernel.hpp``): one CTA per row, the row read once into registers.
Elsewhere it runs the same two torch ops. ``torch.ops.mixgemm.rms_norm`` and
``torch.ops.mixgemm.add_rms_norm`` are its custom ops (traceable by torch.compile).
"""
from __future__ import annotations

import ctypes
import functools
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from ..dispatch import checks, plans
from ..dispatch.library import custom_op
from ..dtypes import ActType
from ..jit import driver, loader
from ..jit.loader import aligned_contiguous
from ..jit.specs import NormSpec

__all__ = ["rms_norm", "norm_spec", "RMSNorm", "replace_rms_norms", "LLAMA_STYLE_NORMS"]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_THREADS = 256   # norm_kernel.hpp's kNormThreads
_Tensor = torch.Tensor


@functools.lru_cache(maxsize=None)
def norm_spec(dtype: torch.dtype, residual: bool):
    """The kernel :func:`rms_norm` launches for rows of ``dtype`` (bf16 or fp16), without or with
    the residual add."""
    return NormSpec(ActType.from_torch(dtype), bool(residual))


def _check(x, weight, eps, residual) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"x must be a floating-point tensor [..., H], got "
                        f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    h = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != h:
        raise ValueError(f"weight must be a 1-D tensor of H={h} values, got "
                         f"{list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must have x's dtype and device ({x.dtype}, {x.device}), "
                         f"got {weight.dtype} on {weight.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
            raise ValueError(f"residual must be a tensor of x's shape {list(x.shape)}, got "
                             f"{list(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must have x's dtype and device ({x.dtype}, {x.device}), "
                             f"got {residual.dtype} on {residual.device}")


def _kernel_takes(x: torch.Tensor) -> bool:

    return (x.dtype in _KERNEL_DTYPES and (x.shape[-1] * x.element_size()) % 16 == 0 and x.shape[-1] > 0
            and checks.device_problem(x.device) is None)


#: the argument types of MIXGEMM_RMS_NORM_ENTRY: x, residual, weight, out, sum_out, row_vecs, eps
_ARG_TYPES = (ctypes.c_void_p,) * 5 + (ctypes.c_int, ctypes.c_float)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor]):
    h = x.shape[-1]
    x, w = aligned_contiguous(x), aligned_contiguous(weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        residual = aligned_contiguous(residual)
        sums = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_ptr, sums_ptr = residual.data_ptr(), sums.data_ptr()
    else:
        res_ptr = sums_ptr = None
    launch = loader.KERNELS.plain_launch(norm_spec(x.dtype, residual is not None), x.device, _ARG_TYPES, _THREADS)
    rows = x.numel() // h
    if rows:
        launch(rows, driver.current_stream(x.device.index), x.data_ptr(), res_ptr, w.data_ptr(), out.data_ptr(), sums_ptr,
               h // 8, eps)
    return out if residual is None else (out, sums)


def _torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor]):
    s = x if residual is None else x + residual
    y = F.rms_norm(s, (s.shape[-1],), weight, eps)
    return y if residual is None else (y, s)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             residual: Optional[torch.Tensor] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm of the last dimension, optionally of ``x + residual``.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., H]``, bfloat16 or float16 for the kernel (any floating dtype runs torch's ops).
    weight : torch.Tensor
        ``[H]``, x's dtype and device.
    eps : float
        Added to the mean square (the model's ``rms_norm_eps``).
    residual : torch.Tensor, optional
        x's shape, dtype and device. When given, the row normalized is ``s = x + residual``
        (rounded to x's dtype, as torch's add) and ``s`` is returned too: the residual stream of
        a decoder layer after a projection's output is added to it.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``y = weight * s / sqrt(mean(s^2) + eps)`` computed in float32 and rounded once to x's
        dtype (``s = x`` without residual), contiguous, of x's shape; with ``residual``,
        ``(y, s)``. Neither input is modified.

    Notes
    -----
    On an sm_90 GPU with bf16 / fp16 rows of ``H * 2 % 16 == 0`` bytes this is one launch of
    :class:`mixgemm.jit.specs.NormSpec`'s kernel (capturable in a CUDA graph after a first call has
    loaded it); it equals ``F.rms_norm`` up to the order of the sum of squares (an ulp of the
    dtype where that moves the last bit of the float32 scale). Otherwise it is ``x + residual``
    and ``F.rms_norm``. Under torch.compile it goes through ``torch.ops.mixgemm.rms_norm`` /
    ``add_rms_norm``.

    In eager mode, once the torch operator library (:mod:`mixgemm.jit.torch_ops`) holds the
    kernel for x's dtype and CUDA device (the first such call launches from Python, loads the
    library and hands the kernel over), a call of plain tensors and a float ``eps`` goes to those
    operators, whose C++ kernel launches it: the same kernel with the same arguments, so the same
    results. A call the C++ kernel does not take (a strided or misaligned input, a bad argument)
    goes on to the Python kernel, which checks it as here: the same results and errors.
    """
    if torch.compiler.is_compiling():
        _check(x, weight, eps, residual)
        eps = float(eps)
        if residual is None:
            return torch.ops.mixgemm.rms_norm(x, weight, eps)
        return tuple(torch.ops.mixgemm.add_rms_norm(x, residual, weight, eps))
    # the types the operators' schema takes, checked here; their values the C++ kernel checks
    if (type(x) is _Tensor and plans.OPERATORS.holds_norm(x, residual is not None)
            and isinstance(weight, _Tensor) and type(eps) is float
            and (residual is None or type(residual) is _Tensor)):
        if residual is None:
            return _rms_norm_call(x, weight, eps)
        return _add_rms_norm_call(x, residual, weight, eps)
    _check(x, weight, eps, residual)
    return _rms_norm(x, weight, float(eps), residual)


def _rms_norm(x, weight, eps, residual):
    """A checked call: the kernel where it takes x, else torch's ops. After a CUDA launch the
    torch operator library is loaded and handed the kernel (once), so that its C++ kernel
    launches every later plain call (:class:`mixgemm.dispatch.plans.OperatorLibrary`)."""
    if not _kernel_takes(x):
        return _torch(x, weight, eps, residual)
    out = _launch(x, weight, eps, residual)
    if x.is_cuda and plans.OPERATORS.attach() is not None:
        kernel = loader.KERNELS.get(norm_spec(x.dtype, residual is not None), x.device)   # loaded by the call
        plans.OPERATORS.put_norm(kernel, residual is not None, x.dtype)
    return out


def _rms_norm_dispatched(x, weight, eps, residual):
    """The Python kernel of the operators (``mixgemm::rms_norm`` / ``add_rms_norm``, and the
    ``_py`` operators their C++ kernel hands its other calls to): checked, then :func:`_rms_norm`."""
    _check(x, weight, eps, residual)
    return _rms_norm(x, weight, eps, residual)


def _norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _add_norm_fake(x, residual, weight, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@custom_op("mixgemm::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_dispatched(x, weight, eps, None)


@custom_op("mixgemm::rms_norm_py", mutates_args=())
def _rms_norm_py_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Python kernel of ``mixgemm::rms_norm``, for the calls its C++ kernel hands over."""
    return _rms_norm_dispatched(x, weight, eps, None)


@custom_op("mixgemm::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm_dispatched(x, weight, eps, residual)


@custom_op("mixgemm::add_rms_norm_py", mutates_args=())
def _add_rms_norm_py_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Python kernel of ``mixgemm::add_rms_norm``, for the calls its C++ kernel hands over."""
    return _rms_norm_dispatched(x, weight, eps, residual)


for _op in (_rms_norm_op, _rms_norm_py_op):
    _op.register_fake(_norm_fake)
for _op in (_add_rms_norm_op, _add_rms_norm_py_op):
    _op.register_fake(_add_norm_fake)

#: the operators' overloads, called by the eager path (an overload's call skips the packet's
#: overload resolution)
_rms_norm_call = torch.ops.mixgemm.rms_norm.default
_add_rms_norm_call = torch.ops.mixgemm.add_rms_norm.default


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
#: transformers' RMSNorm classes whose forward is LLaMA's: ``weight * (x.float() *
#: rsqrt(mean(x.float()^2) + variance_epsilon)).to(x.dtype)``, a ``weight`` of ``[H]`` and a float
#: ``variance_epsilon`` (Gemma's, which scales by ``1 + weight``, is not among them)
LLAMA_STYLE_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
                               "Qwen3RMSNorm", "Qwen3MoeRMSNorm"})


class RMSNorm(torch.nn.Module):
    """LLaMA's RMSNorm through :func:`rms_norm`: one launch on an sm_90 GPU where transformers'
    ``LlamaRMSNorm`` makes about seven (float cast, square, mean, rsqrt, two multiplies, cast).

    Parameters
    ----------
    hidden_size : int
    eps : float, default 1e-6
        Kept as ``variance_epsilon``, the attribute name of transformers' modules.
    dtype, device : optional
        Of the weight (initialized to ones).

    Notes
    -----
    ``forward(x)`` with x ``[..., hidden_size]`` of the weight's dtype is :func:`rms_norm`:
    computed in float32 and rounded once, where transformers' module rounds the normalized x to
    x's dtype before the weight multiplies it (the two differ by at most an ulp of the dtype).
    An x of another dtype takes transformers' formula in torch ops.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.variance_epsilon = float(eps)

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> "RMSNorm":
        """The same norm (its weight shared, not copied) from a transformers RMSNorm module of
        :data:`LLAMA_STYLE_NORMS`. Raises TypeError for any other module."""
        name = type(module).__name__
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", None)
        if name not in LLAMA_STYLE_NORMS or not isinstance(weight, torch.Tensor) or weight.dim() != 1 \
                or isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"not a LLaMA-style RMSNorm (one of {sorted(LLAMA_STYLE_NORMS)} with a 1-D weight "
                            f"and a float variance_epsilon): {name}")
        norm = cls.__new__(cls)
        torch.nn.Module.__init__(norm)
        norm.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight, False)
        norm.variance_epsilon = float(eps)
        return norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]   # (read without nn.Module.__getattr__: the eager hot path)
        if x.dtype != weight.dtype:
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return weight * h.to(x.dtype)
        return rms_norm(x, weight, self.variance_epsilon)

    def kernel_uses(self) -> list[NormSpec]:
        """The RMSNorm kernel of the weight's dtype, where it is bf16 or fp16
        (:class:`~mixgemm.dispatch.uses.LaunchesKernels`)."""
        return [norm_spec(self.weight.dtype, False)] if self.weight.dtype in _KERNEL_DTYPES else []

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


def replace_rms_norms(model: torch.nn.Module) -> list[str]:
    """Replace every transformers RMSNorm module of :data:`LLAMA_STYLE_NORMS` inside ``model`` by
    :class:`RMSNorm` (sharing its weight), in place; the names of the replaced modules."""
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod).__name__ in LLAMA_STYLE_NORMS]
    done = []
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if not attr:
            continue                     # the model itself is a norm: nothing to replace it in
        setattr(parent, attr, RMSNorm.from_module(mod))
        done.append(name)
    return done
