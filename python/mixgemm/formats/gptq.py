"""GPTQ layers (AutoGPTQ / GPTQModel ``QuantLinear``, the packed "gptq" layout):
:func:`from_gptq` and the zero-point convention :class:`GPTQCheckpointFormat`, and the format's
rules: its ``quantization_config`` (:func:`parse_config`), a layer of a state dict
(:func:`import_tensors`), its own dequantization formula (:func:`dequantize`) and a layer from
safetensors headers (:func:`header_layer`)."""
from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, Optional, Union

import torch

from ..dtypes import WeightType
from ..errors import CheckpointError, FormatError, UserError
from .common import (shard_imported, WORD_BITS, DTypeLike, ImportedLayer, apply_groups, check_bits,
                     check_kernel_shape, check_tensor, dequant_groups, layer_error, finalize_layer, layer_dtype,
                     required_tensor, resolve_group_size, resolve_groups, unpack_stream, unpack_words)
from .registry import Format
from .rules import (HeaderLayer, LayerScheme, QuantizationConfig, Rule, SkipLayer, config_int, header_group,
                    header_shape, kernel_bits)

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


# ---------------------------------------------------------------------------------------------
# The format's rules (mixgemm.formats.handlers)
# ---------------------------------------------------------------------------------------------
def parse_config(qc: Mapping, raw: dict, where: str) -> QuantizationConfig:
    """A ``"gptq"`` ``quantization_config``: ``bits``, ``group_size``, ``checkpoint_format`` (or
    GPTQModel's ``format``), GPTQModel's ``dynamic`` per-module overrides."""
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    try:
        fmt = GPTQCheckpointFormat.parse(str(fmt)).value
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    default = LayerScheme(bits=config_int(qc, "bits"), group_size=config_int(qc, "group_size"),
                          checkpoint_format=fmt)
    rules = []
    for pattern, override in (qc.get("dynamic") or {}).items():
        pattern = str(pattern)
        if pattern.startswith("-:"):
            rules.append(Rule(pattern[2:], "regex", LayerScheme(quantized=False)))
            continue
        if pattern.startswith("+:"):
            pattern = pattern[2:]
        override = override if isinstance(override, Mapping) else {}
        bits = config_int(override, "bits")
        gs = config_int(override, "group_size")
        rules.append(Rule(pattern, "regex", dataclasses.replace(
            default, bits=default.bits if bits is None else bits,
            group_size=default.group_size if gs is None else gs)))
    return QuantizationConfig(Format.GPTQ, raw, default, tuple(rules))


def import_tensors(get, tensors, prefix, *, dtype, bits, group_size, checkpoint_format, symmetric):
    """The layer ``prefix`` of a state dict (``get(suffix)``: its tensor), by :func:`from_gptq`."""
    if checkpoint_format is None:
        raise layer_error(prefix, "GPTQ layers need checkpoint_format='gptq' (v1: zeros stored "
                           "minus one; also when quantize_config.json has no "
                           "checkpoint_format) or 'gptq_v2'")
    return from_gptq(get("qweight"), get("qzeros"), get("scales"), get("g_idx", False),
                     checkpoint_format=checkpoint_format, bits=bits, group_size=group_size, dtype=dtype,
                     symmetric=symmetric, name=prefix)


def dequantize(tensors: Mapping, prefix: str, scheme: LayerScheme) -> torch.Tensor:
    """GPTQ's formula: ``w[n, k] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])`` (2, 3, 4 and 8
    bits; v1 zero points stored minus one), in the scales' dtype, ``[N, K]``."""
    qweight, qzeros, scales = (required_tensor(tensors, prefix, s) for s in ("qweight", "qzeros", "scales"))
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
    q = unpack_stream(qweight, bits, k, 0)                            # [K, N]
    if scheme.checkpoint_format not in (None, GPTQCheckpointFormat.V1.value):
        z = unpack_stream(qzeros, bits, n, 1)                         # [G, N], v2: as stored
    elif bits in GPTQ_V1_OFFSET:
        # v1 stores z - 1: undone as GPTQModel undoes its own export (and as from_gptq does), by
        # adding 0x11111111 (4-bit) ... to each word, so a zero point of 0 (stored as all ones,
        # with a borrow from the next field) reads back as 0 and its neighbour as itself.
        z = unpack_stream((qzeros.to(torch.int64) + GPTQ_V1_OFFSET[bits]) & 0xFFFFFFFF, bits, n, 1)
    else:
        # 3-bit fields straddle words: GPTQModel shifts each field by one, modulo 8.
        z = (unpack_stream(qzeros, bits, n, 1) + 1) & ((1 << bits) - 1)
    g = dequant_groups(k, num_groups, scheme.group_size, g_idx, prefix)
    return ((q - z[g]).to(scales.dtype) * scales[g]).t().contiguous()


def header_layer(prefix: str, tensors: dict, qconfig: QuantizationConfig, scheme: LayerScheme) -> HeaderLayer:
    """A GPTQ layer from its tensors' shapes: ``qweight`` ``[K * bits / 32, N]``, ``scales``
    ``[G, N]``; the layer's ``bits`` (else from ``qzeros``), the config's ``sym`` (default true)."""
    q = header_shape(tensors, f"{prefix}.qweight", 2)
    s = header_shape(tensors, f"{prefix}.scales", 2)
    n, groups = s[1], s[0]
    if q[1] != n:
        raise UserError(f"{prefix}: GPTQ qweight {list(q)} with scales {list(s)} is not [K*bits/32, N]")
    bits = scheme.bits
    if bits is None:
        z = header_shape(tensors, f"{prefix}.qzeros", 2)
        bits = z[1] * 32 // n
    if 32 % bits:
        raise SkipLayer(f"{bits}-bit codes")
    k = q[0] * 32 // bits
    kernel_bits(bits)
    symmetric = bool(qconfig.raw.get("sym", True))
    return HeaderLayer(n, k, WeightType.of(bits, symmetric), header_group(k, groups))
