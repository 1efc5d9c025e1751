"""mixgemm.save / mixgemm.load: round trips, atomic writes and every refused file."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import mixgemm
from mixgemm.weights.io import (FORMAT_VERSION, MixgemmFormatError, check_metadata, load, read_metadata,
                        save, stale_temporaries)
from mixgemm.weights.layout import prepack, unpack
from mixgemm.weights.quantize import quantize
from mixgemm.weights.types import LAYOUT_VERSION, PackedWeight


def packed_weight(bits=4, symmetric=False, group_size=64, dtype=torch.bfloat16, n=32, k=128, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return prepack(quantize(w, bits, group_size, symmetric=symmetric, dtype=dtype))


def assert_same_packed(a: PackedWeight, b: PackedWeight):
    assert isinstance(b, PackedWeight)
    assert a.metadata() == b.metadata()
    assert torch.equal(a.qdata, b.qdata)
    assert a.scales.dtype == b.scales.dtype and torch.equal(a.scales, b.scales)
    assert (a.zeros is None) == (b.zeros is None)
    if a.zeros is not None:
        assert torch.equal(a.zeros, b.zeros)


def raw_file(path):
    """(tensors, metadata) of a safetensors file, read without mixgemm."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def write_raw(path, tensors, metadata):
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


@pytest.fixture
def saved(tmp_path):
    """A file with plain tensors and three packed weights; returns (path, objects, metadata)."""
    objects = {
        "embed": torch.randn(8, 4),
        "norm": torch.randn(4, dtype=torch.bfloat16),
        "ids": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "layers.0.q.weight": packed_weight(4, False, 64),
        "layers.0.k.weight": packed_weight(2, True, 32, torch.float16, seed=1),
        "layers.0.v.weight": packed_weight(8, False, 128, n=16, seed=2),  # per-channel (K=128)
    }
    meta = {"source": "unit test", "note": "ünïcode ok"}
    path = tmp_path / "model.safetensors"
    save(path, objects, meta)
    return path, objects, meta


def test_round_trip(saved):
    path, objects, meta = saved
    loaded = load(path)
    assert set(loaded) == set(objects)
    for name, obj in objects.items():
        if isinstance(obj, PackedWeight):
            assert_same_packed(obj, loaded[name])
            assert loaded[name].device.type == "cpu"
        else:
            assert loaded[name].dtype == obj.dtype and torch.equal(loaded[name], obj)
    header = read_metadata(path)
    # no zero_offsets: the oldest format version, readable by every mixgemm
    assert header["mixgemm:format_version"] == "1" and FORMAT_VERSION == 3
    for key, value in meta.items():
        assert header[key] == value
    # the packed weights really are stored as companion tensors with JSON metadata
    tensors, _ = raw_file(path)
    assert {"layers.0.q.weight.qdata", "layers.0.q.weight.scales", "layers.0.q.weight.zeros",
            "layers.0.k.weight.qdata", "layers.0.k.weight.scales"} <= set(tensors)
    assert "layers.0.k.weight.zeros" not in tensors
    assert json.loads(header["mixgemm:layers.0.q.weight"]) == objects["layers.0.q.weight"].metadata()


def test_package_exports_save_and_load(tmp_path):
    packed = packed_weight()
    mixgemm.save(tmp_path / "a.safetensors", {"w": packed})
    assert_same_packed(packed, mixgemm.load(str(tmp_path / "a.safetensors"))["w"])
    assert torch.equal(unpack(mixgemm.load(tmp_path / "a.safetensors")["w"]).qweight,
                       unpack(packed).qweight)


def test_views_and_shared_storage(tmp_path):
    base = torch.arange(64, dtype=torch.float32).view(8, 8)
    objects = {"t": base.t(), "row": base[2], "alias": base}  # non-contiguous + shared memory
    save(tmp_path / "v.safetensors", objects)
    loaded = load(tmp_path / "v.safetensors")
    for name, value in objects.items():
        assert torch.equal(loaded[name], value)


def test_file_mode_follows_umask(tmp_path):
    save(tmp_path / "m.safetensors", {"x": torch.zeros(2)})
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(tmp_path / "m.safetensors").st_mode & 0o777 == 0o666 & ~umask


