"""Refusals of the command line that name the real cause, each in one line: an overflow with the
command line's own remedy (and never the dtype that overflowed), a full stdout after the output
file was written, a GGUF file given as safetensors, an fp8 weight that prepack would otherwise
have copied through."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mixgemm.cli.main import main
from mixgemm.weights.io import load
from mixgemm.weights.types import PackedWeight

ROOT = Path(__file__).resolve().parents[2]
ERR = "mixgemm prepack: error: "
NAME = "layers.0.proj.weight"


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def checkpoint(path: Path, weight: torch.Tensor, **extra) -> Path:
    safetensors.torch.save_file({NAME: weight, **extra}, str(path))
    return path


@pytest.mark.parametrize("dtype,source,message", [
    ("fp16", torch.float32, f"cannot quantize {NAME}: the dequantized weights overflow fp16 (|w| up to 65504); "
                            f"pass --dtype bf16 (bf16 has fp32's range), or skip it with --exclude "),
    ("bf16", torch.float64, f"cannot quantize {NAME}: the scales overflow bf16 (|w| up to 1e+300); "
                            f"no activation dtype holds these values, or skip it with --exclude "),
])
def test_overflow_hint_in_the_command_lines_words(capsys, tmp_path, dtype, source, message, pin_case):
    w = torch.zeros(16, 64, dtype=source)
    w[0, 0] = 65504.0 if dtype == "fp16" else 1e300
    src = checkpoint(tmp_path / "in.safetensors", w)
    out = tmp_path / "out.safetensors"
    rc, _, err = run(capsys, "prepack", src, "-o", out, "--bits", "2", "--group-size", "64", "--dtype", dtype)
    assert rc == 1 and len(err.splitlines()) == 1 and err.startswith(ERR + message), err
    assert "torch." not in err and "dtype=" not in err
    if dtype == "bf16":
        assert "--dtype bf16" not in err, "never the dtype that overflowed"
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["in.safetensors"]
    pin_case("Values", f"a weight that overflows {dtype} (command line)",
             f"mixgemm prepack IN -o OUT --bits 2 --group-size 64 --dtype {dtype}", "exit 1", err.splitlines()[0])


def test_the_api_overflow_hint(pin_case):
    from mixgemm import quantize
    from mixgemm.errors import OverflowQuantizeError
    w = torch.zeros(16, 64)
    w[0, 0] = 65504.0
    with pytest.raises(OverflowQuantizeError) as excinfo:
        quantize(w, 2, 64, dtype=torch.float16)
    assert str(excinfo.value) == ("the dequantized weights overflow torch.float16 (|w| up to 65504); quantize for "
                                  "bfloat16 instead (dtype=torch.bfloat16), whose range is float32's")
    with pytest.raises(OverflowQuantizeError) as excinfo:
        quantize(torch.full((16, 64), 1e300, dtype=torch.float64), 2, 64)
    assert "bfloat16 instead" not in str(excinfo.value) and "scale the weight down" in str(excinfo.value)
    pin_case("Values", "a weight that overflows bf16 (API)", "mixgemm.quantize(w, 2, 64)", "OverflowQuantizeError",
             str(excinfo.value))


def test_a_full_stdout_after_the_file_was_written(tmp_path, pin_case):
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    src = checkpoint(tmp_path / "in.safetensors", w)
    out = tmp_path / "out.safetensors"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open("/dev/full", "w") as full:          # opened for writing only: it stays as it is
        res = subprocess.run([sys.executable, "-m", "mixgemm", "prepack", str(src), "-o", str(out), "--bits", "4",
                              "--group-size", "64"], stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=tmp_path, timeout=120)
    assert res.returncode == 1
    # (whether the first print or the final flush fails depends on the stream's buffering)
    assert res.stderr.splitlines() in ([ERR + "cannot write to stdout: No space left on device (the command stopped "
                                              "there; any file it wrote before is complete)"],
                                       [ERR + "cannot write to stdout: No space left on device (the command itself "
                                              "finished; only its report is lost)"]), res.stderr
    assert isinstance(load(out)[NAME], PackedWeight), "the output file was written"
    pin_case("Command line", "stdout on a full disk (> /dev/full)", "mixgemm prepack IN -o OUT ... > /dev/full",
             "exit 1", res.stderr.splitlines()[0], "none (OUT written, complete)")


def test_a_full_stdout_at_the_final_flush(capsys, monkeypatch):
    """The report lost when the command had finished: said so."""
    import errno
    from mixgemm.cli import main as cli

    class Full:
        def write(self, text):
            return len(text)

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sys, "stdout", Full())
    monkeypatch.setattr(cli, "_silence_stdout", lambda: None)
    rc = main(["generate", "--list", "--kernels", "dequant_bf16_u4$"])
    err = capsys.readouterr().err
    assert rc == 1 and err == ("mixgemm generate: error: cannot write to stdout: No space left on device (the command "
                               "itself finished; only its report is lost)\n")


def test_a_gguf_file_without_from_gguf(capsys, tmp_path, pin_case):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF" + bytes(60))
    rc, _, err = run(capsys, "prepack", src, "-o", tmp_path / "o.safetensors", "--bits", "4", "--group-size", "64")
    assert rc == 1 and err == ERR + f"{src} is a GGUF file, not safetensors; convert it with --from gguf\n"
    pin_case("Files", "a .gguf file without --from gguf", "mixgemm prepack model.gguf -o OUT --bits 4 --group-size 64",
             "exit 1", err.splitlines()[0])
    rc, _, err = run(capsys, "prepack", src, "-o", tmp_path / "o.safetensors", "--from", "awq")
    assert rc == 1 and err == ERR + f"{src} is a GGUF file, not safetensors; convert it with --from gguf instead\n"
    assert sorted(os.listdir(tmp_path)) == ["model.gguf"]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_prepack_refuses_an_fp8_weight_by_name(capsys, tmp_path, fp8, pin_case):
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.1).to(fp8)
    src = checkpoint(tmp_path / "in.safetensors", w, **{NAME + "_scale": torch.tensor(0.5)})
    out = tmp_path / "out.safetensors"
    rc, _, err = run(capsys, "prepack", src, "-o", out, "--bits", "4", "--group-size", "64")
    kind = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}[fp8]
    assert rc == 1 and len(err.splitlines()) == 1
    assert err.startswith(ERR + f"cannot prepack 1 selected tensor(s) of {src}: {NAME} [N=64, K=128] {kind}: an fp8 "
                                f"weight, whose values need the checkpoint's scale, which prepack does not apply; "
                                f"skip a tensor with --exclude"), err
    assert not out.exists()
    pin_case("Values", f"an {kind} weight (command line)", "mixgemm prepack IN -o OUT --bits 4 --group-size 64",
             "exit 1", err.splitlines()[0])


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_refuses_an_fp8_weight_by_name(fp8, pin_case):
    import mixgemm
    with pytest.raises(TypeError) as excinfo:
        mixgemm.quantize(torch.zeros(16, 64).to(fp8), 4, 64)
    assert str(excinfo.value) == (f"w is {fp8}: fp8 values mean nothing without the checkpoint's scale "
                                  f"(weight_scale); dequantize first (w.float() * scale) and quantize that")
    pin_case("Values", f"quantize of a {fp8} weight", "mixgemm.quantize(w, 4, 64)", "TypeError", str(excinfo.value))


def test_prepack_from_compressed_tensors_refuses_an_fp8_layer_by_name(capsys, tmp_path, pin_case):
    """A compressed-tensors float-quantized checkpoint (fp8 weight + weight_scale): named, not
    copied through, not 'an incomplete layer'."""
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.1).to(torch.float8_e4m3fn)
    src = checkpoint(tmp_path / "in.safetensors", w, **{"layers.0.proj.weight_scale": torch.ones(64, 1),
                                                        "layers.0.proj.input_scale": torch.ones(1)})
    out = tmp_path / "out.safetensors"
    rc, _, err = run(capsys, "prepack", src, "-o", out, "--from", "compressed-tensors")
    assert rc == 1 and len(err.splitlines()) == 1
    assert err == (ERR + f"layer 'layers.0.proj': '{NAME}' is torch.float8_e4m3fn: an fp8 layer (compressed-tensors "
                         f"float-quantized, with a weight_scale); mixgemm imports integer layers (dequantize it by "
                         f"its scale and quantize that with `mixgemm prepack`, or leave fp8 layers to an fp8 kernel)\n")
    assert not out.exists()
    pin_case("Values", "an fp8 layer with --from compressed-tensors",
             "mixgemm prepack IN -o OUT --from compressed-tensors", "exit 1", err.splitlines()[0])
