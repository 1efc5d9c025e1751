r"""What a quantized checkpoint's ``config.json`` says: its ``quantization_config``, parsed into
a scheme per layer (:func:`parse_quantization_config`). Needs no transformers.

Quantization configs read
-------------------------
``quant_method`` (in ``config.json``'s ``quantization_config``) says how the linear layers are
stored; the bits and group size it gives are checked against each layer's tensors:

* ``"awq"`` (AutoAWQ ``version="gemm"``): ``bits`` / ``w_bit``, ``group_size`` /
  ``q_group_size``, ``modules_to_not_convert``.
* ``"gptq"`` (AutoGPTQ, GPTQModel): ``bits``, ``group_size``, ``checkpoint_format`` (or
  GPTQModel's ``format``): ``"gptq"`` (v1, the default) or ``"gptq_v2"``; ``desc_act``
  checkpoints carry their ``g_idx``; GPTQModel's ``dynamic`` per-module overrides
  (``"+:regex"`` / ``"regex"``: other bits or group size; ``"-:regex"``: not quantized).
* ``"compressed-tensors"`` with ``format="pack-quantized"``: each ``config_groups`` entry's
  ``targets`` (``"Linear"``, a module name or ``"re:regex"``) and ``weights``
  (``num_bits``, ``strategy`` "group" / "channel", ``group_size``), and ``ignore``; ``version``
  (the writer's compressed-tensors version) says how 3/5/6/7-bit codes are packed.
* ``"mixgemm"``: the shards are :func:`mixgemm.save` files (see :data:`MIXGEMM_FORMAT_VERSION`).

The mixgemm checkpoint format
-----------------------------
A directory with a transformers ``config.json`` whose ``quantization_config`` is
``{"quant_method": "mixgemm", "format_version": 1}``, and one or more ``*.safetensors`` files
written by :func:`mixgemm.save` (with a ``model.safetensors.index.json`` when there are several,
as transformers writes it, mapping the files' own tensor names to their file). A quantized
``nn.Linear`` named ``P`` is the packed weight ``P.weight`` (a
:class:`~mixgemm.weights.types.PackedWeight`: its bits, group size and symmetry are in its metadata), with
optional ``P.bias`` and ``P.perm`` (int64 ``[K]``: the layer computes ``x[..., perm] @ W.T``);
every other tensor, including layers kept in full precision, is stored as in the original
checkpoint. ``mixgemm prepack --from FORMAT`` writes such weights from an AWQ, GPTQ or
compressed-tensors checkpoint.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import List, Mapping, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..weights.types import ActType
from .gptq import GPTQCheckpointFormat
from .registry import Format

__all__ = ["QuantMethod", "LayerScheme", "QuantizationConfig", "MIXGEMM_FORMAT_VERSION", "parse_quantization_config"]

#: The ``format_version`` of a mixgemm checkpoint's ``quantization_config`` that this mixgemm
#: writes and reads.
MIXGEMM_FORMAT_VERSION = 1


#: The ``quant_method`` of a parsed config is a :class:`~mixgemm.formats.Format` (one of
#: :meth:`Format.quant_methods`); ``QuantMethod`` is the name it had here, kept for callers.
QuantMethod = Format


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
        GPTQ only: ``"gptq"`` (v1) or ``"gptq_v2"``.
    packing : str or None
        compressed-tensors only: how its writer packed 3, 5, 6 and 7-bit codes, from the
        config's ``version``: ``"padded"`` (``32 // bits`` codes per int32 word, up to 0.17) or
        ``"dense"`` (0.18 on); ``None`` when the config does not say.
    """

    quantized: bool = True
    bits: Optional[int] = None
    group_size: Optional[int] = None
    checkpoint_format: Optional[str] = None
    packing: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class _Rule:
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
    rules: Tuple[_Rule, ...] = ()

    def scheme_for(self, name: str, class_name: str = "Linear") -> LayerScheme:
        """The scheme of the layer ``name`` (an ``nn.Linear`` unless ``class_name`` says
        otherwise)."""
        for rule in self.rules:
            if rule.matches(name, class_name):
                return rule.scheme
        return self.default


def _int_or_none(qc: Mapping, *keys: str) -> Optional[int]:
    for key in keys:
        value = qc.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointError(f"quantization_config {key!r} must be an integer, got {value!r}")
            return value
    return None