def fail_midway(tensors, filename, metadata=None):
    with open(filename, "wb") as fh:
        fh.write(b"partial data")
    raise OSError(28, "No space left on device")


def test_atomic_write_leaves_no_file_on_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors.torch, "save_file", fail_midway)
    with pytest.raises(OSError, match="No space"):
        save(tmp_path / "new.safetensors", {"x": torch.zeros(3)})
    assert os.listdir(tmp_path) == []  # no target, no temporary


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    save(path, {"x": torch.ones(3)})
    before = path.read_bytes()
    monkeypatch.setattr(safetensors.torch, "save_file", fail_midway)
    with pytest.raises(OSError):
        save(path, {"x": torch.zeros(3)})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_save_rejects_bad_input_and_writes_nothing(tmp_path):
    path = tmp_path / "x.safetensors"
    packed = packed_weight()
    with pytest.raises(TypeError, match="dict"):
        save(path, [torch.zeros(1)])
    with pytest.raises(TypeError, match="PackedWeight"):
        save(path, {"x": [1, 2, 3]})
    with pytest.raises(TypeError, match="non-empty str"):
        save(path, {"": torch.zeros(1)})
    with pytest.raises(ValueError, match="clashes"):
        save(path, {"w": packed, "w.scales": torch.zeros(1)})
    with pytest.raises(ValueError, match="reserved"):
        save(path, {"x": torch.zeros(1)}, {"mixgemm:format_version": "7"})
    with pytest.raises(TypeError, match="str to str"):
        save(path, {"x": torch.zeros(1)}, {"bits": 4})
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save(tmp_path / "no" / "dir.safetensors", {"x": torch.zeros(1)})


def test_plain_safetensors_files_load(tmp_path):
    write_raw(tmp_path / "plain.safetensors", {"a": torch.ones(2, 2)}, {"format": "pt"})
    loaded = load(tmp_path / "plain.safetensors")
    assert list(loaded) == ["a"] and torch.equal(loaded["a"], torch.ones(2, 2))
    assert check_metadata(read_metadata(tmp_path / "plain.safetensors")) == {}


# ---------------------------------------------------------------------------- bad files


def test_missing_file(tmp_path):
    with pytest.raises(MixgemmFormatError, match="no such file"):
        load(tmp_path / "absent.safetensors")
    with pytest.raises(MixgemmFormatError, match="no such file"):
        read_metadata(tmp_path / "absent.safetensors")
    with pytest.raises(MixgemmFormatError, match="directory"):
        load(tmp_path)


