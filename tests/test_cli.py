"""The `mixgemm` command line: prepack end to end, every refused input, the demo."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from mixgemm import cli
from mixgemm.cli import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, NO_GPU_MESSAGE, main
from mixgemm.io import load, read_metadata, save
from mixgemm.layout import prepack, unpack
from mixgemm.quantize import quantize
from mixgemm.types import LAYOUT_VERSION, PackedWeight

PACKED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight")


def make_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen) * 0.05
    return {
        "model.embed_tokens.weight": r(64, 128).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": r(64, 128).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": r(64).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": r(32, 256),  # fp32
        "model.layers.0.input_layernorm.weight": r(128).to(torch.bfloat16),
        "model.norm.weight": r(128),
        "lm_head.weight": r(64, 128).to(torch.bfloat16),
        "model.rotary_emb.inv_freq": r(16),
        "position_ids": torch.arange(8).view(1, 8),
    }


def write_checkpoint(path, tensors, metadata=None):
    safetensors.torch.save_file(tensors, str(path), metadata=metadata or {"format": "pt"})
    return path


@pytest.fixture
def checkpoint(tmp_path):
    src = tmp_path / "in" / "model.safetensors"
    src.parent.mkdir()
    return write_checkpoint(src, make_tensors())


@pytest.fixture
def out_dir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("bits,group,symmetric,dtype", [
    (4, "64", False, None),
    (8, "channel", True, None),
    (2, "32", False, "fp16"),
])
def test_prepack_end_to_end(capsys, checkpoint, out_dir, bits, group, symmetric, dtype):
    out = out_dir / "packed.safetensors"
    argv = ["prepack", checkpoint, "-o", out, "--bits", bits, "--group-size", group]
    argv += ["--symmetric"] if symmetric else []
    argv += ["--dtype", dtype] if dtype else []
    rc, stdout, stderr = run(capsys, *argv)
    assert rc == 0, stderr
    original = make_tensors()
    loaded = load(out)
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        if name in PACKED:
            packed = loaded[name]
            assert isinstance(packed, PackedWeight)
            k = tensor.shape[1]
            want = quantize(tensor, bits, k if group == "channel" else int(group),
                            symmetric=symmetric, dtype=dtype)
            got = unpack(packed)
            assert torch.equal(got.qweight, want.qweight)
            assert torch.equal(got.scales, want.scales)
            assert (want.zeros is None and got.zeros is None) or torch.equal(got.zeros, want.zeros)
            assert packed.dtype == (torch.float16 if dtype == "fp16" else torch.bfloat16)
        else:  # copied bit-exact
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    meta = read_metadata(out)
    assert meta["format"] == "pt"  # the input's metadata is kept
    assert meta["prepack.source"] == "model.safetensors"
    assert meta["prepack.bits"] == str(bits) and meta["prepack.group_size"] == group
    assert meta["prepack.symmetric"] == str(symmetric).lower()
    # the summary
    assert f"wrote {out}" in stdout
    assert re.search(r"tensors: 2 packed .*, 7 copied unchanged", stdout)
    before = sum(t.numel() * t.element_size() for t in original.values())
    after = sum(v.nbytes if isinstance(v, PackedWeight) else v.numel() * v.element_size()
                for v in loaded.values())
    assert "total: " in stdout and f"({before:,} B) -> " in stdout and f"({after:,} B)" in stdout
    assert f"ratio {after / before:.3f}" in stdout


def test_include_exclude(capsys, checkpoint, out_dir):
    out = out_dir / "a.safetensors"
    rc, _, err = run(capsys, "prepack", checkpoint, "-o", out, "--bits", 4, "--group-size", 64,
                     "--exclude", "down_proj")
    assert rc == 0, err
    loaded = load(out)
    assert isinstance(loaded[PACKED[0]], PackedWeight)
    assert not isinstance(loaded[PACKED[1]], PackedWeight)
    out = out_dir / "b.safetensors"
    rc, _, err = run(capsys, "prepack", checkpoint, "-o", out, "--bits", 4, "--group-size", 64,
                     "--include", "lm_head", "--no-default-exclude")
    assert rc == 0, err
    loaded = load(out)
    assert [n for n, v in loaded.items() if isinstance(v, PackedWeight)] == ["lm_head.weight"]


@pytest.mark.parametrize("name,selected", [
    ("model.layers.0.self_attn.q_proj.weight", True),
    ("model.layers.3.self_attn.o_proj.weight", True),
    ("model.layers.0.mlp.gate_proj.weight", True),
    ("model.layers.0.mlp.experts.7.w2.weight", True),
    ("transformer.h.0.attn.c_attn.weight", True),
    ("layers.0.attention.wo.weight", True),
    ("bert.encoder.layer.0.output.dense.weight", True),
    ("model.layers.0.self_attn.q_proj.bias", False),
    ("model.embed_tokens.weight", False),
    ("gpt_neox.embed_in.weight", False),
    ("embed_out.weight", False),
    ("transformer.wte.weight", False),
    ("transformer.wpe.weight", False),
    ("tok_embeddings.weight", False),
    ("lm_head.weight", False),
    ("output.weight", False),
    ("model.norm.weight", False),
    ("model.layers.0.input_layernorm.weight", False),
    ("model.layers.0.self_attn.q_norm.weight", False),
    ("layers.0.attention_norm.weight", False),
    ("transformer.h.0.ln_1.weight", False),
    ("transformer.ln_f.weight", False),
])
def test_default_selection(name, selected):
    assert bool(re.search(DEFAULT_INCLUDE, name) and not re.search(DEFAULT_EXCLUDE, name)) == selected


# ------------------------------------------------------------------------- refused inputs


def assert_refused(capsys, out_dir, argv, message, rc_expected=1):
    rc, _, err = run(capsys, *argv)
    assert rc == rc_expected
    assert re.search(message, err), err
    assert os.listdir(out_dir) == []  # no output file, no temporary


def prepack_argv(src, out_dir, *extra):
    return ["prepack", src, "-o", out_dir / "out.safetensors", "--bits", "4",
            "--group-size", "64", *extra]


def test_missing_input(capsys, tmp_path, out_dir):
    assert_refused(capsys, out_dir, prepack_argv(tmp_path / "nope.safetensors", out_dir),
                   "nope.safetensors: no such file")


def test_corrupt_input(capsys, tmp_path, out_dir):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage" + os.urandom(100))
    assert_refused(capsys, out_dir, prepack_argv(bad, out_dir), "not a valid safetensors file")


def test_truncated_input(capsys, checkpoint, out_dir):
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(data[:-50])
    assert_refused(capsys, out_dir, prepack_argv(checkpoint, out_dir), "not a valid safetensors file")


def test_nothing_selected(capsys, checkpoint, out_dir):
    assert_refused(capsys, out_dir, prepack_argv(checkpoint, out_dir, "--include", "nomatch"),
                   "no tensor of .* is selected")


def test_group_size_does_not_divide_k(capsys, checkpoint, out_dir):
    argv = ["prepack", checkpoint, "-o", out_dir / "o.safetensors", "--bits", "4",
            "--group-size", "256"]
    assert_refused(capsys, out_dir, argv,
                   r"(?s)model\.layers\.0\.self_attn\.q_proj\.weight \[N=64, K=128\].*"
                   r"K=128 is not divisible by group_size=256.*--exclude")


@pytest.mark.parametrize("shape,message", [
    ((24, 128), r"odd_proj\.weight \[N=24, K=128\].*N=24 is not a multiple of 16"),
    ((32, 96), r"odd_proj\.weight \[N=32, K=96\].*K=96 is not a multiple of 64"),
])
def test_shape_not_packable(capsys, tmp_path, out_dir, shape, message):
    tensors = make_tensors()
    tensors["model.layers.0.mlp.odd_proj.weight"] = torch.randn(*shape)
    src = write_checkpoint(tmp_path / "odd.safetensors", tensors)
    assert_refused(capsys, out_dir, prepack_argv(src, out_dir, "--group-size", "32"),
                   r"(?s)" + message + r".*--exclude '\^model\\\.layers")


def test_unsupported_bits(capsys, checkpoint, out_dir):
    argv = ["prepack", checkpoint, "-o", out_dir / "o.safetensors", "--bits", "3",
            "--group-size", "64"]
    assert_refused(capsys, out_dir, argv, r"--bits: invalid choice: 3", rc_expected=2)


def test_unsupported_group_size(capsys, checkpoint, out_dir):
    argv = ["prepack", checkpoint, "-o", out_dir / "o.safetensors", "--bits", "4",
            "--group-size", "48"]
    assert_refused(capsys, out_dir, argv, r"group_size must be one of")


def test_already_packed(capsys, checkpoint, tmp_path, out_dir):
    packed_file = tmp_path / "packed.safetensors"
    rc, _, err = run(capsys, *prepack_argv(checkpoint, tmp_path)[:3], packed_file,
                     "--bits", "4", "--group-size", "64")
    assert rc == 0, err
    assert_refused(capsys, out_dir, prepack_argv(packed_file, out_dir),
                   "already a mixgemm packed file")


def test_layout_from_the_future(capsys, tmp_path, out_dir):
    w = torch.randn(32, 128)
    path = tmp_path / "future.safetensors"
    save(path, {"w": prepack(quantize(w, 4, 64))})
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    spec = json.loads(meta["mixgemm:w"])
    spec["layout_version"] = str(LAYOUT_VERSION + 1)
    meta["mixgemm:w"] = json.dumps(spec)
    safetensors.torch.save_file(tensors, str(path), metadata=meta)
    assert_refused(capsys, out_dir, prepack_argv(path, out_dir), "from the future.*upgrade mixgemm")


def test_non_finite_weight(capsys, tmp_path, out_dir):
    tensors = make_tensors()
    tensors[PACKED[1]][3, 3] = float("nan")
    src = write_checkpoint(tmp_path / "nan.safetensors", tensors)
    assert_refused(capsys, out_dir, prepack_argv(src, out_dir),
                   r"(?s)cannot quantize model\.layers\.0\.mlp\.down_proj\.weight: .*non-finite"
                   r".*--exclude")


def test_bad_regex(capsys, checkpoint, out_dir):
    assert_refused(capsys, out_dir, prepack_argv(checkpoint, out_dir, "--exclude", "(["),
                   "bad regular expression")


def test_output_is_input(capsys, checkpoint, out_dir):
    before = checkpoint.read_bytes()
    rc, _, err = run(capsys, "prepack", checkpoint, "-o", checkpoint, "--bits", "4",
                     "--group-size", "64")
    assert rc == 1 and "is the input file" in err
    assert checkpoint.read_bytes() == before


def test_output_directory_missing(capsys, checkpoint, tmp_path, out_dir):
    rc, _, err = run(capsys, "prepack", checkpoint, "-o", tmp_path / "no" / "o.safetensors",
                     "--bits", "4", "--group-size", "64")
    assert rc == 1 and "does not exist" in err


# ---------------------------------------------------------------------------- the rest


def test_no_command_prints_help(capsys):
    rc, _, err = run(capsys)
    assert rc == 2 and "prepack" in err and "demo" in err


def test_subcommand_registry_is_read_only():
    assert {"prepack", "demo"} <= set(cli.SUBCOMMANDS)
    with pytest.raises(TypeError):
        cli.SUBCOMMANDS["x"] = None


def test_python_dash_m(tmp_path):
    env = dict(os.environ)
    python_dir = str(Path(__file__).resolve().parents[1] / "python")
    env["PYTHONPATH"] = python_dir + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-m", "mixgemm", "prepack", "--help"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--group-size" in result.stdout and DEFAULT_EXCLUDE in result.stdout


def test_demo_without_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, err = run(capsys, "demo")
    assert rc == 0, err
    assert "weight [N=4096, K=4096] bf16" in out
    assert "u4" in out and "group size 128" in out
    assert "32.00 MiB (33,554,432 B) -> 8.50 MiB (8,912,896 B)" in out
    assert re.search(r"max \|w - deq\| = \d\.\d+e-0\d, relative \(Frobenius\) = \d\.\d+e-0\d", out)
    assert "holds for every element" in out
    assert "unpack(prepack(q)) == q exactly" in out
    assert out.rstrip().endswith(NO_GPU_MESSAGE)
    assert NO_GPU_MESSAGE == "the GEMM needs an NVIDIA Hopper (sm_90) GPU; none found, skipping it"


@pytest.mark.gpu
def test_demo_runs_the_gemm_on_hopper(capsys, monkeypatch, requires_gpu):
    """The demo's GPU branch, with mixgemm.gemm stood in for by the unfused reference."""
    import mixgemm
    from mixgemm.quantize import dequantize_reference

    calls = []

    def fake_gemm(x, packed):
        calls.append((tuple(x.shape), x.device.type, packed.device.type))
        return x @ dequantize_reference(packed).t()

    monkeypatch.setattr(mixgemm, "gemm", fake_gemm, raising=False)
    rc, out, err = run(capsys, "demo")
    assert rc == 0, err
    assert calls == [((64, 4096), "cuda", "cuda")]
    assert "running the GEMM via mixgemm.gemm" in out
    assert re.search(r"GEMM result \[64, 4096\] torch.bfloat16: .* relative = \d\.\d+e-0[3-9]", out)
