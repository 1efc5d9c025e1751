r"""Importers for third-party quantized checkpoints: AutoAWQ, GPTQ, compressed-tensors, HQQ.

Each converter turns one layer of a source format into mixgemm's logical
:class:`~mixgemm.types.QuantizedWeight` **without re-quantizing**: the integer codes, scales
and zero points are carried over as they are; only their packing and, where necessary, their
sign convention change. mixgemm dequantizes::

    symmetric:   w[n, k] = q[n, k] * s[n, g]                 q signed,   [-2^(b-1), 2^(b-1)-1]
    asymmetric:  w[n, k] = (q[n, k] - z[n, g]) * s[n, g]     q unsigned, [0, 2^b-1], z integer

in the activation dtype (bf16 or fp16), with ``g = k // group_size``. Every source format
covered here has the same shape of formula, ``(q - z) * s`` with integer ``q`` and ``z``, so
the conversion is exact, and so is the dequantized weight:

Bit-exactness
-------------
With ``dtype`` equal to the dtype the checkpoint stores its scales in (the default), the
weight that :func:`mixgemm.dequantize_reference` computes from an imported layer equals the
source format's own dequantization formula, evaluated in that dtype, **bit for bit**: both
sides form the exact integer ``q - z`` (``|q - z| <= 255`` is exact in bf16 and fp16), and
round its product with the scale to nearest-even once. The one exception, per converter
below, is HQQ with fractional zero points: imported with an integer zero point plus a float32
offset per (row, group), within 2 ulp of ``2^b * |scale|`` of HQQ's formula (see
:func:`from_hqq`).

If ``dtype`` differs from the checkpoint's scale dtype, the scales are first rounded to
``dtype`` (to nearest-even). That is exact when they are representable in it: bf16 scales in
``[2^-17, 65280]`` always are in fp16; fp16 scales are in bf16 only when they have at most 8
significant bits. The result is then ``fl((q - z) * fl(s))``, within a relative ``2u + u^2``
of the exact ``(q - z) * s`` (``u = 2^-8`` for bf16, ``2^-11`` for fp16) while nothing under-
or overflows; the source evaluated in its own dtype is within ``u_src`` of the exact value, so
the two differ by at most ``(2u + u^2 + u_src) * |(q - z) * s|`` (for an fp16 checkpoint
imported as bf16: ``(2^-7 + 2^-16 + 2^-11) * |w|``, about 0.84%).

Symmetric or asymmetric
-----------------------
Several formats always store a zero point (GPTQ with ``sym=True`` stores ``z = 2^(b-1)``).
A layer whose zero points all equal ``2^(b-1)`` (in the unsigned convention) is exactly the
symmetric layer with codes ``q - 2^(b-1)``; ``symmetric=None`` (the default of every converter)
picks the symmetric, zero-free representation then (its kernels skip the zero point) and the
asymmetric one otherwise; ``True`` insists on it (and refuses other zero points), ``False``
keeps zero points (adding ``2^(b-1)`` ones where the source has none). All three are exact.

Act-order (GPTQ ``desc_act``, compressed-tensors ``actorder="group"``)
----------------------------------------------------------------------
mixgemm's groups are runs of ``group_size`` consecutive K elements. A ``g_idx`` that assigns
the K columns to groups in another order is handled exactly by a permutation of K: the
converter returns ``perm`` (int64 ``[K]``) and the weight's columns in the order
``W_mixgemm[:, j] = W_source[:, perm[j]]``, so that ``x[..., perm] @ W_mixgemm.T ==
x @ W_source.T``. **The caller must apply ``x[..., perm]`` to the activations** (or fold
``perm`` into the previous layer); :meth:`ImportedLayer.permute_input` does it. When the
groups are already contiguous (only their labels out of order), the scales are reordered
instead and ``perm`` is ``None``. A ``g_idx`` whose groups are not all of the same size cannot
be made contiguous groups of equal size and is refused.

Tensor parallelism
------------------
Every converter (and :func:`import_layer`) takes ``tp_rank``, ``tp_size`` and ``tp_dim``: with
``tp_size > 1`` it returns the rank's shard of the layer (:meth:`ImportedLayer.shard`): rows
``tp_rank * N/tp_size ..`` for ``tp_dim=0`` (column parallel, whole 16-row atoms; ``tp_sections``
slices a fused q/k/v layer section by section), columns ``tp_rank * K/tp_size ..`` for
``tp_dim=1`` (row parallel, whole 64-column atoms and whole groups). The whole layer is
converted on the CPU first (its codes are cut only after unpacking), then only the slice is
kept; nothing is re-quantized, and the shard equals the same slice of the whole layer's import.
A split the layer cannot take raises :class:`~mixgemm.errors.ShardError`.

Errors
------
Tensors that do not form a valid layer (missing companions, wrong shapes or dtypes, bits that
contradict the shapes, N not a multiple of 16 or K of 64, ...) raise :class:`FormatError`, a
``ValueError`` naming the layer. Valid source layers that mixgemm cannot represent exactly
(HQQ ``axis=0``, 3-bit codes, ...) raise
:class:`UnsupportedLayerError`, which is both a ``FormatError`` and a ``NotImplementedError``.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .errors import FormatError, ShardError, UnsupportedLayerError
from .layout import ATOM_K, ATOM_N, prepack
from .types import SUPPORTED_GROUP_SIZES, ActType, PackedWeight, QuantizedWeight

__all__ = [
    "Format", "GPTQCheckpointFormat", "FormatError", "UnsupportedLayerError", "ImportedLayer",
    "from_awq", "from_gptq", "from_compressed_tensors", "from_hqq",
    "detect_format", "import_layer", "import_checkpoint",
]

DTypeLike = Union[torch.dtype, ActType, str, None]

_WORD_BITS = 32


class Format(str, enum.Enum):
    """Checkpoint formats :func:`import_layer` and :func:`import_checkpoint` read."""

    #: AutoAWQ ``version="GEMM"`` layers: ``qweight``, ``qzeros``, ``scales``.
    AWQ = "awq"
    #: GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` "gptq" or "gptq_v2"): ``qweight``,
    #: ``qzeros``, ``scales``, ``g_idx``.
    GPTQ = "gptq"
    #: compressed-tensors ``format="pack-quantized"``: ``weight_packed``, ``weight_scale``,
    #: ``weight_shape``, optional ``weight_zero_point`` and ``weight_g_idx``.
    COMPRESSED_TENSORS = "compressed-tensors"
    #: HQQ ``HQQLinear`` state dicts: ``W_q``, ``scale``, ``zero`` and the meta entries.
    HQQ = "hqq"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "Format | str") -> "Format":
        """A :class:`Format` from itself or a name (case-insensitive; ``"autoawq"``,
        ``"pack-quantized"``, ``"compressed_tensors"`` and ``"ct"`` are accepted too)."""
        if isinstance(value, Format):
            return value
        aliases = {"awq": cls.AWQ, "autoawq": cls.AWQ, "awq-gemm": cls.AWQ, "gptq": cls.GPTQ,
                   "compressed-tensors": cls.COMPRESSED_TENSORS,
                   "compressed_tensors": cls.COMPRESSED_TENSORS,
                   "pack-quantized": cls.COMPRESSED_TENSORS, "ct": cls.COMPRESSED_TENSORS,
                   "hqq": cls.HQQ}
        try:
            return aliases[str(value).lower()]
        except KeyError:
            raise ValueError(f"unknown checkpoint format {value!r}; use one of "
                             f"{[f.value for f in cls]}") from None


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


@dataclasses.dataclass(frozen=True, eq=False)
class ImportedLayer:
    """One converted layer.

    Attributes
    ----------
    qweight : QuantizedWeight
        The weight, ``[N, K]`` (out_features, in_features), with its columns in the order of
        ``perm`` when ``perm`` is set.
    perm : torch.Tensor or None
        int64 ``[K]``, only for act-order layers whose groups are not contiguous: the layer
        computes ``x[..., perm] @ W^T``, i.e. **the activations must be permuted with
        ``x[..., perm]`` before the GEMM** (:meth:`permute_input`). ``None``: no permutation.
    bias : torch.Tensor or None
        The layer's bias ``[N]`` as stored in the checkpoint (unchanged), if any.
    """

    qweight: QuantizedWeight
    perm: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None

    def permute_input(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x[..., perm]`` (``x`` itself when there is no permutation).

        Parameters
        ----------
        x : torch.Tensor
            Activations ``[..., K]``, any dtype and device.
        """
        if self.perm is None:
            return x
        return x.index_select(-1, self.perm.to(x.device))

    def shard(self, dim: int, rank: int, world_size: int, sections=None, name: str = "<layer>") -> "ImportedLayer":
        """The ``rank``-th of ``world_size`` tensor-parallel shards of this layer.

        Parameters
        ----------
        dim : int
            0: output rows (column parallel); the bias is sliced the same way and ``perm``
            (which selects input columns) is kept whole. 1: input columns (row parallel); the
            bias is kept whole (a row-parallel layer adds it once, after the all-reduce) and
            ``perm``, if any, keeps the rank's entries (indices into the *whole* input:
            :class:`mixgemm.nn.RowParallelQuantLinear` with ``input_is_parallel=False``).
        rank, world_size : int
        sections : sequence of int, optional
            ``dim=0``: the rows of a fused layer's sections (e.g. ``(q, k, v)``), each sliced
            on its own (:func:`mixgemm.layout.shard`).
        name : str
            For error messages.

        Returns
        -------
        ImportedLayer
            ``qweight`` ``[N/W, K]`` or ``[N, K/W]`` (:meth:`QuantizedWeight.shard`); ``self``
            when ``world_size == 1``.

        Raises
        ------
        ShardError
            The split cuts an atom or a group, or ``sections`` do not divide.
        """
        if world_size == 1 and rank == 0:
            return self
        try:
            qw = self.qweight.shard(dim, rank, world_size, sections)
        except ValueError as e:
            raise ShardError(f"layer {name!r}: tensor-parallel split {rank}/{world_size} along "
                             f"{'N (rows)' if dim % 2 == 0 else 'K (columns)'}: {e}") from None
        if dim % 2 == 0:
            bias, perm = self.bias, self.perm
            if bias is not None:
                secs = tuple(sections) if sections is not None else (bias.shape[0],)
                parts, start = [], 0
                for s in secs:
                    part = s // world_size
                    parts.append(bias[start + rank * part:start + (rank + 1) * part])
                    start += s
                bias = torch.cat(parts)
        else:
            bias, perm = self.bias, self.perm
            if perm is not None:
                perm = perm[rank * qw.k:(rank + 1) * qw.k].clone()
        return ImportedLayer(qweight=qw, perm=perm, bias=bias)