def test_corrupt_file(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(os.urandom(1000))
    with pytest.raises(MixgemmFormatError, match="not a valid safetensors file"):
        load(path)
    path.write_bytes(b"")
    with pytest.raises(MixgemmFormatError, match="not a valid safetensors file"):
        load(path)
    assert issubclass(MixgemmFormatError, ValueError)


@pytest.mark.parametrize("cut", [1, 100, 4000])
def test_truncated_file(saved, cut):
    path = saved[0]
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with pytest.raises(MixgemmFormatError, match="not a valid safetensors file"):
        load(path)


def rewrite(path, edit_tensors=None, edit_metadata=None):
    tensors, metadata = raw_file(path)
    if edit_tensors:
        edit_tensors(tensors)
    if edit_metadata:
        edit_metadata(metadata)
    write_raw(path, tensors, metadata)


def edit_spec(name, **changes):
    def edit(metadata):
        spec = json.loads(metadata["mixgemm:" + name])
        spec.update(changes)
        metadata["mixgemm:" + name] = json.dumps(spec)
    return edit


def test_layout_version_from_the_future(saved):
    path = saved[0]
    rewrite(path, edit_metadata=edit_spec("layers.0.q.weight", layout_version=str(LAYOUT_VERSION + 1)))
    with pytest.raises(MixgemmFormatError, match=r"from the future.*upgrade mixgemm"):
        load(path)


def test_format_version_from_the_future(saved):
    path = saved[0]
    rewrite(path, edit_metadata=lambda m: m.update({"mixgemm:format_version": str(FORMAT_VERSION + 1)}))
    with pytest.raises(MixgemmFormatError, match=r"from the future.*upgrade mixgemm"):
        load(path)


def test_old_layout_version(saved):
    path = saved[0]
    rewrite(path, edit_metadata=edit_spec("layers.0.q.weight", layout_version="0"))
    with pytest.raises(MixgemmFormatError, match="prepack the weight again"):
        load(path)


def test_unknown_arch(saved):
    path = saved[0]
    rewrite(path, edit_metadata=edit_spec("layers.0.k.weight", arch="sm100a"))
    with pytest.raises(MixgemmFormatError, match="unknown arch 'sm100a'"):
        load(path)


@pytest.mark.parametrize("part", ["qdata", "scales", "zeros"])
def test_missing_companion(saved, part):
    path = saved[0]
    rewrite(path, edit_tensors=lambda t: t.pop(f"layers.0.q.weight.{part}"))
    with pytest.raises(MixgemmFormatError, match=f"'layers.0.q.weight.{part}' is missing"):
        load(path)


def test_unexpected_zeros_for_symmetric(saved):
    path = saved[0]
    rewrite(path, edit_tensors=lambda t: t.update(
        {"layers.0.k.weight.zeros": t["layers.0.k.weight.scales"].clone()}))
    with pytest.raises(MixgemmFormatError, match="unexpected tensor"):
        load(path)


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update({"mixgemm:layers.0.q.weight": "{not json"}), "not valid JSON"),
    (lambda m: m.update({"mixgemm:layers.0.q.weight": "[1, 2]"}), "JSON object"),
    (edit_spec("layers.0.q.weight", weight_type="u3"), "unknown weight_type"),
    (edit_spec("layers.0.q.weight", bits="8"), "contradicts"),
    (edit_spec("layers.0.q.weight", symmetric="true"), "contradicts"),
    (edit_spec("layers.0.q.weight", n="48"), "inconsistent"),
    (edit_spec("layers.0.q.weight", group_size="many"), "integer"),
    (edit_spec("layers.0.q.weight", dtype="fp16"), "metadata says"),
    (edit_spec("layers.0.q.weight", dtype="fp8"), "unknown dtype"),
    (edit_spec("layers.0.q.weight", format="other"), "'format'"),
    (lambda m: m.update({"mixgemm:format_version": "one"}), "bad mixgemm:format_version"),
    (lambda m: m.pop("mixgemm:format_version"), "no 'mixgemm:format_version'"),
])
def test_bad_metadata(saved, edit, message):
    path = saved[0]
    rewrite(path, edit_metadata=edit)
    with pytest.raises(MixgemmFormatError, match=message):
        load(path)


def test_name_clash_between_packed_and_plain(saved):
    path = saved[0]
    rewrite(path, edit_tensors=lambda t: t.update({"layers.0.q.weight": torch.zeros(1)}))
    with pytest.raises(MixgemmFormatError, match="same name"):
        load(path)


@pytest.mark.gpu
def test_load_to_cuda(saved, requires_gpu):
    path, objects, _ = saved
    loaded = load(path, device="cuda")
    assert loaded["layers.0.q.weight"].device.type == "cuda"
    assert loaded["embed"].device.type == "cuda"
    assert_same_packed(objects["layers.0.q.weight"], loaded["layers.0.q.weight"].to("cpu"))


def test_zero_offsets_round_trip_and_version(tmp_path):
    """A weight with fractional zero points (zero_offsets) is saved as a companion tensor and
    marks the file format version 2; it loads back exactly."""
    from mixgemm.weights.types import PackedWeight

    qw = quantize(torch.randn(32, 128), 4, 64, symmetric=False, dtype=torch.bfloat16)
    offsets = torch.randn(32, 2) * 1e-3
    packed = prepack(dataclasses.replace(qw, zero_offsets=offsets))
    assert isinstance(packed, PackedWeight) and packed.zero_offsets.shape == (2, 32)
    path = tmp_path / "o.safetensors"
    save(path, {"w": packed})
    assert read_metadata(path)["mixgemm:format_version"] == "2"
    back = load(path)["w"]
    assert torch.equal(back.zero_offsets, packed.zero_offsets)
    assert torch.equal(unpack(back).zero_offsets, offsets)
    with pytest.raises(ValueError, match="zero_offsets must be float32"):
        dataclasses.replace(packed, zero_offsets=packed.zero_offsets.double())


