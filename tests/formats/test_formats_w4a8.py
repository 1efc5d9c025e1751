"""compressed-tensors checkpoints with integer weights and fp8 (e4m3) input activations (W4A8,
W2A8), against the installed compressed-tensors itself.

Each checkpoint is written by compressed-tensors' own lifecycle (``apply_quantization_config``,
``ModelCompressor.compress_model`` and ``update_config``: tests/ct_packer.py), in both layouts it
writes integer weights in: ``"int-quantized"`` (what it infers for integer weights with quantized
activations: the int8 codes unpacked) and ``"pack-quantized"`` (what vLLM's W4A8 kernels read).
mixgemm reads it back from the files and is checked against the library:

* the weight: ``mixgemm.dequantize_reference`` of the import equals the compressor's own
  ``decompress``, bit for bit (4 and 2 bits, symmetric and with zero points);
* the activations: mixgemm's quantizer (``mixgemm.ops.quantize_fp8_reference``, the kernel's
  definition) equals compressed-tensors' ``quantize`` on the same input and the same scale, code
  for code: the layer's static ``input_scale``, or the per-token scale compressed-tensors'
  ``compute_dynamic_scales_and_zp`` derives (``amax / 448``, equal to mixgemm's), both evaluated
  in float32. compressed-tensors' own fake quantization in the model's dtype (bf16) rounds the
  quotient to bf16 first: the last test measures how far that is.

``import_checkpoint`` (the state-dict import behind ``mixgemm prepack --from``) reads the
``"int-quantized"`` layout too: the same weights, bit for bit, and each layer's ``input_scale``
kept as a plain tensor, as for ``"pack-quantized"``.
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

import mixgemm
from mixgemm.errors import FormatError, ShardError, UnsupportedLayerError
from mixgemm.formats import Format, detect_format, from_compressed_tensors, import_checkpoint, import_layer
from mixgemm.formats.compressed_tensors import ACTIVATION_SCHEMES, activation_scheme
from mixgemm.formats.config import parse_quantization_config
from mixgemm.nn import QuantLinear
from mixgemm.ops import fp8
from mixgemm.weights.quantize import dequantize_reference


@pytest.fixture(scope="module")
def ct():
    ct = pytest.importorskip("compressed_tensors")
    import ct_packer
    return ct, ct_packer


def _weight(n=48, k=256, seed=0):
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


def _activations(m=24, k=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)
    x[:, ::37] *= 8                                          # outliers
    x[3] = 0
    return x.to(torch.bfloat16)


def _natural(xq: torch.Tensor) -> torch.Tensor:
    """mixgemm's e4m3 codes in the natural column order, as float32 values."""
    return fp8.dequantize_fp8(xq, torch.ones(xq.shape[:-1]))


def _ct_codes(x, scale, args) -> torch.Tensor:
    """compressed-tensors' ``quantize`` of x with ``scale`` into e4m3, as float32 values."""
    from compressed_tensors.quantization.lifecycle.forward import quantize   # deferred: optional dependency
    return quantize(x, scale, None, args, dtype=torch.float8_e4m3fn).float()


def _read(tmp_path):
    raw = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    return raw, load_file(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("fmt", [None, "pack-quantized"], ids=["int-quantized", "pack-quantized"])
@pytest.mark.parametrize("activations", ["token", "tensor"])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (2, True), (2, False)],
                         ids=["s4", "u4", "s2", "u2"])