def parse_quantization_config(qc: Mapping, where: str = "config.json") -> QuantizationConfig:
    """Parse ``config.json``'s ``quantization_config``.

    Raises
    ------
    CheckpointError
        Not a mapping, an unknown ``quant_method``, or a variant mixgemm does not read (AWQ
        GEMV/Marlin packing, GPTQ Marlin/BitBLAS formats, compressed-tensors formats other than
        pack-quantized, float weights, a mixgemm format version from the future).
    """
    if not isinstance(qc, Mapping):
        raise CheckpointError(f"{where}: quantization_config must be a JSON object, got {type(qc).__name__}")
    name = str(qc.get("quant_method", "")).lower().replace("_", "-")
    method = next((m for m in Format.quant_methods() if m.value == name), None)
    if method is None:
        raise CheckpointError(f"{where}: quant_method {qc.get('quant_method')!r} is not supported; "
                              f"mixgemm reads {[m.value for m in Format.quant_methods()]}")
    raw = dict(qc)
    if method is Format.AWQ:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: AWQ version {qc.get('version')!r} is not supported: mixgemm "
                                  f"reads AutoAWQ's GEMM packing (version 'gemm')")
        default = LayerScheme(bits=_int_or_none(qc, "bits", "w_bit"),
                              group_size=_int_or_none(qc, "group_size", "q_group_size"))
        skip = qc.get("modules_to_not_convert") or []
        rules = tuple(_Rule(str(s), "substring", LayerScheme(quantized=False)) for s in skip)
        return QuantizationConfig(method, raw, default, rules)
    if method is Format.GPTQ:
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        try:
            fmt = GPTQCheckpointFormat.parse(str(fmt)).value
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        default = LayerScheme(bits=_int_or_none(qc, "bits"), group_size=_int_or_none(qc, "group_size"),
                              checkpoint_format=fmt)
        rules = []
        for pattern, override in (qc.get("dynamic") or {}).items():
            pattern = str(pattern)
            if pattern.startswith("-:"):
                rules.append(_Rule(pattern[2:], "regex", LayerScheme(quantized=False)))
                continue
            if pattern.startswith("+:"):
                pattern = pattern[2:]
            override = override if isinstance(override, Mapping) else {}
            bits = _int_or_none(override, "bits")
            gs = _int_or_none(override, "group_size")
            rules.append(_Rule(pattern, "regex", dataclasses.replace(
                default, bits=default.bits if bits is None else bits,
                group_size=default.group_size if gs is None else gs)))
        return QuantizationConfig(method, raw, default, tuple(rules))
    if method is Format.COMPRESSED_TENSORS:
        return _parse_compressed_tensors(qc, raw, where)
    version = qc.get("format_version", MIXGEMM_FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{where}: mixgemm format_version must be a positive integer, got {version!r}")
    if version > MIXGEMM_FORMAT_VERSION:
        raise CheckpointError(f"{where}: mixgemm checkpoint format_version {version} is from the future: this "
                              f"mixgemm reads version {MIXGEMM_FORMAT_VERSION}; upgrade mixgemm")
    return QuantizationConfig(method, raw, LayerScheme())


def _ct_rules(targets, scheme: LayerScheme) -> List[_Rule]:
    rules = []
    for target in targets or []:
        target = str(target)
        if target.startswith("re:"):
            rules.append(_Rule(target[3:], "regex", scheme))
        elif target[:1].isupper() and "." not in target:
            rules.append(_Rule(target, "class", scheme))   # a module class, e.g. "Linear"
        else:
            rules.append(_Rule(target, "name", scheme))
    return rules


#: The first compressed-tensors version that packs 3/5/6/7-bit codes densely.
_CT_DENSE_SINCE = (0, 18)


def _ct_packing(version) -> Optional[str]:
    """``"padded"`` or ``"dense"`` from a compressed-tensors ``version`` string ("0.17.1",
    "0.10.3.a20250101", ...); None when there is none or it does not start with major.minor."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version)) if version is not None else None
    if m is None:
        return None
    return "dense" if (int(m.group(1)), int(m.group(2))) >= _CT_DENSE_SINCE else "padded"


def _parse_compressed_tensors(qc: Mapping, raw: dict, where: str) -> QuantizationConfig:
    fmt = qc.get("format")
    packing = _ct_packing(qc.get("version"))
    rules: List[_Rule] = _ct_rules(qc.get("ignore"), LayerScheme(quantized=False))
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise CheckpointError(f"{where}: compressed-tensors config_groups must be an object")
    for gname, group in groups.items():
        if not isinstance(group, Mapping):
            raise CheckpointError(f"{where}: compressed-tensors config group {gname!r} must be an object")
        weights = group.get("weights")
        if not weights:
            continue
        gfmt = group.get("format") or fmt
        if gfmt != "pack-quantized":
            raise CheckpointError(f"{where}: compressed-tensors format {gfmt!r} (config group {gname!r}) is not "
                                  f"supported: mixgemm reads integer weights in the 'pack-quantized' format")
        if str(weights.get("type", "int")) != "int":
            raise CheckpointError(f"{where}: compressed-tensors config group {gname!r} has {weights.get('type')!r} "
                                  f"weights; mixgemm reads integer ones")
        if group.get("input_activations"):
            warnings.warn(f"mixgemm.hf: {where}: compressed-tensors config group {gname!r} quantizes the input "
                          f"activations; mixgemm computes with bf16/fp16 activations and ignores that",
                          stacklevel=3)
        strategy = str(weights.get("strategy", "group"))
        group_size = {"group": _int_or_none(weights, "group_size"), "channel": -1}.get(strategy)
        scheme = LayerScheme(bits=_int_or_none(weights, "num_bits"), group_size=group_size, packing=packing)
        rules.extend(_ct_rules(group.get("targets"), scheme))
    return QuantizationConfig(Format.COMPRESSED_TENSORS, raw, LayerScheme(quantized=False), tuple(rules))


def resolve_dtype(dtype, raw_config: dict) -> torch.dtype:
    """The activation dtype: ``dtype``, else config.json's ``dtype`` / ``torch_dtype`` if bf16 or
    fp16, else bf16."""
    if dtype is not None:
        try:
            return ActType.parse(dtype).torch_dtype
        except (TypeError, ValueError) as e:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16: {e}") from None
    stored = raw_config.get("dtype") or raw_config.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(stored), torch.bfloat16)