# ------------------------------------------------------------------ pinned cases (issue #15)

def first_line(excinfo) -> str:
    return str(excinfo.value).splitlines()[0]


def test_pinned_bad_files(tmp_path, pin_case):
    """mixgemm.load of each bad file: the exception, the first line of its message, and no file
    created next to it."""
    good = tmp_path / "good.safetensors"
    save(good, {"w": packed_weight()})
    data = good.read_bytes()
    header = b"{garbage, not json}"
    cases = {
        "missing input": (tmp_path / "absent.safetensors", None, r"\S+absent\.safetensors: no such file$"),
        "not a safetensors file (random bytes)": (tmp_path / "random.safetensors", os.urandom(1000),
                                                  r"\S+: not a valid safetensors file \(corrupt or truncated\?\)"),
        "truncated safetensors file": (tmp_path / "cut.safetensors", data[:-100],
                                       r"\S+: not a valid safetensors file \(corrupt or truncated\?\)"),
        "garbage in the header JSON": (tmp_path / "garbage.safetensors",
                                       len(header).to_bytes(8, "little") + header + bytes(64),
                                       r"\S+: not a valid safetensors file \(corrupt or truncated\?\)"),
    }
    for case, (path, content, pattern) in cases.items():
        if content is not None:
            path.write_bytes(content)
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(MixgemmFormatError) as excinfo:
            load(path)
        assert re.match(pattern, first_line(excinfo)), first_line(excinfo)
        assert sorted(os.listdir(tmp_path)) == before
        pin_case("Files", case, f"mixgemm.load({path.name!r})", "MixgemmFormatError", first_line(excinfo))


def test_pinned_future_format(saved, pin_case):
    path = saved[0]
    rewrite(path, edit_metadata=lambda m: m.update({"mixgemm:format_version": str(FORMAT_VERSION + 1)}))
    with pytest.raises(MixgemmFormatError) as excinfo:
        load(path)
    assert re.fullmatch(rf"\S+ uses mixgemm file format version {FORMAT_VERSION + 1}, from the future: this "
                        rf"mixgemm reads version {FORMAT_VERSION}; this is mixgemm \S+; upgrade mixgemm "
                        r"\(pip install -U mixgemm\) to read it", first_line(excinfo))
    pin_case("Files", "a file from a future format version", "mixgemm.load(path)",
             "MixgemmFormatError", first_line(excinfo))


@pytest.mark.parametrize("what,edit,message", [
    ("the wrong shape", lambda t: t[:, :1].contiguous(), r"qdata must be uint8 of shape \[2, 2, 512\], got torch\.uint8 \[2, 1, 512\]"),
    ("the wrong dtype", lambda t: t.to(torch.int8), r"qdata must be uint8 of shape \[2, 2, 512\], got torch\.int8 \[2, 2, 512\]"),
])
def test_packed_qdata_of_the_wrong_shape_or_dtype(saved, what, edit, message, pin_case):
    """A packed tensor whose qdata does not match its metadata is refused when loading."""
    path = saved[0]
    rewrite(path, edit_tensors=lambda t: t.update({"layers.0.q.weight.qdata": edit(t["layers.0.q.weight.qdata"])}))
    with pytest.raises(MixgemmFormatError) as excinfo:
        load(path)
    assert re.fullmatch(r"\S+: packed weight 'layers\.0\.q\.weight': inconsistent with its metadata: " + message,
                        first_line(excinfo)), first_line(excinfo)
    pin_case("Tensors", f"packed qdata of {what}", "mixgemm.load(path)", "MixgemmFormatError", first_line(excinfo))
    # and the constructor itself, for a weight built in memory
    good = packed_weight()
    with pytest.raises(ValueError, match=message):
        PackedWeight(edit(good.qdata), good.scales, good.zeros, good.weight_type, good.group_size, good.n, good.k)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_save_leaves_a_named_temporary_that_the_next_save_removes(tmp_path):
    path = tmp_path / "model.safetensors"
    dead, alive = _dead_pid(), os.getppid()
    stale_dir = tmp_path / f".model.safetensors.{dead}.abc123.tmp"    # what save leaves when killed
    stale_file = tmp_path / f".model.safetensors.{dead}.abc124.tmp"   # (and a plain file of that name)
    live = tmp_path / f".model.safetensors.{alive}.def456.tmp"        # a save in progress elsewhere
    other = tmp_path / f".other.safetensors.{dead}.xyz.tmp"           # another file's: not ours
    stale_dir.mkdir()
    (stale_dir / "model.safetensors").write_bytes(b"partial")
    (stale_dir / ".tmpAbC123").write_bytes(b"safetensors' own")
    for p in (stale_file, live, other):
        p.write_bytes(b"partial")
    assert stale_temporaries(path) == sorted([str(stale_dir), str(stale_file)])
    save(path, {"x": torch.zeros(2)})
    assert sorted(os.listdir(tmp_path)) == sorted(["model.safetensors", live.name, other.name])


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    """KeyboardInterrupt while the file is being written: no target, no temporary."""
    def interrupted(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"partial data")
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path / "new.safetensors", {"x": torch.zeros(3)})
    assert os.listdir(tmp_path) == []


