"""compressed-tensors ``format="pack-quantized"`` layers: :func:`from_compressed_tensors`."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..errors import UnsupportedLayerError
from .common import (shard_imported, WORD_BITS, DTypeLike, ImportedLayer, apply_groups, check_bits,
                     check_kernel_shape, check_tensor, layer_error, finalize_layer, layer_dtype,
                     resolve_group_size, resolve_groups, unpack_words)

#: The widths that compressed-tensors <= 0.17 packed with spare bits (``32 // bits`` codes per
#: int32 word, the rest zero) and later versions pack densely (codes straddle words).
PADDED_WIDTHS = (3, 5, 6, 7)


def packed_words(count: int, bits: int) -> dict:
    """The int32 words that hold ``count`` codes of ``bits`` bits in each of compressed-tensors'
    layouts: ``{"dense": ceil(count * bits / 32), "padded": ceil(count / (32 // bits))}`` (the
    two are the same layout for 1, 2, 4 and 8 bits)."""
    return {"dense": -(-count * bits // WORD_BITS), "padded": -(-count // (WORD_BITS // bits))}


def packings(words: torch.Tensor, count: int, bits: Optional[int] = None, dim: int = 1) -> set:
    """The ``(bits, layout)`` pairs that int32 ``words`` (``count`` codes along ``dim``) can be:
    the word count fits the layout (:func:`packed_words`), and a padded layout leaves its spare
    bits zero in every word (how 8-bit codes, dense, are told from 7-bit ones, padded, when both
    take K / 4 words). ``bits`` restricts the widths. For 1, 2, 4 and 8 bits the two layouts are
    one, reported as ``"dense"``."""
    n_words = words.shape[dim]
    out = set()
    for b in ([bits] if bits is not None else range(1, 9)):
        need = packed_words(count, b)
        if need["dense"] == n_words:
            out.add((b, "dense"))
        if need["padded"] == n_words and WORD_BITS % b:
            spare = WORD_BITS - (WORD_BITS // b) * b
            if not bool(((words.to(torch.int64) >> (WORD_BITS - spare)) & ((1 << spare) - 1)).any()):
                out.add((b, "padded"))
    return out


def _packed_bits(name: str, packed: torch.Tensor, k: int, bits: Optional[int]) -> int:
    """The bits of ``weight_packed`` holding K codes per row, dense or padded (:func:`packings`):
    checked against ``bits`` when given, else inferred; a FormatError when the words fit no
    width, or several."""
    shape, words = list(packed.shape), packed.shape[1]
    if bits is not None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise layer_error(name, f"bits must be an integer from 1 to 8, got {bits!r}")
        need = packed_words(k, bits)
        if words not in need.values():
            layouts = (f"{need['dense']}" if need["dense"] == need["padded"] else
                       f"{need['dense']} (dense) or {need['padded']} (padded, compressed-tensors <= 0.17)")
            raise layer_error(name, f"bits={bits} does not match weight_packed {shape} for K={k}: need {layouts} "
                             f"int32 words per row")
        return bits
    fits = sorted({b for b, _ in packings(packed, k)})
    if len(fits) != 1:
        what = "no width" if not fits else f"several widths ({fits})"
        raise layer_error(name, f"weight_packed {shape} holds K={k} codes of {what}; pass bits (the config's num_bits)")
    return fits[0]


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_shape: Optional[Union[torch.Tensor, Tuple[int, int]]] = None,
                            weight_zero_point: Optional[torch.Tensor] = None,
                            weight_g_idx: Optional[torch.Tensor] = None, *,
                            bits: Optional[int] = None, group_size: Optional[int] = None,
                            dtype: DTypeLike = None, symmetric: Optional[bool] = None,
                            name: str = "<compressed-tensors>", tp_rank: int = 0, tp_size: int = 1,
             tp_dim: int = 0) -> ImportedLayer:
    """Convert a compressed-tensors ``format="pack-quantized"`` layer (int, "group" or
    "channel" strategy).

    compressed-tensors stores signed codes ``q`` (and zero points ``z``) in
    ``[-2^(b-1), 2^(b-1)-1]`` and dequantizes (``_dequantize``)::

        w[n, k] = (q[n, k].to(s.dtype) - z[n, g].to(s.dtype)) * s[n, g]   (z = 0 if symmetric)

    with ``g = k // group_size`` (``g = g_idx[k]`` for ``actorder="group"`` layers). mixgemm
    stores ``q + 2^(b-1)`` and ``z + 2^(b-1)`` (the same difference) when asymmetric, ``q``
    when symmetric.

    Bit-exact with this formula when ``dtype`` is the scales' dtype (the default); with
    another ``dtype``, within the bound given under "Bit-exactness" in the module docstring.

    Parameters
    ----------
    weight_packed : torch.Tensor
        int32 ``[N, K * bits / 32]`` (``pack_to_int32``): code ``i`` of a row (offset to
        unsigned, ``q + 2^(b-1)``) at bit ``i * bits`` of the row's little-endian bit stream,
        i.e. code ``j`` of word ``c`` is element ``c * 32/bits + j`` at bits ``bits*j ..``.
        A 3, 5, 6 or 7-bit layer (which mixgemm cannot represent: UnsupportedLayerError) is
        recognised in both of compressed-tensors' layouts, told apart by the word count
        (:func:`packed_words`): dense (0.18 on) or padded (up to 0.17).
    weight_scale : torch.Tensor
        ``[N, G]`` ("group") or ``[N, 1]`` ("channel"), floating point.
    weight_shape : torch.Tensor or tuple, optional
        ``[N, K]`` (int tensor of 2 elements); required unless ``bits`` is given.
    weight_zero_point : torch.Tensor, optional
        Asymmetric layers only: int32 ``[N * bits / 32, G]`` packed along N the same way
        (``pack_to_int32(zp, bits, packed_dim=0)``, current compressed-tensors), or the
        unpacked signed values ``[N, G]`` (integer-valued, any dtype).
    weight_g_idx : torch.Tensor, optional
        Integer ``[K]`` (``actorder="group"``); ignored when it contains ``-1`` (the
        "no act-order" placeholder).
    bits : int, optional
        ``num_bits`` (8, 4 or 2); inferred from the shapes when ``None``, checked otherwise.
    group_size, dtype, symmetric, name, tp_rank, tp_size, tp_dim
        As for :func:`from_gptq` (``symmetric=None``: symmetric iff there is no zero point
        or every zero point is 0).

    Returns
    -------
    ImportedLayer
        ``qweight`` ``[N, K]``; ``perm`` for act-order layers (see the module docstring).

    Raises
    ------
    FormatError
        Inconsistent shapes/dtypes or ``bits``, zero points out of range; N % 16, K % 64 or
        the group size unsupported.
    UnsupportedLayerError
        Other bit widths (3, 5, 6, 7: in either layout); the "tensor" strategy (a scalar scale).
    """
    check_tensor(name, "weight_packed", weight_packed, 2, (torch.int32,))
    check_tensor(name, "weight_scale", weight_scale, floating=True)
    n, words = weight_packed.shape
    if weight_shape is not None:
        shape = [int(v) for v in (weight_shape.flatten().tolist()
                                  if isinstance(weight_shape, torch.Tensor) else weight_shape)]
        if len(shape) != 2:
            raise layer_error(name, f"weight_shape must hold [N, K], got {shape}")
        if shape[0] != n:
            raise layer_error(name, f"weight_shape {shape} does not match weight_packed "
                             f"{list(weight_packed.shape)} (N)")
        k = shape[1]
        check_kernel_shape(name, n, k)
        bits = _packed_bits(name, weight_packed, k, bits)
    elif bits is None:
        raise layer_error(name, "pass weight_shape (or bits) to size the weight")
    else:
        k = words * WORD_BITS // bits
    check_bits(name, bits, "compressed-tensors")
    if weight_scale.dim() != 2:
        if weight_scale.numel() == 1:
            raise layer_error(name, "a scalar weight_scale (the 'tensor' strategy) is not supported; "
                             "only 'group' and 'channel'", UnsupportedLayerError)
        raise layer_error(name, f"weight_scale must be [N, G], got {list(weight_scale.shape)}")
    if weight_scale.shape[0] != n:
        raise layer_error(name, f"weight_scale {list(weight_scale.shape)} does not match N={n}")
    num_groups = weight_scale.shape[1]
    gs = resolve_group_size(name, k, num_groups, group_size)
    check_kernel_shape(name, n, k, gs)
    act = layer_dtype(name, dtype, weight_scale.dtype)
    if weight_g_idx is not None and isinstance(weight_g_idx, torch.Tensor) \
            and bool((weight_g_idx == -1).any()):
        weight_g_idx = None
    perm, labels = resolve_groups(name, weight_g_idx, k, num_groups)

    offset = 1 << (bits - 1)
    z_u = None
    if weight_zero_point is not None:
        zp = check_tensor(name, "weight_zero_point", weight_zero_point, 2)
        packed_rows = n * bits // WORD_BITS
        if zp.dtype == torch.int32 and tuple(zp.shape) == (packed_rows, num_groups) \
                and packed_rows != n:
            z_u = unpack_words(zp, bits, dim=0)              # [N, G], already offset
        elif tuple(zp.shape) == (n, num_groups):
            zf = zp.to(torch.float64)
            if not bool((zf == zf.round()).all()) or int(zf.min()) < -offset \
                    or int(zf.max()) > offset - 1:
                raise layer_error(name, f"weight_zero_point values must be integers in "
                                 f"[{-offset}, {offset - 1}]")
            z_u = (zp.to(torch.int16) + offset)
        else:
            raise layer_error(name, f"weight_zero_point must be int32 [{packed_rows}, {num_groups}] "
                             f"(packed along N) or [{n}, {num_groups}], got {zp.dtype} "
                             f"{list(zp.shape)}")
    q_u = unpack_words(weight_packed, bits, dim=1)[:, :k]     # [N, K], q + offset
    q_u, z_u, s = apply_groups(q_u, z_u, weight_scale, perm, labels)
    qw = finalize_layer(name, q_u, z_u, s, bits=bits, group_size=gs, symmetric=symmetric, act=act)
    return shard_imported(ImportedLayer(qweight=qw, perm=perm), name, tp_rank, tp_size, tp_dim)
