"""State-dict level import of the safetensors formats (AWQ, GPTQ, compressed-tensors, HQQ):
:class:`Format`, :func:`detect_format`, :func:`import_layer` and :func:`import_checkpoint`. Each
format's converter is its module's ``import_tensors``, reached through
:data:`mixgemm.formats.handlers.HANDLERS`."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple, Union

import torch

from ..errors import UnsupportedLayerError
from ..weights.layout import prepack
from ..weights.quantize import FLOAT8_DTYPES
from ..weights.types import PackedWeight
from .common import DTypeLike, ImportedLayer, layer_error, tensor_key, shard_imported
from .gptq import GPTQCheckpointFormat
from .handlers import HANDLERS
from .registry import Format


def detect_format(tensors: Mapping[str, torch.Tensor], prefix: str) -> Format:
    """Which format the layer ``prefix`` of a state dict is stored in.

    Parameters
    ----------
    tensors : Mapping[str, torch.Tensor]
        A state dict (e.g. from ``safetensors.torch.load_file``).
    prefix : str
        The layer's name, e.g. ``"model.layers.0.mlp.down_proj"`` (``""``: no prefix).

    Returns
    -------
    Format
        (a ``str`` enum): ``HQQ`` if ``<prefix>.W_q`` exists, ``COMPRESSED_TENSORS`` for
        ``<prefix>.weight_packed``, and for ``<prefix>.qweight`` ``GPTQ`` if it is
        ``[K*bits/32, N]`` (N from ``<prefix>.scales``), ``AWQ`` if it is ``[K, N/8]``.

    Raises
    ------
    FormatError
        No quantized weight under ``prefix``, or a ``qweight`` whose shape fits neither.
    """
    if tensor_key(prefix, "W_q") in tensors:
        return Format.HQQ
    if tensor_key(prefix, "weight_packed") in tensors:
        return Format.COMPRESSED_TENSORS
    qkey = tensor_key(prefix, "qweight")
    if qkey in tensors:
        skey = tensor_key(prefix, "scales")
        if skey not in tensors:
            raise layer_error(prefix, f"has {qkey!r} but no {skey!r}")
        qweight, scales = tensors[qkey], tensors[skey]
        if isinstance(qweight, torch.Tensor) and isinstance(scales, torch.Tensor) \
                and qweight.dim() == 2 and scales.dim() == 2:
            n = scales.shape[1]
            if qweight.shape[1] == n:
                return Format.GPTQ
            if qweight.shape[1] * 8 == n:
                return Format.AWQ
        raise layer_error(prefix, f"qweight {_shape_of(qweight)} with scales {_shape_of(scales)} is "
                           f"neither GPTQ ([K*bits/32, N]) nor AutoAWQ GEMM ([K, N/8])")
    raise layer_error(prefix, "no quantized weight found: expected one of "
                       f"{[tensor_key(prefix, p) for p in dict.fromkeys(f.primary for f in Format.importable())]}")


def _shape_of(t: Any) -> Any:
    return list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _get(tensors: Mapping, prefix: str, suffix: str, fmt: Format, required: bool = True):
    key = tensor_key(prefix, suffix)
    if key in tensors:
        return tensors[key]
    if required:
        raise layer_error(prefix, f"{fmt.value} layer is missing its companion tensor {key!r}")
    return None


def import_layer(fmt: Union[Format, str, None], tensors: Mapping[str, torch.Tensor],
                 prefix: str, dtype: DTypeLike = None, *, bits: Optional[int] = None,
                 group_size: Optional[int] = None,
                 checkpoint_format: Union[GPTQCheckpointFormat, str, None] = None,
                 symmetric: Optional[bool] = None, tp_rank: int = 0, tp_size: int = 1, tp_dim: int = 0,
                 tp_sections: Optional[Tuple[int, ...]] = None, activations: Optional[str] = None) -> ImportedLayer:
    """Convert the layer ``prefix`` of a loaded state dict.

    Parameters
    ----------
    fmt : Format or str or None
        The checkpoint format; ``None`` or ``"auto"``: :func:`detect_format`.
    tensors : Mapping[str, torch.Tensor]
        The state dict (names as in the checkpoint, e.g. ``"<prefix>.qweight"``).
    prefix : str
        The layer's name (``""`` for none).
    dtype : torch.dtype or str, optional
        Activation dtype (bf16/fp16); default the layer's scale dtype.
    bits, group_size : int, optional
        From the checkpoint's quantization config; inferred from the shapes when ``None``
        and checked against them otherwise. Not used for HQQ (read from its meta data).
    checkpoint_format : GPTQCheckpointFormat or str
        GPTQ only, and required there: ``"gptq"`` (v1) or ``"gptq_v2"``, see
        :func:`from_gptq`.
    symmetric : bool, optional
        See the module docstring.
    tp_rank, tp_size, tp_dim : int
        Tensor parallelism (module docstring, :meth:`ImportedLayer.shard`): with ``tp_size >
        1`` the rank's shard of the layer, bias included, along ``tp_dim``.
    tp_sections : tuple of int, optional
        ``tp_dim=0``: the row sections of a fused layer (q/k/v), each split on its own.
    activations : {None, "fp8-token", "fp8-tensor"}
        compressed-tensors only: the layer's e4m3 input quantization, from its config group's
        ``input_activations`` (:func:`mixgemm.formats.compressed_tensors.activation_scheme`);
        ``"fp8-tensor"`` reads ``<prefix>.input_scale``. None: the weights alone.

    Returns
    -------
    ImportedLayer
        The weight, the K permutation (act-order only), ``<prefix>.bias`` if present, and the
        activation format and static input scale when ``activations`` is given.

    Raises
    ------
    FormatError
        Unrecognised or inconsistent tensors, naming the layer (see the converters).
    UnsupportedLayerError
        Valid layers mixgemm cannot represent exactly.
    """
    fmt = detect_format(tensors, prefix) if fmt is None or fmt == "auto" else Format.parse(fmt)
    extra = {}
    if activations is not None:       # checkpoints of the other formats quantize weights alone
        if fmt is not Format.COMPRESSED_TENSORS:
            raise ValueError(f"activations={activations!r}: e4m3 input activations are read from compressed-tensors "
                             f"checkpoints only, this layer is {fmt.value}")
        extra["activations"] = activations
    get = lambda suffix, required=True: _get(tensors, prefix, suffix, fmt, required)  # noqa: E731
    layer = HANDLERS[fmt].import_tensors(get, tensors, prefix, dtype=dtype, bits=bits, group_size=group_size,
                                         checkpoint_format=checkpoint_format, symmetric=symmetric, **extra)
    bias = tensors.get(tensor_key(prefix, "bias"))
    layer = dataclasses.replace(layer, bias=bias) if bias is not None else layer
    return shard_imported(layer, prefix, tp_rank, tp_size, tp_dim, tp_sections)


def _split(key: str) -> Tuple[str, str]:
    prefix, _, last = key.rpartition(".")
    return prefix, last


def _refuse_fp8(tensors: Mapping[str, torch.Tensor]) -> None:
    """An fp8 tensor (a compressed-tensors "float-quantized" layer's weight, with its
    ``weight_scale``; any other): refused by name, never copied through as if it were a plain
    weight."""
    for key, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.dtype in FLOAT8_DTYPES:
            prefix, _ = _split(key)
            scaled = any(tensor_key(prefix, s) in tensors for s in ("weight_scale", "weight_scale_inv"))
            what = ("an fp8 layer (compressed-tensors float-quantized, with a weight_scale)" if scaled
                    else "an fp8 tensor")
            raise layer_error(prefix or key, f"{key!r} is {value.dtype}: {what}; mixgemm imports integer layers "
                                      f"(dequantize it by its scale and quantize that with `mixgemm prepack`, "
                                      f"or leave fp8 layers to an fp8 kernel)", UnsupportedLayerError)


def import_checkpoint(fmt: Union[Format, str, None], tensors: Mapping[str, torch.Tensor],
                      dtype: DTypeLike = None, *, bits: Optional[int] = None,
                      group_size: Optional[int] = None,
                      checkpoint_format: Union[GPTQCheckpointFormat, str, None] = None,
                      symmetric: Optional[bool] = None, arch: str = "sm90a",
                      progress: bool = False) -> Dict[str, Union[torch.Tensor, PackedWeight]]:
    """Convert every quantized layer of a loaded state dict and prepack it.

    Parameters
    ----------
    fmt : Format or str or None
        The checkpoint format; ``None`` or ``"auto"``: detected per layer.
    tensors : Mapping[str, torch.Tensor]
        The whole state dict (e.g. ``safetensors.torch.load_file`` of every shard, merged).
    dtype, bits, group_size, checkpoint_format, symmetric
        Passed to :func:`import_layer` for every layer.
    arch : str
        Target of :func:`mixgemm.prepack` (``"sm90a"``).
    progress : bool
        Show a progress bar over the quantized layers.

    Returns
    -------
    dict
        In the input's order: for each quantized layer ``P``, ``"P.weight"`` ->
        :class:`~mixgemm.weights.types.PackedWeight` (in place of its packed tensors, scales, zeros,
        ``g_idx`` and meta data) and, for act-order layers whose groups are not contiguous,
        ``"P.perm"`` -> int64 ``[K]`` (apply ``x[..., perm]`` to the layer's input); every
        other tensor (biases, norms, embeddings, ...) unchanged, as the same object.
        :func:`mixgemm.save` writes the result.

    Raises
    ------
    FormatError
        A layer's tensors are inconsistent (the message names it); a companion tensor
        without its layer's packed weight (e.g. ``qzeros`` without ``qweight``); a layer that
        also has a plain ``P.weight`` (or ``P.perm``) tensor.
    UnsupportedLayerError
        A valid layer mixgemm cannot represent exactly; an fp8 tensor (named: never copied
        through).
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of name -> torch.Tensor, got "
                        f"{type(tensors).__name__}")
    fixed = None if fmt is None or fmt == "auto" else Format.parse(fmt)
    _refuse_fp8(tensors)
    formats = [fixed] if fixed is not None else list(Format.importable())
    primaries = {f.primary for f in formats}
    layers: Dict[str, Format] = {}
    for key in tensors:
        prefix, last = _split(key)
        if last in primaries:
            layers[prefix] = fixed if fixed is not None else detect_format(tensors, prefix)
    consumed: Dict[str, str] = {}
    for prefix, f in layers.items():
        for suffix in f.spec.companions:
            key = tensor_key(prefix, suffix)
            if key in tensors:
                consumed[key] = prefix
        for suffix in ("weight", "perm"):
            if tensor_key(prefix, suffix) in tensors:
                raise layer_error(prefix, f"has both a {f.value} quantized weight and a plain tensor "
                                   f"{tensor_key(prefix, suffix)!r}, which the import would replace")
    for key in tensors:
        prefix, last = _split(key)
        owners = [f for f in formats if last in f.spec.orphans]
        if key not in consumed and owners:
            wanted = " or ".join(sorted({repr(tensor_key(prefix, f.primary)) for f in owners}))
            raise layer_error(prefix, f"{key!r} belongs to a {'/'.join(f.value for f in owners)} "
                               f"layer, but there is no {wanted} (unrecognised or incomplete "
                               f"quantized layer)")
    from tqdm import tqdm   # deferred: loaded only when a progress bar is shown

    out: Dict[str, Union[torch.Tensor, PackedWeight]] = {}
    with tqdm(total=len(layers), desc="mixgemm import", unit="layer", disable=not progress or None) as bar:
        for key, value in tensors.items():
            prefix, last = _split(key)
            if key in consumed:
                if prefix in layers and last == layers[prefix].primary:
                    layer = import_layer(layers[prefix], tensors, prefix, dtype, bits=bits,
                                         group_size=group_size,
                                         checkpoint_format=checkpoint_format, symmetric=symmetric)
                    out[tensor_key(prefix, "weight")] = prepack(layer.qweight, arch=arch)
                    if layer.perm is not None:
                        out[tensor_key(prefix, "perm")] = layer.perm
                    bar.update(1)
                continue
            out[key] = value
    return out
