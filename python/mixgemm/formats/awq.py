"""AutoAWQ ``version="GEMM"`` layers (``WQLinear_GEMM``): :func:`from_awq`, and the format's
rules: its ``quantization_config`` (:func:`parse_config`), a layer of a state dict
(:func:`import_tensors`), its own dequantization formula (:func:`dequantize`) and a layer from
safetensors headers (:func:`header_layer`)."""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..dtypes import WeightType
from ..errors import CheckpointError, FormatError, UserError
from .common import (shard_imported, DTypeLike, ImportedLayer, check_bits, check_kernel_shape, check_tensor,
                     dequant_groups, layer_error, finalize_layer, layer_dtype, required_tensor, resolve_group_size,
                     unpack_stream, unpack_words)
from .registry import Format
from .rules import (HeaderLayer, LayerScheme, QuantizationConfig, Rule, config_int, header_group,
                    header_shape)

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


# ---------------------------------------------------------------------------------------------
# The format's rules (mixgemm.formats.handlers)
# ---------------------------------------------------------------------------------------------
def parse_config(qc: Mapping, raw: dict, where: str) -> QuantizationConfig:
    """An ``"awq"`` ``quantization_config``: ``version`` "gemm", ``bits`` / ``w_bit``,
    ``group_size`` / ``q_group_size``, ``modules_to_not_convert``."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(f"{where}: AWQ version {qc.get('version')!r} is not supported: mixgemm "
                              f"reads AutoAWQ's GEMM packing (version 'gemm')")
    default = LayerScheme(bits=config_int(qc, "bits", "w_bit"),
                          group_size=config_int(qc, "group_size", "q_group_size"))
    skip = qc.get("modules_to_not_convert") or []
    rules = tuple(Rule(str(s), "substring", LayerScheme(quantized=False)) for s in skip)
    return QuantizationConfig(Format.AWQ, raw, default, rules)


def import_tensors(get, tensors, prefix, *, dtype, bits, group_size, checkpoint_format, symmetric):
    """The layer ``prefix`` of a state dict (``get(suffix)``: its tensor), by :func:`from_awq`."""
    return from_awq(get("qweight"), get("qzeros"), get("scales"), group_size=group_size,
                    bits=4 if bits is None else bits, dtype=dtype, symmetric=symmetric, name=prefix)


def dequantize(tensors: Mapping, prefix: str, scheme: LayerScheme) -> torch.Tensor:
    """AutoAWQ's formula: ``w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]`` (4-bit GEMM
    packing), in the scales' dtype, ``[N, K]``."""
    if scheme.bits not in (None, 4):
        raise FormatError(f"layer {prefix!r}: AWQ GEMM packing holds 4-bit codes, the config says {scheme.bits}")
    qweight, qzeros, scales = (required_tensor(tensors, prefix, s) for s in ("qweight", "qzeros", "scales"))
    k, n, num_groups = qweight.shape[0], scales.shape[1], scales.shape[0]
    if qweight.shape[1] * 8 != n or tuple(qzeros.shape) != (num_groups, n // 8):
        raise FormatError(f"layer {prefix!r}: AWQ qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)} and "
                          f"scales {list(scales.shape)} do not fit together")
    inverse = torch.argsort(torch.tensor(_AWQ_ORDER))

    def unpack(t):   # [R, C] words -> [R, 8C] codes in column order
        return unpack_stream(t, 4, t.shape[1] * 8, 1).view(t.shape[0], -1, 8)[..., inverse].reshape(t.shape[0], -1)

    g = dequant_groups(k, num_groups, scheme.group_size, None, prefix)
    q, z = unpack(qweight), unpack(qzeros)[g]                         # [K, N]
    return ((q - z).to(scales.dtype) * scales[g]).t().contiguous()


def header_layer(prefix: str, tensors: dict, qconfig: QuantizationConfig, scheme: LayerScheme) -> HeaderLayer:
    """An AutoAWQ GEMM layer from its tensors' shapes: ``qweight`` ``[K, N/8]``, ``scales``
    ``[G, N]``; 4-bit, asymmetric unless the config's ``zero_point`` is false."""
    q = header_shape(tensors, f"{prefix}.qweight", 2)
    s = header_shape(tensors, f"{prefix}.scales", 2)
    n, groups = s[1], s[0]
    if q[1] * 8 != n:
        raise UserError(f"{prefix}: AWQ qweight {list(q)} with scales {list(s)} is not AutoAWQ GEMM ([K, N/8])")
    k = q[0]
    bits = scheme.bits if scheme.bits is not None else 4
    if bits != 4:
        raise UserError(f"{prefix}: AWQ GEMM layers are 4-bit, the config says {bits}")
    symmetric = not qconfig.raw.get("zero_point", True)
    return HeaderLayer(n, k, WeightType.of(4, symmetric), header_group(k, groups))
