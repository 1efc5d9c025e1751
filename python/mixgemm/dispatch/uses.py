"""What decides the kernels a layer can launch, as the layer reports it, for building them ahead of
time (:mod:`mixgemm.aot.prebuild`).

A module that launches kernels says which through its ``kernel_uses()`` method
(:class:`LaunchesKernels`): a list of

* :class:`WeightUse`: a packed weight as the GEMM sees it (:class:`mixgemm.nn.QuantLinear`); which of
  its kernels runs depends on the token count too (:func:`mixgemm.dispatch.heuristic.select_spec`);
* :class:`ExpertsUse`: a MoE layer's stacked experts as the grouped kernels see them
  (:class:`mixgemm.nn.moe.QuantMoE`); their kernels depend on the row count;
* :class:`~mixgemm.jit.specs.KernelSpec`: a kernel that does not depend on the token count (the
  RMSNorm of :class:`mixgemm.ops.norm.RMSNorm`, the rotary and the add + RMSNorm of the fused decoder
  layers of :mod:`mixgemm.nn.blocks`).

A module reports only what its own ``forward`` launches, not its children's: the caller walks
``module.modules()``.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Union, runtime_checkable

import torch

from ..dtypes import ActType, WeightType
from ..jit.specs import Activation, KernelSpec
from ..weights.layout import atom_bytes
from ..weights.types import PackedWeight

__all__ = ["WeightUse", "ExpertsUse", "KernelUse", "LaunchesKernels"]


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


#: one kernel use that a module reports (see the module docstring)
KernelUse = Union[WeightUse, ExpertsUse, KernelSpec]


@runtime_checkable
class LaunchesKernels(Protocol):
    """A module that says which kernels its ``forward`` launches (its children's not included)."""

    def kernel_uses(self) -> list[KernelUse]:
        """The :data:`KernelUse` of every kernel this module itself can launch; names left empty
        (the caller knows where the module sits)."""
        ...
