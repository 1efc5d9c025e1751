"""mixgemm's own checkpoints (``quant_method`` ``"mixgemm"``, :func:`mixgemm.save` files; the
format is described in :mod:`mixgemm.formats.config`): the config rule (:func:`parse_config`)
and the ``format_version`` this mixgemm writes and reads (:data:`MIXGEMM_FORMAT_VERSION`). Its
layers are packed weights already: nothing to import or dequantize."""
from __future__ import annotations

from typing import Mapping

from ..errors import CheckpointError
from .registry import Format
from .rules import LayerScheme, QuantizationConfig

__all__ = ["MIXGEMM_FORMAT_VERSION", "parse_config"]

#: The ``format_version`` of a mixgemm checkpoint's ``quantization_config`` that this mixgemm
#: writes and reads.
MIXGEMM_FORMAT_VERSION = 1


def parse_config(qc: Mapping, raw: dict, where: str) -> QuantizationConfig:
    """A ``"mixgemm"`` ``quantization_config``: its ``format_version`` must not be from the
    future."""
    version = qc.get("format_version", MIXGEMM_FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{where}: mixgemm format_version must be a positive integer, got {version!r}")
    if version > MIXGEMM_FORMAT_VERSION:
        raise CheckpointError(f"{where}: mixgemm checkpoint format_version {version} is from the future: this "
                              f"mixgemm reads version {MIXGEMM_FORMAT_VERSION}; upgrade mixgemm")
    return QuantizationConfig(Format.MIXGEMM, raw, LayerScheme())
