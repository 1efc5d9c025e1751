r"""The formats' own dequantization formulas, for the layers mixgemm keeps in full precision.

:func:`dequantize_layer` evaluates each format's own dequantization formula (in the scales'
dtype), for the layers :func:`mixgemm.formats.import_layer` refuses with
:class:`~mixgemm.errors.UnsupportedLayerError` (a shape the kernels cannot take, 3-bit codes, a
scalar compressed-tensors scale, act-order groups of unequal size): the loader keeps them in full
precision. Each formula lives in its format's module (``dequantize`` in ``formats.awq``,
``formats.gptq``, ``formats.compressed_tensors``), reached through
:data:`mixgemm.formats.handlers.HANDLERS`.
"""
from __future__ import annotations

from typing import Mapping

import torch

from ..errors import FormatError
from .handlers import HANDLERS
from .registry import Format
from .rules import LayerScheme

__all__ = ["dequantize_layer"]


def dequantize_layer(method: Format, tensors: Mapping[str, torch.Tensor], prefix: str,
                     scheme: LayerScheme) -> torch.Tensor:
    """The layer ``prefix``'s weight by its format's own dequantization formula.

    For the layers mixgemm's importers refuse (:class:`~mixgemm.errors.UnsupportedLayerError`);
    the same formulas as :mod:`mixgemm.formats` documents, evaluated in the scales' dtype:

    * AWQ: ``w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]`` (4-bit GEMM packing);
    * GPTQ: ``w[n, k] = s[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])``, codes and zero points as
      little-endian bit streams along K and N (2, 3, 4 and 8 bits), ``z`` the stored value plus one
      for v1, undone as GPTQModel undoes its v1 export (per word with carries as
      :func:`~mixgemm.formats.from_gptq` does; 3-bit per field, modulo 8), so a zero point of 0
      (stored as all ones) reads as 0;
    * compressed-tensors: ``w[n, k] = (q[n, k] - z[n, g]) * s[n, g]`` with signed codes, a
      scalar scale ("tensor" strategy) or any group size; 3, 5, 6 and 7-bit codes packed densely
      (0.18 on) or padded (``32 // bits`` per word, up to 0.17), told apart by the word count
      (where the counts coincide, by the config's ``version``, else refused).

    Parameters
    ----------
    method : Format
        AWQ, GPTQ or COMPRESSED_TENSORS (the config's ``quant_method``).
    tensors : Mapping[str, torch.Tensor]
        The layer's tensors, named ``f"{prefix}.{suffix}"``.
    prefix : str
        The layer's name.
    scheme : LayerScheme
        Bits, group size and (GPTQ) checkpoint format from the config (``None``: inferred).

    Returns
    -------
    torch.Tensor
        ``[N, K]`` (``nn.Linear``'s layout), in the scales' dtype, on the CPU.

    Raises
    ------
    FormatError
        Tensors that do not form a layer of the format.
    """
    formula = HANDLERS[method].dequantize if method in HANDLERS else None
    try:
        if formula is not None:
            return formula(tensors, prefix, scheme)
    except (ValueError, IndexError, RuntimeError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"layer {prefix!r}: cannot dequantize its {method.value} tensors: {e}") from None
    raise ValueError(f"no dequantization formula for {method}")
