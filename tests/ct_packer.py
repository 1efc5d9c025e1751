"""compressed-tensors' own packer and unpacker, for the importer tests: a layer quantized,
packed (``PackedQuantizationCompressor.compress``) and dequantized back
(``PackedQuantizationCompressor.decompress``) by the installed compressed-tensors, so that the
test compares mixgemm with the library itself, never with an imitation of it.

Also run (by ``data/compressed_tensors_0_17/make_fixture.py``) under compressed-tensors 0.17.1,
the last version that packs 3, 5, 6 and 7-bit codes padded, to write the fixture that the tests
read when a newer version is installed.
"""
from __future__ import annotations

import torch


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
