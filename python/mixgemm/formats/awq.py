"""AutoAWQ ``version="GEMM"`` layers (``WQLinear_GEMM``): :func:`from_awq`."""
from __future__ import annotations

from typing import Optional

import torch

from .common import (shard_imported, DTypeLike, ImportedLayer, check_bits, check_kernel_shape, check_tensor,
                     layer_error, finalize_layer, layer_dtype, resolve_group_size, unpack_words)

#: AutoAWQ's nibble order: nibble ``i`` (bits ``4i..4i+3``) of a packed word holds output
#: column ``8*c + _AWQ_ORDER[i]`` of word column ``c``.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` in AWQ order -> uint8 ``[R, 8C]`` in natural column order."""
    r, c = packed.shape
    nibbles = unpack_words(packed, 4, dim=1).view(r, c, 8)  # in storage (nibble) order
    # column p of a word sits in the nibble i with _AWQ_ORDER[i] == p
    inverse = torch.argsort(torch.tensor(_AWQ_ORDER, device=packed.device))
    return nibbles.index_select(2, inverse).reshape(r, 8 * c)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
             group_size: Optional[int] = None, bits: int = 4, dtype: DTypeLike = None,
             symmetric: Optional[bool] = None, name: str = "<awq>", tp_rank: int = 0, tp_size: int = 1,
             tp_dim: int = 0) -> ImportedLayer:
    """Convert an AutoAWQ ``version="GEMM"`` layer (``WQLinear_GEMM``).

    AutoAWQ dequantizes (``awq.utils.packing_utils.dequantize_gemm``)::

        w[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]      q, z in [0, 15]

    in the scales' dtype (fp16), transposed here to nn.Linear's ``[N, K]``.

    Bit-exact with this formula when ``dtype`` is the scales' dtype (the default); with
    another ``dtype``, within the bound given under "Bit-exactness" in the module docstring.

    Parameters
    ----------
    qweight : torch.Tensor
        int32 ``[K, N/8]``: each word packs 8 consecutive output columns ``8c .. 8c+7`` of
        input row ``k`` as 4-bit codes, nibble ``i`` (bits ``4i..4i+3``) holding column
        ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``.
    qzeros : torch.Tensor
        int32 ``[K/g, N/8]``: the zero points, packed the same way along N.
    scales : torch.Tensor
        ``[K/g, N]``, floating point (fp16 in AutoAWQ checkpoints).
    group_size : int, optional
        AWQ's ``q_group_size``; inferred from the shapes when ``None``, checked otherwise
        (``-1``: per-channel).
    bits : int, default 4
        AWQ's ``w_bit``; the GEMM packing exists for 4 bits only.
    dtype : torch.dtype or str, optional
        Activation dtype (bf16/fp16) of the result's scales and zeros; default the scales'.
    symmetric : bool, optional
        See the module docstring; ``None`` picks symmetric iff every zero point is 8.
    name : str
        Layer name used in error messages.
    tp_rank, tp_size, tp_dim : int
        Tensor parallelism (module docstring): with ``tp_size > 1``, the rank's shard along
        ``tp_dim`` (0: rows, 1: columns).

    Returns
    -------
    ImportedLayer
        ``qweight`` ``[N, K]`` (uint8 asymmetric, or int8 symmetric), ``perm=None``.

    Raises
    ------
    FormatError
        Inconsistent shapes or dtypes; N % 16, K % 64 or the group size unsupported.
    UnsupportedLayerError
        ``bits != 4``.
    """
    check_bits(name, bits, "AWQ GEMM", (4,))
    check_tensor(name, "qweight", qweight, 2, (torch.int32,))
    check_tensor(name, "qzeros", qzeros, 2, (torch.int32,))
    check_tensor(name, "scales", scales, 2, floating=True)
    k, n = qweight.shape[0], scales.shape[1]
    if qweight.shape[1] * 8 != n:
        raise layer_error(name, f"AWQ GEMM qweight must be [K, N/8] with N={n} from scales "
                         f"{list(scales.shape)}, got {list(qweight.shape)}")
    num_groups = scales.shape[0]
    if tuple(qzeros.shape) != (num_groups, n // 8):
        raise layer_error(name, f"qzeros must be [K/g, N/8] = {[num_groups, n // 8]} to match scales "
                         f"{list(scales.shape)}, got {list(qzeros.shape)}")
    gs = resolve_group_size(name, k, num_groups, group_size)
    check_kernel_shape(name, n, k, gs)
    act = layer_dtype(name, dtype, scales.dtype)
    q_u = _awq_unpack(qweight).t()           # [N, K]
    z_u = _awq_unpack(qzeros).t()            # [N, G]
    qw = finalize_layer(name, q_u, z_u, scales.t(), bits=4, group_size=gs, symmetric=symmetric,
                   act=act)
    return shard_imported(ImportedLayer(qweight=qw), name, tp_rank, tp_size, tp_dim)