def test_w4a8_checkpoint_against_compressed_tensors(ct, tmp_path, fmt, activations, bits, symmetric):
    module, packer = ct
    reference, scheme = packer.w4a8_checkpoint(tmp_path, _weight(seed=bits), bits, symmetric, activations, 64, fmt)
    raw, tensors = _read(tmp_path)
    group = raw["config_groups"]["group_0"]
    assert raw["format"] == (fmt or "int-quantized") and raw["version"] == module.__version__
    act = activation_scheme(group["input_activations"])
    assert act == f"fp8-{activations}"
    with pytest.warns(UserWarning, match="from_pretrained computes with bf16/fp16 activations"):
        scheme_of = parse_quantization_config(raw).scheme_for("proj")   # from_pretrained's config reader
    assert (scheme_of.activations, scheme_of.bits, scheme_of.group_size, scheme_of.checkpoint_format) == \
        (act, bits, 64, fmt or "int-quantized")

    layer = import_layer(Format.COMPRESSED_TENSORS, tensors, "proj", bits=bits, activations=act)
    # the weight: compressed-tensors' own decompression, bit for bit
    assert layer.qweight.symmetric == symmetric and layer.qweight.bits == bits
    assert torch.equal(dequantize_reference(layer.qweight), reference)
    assert torch.equal(dequantize_reference(mixgemm.prepack(layer.qweight)), reference)
    # the activations: compressed-tensors' quantize on the same x and scale, code for code
    assert layer.act_format == "fp8"
    x = _activations()
    if activations == "tensor":
        stored = tensors["proj.input_scale"]
        assert stored.dtype == torch.bfloat16                # compressed-tensors keeps it in the weight's dtype
        assert layer.input_scale.dtype == torch.float32 and layer.input_scale.shape == ()
        assert layer.input_scale == stored.float().reshape(())
        xq, s = fp8.quantize_fp8_reference(x, layer.input_scale)
        want = _ct_codes(x, layer.input_scale.reshape(1), scheme.input_activations)
        assert bool((want.abs() == 448).any())               # some values saturate
    else:
        from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp  # deferred: optional

        assert layer.input_scale is None
        xq, s = fp8.quantize_fp8_reference(x)
        x3 = x.float().unsqueeze(0)                          # the token strategy reduces [B, T, K] over K
        scale, zero = compute_dynamic_scales_and_zp(x3, scheme.input_activations, torch.nn.Identity())
        nonzero = s != 1                                     # a row of zeros: scale 1 here, eps there; codes 0 both
        assert torch.equal(scale.reshape(-1)[nonzero], s[nonzero])
        want = _ct_codes(x3, scale, scheme.input_activations)[0]
    assert torch.equal(_natural(xq), want)
    # and the layer carries both into QuantLinear
    q = QuantLinear.from_packed(mixgemm.prepack(layer.qweight), act_format=layer.act_format,
                                input_scale=layer.input_scale)
    assert q.act_format == "fp8" and (q.input_scale is None) == (activations == "token")


def test_ct_fake_quant_in_bf16_is_within_one_e4m3_step(ct):
    """compressed-tensors' own fake quantization of a bf16 model divides in bf16 with the bf16
    input_scale it stores (x / s rounded to bf16, then to e4m3); mixgemm divides in float32.
    The two differ only where the bf16 quotient lands on the other side of an e4m3 rounding
    boundary: by one e4m3 step, in a few percent of the values."""
    from compressed_tensors.quantization import QuantizationArgs   # deferred: optional dependency

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    x = _activations(64, 1024, seed=5)
    s16 = torch.tensor([0.0123], dtype=torch.bfloat16)
    theirs = _ct_codes(x, s16, args).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    xq, _ = fp8.quantize_fp8_reference(x, s16.float().reshape(()))
    mine = _natural(xq).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    step = ((mine & 0x7F) - (theirs & 0x7F)).abs()
    assert bool(((mine ^ theirs) & 0x80)[step > 0].eq(0).all())     # same sign wherever they differ
    assert int(step.max()) == 1 and 0 < float((step > 0).float().mean()) < 0.05


# ---------------------------------------------------------------------------------------------
# What is refused, and how
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,msg", [
    (dict(type="int", num_bits=8, strategy="token", dynamic=True),
     "int 8-bit input activations, strategy 'token', dynamic: mixgemm's e4m3 activations are float 8-bit ones"),
    (dict(type="float", num_bits=4, strategy="tensor_group", group_size=16, dynamic="local"),
     "float 4-bit input activations"),
    (dict(type="float", num_bits=8, strategy="group", group_size=128, dynamic=True),
     "strategy 'group', dynamic: mixgemm's e4m3 activations take a scale per token"),
    (dict(type="float", num_bits=8, strategy="tensor", dynamic=True),
     "strategy 'tensor', dynamic: mixgemm's e4m3 activations take a scale per token"),
    (dict(type="float", num_bits=8, strategy="token", dynamic=True, symmetric=False), "asymmetric"),
    (dict(type="float", num_bits=8, strategy="token", dynamic=True, scale_dtype="torch.uint8"),
     "scales rounded to torch.uint8"),
])
def test_activation_schemes_refused(cfg, msg):
    with pytest.raises(ValueError) as excinfo:
        activation_scheme(cfg)
    assert msg in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_activation_schemes_taken():
    assert activation_scheme(dict(type="float", num_bits=8, strategy="token", dynamic=True)) == "fp8-token"
    assert activation_scheme(dict(type="float", num_bits=8, strategy="tensor", dynamic=False)) == "fp8-tensor"
    # no strategy: compressed-tensors' default, "tensor"
    assert activation_scheme(dict(type="float", num_bits=8, dynamic=False)) == "fp8-tensor"
    assert ACTIVATION_SCHEMES == ("fp8-token", "fp8-tensor")


