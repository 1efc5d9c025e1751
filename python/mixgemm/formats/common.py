"""What the checkpoint importers share: :class:`ImportedLayer`, the activation-dtype type and
the checks and conversions every converter uses (unpacking 32-bit words, act-order groups, the
final :class:`~mixgemm.weights.types.QuantizedWeight`). The conventions they follow are documented in
:mod:`mixgemm.formats`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

import torch

from ..dtypes import ActType
from ..errors import FormatError, ShardError, UnsupportedLayerError
from ..weights.layout import ATOM_K, ATOM_N
from ..weights.types import SUPPORTED_GROUP_SIZES, QuantizedWeight

DTypeLike = Union[torch.dtype, ActType, str, None]

WORD_BITS = 32


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
    act_format : str
        How the checkpoint quantizes the layer's input: ``"bf16"`` (it does not: the weights
        alone are quantized) or ``"fp8"`` (e4m3 activations, as ``mixgemm.gemm(...,
        act_format="fp8")`` and ``QuantLinear(act_format="fp8")`` compute).
    input_scale : torch.Tensor or None
        With ``act_format="fp8"``: the static per-tensor activation scale (float32, 0-d,
        positive and finite), or None for a scale per token (dynamic).
    """

    qweight: QuantizedWeight
    perm: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    act_format: str = "bf16"
    input_scale: Optional[torch.Tensor] = None

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
            :class:`mixgemm.nn.RowParallelQuantLinear` with ``input_is_parallel=False``). The
            activation format and a static ``input_scale`` are kept by every shard.
        rank, world_size : int
        sections : sequence of int, optional
            ``dim=0``: the rows of a fused layer's sections (e.g. ``(q, k, v)``), each sliced
            on its own (:func:`mixgemm.weights.types.shard`).
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
            The split cuts an atom or a group, or ``sections`` do not divide; or ``dim=1`` of a
            layer with per-token e4m3 activations (a token's scale is the amax of its whole row,
            which a rank holding K/W of its columns does not see).
        """
        if world_size == 1 and rank == 0:
            return self
        if dim % 2 == 1 and self.act_format == "fp8" and self.input_scale is None:
            raise ShardError(f"layer {name!r}: a row-parallel split (along K) of a layer with per-token e4m3 "
                             f"activations: each token's scale is the amax of its whole row, which a rank does not "
                             f"see (import it with activations=None, or with tp_dim=0)")
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
        return dataclasses.replace(self, qweight=qw, perm=perm, bias=bias)


def shard_imported(layer: "ImportedLayer", name: str, tp_rank: int, tp_size: int, tp_dim: int,
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


def layer_error(name: str, msg: str, cls: type = FormatError) -> FormatError:
    return cls(f"layer {name!r}: {msg}")


def tensor_key(prefix: str, suffix: str) -> str:
    return f"{prefix}.{suffix}" if prefix else suffix


def check_tensor(name: str, what: str, t: Any, ndim: Optional[int] = None,
                  dtypes: Optional[Tuple[torch.dtype, ...]] = None,
                  floating: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise layer_error(name, f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise layer_error(name, f"{what} must be {ndim}-D, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise layer_error(name, f"{what} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if floating and not t.is_floating_point():
        raise layer_error(name, f"{what} must be a floating-point tensor, got {t.dtype}")
    return t


def check_kernel_shape(name: str, n: int, k: int, group_size: Optional[int] = None) -> None:
    """The kernels' constraints, as UnsupportedLayerError (a FormatError / ValueError);
    ``group_size=None`` checks N and K only."""
    if n <= 0 or k <= 0 or n % ATOM_N or k % ATOM_K:
        raise layer_error(name, f"mixgemm's kernels need N (out_features) % {ATOM_N} == 0 and K "
                         f"(in_features) % {ATOM_K} == 0, got N={n}, K={k}",
                   UnsupportedLayerError)
    if group_size is None:
        return
    if group_size != k and group_size not in SUPPORTED_GROUP_SIZES:
        raise layer_error(name, f"group size {group_size} is not supported: mixgemm's kernels take "
                         f"{SUPPORTED_GROUP_SIZES} or K={k} (per-channel)", UnsupportedLayerError)
    if k % group_size:
        raise layer_error(name, f"K={k} is not a multiple of group size {group_size}: mixgemm needs "
                         f"groups of equal size", UnsupportedLayerError)


def resolve_group_size(name: str, k: int, num_groups: int, group_size: Optional[int]) -> int:
    """group size from the number of groups, checked against the caller's (``-1`` or
    ``None`` from the caller: per-channel / infer)."""
    if num_groups <= 0:
        raise layer_error(name, f"the scales have {num_groups} groups")
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
            raise layer_error(name, f"group_size={group_size} means {want} groups for K={k}, but the "
                             f"scales have {num_groups}")
        if k % gs:
            raise layer_error(name, f"K={k} is not a multiple of group_size={gs}: the last group is "
                             f"shorter, and mixgemm needs groups of equal size",
                       UnsupportedLayerError)
        return gs
    if k % num_groups:
        raise layer_error(name, f"K={k} is not a multiple of the number of groups ({num_groups}) in "
                         f"the scales: groups of unequal size are not supported",
                   UnsupportedLayerError)
    return k // num_groups


def layer_dtype(name: str, dtype: DTypeLike, scale_dtype: torch.dtype,
                   fallback: Optional[torch.dtype] = None) -> torch.dtype:
    if dtype is None:
        for cand in (scale_dtype, fallback):
            if cand in (torch.bfloat16, torch.float16):
                return cand
        raise layer_error(name, f"the checkpoint's scales are {scale_dtype}; pass dtype=torch.bfloat16 "
                         f"or torch.float16 (the activation dtype; the scales are rounded to it)")
    try:
        return ActType.parse(dtype).torch_dtype
    except (TypeError, ValueError) as e:
        raise ValueError(f"dtype (the activation dtype) must be bf16 or fp16: {e}") from None


def check_bits(name: str, bits: Any, fmt: str, allowed: Tuple[int, ...] = (8, 4, 2)) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    if bits not in allowed:
        raise layer_error(name, f"{bits}-bit {fmt} layers are not supported (mixgemm imports "
                         f"{'/'.join(map(str, allowed))}-bit ones)", UnsupportedLayerError)
    return bits


def unpack_words(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split 32-bit words into ``32 // bits`` codes, code ``j`` from bits ``[bits*j,
    bits*(j+1))`` (little endian), placed consecutively along ``dim``.

    ``packed`` is int32 (or int64 holding 32-bit words); the result is uint8 with
    ``packed.shape[dim] * 32 // bits`` entries along ``dim``.
    """
    shifts = torch.arange(0, WORD_BITS, bits, dtype=packed.dtype, device=packed.device)
    x = packed.movedim(dim, -1)
    # Arithmetic shifts of negative int32 words shift in ones; the mask keeps only the code.
    codes = ((x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    return codes.flatten(-2).movedim(-1, dim).contiguous()


def resolve_groups(name: str, g_idx: Optional[torch.Tensor], k: int, num_groups: int
                    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Turn a ``g_idx`` into ``(perm, labels)``.

    ``perm`` (int64 ``[K]``): the K permutation that makes the groups contiguous (sorted by
    group, stable), or None. ``labels`` (int64 ``[G]``): when the groups are already
    contiguous but not in order, the source group of each contiguous block (reorder the
    scales' columns with it), or None.
    """
    if g_idx is None:
        return None, None
    check_tensor(name, "g_idx", g_idx, ndim=1)
    if g_idx.is_floating_point() or g_idx.is_complex() or g_idx.dtype == torch.bool:
        raise layer_error(name, f"g_idx must be an integer tensor, got {g_idx.dtype}")
    if g_idx.shape[0] != k:
        raise layer_error(name, f"g_idx has {g_idx.shape[0]} entries, but K (in_features) is {k}")
    g = g_idx.to(torch.int64)
    lo, hi = int(g.min()), int(g.max())
    if lo < 0 or hi >= num_groups:
        raise layer_error(name, f"g_idx values must lie in [0, {num_groups}) (the scales have "
                         f"{num_groups} groups), got [{lo}, {hi}]")
    counts = torch.bincount(g, minlength=num_groups)
    if k % num_groups or not bool((counts == k // num_groups).all()):
        raise layer_error(name, f"g_idx assigns groups of unequal sizes (between {int(counts.min())} "
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


def finalize_layer(name: str, q_u: torch.Tensor, z_u: Optional[torch.Tensor], scales: torch.Tensor,
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
        raise layer_error(name, f"symmetric=True, but {bad} of its {z_u.numel()} zero points differ "
                         f"from 2^(b-1) = {mid}: the layer is asymmetric (use symmetric=None "
                         f"or False)")
    s = scales.to(act)
    if not bool(torch.isfinite(s).all()):
        raise layer_error(name, f"the scales are not all finite in {act} (converted from "
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
        raise layer_error(name, str(e)) from e


def apply_groups(q_u: torch.Tensor, z_u: Optional[torch.Tensor], scales: torch.Tensor,
                  perm: Optional[torch.Tensor], labels: Optional[torch.Tensor]):
    if perm is not None:
        q_u = q_u.index_select(1, perm.to(q_u.device))
    if labels is not None:
        scales = scales.index_select(1, labels.to(scales.device))
        if z_u is not None:
            z_u = z_u.index_select(1, labels.to(z_u.device))
    return q_u, z_u, scales


# ------------------------------------------------------------------------------ reference dequant
# What the formats' own dequantization formulas share (each format's ``dequantize``).


def unpack_stream(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
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


def required_tensor(tensors: Mapping, prefix: str, suffix: str) -> torch.Tensor:
    """The tensor ``<prefix>.<suffix>``; :class:`FormatError` when it is missing."""
    key = f"{prefix}.{suffix}"
    if key not in tensors:
        raise FormatError(f"layer {prefix!r}: missing tensor {key!r}")
    return tensors[key]


def dequant_groups(k: int, num_groups: int, group_size: Optional[int], g_idx: Optional[torch.Tensor],
                   prefix: str) -> torch.Tensor:
    """The group of each of the ``k`` columns (int64 ``[K]``): ``g_idx``, or runs of
    ``group_size`` (from the config, else from ``num_groups``)."""
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