def _shard_imported(layer: "ImportedLayer", name: str, tp_rank: int, tp_size: int, tp_dim: int,
                    tp_sections=None) -> "ImportedLayer":
    """The converters' last step: the rank's shard (the layer itself at ``tp_size == 1``)."""
    for what, v in (("tp_rank", tp_rank), ("tp_size", tp_size), ("tp_dim", tp_dim)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{what} must be an int, got {v!r}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    if tp_dim not in (0, 1):
        raise ValueError(f"tp_dim must be 0 (N, column parallel) or 1 (K, row parallel), got {tp_dim}")
    if tp_size == 1:
        return layer
    return layer.shard(tp_dim, tp_rank, tp_size, tp_sections, name=name)


# ------------------------------------------------------------------------------ helpers


def _err(name: str, msg: str, cls: type = FormatError) -> FormatError:
    return cls(f"layer {name!r}: {msg}")


def _key(prefix: str, suffix: str) -> str:
    return f"{prefix}.{suffix}" if prefix else suffix


def _check_tensor(name: str, what: str, t: Any, ndim: Optional[int] = None,
                  dtypes: Optional[Tuple[torch.dtype, ...]] = None,
                  floating: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _err(name, f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise _err(name, f"{what} must be {ndim}-D, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise _err(name, f"{what} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if floating and not t.is_floating_point():
        raise _err(name, f"{what} must be a floating-point tensor, got {t.dtype}")
    return t


def _check_kernel_shape(name: str, n: int, k: int, group_size: Optional[int] = None) -> None:
    """The kernels' constraints, as UnsupportedLayerError (a FormatError / ValueError);
    ``group_size=None`` checks N and K only."""
    if n <= 0 or k <= 0 or n % ATOM_N or k % ATOM_K:
        raise _err(name, f"mixgemm's kernels need N (out_features) % {ATOM_N} == 0 and K "
                         f"(in_features) % {ATOM_K} == 0, got N={n}, K={k}",
                   UnsupportedLayerError)
    if group_size is None:
        return
    if group_size != k and group_size not in SUPPORTED_GROUP_SIZES:
        raise _err(name, f"group size {group_size} is not supported: mixgemm's kernels take "
                         f"{SUPPORTED_GROUP_SIZES} or K={k} (per-channel)", UnsupportedLayerError)
    if k % group_size:
        raise _err(name, f"K={k} is not a multiple of group size {group_size}: mixgemm needs "
                         f"groups of equal size", UnsupportedLayerError)


def _resolve_group_size(name: str, k: int, num_groups: int, group_size: Optional[int]) -> int:
    """group size from the number of groups, checked against the caller's (``-1`` or
    ``None`` from the caller: per-channel / infer)."""
    if num_groups <= 0:
        raise _err(name, f"the scales have {num_groups} groups")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
        if group_size == -1:
            gs = k
        elif group_size > 0:
            gs = group_size
        else:
            raise ValueError(f"group_size must be positive, or -1 for per-channel, got "
                             f"{group_size}")
        want = -(-k // gs)
        if want != num_groups:
            raise _err(name, f"group_size={group_size} means {want} groups for K={k}, but the "
                             f"scales have {num_groups}")
        if k % gs:
            raise _err(name, f"K={k} is not a multiple of group_size={gs}: the last group is "
                             f"shorter, and mixgemm needs groups of equal size",
                       UnsupportedLayerError)
        return gs
    if k % num_groups:
        raise _err(name, f"K={k} is not a multiple of the number of groups ({num_groups}) in "
                         f"the scales: groups of unequal size are not supported",
                   UnsupportedLayerError)
    return k // num_groups


def _resolve_dtype(name: str, dtype: DTypeLike, scale_dtype: torch.dtype,
                   fallback: Optional[torch.dtype] = None) -> torch.dtype:
    if dtype is None:
        for cand in (scale_dtype, fallback):
            if cand in (torch.bfloat16, torch.float16):
                return cand
        raise _err(name, f"the checkpoint's scales are {scale_dtype}; pass dtype=torch.bfloat16 "
                         f"or torch.float16 (the activation dtype; the scales are rounded to it)")
    try:
        return ActType.parse(dtype).torch_dtype
    except (TypeError, ValueError) as e:
        raise ValueError(f"dtype (the activation dtype) must be bf16 or fp16: {e}") from None


def _check_bits(name: str, bits: Any, fmt: str, allowed: Tuple[int, ...] = (8, 4, 2)) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    if bits not in allowed:
        raise _err(name, f"{bits}-bit {fmt} layers are not supported (mixgemm imports "
                         f"{'/'.join(map(str, allowed))}-bit ones)", UnsupportedLayerError)
    return bits


def _unpack_words(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split 32-bit words into ``32 // bits`` codes, code ``j`` from bits ``[bits*j,
    bits*(j+1))`` (little endian), placed consecutively along ``dim``.

    ``packed`` is int32 (or int64 holding 32-bit words); the result is uint8 with
    ``packed.shape[dim] * 32 // bits`` entries along ``dim``.
    """
    shifts = torch.arange(0, _WORD_BITS, bits, dtype=packed.dtype, device=packed.device)
    x = packed.movedim(dim, -1)
    # Arithmetic shifts of negative int32 words shift in ones; the mask keeps only the code.
    codes = ((x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    return codes.flatten(-2).movedim(-1, dim).contiguous()


def _resolve_groups(name: str, g_idx: Optional[torch.Tensor], k: int, num_groups: int
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Turn a ``g_idx`` into ``(perm, labels)``.

    ``perm`` (int64 ``[K]``): the K permutation that makes the groups contiguous (sorted by
    group, stable), or None. ``labels`` (int64 ``[G]``): when the groups are already
    contiguous but not in order, the source group of each contiguous block (reorder the
    scales' columns with it), or None.
    """
    if g_idx is None:
        return None, None
    _check_tensor(name, "g_idx", g_idx, ndim=1)
    if g_idx.is_floating_point() or g_idx.is_complex() or g_idx.dtype == torch.bool:
        raise _err(name, f"g_idx must be an integer tensor, got {g_idx.dtype}")
    if g_idx.shape[0] != k:
        raise _err(name, f"g_idx has {g_idx.shape[0]} entries, but K (in_features) is {k}")
    g = g_idx.to(torch.int64)
    lo, hi = int(g.min()), int(g.max())
    if lo < 0 or hi >= num_groups:
        raise _err(name, f"g_idx values must lie in [0, {num_groups}) (the scales have "
                         f"{num_groups} groups), got [{lo}, {hi}]")
    counts = torch.bincount(g, minlength=num_groups)
    if k % num_groups or not bool((counts == k // num_groups).all()):
        raise _err(name, f"g_idx assigns groups of unequal sizes (between {int(counts.min())} "
                         f"and {int(counts.max())} of K={k} columns in {num_groups} groups); "
                         f"they cannot be permuted into contiguous groups of equal size",
                   UnsupportedLayerError)
    gs = k // num_groups
    blocks = g.view(num_groups, gs)
    if bool((blocks == blocks[:, :1]).all()):
        labels = blocks[:, 0].contiguous()
        if torch.equal(labels, torch.arange(num_groups, device=labels.device)):
            return None, None
        return None, labels
    return torch.argsort(g, stable=True), None


def _finalize(name: str, q_u: torch.Tensor, z_u: Optional[torch.Tensor], scales: torch.Tensor,
              *, bits: int, group_size: int, symmetric: Optional[bool], act: torch.dtype
              ) -> QuantizedWeight:
    """Build the QuantizedWeight from unsigned codes ``q_u`` (uint8 ``[N, K]``, in
    ``[0, 2^b-1]``), unsigned integer zero points ``z_u`` (``[N, G]``, any integer dtype, in
    ``[0, 2^b-1]``; ``None``: all ``2^(b-1)``, i.e. symmetric) and scales ``[N, G]``."""
    if symmetric is not None and not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be True, False or None, got {symmetric!r}")
    mid = 1 << (bits - 1)
    all_mid = z_u is None or bool((z_u == mid).all())
    sym = all_mid if symmetric is None else symmetric
    if sym and not all_mid:
        bad = int((z_u != mid).sum())
        raise _err(name, f"symmetric=True, but {bad} of its {z_u.numel()} zero points differ "
                         f"from 2^(b-1) = {mid}: the layer is asymmetric (use symmetric=None "
                         f"or False)")
    s = scales.to(act)
    if not bool(torch.isfinite(s).all()):
        raise _err(name, f"the scales are not all finite in {act} (converted from "
                         f"{scales.dtype}); use dtype=torch.bfloat16 if they overflow fp16")
    if sym:
        q = (q_u.to(torch.int16) - mid).to(torch.int8)
        zeros = None
    else:
        q = q_u.to(torch.uint8)
        zeros = torch.full_like(s, mid) if z_u is None else z_u.to(act)
    try:
        return QuantizedWeight(qweight=q.contiguous(), scales=s.contiguous(),
                               zeros=None if zeros is None else zeros.contiguous(), bits=bits,
                               group_size=group_size, symmetric=sym)
    except (TypeError, ValueError) as e:  # pragma: no cover - guarded by the checks above
        raise _err(name, str(e)) from e


def _apply_groups(q_u: torch.Tensor, z_u: Optional[torch.Tensor], scales: torch.Tensor,
                  perm: Optional[torch.Tensor], labels: Optional[torch.Tensor]):
    if perm is not None:
        q_u = q_u.index_select(1, perm.to(q_u.device))
    if labels is not None:
        scales = scales.index_select(1, labels.to(scales.device))
        if z_u is not None:
            z_u = z_u.index_select(1, labels.to(z_u.device))
    return q_u, z_u, scales


# --------------------------------------------------------------------------------- AWQ

#: AutoAWQ's nibble order: nibble ``i`` (bits ``4i..4i+3``) of a packed word holds output
#: column ``8*c + _AWQ_ORDER[i]`` of word column ``c``.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` in AWQ order -> uint8 ``[R, 8C]`` in natural column order."""
    r, c = packed.shape
    nibbles = _unpack_words(packed, 4, dim=1).view(r, c, 8)  # in storage (nibble) order
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
    _check_bits(name, bits, "AWQ GEMM", (4,))
    _check_tensor(name, "qweight", qweight, 2, (torch.int32,))
    _check_tensor(name, "qzeros", qzeros, 2, (torch.int32,))
    _check_tensor(name, "scales", scales, 2, floating=True)
    k, n = qweight.shape[0], scales.shape[1]
    if qweight.shape[1] * 8 != n:
        raise _err(name, f"AWQ GEMM qweight must be [K, N/8] with N={n} from scales "
                         f"{list(scales.shape)}, got {list(qweight.shape)}")
    num_groups = scales.shape[0]
    if tuple(qzeros.shape) != (num_groups, n // 8):
        raise _err(name, f"qzeros must be [K/g, N/8] = {[num_groups, n // 8]} to match scales "
                         f"{list(scales.shape)}, got {list(qzeros.shape)}")
    gs = _resolve_group_size(name, k, num_groups, group_size)
    _check_kernel_shape(name, n, k, gs)
    act = _resolve_dtype(name, dtype, scales.dtype)
    q_u = _awq_unpack(qweight).t()           # [N, K]
    z_u = _awq_unpack(qzeros).t()            # [N, G]
    qw = _finalize(name, q_u, z_u, scales.t(), bits=4, group_size=gs, symmetric=symmetric,
                   act=act)
    return _shard_imported(ImportedLayer(qweight=qw), name, tp_rank, tp_size, tp_dim)


# -------------------------------------------------------------------------------- GPTQ

#: Adding this to a packed int32 zero word adds 1 to every packed zero point (with carries),
#: GPTQModel's v1 -> v2 conversion (``convert_gptq_v1_to_v2_format_module``).
_GPTQ_V1_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


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
    _check_tensor(name, "qweight", qweight, 2, (torch.int32,))
    _check_tensor(name, "qzeros", qzeros, 2, (torch.int32,))
    _check_tensor(name, "scales", scales, 2, floating=True)
    num_groups, n = scales.shape
    if qweight.shape[1] != n:
        raise _err(name, f"GPTQ qweight must be [K*bits/32, N] with N={n} from scales "
                         f"{list(scales.shape)}, got {list(qweight.shape)}")
    if qzeros.shape[0] != num_groups:
        raise _err(name, f"qzeros has {qzeros.shape[0]} groups, scales {num_groups}")
    zbits, rem = divmod(qzeros.shape[1] * _WORD_BITS, n)
    if bits is None:
        if rem:
            raise _err(name, f"qzeros {list(qzeros.shape)} does not pack N={n} zero points "
                             f"into whole int32 words")
        bits = zbits
    elif rem or zbits != bits:
        raise _err(name, f"bits={bits} does not match qzeros {list(qzeros.shape)}: "
                         f"{bits}-bit zeros for N={n} need [G, {n * bits // _WORD_BITS}]")
    _check_bits(name, bits, "GPTQ")
    k = qweight.shape[0] * _WORD_BITS // bits
    gs = _resolve_group_size(name, k, num_groups, group_size)
    _check_kernel_shape(name, n, k, gs)
    act = _resolve_dtype(name, dtype, scales.dtype)
    perm, labels = _resolve_groups(name, g_idx, k, num_groups)

    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    if fmt is GPTQCheckpointFormat.V1:
        words = (words + _GPTQ_V1_OFFSET[bits]) & 0xFFFFFFFF
    z_u = _unpack_words(words, bits, dim=1).t()          # [N, G]
    q_u = _unpack_words(qweight, bits, dim=0).t()         # [N, K]
    q_u, z_u, s = _apply_groups(q_u, z_u, scales.t(), perm, labels)
    qw = _finalize(name, q_u, z_u, s, bits=bits, group_size=gs, symmetric=symmetric, act=act)
    return _shard_imported(ImportedLayer(qweight=qw, perm=perm), name, tp_rank, tp_size, tp_dim)


# ------------------------------------------------------------------ compressed-tensors


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
        Other bit widths; the "tensor" strategy (a scalar scale).
    """
    _check_tensor(name, "weight_packed", weight_packed, 2, (torch.int32,))
    _check_tensor(name, "weight_scale", weight_scale, floating=True)
    n, words = weight_packed.shape
    if weight_shape is not None:
        shape = [int(v) for v in (weight_shape.flatten().tolist()
                                  if isinstance(weight_shape, torch.Tensor) else weight_shape)]
        if len(shape) != 2:
            raise _err(name, f"weight_shape must hold [N, K], got {shape}")
        if shape[0] != n:
            raise _err(name, f"weight_shape {shape} does not match weight_packed "
                             f"{list(weight_packed.shape)} (N)")
        k = shape[1]
        _check_kernel_shape(name, n, k)
        inferred, rem = divmod(words * _WORD_BITS, k)
        if bits is None:
            if rem:
                raise _err(name, f"weight_packed {list(weight_packed.shape)} does not hold "
                                 f"K={k} codes of a whole number of bits")
            bits = inferred
        elif -(-k * bits // _WORD_BITS) != words:
            raise _err(name, f"bits={bits} does not match weight_packed "
                             f"{list(weight_packed.shape)} for K={k}: need "
                             f"{-(-k * bits // _WORD_BITS)} int32 words per row")
    elif bits is None:
        raise _err(name, "pass weight_shape (or bits) to size the weight")
    else:
        k = words * _WORD_BITS // bits
    _check_bits(name, bits, "compressed-tensors")
    if weight_scale.dim() != 2:
        if weight_scale.numel() == 1:
            raise _err(name, "a scalar weight_scale (the 'tensor' strategy) is not supported; "
                             "only 'group' and 'channel'", UnsupportedLayerError)
        raise _err(name, f"weight_scale must be [N, G], got {list(weight_scale.shape)}")
    if weight_scale.shape[0] != n:
        raise _err(name, f"weight_scale {list(weight_scale.shape)} does not match N={n}")
    num_groups = weight_scale.shape[1]
    gs = _resolve_group_size(name, k, num_groups, group_size)
    _check_kernel_shape(name, n, k, gs)
    act = _resolve_dtype(name, dtype, weight_scale.dtype)
    if weight_g_idx is not None and isinstance(weight_g_idx, torch.Tensor) \
            and bool((weight_g_idx == -1).any()):
        weight_g_idx = None
    perm, labels = _resolve_groups(name, weight_g_idx, k, num_groups)

    offset = 1 << (bits - 1)
    z_u = None
    if weight_zero_point is not None:
        zp = _check_tensor(name, "weight_zero_point", weight_zero_point, 2)
        packed_rows = n * bits // _WORD_BITS
        if zp.dtype == torch.int32 and tuple(zp.shape) == (packed_rows, num_groups) \
                and packed_rows != n:
            z_u = _unpack_words(zp, bits, dim=0)              # [N, G], already offset
        elif tuple(zp.shape) == (n, num_groups):
            zf = zp.to(torch.float64)
            if not bool((zf == zf.round()).all()) or int(zf.min()) < -offset \
                    or int(zf.max()) > offset - 1:
                raise _err(name, f"weight_zero_point values must be integers in "
                                 f"[{-offset}, {offset - 1}]")
            z_u = (zp.to(torch.int16) + offset)
        else:
            raise _err(name, f"weight_zero_point must be int32 [{packed_rows}, {num_groups}] "
                             f"(packed along N) or [{n}, {num_groups}], got {zp.dtype} "
                             f"{list(zp.shape)}")
    q_u = _unpack_words(weight_packed, bits, dim=1)[:, :k]     # [N, K], q + offset
    q_u, z_u, s = _apply_groups(q_u, z_u, weight_scale, perm, labels)
    qw = _finalize(name, q_u, z_u, s, bits=bits, group_size=gs, symmetric=symmetric, act=act)
    return _shard_imported(ImportedLayer(qweight=qw, perm=perm), name, tp_rank, tp_size, tp_dim)


# --------------------------------------------------------------------------------- HQQ

#: HQQ's packing names for the widths mixgemm imports (``Quantizer.bit_to_packing``).
_HQQ_PACKING = {8: "8bit_u8", 4: "4bit_u8", 2: "2bit_u8"}
#: Meta entries an HQQLinear state dict holds next to ``W_q`` (``state_dict_keys``).
_HQQ_META_KEYS = ("nbits", "group_size", "shape", "axis", "packing", "unpack_view_dtype",
                  "view_as_float", "compute_dtype", "channel_wise", "optimize", "round_zero",
                  "quant_scale", "quant_zero", "offload_meta", "encoded_state_dict",
                  "stores_quant_config", "zero_scale", "meta_zero", "meta_scale")
_MISSING = object()


def _meta_scalar(name: str, meta: Mapping, key: str, default: Any = _MISSING) -> Any:
    value = meta.get(key, default)
    if value is _MISSING:
        raise _err(name, f"HQQ meta entry {key!r} is missing")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise _err(name, f"HQQ meta entry {key!r} must hold one value, got shape "
                             f"{list(value.shape)}")
        value = value.item()
    return value


def _meta_str(name: str, meta: Mapping, key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, torch.Tensor):  # encode_safetensor_type: uint8 character codes
        if value.dim() != 1 or value.is_floating_point():
            raise _err(name, f"HQQ meta entry {key!r} must be a string or a 1-D tensor of "
                             f"character codes, got {value.dtype} {list(value.shape)}")
        value = "".join(map(chr, value.tolist()))
    return value


def _hqq_meta_from(tensors: Mapping, prefix: str) -> Dict[str, Any]:
    return {key: tensors[_key(prefix, key)] for key in _HQQ_META_KEYS
            if _key(prefix, key) in tensors}


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
            raise _err(name, f"HQQ layers with {flag}=True (quantized meta data) are not "
                             f"supported", UnsupportedLayerError)
    for key in ("zero_scale", "meta_zero", "meta_scale"):
        if key in meta:
            raise _err(name, f"HQQ layers with quantized scale/zero ({key!r}) are not "
                             f"supported", UnsupportedLayerError)
    nbits = _meta_scalar(name, meta, "nbits")
    if isinstance(nbits, float):
        if not nbits.is_integer():
            raise _err(name, f"{nbits:g}-bit HQQ layers are not supported (mixgemm imports 8, 4 "
                             f"and 2-bit ones)", UnsupportedLayerError)
        nbits = int(nbits)
    bits = _check_bits(name, nbits, "HQQ")
    axis = int(_meta_scalar(name, meta, "axis"))
    if axis != 1:
        raise _err(name, f"HQQ axis={axis} is not supported: mixgemm's groups run along K "
                         f"(in_features), which is HQQ's axis=1; axis=0 groups mix rows of "
                         f"the weight", UnsupportedLayerError)
    if "channel_wise" in meta and not bool(_meta_scalar(name, meta, "channel_wise")):
        raise _err(name, "HQQ channel_wise=False (one scale for the whole tensor) is not "
                         "supported", UnsupportedLayerError)
    shape_v = meta.get("shape")
    if shape_v is None:
        raise _err(name, "HQQ meta entry 'shape' is missing")
    shape = [int(v) for v in (shape_v.flatten().tolist() if isinstance(shape_v, torch.Tensor)
                              else shape_v)]
    if len(shape) != 2:
        raise _err(name, f"HQQ shape must be [N, K], got {shape}")
    n, k = shape
    gs_v = _meta_scalar(name, meta, "group_size", None)
    gs = k if gs_v is None else int(gs_v)
    packing = _meta_str(name, meta, "packing", None) or _HQQ_PACKING[bits]
    if packing != _HQQ_PACKING[bits]:
        raise _err(name, f"HQQ packing {packing!r} does not match nbits={bits} (expected "
                         f"{_HQQ_PACKING[bits]!r})")
    _check_kernel_shape(name, n, k, gs)

    _check_tensor(name, "W_q", W_q, 2)
    if W_q.dtype != torch.uint8:
        if W_q.is_floating_point():  # view_as_float: the packed bytes viewed as floats
            W_q = W_q.contiguous().view(torch.uint8)
        else:
            raise _err(name, f"W_q must be uint8 (or a float view of it), got {W_q.dtype}")
    rows = n * k // gs
    per = 8 // bits
    if tuple(W_q.shape) != (rows // per, gs):
        raise _err(name, f"W_q must be [N*K/g / {per}, g] = {[rows // per, gs]} for shape "
                         f"{shape}, group_size={gs}, nbits={bits}; got {list(W_q.shape)}")
    for what, t in (("scale", scale), ("zero", zero)):
        _check_tensor(name, what, t, floating=True)
        if t.numel() != rows:
            raise _err(name, f"{what} must have N*K/g = {rows} elements, got {list(t.shape)}")
    compute = _meta_str(name, meta, "compute_dtype", None)
    fallback = {"torch.float16": torch.float16, "torch.bfloat16": torch.bfloat16}.get(
        compute if isinstance(compute, str) else str(compute))
    act = _resolve_dtype(name, dtype, scale.dtype, fallback)

    z = zero.reshape(n, k // gs)
    if not bool(torch.isfinite(z).all()):
        raise _err(name, "zero has non-finite values")
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
        raise _err(name, "symmetric=True, but the zero points are fractional")
    qw = _finalize(name, q_u, z_int.to(torch.int16), s, bits=bits, group_size=gs,
                   symmetric=False if fractional else symmetric, act=act)
    if offsets is not None:
        qw = dataclasses.replace(qw, zero_offsets=offsets)
    return _shard_imported(ImportedLayer(qweight=qw), name, tp_rank, tp_size, tp_dim)


# ------------------------------------------------------------------- state dict level

#: The tensor that marks a layer of each format, and the companions a layer may have.
_PRIMARY = {Format.AWQ: "qweight", Format.GPTQ: "qweight",
            Format.COMPRESSED_TENSORS: "weight_packed", Format.HQQ: "W_q"}
_COMPANIONS = {
    Format.AWQ: ("qweight", "qzeros", "scales"),
    Format.GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
    Format.COMPRESSED_TENSORS: ("weight_packed", "weight_scale", "weight_shape",
                                "weight_zero_point", "weight_g_idx"),
    Format.HQQ: ("W_q", "scale", "zero") + _HQQ_META_KEYS,
}
#: Names that only occur next to a format's primary tensor: seen alone, they are an error.
_ORPHANS = {
    Format.AWQ: ("qzeros", "scales", "g_idx"),
    Format.GPTQ: ("qzeros", "scales", "g_idx"),
    Format.COMPRESSED_TENSORS: ("weight_scale", "weight_zero_point", "weight_shape",
                                "weight_g_idx"),
    Format.HQQ: ("nbits", "packing", "unpack_view_dtype", "encoded_state_dict",
                 "stores_quant_config"),
}


def detect_format(tensors: Mapping[str, torch.Tensor], prefix: str) -> Format:
    """Which format the layer ``prefix`` of a state dict is stored in.

    Parameters
    ----------
    tensors : Mapping[str, torch.Tensor]
        A state dict (e.g. from ``safetensors.torch.load_file``).
    prefix : str
        The layer's name, e.g. ``"model.layers.0.mlp.down_proj"`` (``""``: no prefix).

    Returns
    -------
    Format
        (a ``str`` enum): ``HQQ`` if ``<prefix>.W_q`` exists, ``COMPRESSED_TENSORS`` for
        ``<prefix>.weight_packed``, and for ``<prefix>.qweight`` ``GPTQ`` if it is
        ``[K*bits/32, N]`` (N from ``<prefix>.scales``), ``AWQ`` if it is ``[K, N/8]``.

    Raises
    ------
    FormatError
        No quantized weight under ``prefix``, or a ``qweight`` whose shape fits neither.
    """
    if _key(prefix, "W_q") in tensors:
        return Format.HQQ
    if _key(prefix, "weight_packed") in tensors:
        return Format.COMPRESSED_TENSORS
    qkey = _key(prefix, "qweight")
    if qkey in tensors:
        skey = _key(prefix, "scales")
        if skey not in tensors:
            raise _err(prefix, f"has {qkey!r} but no {skey!r}")
        qweight, scales = tensors[qkey], tensors[skey]
        if isinstance(qweight, torch.Tensor) and isinstance(scales, torch.Tensor) \
                and qweight.dim() == 2 and scales.dim() == 2:
            n = scales.shape[1]
            if qweight.shape[1] == n:
                return Format.GPTQ
            if qweight.shape[1] * 8 == n:
                return Format.AWQ
        raise _err(prefix, f"qweight {_shape_of(qweight)} with scales {_shape_of(scales)} is "
                           f"neither GPTQ ([K*bits/32, N]) nor AutoAWQ GEMM ([K, N/8])")
    raise _err(prefix, "no quantized weight found: expected one of "
                       f"{[_key(prefix, p) for p in ('qweight', 'weight_packed', 'W_q')]}")


def _shape_of(t: Any) -> Any:
    return list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _get(tensors: Mapping, prefix: str, suffix: str, fmt: Format, required: bool = True):
    key = _key(prefix, suffix)
    if key in tensors:
        return tensors[key]
    if required:
        raise _err(prefix, f"{fmt.value} layer is missing its companion tensor {key!r}")
    return None


def import_layer(fmt: Union[Format, str, None], tensors: Mapping[str, torch.Tensor],
                 prefix: str, dtype: DTypeLike = None, *, bits: Optional[int] = None,
                 group_size: Optional[int] = None,
                 checkpoint_format: Union[GPTQCheckpointFormat, str, None] = None,
                 symmetric: Optional[bool] = None, tp_rank: int = 0, tp_size: int = 1, tp_dim: int = 0,
                 tp_sections: Optional[Tuple[int, ...]] = None) -> ImportedLayer:
    """Convert the layer ``prefix`` of a loaded state dict.

    Parameters
    ----------
    fmt : Format or str or None
        The checkpoint format; ``None`` or ``"auto"``: :func:`detect_format`.
    tensors : Mapping[str, torch.Tensor]
        The state dict (names as in the checkpoint, e.g. ``"<prefix>.qweight"``).
    prefix : str
        The layer's name (``""`` for none).
    dtype : torch.dtype or str, optional
        Activation dtype (bf16/fp16); default the layer's scale dtype.
    bits, group_size : int, optional
        From the checkpoint's quantization config; inferred from the shapes when ``None``
        and checked against them otherwise. Not used for HQQ (read from its meta data).
    checkpoint_format : GPTQCheckpointFormat or str
        GPTQ only, and required there: ``"gptq"`` (v1) or ``"gptq_v2"``, see
        :func:`from_gptq`.
    symmetric : bool, optional
        See the module docstring.
    tp_rank, tp_size, tp_dim : int
        Tensor parallelism (module docstring, :meth:`ImportedLayer.shard`): with ``tp_size >
        1`` the rank's shard of the layer, bias included, along ``tp_dim``.
    tp_sections : tuple of int, optional
        ``tp_dim=0``: the row sections of a fused layer (q/k/v), each split on its own.

    Returns
    -------
    ImportedLayer
        The weight, the K permutation (act-order only) and ``<prefix>.bias`` if present.

    Raises
    ------
    FormatError
        Unrecognised or inconsistent tensors, naming the layer (see the converters).
    UnsupportedLayerError
        Valid layers mixgemm cannot represent exactly.
    """
    fmt = detect_format(tensors, prefix) if fmt is None or fmt == "auto" else Format.parse(fmt)
    get = lambda suffix, required=True: _get(tensors, prefix, suffix, fmt, required)  # noqa: E731
    if fmt is Format.AWQ:
        layer = from_awq(get("qweight"), get("qzeros"), get("scales"), group_size=group_size,
                         bits=4 if bits is None else bits, dtype=dtype, symmetric=symmetric,
                         name=prefix)
    elif fmt is Format.GPTQ:
        if checkpoint_format is None:
            raise _err(prefix, "GPTQ layers need checkpoint_format='gptq' (v1: zeros stored "
                               "minus one; also when quantize_config.json has no "
                               "checkpoint_format) or 'gptq_v2'")
        layer = from_gptq(get("qweight"), get("qzeros"), get("scales"), get("g_idx", False),
                          checkpoint_format=checkpoint_format, bits=bits,
                          group_size=group_size, dtype=dtype, symmetric=symmetric,
                          name=prefix)
    elif fmt is Format.COMPRESSED_TENSORS:
        layer = from_compressed_tensors(
            get("weight_packed"), get("weight_scale"), get("weight_shape"),
            get("weight_zero_point", False), get("weight_g_idx", False), bits=bits,
            group_size=group_size, dtype=dtype, symmetric=symmetric, name=prefix)
    else:
        meta = _hqq_meta_from(tensors, prefix)
        layer = from_hqq(get("W_q"), get("scale"), get("zero"), meta, dtype=dtype,
                         symmetric=symmetric, name=prefix)
    bias = tensors.get(_key(prefix, "bias"))
    layer = dataclasses.replace(layer, bias=bias) if bias is not None else layer
    return _shard_imported(layer, prefix, tp_rank, tp_size, tp_dim, tp_sections)


def _split(key: str) -> Tuple[str, str]:
    prefix, _, last = key.rpartition(".")
    return prefix, last


def import_checkpoint(fmt: Union[Format, str, None], tensors: Mapping[str, torch.Tensor],
                      dtype: DTypeLike = None, *, bits: Optional[int] = None,
                      group_size: Optional[int] = None,
                      checkpoint_format: Union[GPTQCheckpointFormat, str, None] = None,
                      symmetric: Optional[bool] = None, arch: str = "sm90a",
                      progress: bool = False) -> Dict[str, Union[torch.Tensor, PackedWeight]]:
    """Convert every quantized layer of a loaded state dict and prepack it.

    Parameters
    ----------
    fmt : Format or str or None
        The checkpoint format; ``None`` or ``"auto"``: detected per layer.
    tensors : Mapping[str, torch.Tensor]
        The whole state dict (e.g. ``safetensors.torch.load_file`` of every shard, merged).
    dtype, bits, group_size, checkpoint_format, symmetric
        Passed to :func:`import_layer` for every layer.
    arch : str
        Target of :func:`mixgemm.prepack` (``"sm90a"``).
    progress : bool
        Show a progress bar over the quantized layers.

    Returns
    -------
    dict
        In the input's order: for each quantized layer ``P``, ``"P.weight"`` ->
        :class:`~mixgemm.types.PackedWeight` (in place of its packed tensors, scales, zeros,
        ``g_idx`` and meta data) and, for act-order layers whose groups are not contiguous,
        ``"P.perm"`` -> int64 ``[K]`` (apply ``x[..., perm]`` to the layer's input); every
        other tensor (biases, norms, embeddings, ...) unchanged, as the same object.
        :func:`mixgemm.save` writes the result.

    Raises
    ------
    FormatError
        A layer's tensors are inconsistent (the message names it); a companion tensor
        without its layer's packed weight (e.g. ``qzeros`` without ``qweight``); a layer that
        also has a plain ``P.weight`` (or ``P.perm``) tensor.
    UnsupportedLayerError
        A valid layer mixgemm cannot represent exactly.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of name -> torch.Tensor, got "
                        f"{type(tensors).__name__}")
    fixed = None if fmt is None or fmt == "auto" else Format.parse(fmt)
    formats = [fixed] if fixed is not None else list(Format)
    primaries = {_PRIMARY[f] for f in formats}
    layers: Dict[str, Format] = {}
    for key in tensors:
        prefix, last = _split(key)
        if last in primaries:
            layers[prefix] = fixed if fixed is not None else detect_format(tensors, prefix)
    consumed: Dict[str, str] = {}
    for prefix, f in layers.items():
        for suffix in _COMPANIONS[f]:
            key = _key(prefix, suffix)
            if key in tensors:
                consumed[key] = prefix
        for suffix in ("weight", "perm"):
            if _key(prefix, suffix) in tensors:
                raise _err(prefix, f"has both a {f.value} quantized weight and a plain tensor "
                                   f"{_key(prefix, suffix)!r}, which the import would replace")
    for key in tensors:
        prefix, last = _split(key)
        owners = [f for f in formats if last in _ORPHANS[f]]
        if key not in consumed and owners:
            wanted = " or ".join(sorted({repr(_key(prefix, _PRIMARY[f])) for f in owners}))
            raise _err(prefix, f"{key!r} belongs to a {'/'.join(f.value for f in owners)} "
                               f"layer, but there is no {wanted} (unrecognised or incomplete "
                               f"quantized layer)")
    from tqdm import tqdm

    out: Dict[str, Union[torch.Tensor, PackedWeight]] = {}
    with tqdm(total=len(layers), desc="mixgemm import", unit="layer", disable=not progress or None) as bar:
        for key, value in tensors.items():
            prefix, last = _split(key)
            if key in consumed:
                if prefix in layers and last == _PRIMARY[layers[prefix]]:
                    layer = import_layer(layers[prefix], tensors, prefix, dtype, bits=bits,
                                         group_size=group_size,
                                         checkpoint_format=checkpoint_format, symmetric=symmetric)
                    out[_key(prefix, "weight")] = prepack(layer.qweight, arch=arch)
                    if layer.perm is not None:
                        out[_key(prefix, "perm")] = layer.perm
                    bar.update(1)
                continue
            out[key] = value
    return out
