r"""What a quantized checkpoint's ``config.json`` says: its ``quantization_config``, parsed into
a scheme per layer (:func:`parse_quantization_config`). Needs no transformers. Each format's
rules live in its own module (``formats.awq``, ``formats.gptq``, ``formats.compressed_tensors``,
``formats.native``), reached through :data:`mixgemm.formats.handlers.HANDLERS`.

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
* ``"compressed-tensors"`` with ``format="pack-quantized"`` or ``"int-quantized"`` (a group's own
  ``format`` first): each ``config_groups`` entry's
  ``targets`` (``"Linear"``, a module name or ``"re:regex"``) and ``weights``
  (``num_bits``, ``strategy`` "group" / "channel", ``group_size``), and ``ignore``; ``version``
  (the writer's compressed-tensors version) says how 3/5/6/7-bit codes are packed. A group's
  e4m3 ``input_activations`` (per token, dynamic; or per tensor, static) are recorded in
  :attr:`LayerScheme.activations` (``from_pretrained`` computes with bf16/fp16
  activations unless given ``act_format="fp8"``, with a warning that says so); other activation schemes are ignored with a warning.
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

from typing import Mapping

import torch

from ..dtypes import ActType
from ..errors import CheckpointError
from .handlers import HANDLERS
from .native import MIXGEMM_FORMAT_VERSION
from .registry import Format
from .rules import LayerScheme, QuantizationConfig

__all__ = ["QuantMethod", "LayerScheme", "QuantizationConfig", "MIXGEMM_FORMAT_VERSION", "parse_quantization_config"]

#: The ``quant_method`` of a parsed config is a :class:`~mixgemm.formats.Format` (one of
#: :meth:`Format.quant_methods`); ``QuantMethod`` is the name it had here, kept for callers.
QuantMethod = Format


def parse_quantization_config(qc: Mapping, where: str = "config.json") -> QuantizationConfig:
    """Parse ``config.json``'s ``quantization_config``.

    Raises
    ------
    CheckpointError
        Not a mapping, an unknown ``quant_method``, or a variant mixgemm does not read (AWQ
        GEMV/Marlin packing, GPTQ Marlin/BitBLAS formats, compressed-tensors formats other than
        pack-quantized and int-quantized, float weights, a mixgemm format version from the future).
    """
    if not isinstance(qc, Mapping):
        raise CheckpointError(f"{where}: quantization_config must be a JSON object, got {type(qc).__name__}")
    name = str(qc.get("quant_method", "")).lower().replace("_", "-")
    method = next((m for m in Format.quant_methods() if m.value == name), None)
    if method is None:
        raise CheckpointError(f"{where}: quant_method {qc.get('quant_method')!r} is not supported; "
                              f"mixgemm reads {[m.value for m in Format.quant_methods()]}")
    return HANDLERS[method].parse_config(qc, dict(qc), where)


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
