"""What each format's rules share: the scheme a ``quantization_config`` gives a layer
(:class:`LayerScheme`, :class:`Rule`, :class:`QuantizationConfig`), read by each format's
``parse_config`` and ``dequantize``; and what a format's ``header_layer`` finds from a
checkpoint's safetensors headers (:class:`HeaderLayer`, :class:`SkipLayer`), read by
:mod:`mixgemm.aot.checkpoint`.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional, Tuple

from ..dtypes import WeightType
from ..errors import CheckpointError, UserError
from .registry import Format

__all__ = ["LayerScheme", "Rule", "QuantizationConfig", "config_int", "HeaderLayer", "SkipLayer",
           "header_shape", "header_group", "kernel_bits"]


@dataclasses.dataclass(frozen=True)
class LayerScheme:
    """How the config says one linear layer is stored.

    Attributes
    ----------
    quantized : bool
        False when the config keeps the layer in full precision (its tensors must say so too).
    bits, group_size : int or None
        From the config; ``None``: inferred from the tensors. ``group_size=-1``: per-channel.
    checkpoint_format : str or None
        GPTQ: ``"gptq"`` (v1) or ``"gptq_v2"``; compressed-tensors: the config group's layout,
        ``"pack-quantized"`` (``weight_packed``) or ``"int-quantized"`` (an int8 ``weight``).
    packing : str or None
        compressed-tensors only: how its writer packed 3, 5, 6 and 7-bit codes, from the
        config's ``version``: ``"padded"`` (``32 // bits`` codes per int32 word, up to 0.17) or
        ``"dense"`` (0.18 on); ``None`` when the config does not say.
    activations : str or None
        compressed-tensors only: the layer's e4m3 input quantization, ``"fp8-token"`` or
        ``"fp8-tensor"`` (:func:`mixgemm.formats.compressed_tensors.activation_scheme`); None
        when the config quantizes the weights alone (or activations mixgemm does not compute).
    """

    quantized: bool = True
    bits: Optional[int] = None
    group_size: Optional[int] = None
    checkpoint_format: Optional[str] = None
    packing: Optional[str] = None
    activations: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One per-layer rule of a config: the layers it matches get its scheme."""

    pattern: str              # a regular expression (re.match on the module name) or an exact name
    kind: str                 # "regex", "name", "class", "substring"
    scheme: LayerScheme

    def matches(self, name: str, class_name: str) -> bool:
        if self.kind == "regex":
            return re.match(self.pattern, name) is not None
        if self.kind == "class":
            return class_name == self.pattern
        if self.kind == "substring":
            return self.pattern in name
        return name == self.pattern


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """A parsed ``quantization_config``: the method and a scheme per layer (first matching rule,
    else ``default``)."""

    method: Format
    raw: dict
    default: LayerScheme
    rules: Tuple[Rule, ...] = ()

    def scheme_for(self, name: str, class_name: str = "Linear") -> LayerScheme:
        """The scheme of the layer ``name`` (an ``nn.Linear`` unless ``class_name`` says
        otherwise)."""
        for rule in self.rules:
            if rule.matches(name, class_name):
                return rule.scheme
        return self.default


def config_int(qc: Mapping, *keys: str) -> Optional[int]:
    """The first of ``keys`` that ``qc`` sets, an integer; None when it sets none."""
    for key in keys:
        value = qc.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointError(f"quantization_config {key!r} must be an integer, got {value!r}")
            return value
    return None


# ---------------------------------------------------------------------------------------------
# Header rules: a layer from its tensors' shapes ({name: (shape, safetensors dtype)})
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeaderLayer:
    """What a format's ``header_layer`` reads of one quantized layer from its tensors' shapes."""

    n: int
    k: int
    weight_type: WeightType
    group_size: Optional[int]


class SkipLayer(Exception):
    """A layer the kernels cannot take: the loader keeps it in full precision."""


def header_shape(tensors: dict, key: str, ndim: int) -> tuple:
    """The shape of the tensor ``key``, which must have ``ndim`` dimensions."""
    if key not in tensors:
        raise UserError(f"{key.rpartition('.')[0]}: missing the tensor {key!r}")
    shape = tensors[key][0]
    if len(shape) != ndim:
        raise UserError(f"{key}: expected {ndim} dimensions, got {list(shape)}")
    return shape


def header_group(k: int, groups: int) -> Optional[int]:
    """The group size of ``groups`` groups along ``k``; None when they do not divide it."""
    return k // groups if groups and k % groups == 0 else None


def kernel_bits(bits: int) -> int:
    """``bits`` if the kernels take it (2, 4, 8); else :class:`SkipLayer`."""
    if bits not in (2, 4, 8):
        raise SkipLayer(f"{bits}-bit codes")
    return bits
