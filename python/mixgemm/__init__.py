"""mixgemm: CUTLASS-based mixed-input GEMMs (bf16/fp16 x int8/int4/int2) for NVIDIA Hopper.

Offline: :func:`quantize` (or :mod:`mixgemm.formats` importers) -> :func:`prepack` -> :func:`save`.
Online: :func:`load` -> :func:`gemm` (``y = x @ dequant(w).T``), :func:`dequantize`, :func:`supports`.
Nothing is built or loaded at import time; kernels are compiled on first use or ahead of time
(``mixgemm generate --build``).

The subpackages a user reaches by attribute (``mixgemm.nn.QuantLinear``, ``mixgemm.moe.fused_moe``,
``mixgemm.formats.from_awq``, ...) are imported on first access (PEP 562), so ``import mixgemm``
stays light and ``mixgemm.nn`` works without its own import statement.
"""
import importlib as _importlib
from ._version import __version__
from .dtypes import ActType, WeightType
from .weights.types import PackedWeight, QuantizedWeight, LAYOUT_VERSION
from .weights.layout import prepack, unpack
from .weights.quantize import quantize, dequantize_reference
from .weights.io import save, load
from .ops.dense import gemm, dequantize, supports
from .ops.norm import rms_norm
from .ops.rotary import rotary_kv_cache

__all__ = ["__version__", "ActType", "PackedWeight", "QuantizedWeight", "WeightType", "LAYOUT_VERSION",
           "prepack", "unpack", "quantize", "dequantize_reference", "save", "load", "gemm", "dequantize",
           "supports", "rms_norm", "rotary_kv_cache"]

#: submodules imported on first attribute access (``mixgemm.nn``): the public ones that
#: ``import mixgemm`` does not load itself
_LAZY_SUBMODULES = frozenset({"aot", "bench", "dispatch", "formats", "hf", "jit", "moe", "nn"})
#: documented attribute paths of modules that moved into a subpackage: ``mixgemm.prebuild.build_for``
_MOVED = {"build": "jit.build", "prebuild": "aot.prebuild", "specs": "jit.specs",
          "tensor_parallel": "nn.parallel"}


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:   # the import binds the submodule on the package: called once per name
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _MOVED:
        return _importlib.import_module(f"{__name__}.{_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _LAZY_SUBMODULES | set(_MOVED))