def test_unsupported_activations_are_ignored_with_a_warning():
    """An int8-activation group (W4A8 int): the weights are read, the activations ignored, as before."""
    raw = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}
    with pytest.warns(UserWarning, match="int 8-bit input activations.*ignores that"):
        scheme = parse_quantization_config(raw).scheme_for("x")
    assert scheme.activations is None and scheme.bits == 4


@pytest.mark.parametrize("change,kw,exc,msg", [
    (None, dict(activations=None), FormatError,
     "layer 'proj': input_scale is given, but activations is None: pass activations='fp8-tensor'"),
    ("drop_scale", dict(activations="fp8-tensor"), FormatError,
     "layer 'proj': static per-tensor e4m3 activations need the layer's input_scale"),
    (None, dict(activations="fp8-token"), FormatError,
     "layer 'proj': an input_scale is given, but the activations are quantized per token (dynamic)"),
    ("zero_scale", dict(activations="fp8-tensor"), FormatError,
     "layer 'proj': input_scale must be positive and finite, got 0.0"),
    ("two_scales", dict(activations="fp8-tensor"), FormatError,
     "layer 'proj': input_scale must hold one value (per tensor), got shape [2]"),
    (None, dict(activations="fp8"), ValueError, "activations must be None or one of ('fp8-token', 'fp8-tensor')"),
])
def test_input_scale_refusals(ct, tmp_path, change, kw, exc, msg):
    _, packer = ct
    packer.w4a8_checkpoint(tmp_path, _weight(32, 128), 4, True, "tensor", 64, "pack-quantized")
    _, tensors = _read(tmp_path)
    scale = tensors["proj.input_scale"]
    if change == "drop_scale":
        scale = None
    elif change == "zero_scale":
        scale = torch.zeros(1)
    elif change == "two_scales":
        scale = torch.ones(2)
    with pytest.raises(exc) as excinfo:
        from_compressed_tensors(tensors["proj.weight_packed"], tensors["proj.weight_scale"],
                                tensors["proj.weight_shape"], name="proj", input_scale=scale, **kw)
    assert str(excinfo.value) == msg or str(excinfo.value).startswith(msg), str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_import_layer_refusals(ct, tmp_path):
    _, packer = ct
    packer.w4a8_checkpoint(tmp_path, _weight(32, 128), 4, True, "tensor", 64, None)
    _, tensors = _read(tmp_path)
    # int-quantized codes say no width
    with pytest.raises(FormatError, match="int8 codes do not say their width: pass bits"):
        import_layer(Format.COMPRESSED_TENSORS, tensors, "proj", activations="fp8-tensor")
    # ... nor may they exceed it
    with pytest.raises(FormatError, match=r"int8 codes in \[-8, 7\] are not 2-bit ones \(\[-2, 1\]\)"):
        import_layer(Format.COMPRESSED_TENSORS, tensors, "proj", bits=2, activations="fp8-tensor")
    # an input zero point other than 0
    bad = dict(tensors, **{"proj.input_zero_point": torch.ones(1)})
    with pytest.raises(FormatError, match="input_zero_point is not 0"):
        import_layer(Format.COMPRESSED_TENSORS, bad, "proj", bits=4, activations="fp8-tensor")
    ok = dict(tensors, **{"proj.input_zero_point": torch.zeros(1, dtype=torch.float8_e4m3fn)})
    assert import_layer(Format.COMPRESSED_TENSORS, ok, "proj", bits=4, activations="fp8-tensor").act_format == "fp8"
    # e4m3 activations from another format
    awq = {"l.qweight": torch.zeros(128, 4, dtype=torch.int32), "l.qzeros": torch.zeros(1, 4, dtype=torch.int32),
           "l.scales": torch.ones(1, 32, dtype=torch.float16)}
    with pytest.raises(ValueError, match="read from compressed-tensors checkpoints only, this layer is awq"):
        import_layer(Format.AWQ, awq, "l", activations="fp8-token")


