r"""Importers for third-party quantized checkpoints: AutoAWQ, GPTQ, compressed-tensors, HQQ,
and llama.cpp's GGUF files.

One module per format, named after it, holding all that format's rules: its converter, its
``quantization_config`` rules (``parse_config``), a layer of a state dict (``import_tensors``),
its own dequantization formula (``dequantize``) and its safetensors header rule
(``header_layer``); the converters are importable from this package:

* ``formats.awq``: :func:`from_awq` (AutoAWQ ``version="GEMM"``);
* ``formats.gptq``: :func:`from_gptq`, :class:`GPTQCheckpointFormat`;
* ``formats.compressed_tensors``: :func:`from_compressed_tensors` (``pack-quantized`` and
  ``int-quantized``);
* ``formats.hqq``: :func:`from_hqq` (fractional zero points included);
* ``formats.gguf``: :func:`from_gguf` (a whole ``.gguf`` file: Q8_0, Q4_0, Q4_1 tensors),
  :func:`gguf_name_to_hf`, :func:`undo_llama_rope_permutation` (its accuracy is documented
  there);
* ``formats.checkpoint``: state dicts of the safetensors formats: :class:`Format`,
  :func:`detect_format`, :func:`import_layer`, :func:`import_checkpoint`;
* ``formats.common``: what the converters share (:class:`ImportedLayer`, the checks);
* ``formats.registry``: the one :class:`Format` enum and the table of per-format facts
  (:data:`~mixgemm.formats.registry.FORMATS`: marker and companion tensors, aliases, whether a
  format imports and whether it is a ``quant_method``) that the modules here, ``mixgemm.hf`` and
  ``mixgemm.aot`` read;
* ``formats.native``: mixgemm's own checkpoints (``quant_method`` ``"mixgemm"``);
* ``formats.rules``: what the formats' rules share (:class:`~mixgemm.formats.rules.LayerScheme`,
  :class:`~mixgemm.formats.rules.QuantizationConfig`, what a header rule returns);
* ``formats.handlers``: the one table (:data:`~mixgemm.formats.handlers.HANDLERS`) from each
  :class:`Format` to its module's rules, above the format modules;
* ``formats.config``: a ``config.json``'s ``quantization_config``;
* ``formats.dequant``: each format's own dequantization formula, for the layers kept in full
  precision.

Each converter turns one layer of a source format into mixgemm's logical
:class:`~mixgemm.weights.types.QuantizedWeight` **without re-quantizing**: the integer codes, scales
and zero points are carried over as they are; only their packing and, where necessary, their
sign convention change. mixgemm dequantizes::

    symmetric:   w[n, k] = q[n, k] * s[n, g]                 q signed,   [-2^(b-1), 2^(b-1)-1]
    asymmetric:  w[n, k] = (q[n, k] - z[n, g]) * s[n, g]     q unsigned, [0, 2^b-1], z integer

in the activation dtype (bf16 or fp16), with ``g = k // group_size``. Every source format
covered here has the same shape of formula, ``(q - z) * s`` with integer ``q`` and ``z``, so
the conversion is exact, and so is the dequantized weight:

Bit-exactness
-------------
With ``dtype`` equal to the dtype the checkpoint stores its scales in (the default), the
weight that :func:`mixgemm.dequantize_reference` computes from an imported layer equals the
source format's own dequantization formula, evaluated in that dtype, **bit for bit**: both
sides form the exact integer ``q - z`` (``|q - z| <= 255`` is exact in bf16 and fp16), and
round its product with the scale to nearest-even once. The exceptions are the formats with
a floating-point zero point, HQQ with fractional zero points and GGUF's Q4_1 (``q * d + m``):
imported with an integer zero point plus a float32 offset per (row, group), within 2 ulp of
``2^b * |scale|`` of HQQ's formula (see :func:`from_hqq`), and within the bounds documented
in :mod:`mixgemm.formats.gguf` of GGUF's.

If ``dtype`` differs from the checkpoint's scale dtype, the scales are first rounded to
``dtype`` (to nearest-even). That is exact when they are representable in it: bf16 scales in
``[2^-17, 65280]`` always are in fp16; fp16 scales are in bf16 only when they have at most 8
significant bits. The result is then ``fl((q - z) * fl(s))``, within a relative ``2u + u^2``
of the exact ``(q - z) * s`` (``u = 2^-8`` for bf16, ``2^-11`` for fp16) while nothing under-
or overflows; the source evaluated in its own dtype is within ``u_src`` of the exact value, so
the two differ by at most ``(2u + u^2 + u_src) * |(q - z) * s|`` (for an fp16 checkpoint
imported as bf16: ``(2^-7 + 2^-16 + 2^-11) * |w|``, about 0.84%).

Symmetric or asymmetric
-----------------------
Several formats always store a zero point (GPTQ with ``sym=True`` stores ``z = 2^(b-1)``).
A layer whose zero points all equal ``2^(b-1)`` (in the unsigned convention) is exactly the
symmetric layer with codes ``q - 2^(b-1)``; ``symmetric=None`` (the default of every converter)
picks the symmetric, zero-free representation then (its kernels skip the zero point) and the
asymmetric one otherwise; ``True`` insists on it (and refuses other zero points), ``False``
keeps zero points (adding ``2^(b-1)`` ones where the source has none). All three are exact.

Act-order (GPTQ ``desc_act``, compressed-tensors ``actorder="group"``)
----------------------------------------------------------------------
mixgemm's groups are runs of ``group_size`` consecutive K elements. A ``g_idx`` that assigns
the K columns to groups in another order is handled exactly by a permutation of K: the
converter returns ``perm`` (int64 ``[K]``) and the weight's columns in the order
``W_mixgemm[:, j] = W_source[:, perm[j]]``, so that ``x[..., perm] @ W_mixgemm.T ==
x @ W_source.T``. **The caller must apply ``x[..., perm]`` to the activations** (or fold
``perm`` into the previous layer); :meth:`ImportedLayer.permute_input` does it. When the
groups are already contiguous (only their labels out of order), the scales are reordered
instead and ``perm`` is ``None``. A ``g_idx`` whose groups are not all of the same size cannot
be made contiguous groups of equal size and is refused.

Tensor parallelism
------------------
Every converter (and :func:`import_layer`) takes ``tp_rank``, ``tp_size`` and ``tp_dim``: with
``tp_size > 1`` it returns the rank's shard of the layer (:meth:`ImportedLayer.shard`): rows
``tp_rank * N/tp_size ..`` for ``tp_dim=0`` (column parallel, whole 16-row atoms; ``tp_sections``
slices a fused q/k/v layer section by section), columns ``tp_rank * K/tp_size ..`` for
``tp_dim=1`` (row parallel, whole 64-column atoms and whole groups). The whole layer is
converted on the CPU first (its codes are cut only after unpacking), then only the slice is
kept; nothing is re-quantized, and the shard equals the same slice of the whole layer's import.
A split the layer cannot take raises :class:`~mixgemm.errors.ShardError`.

Errors
------
Tensors that do not form a valid layer (missing companions, wrong shapes or dtypes, bits that
contradict the shapes, N not a multiple of 16 or K of 64, ...) raise :class:`FormatError`, a
``ValueError`` naming the layer. Valid source layers that mixgemm cannot represent exactly
(HQQ ``axis=0``, 3-bit codes, ...) raise
:class:`UnsupportedLayerError`, which is both a ``FormatError`` and a ``NotImplementedError``.
"""
from __future__ import annotations

from ..errors import FormatError, ShardError, UnsupportedLayerError
from .awq import from_awq
from .checkpoint import detect_format, import_checkpoint, import_layer
from .common import DTypeLike, ImportedLayer  # noqa: F401  (DTypeLike: for annotations)
from .compressed_tensors import from_compressed_tensors
from .gguf import from_gguf, gguf_name_to_hf, undo_llama_rope_permutation
from .gptq import GPTQCheckpointFormat, from_gptq
from .hqq import from_hqq
from .registry import Format

__all__ = [
    "Format", "GPTQCheckpointFormat", "FormatError", "ShardError", "UnsupportedLayerError", "ImportedLayer",
    "from_awq", "from_gptq", "from_compressed_tensors", "from_hqq",
    "detect_format", "import_layer", "import_checkpoint",
    "from_gguf", "gguf_name_to_hf", "undo_llama_rope_permutation",
]
