"""Core data model: the logical quantized weight and the prepacked weight, over the element
types of :mod:`mixgemm.dtypes`.

Two weight objects exist, and everything else converts between them:

* :class:`QuantizedWeight` is the *logical* form: integer codes ``q[N, K]`` in nn.Linear's
  layout, group-wise ``scales[N, G]`` and (asymmetric only) ``zeros[N, G]``. It is what the
  quantizer and the checkpoint importers produce, and what the reference dequantizer reads.
* :class:`PackedWeight` is the *kernel* form: the same codes swizzled into the layout that the
  sm90a kernels read (see :mod:`mixgemm.weights.layout`), with scales and zeros transposed to
  ``[G, N]`` (N contiguous, the order the kernels' TMA loads them in).

The dequantization formula is the same for both and for every kernel (see
:func:`mixgemm.weights.quantize.dequantize_reference`)::

    symmetric:   w[n, k] = q[n, k] * s[n, g]                 q signed,   in [-2^(b-1), 2^(b-1)-1]
    asymmetric:  w[n, k] = (q[n, k] - z[n, g]) * s[n, g]     q unsigned, in [0, 2^b - 1]

with ``g = k // group_size``, evaluated in the activation dtype: ``q - z`` is an exact small
integer, so the only rounding is the final product, rounded to nearest even once.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..dtypes import ActType, WeightType

#: Version of the prepacked layout. Bump it whenever the byte layout of PackedWeight changes;
#: files and objects with a newer version are refused.
LAYOUT_VERSION = 1

#: The only architecture the prepacked layout targets today.
SUPPORTED_ARCHS = ("sm90a",)

#: The prepacked layout's atom: 16 weight rows (N) x 64 columns (K), one MMA fragment's worth
#: for 32 lanes (mixgemm.weights.layout documents the (n, k) -> (lane, value) map inside it).
ATOM_N = 16
ATOM_K = 64


def atom_bytes(bits: int) -> int:
    """Bytes in one 16x64 atom of ``bits``-bit codes (32 lanes x 32 values)."""
    return ATOM_N * ATOM_K * bits // 8


SUPPORTED_BITS = (8, 4, 2)
#: Group sizes the kernels are generated and tested for; ``group_size == K`` (per-channel) is
#: always allowed too.
SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)


def check_group_size(group_size: int, k: int) -> None:
    """Raise ValueError unless ``group_size`` is one of the supported sizes (or K) and divides K."""
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size != k and group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES} or K (={k}) for "
                         f"per-channel scales, got {group_size}")
    if k % group_size != 0:
        raise ValueError(f"K={k} is not divisible by group_size={group_size}")


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A group-wise quantized weight in its logical (unpacked) form.

    Attributes
    ----------
    qweight : torch.Tensor
        Integer codes, shape ``[N, K]`` (nn.Linear's ``[out_features, in_features]``).
        dtype ``torch.int8`` with values in ``[-2^(b-1), 2^(b-1)-1]`` when symmetric,
        ``torch.uint8`` with values in ``[0, 2^b-1]`` when asymmetric.
    scales : torch.Tensor
        Shape ``[N, K // group_size]``, in the activation dtype (bf16 or fp16), positive.
    zeros : torch.Tensor or None
        Asymmetric only: shape ``[N, K // group_size]``, activation dtype, integer-valued in
        ``[0, 2^b-1]``. ``None`` when symmetric.
    bits : int
        8, 4 or 2.
    group_size : int
        Number of consecutive K elements sharing one scale (and zero); ``K`` means per-channel.
    symmetric : bool
        True: ``w = q*s``. False: ``w = (q - z)*s``.
    zero_offsets : torch.Tensor or None
        Asymmetric only, optional: float32 ``[N, K // group_size]``, for checkpoints whose zero
        points are not integers (HQQ). The weight is then ``w = (q - z)*s + o`` with the integer
        ``z`` above and ``o = (z - z_float)*s`` (see :func:`mixgemm.formats.from_hqq`).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    bits: int
    group_size: int
    symmetric: bool
    zero_offsets: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        wt = WeightType.of(self.bits, self.symmetric)
        q = self.qweight
        if q.dim() != 2:
            raise ValueError(f"qweight must be 2-D [N, K], got shape {tuple(q.shape)}")
        want = torch.int8 if wt.signed else torch.uint8
        if q.dtype != want:
            raise TypeError(f"qweight for {'symmetric' if self.symmetric else 'asymmetric'} "
                            f"{self.bits}-bit weights must be {want}, got {q.dtype}")
        n, k = q.shape
        check_group_size(self.group_size, k)
        g = k // self.group_size
        ActType.from_torch(self.scales.dtype)
        if tuple(self.scales.shape) != (n, g):
            raise ValueError(f"scales must have shape [N, K/group_size] = {[n, g]}, "
                             f"got {list(self.scales.shape)}")
        if wt.has_zero:
            if self.zeros is None:
                raise ValueError("asymmetric weights need zeros")
            if tuple(self.zeros.shape) != (n, g) or self.zeros.dtype != self.scales.dtype:
                raise ValueError(f"zeros must have shape {[n, g]} and dtype {self.scales.dtype}, "
                                 f"got {list(self.zeros.shape)} {self.zeros.dtype}")
        elif self.zeros is not None:
            raise ValueError("symmetric weights have no zeros")
        _check_zero_offsets(self.zero_offsets, wt, (n, g))
        devices = {t.device for t in (q, self.scales, self.zeros, self.zero_offsets) if t is not None}
        if len(devices) != 1:
            raise ValueError(f"qweight, scales and zeros must be on one device, got {devices}")

    def shard(self, dim: int, rank: int, world_size: int, sections=None) -> "QuantizedWeight":
        """The ``rank``-th of ``world_size`` tensor-parallel slices of this logical weight, by the
        rules of :meth:`PackedWeight.shard` (whole 16-row atoms along N, whole 64-column atoms
        and groups along K), so that ``prepack(qw.shard(...)) == prepack(qw).shard(...)``. See
        :func:`shard_logical`."""
        return shard_logical(self, dim, rank, world_size, sections)

    @property
    def weight_type(self) -> WeightType:
        return WeightType.of(self.bits, self.symmetric)

    @property
    def n(self) -> int:
        return self.qweight.shape[0]

    @property
    def k(self) -> int:
        return self.qweight.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def to(self, device) -> "QuantizedWeight":
        return dataclasses.replace(
            self, qweight=self.qweight.to(device), scales=self.scales.to(device),
            zeros=None if self.zeros is None else self.zeros.to(device),
            zero_offsets=None if self.zero_offsets is None else self.zero_offsets.to(device))


def _check_zero_offsets(offsets: Optional[torch.Tensor], wt: "WeightType", shape: tuple) -> None:
    if offsets is None:
        return
    if not wt.has_zero:
        raise ValueError("zero_offsets belong to asymmetric weights (fractional zero points)")
    if offsets.dtype != torch.float32 or tuple(offsets.shape) != shape:
        raise ValueError(f"zero_offsets must be float32 of shape {list(shape)}, got "
                         f"{offsets.dtype} {list(offsets.shape)}")


@dataclasses.dataclass(frozen=True, eq=False)
class PackedProperties:
    """The fields a prepacked weight (:class:`PackedWeight`) and a stack of them
    (:class:`mixgemm.weights.experts.PackedExperts`) share, their checks that do not depend on the
    tensors' leading dimensions, and what both derive from them. The subclasses document each
    field's shape."""

    qdata: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    weight_type: WeightType
    group_size: int
    n: int
    k: int
    arch: str = "sm90a"
    layout_version: int = LAYOUT_VERSION

    def check_geometry(self) -> None:
        """The architecture, the layout version, N and K against the atom, and the group size:
        ``ValueError`` with the reason."""
        kind = type(self).__name__
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"{kind} is for arch {self.arch!r}; this mixgemm supports {SUPPORTED_ARCHS}")
        if self.layout_version != LAYOUT_VERSION:
            hint = ("upgrade mixgemm to read it" if self.layout_version > LAYOUT_VERSION
                    else "prepack the weight again")
            raise ValueError(f"{kind} has layout version {self.layout_version}; this mixgemm "
                             f"reads version {LAYOUT_VERSION} ({hint})")
        if self.n % ATOM_N or self.k % ATOM_K:
            raise ValueError(f"N must be a multiple of {ATOM_N} and K of {ATOM_K}, got N={self.n} K={self.k}")
        check_group_size(self.group_size, self.k)

    def layout_metadata(self) -> dict:
        """The safetensors header strings both kinds write after their ``format``: the type,
        group size, activation dtype, shape, architecture and layout version."""
        return {
            "weight_type": self.weight_type.value,
            "bits": str(self.bits),
            "symmetric": str(self.symmetric).lower(),
            "group_size": str(self.group_size),
            "dtype": self.act_type.value,
            "n": str(self.n),
            "k": str(self.k),
            "arch": self.arch,
            "layout_version": str(self.layout_version),
        }

    @property
    def bits(self) -> int:
        return self.weight_type.bits

    @property
    def symmetric(self) -> bool:
        return self.weight_type.signed

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def act_type(self) -> ActType:
        return ActType.from_torch(self.scales.dtype)

    @property
    def device(self) -> torch.device:
        return self.qdata.device

    @property
    def num_groups(self) -> int:
        return self.k // self.group_size


