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

from mixgemm.cli import main as cli
from mixgemm.cli.main import NO_GPU_MESSAGE, main
from mixgemm.cli.prepack import DEFAULT_EXCLUDE, DEFAULT_INCLUDE
from mixgemm.weights.io import load, read_metadata, save
from mixgemm.weights.layout import prepack, unpack
from mixgemm.weights.quantize import quantize
from mixgemm.weights.types import LAYOUT_VERSION, PackedWeight

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
#
# Each refusal pins: the exit status, the one line on stderr (its start: "mixgemm prepack:
# error: ..."; no traceback), and that nothing is left behind: the output directory stays empty
# and the input's directory holds what it held (no temporary file anywhere).


def listing(*dirs):
    return {str(d): sorted(os.listdir(d)) for d in dirs}


def assert_refused(capsys, out_dir, argv, first_line, rc_expected=1, *, pin=None, case=None,
                   group="Options", call=None):
    inputs = [Path(a).parent for a in argv[1:2] if Path(a).parent.is_dir()]
    before = listing(*inputs)
    rc, _, err = run(capsys, *argv)
    assert rc == rc_expected, err
    lines = err.splitlines()
    assert len(lines) == 1, f"the error must be one line, got:\n{err}"
    assert re.match(first_line, lines[0]), lines[0]
    assert os.listdir(out_dir) == []  # no output file, no temporary
    assert listing(*inputs) == before
    if pin is not None:
        pin(group, case, call or "mixgemm " + " ".join(str(a) for a in argv), f"exit {rc}", lines[0])
    return lines[0]


def prepack_argv(src, out_dir, *extra):
    return ["prepack", src, "-o", out_dir / "out.safetensors", "--bits", "4",
            "--group-size", "64", *extra]


ERR = r"mixgemm prepack: error: "


def test_missing_input(capsys, tmp_path, out_dir, pin_case):
    assert_refused(capsys, out_dir, prepack_argv(tmp_path / "nope.safetensors", out_dir),
                   ERR + r"\S*nope\.safetensors: no such file$", pin=pin_case, group="Files",
                   case="missing input", call="mixgemm prepack nope.safetensors -o OUT --bits 4 --group-size 64")


def test_corrupt_input(capsys, tmp_path, out_dir, pin_case):
    """Not a safetensors file at all: random bytes."""
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(os.urandom(1000))
    assert_refused(capsys, out_dir, prepack_argv(bad, out_dir),
                   ERR + r"\S*bad\.safetensors: not a valid safetensors file \(corrupt or truncated\?\)",
                   pin=pin_case, group="Files", case="not a safetensors file (random bytes)",
                   call="mixgemm prepack random.bin -o OUT --bits 4 --group-size 64")


def test_garbage_header_json(capsys, tmp_path, out_dir, pin_case):
    """A correct 8-byte header length, then a header that is not JSON."""
    bad = tmp_path / "garbage.safetensors"
    header = b"{garbage, not json}"
    bad.write_bytes(len(header).to_bytes(8, "little") + header + os.urandom(64))
    assert_refused(capsys, out_dir, prepack_argv(bad, out_dir),
                   ERR + r"\S*garbage\.safetensors: not a valid safetensors file \(corrupt or truncated\?\)",
                   pin=pin_case, group="Files", case="garbage in the header JSON",
                   call="mixgemm prepack garbage.safetensors -o OUT --bits 4 --group-size 64")


def test_garbage_mixgemm_metadata_json(capsys, tmp_path, out_dir, pin_case):
    """A valid safetensors file whose mixgemm metadata entry is not JSON."""
    path = tmp_path / "meta.safetensors"
    save(path, {"w": prepack(quantize(torch.randn(32, 128), 4, 64))})
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    meta["mixgemm:w"] = "{not json"
    safetensors.torch.save_file(tensors, str(path), metadata=meta)
    assert_refused(capsys, out_dir, prepack_argv(path, out_dir),
                   ERR + r"\S*meta\.safetensors: packed weight 'w': metadata is not valid JSON",
                   pin=pin_case, group="Files", case="garbage in the mixgemm metadata JSON",
                   call="mixgemm prepack packed.safetensors -o OUT --bits 4 --group-size 64")


