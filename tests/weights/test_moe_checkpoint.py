"""Per-expert tensors stacked by `mixgemm prepack` (plain and --from): Qwen/DeepSeek and Mixtral
names, gate/up interleaved into w13 exactly, the stacked file format, and every refused expert set
(different shapes or types, a missing expert, ids that skip a number, partly packed) with no
output file."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import mixgemm
from mixgemm import formats
from mixgemm.cli.main import main
from mixgemm.weights.experts import PackedExperts
from mixgemm.weights.io import read_metadata
from mixgemm.weights.stacking import stack_experts
from mixgemm.weights.quantize import interleave_rows

import reference_packers as rp   # the formats' independent reference packers

I, H = 64, 128


def _w(gen, n, k):
    return (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)


def expert_tensors(experts=3, names=("gate_proj", "up_proj", "down_proj"), prefix="model.layers.0.mlp", seed=0,
                   skip=(), shapes=None):
    """A tiny MoE layer's tensors: router, per-expert projections, a shared expert and a norm."""
    gen = torch.Generator().manual_seed(seed)
    t = {f"{prefix}.gate.weight": _w(gen, 16, H)}                         # the router (E rows, not an expert)
    for e in range(experts):
        for name in names:
            if (e, name) in skip:
                continue
            down = name in ("down_proj", "w2")
            n, k = (shapes or {}).get((e, name), (H, I) if down else (I, H))
            t[f"{prefix}.experts.{e}.{name}.weight"] = _w(gen, n, k)
    t[f"{prefix}.shared_experts.gate_proj.weight"] = _w(gen, I, H)
    t["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    return t


def packed(tensors, bits=4, group=32, symmetric=False):
    return {k: mixgemm.prepack(mixgemm.quantize(v, bits, group, symmetric)) if k.endswith("proj.weight")
            or k.split(".")[-2] in ("w1", "w2", "w3") else v for k, v in tensors.items()}


def deq(w):
    return mixgemm.dequantize_reference(w)


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_stack_experts(names):
    src = packed(expert_tensors(names=names))
    out = stack_experts(src)
    p = "model.layers.0.mlp"
    assert list(out) == [f"{p}.gate.weight", f"{p}.experts.w13.weight", f"{p}.experts.w2.weight",
                         f"{p}.shared_experts.gate_proj.weight", "model.norm.weight"]
    w13, w2 = out[f"{p}.experts.w13.weight"], out[f"{p}.experts.w2.weight"]
    assert isinstance(w13, PackedExperts) and (w13.num_experts, w13.n, w13.k) == (3, 2 * I, H)
    assert isinstance(w2, PackedExperts) and (w2.num_experts, w2.n, w2.k) == (3, H, I)
    gate, up, down = names
    for e in range(3):
        want = interleave_rows(deq(src[f"{p}.experts.{e}.{gate}.weight"]), deq(src[f"{p}.experts.{e}.{up}.weight"]))
        assert torch.equal(deq(w13.expert(e)), want)                       # exact: codes and scales moved
        assert torch.equal(deq(w2.expert(e)), deq(src[f"{p}.experts.{e}.{down}.weight"]))
    assert out[f"{p}.shared_experts.gate_proj.weight"] is src[f"{p}.shared_experts.gate_proj.weight"]


def test_stack_without_up_keeps_gate_alone_and_unpacked_experts_are_left():
    src = packed(expert_tensors(names=("gate_proj", "down_proj")))
    out = stack_experts(src)
    assert {"model.layers.0.mlp.experts.gate_proj.weight", "model.layers.0.mlp.experts.w2.weight"} <= set(out)
    plain = expert_tensors()
    assert stack_experts(plain) == plain                                    # nothing packed: unchanged


@pytest.mark.parametrize("kw,message", [
    (dict(shapes={(1, "down_proj"): (H, 2 * I)}), "expert 1 has shape K 128, expert 0 has 64"),
    (dict(skip={(1, "down_proj")}), "expert 1 has no down projection"),
    (dict(skip={(2, "gate_proj"), (2, "up_proj"), (2, "down_proj")}, experts=4), "not contiguous from 0"),
])
def test_bad_expert_sets(kw, message):
    with pytest.raises(ValueError, match=message):
        stack_experts(packed(expert_tensors(**kw)))


def test_experts_of_different_types_and_partly_packed():
    src = packed(expert_tensors())
    src["model.layers.0.mlp.experts.2.down_proj.weight"] = mixgemm.prepack(mixgemm.quantize(
        torch.randn(H, I).to(torch.bfloat16), 8, 32, True))
    with pytest.raises(ValueError, match="expert 2 has weight type s8, expert 0 has u4"):
        stack_experts(src)
    src["model.layers.0.mlp.experts.2.down_proj.weight"] = torch.randn(H, I).to(torch.bfloat16)
    with pytest.raises(ValueError, match="packed and others not"):
        stack_experts(src)


# ---------------------------------------------------------------------------------- the CLI
def test_prepack_writes_stacked_experts(tmp_path, capsys):
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    tensors = expert_tensors(names=("w1", "w3", "w2"), prefix="model.layers.0.block_sparse_moe")
    save_file(tensors, str(src))
    assert main(["prepack", str(src), "-o", str(dst), "--bits", "4", "--group-size", "32"]) == 0
    assert "stacked expert tensors" in capsys.readouterr().out
    got = mixgemm.load(str(dst))
    p = "model.layers.0.block_sparse_moe"
    w13 = got[f"{p}.experts.w13.weight"]
    assert isinstance(w13, PackedExperts) and w13.num_experts == 3 and w13.n == 2 * I
    assert isinstance(got[f"{p}.experts.w2.weight"], PackedExperts)
    assert not any(".experts.0." in k for k in got)
    # the router is [16, 128]: a plain linear, packed as such; the shared expert too
    assert isinstance(got[f"{p}.gate.weight"], mixgemm.PackedWeight)
    meta = read_metadata(str(dst))
    assert "w13" in meta["prepack.experts"] and meta["mixgemm:format_version"] == "3"
    spec = json.loads(meta[f"mixgemm:{p}.experts.w13.weight"])
    assert spec["format"] == "mixgemm.packed_experts" and spec["experts"] == "3"
    want = interleave_rows(*(deq(mixgemm.prepack(mixgemm.quantize(tensors[f"{p}.experts.1.{n}.weight"], 4, 32)))
                             for n in ("w1", "w3")))
    assert torch.equal(deq(w13.expert(1)), want)


@pytest.mark.parametrize("kw,message", [
    (dict(shapes={(0, "up_proj"): (2 * I, H)}), "differ"),
    (dict(skip={(1, "down_proj")}), "expert 1 has no down projection"),
    (dict(skip={(0, "gate_proj"), (0, "up_proj"), (0, "down_proj")}), "not contiguous from 0"),
])
def test_prepack_refuses_bad_experts_with_no_output(tmp_path, capsys, kw, message):
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(expert_tensors(**kw), str(src))
    assert main(["prepack", str(src), "-o", str(dst), "--bits", "4", "--group-size", "32"]) == 1
    err = capsys.readouterr().err
    assert "cannot stack the experts" in err and message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == [src]                                  # no output, no temporary


def _awq_experts(path, experts=2, skip=()):
    k, gs = rp.shape_for(128)
    gen = rp.gen_for("cli-awq-experts")
    tensors, want = {}, {}
    for e in range(experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            if (e, name) in skip:
                continue
            qweight, qzeros, scales = rp.make_awq(k, gs, gen)
            p = f"model.layers.0.mlp.experts.{e}.{name}"
            tensors.update({f"{p}.qweight": qweight, f"{p}.qzeros": qzeros, f"{p}.scales": scales})
            want[(e, name)] = formats.from_awq(qweight, qzeros, scales)
    save_file(tensors, str(path))
    return want


def test_prepack_from_awq_stacks_experts(tmp_path):
    src, dst = tmp_path / "awq.safetensors", tmp_path / "out.safetensors"
    want = _awq_experts(src)
    assert main(["prepack", str(src), "-o", str(dst), "--from", "awq"]) == 0
    got = mixgemm.load(str(dst))
    w13, w2 = got["model.layers.0.mlp.experts.w13.weight"], got["model.layers.0.mlp.experts.w2.weight"]
    assert isinstance(w13, PackedExperts) and w13.num_experts == 2
    for e in range(2):
        gate, up = (deq(mixgemm.prepack(want[(e, n)].qweight)) for n in ("gate_proj", "up_proj"))
        assert torch.equal(deq(w13.expert(e)), interleave_rows(gate, up))
        assert torch.equal(deq(w2.expert(e)), deq(mixgemm.prepack(want[(e, "down_proj")].qweight)))
    assert "w13" in read_metadata(str(dst))["prepack.experts"]


def test_prepack_from_awq_refuses_a_missing_expert(tmp_path, capsys):
    src, dst = tmp_path / "awq.safetensors", tmp_path / "out.safetensors"
    _awq_experts(src, experts=3, skip={(2, "up_proj")})
    assert main(["prepack", str(src), "-o", str(dst), "--from", "awq"]) == 1
    assert "expert 2 has no up projection" in capsys.readouterr().err
    assert not dst.exists()


def test_quantize_and_prepack_point_stacked_weights_to_packed_experts():
    w = torch.randn(2, 16, 64)
    with pytest.raises(ValueError, match="PackedExperts.quantize"):
        mixgemm.quantize(w, 4, 32)
    qws = [mixgemm.quantize(w[e], 4, 32) for e in range(2)]
    with pytest.raises(TypeError, match="PackedExperts.from_quantized"):
        mixgemm.prepack(qws)
    stacked = PackedExperts.quantize(w, 4, 32)
    assert torch.equal(deq(stacked.expert(1)), deq(mixgemm.prepack(qws[1])))
