"""The AWQ and GPTQ importers against layers written by the real packers.

tests/data/real_packers holds layers packed by AutoAWQ 0.2.9 (``WQLinear_GEMM.from_linear``)
and AutoGPTQ 0.7.1 (``qlinear_cuda.QuantLinear.pack``), each beside the library's own dequantized
weight (its layer's forward on the identity, on the CPU); ``make_fixtures.py`` there wrote them and
says how (the libraries need an older transformers, so they are not installed for the tests).
mixgemm's import must give the library's weight bit for bit, through the packed kernel layout
(:func:`mixgemm.formats.from_awq` / :func:`~mixgemm.formats.from_gptq`) where the kernels take the
layer, and through the full-precision fallback (:func:`mixgemm.hf.dequant.dequantize_layer`) for
every layer, 3-bit codes included.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mixgemm import dequantize_reference
from mixgemm.errors import UnsupportedLayerError
from mixgemm.formats import from_awq, from_gptq
from mixgemm.formats.config import LayerScheme, QuantMethod
from mixgemm.hf.dequant import dequantize_layer
from reference_packers import assert_bitwise, in_source_order

DATA = Path(__file__).resolve().parents[1] / "data" / "real_packers"
CASES = sorted(p.stem for p in DATA.glob("*.safetensors"))


def load(case: str) -> tuple[dict, dict]:
    with safe_open(str(DATA / f"{case}.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["case"])
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def test_the_fixtures_are_there():
    assert len(CASES) == 9, CASES
    libraries = {load(c)[1]["library"]: load(c)[1]["version"] for c in CASES}
    assert libraries == {"auto-gptq": "0.7.1", "autoawq": "0.2.9"}


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("awq")])
def test_awq_layers_import_as_autoawq_dequantizes_them(case):
    t, meta = load(case)
    layer = from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=meta["group_size"])
    assert layer.perm is None and layer.qweight.group_size == meta["group_size"]
    assert_bitwise(dequantize_reference(layer.qweight), t["reference"], case)
    full = dequantize_layer(QuantMethod.AWQ, {f"L.{k}": v for k, v in t.items()}, "L",
                            LayerScheme(bits=4, group_size=meta["group_size"]))
    assert_bitwise(full, t["reference"], f"{case} (full-precision fallback)")


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("gptq") and "zero-point-zero" not in c])
def test_gptq_layers_import_as_autogptq_dequantizes_them(case):
    t, meta = load(case)
    tensors = {f"L.{k}": v for k, v in t.items() if k != "reference"}
    scheme = LayerScheme(bits=meta["bits"], group_size=meta["group_size"], checkpoint_format="gptq")
    assert_bitwise(dequantize_layer(QuantMethod.GPTQ, tensors, "L", scheme), t["reference"],
                   f"{case} (full-precision fallback)")
    g_idx = t["g_idx"] if meta["act_order"] else None
    if meta["bits"] == 3:      # the kernels take 2, 4 and 8 bits: from_pretrained falls back
        with pytest.raises(UnsupportedLayerError):
            from_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, checkpoint_format="gptq", bits=3)
        return
    layer = from_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, checkpoint_format="gptq", bits=meta["bits"])
    assert (layer.perm is not None) == meta["act_order"]
    assert layer.qweight.symmetric == meta["sym"]
    w = in_source_order(dequantize_reference(layer.qweight), layer.perm)
    assert_bitwise(w, t["reference"], case)


def test_gptq_zero_point_zero_as_autogptq_wrote_it():
    """AutoGPTQ stores a zero point of 0 as -1 in v1, and its packer ORs the sign bits of that -1
    over the word's other zero points: the checkpoint is corrupt, and every loader reads it its
    own way. AutoGPTQ's own torch path reads each stored nibble 15 as 16. mixgemm reads v1 zero
    points as GPTQModel (and so transformers' GPTQ loading) does, adding 0x11111111 to each word,
    the exact inverse of GPTQModel's v1 export (tests/formats/test_formats_gptqmodel_real.py): the packed
    import and the full-precision fallback alike, so they agree with each other, and both differ
    from AutoGPTQ's reading of this corrupt layer."""
    t, meta = load("gptq-v1-4bit-zero-point-zero-g64")
    tensors = {f"L.{k}": v for k, v in t.items() if k != "reference"}
    scheme = LayerScheme(bits=4, group_size=meta["group_size"], checkpoint_format="gptq")
    assert int((t["qzeros"] == -1).sum()) == t["qzeros"].numel(), "every zero word is all ones"
    full = dequantize_layer(QuantMethod.GPTQ, tensors, "L", scheme)
    layer = from_gptq(t["qweight"], t["qzeros"], t["scales"], checkpoint_format="gptq", bits=4)
    assert_bitwise(full, dequantize_reference(layer.qweight), "zero point 0: fallback vs packed import")
    assert not torch.equal(full, t["reference"]), "AutoGPTQ reads its corrupt zero words differently"
    # AutoGPTQ's reading is each field plus one, without carries: every zero point 16
    z16 = torch.full_like(t["scales"], 16.0)
    q = torch.stack([(t["qweight"] >> (4 * j)) & 15 for j in range(8)], 1).reshape(-1, t["scales"].shape[1])
    g = torch.arange(q.shape[0]) // meta["group_size"]
    autogptq = ((q - z16[g].to(torch.int64)).to(torch.float16) * t["scales"][g]).t()
    assert_bitwise(autogptq.contiguous(), t["reference"], "AutoGPTQ's reading, for the record")
