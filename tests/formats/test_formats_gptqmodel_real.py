"""The GPTQ importer against layers written by GPTQModel (v1 ``"gptq"`` and ``"gptq_v2"`` exports).

tests/data/real_packers/gptqmodel holds layers that GPTQModel 7.7.0 quantized (its GPTQ, act-order
included), packed (``pack_module`` -> ``TorchLinear.pack_block``, the CPU/torch packer) and, for
v1, converted to ``z - 1`` zero points as it does before saving; beside each, GPTQModel's own
weight for it (the layer loaded back as its loader does, v1 zero points converted to its internal
v2, then its ``dequantize_weight()``), and the quantization_config it writes.
``make_fixtures_gptqmodel.py`` there wrote them and says how; GPTQModel is not needed here.

mixgemm must give GPTQModel's weight bit for bit through the packed kernel layout
(:func:`mixgemm.formats.from_gptq`, 2/4/8 bits) and through the full-precision fallback
(:func:`mixgemm.hf.dequant.dequantize_layer`, every width), zero points of 0 included, with the
checkpoint format read from GPTQModel's own config; and refuse, in one line, what it cannot read.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mixgemm import dequantize_reference
from mixgemm.errors import CheckpointError, FormatError, UnsupportedLayerError
from mixgemm.formats import from_gptq
from mixgemm.formats.config import LayerScheme, QuantMethod, parse_quantization_config
from mixgemm.hf.dequant import dequantize_layer
import reference_packers
from reference_packers import in_source_order

DATA = Path(__file__).resolve().parents[1] / "data" / "real_packers" / "gptqmodel"
CASES = sorted(p.stem for p in DATA.glob("*.safetensors"))
READABLE = [c for c in CASES if "gptq_p" not in c]


def load(case: str) -> tuple[dict, dict]:
    with safe_open(str(DATA / f"{case}.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["case"])
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    reference_packers.assert_bitwise(a, b, what, "GPTQModel's")


def scheme_of(meta: dict):
    """The layer scheme mixgemm reads from the quantization_config GPTQModel saved."""
    qc = parse_quantization_config(meta["quantize_config"])
    assert qc.method is QuantMethod.GPTQ
    return qc.default


def test_the_fixtures_are_there():
    assert len(CASES) == 16, CASES
    metas = [load(c)[1] for c in CASES]
    assert {(m["library"], m["version"]) for m in metas} == {("gptqmodel", "7.7.0")}
    assert {m["checkpoint_format"] for m in metas} == {"gptq", "gptq_v2", "gptq_p"}
    for c, m in zip(CASES, metas):
        assert m["quantize_config"]["checkpoint_format"] == m["checkpoint_format"], c
        assert (m["zero_points_equal_to_0"] > 0) == m["zero_point_zero"], c


@pytest.mark.parametrize("case", READABLE)
def test_the_fallback_dequantizes_as_gptqmodel(case):
    t, meta = load(case)
    scheme = scheme_of(meta)
    assert scheme.checkpoint_format == meta["checkpoint_format"]
    assert (scheme.bits, scheme.group_size) == (meta["bits"], meta["group_size"])
    tensors = {f"L.{k}": v for k, v in t.items() if k != "reference"}
    assert_bitwise(dequantize_layer(QuantMethod.GPTQ, tensors, "L", scheme), t["reference"],
                   f"{case} (full-precision fallback)")


@pytest.mark.parametrize("case", READABLE)
def test_the_packed_import_dequantizes_as_gptqmodel(case):
    t, meta = load(case)
    scheme = scheme_of(meta)
    g_idx = t["g_idx"] if meta["act_order"] else None
    args = (t["qweight"], t["qzeros"], t["scales"], g_idx)
    if meta["bits"] == 3:      # the kernels take 2, 4 and 8 bits: from_pretrained falls back
        with pytest.raises(UnsupportedLayerError):
            from_gptq(*args, checkpoint_format=scheme.checkpoint_format, bits=3)
        return
    layer = from_gptq(*args, checkpoint_format=scheme.checkpoint_format, bits=meta["bits"])
    assert (layer.perm is not None) == meta["act_order"]
    assert layer.qweight.symmetric == meta["sym"]
    assert layer.qweight.group_size == meta["group_size"]
    w = in_source_order(dequantize_reference(layer.qweight), layer.perm)
    assert_bitwise(w, t["reference"], case)


@pytest.mark.parametrize("case", [c for c in READABLE if "zero-point-zero" in c])
def test_zero_points_of_0_and_the_v1_borrow(case):
    """v2 stores a zero point of 0 as 0. v1 stores ``z - 1``: GPTQModel subtracts 0x11111111
    (4-bit) from each packed word, so a 0 becomes all ones and borrows one from the next field
    (3-bit: each field minus one, mod 8). Reading each field plus one would put 2^b in place of
    0 and shift its neighbour by one."""
    t, meta = load(case)
    scheme = scheme_of(meta)
    assert meta["zero_points_equal_to_0"] > 0
    tensors = {f"L.{k}": v for k, v in t.items() if k != "reference"}
    w = dequantize_layer(QuantMethod.GPTQ, tensors, "L", scheme)
    assert_bitwise(w, t["reference"], case)
    if meta["checkpoint_format"] == "gptq_v2":
        other = dequantize_layer(QuantMethod.GPTQ, tensors, "L",
                                 LayerScheme(bits=scheme.bits, group_size=scheme.group_size, checkpoint_format="gptq"))
        assert not torch.equal(other, w), "the checkpoint format must matter"


def test_gptqmodel_gptq_p_is_refused_in_one_line():
    """GPTQModel writes 5/6/7-bit layers (and 3-bit on request) in its planar "gptq_p" layout,
    which mixgemm does not read: the config is refused by name, and a 5-bit layer handed to the
    importers as plain GPTQ is refused, not decoded as a dense bit stream."""
    t, meta = load("gptqmodel-gptq_p-5bit-asym-g64")
    assert meta["checkpoint_format"] == "gptq_p" and meta["planar"]
    with pytest.raises(CheckpointError, match="gptq_p") as e:
        parse_quantization_config(meta["quantize_config"])
    assert "\n" not in str(e.value)
    tensors = {f"L.{k}": v for k, v in t.items() if k != "reference"}
    with pytest.raises(UnsupportedLayerError):
        from_gptq(t["qweight"], t["qzeros"], t["scales"], checkpoint_format="gptq_v2")
    for fmt in ("gptq", "gptq_v2"):
        with pytest.raises(FormatError, match="5-bit GPTQ layers are not supported") as e:
            dequantize_layer(QuantMethod.GPTQ, tensors, "L", LayerScheme(bits=5, group_size=64, checkpoint_format=fmt))
        assert "\n" not in str(e.value)