@pytest.mark.parametrize("cut", [50, 100_000])
def test_truncated_input(capsys, checkpoint, out_dir, cut, pin_case):
    """Cut in the tensor data, and cut inside the header."""
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(data[:-cut] if cut < len(data) else data[:20])
    where = "data" if cut < len(data) else "header"
    assert_refused(capsys, out_dir, prepack_argv(checkpoint, out_dir),
                   ERR + r"\S*model\.safetensors: not a valid safetensors file \(corrupt or truncated\?\)",
                   pin=pin_case, group="Files", case=f"truncated safetensors file (in its {where})",
                   call="mixgemm prepack truncated.safetensors -o OUT --bits 4 --group-size 64")


def test_nothing_selected(capsys, checkpoint, out_dir):
    assert_refused(capsys, out_dir, prepack_argv(checkpoint, out_dir, "--include", "nomatch"),
                   ERR + r"no tensor of .* is selected")


def test_group_size_does_not_divide_k(capsys, checkpoint, out_dir, pin_case):
    argv = ["prepack", checkpoint, "-o", out_dir / "o.safetensors", "--bits", "4",
            "--group-size", "256"]
    line = assert_refused(capsys, out_dir, argv,
                          ERR + r"cannot prepack 1 selected tensor\(s\) of \S+: "
                          r"model\.layers\.0\.self_attn\.q_proj\.weight \[N=64, K=128\] BF16: "
                          r"K=128 is not divisible by group_size=256",
                          pin=pin_case, case="group size that does not divide K",
                          call="mixgemm prepack IN -o OUT --bits 4 --group-size 256 (K = 128)")
    assert "--exclude '^model\\.layers\\.0\\.self_attn\\.q_proj\\.weight$'" in line
    assert "or choose a --group-size that divides every K" in line


@pytest.mark.parametrize("shape,message,case", [
    ((24, 128), r"odd_proj\.weight \[N=24, K=128\] F32: N=24 is not a multiple of 16",
     "N not a multiple of 16"),
    ((32, 96), r"odd_proj\.weight \[N=32, K=96\] F32: K=96 is not a multiple of 64",
     "K not a multiple of 64"),
])
def test_shape_not_packable(capsys, tmp_path, out_dir, shape, message, case, pin_case):
    tensors = make_tensors()
    tensors["model.layers.0.mlp.odd_proj.weight"] = torch.randn(*shape)
    src = write_checkpoint(tmp_path / "odd.safetensors", tensors)
    line = assert_refused(capsys, out_dir, prepack_argv(src, out_dir, "--group-size", "32"),
                          ERR + r"cannot prepack 1 selected tensor\(s\) of \S+: model\.layers\.0\.mlp\." + message,
                          pin=pin_case, case=case,
                          call=f"mixgemm prepack IN -o OUT --bits 4 --group-size 32 (a weight [{shape[0]}, {shape[1]}])")
    assert re.search(r"--exclude '\^model\\\.layers", line)


def test_unsupported_bits(capsys, checkpoint, out_dir, pin_case):
    argv = ["prepack", checkpoint, "-o", out_dir / "o.safetensors", "--bits", "3",
            "--group-size", "64"]
    assert_refused(capsys, out_dir, argv,
                   ERR + r"argument --bits: invalid choice: 3 \(choose from 8, 4, 2\) "
                   r"\(see `mixgemm prepack --help`\)$", rc_expected=2,
                   pin=pin_case, case="--bits 3", call="mixgemm prepack IN -o OUT --bits 3 --group-size 64")


