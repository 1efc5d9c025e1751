"""What decides the kernels a layer can launch, for building them ahead of time
(:mod:`mixgemm.aot.prebuild`): a packed weight as the GEMM sees it (:class:`WeightUse`; which of its
kernels runs depends on the token count too, :func:`mixgemm.dispatch.heuristic.select_spec`), and a
MoE layer's stacked experts as the grouped kernels see them (:class:`ExpertsUse`; theirs depend on the
row count).
"""
from __future__ import annotations

import dataclasses
from typing import Union

import torch

from ..dtypes import ActType, WeightType
from ..jit.specs import Activation
from ..weights.layout import atom_bytes
from ..weights.types import PackedWeight

__all__ = ["WeightUse", "ExpertsUse"]


@dataclasses.dataclass(frozen=True)
class WeightUse:
    """One packed weight as the GEMM sees it: what decides its kernels.

    Attributes
    ----------
    n, k : int
        The packed weight's shape ``[N, K]`` (a swiglu weight's N holds gate and up).
    weight_type : WeightType
    act : ActType
        Activation dtype (bf16 / fp16).
    activation : Activation
        What the calls fuse (``QuantLinear.activation``).
    zero_offsets : bool
        Whether the weight has zero offsets (then its activation runs after the kernel).
    name : str
        Where it comes from (messages only; not compared).
    """

    n: int
    k: int
    weight_type: WeightType
    act: ActType
    activation: Activation = Activation.NONE
    zero_offsets: bool = False
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        self.meta_weight()   # the PackedWeight checks: N % 16, K % 64, ...

    @property
    def kernel_activation(self) -> Activation:
        """The activation the kernel itself fuses (none when zero offsets come first)."""
        return Activation.NONE if self.zero_offsets else self.activation

    def meta_weight(self) -> PackedWeight:
        """A PackedWeight of this shape and types on the meta device (no memory): what
        :func:`mixgemm.ops.select_spec` reads."""
        where = f" ({self.name})" if self.name else ""
        if self.n <= 0 or self.k <= 0 or self.n % 16 or self.k % 64:
            raise ValueError(f"a packed weight needs N % 16 == 0 and K % 64 == 0, got N={self.n}, K={self.k}{where}")
        meta = torch.device("meta")
        dtype = self.act.torch_dtype
        scales = torch.empty((1, self.n), dtype=dtype, device=meta)
        return PackedWeight(
            qdata=torch.empty((self.n // 16, self.k // 64, atom_bytes(self.weight_type.bits)), dtype=torch.uint8,
                              device=meta),
            scales=scales, zeros=torch.empty_like(scales) if self.weight_type.has_zero else None,
            weight_type=self.weight_type, group_size=self.k, n=self.n, k=self.k)

    @classmethod
    def of_packed(cls, w: PackedWeight, activation: Union[str, Activation] = "none", name: str = "") -> "WeightUse":
        return cls(w.n, w.k, w.weight_type, w.act_type, Activation(activation), w.zero_offsets is not None, name)


@dataclasses.dataclass(frozen=True)
class ExpertsUse:
    """A MoE layer's stacked experts as the grouped kernels see them: ``num_experts`` experts of
    gate/up ``[2 * intermediate, hidden]`` (interleaved, swiglu) and down ``[hidden, intermediate]``,
    of one weight type and activation dtype. ``name``: where they come from (messages only)."""

    num_experts: int
    hidden: int
    intermediate: int
    weight_type: WeightType
    act: ActType
    name: str = dataclasses.field(default="", compare=False)

    @classmethod
    def of_layer(cls, layer, name: str = "") -> "ExpertsUse":
        """From a :class:`~mixgemm.nn.moe.QuantMoE`."""
        w13 = layer.experts("w13")
        return cls(layer.num_experts, layer.hidden_size, layer.intermediate_size, w13.weight_type, w13.act_type, name)
