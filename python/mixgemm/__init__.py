"""mixgemm: CUTLASS-based mixed-input GEMMs (bf16/fp16 x int8/int4/int2) for NVIDIA Hopper.

Offline: :func:`quantize` (or :mod:`mixgemm.formats` importers) -> :func:`prepack` -> :func:`save`.
Online: :func:`load` -> :func:`gemm` (``y = x @ dequant(w).T``), :func:`dequantize`, :func:`supports`.
Nothing is built or loaded at import time; kernels are compiled on first use or ahead of time
(``mixgemm generate --build``).
"""
from ._version import __version__
from .types import ActType, PackedWeight, QuantizedWeight, WeightType, LAYOUT_VERSION
from .layout import prepack, unpack
from .quantize import quantize, dequantize_reference
from .io import save, load
from .ops import gemm, dequantize, supports
from .norm import rms_norm
from .rotary import rotary_kv_cache

__all__ = ["__version__", "ActType", "PackedWeight", "QuantizedWeight", "WeightType", "LAYOUT_VERSION",
           "prepack", "unpack", "quantize", "dequantize_reference", "save", "load", "gemm", "dequantize",
           "supports", "rms_norm", "rotary_kv_cache"]