def test_unsupported_group_size(capsys, checkpoint, out_dir):
    argv = ["prepack", checkpoint, "-o", out_dir / "o.safetensors", "--bits", "4",
            "--group-size", "48"]
    assert_refused(capsys, out_dir, argv, ERR + r"cannot prepack 2 selected .*group_size must be one of")


@pytest.mark.parametrize("argv,message", [
    (["--bits", "4"], r"--bits and --group-size are required"),
    (["--group-size", "64", "--from", "awq"], r"--bits, --group-size and --symmetric come from the checkpoint"),
])
def test_options_that_do_not_go_together(capsys, checkpoint, out_dir, argv, message, pin_case):
    """Found after parsing, still usage errors (exit status 2)."""
    full = ["prepack", checkpoint, "-o", out_dir / "o.safetensors", *argv]
    assert_refused(capsys, out_dir, full, ERR + message, rc_expected=2)


def test_already_packed(capsys, checkpoint, tmp_path, out_dir):
    packed_file = tmp_path / "packed.safetensors"
    rc, _, err = run(capsys, *prepack_argv(checkpoint, tmp_path)[:3], packed_file,
                     "--bits", "4", "--group-size", "64")
    assert rc == 0, err
    assert_refused(capsys, out_dir, prepack_argv(packed_file, out_dir),
                   ERR + r"\S+ is already a mixgemm packed file")


def _edit_packed_metadata(path, edit):
    save(path, {"w": prepack(quantize(torch.randn(32, 128), 4, 64))})
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    edit(meta)
    safetensors.torch.save_file(tensors, str(path), metadata=meta)


def test_layout_from_the_future(capsys, tmp_path, out_dir, pin_case):
    def edit(meta):
        spec = json.loads(meta["mixgemm:w"])
        spec["layout_version"] = str(LAYOUT_VERSION + 1)
        meta["mixgemm:w"] = json.dumps(spec)
    path = tmp_path / "future.safetensors"
    _edit_packed_metadata(path, edit)
    assert_refused(capsys, out_dir, prepack_argv(path, out_dir),
                   ERR + r"\S+: packed weight 'w' uses layout version \d+, from the future: .*upgrade mixgemm",
                   pin=pin_case, group="Files", case="a packed weight of a future layout version",
                   call="mixgemm prepack future.safetensors -o OUT --bits 4 --group-size 64")


def test_format_version_from_the_future(capsys, tmp_path, out_dir, pin_case):
    from mixgemm.weights.io import FORMAT_VERSION

    path = tmp_path / "future.safetensors"
    _edit_packed_metadata(path, lambda m: m.update({"mixgemm:format_version": str(FORMAT_VERSION + 1)}))
    assert_refused(capsys, out_dir, prepack_argv(path, out_dir),
                   ERR + rf"\S+ uses mixgemm file format version {FORMAT_VERSION + 1}, from the future: "
                   r"this mixgemm reads version \d+; .*upgrade mixgemm",
                   pin=pin_case, group="Files", case="a file from a future format version",
                   call="mixgemm prepack future.safetensors -o OUT --bits 4 --group-size 64")


def test_non_finite_weight(capsys, tmp_path, out_dir, pin_case):
    tensors = make_tensors()
    tensors[PACKED[1]][3, 5] = float("nan")
    src = write_checkpoint(tmp_path / "nan.safetensors", tensors)
    line = assert_refused(capsys, out_dir, prepack_argv(src, out_dir),
                          ERR + r"cannot quantize model\.layers\.0\.mlp\.down_proj\.weight: w contains "
                          r"non-finite values \(NaN or inf\), e\.g\. w\[3, 5\] = nan",
                          pin=pin_case, group="Values", case="NaN in a weight (command line)",
                          call="mixgemm prepack IN -o OUT --bits 4 --group-size 64")
    assert "skip it with --exclude" in line


