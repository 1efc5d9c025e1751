"""The importers against the real packers.

compressed-tensors: the installed version's own ``PackedQuantizationCompressor`` packs each layer
and its own ``decompress`` gives the reference (tests/ct_packer.py), when it is installed; the
padded packing of 3, 5, 6 and 7-bit codes that versions up to 0.17 wrote comes from a fixture
that compressed-tensors 0.17.1 wrote (tests/data/compressed_tensors_0_17/, with its script).
For each layer: the kernels' widths (2, 4, 8 bits) import bit-exactly; the others are refused
with UnsupportedLayerError (so that from_pretrained keeps them in full precision), and the
full-precision dequantizer gives compressed-tensors' own weights exactly, in either packing, or
refuses where it cannot tell them apart: never a wrong weight.

HQQ: HQQLinear (hqq 0.2.8 checked) quantizes each layer and its own dequantize is the reference;
skipped where hqq is not installed (it is not in the test extra: a source build that pulls in
accelerate). gguf's own quantizer and dequantizer are the reference of tests/formats/test_formats_gguf.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mixgemm.errors import FormatError, UnsupportedLayerError
from mixgemm.formats import Format, import_layer
from mixgemm.formats.config import LayerScheme, QuantMethod, parse_quantization_config
from mixgemm.hf.dequant import dequantize_layer
from mixgemm.weights.quantize import dequantize_reference

FIXTURE = Path(__file__).parents[1] / "data" / "compressed_tensors_0_17" / "layers.safetensors"


def _prefixed(tensors: dict, prefix: str) -> dict:
    return {f"{prefix}.{key}": value for key, value in tensors.items()}


def _check_layer(tensors: dict, prefix: str, reference: torch.Tensor, bits: int, group_size, packing):
    """The assertions every layer gets, whichever packer wrote it."""
    scheme = LayerScheme(bits=bits, group_size=group_size, packing=packing)
    if bits in (2, 4, 8):
        layer = import_layer(Format.COMPRESSED_TENSORS, tensors, prefix, bits=bits)
        assert torch.equal(dequantize_reference(layer.qweight), reference), "bit-exact import"
    else:
        with pytest.raises(UnsupportedLayerError) as excinfo:
            import_layer(Format.COMPRESSED_TENSORS, tensors, prefix, bits=bits)
        shape_ok = reference.shape[0] % 16 == 0 and reference.shape[1] % 64 == 0
        assert (f"{bits}-bit compressed-tensors layers are not supported" if shape_ok else "% 64 == 0") \
            in str(excinfo.value)
        with pytest.raises(FormatError) as excinfo:                           # bits inferred
            import_layer(Format.COMPRESSED_TENSORS, tensors, prefix)
        assert isinstance(excinfo.value, UnsupportedLayerError) or "pass bits" in str(excinfo.value), excinfo.value
    if bits == 8:   # 8-bit words are never taken for padded 7-bit ones (K / 4 words each)
        assert import_layer(Format.COMPRESSED_TENSORS, tensors, prefix).qweight.bits == 8
    got = dequantize_layer(QuantMethod.COMPRESSED_TENSORS, tensors, prefix, scheme)
    assert got.dtype == reference.dtype and torch.equal(got, reference), \
        f"{int((got != reference).sum())} of {reference.numel()} elements differ"


# ------------------------------------------------------------------ the installed compressed-tensors

@pytest.fixture(scope="module")
def ct():
    ct = pytest.importorskip("compressed_tensors")
    import ct_packer
    return ct, ct_packer


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_against_the_installed_packer(ct, bits, symmetric, strategy):
    module, packer = ct
    from mixgemm.formats.compressed_tensors import packing_of_version
    gen = torch.Generator().manual_seed(bits * 10 + symmetric)
    w = (torch.randn(32, 128, generator=gen) * 0.05).to(torch.bfloat16)
    tensors, reference = packer.pack_layer(w, bits, symmetric, strategy, 32)
    group_size = 32 if strategy == "group" else -1
    _check_layer(_prefixed(tensors, "l"), "l", reference, bits, group_size, packing_of_version(module.__version__))


def test_the_tensor_strategy_against_the_installed_packer(ct):
    module, packer = ct
    w = (torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    tensors, reference = packer.pack_layer(w, 4, True, "tensor")
    tensors = _prefixed(tensors, "l")
    with pytest.raises(UnsupportedLayerError, match="'tensor' strategy"):
        import_layer(Format.COMPRESSED_TENSORS, tensors, "l", bits=4)
    assert torch.equal(dequantize_layer(QuantMethod.COMPRESSED_TENSORS, tensors, "l", LayerScheme(bits=4)), reference)


def test_the_config_version_says_the_packing():
    def scheme(version):
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 3, "strategy": "group",
                                                                        "group_size": 32}}}}
        if version is not None:
            qc["version"] = version
        return parse_quantization_config(qc).scheme_for("model.layers.0.mlp.up_proj")
    assert scheme("0.17.1").packing == "padded" and scheme("0.10.3.a20250101").packing == "padded"
    assert scheme("0.18.0").packing == "dense" and scheme("0.20.0").packing == "dense"
    assert scheme("1.0").packing == "dense" and scheme(None).packing is None and scheme("dev").packing is None


# ------------------------------------------------------------------ compressed-tensors 0.17.1 (padded)

def _fixture():
    with safe_open(str(FIXTURE), framework="pt") as f:
        meta = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return meta, json.loads(meta["cases"]), tensors


def test_the_fixture_is_what_0_17_wrote():
    meta, cases, tensors = _fixture()
    assert meta["compressed_tensors"] == "0.17.1"
    padded = [name for name, c in cases.items() if c["bits"] == 3 and c["k"] == 128]
    assert all(tensors[f"{name}.weight_packed"].shape[1] == 13 for name in padded), "ceil(128 / 10): padded"


@pytest.mark.parametrize("packing", ["padded", None, "dense"], ids=["version 0.17", "no version", "a wrong version"])
def test_against_compressed_tensors_0_17(packing):
    """With the config's version (0.17: padded) every layer dequantizes to 0.17's own weights.
    Without it, or with a version that says dense, the word count decides where the two
    packings take different counts; where they take as many (a 3-bit row of K=20, 3-bit zero
    points of N=16) the layer is refused without a version and, with a wrong one, read as the
    version says (the only case the version decides)."""
    meta, cases, tensors = _fixture()
    from mixgemm.formats.compressed_tensors import packed_words
    for name, c in cases.items():
        layer = {key: value for key, value in tensors.items() if key.startswith(name + ".")}
        reference = layer.pop(f"{name}.reference")
        bits = c["bits"]
        group_size = c["group_size"] if c["strategy"] == "group" else -1
        counts = [packed_words(c["k"], bits)]
        if not c["symmetric"]:
            counts.append(packed_words(c["n"], bits))
        ambiguous = bits not in (1, 2, 4, 8) and any(
            w["dense"] == w["padded"] and w["padded"] > 1 for w in counts)
        if packing == "padded" or not ambiguous:
            _check_layer(layer, name, reference, bits, group_size, packing)
        elif packing is None:
            with pytest.raises(FormatError, match="does not say which wrote it"):
                dequantize_layer(QuantMethod.COMPRESSED_TENSORS, layer, name,
                                 LayerScheme(bits=bits, group_size=group_size))
        else:   # a config that says dense about padded words of an ambiguous count: read as it says
            got = dequantize_layer(QuantMethod.COMPRESSED_TENSORS, layer, name,
                                   LayerScheme(bits=bits, group_size=group_size, packing="dense"))
            assert not torch.equal(got, reference)


def test_the_bits_are_never_guessed_wrong():
    """Without the config's num_bits, the word count alone either gives the right width or is
    refused."""
    meta, cases, tensors = _fixture()
    for name, c in cases.items():
        layer = {key: value for key, value in tensors.items() if key.startswith(name + ".")}
        reference = layer.pop(f"{name}.reference")
        try:
            got = dequantize_layer(QuantMethod.COMPRESSED_TENSORS, layer, name, LayerScheme(packing="padded"))
        except FormatError as e:
            assert "num_bits is needed" in str(e) or "does not say which wrote it" in str(e), e
        else:
            assert torch.equal(got, reference), name


def test_a_padded_layer_in_import_checkpoint_is_unsupported_not_malformed():
    """What from_pretrained needs to fall back to full precision: UnsupportedLayerError, not the
    FormatError ("need 48 int32 words per row") that aborted the whole load."""
    meta, cases, tensors = _fixture()
    name = next(n for n, c in cases.items() if c["bits"] == 3 and c["k"] == 128)
    layer = {key: value for key, value in tensors.items() if key.startswith(name + ".") and "reference" not in key}
    with pytest.raises(UnsupportedLayerError) as excinfo:
        import_layer(Format.COMPRESSED_TENSORS, layer, name, bits=3)
    with pytest.raises(FormatError, match=r"need 12 \(dense\) or 13 \(padded, compressed-tensors <= 0.17\) int32 words"):
        bad = dict(layer)
        bad[f"{name}.weight_packed"] = bad[f"{name}.weight_packed"][:, :-2].contiguous()
        import_layer(Format.COMPRESSED_TENSORS, bad, name, bits=3)


# ------------------------------------------------------------------ HQQ

def _ulp(v: torch.Tensor, dtype) -> torch.Tensor:
    mant = 7 if dtype == torch.bfloat16 else 10
    return torch.exp2(torch.floor(torch.log2(v.abs().float())) - mant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("optimize", [True, False], ids=["optimized (fractional zeros)", "plain"])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_against_hqq(bits, group, optimize, dtype):
    """HQQ's own HQQLinear quantizes a layer (its optimizer leaves fractional zero points); its
    own dequantize is the reference: the import is within the bound from_hqq documents (2 ulp of
    2^b * |scale| per element), bit-exact where every zero point is an integer; 3 bits are
    refused as unsupported."""
    quantize = pytest.importorskip("hqq.core.quantize")
    gen = torch.Generator().manual_seed(bits * 1000 + group + optimize)
    linear = torch.nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 256, generator=gen) * 0.02)
    linear = linear.to(dtype)
    config = quantize.BaseQuantizeConfig(nbits=bits, group_size=group, axis=1)
    config["weight_quant_params"]["optimize"] = optimize
    layer = quantize.HQQLinear(linear, config, compute_dtype=dtype, device="cpu")
    reference = layer.dequantize().to(dtype)
    state = _prefixed({k: v for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}, "l")
    if bits == 3:
        with pytest.raises(UnsupportedLayerError, match="3-bit HQQ"):
            import_layer(Format.HQQ, state, "l")
        return
    qw = import_layer(Format.HQQ, state, "l").qweight
    ours = dequantize_reference(qw)
    zero = state["l.zero"]
    if bool((zero == zero.round()).all()):
        assert torch.equal(ours, reference)
    else:
        s = state["l.scale"].reshape(64, 256 // group).repeat_interleave(group, dim=1)
        bound = 2 * _ulp((1 << bits) * s, dtype)
        err = (ours.float() - reference.float()).abs()
        assert bool((err <= bound).all()), float((err / bound).max())
