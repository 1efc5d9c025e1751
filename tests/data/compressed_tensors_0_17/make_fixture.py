"""Write ``layers.safetensors``: layers packed by compressed-tensors 0.17.1, the last version
that packs 3, 5, 6 and 7-bit codes padded (``32 // bits`` codes per int32 word, the spare bits
zero), with the weights its own decompress gives back. The tests read it (the installed
compressed-tensors packs densely); run once, by hand:

    pip install --no-deps --target /tmp/ct017 compressed-tensors==0.17.1
    pip install --target /tmp/ctdeps loguru psutil
    PYTHONPATH=/tmp/ct017:/tmp/ctdeps:tests python tests/data/compressed_tensors_0_17/make_fixture.py

Each layer ``L`` is ``L.weight_packed``, ``L.weight_scale``, ``L.weight_shape``, ``L.weight_zero_point``
(asymmetric) and ``L.reference`` (compressed-tensors' dequantized weight); the header's
``cases`` metadata lists each layer's bits, symmetry, strategy, group size and shape, and
``compressed_tensors`` the version that wrote it.
"""
from __future__ import annotations

import json
from pathlib import Path

import compressed_tensors
import safetensors.torch
import torch

from ct_packer import pack_layer

#: (bits, symmetric, strategy, group_size, N, K). N = 32 gives zero points whose padded and dense
#: word counts differ for 3 bits; N = 16 and K = 20 give 3-bit counts that coincide (decided by
#: the config's version); 4 bits is the same in both layouts.
CASES = [(b, sym, "group", 32, 32, 128) for b in (3, 4, 5, 6, 7) for sym in (True, False)] + [
    (3, False, "group", 32, 16, 128),
    (3, True, "channel", None, 16, 20),
    (5, False, "channel", None, 32, 96),
]


def main() -> None:
    assert compressed_tensors.__version__.startswith("0.17."), compressed_tensors.__version__
    gen = torch.Generator().manual_seed(17)
    tensors, cases = {}, {}
    for i, (bits, sym, strategy, group_size, n, k) in enumerate(CASES):
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        packed, reference = pack_layer(w, bits, sym, strategy, group_size or 32)
        name = f"layers.{i}"
        for key, value in packed.items():
            tensors[f"{name}.{key}"] = value.contiguous()
        tensors[f"{name}.reference"] = reference.contiguous()
        cases[name] = {"bits": bits, "symmetric": sym, "strategy": strategy, "group_size": group_size,
                       "n": n, "k": k}
    out = Path(__file__).with_name("layers.safetensors")
    safetensors.torch.save_file(tensors, str(out), metadata={
        "compressed_tensors": compressed_tensors.__version__, "torch": torch.__version__.split("+")[0],
        "cases": json.dumps(cases)})
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(cases)} layers)")


if __name__ == "__main__":
    main()