def test_bad_regex(capsys, checkpoint, out_dir):
    assert_refused(capsys, out_dir, prepack_argv(checkpoint, out_dir, "--exclude", "(["),
                   ERR + r"argument --exclude: bad regular expression '\(\['", rc_expected=2)


def test_output_is_input(capsys, checkpoint, out_dir, pin_case):
    before = checkpoint.read_bytes()
    for force in ([], ["--force"]):
        argv = ["prepack", checkpoint, "-o", checkpoint, "--bits", "4", "--group-size", "64", *force]
        line = assert_refused(capsys, out_dir, argv, ERR + r"the output \S+ is the input file; write to another file$")
        assert checkpoint.read_bytes() == before
    pin_case("Output path", "equal to the input path (with or without --force)",
             "mixgemm prepack IN -o IN --bits 4 --group-size 64", "exit 1", line, "none (input unchanged)")


def test_output_directory_missing(capsys, checkpoint, tmp_path, out_dir, pin_case):
    argv = ["prepack", checkpoint, "-o", tmp_path / "no" / "o.safetensors", "--bits", "4", "--group-size", "64"]
    assert_refused(capsys, out_dir, argv, ERR + r"cannot write \S+: directory \S+/no does not exist$",
                   pin=pin_case, group="Output path", case="in a missing directory",
                   call="mixgemm prepack IN -o missing/OUT --bits 4 --group-size 64")
    assert not (tmp_path / "no").exists()


def test_existing_output_needs_force(capsys, checkpoint, out_dir, pin_case):
    """An existing output is refused and kept; with --force it is replaced atomically."""
    out = out_dir / "out.safetensors"
    out.write_bytes(b"precious")
    rc, _, err = run(capsys, *prepack_argv(checkpoint, out_dir))
    assert rc == 1 and err.splitlines() == [f"mixgemm prepack: error: {out} exists; pass --force to replace it"]
    assert out.read_bytes() == b"precious" and os.listdir(out_dir) == ["out.safetensors"]
    pin_case("Output path", "an existing file, without --force", "mixgemm prepack IN -o EXISTING --bits 4 --group-size 64",
             "exit 1", err.splitlines()[0], "none (the file is kept)")
    rc, stdout, err = run(capsys, *prepack_argv(checkpoint, out_dir, "--force"))
    assert rc == 0, err
    assert os.listdir(out_dir) == ["out.safetensors"]      # replaced, no temporary left
    assert isinstance(load(out)[PACKED[0]], PackedWeight)
    pin_case("Output path", "an existing file, with --force", "mixgemm prepack IN -o EXISTING --bits 4 --group-size 64 --force",
             "exit 0", stdout.splitlines()[0], "none (replaced atomically)")


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
    python_dir = str(Path(__file__).resolve().parents[2] / "python")
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


def _fake_hopper(monkeypatch, cached, build_fails=None):
    """The demo's GPU branch on the CPU: a 'GPU' that is the CPU, mixgemm.gemm stood in for by
    the unfused reference, and a kernel build that takes a moment (or fails)."""
    import mixgemm
    from mixgemm.jit import build
    from mixgemm.cli import demo
    from mixgemm.weights.quantize import dequantize_reference

    calls = {"gemm": [], "build": []}

    def fake_gemm(x, packed):
        calls["gemm"].append((tuple(x.shape), packed.n, packed.k))
        return x @ dequantize_reference(packed).t()

    def fake_is_cached(spec):
        if build_fails:
            raise build.BuildError(build_fails)
        return cached

    def fake_build(spec, **kw):
        import time
        time.sleep(0.3)
        calls["build"].append(spec.name)

    monkeypatch.setattr(demo, "find_gpu", lambda: (torch.device("cpu"), "Fake H100 (CPU)"))
    monkeypatch.setattr(mixgemm, "gemm", fake_gemm)
    monkeypatch.setattr(build, "is_cached", fake_is_cached)
    monkeypatch.setattr(build, "build", fake_build)
    return calls


