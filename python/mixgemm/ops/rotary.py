"""Rotary position embedding of q and k, with the new keys and values written into the KV cache:
:func:`rotary_kv_cache`.

Between a decoder layer's qkv projection and its attention, the LLaMA / Qwen code turns q and k by
their position (``x * cos + rotate_half(x) * sin``) and writes k and v into the cache. In torch
that is about eight small launches (a negation, a concatenation, two products and a sum for the
rotation, the cache copies), each a few microseconds at decode. On an sm_90 GPU
:func:`rotary_kv_cache` is one launch of mixgemm's kernel (:class:`mixgemm.jit.specs.RopeSpec`,
``cutlass_ext/mixgemm/rope_kernel.hpp``), with the same roundings as the torch formula, so the
results are equal bit for bit. Elsewhere it runs that formula in torch ops.
``torch.ops.mixgemm.rotary_kv_cache`` is its custom op (traceable by torch.compile).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional, Union

import torch

from ..dispatch import checks, plans
from ..dispatch.library import custom_op
from ..dtypes import ActType
from ..jit import driver, loader
from ..jit.loader import aligned_contiguous
from ..jit.specs import RopeSpec

__all__ = ["rotary_kv_cache", "rope_spec", "rotate"]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_THREADS = 256   # rope_kernel.hpp's kRopeThreads
_Tensor = torch.Tensor
#: the largest head count and first position that the eager path hands to the operator (the C++
#: kernel's int32 arguments; larger ones take the Python path, which raises or runs them)
_INT32_MAX = 2 ** 31 - 1


@functools.lru_cache(maxsize=None)
def rope_spec(dtype: torch.dtype):
    """The kernel :func:`rotary_kv_cache` launches for a qkv of ``dtype`` (bf16 or fp16)."""
    return RopeSpec(ActType.from_torch(dtype))


def _shape(t) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_like_qkv(name: str, t: torch.Tensor, qkv: torch.Tensor) -> None:
    if t.dtype != qkv.dtype or t.device != qkv.device:
        raise ValueError(f"{name} must have qkv's dtype and device ({qkv.dtype}, {qkv.device}), "
                         f"got {t.dtype} on {t.device}")


def _check(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads) -> tuple[int, int, int]:
    """(B, T, D), or a clear error."""
    for name, v in (("heads", heads), ("kv_heads", kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(qkv, torch.Tensor) or not qkv.is_floating_point() or qkv.dim() != 3:
        raise TypeError(f"qkv must be a floating-point tensor [B, T, (heads + 2 kv_heads) * D], got {_shape(qkv)}")
    b, t, width = qkv.shape
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if width % (heads + 2 * kv_heads) or (width // (heads + 2 * kv_heads)) % 2:
        raise ValueError(f"qkv's last dimension {width} is not (heads + 2 kv_heads) = {heads + 2 * kv_heads} "
                         "heads of an even head size")
    d = width // (heads + 2 * kv_heads)
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] != d:
            raise ValueError(f"{name} must be a table [positions, D={d}], got {_shape(table)}")
        _check_like_qkv(name, table, qkv)
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {list(cos.shape)} and {list(sin.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.shape[0] < b \
                or cache.shape[1] != kv_heads or cache.shape[3] != d:
            raise ValueError(f"{name} must be [batch >= {b}, kv_heads={kv_heads}, length, D={d}], got {_shape(cache)}")
        _check_like_qkv(name, cache, qkv)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {list(k_cache.shape)} and {list(v_cache.shape)}")
    limit = min(cos.shape[0], k_cache.shape[2])
    if isinstance(positions, torch.Tensor):
        if positions.shape != (b, t) or positions.dtype not in (torch.int32, torch.int64) \
                or positions.device != qkv.device:
            raise ValueError(f"positions must be an int32 / int64 tensor [B={b}, T={t}] on {qkv.device}, got "
                             f"{positions.dtype} {list(positions.shape)} on {positions.device}")
    elif isinstance(positions, bool) or not isinstance(positions, int):
        raise TypeError(f"positions must be an int (the first token's position) or a tensor [B, T], "
                        f"got {type(positions).__name__}")
    elif positions < 0 or positions + t > limit:
        raise ValueError(f"positions {positions}..{positions + t - 1} are outside the {limit} positions that the "
                         f"tables ({cos.shape[0]}) and the cache ({k_cache.shape[2]}) hold")
    return b, t, d


def _kernel_takes(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: int) -> bool:

    if qkv.dtype not in _KERNEL_DTYPES or d % 16 or checks.device_problem(qkv.device) is not None:
        return False
    strides = k_cache.stride()
    return (strides == v_cache.stride() and strides[3] == 1 and all(s % 8 == 0 for s in strides[:3])
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


#: the argument types of MIXGEMM_ROPE_KV_ENTRY: qkv, cos, sin, positions, q_out, k_cache, v_cache,
#: three cache strides, tokens, heads, kv_heads, head_dim, table positions, cache length, pos0
_ARG_TYPES = (ctypes.c_void_p,) * 7 + (ctypes.c_int64,) * 3 + (ctypes.c_int32,) * 7


def _launch(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads, b, t, d) -> torch.Tensor:
    qkv, cos, sin = aligned_contiguous(qkv), aligned_contiguous(cos), aligned_contiguous(sin)
    q = torch.empty(b, t, heads, d, dtype=qkv.dtype, device=qkv.device)
    if isinstance(positions, torch.Tensor):
        table, pos0 = positions.to(torch.int64).contiguous(), 0
        table_ptr = table.data_ptr()
    else:
        table, table_ptr, pos0 = None, None, positions
    launch = loader.KERNELS.plain_launch(rope_spec(qkv.dtype), qkv.device, _ARG_TYPES, _THREADS)
    if b * t:
        sb, sh, sl, _ = k_cache.stride()
        launch(b * t, driver.current_stream(qkv.device.index), qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), table_ptr,
               q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), sb, sh, sl, t, heads, kv_heads, d,
               cos.shape[0], k_cache.shape[2], pos0)
    return q


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in x's dtype (the LLaMA / Qwen code's formula), cos and
    sin broadcast against x ``[..., D]``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _torch(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads, b, t, d) -> torch.Tensor:
    q, k, v = qkv.reshape(b, t, heads + 2 * kv_heads, d).split((heads, kv_heads, kv_heads), dim=2)
    if isinstance(positions, torch.Tensor):
        pos = positions.to(torch.int64)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= min(cos.shape[0], k_cache.shape[2])):
            raise ValueError(f"positions must lie in [0, {min(cos.shape[0], k_cache.shape[2])})")
    else:
        pos = torch.arange(positions, positions + t, device=qkv.device)[None, :].expand(b, t)
    c, s = cos[pos][:, :, None, :], sin[pos][:, :, None, :]            # [B, T, 1, D]
    q, k = rotate(q, c, s), rotate(k, c, s)
    rows = torch.arange(b, device=qkv.device)[:, None].expand(b, t)
    k_cache[rows, :, pos] = k                                           # [B, T, kv_heads, D] at (b, :, p)
    v_cache[rows, :, pos] = v
    return q.contiguous()


def rotary_kv_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, positions: Union[int, torch.Tensor], heads: int,
                    kv_heads: int) -> torch.Tensor:
    """Rotary embedding of q and k, and k and v written into the KV cache, in one launch.

    Parameters
    ----------
    qkv : torch.Tensor
        ``[B, T, (heads + 2 kv_heads) * D]``: a fused qkv projection's output, the query heads,
        then the key heads, then the value heads, ``D`` values each (``D`` even; a multiple of 16
        for the kernel). bfloat16 or float16 for the kernel.
    cos, sin : torch.Tensor
        ``[P, D]``, qkv's dtype and device: the tables of the "rotate half" form (row ``p`` holds
        ``cos(p * theta_i)`` / ``sin(...)`` for ``i = j mod D/2``, as LLaMA's rotary module
        computes them).
    k_cache, v_cache : torch.Tensor
        ``[batch >= B, kv_heads, L, D]``, qkv's dtype and device, one shape (the layout of
        transformers' caches). Written in place: sequence ``b``'s token at position ``p`` goes to
        ``[b, :, p, :]``.
    positions : int or torch.Tensor
        The position of the first token of every sequence (tokens at ``positions .. positions +
        T - 1``), or an int32 / int64 tensor ``[B, T]`` of each token's position (what a CUDA graph
        replayed at several positions takes). Positions must lie in ``[0, min(P, L))``: an int
        outside raises ValueError; the kernel skips a token whose tensor position is outside (its
        q row is then undefined), the torch path raises.
    heads, kv_heads : int
        Query heads and key/value heads (grouped-query attention: heads a multiple of kv_heads).

    Returns
    -------
    torch.Tensor
        q rotated, ``[B, T, heads, D]``, contiguous, qkv's dtype. ``qkv`` is not modified.

    Notes
    -----
    Each rotated value is ``x * cos + rotate_half(x) * sin`` with both products and the sum
    rounded to the dtype, as the models' torch code computes it, so the kernel's results equal
    :func:`rotate`'s bit for bit. On an sm_90 GPU with bf16 / fp16, ``D % 16 == 0``, and caches
    whose rows are 16-byte aligned with strides in whole 8-value vectors (``k_cache.stride() ==
    v_cache.stride()``, last stride 1), this is one launch of :class:`mixgemm.jit.specs.RopeSpec`'s
    kernel (capturable in a CUDA graph after a first call has loaded it); otherwise the same
    formula runs in torch ops. Under torch.compile it goes through
    ``torch.ops.mixgemm.rotary_kv_cache``.

    In eager mode, once the torch operator library (:mod:`mixgemm.jit.torch_ops`) holds the
    kernel for qkv's dtype and CUDA device (the first such call launches from Python, loads the
    library and hands the kernel over), a call of plain tensors, int head counts and an int or
    tensor ``positions`` goes to that operator, whose C++ kernel launches it: the same kernel
    with the same arguments, so the same results. A call the C++ kernel does not take (int32 or
    strided positions, tables to copy, caches it cannot address, a bad argument) goes on to the
    Python kernel, which checks it as here: the same results and errors, nothing written before
    an error.
    """
    if torch.compiler.is_compiling():
        _check(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads)
        table = positions if isinstance(positions, torch.Tensor) else None
        return torch.ops.mixgemm.rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, table,
                                                 0 if table is not None else positions, heads, kv_heads)
    # the types (and int ranges) the operator's schema takes, checked here; the rest the C++ kernel checks
    if (type(qkv) is _Tensor and plans.OPERATORS.holds_rope(qkv)
            and type(heads) is int and type(kv_heads) is int and 0 < heads <= _INT32_MAX
            and 0 < kv_heads <= _INT32_MAX and isinstance(cos, _Tensor) and isinstance(sin, _Tensor)
            and isinstance(k_cache, _Tensor) and isinstance(v_cache, _Tensor)):
        if type(positions) is _Tensor:
            return _rotary_kv_cache_call(qkv, cos, sin, k_cache, v_cache, positions, 0, heads, kv_heads)
        if type(positions) is int and 0 <= positions <= _INT32_MAX:
            return _rotary_kv_cache_call(qkv, cos, sin, k_cache, v_cache, None, positions, heads, kv_heads)
    b, t, d = _check(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads)
    return _rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads, b, t, d)


def _rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads, b, t, d) -> torch.Tensor:
    """A checked call: the kernel where it takes the call, else the torch formula. After a CUDA
    launch the torch operator library is loaded and handed the kernel (once), so that its C++
    kernel launches every later plain call (:class:`mixgemm.dispatch.plans.OperatorLibrary`)."""
    if not _kernel_takes(qkv, k_cache, v_cache, d):
        return _torch(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads, b, t, d)
    q = _launch(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads, b, t, d)
    if qkv.is_cuda and plans.OPERATORS.attach() is not None:
        kernel = loader.KERNELS.get(rope_spec(qkv.dtype), qkv.device)   # loaded by the call
        plans.OPERATORS.put_rope(kernel, qkv.dtype)
    return q


def _rotary_kv_cache_dispatched(qkv, cos, sin, k_cache, v_cache, positions, pos0, heads, kv_heads) -> torch.Tensor:
    """The Python kernel of the operator ``mixgemm::rotary_kv_cache`` (and of
    ``rotary_kv_cache_py``, which its C++ kernel hands its other calls to; ``positions``: a
    tensor, or None for the first token's position ``pos0``): checked, then :func:`_rotary_kv_cache`."""
    if positions is None:
        positions = pos0
    b, t, d = _check(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads)
    return _rotary_kv_cache(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads, b, t, d)


def _rotary_kv_cache_fake(qkv, cos, sin, k_cache, v_cache, positions, pos0, heads, kv_heads):
    b, t, width = qkv.shape
    return qkv.new_empty(b, t, heads, width // (heads + 2 * kv_heads))


@custom_op("mixgemm::rotary_kv_cache", mutates_args=("k_cache", "v_cache"))
def _rotary_kv_cache_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, positions: Optional[torch.Tensor], pos0: int, heads: int,
                        kv_heads: int) -> torch.Tensor:
    return _rotary_kv_cache_dispatched(qkv, cos, sin, k_cache, v_cache, positions, pos0, heads, kv_heads)


@custom_op("mixgemm::rotary_kv_cache_py", mutates_args=("k_cache", "v_cache"))
def _rotary_kv_cache_py_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, positions: Optional[torch.Tensor], pos0: int, heads: int,
                           kv_heads: int) -> torch.Tensor:
    """The Python kernel of ``mixgemm::rotary_kv_cache``, for the calls its C++ kernel hands over."""
    return _rotary_kv_cache_dispatched(qkv, cos, sin, k_cache, v_cache, positions, pos0, heads, kv_heads)


for _op in (_rotary_kv_cache_op, _rotary_kv_cache_py_op):
    _op.register_fake(_rotary_kv_cache_fake)

#: the operator's overload, called by the eager path (an overload's call skips the packet's
#: overload resolution)
_rotary_kv_cache_call = torch.ops.mixgemm.rotary_kv_cache.default
