"""GPTQ layers (AutoGPTQ / GPTQModel ``QuantLinear``, the packed "gptq" layout):
:func:`from_gptq` and the zero-point convention :class:`GPTQCheckpointFormat`."""
from __future__ import annotations

import enum
from typing import Optional, Union

import torch

from .common import (shard_imported, WORD_BITS, DTypeLike, ImportedLayer, apply_groups, check_bits,
                     check_kernel_shape, check_tensor, layer_error, finalize_layer, layer_dtype,
                     resolve_group_size, resolve_groups, unpack_words)


class GPTQCheckpointFormat(enum.Enum):
    """How a GPTQ checkpoint stores its zero points (``checkpoint_format`` in
    ``quantize_config.json``; a config without it means :attr:`V1`)."""

    #: ``"gptq"``: the original AutoGPTQ convention, each zero point stored as ``z - 1``.
    V1 = "gptq"
    #: ``"gptq_v2"``: GPTQModel's convention, each zero point stored as ``z``.
    V2 = "gptq_v2"

    @classmethod
    def parse(cls, value: "GPTQCheckpointFormat | str") -> "GPTQCheckpointFormat":
        if isinstance(value, GPTQCheckpointFormat):
            return value
        aliases = {"gptq": cls.V1, "v1": cls.V1, "gptq_v1": cls.V1, "gptq_v2": cls.V2,
                   "v2": cls.V2}
        try:
            return aliases[str(value).lower()]
        except KeyError:
            raise ValueError(f"unknown GPTQ checkpoint_format {value!r}: mixgemm reads 'gptq' "
                             f"(v1, zeros stored minus one) and 'gptq_v2'") from None