DEMO_GEMM_KERNEL = "mixgemm_gemm_bf16_u4_t128x64x64_coop_streamk_biasact_s0"


def test_demo_on_a_gpu_says_it_is_compiling(capsys, monkeypatch):
    """First run on a GPU: a line says which kernel is compiled and why it takes a while, and
    a progress line (elapsed seconds) runs on stderr until the build ends; then the GEMM."""
    calls = _fake_hopper(monkeypatch, cached=False)
    rc, out, err = run(capsys, "demo")
    assert rc == 0, err
    assert calls["build"] == [DEMO_GEMM_KERNEL] and calls["gemm"] == [((64, 4096), 4096, 4096)]
    assert (f"first use of kernel {DEMO_GEMM_KERNEL} on this machine: compiling it with nvcc "
            f"(65-100 s for a GEMM kernel, once per machine; cached in ") in out
    assert "`mixgemm generate --build` compiles every kernel ahead of time" in out
    assert re.search(rf"^compiling {DEMO_GEMM_KERNEL} \.\.\.$", err, re.M), err   # not a terminal: start...
    assert re.search(rf"^compiling {DEMO_GEMM_KERNEL}: done in 0\.\d s$", err, re.M), err   # ...and end
    assert re.search(r"GEMM result \[64, 4096\] torch.bfloat16: .* relative = \d\.\d+e-0[3-9]", out)
    # the order: the compile announcement comes before the GEMM
    assert out.index("first use of kernel") < out.index("GEMM result")


def test_demo_on_a_gpu_with_the_kernel_cached(capsys, monkeypatch):
    calls = _fake_hopper(monkeypatch, cached=True)
    rc, out, err = run(capsys, "demo")
    assert rc == 0, err
    assert calls["build"] == [] and len(calls["gemm"]) == 1
    assert "compiling" not in out + err


def test_demo_on_a_gpu_without_nvcc(capsys, monkeypatch):
    calls = _fake_hopper(monkeypatch, cached=False, build_fails="nvcc not found: set CUDA_HOME, ...")
    rc, out, err = run(capsys, "demo")
    assert rc == 1 and calls["gemm"] == []
    assert err.splitlines() == [f"mixgemm demo: error: cannot build the GEMM kernel {DEMO_GEMM_KERNEL}: "
                                f"nvcc not found: set CUDA_HOME, ..."]
    assert "round trip: unpack(prepack(q)) == q exactly" in out


@pytest.mark.gpu
def test_demo_runs_the_gemm_on_hopper(capsys, monkeypatch, requires_gpu):
    """The demo's GPU branch, with mixgemm.gemm stood in for by the unfused reference (and
    no kernel build)."""
    import mixgemm
    from mixgemm.cli import demo
    from mixgemm.weights.quantize import dequantize_reference

    calls = []

    def fake_gemm(x, packed):
        calls.append((tuple(x.shape), x.device.type, packed.device.type))
        return x @ dequantize_reference(packed).t()

    monkeypatch.setattr(mixgemm, "gemm", fake_gemm, raising=False)
    monkeypatch.setattr(demo, "ensure_built", lambda spec, out=print, stream=None: False)
    rc, out, err = run(capsys, "demo")
    assert rc == 0, err
    assert calls == [((64, 4096), "cuda", "cuda")]
    assert "running the GEMM via mixgemm.gemm" in out
    assert re.search(r"GEMM result \[64, 4096\] torch.bfloat16: .* relative = \d\.\d+e-0[3-9]", out)


def test_generate_lists_the_grouped_moe_kernels(capsys):
    """`mixgemm generate --list` covers the grouped (MoE) decode kernels of catalog.grouped_specs()."""
    from mixgemm.jit import catalog

    rc, out, _ = run(capsys, "generate", "--list", "--kernels", "_gdecode_")
    assert rc == 0 and out.split() == [s.name for s in catalog.grouped_specs()] and len(out.split()) == 48
