"""A model's QuantLinear layers computed in torch with chosen numerics: the yardstick and the bf16
paths that tests/formats/test_gguf_smollm2.py compares the mixgemm kernels with, and a CPU emulation of
the kernels' own numerics (with faults to inject into it).

Every path computes with the same weight, the one the layer represents exactly,
``w = (q - z) * s + o`` (integer codes ``q - z``, bf16 scales ``s``, float32 zero offsets ``o``
of a GGUF Q4_1 / HQQ import), and differs only in where it rounds to bf16:

* ``FLOAT32``: ``x @ w.T`` in float32, no rounding (the yardstick; the rest of the model in
  float32 too);
* ``MIXGEMM``: what the decode kernels (M <= 32) and :func:`mixgemm.dispatch.plans.add_zero_offsets`
  compute: the float32 sum of the exact products ``x * (q - z) * s`` (the kernel multiplies the
  integer codes and applies the scale to each group's float32 partial sum), rounded to bf16;
  then ``+ xsum @ o`` in float32 (``xsum``: x summed per group) and a second rounding; an
  activation in float32 with one more rounding (:func:`mixgemm.ops.dense._activate`: the zero offsets
  keep the activation out of the kernel);
* ``ONE_ROUNDING``: the exact ``x @ w.T`` in float32, rounded to bf16 once (what a kernel that
  adds the offsets in its epilogue would compute); activation as MIXGEMM;
* ``F_LINEAR``: ``F.linear`` on :func:`mixgemm.dequantize_reference`'s bf16 weight (each weight
  rounded to bf16), float32 accumulation, the output rounded once; activation as MIXGEMM;
* ``BF16_OPS``: as F_LINEAR, with a swiglu the way a plain bf16 model computes it (transformers'
  MLP: ``silu(gate)`` rounded to bf16, times ``up``, rounded again).

The GEMMs are float32 matmuls rounded afterwards (a bf16 GEMM with float32 accumulation, up to the
order of the sum), so the same code runs on the CPU and the GPU (TF32 must be off:
``torch.get_float32_matmul_precision() == "highest"``, torch's default).
"""
from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mixgemm import dequantize_reference
from mixgemm.weights.layout import unpack
from mixgemm.nn import QuantLinear
from mixgemm.weights.quantize import GATE_UP_STRIPE

BF16 = torch.bfloat16


class Numerics(enum.Enum):
    FLOAT32 = "float32"
    MIXGEMM = "mixgemm (emulated)"
    ONE_ROUNDING = "one rounding"
    F_LINEAR = "F.linear"
    BF16_OPS = "bf16 ops"


#: the bf16 paths other than mixgemm's: equally exact computations, the roundings elsewhere
BF16_PATHS = (Numerics.ONE_ROUNDING, Numerics.F_LINEAR, Numerics.BF16_OPS)


@dataclasses.dataclass(frozen=True)
class Parts:
    """One layer's weight, float32: ``codes`` ``[N, K]`` (``q - z``), ``scales`` and ``offsets``
    ``[N, K / group_size]`` (offsets zero when the layer has none)."""
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int


#: a fault: (layer name, its parts) -> the parts a buggy kernel would compute with
Fault = Callable[[str, Parts], Parts]


def parts_of(q: QuantLinear) -> Parts:
    qw = unpack(q.packed)
    codes = qw.qweight.float()
    if qw.zeros is not None:
        codes = codes - _expand(qw.zeros.float(), qw.group_size)
    offsets = torch.zeros_like(qw.scales, dtype=torch.float32) if qw.zero_offsets is None else qw.zero_offsets
    return Parts(codes, qw.scales.float(), offsets.float(), qw.group_size)


def _expand(t: torch.Tensor, g: int) -> torch.Tensor:
    return t.repeat_interleave(g, 1)


def swiglu(y: torch.Tensor, bf16_ops: bool = False) -> torch.Tensor:
    """silu(gate) * up of a gate/up interleaved output (stripes of GATE_UP_STRIPE rows): in float32
    with one rounding (mixgemm's), or in the output's dtype op by op (a plain bf16 model's)."""
    pairs = y.view(*y.shape[:-1], -1, 2, GATE_UP_STRIPE)
    gate, up = pairs[..., 0, :], pairs[..., 1, :]
    r = F.silu(gate) * up if bf16_ops else (F.silu(gate.float()) * up.float()).to(y.dtype)
    return r.reshape(*y.shape[:-1], -1)


