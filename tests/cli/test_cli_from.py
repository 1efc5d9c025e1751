"""`mixgemm prepack --from FORMAT`: converting quantized checkpoints (file or shard directory)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mixgemm
from mixgemm import formats
from mixgemm.cli.main import main

import hf_checkpoints as hc      # tiny checkpoints in each format, with their formats' own weights
import reference_packers as rp   # the formats' independent reference packers


def _awq_ckpt(path):
    k, gs = rp.shape_for(128)
    qweight, qzeros, scales = rp.make_awq(k, gs, rp.gen_for("cli-awq"))
    bias = torch.randn(rp.N, dtype=torch.float16)
    save_file({"model.proj.qweight": qweight, "model.proj.qzeros": qzeros, "model.proj.scales": scales,
               "model.proj.bias": bias, "model.norm.weight": torch.ones(k, dtype=torch.float16)}, str(path))
    return formats.from_awq(qweight, qzeros, scales), bias


def test_from_awq_file(tmp_path, capsys):
    src, dst = tmp_path / "awq.safetensors", tmp_path / "out.safetensors"
    want, bias = _awq_ckpt(src)
    assert main(["prepack", str(src), "-o", str(dst), "--from", "awq"]) == 0
    got = mixgemm.load(str(dst))
    packed = got["model.proj.weight"]
    assert isinstance(packed, mixgemm.PackedWeight)
    assert torch.equal(mixgemm.dequantize_reference(packed).view(torch.int16),
                       mixgemm.dequantize_reference(want.qweight).view(torch.int16))
    assert torch.equal(got["model.proj.bias"], bias) and "model.norm.weight" in got
    assert "converted 1 awq layers" in capsys.readouterr().out


def test_from_gptq_shard_directory_with_act_order(tmp_path):
    k, gs = rp.shape_for(128)
    gen = rp.gen_for("cli-gptq")
    t = rp.make_gptq(k, gs, 4, False, "gptq", torch.float16, gen, g_idx=rp.random_act_order_g_idx(k, gs, gen))
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({f"l.{n}": v for n, v in t.items() if n in ("qweight", "qzeros")}, str(d / "a.safetensors"))
    save_file({f"l.{n}": v for n, v in t.items() if n in ("scales", "g_idx")}, str(d / "b.safetensors"))
    (d / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": gs, "desc_act": True}))
    dst = tmp_path / "out.safetensors"
    (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    assert main(["prepack", str(d), "-o", str(dst), "--from", "gptq"]) == 0
    got = mixgemm.load(str(dst))
    perm = got["l.perm"]
    w_ref = rp.gptq_reference_dequant(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, "gptq")
    x = torch.randn(3, k, dtype=torch.float64)
    y = x[:, perm] @ mixgemm.dequantize_reference(got["l.weight"]).double().T
    assert torch.allclose(y, x @ w_ref.double().T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case,message", [
    ("no-gptq-format", "checkpoint_format"),
    ("corrupt", "not a valid safetensors file"),
    ("no-layer", "no awq quantized layer"),
    ("with-bits", "come from the checkpoint"),
    ("missing", "no such file"),
])
def test_from_errors_leave_no_output(tmp_path, capsys, case, message):
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    args = ["prepack", str(src), "-o", str(dst), "--from", "awq"]
    if case == "no-gptq-format":
        k, gs = rp.shape_for(128)
        t = rp.make_gptq(k, gs, 4, True, "gptq", torch.float16, rp.gen_for("cli-err"))
        save_file({f"l.{n}": v for n, v in t.items()}, str(src))
        args[-1] = "gptq"
    elif case == "corrupt":
        _awq_ckpt(src)
        src.write_bytes(src.read_bytes()[:100])
    elif case == "no-layer":
        save_file({"x.weight": torch.zeros(4, 4)}, str(src))
    elif case == "with-bits":
        _awq_ckpt(src)
        args += ["--bits", "4"]
    rc = main(args)
    assert rc != 0
    assert message in capsys.readouterr().err
    assert not dst.exists()


# ------------------------------------------------------- compressed-tensors int-quantized (int8 codes)
def _source_order(packed, perm):
    """A packed weight dequantized, its act-order permutation (if any) undone."""
    w = mixgemm.dequantize_reference(packed)
    if perm is None:
        return w
    src = torch.empty_like(w)
    src[:, perm] = w
    return src


@pytest.mark.parametrize("kind", ["w4a8-token", "w2a8-static-asym", "u4-act-order"])
@pytest.mark.parametrize("spec", ["compressed-tensors", "auto"])
def test_from_compressed_tensors_int_quantized_directory(tmp_path, capsys, kind, spec):
    """An int-quantized checkpoint directory (int8 codes, bits from its config.json): each layer
    reads back as its format's own dequantization, and as the pack-quantized checkpoint of the
    same weights converts; input scales and plain tensors are copied through."""
    opts = {"w4a8-token": dict(fp8_activations="token"),
            "w2a8-static-asym": dict(bits=2, symmetric=False, fp8_activations="tensor"),
            "u4-act-order": dict(group_size=128, symmetric=False, act_order=True)}[kind]
    ref = hc.write_compressed_tensors(tmp_path / "int", layout="int-quantized", **opts)
    hc.write_compressed_tensors(tmp_path / "packed", **opts)
    source = load_file(str(tmp_path / "int" / "model.safetensors"))
    assert all(source[f"{name}.weight"].dtype == torch.int8 for name in ref.linears)
    dst, twin = tmp_path / "int.safetensors", tmp_path / "packed.safetensors"
    assert main(["prepack", str(tmp_path / "int"), "-o", str(dst), "--from", spec]) == 0
    assert f"converted {len(ref.linears)} {spec} layers" in capsys.readouterr().out
    assert main(["prepack", str(tmp_path / "packed"), "-o", str(twin), "--from", spec]) == 0
    got, want = mixgemm.load(str(dst)), mixgemm.load(str(twin))
    assert sorted(got) == sorted(want)
    for name, weight in ref.linears.items():
        packed = got[f"{name}.weight"]
        assert isinstance(packed, mixgemm.PackedWeight)
        assert torch.equal(_source_order(packed, got.get(f"{name}.perm")), weight), name
        assert torch.equal(mixgemm.dequantize_reference(packed), mixgemm.dequantize_reference(want[f"{name}.weight"]))
        assert (f"{name}.perm" in got) == opts.get("act_order", False)
        if opts.get("fp8_activations") == "tensor":
            assert torch.equal(got[f"{name}.input_scale"], source[f"{name}.input_scale"])
        else:
            assert f"{name}.input_scale" not in got
    for key, value in ref.plain.items():                # lm_head's bf16 weight among them
        assert torch.equal(got[key], value), key


def test_from_compressed_tensors_int_quantized_written_by_the_library(tmp_path):
    """A checkpoint compressed-tensors itself writes in its default layout for W4A8 (int-quantized):
    the weight reads back as its own decompression, bit for bit."""
    pytest.importorskip("compressed_tensors")
    import ct_packer

    w = (torch.randn(48, 256, generator=torch.Generator().manual_seed(7)) * 0.05).to(torch.bfloat16)
    reference, _ = ct_packer.w4a8_checkpoint(tmp_path / "ckpt", w, 4, False, "tensor", 64)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]["format"] \
        == "int-quantized"
    dst = tmp_path / "out.safetensors"
    assert main(["prepack", str(tmp_path / "ckpt"), "-o", str(dst), "--from", "compressed-tensors"]) == 0
    got = mixgemm.load(str(dst))
    assert torch.equal(mixgemm.dequantize_reference(got["proj.weight"]), reference)
    assert torch.equal(got["proj.input_scale"],
                       load_file(str(tmp_path / "ckpt" / "model.safetensors"))["proj.input_scale"])


def test_from_compressed_tensors_int_quantized_bits_from_the_command_line(tmp_path):
    """A config that gives no num_bits: --bits gives the codes' width."""
    ref = hc.write_compressed_tensors(tmp_path / "ckpt", layout="int-quantized")
    hc.edit_config(tmp_path / "ckpt", quantization_config=None)
    dst = tmp_path / "out.safetensors"
    assert main(["prepack", str(tmp_path / "ckpt"), "-o", str(dst), "--from", "compressed-tensors",
                 "--bits", "4"]) == 0
    got = mixgemm.load(str(dst))
    for name, weight in ref.linears.items():
        assert torch.equal(mixgemm.dequantize_reference(got[f"{name}.weight"]), weight), name


