"""The checkpoint formats mixgemm knows, and what each is: one :class:`Format` enum and one
table of per-format facts (:data:`FORMATS`), which the importers (:mod:`~mixgemm.formats.checkpoint`),
the ``quantization_config`` parser (:mod:`~mixgemm.formats.config`), the reference dequantizer
(:mod:`~mixgemm.formats.dequant`) and the header scan (:mod:`mixgemm.aot.checkpoint`) all read.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Dict, Tuple

__all__ = ["Format", "FormatSpec", "FORMATS", "HQQ_META_KEYS"]

#: Meta entries an HQQLinear state dict holds next to ``W_q`` (``state_dict_keys``).
HQQ_META_KEYS = ("nbits", "group_size", "shape", "axis", "packing", "unpack_view_dtype",
                  "view_as_float", "compute_dtype", "channel_wise", "optimize", "round_zero",
                  "quant_scale", "quant_zero", "offload_meta", "encoded_state_dict",
                  "stores_quant_config", "zero_scale", "meta_zero", "meta_scale")


class Format(str, enum.Enum):
    """Checkpoint formats: those :func:`~mixgemm.formats.import_layer` and
    :func:`~mixgemm.formats.import_checkpoint` read (:meth:`importable`), and mixgemm's own
    (``quant_method`` ``"mixgemm"``, :func:`mixgemm.save` files), which needs no import."""

    #: AutoAWQ ``version="GEMM"`` layers: ``qweight``, ``qzeros``, ``scales``.
    AWQ = "awq"
    #: GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` "gptq" or "gptq_v2"): ``qweight``,
    #: ``qzeros``, ``scales``, ``g_idx``.
    GPTQ = "gptq"
    #: compressed-tensors ``format="pack-quantized"``: ``weight_packed``, ``weight_scale``,
    #: ``weight_shape``, optional ``weight_zero_point`` and ``weight_g_idx``; or
    #: ``"int-quantized"``: an int8 ``weight`` (the codes unpacked) in place of ``weight_packed``
    #: and ``weight_shape``.
    COMPRESSED_TENSORS = "compressed-tensors"
    #: HQQ ``HQQLinear`` state dicts: ``W_q``, ``scale``, ``zero`` and the meta entries.
    HQQ = "hqq"
    #: mixgemm's own checkpoints (:func:`mixgemm.save`): ``P.weight`` is a packed weight.
    MIXGEMM = "mixgemm"

    def __str__(self) -> str:
        return self.value

    @property
    def spec(self) -> "FormatSpec":
        """This format's facts (:data:`FORMATS`)."""
        return FORMATS[self]

    @property
    def primary(self) -> str:
        """The tensor (suffix) that marks a quantized layer ``P``: ``P.<primary>``."""
        return FORMATS[self].primary

    @classmethod
    def importable(cls) -> Tuple["Format", ...]:
        """The formats whose layers :func:`~mixgemm.formats.import_layer` converts."""
        return tuple(f for f in cls if FORMATS[f].importable)

    @classmethod
    def quant_methods(cls) -> Tuple["Format", ...]:
        """The formats whose ``quantization_config["quant_method"]`` :func:`mixgemm.hf.from_pretrained`
        reads."""
        return tuple(f for f in cls if FORMATS[f].quant_method)

    @classmethod
    def parse(cls, value: "Format | str") -> "Format":
        """An importable :class:`Format` from itself or a name (case-insensitive; ``"autoawq"``,
        ``"pack-quantized"``, ``"compressed_tensors"`` and ``"ct"`` are accepted too)."""
        if isinstance(value, Format) and FORMATS[value].importable:
            return value
        for f in cls.importable():
            if str(value).lower() in FORMATS[f].aliases:
                return f
        raise ValueError(f"unknown checkpoint format {value!r}; use one of "
                         f"{[f.value for f in cls.importable()]}")


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """What one format is.

    Attributes
    ----------
    primary : str
        The tensor suffix that marks a quantized layer (``P.<primary>``).
    companions : tuple of str
        The tensor suffixes one layer may have (the primary included).
    orphans : tuple of str
        Suffixes that only occur next to the primary: seen alone, they are an error.
    aliases : tuple of str
        Lower-case names :meth:`Format.parse` accepts.
    importable : bool
        Its layers convert to mixgemm's (:func:`~mixgemm.formats.import_layer`).
    quant_method : bool
        :func:`mixgemm.hf.from_pretrained` reads it as a ``quant_method``.
    g_idx : str or None
        The act-order group index's suffix, where the format has one.
    """

    primary: str
    companions: Tuple[str, ...] = ()
    orphans: Tuple[str, ...] = ()
    aliases: Tuple[str, ...] = ()
    importable: bool = True
    quant_method: bool = True
    g_idx: "str | None" = None


#: The one table of per-format facts.
FORMATS: Dict[Format, FormatSpec] = {
    Format.AWQ: FormatSpec(
        "qweight", ("qweight", "qzeros", "scales"), ("qzeros", "scales", "g_idx"),
        ("awq", "autoawq", "awq-gemm"), g_idx="g_idx"),
    Format.GPTQ: FormatSpec(
        "qweight", ("qweight", "qzeros", "scales", "g_idx"), ("qzeros", "scales", "g_idx"),
        ("gptq",), g_idx="g_idx"),
    Format.COMPRESSED_TENSORS: FormatSpec(
        "weight_packed", ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
        ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
        ("compressed-tensors", "compressed_tensors", "pack-quantized", "ct"), g_idx="weight_g_idx"),
    Format.HQQ: FormatSpec(
        "W_q", ("W_q", "scale", "zero") + HQQ_META_KEYS,
        ("nbits", "packing", "unpack_view_dtype", "encoded_state_dict", "stores_quant_config"),
        ("hqq",), quant_method=False),
    Format.MIXGEMM: FormatSpec("weight", importable=False),
}
