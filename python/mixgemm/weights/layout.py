r"""The sm90a prepacked weight layout, and :func:`prepack` / :func:`unpack`.

Where the layout comes from
---------------------------
The weight is operand A of a register-sourced ``wgmma.m64nNk16`` (A from registers, the
activations B from shared memory). For a 16-bit MMA type, PTX fixes which thread holds which
element of A: in each warp of the warpgroup (rows ``16*w .. 16*w+15``) the lane ``l`` holds,
per k16 block, the 8 values::

    i:        0        1        2          3          4         5         6          7
    (row, k): (g, 2t)  (g, 2t+1) (g+8, 2t) (g+8, 2t+1) (g, 2t+8) (g, 2t+9) (g+8, 2t+8) (g+8, 2t+9)

with ``g = l // 4`` and ``t = l % 4`` (registers hold the pairs ``(i, i+1)``, i even, as
bf16x2/f16x2). A lane therefore needs, from a 16-row x 64-k *atom*, 4 k16 blocks x 8 = 32
values. The prepacked layout stores those 32 values contiguously, so a lane reads its share
of an atom with one 16-byte load for int4 (8 bytes for int2, two 16-byte loads for int8),
and stores them in the bit order that the converters (``converters/mixgemm``) want, so that
two consecutive fragment values come out of a 32-bit word with one shift and one ``lop3``.

The map ``(n, k) -> (thread, value)``
-------------------------------------
For a weight ``[N, K]`` with ``N % 16 == 0`` and ``K % 64 == 0``, and ``b`` bits per code::

    atom      na = n // 16,  ka = k // 64            r = n % 16,  c = k % 64
    lane      l  = 4 * (r % 8) + (c % 8) // 2                      (thread of the warp)
    value     v  = 8 * (c // 16) + (c % 2) + 2 * (r // 8) + 4 * ((c % 16) // 8)   (0..31)
    word      w  = v // (32 // b),   slot s = v % (32 // b)
    bit       32 * w + 16 * (s % 2) + b * (s // 2)            inside the lane's 4*b-byte chunk
    byte      qdata[na, ka, 4*b*l + bit // 8],  bit position bit % 8 in it (little endian)

So a 32-bit word holds ``32/b`` consecutive fragment values, the even ones in its low half and
the odd ones in its high half, each half in increasing value order (for int4 the nibbles hold
values ``0 2 4 6 1 3 5 7``, CUTLASS example 55's order; for int2 ``0 2 .. 14 1 3 .. 15``; for
int8 the bytes hold ``0 2 1 3``). Shifting the word right by ``b * j`` and masking with
``(2^b - 1) * 0x00010001`` yields the pair ``(2j, 2j+1)`` in the two halves of a register.

Codes are stored as their low ``b`` bits (two's complement for the signed types). Atoms are
stored ``[N/16][K/64]`` (k-atoms contiguous), independent of the kernel's tile shape, so every
tile config reads the same packed weight. Scales and zeros are stored transposed, ``[G, N]``.
"""
from __future__ import annotations

import functools

import torch

from ..dtypes import WeightType
from .types import ATOM_K, ATOM_N, LAYOUT_VERSION, SUPPORTED_ARCHS, PackedWeight, QuantizedWeight, atom_bytes

LANES = 32
VALUES_PER_LANE = ATOM_N * ATOM_K // LANES  # 32