def _all_tensors(loaded: dict) -> dict:
    out = {}
    for name, value in loaded.items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        else:
            for part in ("qdata", "scales", "zeros", "zero_offsets"):
                t = getattr(value, part, None)
                if t is not None:
                    out[f"{name}.{part}"] = t
    return out


def test_load_returns_16_byte_aligned_tensors(saved, tmp_path):
    """safetensors hands out tensors at their offset in the file (8-byte aligned at best); load
    returns each one contiguous and 16-byte aligned, whole or sharded, so that ``.to("cuda")`` of
    a CPU-loaded weight is one the kernels take."""
    path, objects, _ = saved
    odd = {"a": torch.ones(3, dtype=torch.uint8), "b": torch.ones(5, dtype=torch.bfloat16),
           "w": packed_weight(4, False, 64), "c": torch.ones(7, dtype=torch.uint8), "v": packed_weight(2, True, 32, seed=3)}
    odd_path = tmp_path / "odd.safetensors"
    save(odd_path, odd)
    for p, kwargs in ((path, {}), (odd_path, {}), (odd_path, {"tp_rank": 1, "tp_size": 2, "tp_dims": {"w": 0, "v": 1}})):
        tensors = _all_tensors(load(p, **kwargs))
        bad = {name: t.data_ptr() % 16 for name, t in tensors.items() if t.numel() and t.data_ptr() % 16}
        assert not bad, bad
        assert all(t.is_contiguous() for t in tensors.values())
    loaded = load(odd_path)
    assert torch.equal(loaded["b"], odd["b"]) and torch.equal(loaded["c"], odd["c"])
    assert_same_packed(odd["w"], loaded["w"])


@pytest.mark.gpu
@pytest.mark.parametrize("path_kind", ["load(device='cuda')", "load().to('cuda')"])
def test_readme_save_load_gemm(tmp_path, requires_gpu, path_kind):
    """The README's example, both ways of getting the weight onto the GPU."""
    import mixgemm
    w = torch.randn(256, 512, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    written = mixgemm.prepack(mixgemm.quantize(w, bits=4, group_size=128))
    mixgemm.save(tmp_path / "layer.safetensors", {"proj.weight": written})
    if path_kind == "load(device='cuda')":
        packed = mixgemm.load(tmp_path / "layer.safetensors", device="cuda")["proj.weight"]
    else:
        packed = mixgemm.load(tmp_path / "layer.safetensors")["proj.weight"].to("cuda")
    x = torch.randn(16, 512, dtype=torch.bfloat16, device="cuda")
    assert mixgemm.supports(tuple(x.shape), packed, x.dtype) == (True, "")
    y = mixgemm.gemm(x, packed)
    assert torch.equal(y, mixgemm.gemm(x, written.to("cuda")))       # the loaded weight is the written one
    # float64 on the same dequantized weights; the bound of the GPU GEMM tests (it scales with K)
    ref = x.double() @ mixgemm.dequantize_reference(packed).double().T
    k = x.shape[-1]
    bound = min(1e-2, 4 * 2.0 ** -9 + 64 * math.sqrt(k) * 2.0 ** -24)
    assert float((y.double() - ref).norm() / ref.norm()) <= bound
