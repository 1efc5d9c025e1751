"""Stacked experts: E prepacked weights of one shape and type, for the grouped (MoE) kernels.

:class:`PackedExperts` is E :class:`~mixgemm.weights.types.PackedWeight` s of one shape ``[N, K]``, one
weight type, group size and activation dtype, stored as single tensors with a leading expert
dimension: ``qdata [E, N/16, K/64, 128*bits]``, ``scales [E, G, N]`` and (asymmetric types)
``zeros [E, G, N]``. Expert ``e``'s slices are exactly the PackedWeight of that expert, so the
grouped kernels find expert ``e`` at a fixed stride from the first, and :meth:`expert` is a view.

Build one from packed weights (:meth:`PackedExperts.stack`), from quantized weights
(:meth:`PackedExperts.from_quantized`) or from a float ``[E, N, K]`` weight
(:meth:`PackedExperts.quantize`). :meth:`unpack` is the exact inverse of the packing.
Fractional zero points (``zero_offsets``) are not supported for experts.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .layout import ATOM_K, ATOM_N, atom_bytes, prepack, unpack
from .quantize import dequantize_reference, quantize
from ..dtypes import ActType, WeightType
from .types import PackedProperties, PackedWeight, QuantizedWeight

__all__ = ["PackedExperts"]

#: safetensors metadata "format" of a stacked packed tensor (mixgemm.weights.io)
EXPERTS_FORMAT = "mixgemm.packed_experts"


@dataclasses.dataclass(frozen=True, eq=False)
class PackedExperts(PackedProperties):
    """E prepacked weights of one shape and type, stacked (see the module docstring).

    Attributes
    ----------
    qdata : torch.Tensor
        ``torch.uint8 [E, N/16, K/64, 128*bits]``, contiguous: expert e's prepacked codes.
    scales : torch.Tensor
        ``[E, G, N]`` in the activation dtype (bf16 / fp16), ``G = K // group_size``.
    zeros : torch.Tensor or None
        ``[E, G, N]``, integer-valued, the scales' dtype; asymmetric types only.
    weight_type : WeightType
    group_size : int
    n, k : int
        Every expert's logical shape ``[N, K]``.
    arch : str
    layout_version : int
    """

    def __post_init__(self) -> None:
        self.check_geometry()
        if self.qdata.dim() != 4 or self.qdata.shape[0] < 1:
            raise ValueError(f"qdata must be [E, N/16, K/64, bytes] with E >= 1, got {list(self.qdata.shape)}")
        e = self.qdata.shape[0]
        want = (e, self.n // ATOM_N, self.k // ATOM_K, atom_bytes(self.weight_type.bits))
        if self.qdata.dtype != torch.uint8 or tuple(self.qdata.shape) != want:
            raise ValueError(f"qdata must be uint8 of shape {list(want)}, got {self.qdata.dtype} "
                             f"{list(self.qdata.shape)}")
        g = self.k // self.group_size
        ActType.from_torch(self.scales.dtype)
        if tuple(self.scales.shape) != (e, g, self.n):
            raise ValueError(f"scales must have shape [E, G, N] = {[e, g, self.n]}, got {list(self.scales.shape)}")
        if self.weight_type.has_zero:
            if (self.zeros is None or tuple(self.zeros.shape) != (e, g, self.n)
                    or self.zeros.dtype != self.scales.dtype):
                raise ValueError(f"{self.weight_type.value} experts need zeros of shape {[e, g, self.n]} and "
                                 f"dtype {self.scales.dtype}")
        elif self.zeros is not None:
            raise ValueError(f"{self.weight_type.value} (symmetric) experts have no zeros")
        devices = {t.device for t in (self.qdata, self.scales, self.zeros) if t is not None}
        if len(devices) != 1:
            raise ValueError(f"qdata, scales and zeros must be on one device, got {devices}")

    # ------------------------------------------------------------------------------ properties
    @property
    def num_experts(self) -> int:
        return self.qdata.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scales, self.zeros) if t is not None)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert (codes, scales, zeros): what a kernel reads for an expert it uses."""
        return self.nbytes // self.num_experts

    def __len__(self) -> int:
        return self.num_experts

    def __repr__(self) -> str:
        return (f"PackedExperts(E={self.num_experts}, n={self.n}, k={self.k}, {self.weight_type.value}, "
                f"group_size={self.group_size}, {self.act_type.value}, {self.device})")

    # ------------------------------------------------------------------------------ conversions
    def expert(self, e: int) -> PackedWeight:
        """Expert ``e`` as a :class:`PackedWeight` (views of the stacked tensors)."""
        if isinstance(e, bool) or not isinstance(e, int) or not -self.num_experts <= e < self.num_experts:
            raise IndexError(f"expert index must be an int in [0, {self.num_experts}), got {e!r}")
        return PackedWeight(self.qdata[e], self.scales[e], None if self.zeros is None else self.zeros[e],
                            self.weight_type, self.group_size, self.n, self.k, self.arch, self.layout_version)

    def experts(self) -> list[PackedWeight]:
        return [self.expert(e) for e in range(self.num_experts)]

    def unpack(self) -> list[QuantizedWeight]:
        """Every expert's logical :class:`QuantizedWeight`: the exact inverse of the packing."""
        return [unpack(w) for w in self.experts()]

    def dequantize_reference(self) -> torch.Tensor:
        """``[E, N, K]`` in the activation dtype, expert by expert
        (:func:`mixgemm.dequantize_reference`: exactly what the kernels compute with)."""
        return torch.stack([dequantize_reference(w) for w in self.experts()])

    def to(self, device) -> "PackedExperts":
        return dataclasses.replace(self, qdata=self.qdata.to(device), scales=self.scales.to(device),
                                   zeros=None if self.zeros is None else self.zeros.to(device))

    def metadata(self) -> dict:
        """String metadata describing the stacked tensor (stored in safetensors headers)."""
        return {"format": EXPERTS_FORMAT, "experts": str(self.num_experts), **self.layout_metadata()}

    # ------------------------------------------------------------------------------ constructors
    @classmethod
    def stack(cls, weights: Sequence[PackedWeight]) -> "PackedExperts":
        """Stack E prepacked weights of one shape, type, group size, dtype and device.

        Raises
        ------
        TypeError
            An element is not a PackedWeight.
        ValueError
            No weights; weights that differ in shape, weight type, group size, dtype, arch,
            layout version or device (the message names the first expert that differs); a
            weight with ``zero_offsets``.
        """
        weights = list(weights)
        if not weights:
            raise ValueError("PackedExperts needs at least one expert")
        for e, w in enumerate(weights):
            if not isinstance(w, PackedWeight):
                raise TypeError(f"expert {e} must be a mixgemm.PackedWeight, got {type(w).__name__}")
            if w.zero_offsets is not None:
                raise ValueError(f"expert {e} has zero_offsets (fractional zero points): not supported for experts")
        first = weights[0]
        sig = lambda w: (w.n, w.k, w.weight_type, w.group_size, w.dtype, w.arch, w.layout_version, w.device)  # noqa: E731
        names = ("shape N", "shape K", "weight type", "group size", "dtype", "arch", "layout version", "device")
        for e, w in enumerate(weights[1:], 1):
            for name, a, b in zip(names, sig(first), sig(w)):
                if a != b:
                    a = a.value if isinstance(a, WeightType) else a
                    b = b.value if isinstance(b, WeightType) else b
                    raise ValueError(f"experts must share one shape and type: expert {e} has {name} {b}, "
                                     f"expert 0 has {a}")
        zeros = None if first.zeros is None else torch.stack([w.zeros for w in weights])
        return cls(torch.stack([w.qdata for w in weights]), torch.stack([w.scales for w in weights]), zeros,
                   first.weight_type, first.group_size, first.n, first.k, first.arch, first.layout_version)

    @classmethod
    def from_quantized(cls, weights: Sequence[QuantizedWeight]) -> "PackedExperts":
        """Prepack E quantized weights (:func:`mixgemm.prepack` each) and stack them."""
        weights = list(weights)
        for e, w in enumerate(weights):
            if not isinstance(w, QuantizedWeight):
                raise TypeError(f"expert {e} must be a mixgemm.QuantizedWeight, got {type(w).__name__}")
        return cls.stack([prepack(w) for w in weights])

    @classmethod
    def quantize(cls, w: torch.Tensor, bits: int, group_size: int, symmetric: bool = False,
                 dtype=None) -> "PackedExperts":
        """Quantize a stacked float weight ``[E, N, K]`` expert by expert (:func:`mixgemm.quantize`,
        same arguments) and prepack it. ``N % 16 == 0`` and ``K % 64 == 0``."""
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
        if w.dim() != 3 or w.shape[0] < 1:
            raise ValueError(f"w must be a stacked expert weight [E, N, K] with E >= 1, got shape {tuple(w.shape)}")
        return cls.from_quantized([quantize(w[e], bits, group_size, symmetric, dtype) for e in range(w.shape[0])])