#: Adding this to a packed int32 zero word adds 1 to every packed zero point (with carries),
#: GPTQModel's v1 -> v2 conversion (``convert_gptq_v1_to_v2_format_module``).
GPTQ_V1_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: Optional[torch.Tensor] = None, *,
              checkpoint_format: Union[GPTQCheckpointFormat, str],
              bits: Optional[int] = None, group_size: Optional[int] = None,
              dtype: DTypeLike = None, symmetric: Optional[bool] = None,
              name: str = "<gptq>", tp_rank: int = 0, tp_size: int = 1,
             tp_dim: int = 0) -> ImportedLayer:
    """Convert a GPTQ layer (AutoGPTQ / GPTQModel ``QuantLinear``, the packed "gptq" layout).

    GPTQ dequantizes (AutoGPTQ/GPTQModel's torch path)::

        w[k, n] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])    q, z in [0, 2^b - 1]

    in the scales' dtype, transposed here to ``[N, K]``. ``z`` is the stored zero point for
    ``checkpoint_format="gptq_v2"`` and the stored value plus one for ``"gptq"`` (v1).
    Symmetric GPTQ (``sym=True``) stores ``z = 2^(b-1)`` and imports as a symmetric layer.

    Bit-exact with this formula when ``dtype`` is the scales' dtype (the default); with
    another ``dtype``, within the bound given under "Bit-exactness" in the module docstring.

    The v1 "+1" is applied as GPTQModel applies it (adding ``0x11111111`` (4-bit),
    ``0x01010101`` (8-bit) or ``0x55555555`` (2-bit) to each int32 word, which is the exact
    inverse of its own v2 -> v1 export, borrows included). For a v1 zero stored as ``2^b - 1``
    (a true zero point of 0, which AutoGPTQ's packer could not store) other loaders disagree:
    AutoGPTQ's ``cuda_old`` path wraps it to 0 without a carry, exllama-style kernels read
    ``2^b``; such checkpoints are ambiguous (and AutoGPTQ-written ones corrupt), so compare
    against the loader you trust.

    Parameters
    ----------
    qweight : torch.Tensor
        int32 ``[K * bits / 32, N]``: word ``r`` of column ``n`` packs rows
        ``k = r * (32/bits) + j``, code ``j`` at bits ``bits*j .. bits*j + bits - 1``.
    qzeros : torch.Tensor
        int32 ``[G, N * bits / 32]``: the zero points, packed the same way along N.
    scales : torch.Tensor
        ``[G, N]``, floating point (the model dtype, usually fp16).
    g_idx : torch.Tensor, optional
        Integer ``[K]``: the group of each input column. ``None`` or ``arange(K) // g``: groups
        are contiguous. Otherwise (act-order) see the module docstring: ``perm`` is returned.
    checkpoint_format : GPTQCheckpointFormat or str
        ``"gptq"`` (v1: zeros stored minus one; the default when ``quantize_config.json`` has
        no ``checkpoint_format``) or ``"gptq_v2"`` (zeros stored as they are). Required:
        guessing wrong shifts every zero point by one.
    bits : int, optional
        2, 4 or 8; inferred from ``qzeros``'s shape when ``None``, checked otherwise.
    group_size : int, optional
        Inferred (``K / G``) when ``None``; checked otherwise (``-1``: per-channel).
    dtype, symmetric, name, tp_rank, tp_size, tp_dim
        As for :func:`from_awq` (``symmetric=None``: symmetric iff every zero is ``2^(b-1)``).

    Returns
    -------
    ImportedLayer
        ``qweight`` ``[N, K]``; ``perm`` int64 ``[K]`` for act-order layers whose groups are
        not contiguous, else ``None``.

    Raises
    ------
    FormatError
        Inconsistent shapes/dtypes, a ``bits`` that contradicts the shapes, an invalid
        ``g_idx``; N % 16, K % 64 or the group size unsupported.
    UnsupportedLayerError
        3-bit (or other non 2/4/8-bit) layers; act-order groups of unequal size.
    """
    fmt = GPTQCheckpointFormat.parse(checkpoint_format)
    check_tensor(name, "qweight", qweight, 2, (torch.int32,))
    check_tensor(name, "qzeros", qzeros, 2, (torch.int32,))
    check_tensor(name, "scales", scales, 2, floating=True)
    num_groups, n = scales.shape
    if qweight.shape[1] != n:
        raise layer_error(name, f"GPTQ qweight must be [K*bits/32, N] with N={n} from scales "
                         f"{list(scales.shape)}, got {list(qweight.shape)}")
    if qzeros.shape[0] != num_groups:
        raise layer_error(name, f"qzeros has {qzeros.shape[0]} groups, scales {num_groups}")
    zbits, rem = divmod(qzeros.shape[1] * WORD_BITS, n)
    if bits is None:
        if rem:
            raise layer_error(name, f"qzeros {list(qzeros.shape)} does not pack N={n} zero points "
                             f"into whole int32 words")
        bits = zbits
    elif rem or zbits != bits:
        raise layer_error(name, f"bits={bits} does not match qzeros {list(qzeros.shape)}: "
                         f"{bits}-bit zeros for N={n} need [G, {n * bits // WORD_BITS}]")
    check_bits(name, bits, "GPTQ")
    k = qweight.shape[0] * WORD_BITS // bits
    gs = resolve_group_size(name, k, num_groups, group_size)
    check_kernel_shape(name, n, k, gs)
    act = layer_dtype(name, dtype, scales.dtype)
    perm, labels = resolve_groups(name, g_idx, k, num_groups)

    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    if fmt is GPTQCheckpointFormat.V1:
        words = (words + GPTQ_V1_OFFSET[bits]) & 0xFFFFFFFF
    z_u = unpack_words(words, bits, dim=1).t()          # [N, G]
    q_u = unpack_words(qweight, bits, dim=0).t()         # [N, K]
    q_u, z_u, s = apply_groups(q_u, z_u, scales.t(), perm, labels)
    qw = finalize_layer(name, q_u, z_u, s, bits=bits, group_size=gs, symmetric=symmetric, act=act)
    return shard_imported(ImportedLayer(qweight=qw, perm=perm), name, tp_rank, tp_size, tp_dim)
