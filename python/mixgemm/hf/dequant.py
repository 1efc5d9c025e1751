"""The formats' own dequantization formulas: :mod:`mixgemm.formats.dequant`, where they live with
the formats (this name stays for callers)."""
from __future__ import annotations

from ..formats.dequant import dequantize_layer

__all__ = ["dequantize_layer"]