def test_eight_bit_weights_with_fp8_activations_are_unsupported(ct, tmp_path):
    _, packer = ct
    packer.w4a8_checkpoint(tmp_path, _weight(32, 128), 8, True, "token", 64, "pack-quantized")
    _, tensors = _read(tmp_path)
    with pytest.raises(UnsupportedLayerError, match="e4m3 activations need 4- or 2-bit weights.*8-bit"):
        import_layer(Format.COMPRESSED_TENSORS, tensors, "proj", bits=8, activations="fp8-token")
    assert import_layer(Format.COMPRESSED_TENSORS, tensors, "proj", bits=8).act_format == "bf16"


def test_tensor_parallel_shards_keep_the_activation_scheme(ct, tmp_path):
    """Every shard keeps act_format and the static scale; a row-parallel shard of per-token e4m3
    activations is refused (a token's scale is its whole row's amax)."""
    _, packer = ct
    packer.w4a8_checkpoint(tmp_path / "s", _weight(64, 256), 4, True, "tensor", 64, "pack-quantized")
    _, tensors = _read(tmp_path / "s")
    for dim in (0, 1):
        part = import_layer(Format.COMPRESSED_TENSORS, tensors, "proj", bits=4, activations="fp8-tensor",
                            tp_rank=1, tp_size=2, tp_dim=dim)
        assert part.act_format == "fp8" and part.input_scale == tensors["proj.input_scale"].float().reshape(())
    packer.w4a8_checkpoint(tmp_path / "d", _weight(64, 256), 4, True, "token", 64, "pack-quantized")
    _, tensors = _read(tmp_path / "d")
    assert import_layer(Format.COMPRESSED_TENSORS, tensors, "proj", bits=4, activations="fp8-token", tp_rank=0,
                        tp_size=2, tp_dim=0).act_format == "fp8"
    with pytest.raises(ShardError, match="row-parallel split .* per-token e4m3 activations"):
        import_layer(Format.COMPRESSED_TENSORS, tensors, "proj", bits=4, activations="fp8-token", tp_rank=0,
                     tp_size=2, tp_dim=1)


def test_weights_alone_are_unchanged(ct, tmp_path):
    """Without activations the import is the weight-only one (act_format 'bf16'), silently."""
    _, packer = ct
    reference, _ = packer.w4a8_checkpoint(tmp_path, _weight(), 4, False, "token", 64, "pack-quantized")
    _, tensors = _read(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer = import_layer(Format.COMPRESSED_TENSORS, tensors, "proj")
    assert layer.act_format == "bf16" and layer.input_scale is None
    assert torch.equal(dequantize_reference(layer.qweight), reference)


# ---------------------------------------------------------------------------------------------
# import_checkpoint (mixgemm prepack --from): the int-quantized layout
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activations", ["token", "tensor"])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (2, True), (2, False)],
                         ids=["s4", "u4", "s2", "u2"])
