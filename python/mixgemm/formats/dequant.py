r"""The formats' own dequantization formulas, for the layers mixgemm keeps in full precision.

:func:`dequantize_layer` evaluates each format's own dequantization formula (in the scales'
dtype), for the layers :func:`mixgemm.formats.import_layer` refuses with
:class:`~mixgemm.errors.UnsupportedLayerError` (a shape the kernels cannot take, 3-bit codes, a
scalar compressed-tensors scale, act-order groups of unequal size): the loader keeps them in full
precision.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..errors import FormatError
from .compressed_tensors import packed_words, packings
from .config import LayerScheme
from .gptq import GPTQ_V1_OFFSET, GPTQCheckpointFormat
from .registry import Format

__all__ = ["dequantize_layer"]


def _unpack_stream(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """Codes from int32 words holding, along ``dim``, a little-endian bit stream of ``bits``-bit
    codes (code ``i`` at bit ``i * bits``; 2/4/8 bits never straddle a word, 3 bits do). The
    result is int64 with ``count`` codes along ``dim``."""
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    start = torch.arange(count) * bits
    idx, off = start // 32, start % 32
    if -(-count * bits // 32) > w.shape[-1]:
        raise ValueError(f"{w.shape[-1]} int32 words cannot hold {count} {bits}-bit codes")
    lo = w[..., idx] >> off
    nxt = (idx + 1).clamp(max=w.shape[-1] - 1)
    hi = torch.where(off + bits > 32, w[..., nxt] << (32 - off), torch.zeros_like(lo))
    return ((lo | hi) & ((1 << bits) - 1)).movedim(-1, dim)


_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AutoAWQ: nibble i of a word holds column 8c + _AWQ_ORDER[i]


def _need(tensors: Mapping, prefix: str, suffix: str) -> torch.Tensor:
    key = f"{prefix}.{suffix}"
    if key not in tensors:
        raise FormatError(f"layer {prefix!r}: missing tensor {key!r}")
    return tensors[key]


def _groups_of(k: int, num_groups: int, group_size: Optional[int], g_idx: Optional[torch.Tensor],
               prefix: str) -> torch.Tensor:
    if g_idx is not None:
        g = g_idx.to(torch.int64).flatten()
        if g.numel() != k or (k and (int(g.min()) < 0 or int(g.max()) >= num_groups)):
            raise FormatError(f"layer {prefix!r}: g_idx must hold {k} group numbers in [0, {num_groups})")
        return g
    gs = k if group_size in (None, -1) and num_groups == 1 else group_size
    if gs is None:
        gs = -(-k // num_groups)
    if gs <= 0 or -(-k // gs) != num_groups:
        raise FormatError(f"layer {prefix!r}: group size {gs} does not give the {num_groups} groups of the scales "
                          f"for K={k}")
    return torch.arange(k) // gs


def dequantize_layer(method: Format, tensors: Mapping[str, torch.Tensor], prefix: str,
                     scheme: LayerScheme) -> torch.Tensor:
    """The layer ``prefix``'s weight by its format's own dequantization formula.

    For the layers mixgemm's importers refuse (:class:`~mixgemm.errors.UnsupportedLayerError`);
    the same formulas as :mod:`mixgemm.formats` documents, evaluated in the scales' dtype:

    * AWQ: ``w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]`` (4-bit GEMM packing);
    * GPTQ: ``w[n, k] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])``, codes and zero points as
      little-endian bit streams along K and N (2, 3, 4 and 8 bits), ``z`` the stored value plus one
      for v1, undone as GPTQModel undoes its v1 export (per word with carries as
      :func:`~mixgemm.formats.from_gptq` does; 3-bit per field, modulo 8), so a zero point of 0
      (stored as all ones) reads as 0;
    * compressed-tensors: ``w[n, k] = (q[n, k] - z[n, g]) * s[n, g]`` with signed codes, a
      scalar scale ("tensor" strategy) or any group size; 3, 5, 6 and 7-bit codes packed densely
      (0.18 on) or padded (``32 // bits`` per word, up to 0.17), told apart by the word count
      (where the counts coincide, by the config's ``version``, else refused).

    Parameters
    ----------
    method : Format
        AWQ, GPTQ or COMPRESSED_TENSORS (the config's ``quant_method``).
    tensors : Mapping[str, torch.Tensor]
        The layer's tensors, named ``f"{prefix}.{suffix}"``.
    prefix : str
        The layer's name.
    scheme : LayerScheme
        Bits, group size and (GPTQ) checkpoint format from the config (``None``: inferred).

    Returns
    -------
    torch.Tensor
        ``[N, K]`` (``nn.Linear``'s layout), in the scales' dtype, on the CPU.

    Raises
    ------
    FormatError
        Tensors that do not form a layer of the format.
    """
    formula = _FORMULAS.get(method)
    try:
        if formula is not None:
            return formula(tensors, prefix, scheme)
    except (ValueError, IndexError, RuntimeError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"layer {prefix!r}: cannot dequantize its {method.value} tensors: {e}") from None
    raise ValueError(f"no dequantization formula for {method}")


def _dequant_awq(tensors: Mapping, prefix: str, scheme: LayerScheme) -> torch.Tensor:
    if scheme.bits not in (None, 4):
        raise FormatError(f"layer {prefix!r}: AWQ GEMM packing holds 4-bit codes, the config says {scheme.bits}")
    qweight, qzeros, scales = (_need(tensors, prefix, s) for s in ("qweight", "qzeros", "scales"))
    k, n, num_groups = qweight.shape[0], scales.shape[1], scales.shape[0]
    if qweight.shape[1] * 8 != n or tuple(qzeros.shape) != (num_groups, n // 8):
        raise FormatError(f"layer {prefix!r}: AWQ qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)} and "
                          f"scales {list(scales.shape)} do not fit together")
    inverse = torch.argsort(torch.tensor(_AWQ_ORDER))

    def unpack(t):   # [R, C] words -> [R, 8C] codes in column order
        return _unpack_stream(t, 4, t.shape[1] * 8, 1).view(t.shape[0], -1, 8)[..., inverse].reshape(t.shape[0], -1)

    g = _groups_of(k, num_groups, scheme.group_size, None, prefix)
    q, z = unpack(qweight), unpack(qzeros)[g]                         # [K, N]
    return ((q - z).to(scales.dtype) * scales[g]).t().contiguous()


def _dequant_gptq(tensors: Mapping, prefix: str, scheme: LayerScheme) -> torch.Tensor:
    qweight, qzeros, scales = (_need(tensors, prefix, s) for s in ("qweight", "qzeros", "scales"))
    g_idx = tensors.get(f"{prefix}.g_idx")
    num_groups, n = scales.shape
    bits = scheme.bits
    if bits is None:
        bits, rem = divmod(qzeros.shape[1] * 32, n)
        if rem:
            raise FormatError(f"layer {prefix!r}: qzeros {list(qzeros.shape)} does not pack {n} zero points")
    if bits not in (2, 3, 4, 8):     # GPTQModel writes 5/6/7 bits only in its planar "gptq_p" layout
        raise FormatError(f"layer {prefix!r}: {bits}-bit GPTQ layers are not supported (mixgemm reads 2/3/4/8-bit "
                          f"GPTQ; GPTQModel's 5/6/7-bit ones are in its planar 'gptq_p' layout)")
    k = qweight.shape[0] * 32 // bits
    if qweight.shape[1] != n or qzeros.shape[0] != num_groups:
        raise FormatError(f"layer {prefix!r}: GPTQ qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)} and "
                          f"scales {list(scales.shape)} do not fit together")
    q = _unpack_stream(qweight, bits, k, 0)                           # [K, N]
    if scheme.checkpoint_format not in (None, GPTQCheckpointFormat.V1.value):
        z = _unpack_stream(qzeros, bits, n, 1)                        # [G, N], v2: as stored
    elif bits in GPTQ_V1_OFFSET:
        # v1 stores z - 1: undone as GPTQModel undoes its own export (and as from_gptq does), by
        # adding 0x11111111 (4-bit) ... to each word, so a zero point of 0 (stored as all ones,
        # with a borrow from the next field) reads back as 0 and its neighbour as itself.
        z = _unpack_stream((qzeros.to(torch.int64) + GPTQ_V1_OFFSET[bits]) & 0xFFFFFFFF, bits, n, 1)
    else:
        # 3-bit fields straddle words: GPTQModel shifts each field by one, modulo 8.
        z = (_unpack_stream(qzeros, bits, n, 1) + 1) & ((1 << bits) - 1)
    g = _groups_of(k, num_groups, scheme.group_size, g_idx, prefix)
    return ((q - z[g]).to(scales.dtype) * scales[g]).t().contiguous()


def _ct_layout(prefix: str, what: str, words: torch.Tensor, count: int, dim: int, bits: Optional[int],
               packing: Optional[str]) -> tuple:
    """``(bits, layout)`` of ``count`` compressed-tensors codes in int32 ``words`` along ``dim``:
    ``"dense"`` (a bit stream, 0.18 on) or ``"padded"`` (``32 // bits`` codes per word, up to 0.17),
    told apart by the word count and the padded layout's zero spare bits
    (:func:`mixgemm.formats.compressed_tensors.packings`); where both remain possible (as many
    words, and different contents), by ``packing`` (the config's version), else refused."""
    shape = list(words.shape)
    found = packings(words, count, bits, dim)
    if not found:
        if bits is None:
            raise FormatError(f"layer {prefix!r}: {what} {shape} does not hold {count} codes of any width")
        need = packed_words(count, bits)
        raise FormatError(f"layer {prefix!r}: {what} {shape} does not hold {count} {bits}-bit codes: need "
                          f"{need['dense']} (dense) or {need['padded']} (padded) int32 words")
    widths = sorted({b for b, _ in found})
    if len(widths) != 1:
        raise FormatError(f"layer {prefix!r}: {what} {shape} does not say the bits for {count} codes "
                          f"({widths} fit); the config's num_bits is needed")
    b = widths[0]
    layouts = {layout for _, layout in found}
    if len(layouts) == 1:
        return b, layouts.pop()
    if -(-count // (32 // b)) == 1:
        return b, "dense"                              # one word: the two layouts are the same
    if packing in ("dense", "padded"):
        return b, packing
    raise FormatError(f"layer {prefix!r}: {what} {shape} holds {count} {b}-bit codes in as many words densely "
                      f"(compressed-tensors 0.18 on) as padded (up to 0.17), and the config's 'version' does not "
                      f"say which wrote it")


def _ct_unpack(words: torch.Tensor, bits: int, layout: str, count: int, dim: int) -> torch.Tensor:
    if layout == "dense":
        return _unpack_stream(words, bits, count, dim)
    per = 32 // bits                                   # padded: codes j of word c is element c * per + j
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    codes = (w.unsqueeze(-1) >> (torch.arange(per) * bits)) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :count].movedim(-1, dim)


def _dequant_ct(tensors: Mapping, prefix: str, scheme: LayerScheme) -> torch.Tensor:
    packed, scale = _need(tensors, prefix, "weight_packed"), _need(tensors, prefix, "weight_scale")
    shape = tensors.get(f"{prefix}.weight_shape")
    if shape is None:
        raise FormatError(f"layer {prefix!r}: missing tensor {prefix + '.weight_shape'!r}")
    n, k = (int(v) for v in shape.flatten().tolist())
    bits, layout = _ct_layout(prefix, "weight_packed", packed, k, 1, scheme.bits, scheme.packing)
    offset = 1 << (bits - 1)
    q = _ct_unpack(packed, bits, layout, k, 1) - offset                # [N, K], signed
    dt = scale.dtype
    zp = tensors.get(f"{prefix}.weight_zero_point")
    if scale.numel() == 1:                                            # "tensor" strategy
        z = torch.zeros(()) if zp is None else zp.flatten()[:1].to(torch.int64).reshape(())
        return ((q.to(dt) - z.to(dt)) * scale.reshape(())).contiguous()
    if scale.dim() != 2 or scale.shape[0] != n:
        raise FormatError(f"layer {prefix!r}: weight_scale {list(scale.shape)} is not [N={n}, G]")
    num_groups = scale.shape[1]
    g = _groups_of(k, num_groups, scheme.group_size, _ct_g_idx(tensors.get(f"{prefix}.weight_g_idx")), prefix)
    w = q.to(dt)
    if zp is not None:
        if zp.dtype == torch.int32 and zp.shape[0] != n:             # packed along N
            _, zlayout = _ct_layout(prefix, "weight_zero_point", zp, n, 0, bits, scheme.packing)
            zp = _ct_unpack(zp, bits, zlayout, n, 0) - offset
        w = w - zp.to(dt)[:, g]
    return (w * scale[:, g]).contiguous()


def _ct_g_idx(g_idx: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if g_idx is None or bool((g_idx == -1).any()) else g_idx


#: Each format's own dequantization formula.
_FORMULAS = {Format.AWQ: _dequant_awq, Format.GPTQ: _dequant_gptq, Format.COMPRESSED_TENSORS: _dequant_ct}
