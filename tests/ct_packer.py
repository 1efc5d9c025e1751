"""compressed-tensors' own packer and unpacker, for the importer tests: a layer quantized,
packed (``PackedQuantizationCompressor.compress``) and dequantized back
(``PackedQuantizationCompressor.decompress``) by the installed compressed-tensors, so that the
test compares mixgemm with the library itself, never with an imitation of it.

Also run (by ``data/compressed_tensors_0_17/make_fixture.py``) under compressed-tensors 0.17.1,
the last version that packs 3, 5, 6 and 7-bit codes padded, to write the fixture that the tests
read when a newer version is installed.

:func:`w4a8_checkpoint` writes a whole (one-layer) checkpoint with integer weights and fp8 input
activations through compressed-tensors' own quantization lifecycle and ``ModelCompressor``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def pack_layer(w: torch.Tensor, bits: int, symmetric: bool, strategy: str = "group", group_size: int = 32
               ) -> tuple[dict, torch.Tensor]:
    """``(tensors, reference)``: the layer's compressed tensors (``weight_packed``,
    ``weight_scale``, ``weight_shape`` and, if asymmetric, ``weight_zero_point``, without a
    prefix) and the weight compressed-tensors' decompress gives back, ``[N, K]`` in w's dtype.

    ``strategy``: "group" (``group_size``), "channel" or "tensor"."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    n, k = w.shape
    if strategy == "group":
        view = w.float().reshape(n, k // group_size, group_size)
        lo, hi = view.amin(-1), view.amax(-1)
    elif strategy == "channel":
        lo, hi = w.float().amin(-1, keepdim=True), w.float().amax(-1, keepdim=True)
    else:
        lo, hi = w.float().amin().reshape(1), w.float().amax().reshape(1)
    scale, zero_point = calculate_qparams(lo, hi, args)
    state = {"weight": w, "weight_scale": scale.to(w.dtype)}
    if not symmetric:
        state["weight_zero_point"] = zero_point
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    reference = PackedQuantizationCompressor.decompress(dict(compressed), scheme)["weight"]
    return {key: value for key, value in compressed.items()}, reference.to(w.dtype)


def w4a8_checkpoint(directory, w: torch.Tensor, bits: int, symmetric: bool, activations: str,
                    group_size: int = 64, fmt=None, input_scale: float = 0.0123):
    """A checkpoint of one ``Linear`` (``proj``) with integer weights and fp8 input activations,
    quantized and compressed by compressed-tensors' own lifecycle (``apply_quantization_config``,
    ``ModelCompressor.compress_model``) and written as a model directory: ``model.safetensors``
    and ``config.json`` with the ``quantization_config`` that ``ModelCompressor.update_config``
    writes. Returns ``(reference, scheme)``: the weight compressed-tensors' own decompression
    gives back (the compressor's ``decompress``) and the layer's QuantizationScheme.

    ``activations``: ``"token"`` (dynamic, a scale per token) or ``"tensor"`` (static: the layer's
    ``input_scale``, stored in the weight's dtype as compressed-tensors initializes it). ``fmt``:
    None (the format compressed-tensors infers: ``"int-quantized"`` for integer weights with
    quantized activations) or ``"pack-quantized"`` (what vLLM's W4A8 kernels read)."""
    # deferred: compressed-tensors is optional (the tests that call this skip without it)
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    n, k = w.shape
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(k, n, bias=False).to(w.dtype)
    model.proj.weight.data.copy_(w)
    weights = QuantizationArgs(num_bits=bits, type="int", strategy="group", group_size=group_size,
                               symmetric=symmetric)
    acts = QuantizationArgs(num_bits=8, type="float", strategy=activations, dynamic=activations == "token",
                            symmetric=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}))
    lin = model.proj
    view = w.float().reshape(n, k // group_size, group_size)
    scale, zero_point = calculate_qparams(view.amin(-1), view.amax(-1), weights)
    lin.weight_scale.data = scale.to(lin.weight_scale.dtype)
    if hasattr(lin, "weight_zero_point"):
        lin.weight_zero_point.data = zero_point.to(lin.weight_zero_point.dtype)
    if activations == "tensor":
        lin.input_scale.data.fill_(input_scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {key: value.contiguous() for key, value in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    compressor.update_config(str(directory))
    local = {key.removeprefix("proj."): value for key, value in state.items()}
    fmt_name = compressor.quantization_config.format
    codec = BaseCompressor.get_value_from_registry(getattr(fmt_name, "value", fmt_name))
    reference = codec.decompress(dict(local), scheme)["weight"].to(w.dtype)
    return reference, scheme