@dataclasses.dataclass(frozen=True, eq=False)
class PackedWeight(PackedProperties):
    """A quantized weight prepacked for the sm90a kernels.

    Attributes
    ----------
    qdata : torch.Tensor
        ``torch.uint8``, shape ``[N/16, K/64, 128*bits]``: one 16x64 atom of codes per
        ``(n // 16, k // 64)``, in the order documented in :mod:`mixgemm.weights.layout`.
    scales : torch.Tensor
        Shape ``[G, N]`` (N contiguous), activation dtype, ``G = K // group_size``.
    zeros : torch.Tensor or None
        Shape ``[G, N]``, activation dtype, integer-valued; asymmetric types only.
    weight_type : WeightType
        Element type of the codes (signed = symmetric, unsigned = asymmetric with zeros).
    group_size : int
        K elements per group (``K`` for per-channel).
    n, k : int
        Logical weight shape ``[N, K]`` (out_features, in_features).
    arch : str
        Target architecture of the layout (``"sm90a"``).
    layout_version : int
        Version of the byte layout (:data:`LAYOUT_VERSION`).
    zero_offsets : torch.Tensor or None
        Optional, asymmetric only: float32 ``[G, N]`` added to the dequantized weight of each
        (group, row), for checkpoints with fractional zero points (HQQ):
        ``w = (q - z)*s + o``. :func:`mixgemm.gemm` adds ``x_groupsum @ o`` to the kernel's
        result (see :attr:`QuantizedWeight.zero_offsets`).
    """

    zero_offsets: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.check_geometry()
        want = (self.n // ATOM_N, self.k // ATOM_K, atom_bytes(self.weight_type.bits))
        if self.qdata.dtype != torch.uint8 or tuple(self.qdata.shape) != want:
            raise ValueError(f"qdata must be uint8 of shape {list(want)}, got "
                             f"{self.qdata.dtype} {list(self.qdata.shape)}")
        g = self.k // self.group_size
        ActType.from_torch(self.scales.dtype)
        if tuple(self.scales.shape) != (g, self.n):
            raise ValueError(f"scales must have shape [G, N] = {[g, self.n]}, got {list(self.scales.shape)}")
        if self.weight_type.has_zero:
            if self.zeros is None or tuple(self.zeros.shape) != (g, self.n) or self.zeros.dtype != self.scales.dtype:
                raise ValueError(f"{self.weight_type.value} weights need zeros of shape {[g, self.n]} "
                                 f"and dtype {self.scales.dtype}")
        elif self.zeros is not None:
            raise ValueError(f"{self.weight_type.value} (symmetric) weights have no zeros")
        _check_zero_offsets(self.zero_offsets, self.weight_type, (g, self.n))
        devices = {t.device for t in (self.qdata, self.scales, self.zeros, self.zero_offsets) if t is not None}
        if len(devices) != 1:
            raise ValueError(f"qdata, scales and zeros must be on one device, got {devices}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qdata, self.scales, self.zeros, self.zero_offsets) if t is not None)

    def to(self, device) -> "PackedWeight":
        return dataclasses.replace(
            self, qdata=self.qdata.to(device), scales=self.scales.to(device),
            zeros=None if self.zeros is None else self.zeros.to(device),
            zero_offsets=None if self.zero_offsets is None else self.zero_offsets.to(device))

    def shard(self, dim: int, rank: int, world_size: int, sections=None) -> "PackedWeight":
        """The ``rank``-th of ``world_size`` tensor-parallel slices of this weight, along N
        (``dim=0``, column parallel: whole 16-row atoms) or K (``dim=1``, row parallel: whole
        64-column atoms and whole groups), without re-quantizing: equal to ``prepack`` of the
        same slice of the logical weight. See :func:`shard` (``sections``:
        a fused q/k/v weight's row sections, each sliced on its own)."""
        return shard(self, dim, rank, world_size, sections)

    def metadata(self) -> dict:
        """String metadata describing this weight (stored in safetensors headers)."""
        return {"format": "mixgemm.packed", **self.layout_metadata()}


# ---------------------------------------------------------------------------------------------
# Tensor-parallel shards
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ShardSlice:
    """Where one tensor-parallel shard of an ``[N, K]`` weight lies (see :func:`shard_slice`).

    Attributes
    ----------
    dim : int
        0 (rows, N) or 1 (columns, K).
    rows : tuple of (int, int)
        ``dim=0``: the row ranges ``[r0, r1)`` of the whole weight, concatenated in order (one
        per section).
    k0, k_local : int
        ``dim=1``: the shard's first column and its width.
    group_size : int
        The shard's group size (a per-channel weight stays per-channel: ``k_local``).
    g0, g1 : int
        ``dim=1``: the whole weight's groups ``[g0, g1)`` the shard holds.
    """

    dim: int
    rows: tuple = ()
    k0: int = 0
    k_local: int = 0
    group_size: int = 0
    g0: int = 0
    g1: int = 0


def shard_slice(n: int, k: int, group_size: int, dim: int, rank: int, world_size: int,
                sections: "tuple[int, ...] | list[int] | None" = None) -> ShardSlice:
    """The rows or columns of the ``rank``-th of ``world_size`` shards of an ``[N, K]`` weight
    with groups of ``group_size`` (``K``: per-channel), checked: whole 16-row atoms along N,
    whole 64-column atoms and whole groups along K. The rules of :func:`shard`.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, or a split that would cut an atom or a group (the message says which).
    """
    for name, v in (("rank", rank), ("world_size", world_size), ("dim", dim)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if dim not in (0, 1, -2, -1):
        raise ValueError(f"dim must be 0 (N, column parallel) or 1 (K, row parallel), got {dim}")
    dim %= 2
    if sections is not None and dim != 0:
        raise ValueError("sections slice the output rows: they need dim=0")
    if dim == 0:
        sections = tuple(sections) if sections is not None else (n,)
        if any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sections) or sum(sections) != n:
            raise ValueError(f"sections must be positive ints summing to N={n}, got {list(sections)}")
        rows = []
        start = 0
        for s in sections:
            if s % (ATOM_N * world_size):
                what = f"section of {s} rows" if len(sections) > 1 else f"N={s}"
                raise ValueError(f"cannot split {what} into {world_size} shards of whole {ATOM_N}-row atoms: "
                                 f"need N / world_size to be a multiple of {ATOM_N}")
            part = s // world_size
            rows.append((start + rank * part, start + (rank + 1) * part))
            start += s
        return ShardSlice(0, rows=tuple(rows), group_size=group_size)
    g = group_size
    if k % world_size or (k // world_size) % ATOM_K:
        raise ValueError(f"cannot split K={k} into {world_size} shards of whole {ATOM_K}-column atoms: "
                         f"need K / world_size to be a multiple of {ATOM_K}")
    k_local = k // world_size
    per_channel = g == k
    if not per_channel and k_local % g:
        raise ValueError(f"cannot split K={k} into {world_size} shards of whole groups of {g}: "
                         f"K / world_size = {k_local} is not a multiple of the group size")
    k0 = rank * k_local
    g0, g1 = (0, 1) if per_channel else (k0 // g, (k0 + k_local) // g)
    return ShardSlice(1, k0=k0, k_local=k_local, group_size=k_local if per_channel else g, g0=g0, g1=g1)


def shard(packed: PackedWeight, dim: int, rank: int, world_size: int,
          sections: "tuple[int, ...] | list[int] | None" = None) -> PackedWeight:
    """The ``rank``-th of ``world_size`` slices of a packed weight, without re-quantizing.

    Parameters
    ----------
    packed : PackedWeight
        The whole weight ``[N, K]`` (any device).
    dim : int
        ``0``: slice the output features N (column parallel): rows
        ``rank * N/W .. (rank+1) * N/W``; ``N/W`` must be a multiple of 16 (whole 16-row atoms).
        ``1``: slice the input features K (row parallel): columns ``rank * K/W ..``; ``K/W``
        must be a multiple of 64 (whole atoms) and of the group size (whole groups). A
        per-channel weight (``group_size == K``) keeps its scales and becomes per-channel over
        its slice (``group_size = K/W``): each shard's partial product is exact, and their sum
        is the whole product.
    rank, world_size : int
        ``0 <= rank < world_size``.
    sections : sequence of int, optional
        ``dim=0`` only: the weight's rows are consecutive sections (a fused q/k/v projection:
        ``(q_rows, k_rows, v_rows)``, summing to N); each section is sliced on its own and the
        rank's slices are concatenated (``[q_r; k_r; v_r]``). Every section divided by
        ``world_size`` must be a multiple of 16.

    Returns
    -------
    PackedWeight
        ``[N/W, K]`` or ``[N, K/W]``, owning its tensors (copies, contiguous), equal tensor for
        tensor to ``prepack`` of the same slice of ``unpack(packed)``. Scales, zeros and zero
        offsets (``[G, N]``) are sliced along the same rows, or the same groups.

    Notes
    -----
    A swiglu (gate/up interleaved) weight alternates 8 gate rows and 8 up rows in each 16-row
    atom, so a slice at 16-row boundaries holds the matching gate and up rows: it is the
    interleaved weight of the gate's and up's own slices (rows ``rank * I/W ..`` of each), and
    its outputs are features ``rank * I/W .. (rank+1) * I/W`` of the whole layer's.
    """
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"shard expects a PackedWeight, got {type(packed).__name__}")
    sl = shard_slice(packed.n, packed.k, packed.group_size, dim, rank, world_size, sections)
    if sl.dim == 0:
        return _take_rows(packed, list(sl.rows))
    a0, a1 = sl.k0 // ATOM_K, (sl.k0 + sl.k_local) // ATOM_K

    def groups(t):
        return None if t is None else t[sl.g0:sl.g1].clone()

    return PackedWeight(
        qdata=packed.qdata[:, a0:a1].clone(memory_format=torch.contiguous_format), scales=groups(packed.scales),
        zeros=groups(packed.zeros), weight_type=packed.weight_type, group_size=sl.group_size, n=packed.n,
        k=sl.k_local, arch=packed.arch, layout_version=packed.layout_version, zero_offsets=groups(packed.zero_offsets))


def shard_logical(qw: QuantizedWeight, dim: int, rank: int, world_size: int,
                  sections: "tuple[int, ...] | list[int] | None" = None) -> QuantizedWeight:
    """:func:`shard` of a logical weight: the same slice, by the same rules (whole 16-row
    atoms, whole 64-column atoms and groups), so that ``prepack(shard_logical(qw, ...))``
    equals ``shard(prepack(qw), ...)``. Codes, scales, zeros and zero offsets (``[N, G]``) are
    copied (contiguous), never re-quantized.

    Parameters
    ----------
    qw : QuantizedWeight
        The whole weight ``[N, K]``.
    dim, rank, world_size, sections
        As for :func:`shard`.

    Returns
    -------
    QuantizedWeight
        ``[N/W, K]`` or ``[N, K/W]``.
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"shard_logical expects a QuantizedWeight, got {type(qw).__name__}")
    sl = shard_slice(qw.n, qw.k, qw.group_size, dim, rank, world_size, sections)
    if sl.dim == 0:
        def rows(t):
            return None if t is None else torch.cat([t[r0:r1] for r0, r1 in sl.rows]).contiguous()

        return dataclasses.replace(qw, qweight=rows(qw.qweight), scales=rows(qw.scales), zeros=rows(qw.zeros),
                                   zero_offsets=rows(qw.zero_offsets))

    def groups(t):
        return None if t is None else t[:, sl.g0:sl.g1].contiguous()

    return dataclasses.replace(qw, qweight=qw.qweight[:, sl.k0:sl.k0 + sl.k_local].contiguous(),
                               scales=groups(qw.scales), zeros=groups(qw.zeros),
                               zero_offsets=groups(qw.zero_offsets), group_size=sl.group_size)


def _take_rows(packed: PackedWeight, rows: "list[tuple[int, int]]") -> PackedWeight:
    """The weight made of the row ranges ``rows`` (each on 16-row atom boundaries), in order."""
    def cols(t):
        return None if t is None else torch.cat([t[:, r0:r1] for r0, r1 in rows], dim=1)

    qdata = torch.cat([packed.qdata[r0 // ATOM_N:r1 // ATOM_N] for r0, r1 in rows])   # a new tensor
    return PackedWeight(
        qdata=qdata, scales=cols(packed.scales), zeros=cols(packed.zeros), weight_type=packed.weight_type,
        group_size=packed.group_size, n=sum(r1 - r0 for r0, r1 in rows), k=packed.k, arch=packed.arch,
        layout_version=packed.layout_version, zero_offsets=cols(packed.zero_offsets))
