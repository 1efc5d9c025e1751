"""The element types: :class:`ActType` (activations, scales, zeros and outputs: bf16 or fp16)
and :class:`WeightType` (the integer weight codes: signed or unsigned, 8, 4 or 2 bits).

They are the vocabulary that the data model (:mod:`mixgemm.weights`) and the kernels
(:mod:`mixgemm.jit`) share, so they sit below both and import nothing of mixgemm.
"""
from __future__ import annotations

import enum

import torch


class ActType(enum.Enum):
    """Activation (and scale, zero, output) element type."""

    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self is ActType.BF16 else torch.float16

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "ActType":
        if dtype == torch.bfloat16:
            return cls.BF16
        if dtype == torch.float16:
            return cls.FP16
        raise TypeError(f"activation dtype must be torch.bfloat16 or torch.float16, got {dtype}")

    @classmethod
    def parse(cls, value: "ActType | torch.dtype | str") -> "ActType":
        if isinstance(value, ActType):
            return value
        if isinstance(value, torch.dtype):
            return cls.from_torch(value)
        aliases = {"bf16": cls.BF16, "bfloat16": cls.BF16, "fp16": cls.FP16, "float16": cls.FP16,
                   "half": cls.FP16, "f16": cls.FP16}
        try:
            return aliases[str(value).lower()]
        except KeyError:
            raise ValueError(f"unknown activation dtype {value!r}; use bf16 or fp16") from None


class WeightType(enum.Enum):
    """Integer weight element type. Symmetric quantization uses the signed types (no zero
    point), asymmetric quantization the unsigned ones (with a zero point)."""

    S8 = "s8"
    U8 = "u8"
    S4 = "s4"
    U4 = "u4"
    S2 = "s2"
    U2 = "u2"

    @property
    def bits(self) -> int:
        return int(self.value[1:])

    @property
    def signed(self) -> bool:
        return self.value[0] == "s"

    @property
    def has_zero(self) -> bool:
        return not self.signed

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @classmethod
    def of(cls, bits: int, symmetric: bool) -> "WeightType":
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (8, 4, 2):
            raise ValueError(f"bits must be 8, 4 or 2, got {bits!r}")
        return cls(("s" if symmetric else "u") + str(bits))
