"""HQQ layers (``HQQLinear`` state dicts), fractional zero points included: :func:`from_hqq`, and a
layer of a state dict (:func:`import_tensors`). HQQ is no ``quant_method`` mixgemm reads from a
``config.json``, so it has no config, dequantization or header rule."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Dict, Optional

import torch

from .common import (shard_imported, DTypeLike, ImportedLayer, UnsupportedLayerError, check_bits,
                     check_kernel_shape, check_tensor, layer_error, finalize_layer, tensor_key, layer_dtype)
from .registry import HQQ_META_KEYS

#: HQQ's packing names for the widths mixgemm imports (``Quantizer.bit_to_packing``).
_HQQ_PACKING = {8: "8bit_u8", 4: "4bit_u8", 2: "2bit_u8"}
_MISSING = object()


def _meta_scalar(name: str, meta: Mapping, key: str, default: Any = _MISSING) -> Any:
    value = meta.get(key, default)
    if value is _MISSING:
        raise layer_error(name, f"HQQ meta entry {key!r} is missing")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise layer_error(name, f"HQQ meta entry {key!r} must hold one value, got shape "
                             f"{list(value.shape)}")
        value = value.item()
    return value


def _meta_str(name: str, meta: Mapping, key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, torch.Tensor):  # encode_safetensor_type: uint8 character codes
        if value.dim() != 1 or value.is_floating_point():
            raise layer_error(name, f"HQQ meta entry {key!r} must be a string or a 1-D tensor of "
                             f"character codes, got {value.dtype} {list(value.shape)}")
        value = "".join(map(chr, value.tolist()))
    return value


def hqq_meta_from(tensors: Mapping, prefix: str) -> Dict[str, Any]:
    return {key: tensors[tensor_key(prefix, key)] for key in HQQ_META_KEYS
            if tensor_key(prefix, key) in tensors}


def from_hqq(W_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, meta: Mapping, *,
             dtype: DTypeLike = None, symmetric: Optional[bool] = None,
             name: str = "<hqq>", tp_rank: int = 0, tp_size: int = 1,
             tp_dim: int = 0) -> ImportedLayer:
    """Convert an HQQ layer (``HQQLinear``) quantized along K (``axis=1``).

    HQQ dequantizes (``Quantizer.dequantize``), in its ``compute_dtype``::

        W_r = unpack(W_q).to(compute_dtype)                  # [N*K/g, g], codes in [0, 2^b-1]
        w   = ((W_r - zero) * scale).reshape(N, K)           # zero, scale: [N*K/g, 1]

    with a *floating-point* zero point. mixgemm's kernels fold an integer zero point into the
    int -> float conversion. When every zero point is an integer in ``[0, 2^b-1]`` (for
    example ``optimize=False, round_zero=True``), ``W_r - zero`` is exact in both and the
    import is bit-exact with the formula above (when ``dtype`` is the scales' dtype, the
    default; with another ``dtype``, within the bound under "Bit-exactness" in the module
    docstring).

    Fractional zero points (what HQQ's optimizer produces) are split into the nearest integer
    ``z_i`` in ``[0, 2^b-1]``, used by the kernels, and a float32 offset per (row, group),
    ``o = (z_i - zero) * scale`` (:attr:`QuantizedWeight.zero_offsets`), which
    :func:`mixgemm.gemm` adds as ``xsum_per_group @ o`` after the kernel. The weight mixgemm
    computes with is then ``fl(fl((q - z_i) * s) + o)`` against HQQ's ``fl(fl(q - zero) * s)``:
    not bit-exact (no integer re-encoding is: HQQ's first rounding depends on ``zero``'s
    fraction), but within 2 units in the last place of ``2^b * |s|`` per element, i.e. at most
    ``2^(b+1-p)`` quantization steps with ``p`` = 8 (bf16) or 11 (fp16) significant bits
    (tested).

    Parameters
    ----------
    W_q : torch.Tensor
        uint8 ``[N*K/g / (8/b), g]``, packed per HQQ's ``BitPack``: the unpacked codes
        ``[N*K/g, g]`` (row ``r`` = group ``r`` of the row-major flattened weight) are split
        into ``8/b`` equal row blocks, block ``i`` stored in bits ``8 - b*(i+1) ..`` of each
        byte (4-bit: first half in the high nibble; 2-bit: first quarter in bits 6-7; 8-bit:
        unpacked). With ``view_as_float`` the same bytes viewed as a float dtype.
    scale : torch.Tensor
        ``[N*K/g, 1]`` (any shape with ``N*K/g`` elements), floating point: HQQ's
        dequantization scale (already inverted).
    zero : torch.Tensor
        ``[N*K/g, 1]``, floating point: HQQ's zero points, integer or not.
    meta : Mapping
        HQQ's meta data, either plain Python values or as ``encode_safetensor_type`` stores
        them in a state dict (int32 / uint8 tensors): ``nbits`` (8, 4, 2), ``group_size``
        (``None``: K), ``shape`` (``[N, K]``), ``axis`` (must be 1), optionally ``packing``,
        ``view_as_float``, ``compute_dtype``, ``channel_wise``.
    dtype, symmetric, name, tp_rank, tp_size, tp_dim
        As for :func:`from_awq`; the default ``dtype`` is the scales' (else ``compute_dtype``).
        ``symmetric=None``: symmetric iff every zero point is ``2^(b-1)``.

    Returns
    -------
    ImportedLayer
        ``qweight`` ``[N, K]``, ``perm=None``.

    Raises
    ------
    FormatError
        Missing or inconsistent meta data, shapes or dtypes; N % 16, K % 64 or the group
        size unsupported.
    UnsupportedLayerError
        ``axis=0`` (groups along N); nbits other than 8/4/2; quantized scales/zeros (also a
        ``NotImplementedError``).
    """
    if not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping, got {type(meta).__name__}")
    for flag in ("quant_zero", "quant_scale"):
        if flag in meta and bool(_meta_scalar(name, meta, flag)):
            raise layer_error(name, f"HQQ layers with {flag}=True (quantized meta data) are not "
                             f"supported", UnsupportedLayerError)
    for key in ("zero_scale", "meta_zero", "meta_scale"):
        if key in meta:
            raise layer_error(name, f"HQQ layers with quantized scale/zero ({key!r}) are not "
                             f"supported", UnsupportedLayerError)
    nbits = _meta_scalar(name, meta, "nbits")
    if isinstance(nbits, float):
        if not nbits.is_integer():
            raise layer_error(name, f"{nbits:g}-bit HQQ layers are not supported (mixgemm imports 8, 4 "
                             f"and 2-bit ones)", UnsupportedLayerError)
        nbits = int(nbits)
    bits = check_bits(name, nbits, "HQQ")
    axis = int(_meta_scalar(name, meta, "axis"))
    if axis != 1:
        raise layer_error(name, f"HQQ axis={axis} is not supported: mixgemm's groups run along K "
                         f"(in_features), which is HQQ's axis=1; axis=0 groups mix rows of "
                         f"the weight", UnsupportedLayerError)
    if "channel_wise" in meta and not bool(_meta_scalar(name, meta, "channel_wise")):
        raise layer_error(name, "HQQ channel_wise=False (one scale for the whole tensor) is not "
                         "supported", UnsupportedLayerError)
    shape_v = meta.get("shape")
    if shape_v is None:
        raise layer_error(name, "HQQ meta entry 'shape' is missing")
    shape = [int(v) for v in (shape_v.flatten().tolist() if isinstance(shape_v, torch.Tensor)
                              else shape_v)]
    if len(shape) != 2:
        raise layer_error(name, f"HQQ shape must be [N, K], got {shape}")
    n, k = shape
    gs_v = _meta_scalar(name, meta, "group_size", None)
    gs = k if gs_v is None else int(gs_v)
    packing = _meta_str(name, meta, "packing", None) or _HQQ_PACKING[bits]
    if packing != _HQQ_PACKING[bits]:
        raise layer_error(name, f"HQQ packing {packing!r} does not match nbits={bits} (expected "
                         f"{_HQQ_PACKING[bits]!r})")
    check_kernel_shape(name, n, k, gs)

    check_tensor(name, "W_q", W_q, 2)
    if W_q.dtype != torch.uint8:
        if W_q.is_floating_point():  # view_as_float: the packed bytes viewed as floats
            W_q = W_q.contiguous().view(torch.uint8)
        else:
            raise layer_error(name, f"W_q must be uint8 (or a float view of it), got {W_q.dtype}")
    rows = n * k // gs
    per = 8 // bits
    if tuple(W_q.shape) != (rows // per, gs):
        raise layer_error(name, f"W_q must be [N*K/g / {per}, g] = {[rows // per, gs]} for shape "
                         f"{shape}, group_size={gs}, nbits={bits}; got {list(W_q.shape)}")
    for what, t in (("scale", scale), ("zero", zero)):
        check_tensor(name, what, t, floating=True)
        if t.numel() != rows:
            raise layer_error(name, f"{what} must have N*K/g = {rows} elements, got {list(t.shape)}")
    compute = _meta_str(name, meta, "compute_dtype", None)
    fallback = {"torch.float16": torch.float16, "torch.bfloat16": torch.bfloat16}.get(
        compute if isinstance(compute, str) else str(compute))
    act = layer_dtype(name, dtype, scale.dtype, fallback)

    z = zero.reshape(n, k // gs)
    if not bool(torch.isfinite(z).all()):
        raise layer_error(name, "zero has non-finite values")
    qmax = (1 << bits) - 1
    s = scale.reshape(n, k // gs)
    fractional = bool((z != z.round()).any()) or float(z.min()) < 0 or float(z.max()) > qmax
    # integer zero points for the kernels; a fractional (or out-of-range) remainder becomes the
    # float32 offset o = (z_int - z) * s of each (row, group)
    z_int = z.round().clamp(0, qmax)
    offsets = ((z_int.float() - z.float()) * s.to(act).float()).contiguous() if fractional else None
    shifts = torch.arange(8 - bits, -1, -bits, dtype=torch.uint8, device=W_q.device)
    codes = (W_q.unsqueeze(0) >> shifts.view(-1, 1, 1)) & qmax      # [per, rows/per, g]
    q_u = codes.reshape(rows, gs).reshape(n, k)
    if fractional and symmetric:
        raise layer_error(name, "symmetric=True, but the zero points are fractional")
    qw = finalize_layer(name, q_u, z_int.to(torch.int16), s, bits=bits, group_size=gs,
                   symmetric=False if fractional else symmetric, act=act)
    if offsets is not None:
        qw = dataclasses.replace(qw, zero_offsets=offsets)
    return shard_imported(ImportedLayer(qweight=qw), name, tp_rank, tp_size, tp_dim)


def import_tensors(get, tensors, prefix, *, dtype, bits, group_size, checkpoint_format, symmetric):
    """The layer ``prefix`` of a state dict (``get(suffix)``: its tensor), by :func:`from_hqq`
    (bits and group size from the layer's meta entries)."""
    return from_hqq(get("W_q"), get("scale"), get("zero"), hqq_meta_from(tensors, prefix), dtype=dtype,
                    symmetric=symmetric, name=prefix)
