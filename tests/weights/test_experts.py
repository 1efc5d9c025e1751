"""mixgemm.moe.PackedExperts: stacking, the exact inverse, save / load, and the refused inputs."""
import json

import pytest
import torch
from safetensors import safe_open
import safetensors.torch

from mixgemm.weights.experts import PackedExperts
from mixgemm.weights.io import FORMAT_VERSION, MixgemmFormatError, load, read_metadata, save
from mixgemm.weights.layout import prepack
from mixgemm.weights.quantize import dequantize_reference, quantize
from mixgemm.weights.types import PackedWeight

TYPES = [(8, True), (8, False), (4, True), (4, False), (2, True), (2, False)]


def stacked_weight(e=3, n=32, k=128, seed=0):
    return torch.randn(e, n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits,symmetric", TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_stacked_is_per_expert_quantize_and_prepack(bits, symmetric, dtype):
    w = stacked_weight()
    ex = PackedExperts.quantize(w, bits, 32, symmetric=symmetric, dtype=dtype)
    assert (ex.num_experts, ex.n, ex.k, ex.group_size, ex.dtype) == (3, 32, 128, 32, dtype)
    assert ex.qdata.shape == (3, 2, 2, 128 * bits) and ex.scales.shape == (3, 4, 32)
    assert (ex.zeros is None) == symmetric
    unpacked = ex.unpack()
    deq = ex.dequantize_reference()
    assert deq.shape == (3, 32, 128) and deq.dtype == dtype
    for e in range(3):
        qw = quantize(w[e], bits, 32, symmetric=symmetric, dtype=dtype)
        # unpack is the exact inverse of the packing: the codes, scales and zeros come back
        assert torch.equal(unpacked[e].qweight, qw.qweight)
        assert torch.equal(unpacked[e].scales, qw.scales)
        assert (qw.zeros is None) or torch.equal(unpacked[e].zeros, qw.zeros)
        # and expert e is exactly the PackedWeight of that expert
        pw = prepack(qw)
        view = ex.expert(e)
        assert torch.equal(view.qdata, pw.qdata) and torch.equal(view.scales, pw.scales)
        assert torch.equal(deq[e], dequantize_reference(qw))


def test_stack_and_from_quantized_agree():
    w = stacked_weight(e=4)
    qws = [quantize(w[e], 4, 64) for e in range(4)]
    a = PackedExperts.from_quantized(qws)
    b = PackedExperts.stack([prepack(q) for q in qws])
    assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)
    assert len(a) == 4 and a.expert_nbytes * 4 == a.nbytes
    assert isinstance(a.expert(-1), PackedWeight) and torch.equal(a.expert(-1).qdata, a.qdata[3])


def test_stack_refuses_mixed_experts():
    a = prepack(quantize(torch.randn(32, 128), 4, 64))
    with pytest.raises(ValueError, match="at least one expert"):
        PackedExperts.stack([])
    with pytest.raises(TypeError, match="expert 1 must be a mixgemm.PackedWeight"):
        PackedExperts.stack([a, torch.zeros(3)])
    cases = [
        (prepack(quantize(torch.randn(48, 128), 4, 64)), "expert 1 has shape N 48, expert 0 has 32"),
        (prepack(quantize(torch.randn(32, 192), 4, 64)), "expert 1 has shape K 192, expert 0 has 128"),
        (prepack(quantize(torch.randn(32, 128), 8, 64)), "expert 1 has weight type u8, expert 0 has u4"),
        (prepack(quantize(torch.randn(32, 128), 4, 64, symmetric=True)), "weight type s4"),
        (prepack(quantize(torch.randn(32, 128), 4, 32)), "expert 1 has group size 32, expert 0 has 64"),
        (prepack(quantize(torch.randn(32, 128), 4, 64, dtype=torch.float16)), "expert 1 has dtype torch.float16"),
    ]
    for other, msg in cases:
        with pytest.raises(ValueError, match=msg):
            PackedExperts.stack([a, other])


def test_constructor_and_quantize_refuse_bad_tensors():
    ex = PackedExperts.quantize(stacked_weight(e=2), 4, 64)
    with pytest.raises(ValueError, match="qdata must be uint8 of shape"):
        PackedExperts(ex.qdata[:, :1], ex.scales, ex.zeros, ex.weight_type, 64, 32, 128)
    with pytest.raises(ValueError, match="scales must have shape"):
        PackedExperts(ex.qdata, ex.scales[:1], ex.zeros, ex.weight_type, 64, 32, 128)
    with pytest.raises(ValueError, match="need zeros"):
        PackedExperts(ex.qdata, ex.scales, None, ex.weight_type, 64, 32, 128)
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        PackedExperts.quantize(torch.randn(32, 128), 4, 64)
    with pytest.raises(IndexError, match="expert index"):
        ex.expert(2)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        PackedExperts.quantize(torch.randn(2, 24, 128), 4, 64)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (2, True)])
def test_save_load_round_trip(tmp_path, bits, symmetric):
    ex = PackedExperts.quantize(stacked_weight(e=5), bits, 32, symmetric=symmetric)
    single = prepack(quantize(torch.randn(16, 64), 8, 64))
    path = tmp_path / "moe.safetensors"
    save(path, {"layers.0.mlp.experts.w13": ex, "dense": single, "norm": torch.ones(4)})
    meta = read_metadata(path)
    assert meta["mixgemm:format_version"] == str(FORMAT_VERSION) == "3"
    spec = json.loads(meta["mixgemm:layers.0.mlp.experts.w13"])
    assert spec["format"] == "mixgemm.packed_experts" and spec["experts"] == "5"
    with safe_open(str(path), framework="pt") as f:   # one stacked tensor per part
        assert list(f.get_slice("layers.0.mlp.experts.w13.qdata").get_shape()) == list(ex.qdata.shape)
    got = load(path)
    back = got["layers.0.mlp.experts.w13"]
    assert isinstance(back, PackedExperts) and back.metadata() == ex.metadata()
    assert torch.equal(back.qdata, ex.qdata) and torch.equal(back.scales, ex.scales)
    assert (ex.zeros is None and back.zeros is None) or torch.equal(back.zeros, ex.zeros)
    assert isinstance(got["dense"], PackedWeight)


def _rewrite(path, edit_tensors=None, edit_metadata=None):
    with safe_open(str(path), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_metadata:
        edit_metadata(metadata)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def _spec_edit(**changes):
    def edit(m):
        spec = json.loads(m["mixgemm:w"])
        spec.update(changes)
        m["mixgemm:w"] = json.dumps(spec)
    return edit


@pytest.mark.parametrize("edit_tensors,edit_metadata,msg", [
    (None, _spec_edit(experts="4"), "the tensors hold 3 experts, the metadata says 4"),
    (None, _spec_edit(experts="0"), "'experts' must be >= 1"),
    (None, lambda m: m.update({"mixgemm:format_version": "2"}), "need mixgemm:format_version 3"),
    (lambda t: t.update({"w.qdata": t["w.qdata"][:2]}), None, "inconsistent with its metadata"),
    (lambda t: t.pop("w.zeros"), None, "companion tensor 'w.zeros' is missing"),
])
def test_load_refuses_bad_stacked_files(tmp_path, edit_tensors, edit_metadata, msg):
    path = tmp_path / "bad.safetensors"
    save(path, {"w": PackedExperts.quantize(stacked_weight(e=3), 4, 64)})
    _rewrite(path, edit_tensors, edit_metadata)
    with pytest.raises(MixgemmFormatError, match=msg):
        load(path)