def lane_value_of(r: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map in-atom coordinates ``(r, c)`` (row 0..15, column 0..63) to ``(lane, value)``."""
    lane = 4 * (r % 8) + (c % 8) // 2
    value = 8 * (c // 16) + (c % 2) + 2 * (r // 8) + 4 * ((c % 16) // 8)
    return lane, value


def bit_of(value: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit offset of fragment value ``value`` (0..31) inside a lane's ``4*bits``-byte chunk."""
    per_word = 32 // bits
    word, slot = value // per_word, value % per_word
    return 32 * word + 16 * (slot % 2) + bits * (slot // 2)


@functools.lru_cache(maxsize=None)
def _byte_gather_index(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (byte of the atom, code inside that byte), the flat in-atom index ``r*64 + c``
    of the code stored there, and the code's shift inside the byte.

    Returns ``(index[atom_bytes, 8 // bits], shift[8 // bits])``. Derived from
    :func:`lane_value_of` and :func:`bit_of`, so it is the layout by construction.
    """
    r = torch.arange(ATOM_N).repeat_interleave(ATOM_K)
    c = torch.arange(ATOM_K).repeat(ATOM_N)
    lane, value = lane_value_of(r, c)
    bit = lane * (32 * bits) + bit_of(value, bits)  # absolute bit inside the atom
    per_byte = 8 // bits
    index = torch.empty(atom_bytes(bits) * per_byte, dtype=torch.long)
    # bit // bits enumerates code positions in atom order: byte = bit // 8, j = (bit % 8) // bits
    index[bit // bits] = r * ATOM_K + c
    shift = torch.arange(per_byte, dtype=torch.int32) * bits
    return index.view(atom_bytes(bits), per_byte), shift


def _check_arch(arch: str) -> None:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; mixgemm prepacks for {SUPPORTED_ARCHS}")


def check_packable(n: int, k: int) -> None:
    if n % ATOM_N or k % ATOM_K:
        raise ValueError(f"the sm90a layout needs N % {ATOM_N} == 0 and K % {ATOM_K} == 0, "
                         f"got N={n}, K={k}")


# Rows of atoms processed per chunk: bounds the temporaries (~8 B per code) for huge layers.
_CHUNK_CODES = 1 << 24


def prepack(qw: QuantizedWeight, arch: str = "sm90a") -> PackedWeight:
    """Swizzle a quantized weight into the layout the sm90a kernels read.

    Parameters
    ----------
    qw : QuantizedWeight
        Codes ``[N, K]`` (int8 or uint8), scales/zeros ``[N, K // group_size]`` in bf16/fp16.
        Needs ``N % 16 == 0`` and ``K % 64 == 0``. CPU or CUDA tensors.
    arch : str
        Target architecture; only ``"sm90a"``.

    Returns
    -------
    PackedWeight
        ``qdata`` uint8 ``[N/16, K/64, 128*bits]`` on ``qw``'s device, in the layout
        documented in this module; ``scales``/``zeros`` (and ``zero_offsets``) transposed to
        ``[G, N]``.
    """
    _check_arch(arch)
    if not isinstance(qw, QuantizedWeight):
        hint = (" (for a list of experts' weights use mixgemm.moe.PackedExperts.from_quantized)"
                if isinstance(qw, (list, tuple)) else "")
        raise TypeError(f"prepack expects a QuantizedWeight, got {type(qw).__name__}{hint}")
    n, k, bits = qw.n, qw.k, qw.bits
    check_packable(n, k)
    wt = qw.weight_type
    if qw.qweight.numel():
        lo, hi = int(qw.qweight.min()), int(qw.qweight.max())
        if lo < wt.qmin or hi > wt.qmax:
            raise ValueError(f"codes must lie in [{wt.qmin}, {wt.qmax}] for {wt.value} weights, "
                             f"got values in [{lo}, {hi}]")
    for name, t in (("scales", qw.scales), ("zeros", qw.zeros), ("zero_offsets", qw.zero_offsets)):
        if t is not None and not torch.isfinite(t).all():
            raise ValueError(f"{name} must be finite")
    index, shift = _byte_gather_index(bits)
    index, shift = index.to(qw.device), shift.to(qw.device)
    na_total, ka = n // ATOM_N, k // ATOM_K
    qdata = torch.empty((na_total, ka, atom_bytes(bits)), dtype=torch.uint8, device=qw.device)
    mask = (1 << bits) - 1
    rows = max(1, _CHUNK_CODES // (ATOM_N * k))
    for na0 in range(0, na_total, rows):
        na1 = min(na_total, na0 + rows)
        codes = qw.qweight[na0 * ATOM_N:na1 * ATOM_N].view(torch.uint8) & mask  # low b bits
        atoms = (codes.view(na1 - na0, ATOM_N, ka, ATOM_K).permute(0, 2, 1, 3)
                 .reshape(na1 - na0, ka, ATOM_N * ATOM_K))
        per_byte = atoms[:, :, index].to(torch.int32) << shift  # [na, ka, bytes, 8/b]
        qdata[na0:na1] = per_byte.sum(-1).to(torch.uint8)
    return PackedWeight(
        qdata=qdata,
        scales=qw.scales.t().contiguous(),
        zeros=None if qw.zeros is None else qw.zeros.t().contiguous(),
        weight_type=qw.weight_type,
        group_size=qw.group_size,
        n=n,
        k=k,
        arch=arch,
        layout_version=LAYOUT_VERSION,
        zero_offsets=None if qw.zero_offsets is None else qw.zero_offsets.t().contiguous(),
    )


def unpack(packed: PackedWeight) -> QuantizedWeight:
    """Exact inverse of :func:`prepack`: recover the logical :class:`QuantizedWeight`.

    Parameters
    ----------
    packed : PackedWeight
        A weight in the sm90a layout (any device).

    Returns
    -------
    QuantizedWeight
        Codes ``[N, K]`` (int8 when symmetric, uint8 otherwise), scales/zeros ``[N, G]``.
    """
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"unpack expects a PackedWeight, got {type(packed).__name__}")
    wt: WeightType = packed.weight_type
    bits, n, k = wt.bits, packed.n, packed.k
    index, shift = _byte_gather_index(bits)
    index, shift = index.to(packed.device), shift.to(packed.device)
    na_total, ka = n // ATOM_N, k // ATOM_K
    mask = (1 << bits) - 1
    out = torch.empty((n, k), dtype=torch.uint8, device=packed.device)
    flat_index = index.reshape(-1)
    rows = max(1, _CHUNK_CODES // (ATOM_N * k))
    for na0 in range(0, na_total, rows):
        na1 = min(na_total, na0 + rows)
        b = packed.qdata[na0:na1].to(torch.int32)
        codes = ((b.unsqueeze(-1) >> shift) & mask).reshape(na1 - na0, ka, -1)
        atoms = torch.empty_like(codes)
        atoms[:, :, flat_index] = codes
        out[na0 * ATOM_N:na1 * ATOM_N] = (atoms.view(na1 - na0, ka, ATOM_N, ATOM_K)
                                          .permute(0, 2, 1, 3).reshape(-1, k).to(torch.uint8))
    if wt.signed:
        # sign-extend the b-bit two's complement codes
        q = out.to(torch.int16)
        q = torch.where(q >= (1 << (bits - 1)), q - (1 << bits), q).to(torch.int8)
    else:
        q = out
    return QuantizedWeight(
        qweight=q,
        scales=packed.scales.t().contiguous(),
        zeros=None if packed.zeros is None else packed.zeros.t().contiguous(),
        bits=bits,
        group_size=packed.group_size,
        symmetric=wt.signed,
        zero_offsets=None if packed.zero_offsets is None else packed.zero_offsets.t().contiguous(),
    )