def test_import_checkpoint_reads_int_quantized(ct, tmp_path, activations, bits, symmetric):
    """An int-quantized state dict, with the bits from its config or from the argument, gives the
    weights compressed-tensors' own decompression gives, and the pack-quantized import of the
    same weights, bit for bit; its input_scale stays a plain tensor, as a pack-quantized one's
    does; a plain bf16 weight is copied through."""
    _, packer = ct
    w = _weight(seed=10 + bits)
    reference, _ = packer.w4a8_checkpoint(tmp_path / "int", w, bits, symmetric, activations, 64, None)
    packer.w4a8_checkpoint(tmp_path / "packed", w, bits, symmetric, activations, 64, "pack-quantized")
    raw, tensors = _read(tmp_path / "int")
    _, packed = _read(tmp_path / "packed")
    assert raw["format"] == "int-quantized" and tensors["proj.weight"].dtype == torch.int8
    assert detect_format(tensors, "proj") is Format.COMPRESSED_TENSORS
    tensors["head.weight"] = _weight(16, 256, seed=3)
    from_packed = import_checkpoint("compressed-tensors", packed)
    with pytest.warns(UserWarning, match="from_pretrained computes with bf16/fp16 activations"):
        parsed = parse_quantization_config(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # the activations are not read here: no warning
        runs = {"config": import_checkpoint("compressed-tensors", tensors, quantization_config=raw),
                "bits": import_checkpoint("compressed-tensors", tensors, bits=bits),
                "auto": import_checkpoint("auto", tensors, quantization_config=parsed)}
    for how, out in runs.items():
        assert sorted(out) == sorted([*from_packed, "head.weight"]), how
        qw = out["proj.weight"]
        assert isinstance(qw, mixgemm.PackedWeight) and (qw.bits, qw.symmetric) == (bits, symmetric), how
        assert torch.equal(dequantize_reference(qw), reference), how
        assert torch.equal(dequantize_reference(qw), dequantize_reference(from_packed["proj.weight"])), how
        assert out["head.weight"] is tensors["head.weight"]
        if activations == "tensor":
            assert out["proj.input_scale"] is tensors["proj.input_scale"]
            assert torch.equal(out["proj.input_scale"], from_packed["proj.input_scale"])
        else:
            assert "proj.input_scale" not in out


def _edited(tensors, raw, change):
    tensors, raw = dict(tensors), json.loads(json.dumps(raw))
    weights = raw["config_groups"]["group_0"]["weights"]
    if change == "drop_scale":
        del tensors["proj.weight_scale"]
    elif change == "short_scale":
        tensors["proj.weight_scale"] = tensors["proj.weight_scale"][:16]
    elif change == "bf16_weight":
        tensors["proj.weight"] = tensors["proj.weight"].to(torch.bfloat16)
    elif change == "both_layouts":
        tensors["proj.weight_packed"] = torch.zeros(32, 16, dtype=torch.int32)
    elif change == "config_2bit":
        weights["num_bits"] = 2
    elif change == "config_no_bits":
        del weights["num_bits"]
    elif change == "config_ignores":
        raw["ignore"] = ["proj"]
    return tensors, raw


@pytest.mark.parametrize("change,kw,msg", [
    (None, dict(), "layer 'proj': an int-quantized layer's int8 codes do not say their width, and no "
                   "quantization_config gives its num_bits: pass bits (mixgemm prepack: --bits)"),
    ("config_no_bits", dict(config=True), "layer 'proj': an int-quantized layer's int8 codes do not say their width"),
    (None, dict(bits=2), "layer 'proj': int8 codes in [-8, 7] are not 2-bit ones ([-2, 1])"),
    ("config_2bit", dict(config=True), "layer 'proj': int8 codes in [-8, 7] are not 2-bit ones ([-2, 1])"),
    ("drop_scale", dict(config=True), "layer 'proj': the quantization_config stores it int-quantized (int8 codes "
                                      "in 'proj.weight'), but 'proj.weight_scale' is missing"),
    ("drop_scale", dict(bits=4), "layer 'proj': 'proj.weight_zero_point' belongs to a compressed-tensors layer, "
                                 "but there is no 'proj.weight_packed' or int8 'proj.weight'"),
    ("short_scale", dict(bits=4), "layer 'proj': weight_scale [16, 2] does not match N=32"),
    ("bf16_weight", dict(bits=4), "layer 'proj': 'proj.weight_scale' belongs to a compressed-tensors layer, "
                                  "but there is no 'proj.weight_packed' or int8 'proj.weight'"),
    ("both_layouts", dict(bits=4), "layer 'proj': has both a compressed-tensors quantized weight and a plain "
                                   "tensor 'proj.weight'"),
    ("config_ignores", dict(config=True), "layer 'proj': holds quantized tensors, but the quantization_config says "
                                          "it is not quantized"),
    (None, dict(config=True, bits=8), "layer 'proj': bits=8 was given, but the quantization_config gives this "
                                      "layer num_bits=4"),
])
def test_import_checkpoint_int_quantized_refusals(ct, tmp_path, change, kw, msg):
    _, packer = ct
    packer.w4a8_checkpoint(tmp_path, _weight(32, 128), 4, False, "tensor", 64, None)
    raw, tensors = _read(tmp_path)
    assert import_checkpoint("compressed-tensors", tensors, quantization_config=raw)["proj.weight"].bits == 4
    tensors, raw = _edited(tensors, raw, change)
    if kw.pop("config", False):
        kw["quantization_config"] = raw
    with pytest.raises(FormatError) as excinfo:
        import_checkpoint("auto", tensors, **kw)
    assert str(excinfo.value).startswith(msg), str(excinfo.value)
    assert "\n" not in str(excinfo.value)