@pytest.mark.parametrize("case,extra,message,rc_want", [
    ("no-bits", [], "layer 'model.layers.0.mlp.down_proj': an int-quantized layer's int8 codes do not say their "
                    "width, and no quantization_config gives its num_bits: pass bits (mixgemm prepack: --bits)", 1),
    ("bits-too-few", ["--bits", "2"], "layer 'model.layers.0.mlp.down_proj': int8 codes in [-8, 7] are not "
                                      "2-bit ones ([-2, 1])", 1),
    ("config-too-few", [], "int8 codes in [-8, 7] are not 2-bit ones ([-2, 1])", 1),
    ("bits-disagree", ["--bits", "2"], "layer 'model.layers.0.mlp.down_proj': bits=2 was given, but the "
                                       "quantization_config gives this layer num_bits=4", 1),
    ("no-scale", [], "layer 'model.layers.0.self_attn.q_proj': the quantization_config stores it int-quantized "
                     "(int8 codes in 'model.layers.0.self_attn.q_proj.weight'), but "
                     "'model.layers.0.self_attn.q_proj.weight_scale' is missing", 1),
    ("short-scale", [], "layer 'model.layers.0.self_attn.q_proj': weight_scale [128, 4] does not match N=256", 1),
    ("bad-config", [], "config.json: compressed-tensors format 'float-quantized' (config group 'group_0') is "
                       "not supported", 1),
    ("group-size", ["--group-size", "64"], "--bits, --group-size and --symmetric come from the checkpoint with "
                                           "--from", 2),
])
def test_from_compressed_tensors_int_quantized_refusals_leave_no_output(tmp_path, capsys, case, extra, message,
                                                                       rc_want):
    src = tmp_path / "ckpt"
    hc.write_compressed_tensors(src, layout="int-quantized")
    q = "model.layers.0.self_attn.q_proj"
    config = json.loads((src / "config.json").read_text())["quantization_config"]
    if case in ("no-bits", "bits-too-few"):
        del config["config_groups"]["group_0"]["weights"]["num_bits"]
        hc.edit_config(src, quantization_config=config)
    elif case == "config-too-few":
        config["config_groups"]["group_0"]["weights"]["num_bits"] = 2
        hc.edit_config(src, quantization_config=config)
    elif case == "no-scale":
        hc.rewrite(src, lambda t: t.pop(f"{q}.weight_scale"))
    elif case == "short-scale":
        hc.rewrite(src, lambda t: t.update({f"{q}.weight_scale": t[f"{q}.weight_scale"][:128].clone()}))
    elif case == "bad-config":
        hc.edit_config(src, quantization_config={"format": "float-quantized"})
    dst = tmp_path / "out.safetensors"
    rc = main(["prepack", str(src), "-o", str(dst), "--from", "compressed-tensors", *extra])
    err = capsys.readouterr().err
    assert rc == rc_want
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not dst.exists()
