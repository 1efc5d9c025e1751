"""`mixgemm prepack --from FORMAT`: converting quantized checkpoints (file or shard directory)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import mixgemm
from mixgemm import formats
from mixgemm.cli.main import main

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
