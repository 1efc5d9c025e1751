"""Each format's rules, from its own module: the one table (:data:`HANDLERS`) that
:mod:`~mixgemm.formats.config` (``quantization_config``), :mod:`~mixgemm.formats.checkpoint`
(state-dict import), :mod:`~mixgemm.formats.dequant` (reference dequantization) and
:mod:`mixgemm.aot.checkpoint` (header scan) dispatch through.

It sits above the format modules (it imports them) and below their users; the facts about each
format (tensor names, aliases, ...) are in :mod:`~mixgemm.formats.registry`, below them all.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

from . import awq, compressed_tensors, gptq, hqq, native
from .registry import Format

__all__ = ["FormatHandlers", "HANDLERS"]


@dataclasses.dataclass(frozen=True)
class FormatHandlers:
    """One format's rules; ``None`` where the format has none.

    Attributes
    ----------
    parse_config : callable or None
        ``(qc, raw, where) -> QuantizationConfig``: its ``quantization_config`` (the formats
        :meth:`Format.quant_methods` lists).
    import_tensors : callable or None
        ``(get, tensors, prefix, *, dtype, bits, group_size, checkpoint_format, symmetric) ->
        ImportedLayer``: a layer of a state dict (the formats :meth:`Format.importable` lists);
        compressed-tensors' also takes ``activations`` (its e4m3 input quantization).
    dequantize : callable or None
        ``(tensors, prefix, scheme) -> torch.Tensor``: the format's own dequantization formula.
    header_layer : callable or None
        ``(prefix, tensors, qconfig, scheme) -> HeaderLayer``: a layer from its tensors' shapes
        in the safetensors headers.
    """

    parse_config: Optional[Callable] = None
    import_tensors: Optional[Callable] = None
    dequantize: Optional[Callable] = None
    header_layer: Optional[Callable] = None


def _of(module, *names: str) -> FormatHandlers:
    return FormatHandlers(**{name: getattr(module, name) for name in names})


_ALL = ("parse_config", "import_tensors", "dequantize", "header_layer")

#: Format -> its module's rules.
HANDLERS: Dict[Format, FormatHandlers] = {
    Format.AWQ: _of(awq, *_ALL),
    Format.GPTQ: _of(gptq, *_ALL),
    Format.COMPRESSED_TENSORS: _of(compressed_tensors, *_ALL),
    Format.HQQ: _of(hqq, "import_tensors"),
    Format.MIXGEMM: _of(native, "parse_config"),
}
