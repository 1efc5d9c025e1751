"""State-dict level import of the safetensors formats (AWQ, GPTQ, compressed-tensors, HQQ):
:class:`Format`, :func:`detect_format`, :func:`import_layer` and :func:`import_checkpoint`. Each
format's converter is its module's ``import_tensors``, reached through
:data:`mixgemm.formats.handlers.HANDLERS`.

A layer ``P`` is found by the tensor that marks it, ``P.<primary>`` (:attr:`Format.primary`), or,
for compressed-tensors' ``"int-quantized"`` layout, by an int8 ``P.weight`` beside its
``P.weight_scale`` (:func:`~mixgemm.formats.compressed_tensors.holds_int_codes`)."""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple, Union

import torch

from ..errors import UnsupportedLayerError
from ..weights.layout import prepack
from ..weights.quantize import FLOAT8_DTYPES
from ..weights.types import PackedWeight
from .common import DTypeLike, ImportedLayer, layer_error, tensor_key, shard_imported
from .compressed_tensors import holds_int_codes, stores_int_codes
from .config import parse_quantization_config
from .gptq import GPTQCheckpointFormat
from .handlers import HANDLERS
from .registry import Format
from .rules import QuantizationConfig


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
        ``<prefix>.weight_packed`` (pack-quantized) or an int8 ``<prefix>.weight`` beside a
        ``<prefix>.weight_scale`` (int-quantized), and for ``<prefix>.qweight`` ``GPTQ`` if it is
        ``[K*bits/32, N]`` (N from ``<prefix>.scales``), ``AWQ`` if it is ``[K, N/8]``.

    Raises
    ------
    FormatError
        No quantized weight under ``prefix``, or a ``qweight`` whose shape fits neither.
    """
    if tensor_key(prefix, "W_q") in tensors:
        return Format.HQQ
    if tensor_key(prefix, "weight_packed") in tensors or holds_int_codes(tensors, prefix):
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
                       f"{[tensor_key(prefix, p) for p in dict.fromkeys(f.primary for f in Format.importable())]}"
                       f" or an int8 {tensor_key(prefix, 'weight')!r} beside {tensor_key(prefix, 'weight_scale')!r}")


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
        A compressed-tensors int-quantized layer (an int8 ``<prefix>.weight``) needs ``bits``:
        its codes do not say their width.
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


def _parsed_config(quantization_config) -> Optional[QuantizationConfig]:
    """``quantization_config`` parsed (:func:`~mixgemm.formats.config.parse_quantization_config`),
    without the warnings about how ``from_pretrained`` computes activations: the import reads
    the weights alone."""
    if quantization_config is None or isinstance(quantization_config, QuantizationConfig):
        return quantization_config
    if not isinstance(quantization_config, Mapping):
        raise TypeError(f"quantization_config must be a QuantizationConfig or a mapping (config.json's "
                        f"quantization_config), got {type(quantization_config).__name__}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return parse_quantization_config(quantization_config, "quantization_config")


def _layer_options(prefix: str, fmt: Format, codes: bool, qconfig: Optional[QuantizationConfig],
                   bits: Optional[int], group_size: Optional[int], checkpoint_format) -> dict:
    """``bits``, ``group_size`` and ``checkpoint_format`` for the layer ``prefix`` of ``fmt``: the
    arguments, else what ``qconfig`` (when it is ``fmt``'s) gives the layer. ``codes``: an
    int-quantized layer, whose int8 codes need ``bits`` from one or the other."""
    if qconfig is not None and qconfig.method is fmt:
        scheme = qconfig.scheme_for(prefix)
        if not scheme.quantized:
            raise layer_error(prefix, "holds quantized tensors, but the quantization_config says it is not "
                                      "quantized")
        if bits is not None and scheme.bits is not None and bits != scheme.bits:
            raise layer_error(prefix, f"bits={bits} was given, but the quantization_config gives this layer "
                                      f"num_bits={scheme.bits}")
        bits = scheme.bits if bits is None else bits
        group_size = scheme.group_size if group_size is None else group_size
        checkpoint_format = scheme.checkpoint_format if checkpoint_format is None else checkpoint_format
    if codes and bits is None:
        raise layer_error(prefix, "an int-quantized layer's int8 codes do not say their width, and no "
                                  "quantization_config gives its num_bits: pass bits (mixgemm prepack: --bits)")
    return dict(bits=bits, group_size=group_size, checkpoint_format=checkpoint_format)


def import_checkpoint(fmt: Union[Format, str, None], tensors: Mapping[str, torch.Tensor],
                      dtype: DTypeLike = None, *, bits: Optional[int] = None,
                      group_size: Optional[int] = None,
                      checkpoint_format: Union[GPTQCheckpointFormat, str, None] = None,
                      symmetric: Optional[bool] = None, arch: str = "sm90a",
                      progress: bool = False,
                      quantization_config: Union[QuantizationConfig, Mapping, None] = None,
                      ) -> Dict[str, Union[torch.Tensor, PackedWeight]]:
    """Convert every quantized layer of a loaded state dict and prepack it.

    Parameters
    ----------
    fmt : Format or str or None
        The checkpoint format; ``None`` or ``"auto"``: detected per layer.
    tensors : Mapping[str, torch.Tensor]
        The whole state dict (e.g. ``safetensors.torch.load_file`` of every shard, merged).
        A compressed-tensors layer ``P`` is ``P.weight_packed`` and its companions
        (pack-quantized), or an int8 ``P.weight`` beside ``P.weight_scale`` (int-quantized: the
        signed codes unpacked, with the optional ``P.weight_zero_point`` and ``P.weight_g_idx``);
        a ``P.weight`` of another dtype is a plain tensor.
    dtype, bits, group_size, checkpoint_format, symmetric
        Passed to :func:`import_layer` for every layer. ``bits``, ``group_size`` and
        ``checkpoint_format`` left ``None`` are taken from ``quantization_config`` where it gives
        them, else inferred from the tensors, except an int-quantized layer's ``bits``, which
        its int8 codes do not say.
    arch : str
        Target of :func:`mixgemm.prepack` (``"sm90a"``).
    progress : bool
        Show a progress bar over the quantized layers.
    quantization_config : QuantizationConfig or Mapping, optional
        The checkpoint's ``quantization_config`` (``config.json``'s, as it is there or parsed by
        :func:`~mixgemm.formats.config.parse_quantization_config`): each layer of its method
        gets the ``num_bits``, group size and checkpoint format of the config's scheme for it
        (checked against the layer's tensors), and a layer it says is not quantized is refused.
        Its input activation schemes are not read: a layer's ``input_scale`` (and
        ``input_zero_point``) stay plain tensors next to the packed weight.

    Returns
    -------
    dict
        In the input's order: for each quantized layer ``P``, ``"P.weight"`` ->
        :class:`~mixgemm.weights.types.PackedWeight` (in place of its packed tensors or int8
        codes, scales, zeros, ``g_idx`` and meta data) and, for act-order layers whose groups
        are not contiguous, ``"P.perm"`` -> int64 ``[K]`` (apply ``x[..., perm]`` to the
        layer's input); every other tensor (biases, norms, embeddings, input scales, ...)
        unchanged, as the same object. :func:`mixgemm.save` writes the result.

    Raises
    ------
    FormatError
        A layer's tensors are inconsistent (the message names it); a companion tensor
        without its layer's packed weight (e.g. ``qzeros`` without ``qweight``); a layer that
        also has a plain ``P.weight`` (or ``P.perm``) tensor; an int-quantized layer without
        ``bits`` (neither given nor in ``quantization_config``), with int8 codes outside
        ``bits``' range, or, where ``quantization_config`` says it is int-quantized, without
        its ``weight_scale``; a layer ``quantization_config`` says is not quantized.
    UnsupportedLayerError
        A valid layer mixgemm cannot represent exactly; an fp8 tensor (named: never copied
        through).
    CheckpointError
        A ``quantization_config`` mixgemm does not read.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of name -> torch.Tensor, got "
                        f"{type(tensors).__name__}")
    fixed = None if fmt is None or fmt == "auto" else Format.parse(fmt)
    qconfig = _parsed_config(quantization_config)
    _refuse_fp8(tensors)
    formats = [fixed] if fixed is not None else list(Format.importable())
    primaries = {f.primary for f in formats}
    layers: Dict[str, Format] = {}
    markers: Dict[str, str] = {}          # layer -> the tensor that marks it (converted in its place)
    for key in tensors:
        prefix, last = _split(key)
        if last in primaries:
            layers[prefix] = fixed if fixed is not None else detect_format(tensors, prefix)
            markers[prefix] = key
    if Format.COMPRESSED_TENSORS in formats:
        ct_config = qconfig if qconfig is not None and qconfig.method is Format.COMPRESSED_TENSORS else None
        for key, value in tensors.items():
            prefix, last = _split(key)
            if last != "weight" or prefix in layers:
                continue
            if holds_int_codes(tensors, prefix):
                layers[prefix], markers[prefix] = Format.COMPRESSED_TENSORS, key
            elif ct_config is not None and stores_int_codes(ct_config, prefix) \
                    and isinstance(value, torch.Tensor) and value.dtype == torch.int8:
                raise layer_error(prefix, f"the quantization_config stores it int-quantized (int8 codes in {key!r}), "
                                          f"but {tensor_key(prefix, 'weight_scale')!r} is missing")
    consumed: Dict[str, str] = {}
    for prefix, f in layers.items():
        consumed[markers[prefix]] = prefix
        for suffix in f.spec.companions:
            key = tensor_key(prefix, suffix)
            if key in tensors:
                consumed[key] = prefix
        for suffix in ("weight", "perm"):
            key = tensor_key(prefix, suffix)
            if key in tensors and key != markers[prefix]:
                raise layer_error(prefix, f"has both a {f.value} quantized weight and a plain tensor "
                                   f"{key!r}, which the import would replace")
    for key in tensors:
        prefix, last = _split(key)
        owners = [f for f in formats if last in f.spec.orphans]
        if key not in consumed and owners:
            wanted = " or ".join(sorted({repr(tensor_key(prefix, f.primary)) for f in owners}))
            if Format.COMPRESSED_TENSORS in owners:
                wanted += f" or int8 {tensor_key(prefix, 'weight')!r}"
            raise layer_error(prefix, f"{key!r} belongs to a {'/'.join(f.value for f in owners)} "
                               f"layer, but there is no {wanted} (unrecognised or incomplete "
                               f"quantized layer)")
    options = {prefix: _layer_options(prefix, f, markers[prefix] == tensor_key(prefix, "weight"), qconfig, bits,
                                      group_size, checkpoint_format)
               for prefix, f in layers.items()}
    from tqdm import tqdm   # deferred: loaded only when a progress bar is shown

    out: Dict[str, Union[torch.Tensor, PackedWeight]] = {}
    with tqdm(total=len(layers), desc="mixgemm import", unit="layer", disable=not progress or None) as bar:
        for key, value in tensors.items():
            prefix, last = _split(key)
            if key in consumed:
                if prefix in layers and key == markers[prefix]:
                    layer = import_layer(layers[prefix], tensors, prefix, dtype, symmetric=symmetric,
                                         **options[prefix])
                    out[tensor_key(prefix, "weight")] = prepack(layer.qweight, arch=arch)
                    if layer.perm is not None:
                        out[tensor_key(prefix, "perm")] = layer.perm
                    bar.update(1)
                continue
            out[key] = value
    return out