class EmulatedLinear(nn.Module):
    """A stand-in for ``q`` (no bias, no input permutation) computing ``numerics``; ``fault``
    changes the weight of the MIXGEMM path only. The weights are held as plain attributes in the
    form the path needs (float32 ``[N, K]``; ``dtype``/``device`` moves go through :meth:`_apply`)."""

    def __init__(self, name: str, q: QuantLinear, numerics: Numerics, fault: Optional[Fault] = None):
        super().__init__()
        if q.bias is not None or q.perm is not None:
            raise ValueError(f"{name}: the emulation covers layers without bias and permutation")
        parts = parts_of(q)
        if fault is not None:
            parts = fault(name, parts)
        g = parts.group_size
        self.numerics, self.activation, self.group_size = numerics, q.activation, g
        product = parts.codes * _expand(parts.scales, g)                  # exact in float32
        if numerics is Numerics.MIXGEMM:
            self.w, self.offsets = product, parts.offsets.T.contiguous()  # [K/g, N]
        elif numerics in (Numerics.F_LINEAR, Numerics.BF16_OPS):
            self.w = dequantize_reference(q.packed).float()
        else:
            self.w = product + _expand(parts.offsets, g)

    def _apply(self, fn, recurse=True):
        # device moves only (fn's device, read off an empty tensor): the weights stay float32
        device = fn(self.w[:0]).device
        self.w = self.w.to(device)
        if self.numerics is Numerics.MIXGEMM:
            self.offsets = self.offsets.to(device)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics is Numerics.FLOAT32:
            y = F.linear(x.float(), self.w)
            return swiglu(y) if self.activation == "swiglu" else y
        y = F.linear(x.float(), self.w).to(BF16)
        if self.numerics is Numerics.MIXGEMM:
            xsum = x.float().reshape(*x.shape[:-1], -1, self.group_size).sum(-1)
            y = (y.float() + xsum @ self.offsets).to(BF16)
        if self.activation == "swiglu":
            y = swiglu(y, bf16_ops=self.numerics is Numerics.BF16_OPS)
        elif self.activation != "none":
            raise ValueError(f"activation {self.activation!r} is not emulated")
        return y


def emulate(model: nn.Module, numerics: Numerics, fault: Optional[Fault] = None) -> nn.Module:
    """A copy of ``model`` (a mixgemm.hf model in bf16) with each QuantLinear replaced by an
    EmulatedLinear of ``numerics``; in float32 for FLOAT32."""
    model = copy.deepcopy(model)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantLinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, EmulatedLinear(name, mod, numerics, fault))
    return (model.float() if numerics is Numerics.FLOAT32 else model).eval()


# ------------------------------------------------------------------------------ faults


def _in(layer: Optional[str], name: str) -> bool:
    return layer is None or name == layer


def scales_shifted(layer: Optional[str] = None) -> Fault:
    """Group j takes group j + 1's scale (the last keeps its own): an off-by-one group index."""
    def f(name, p):
        if not _in(layer, name):
            return p
        s = torch.cat([p.scales[:, 1:], p.scales[:, -1:]], 1)
        return dataclasses.replace(p, scales=s)
    return f


def groups_swapped(layer: Optional[str] = None) -> Fault:
    """Groups 2j and 2j + 1 exchange their codes, scales and offsets: a k-order bug."""
    def f(name, p):
        if not _in(layer, name):
            return p
        g = p.group_size
        n, k = p.codes.shape
        codes = p.codes.view(n, k // (2 * g), 2, g).flip(2).reshape(n, k)
        swap = lambda t: t.view(n, -1, 2).flip(2).reshape(n, -1)  # noqa: E731
        return dataclasses.replace(p, codes=codes, scales=swap(p.scales), offsets=swap(p.offsets))
    return f


def offsets_dropped(layer: Optional[str] = None) -> Fault:
    """The zero offsets' term not added."""
    def f(name, p):
        return dataclasses.replace(p, offsets=torch.zeros_like(p.offsets)) if _in(layer, name) else p
    return f


def offsets_shifted(layer: Optional[str] = None) -> Fault:
    """Group j takes group j + 1's zero offsets (the last keeps its own): an off-by-one group
    index in the offsets' term."""
    def f(name, p):
        if not _in(layer, name):
            return p
        return dataclasses.replace(p, offsets=torch.cat([p.offsets[:, 1:], p.offsets[:, -1:]], 1))
    return f


def zero_off_by_one(layer: Optional[str] = None) -> Fault:
    """Every code one off (``q - z - 1``): a wrong integer zero point."""
    def f(name, p):
        return dataclasses.replace(p, codes=p.codes - 1) if _in(layer, name) else p
    return f


def scales_scaled(factor: float, layer: Optional[str] = None) -> Fault:
    """Every scale times ``factor``."""
    def f(name, p):
        return dataclasses.replace(p, scales=p.scales * factor) if _in(layer, name) else p
    return f
