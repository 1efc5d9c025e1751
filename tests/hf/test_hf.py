"""mixgemm.hf.from_pretrained on the CPU: the loading path.

Tiny LLaMA checkpoints are written in each format (tests/hf_checkpoints.py) and loaded onto the
CPU. Every QuantLinear's dequantized weight must equal its format's own dequantization bit for
bit, and the loaded model, run in float32 with those weights (each QuantLinear swapped for an
nn.Linear by the test: the package has no CPU fallback), must give the logits of the reference
model built from the format's formula. Bad checkpoints must fail before the device step.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="mixgemm.hf needs transformers (pip install 'mixgemm[hf]')")

import hf_checkpoints as hc  # noqa: E402
import reference_packers as rp  # noqa: E402
from mixgemm import hf  # noqa: E402
from mixgemm.errors import CheckpointError, FormatError  # noqa: E402
from mixgemm.hf import materialize  # noqa: E402
from mixgemm.formats.config import LayerScheme, QuantMethod, parse_quantization_config  # noqa: E402
from mixgemm.hf.dequant import dequantize_layer  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402
from tiny_models import reference_forward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load(model_dir, **kw):
    kw.setdefault("attn_implementation", "eager")
    return hf.from_pretrained(model_dir, device="cpu", **kw)


def assert_bitwise(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
        f"{what}: {int((a.view(torch.int16) != b.view(torch.int16)).sum())} elements differ"


def assert_same_logits(model, ref, ids=None):
    ids = hc.input_ids() if ids is None else ids
    with torch.no_grad():
        got = hc.to_float32(model)(ids).logits
        want = hc.reference_model(ref)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", list(hc.WRITERS))
def test_every_format_loads_exactly(tmp_path, kind):
    ref = hc.WRITERS[kind](tmp_path / kind)
    model = load(tmp_path / kind)
    assert isinstance(model, transformers.LlamaForCausalLM) and not model.training
    summary = model.mixgemm_summary
    assert summary.method == ("mixgemm" if kind.startswith("mixgemm") else
                              {"awq": "awq", "gpt": "gptq", "ct-": "compressed-tensors"}[kind[:3]])
    # q/k/v and the gated MLPs are fused, every other quantized linear is a QuantLinear: four per layer
    assert summary.fused == [f"model.layers.{i}.mlp" for i in range(hc.LAYERS)]
    assert summary.fused_attentions == [f"model.layers.{i}.self_attn" for i in range(hc.LAYERS)]
    assert f"{hc.LAYERS} attentions with q/k/v fused, {hc.LAYERS} gated MLPs fused" in str(summary)
    assert len([m for m in model.modules() if isinstance(m, QuantLinear)]) == 4 * hc.LAYERS
    for i in range(hc.LAYERS):
        mlp, attn = model.model.layers[i].mlp, model.model.layers[i].self_attn
        assert isinstance(mlp, hf.GatedMLP) and mlp.gate_up.activation == "swiglu"
        assert mlp.gate_up.out_features == 512 and mlp.gate_up.weight_rows == 1024
        assert isinstance(attn, hf.FusedQKVAttention) and attn.original_class == "LlamaAttention"
        assert (attn.heads, attn.kv_heads, attn.head_dim) == (hc.HEADS, hc.KV_HEADS, hc.HEAD_DIM)
        assert isinstance(attn.qkv_proj, QuantLinear) and attn.qkv_proj.activation == "none"
        assert (attn.qkv_proj.out_features, attn.qkv_proj.in_features) == ((hc.HEADS + 2 * hc.KV_HEADS) * hc.HEAD_DIM,
                                                                            hc.HIDDEN)
        assert not hasattr(attn, "q_proj") and isinstance(attn.o_proj, QuantLinear)
        assert isinstance(mlp.down_proj, QuantLinear)
    assert "model.layers.0.self_attn.qkv_proj" in summary.quantized
    assert type(model.lm_head) is nn.Linear and not summary.full_precision
    # each layer's weight is its format's own dequantization, bit for bit
    got = hc.dequantized_linears(model)
    assert sorted(got) == sorted(ref.linears)
    for name, want in ref.linears.items():
        assert_bitwise(got[name][0], want, name)
    # the unquantized tensors are the checkpoint's, and nothing is left on the meta device
    for name, want in ref.plain.items():
        assert torch.equal(model.get_parameter(name), want), name
    assert all(not t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert_same_logits(model, ref)


def test_a_mixgemm_checkpoint_written_by_the_command_line(tmp_path, capsys):
    """The README's recipe: `mixgemm prepack DIR -o OUT/model.safetensors --from gptq`, and the
    source's config.json with the mixgemm quantization_config next to it."""
    from mixgemm.cli.main import main

    ref = hc.write_gptq(tmp_path / "src", act_order=True, fmt="gptq_v2")
    out = tmp_path / "out"
    out.mkdir()
    assert main(["prepack", str(tmp_path / "src"), "-o", str(out / "model.safetensors"), "--from", "gptq"]) == 0
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mixgemm", "format_version": 1}
    (out / "config.json").write_text(json.dumps(config))
    model = load(out)
    assert model.mixgemm_summary.method == "mixgemm" and len(model.mixgemm_summary.fused) == hc.LAYERS
    assert model.model.layers[0].self_attn.qkv_proj.perm is not None
    got = hc.dequantized_linears(model)
    for name, want in ref.linears.items():
        assert_bitwise(got[name][0], want, name)
    assert_same_logits(model, ref)


def test_tied_embeddings_share_one_tensor(tmp_path):
    ref = hc.write_awq(tmp_path / "m", tie=True, shards=1)
    assert "lm_head.weight" not in hc.checkpoint_keys(tmp_path / "m")
    model = load(tmp_path / "m")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"
    assert_same_logits(model, ref)


def test_memory_is_the_quantized_size_and_a_log_line_says_so(tmp_path, caplog):
    hc.write_gptq(tmp_path / "m", bits=4, group_size=64)
    with caplog.at_level(logging.INFO, logger="mixgemm.hf"):
        model = load(tmp_path / "m")
    lines = [r.getMessage() for r in caplog.records if r.name == "mixgemm.hf" and "resident" in r.getMessage()]
    assert len(lines) == 1
    s = model.mixgemm_summary
    assert str(s) == lines[0] and "quantized" in lines[0] and "in bf16" in lines[0]
    # the summary counts what the model holds
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in list(model.parameters()) + list(model.buffers())}
    assert s.resident_bytes == sum(tensors.values())
    qlayers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert s.quantized_bytes == sum(q.packed.nbytes for q in qlayers)   # no biases or perms here
    # every quantized weight is held at 4 bits (+ fp16 scales and zeros per 64): no full-precision copy
    weights = sum(q.weight_rows * q.in_features for q in qlayers)
    assert s.quantized_bytes == weights // 2 + 2 * 2 * weights // 64
    assert s.bf16_bytes == 2 * weights + s.other_bytes      # the rest is fp16 already
    no_linear = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    assert no_linear == []


def test_unsupported_layers_stay_in_full_precision_with_a_warning(tmp_path):
    # GPTQ: intermediate size 672 = 10.5 * 64: down_proj's K is not a multiple of 64
    ref = hc.write_gptq(tmp_path / "gptq", group_size=32, intermediate=672)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load(tmp_path / "gptq")
    messages = [str(w.message) for w in caught if "mixgemm.hf" in str(w.message)]
    assert len(messages) == 2 and len(ref.full_precision) == 2
    for i, msg in enumerate(messages):
        assert f"keeping model.layers.{i}.mlp.down_proj in full precision" in msg and "K=672" in msg
    for name in ref.full_precision:
        lin = model.get_submodule(name)
        assert type(lin) is nn.Linear and lin.weight.dtype == torch.float16
        assert_bitwise(lin.weight.detach(), ref.linears[name], name)   # GPTQ's formula, in its fp16
    assert sorted(model.mixgemm_summary.full_precision) == sorted(ref.full_precision)
    assert model.mixgemm_summary.fused == ["model.layers.0.mlp", "model.layers.1.mlp"]  # gate/up are fine
    assert_same_logits(model, ref)

    # compressed-tensors: o_proj quantized with one scale for the whole tensor
    ref = hc.write_compressed_tensors(tmp_path / "ct", tensor_strategy_o_proj=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load(tmp_path / "ct")
    messages = [str(w.message) for w in caught if "mixgemm.hf" in str(w.message)]
    assert len(messages) == 2
    for i, msg in enumerate(messages):
        assert msg.startswith(f"mixgemm.hf: keeping model.layers.{i}.self_attn.o_proj in full precision "
                              f"(torch.bfloat16): a scalar weight_scale (the 'tensor' strategy) is not supported")
    for name in ref.full_precision:
        assert_bitwise(model.get_submodule(name).weight.detach(), ref.linears[name], name)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)     # o_proj is not part of it
    assert_same_logits(model, ref)


def _not_fused_lines(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "mixgemm.hf" and "not fused" in r.getMessage()]


def test_gate_and_up_with_different_permutations_stay_separate(tmp_path, caplog):
    """Every projection with its own act-order permutation: neither q/k/v nor gate/up can share
    one layer; each stays a QuantLinear, and the log says why, once per attention and MLP."""
    ref = hc.write_gptq(tmp_path / "m", act_order=True, fmt="gptq_v2", separate_mlp_orders=True)
    with caplog.at_level(logging.INFO, logger="mixgemm.hf"):
        model = load(tmp_path / "m")
    mlp, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
    assert type(mlp).__name__ == "LlamaMLP" and model.mixgemm_summary.fused == []
    assert isinstance(mlp.gate_proj, QuantLinear) and isinstance(mlp.up_proj, QuantLinear)
    assert not torch.equal(mlp.gate_proj.perm, mlp.up_proj.perm)
    assert type(attn).__name__ == "LlamaAttention" and model.mixgemm_summary.fused_attentions == []
    assert all(isinstance(getattr(attn, p), QuantLinear) for p in ("q_proj", "k_proj", "v_proj"))
    assert sorted(_not_fused_lines(caplog)) == sorted(
        [f"mixgemm.hf: model.layers.{i}.mlp: gate and up not fused: gate and up have different act-order "
         f"permutations" for i in range(hc.LAYERS)] +
        [f"mixgemm.hf: model.layers.{i}.self_attn: q, k and v not fused: q, k and v have different act-order "
         f"permutations" for i in range(hc.LAYERS)])
    assert_same_logits(model, ref)
    unfused = load(tmp_path / "m", fuse_gate_up=False)
    assert unfused.mixgemm_summary.fused == [] and len(unfused.mixgemm_summary.quantized) == 14


def test_q_k_and_v_of_different_group_sizes_stay_separate(tmp_path, caplog):
    """k_proj in groups of 128, q and v of 64: the attention keeps three layers (and the log
    line names each one's type); the MLPs are still fused; the logits are the reference's."""
    ref = hc.write_mixgemm(tmp_path / "m", k_proj_group_size=128)
    with caplog.at_level(logging.INFO, logger="mixgemm.hf"):
        model = load(tmp_path / "m")
    s = model.mixgemm_summary
    assert s.fused_attentions == [] and s.fused == [f"model.layers.{i}.mlp" for i in range(hc.LAYERS)]
    assert "(0 attentions with q/k/v fused, 2 gated MLPs fused)" in str(s)
    attn = model.model.layers[1].self_attn
    assert type(attn).__name__ == "LlamaAttention" and attn.k_proj.group_size == 128
    assert _not_fused_lines(caplog) == [
        f"mixgemm.hf: model.layers.{i}.self_attn: q, k and v not fused: q is u4/g64 256x256 bfloat16, "
        f"k is u4/g128 128x256 bfloat16, v is u4/g64 128x256 bfloat16" for i in range(hc.LAYERS)]
    got = hc.dequantized_linears(model)
    for name, want in ref.linears.items():
        assert_bitwise(got[name][0], want, name)
    assert_same_logits(model, ref)


def test_q_k_and_v_biases_are_stacked_with_their_rows(tmp_path):
    """q, k, v (and o) with biases (as Qwen2's): the fused layer's bias is [b_q; b_k; b_v], and
    the logits are the reference's."""
    ref = hc.write_mixgemm(tmp_path / "m", attention_bias=True)
    model = load(tmp_path / "m")
    assert model.mixgemm_summary.fused_attentions == [f"model.layers.{i}.self_attn" for i in range(hc.LAYERS)]
    qkv = model.model.layers[0].self_attn.qkv_proj
    want = torch.cat([ref.plain[f"model.layers.0.self_attn.{p}.bias"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.bias, want)
    assert_same_logits(model, ref)


def test_the_fusion_keywords(tmp_path):
    """fuse_projections=False: every quantized layer alone (as quantize_model's keyword);
    fuse_gate_up=False: q/k/v fused, gate and up apart; fuse_projections=False with
    fuse_gate_up=True: gate/up alone fused. The logits are the same in every case."""
    ref = hc.write_awq(tmp_path / "m", shards=1)
    cases = {(): (2, 2, 8), (("fuse_projections", False),): (0, 0, 14), (("fuse_gate_up", False),): (2, 0, 10),
             (("fuse_projections", False), ("fuse_gate_up", True)): (0, 2, 12)}
    for kw, (attentions, mlps, layers) in cases.items():
        model = load(tmp_path / "m", **dict(kw))
        s = model.mixgemm_summary
        assert (len(s.fused_attentions), len(s.fused), len(s.quantized)) == (attentions, mlps, layers), kw
        assert len([m for m in model.modules() if isinstance(m, QuantLinear)]) == layers
        assert isinstance(model.model.layers[0].self_attn, hf.FusedQKVAttention) == bool(attentions)
        assert_same_logits(model, ref)


def test_an_unrecognized_attention_keeps_q_k_and_v_apart(tmp_path, monkeypatch, caplog):
    """An attention class mixgemm.nn.blocks does not know: its q, k and v stay three QuantLinear
    layers, with one log line; gate/up is still fused."""
    from mixgemm.nn import blocks

    ref = hc.write_awq(tmp_path / "m", shards=1)
    monkeypatch.setattr(blocks, "ATTENTIONS", frozenset({"MistralAttention"}))
    with caplog.at_level(logging.INFO, logger="mixgemm.hf"):
        model = load(tmp_path / "m")
    assert model.mixgemm_summary.fused_attentions == [] and len(model.mixgemm_summary.fused) == hc.LAYERS
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    lines = [r.getMessage() for r in caplog.records if "recognized family" in r.getMessage()]
    assert lines == ["mixgemm.hf: LlamaForCausalLM has no attention of a recognized family (MistralAttention): "
                     "q, k and v are loaded as separate layers"]
    assert_same_logits(model, ref)


def test_generate_on_the_dequantized_model_matches_the_reference(tmp_path):
    """generate() runs through the loaded (fused) model's modules; in float32 with the dequantized
    weights its greedy tokens are the reference model's, with a dynamic and a static cache."""
    ref = hc.write_compressed_tensors(tmp_path / "m", act_order=True, symmetric=False, group_size=128)
    model = hc.to_float32(load(tmp_path / "m"))
    reference = hc.reference_model(ref)
    ids = hc.input_ids(batch=1, length=6, seed=3)
    for cache in (None, "static"):
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        if cache:
            kw["cache_implementation"] = cache
        got = model.generate(ids, **kw)
        want = reference.generate(ids, **kw)
        assert got.shape == (1, 12) and torch.equal(got, want), cache


@pytest.fixture
def reference_gemm(monkeypatch):
    """QuantLinear computes from the reference dequantization (no GPU here)."""
    monkeypatch.setattr(QuantLinear, "forward", reference_forward)


def test_fuse_layers_generates_the_tokens_of_the_unfused_model(tmp_path, reference_gemm, caplog, monkeypatch):
    """fuse_layers=True: every decoder layer a FusedDecoderLayer (after the norms are replaced),
    the static cache generate()'s default, the summary and its log line say so; on the CPU
    reference path greedy generate() gives the unfused model's tokens, over two turns whose cache
    grows past the first prompt, and the logits agree within the dtype's rounding."""
    from mixgemm.nn import blocks
    from mixgemm.nn.blocks import FusedDecoderLayer
    from mixgemm.nn import RMSNorm

    hc.write_gptq(tmp_path / "m", act_order=True, fmt="gptq_v2")
    with caplog.at_level(logging.INFO, logger="mixgemm.hf"):
        fused = load(tmp_path / "m", fuse_layers=True, attn_implementation="sdpa")
    plain = load(tmp_path / "m", attn_implementation="sdpa")
    s = fused.mixgemm_summary
    assert s.fused_layers == [f"model.layers.{i}" for i in range(hc.LAYERS)] and not plain.mixgemm_summary.fused_layers
    assert f"{hc.LAYERS} decoder layers fused" in str(s) and str(s) in caplog.text
    for layer in fused.model.layers:
        assert isinstance(layer, FusedDecoderLayer) and isinstance(layer.self_attn, hf.FusedQKVAttention)
        assert isinstance(layer.input_layernorm, RMSNorm) and layer.self_attn.rope is not None
    assert fused.generation_config.cache_implementation == "static"
    ids = hc.input_ids(batch=1, length=7, seed=4)
    with torch.no_grad():
        got, want = fused(ids).logits.float(), plain(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    calls = []
    real = blocks.rotary_kv_cache
    monkeypatch.setattr(blocks, "rotary_kv_cache", lambda *a, **k: calls.append(1) or real(*a, **k))
    for turn in range(2):
        kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            a = fused.generate(ids, **kw)
            b = plain.generate(ids, cache_implementation="static", **kw)
        assert torch.equal(a, b), turn
        ids = torch.cat([a, hc.input_ids(batch=1, length=3, seed=turn + 9)], dim=1)
    assert len(calls) == 2 * hc.LAYERS * 5, "the fused rotary / KV-cache write: each layer, prefill and 4 steps"


def test_fuse_layers_needs_the_fused_projections(tmp_path, no_device_step):
    hc.write_awq(tmp_path / "m", shards=1)
    for kw in ({"fuse_projections": False}, {"fuse_gate_up": False}):
        with pytest.raises(ValueError, match="fuse_layers=True needs fuse_projections=True"):
            load(tmp_path / "m", fuse_layers=True, **kw)


def test_the_loaded_model_traces_as_one_graph_with_a_static_cache(tmp_path):
    """torch.compile(fullgraph=True) of a decoding step with a StaticCache traces the whole loaded
    model (fused MLPs, act-order permutations) into one graph of mixgemm.gemm custom ops; the
    backend stops before running it (the kernels need the GPU)."""
    hc.write_gptq(tmp_path / "m", act_order=True, fmt="gptq_v2")
    model = load(tmp_path / "m")
    graphs = []

    class Traced(Exception):
        pass

    def backend(gm, example_inputs):
        graphs.append(gm)
        raise Traced

    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    step = torch.compile(model, fullgraph=True, backend=backend)
    with pytest.raises(Exception, match="Traced"):
        step(hc.input_ids(1, 1), past_key_values=cache, use_cache=True, cache_position=torch.tensor([0]))
    assert len(graphs) == 1
    graph = str(graphs[0].graph)
    # per layer: the fused q/k/v, o, the fused gate/up and down; each with its act-order permutation
    assert graph.count("mixgemm.gemm") == 4 * hc.LAYERS and graph.count("index_select") == 4 * hc.LAYERS


def test_norms_are_replaced_by_mixgemm_rms_norm(tmp_path):
    """fuse_norms (default): every LlamaRMSNorm becomes a mixgemm.nn.RMSNorm sharing its weight,
    named in the summary; it computes transformers' formula (rounded once: within an ulp);
    fuse_norms=False keeps transformers' modules."""
    from mixgemm.nn import RMSNorm

    hc.write_awq(tmp_path / "m")
    model = load(tmp_path / "m")
    want = [f"model.layers.{i}.{n}" for i in range(hc.LAYERS) for n in ("input_layernorm", "post_attention_layernorm")]
    assert model.mixgemm_summary.norms == want + ["model.norm"]
    assert "5 RMSNorms on mixgemm's kernel" in str(model.mixgemm_summary)
    plain = load(tmp_path / "m", fuse_norms=False)
    assert plain.mixgemm_summary.norms == [] and "0 RMSNorms" in str(plain.mixgemm_summary)
    x = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).half() * 4
    for name in want + ["model.norm"]:
        ours, theirs = model.get_submodule(name), plain.get_submodule(name)
        assert isinstance(ours, RMSNorm) and type(theirs).__name__ == "LlamaRMSNorm"
        assert ours.variance_epsilon == theirs.variance_epsilon and torch.equal(ours.weight, theirs.weight)
        with torch.no_grad():
            a, b = ours(x).float(), theirs(x).float()
        assert ((a - b).abs() / b.abs().clamp(min=1e-3)).max() <= 2 ** -10 * 2
    assert model.model.norm.weight is model.get_parameter("model.norm.weight")
    with pytest.raises(TypeError, match="not a LLaMA-style RMSNorm"):
        RMSNorm.from_module(nn.LayerNorm(8))


def test_generate_for_a_model_lists_its_norm_kernel(tmp_path, capsys):
    from mixgemm.cli.main import main

    hc.write_awq(tmp_path / "m")
    assert main(["generate", "--list", "--for", str(tmp_path / "m")]) == 0
    names = capsys.readouterr().out.split()
    assert "mixgemm_rmsnorm_fp16" in names and not [n for n in names if "add_rmsnorm" in n]
    assert main(["generate", "--list", "--for", str(tmp_path / "m"), "--no-fuse-norms"]) == 0
    assert "mixgemm_rmsnorm_fp16" not in capsys.readouterr().out.split()
    assert main(["generate", "--list", "--no-fuse-norms"]) == 2
    assert "--no-fuse-norms go with --for" in capsys.readouterr().err


def test_other_activation_dtype_rounds_the_scales(tmp_path):
    ref = hc.write_awq(tmp_path / "m", shards=1)
    model = load(tmp_path / "m", dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.scales.dtype == torch.bfloat16
    got = hc.dequantized_linears(model)["model.layers.0.self_attn.q_proj"][0].double()
    want = ref.linears["model.layers.0.self_attn.q_proj"].double()
    # mixgemm.formats' documented bound for an fp16 checkpoint imported as bf16
    assert bool(((got - want).abs() <= (2 ** -7 + 2 ** -16 + 2 ** -11) * want.abs() / (1 - 2 ** -11)).all())
    assert not torch.equal(got, want)


def test_stale_rotary_frequencies_in_a_checkpoint_are_ignored(tmp_path):
    ref = hc.write_awq(tmp_path / "m", shards=1)
    hc.rewrite(tmp_path / "m", lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}))
    assert_same_logits(load(tmp_path / "m"), ref)


# ------------------------------------------------------------------------------- bad checkpoints


@pytest.fixture
def no_device_step(monkeypatch):
    """Fail the test if from_pretrained reaches its device step."""
    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained reached the device step")
    monkeypatch.setattr(materialize, "materialize", refuse)


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def _drop(key):
    return lambda t: t.pop(key, None)


def _add_bias(layer):
    def change(tensors):
        if f"{layer}.qweight" in tensors:
            tensors[f"{layer}.bias"] = torch.zeros(256, dtype=torch.float16)
    return change


def _replace(key, value):
    return lambda t: t.update({key: value}) if key in t else None


BAD = {
    "truncated-shard": (lambda d: _truncate(d / "model-00002-of-00002.safetensors"), CheckpointError,
                        r"model-00002-of-00002.safetensors: not a valid safetensors file \(truncated or corrupt"),
    "garbage-shard": (lambda d: (d / "model-00001-of-00002.safetensors").write_bytes(os.urandom(5000)),
                      CheckpointError, "not a valid safetensors file"),
    "missing-shard": (lambda d: (d / "model-00001-of-00002.safetensors").unlink(), CheckpointError,
                      r"'model-00001-of-00002.safetensors' listed in model.safetensors.index.json is missing"),
    "stale-index": (lambda d: hc.rewrite(d, _drop("model.norm.weight"), update_index=False), CheckpointError,
                    "disagrees with model.safetensors.index.json: tensor 'model.norm.weight' is listed but missing"),
    "missing-norm": (lambda d: hc.rewrite(d, _drop("model.norm.weight")), CheckpointError,
                     r"lacks 1 tensor\(s\) the model needs, e.g. \['model.norm.weight'\]"),
    "missing-qzeros": (lambda d: hc.rewrite(d, _drop("model.layers.1.mlp.up_proj.qzeros")), FormatError,
                       "'model.layers.1.mlp.up_proj'.*missing its companion tensor"),
    "missing-layer": (lambda d: hc.rewrite(d, lambda t: [t.pop(k) for k in list(t) if ".layers.1.self_attn.k_proj." in k]),
                      CheckpointError, r"lacks 1 tensor\(s\).*model.layers.1.self_attn.k_proj.weight"),
    "embedding-shape": (lambda d: hc.rewrite(d, _replace("model.embed_tokens.weight", torch.zeros(500, 256, dtype=torch.float16))),
                        CheckpointError, r"'model.embed_tokens.weight' .* has shape \[500, 256\], but the config makes it \[512, 256\]"),
    "fewer-layers-in-config": (lambda d: hc.edit_config(d, num_hidden_layers=1), CheckpointError,
                               r"tensor\(s\) of the checkpoint belong to no layer.*model.layers.1"),
    "intermediate-size-in-config": (lambda d: hc.edit_config(d, intermediate_size=1024), CheckpointError,
                                    r"'model.layers.0.mlp.gate_proj' holds a \[512, 256\] weight, but the config makes it \[1024, 256\]"),
    "group-size-in-config": (lambda d: hc.edit_config(d, quantization_config={"group_size": 128}), FormatError,
                             "'model.layers.0.self_attn.q_proj'.*group_size=128 means 2 groups"),
    "bits-in-config": (lambda d: hc.edit_config(d, quantization_config={"bits": 8}), FormatError,
                       "AWQ GEMM"),
    "awq-gemv": (lambda d: hc.edit_config(d, quantization_config={"version": "gemv"}), CheckpointError,
                 "AWQ version 'gemv' is not supported"),
    "bitsandbytes": (lambda d: hc.edit_config(d, quantization_config={"quant_method": "bitsandbytes"}),
                     CheckpointError, "quant_method 'bitsandbytes' is not supported"),
    "no-quantization-config": (lambda d: hc.edit_config(d, quantization_config=None), CheckpointError,
                               "has no quantization_config: not a quantized checkpoint"),
    "bias-for-a-bias-free-layer": (lambda d: hc.rewrite(d, _add_bias("model.layers.0.self_attn.o_proj")),
                                   CheckpointError, "'model.layers.0.self_attn.o_proj' has a bias tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_awq_checkpoints_fail_before_the_device_step(tmp_path, no_device_step, case, pin_case):
    d = tmp_path / "m"
    hc.write_awq(d)                                  # two shards with an index
    damage, error, match = BAD[case]
    damage(d)
    with pytest.raises(error, match=match) as info:
        hf.from_pretrained(d, device="cpu")
    pin_case("hf.from_pretrained", case, "from_pretrained(dir)", type(info.value).__name__, str(info.value).splitlines()[0])


def test_gptq_config_and_tensors_must_agree(tmp_path, no_device_step):
    d = tmp_path / "m"
    hc.write_gptq(d, bits=4, group_size=64, fmt="gptq_v2")
    hc.edit_config(d, quantization_config={"bits": 8})
    with pytest.raises(FormatError, match="bits=8 does not match qzeros"):
        hf.from_pretrained(d, device="cpu")
    hc.edit_config(d, quantization_config={"bits": 4, "checkpoint_format": "marlin"})
    with pytest.raises(CheckpointError, match="unknown GPTQ checkpoint_format 'marlin'"):
        hf.from_pretrained(d, device="cpu")
    # GPTQModel's dynamic rule says o_proj is not quantized, but its tensors are
    hc.edit_config(d, quantization_config={"checkpoint_format": "gptq_v2", "dynamic": {r"-:.*o_proj": {}}})
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.o_proj' holds quantized tensors, but the "
                                              "quantization_config says it is not quantized"):
        hf.from_pretrained(d, device="cpu")


def test_quantized_tensors_the_loader_cannot_place(tmp_path, no_device_step):
    d = tmp_path / "m"
    hc.write_mixgemm(d)
    hc.edit_config(d, quantization_config={"quant_method": "awq"})
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.q_proj.weight' is a mixgemm packed weight, "
                                              "but the quantization_config's quant_method is 'awq'"):
        hf.from_pretrained(d, device="cpu")
    # a quantized embedding: mixgemm replaces linear layers only
    hc.write_awq(tmp_path / "e", shards=1)
    qweight = hc.checkpoint_keys(tmp_path / "e")
    hc.rewrite(tmp_path / "e", lambda t: t.update({"model.embed_tokens.qweight": torch.zeros(4, 4, dtype=torch.int32)}))
    assert "model.embed_tokens.qweight" not in qweight
    with pytest.raises(CheckpointError, match="'model.embed_tokens.qweight' belongs to 'model.embed_tokens', a "
                                              "Embedding: mixgemm.hf reads quantized nn.Linear layers only"):
        hf.from_pretrained(tmp_path / "e", device="cpu")


def test_mixgemm_checkpoint_from_the_future_is_refused(tmp_path, no_device_step):
    d = tmp_path / "m"
    hc.write_mixgemm(d)
    hc.edit_config(d, quantization_config={"format_version": 2})
    with pytest.raises(CheckpointError, match="format_version 2 is from the future.*upgrade mixgemm"):
        hf.from_pretrained(d, device="cpu")


def test_not_a_model_directory(tmp_path, no_device_step):
    with pytest.raises(CheckpointError, match="no such directory"):
        hf.from_pretrained(tmp_path / "nope", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        hf.from_pretrained(tmp_path / "empty", device="cpu")
    hc.write_awq(tmp_path / "m", shards=1)
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights"):
        hf.from_pretrained(tmp_path / "m", device="cpu")


def test_bad_arguments(tmp_path, no_device_step):
    hc.write_awq(tmp_path / "m", shards=1)
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float16"):
        hf.from_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        hf.from_pretrained(tmp_path / "m", device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            hf.from_pretrained(tmp_path / "m", device="cuda")


# --------------------------------------------------------------------- config parsing, fallbacks


def test_quantization_config_schemes():
    awq = parse_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 128,
                                     "modules_to_not_convert": ["visual"]})
    assert awq.scheme_for("model.layers.0.mlp.up_proj") == LayerScheme(bits=4, group_size=128)
    assert not awq.scheme_for("model.visual.proj").quantized
    gptq = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq_v2",
                                      "dynamic": {r"+:.*down_proj": {"bits": 8}, r"-:.*lm_head": {}}})
    assert gptq.scheme_for("model.layers.3.mlp.down_proj") == LayerScheme(bits=8, group_size=128,
                                                                          checkpoint_format="gptq_v2")
    assert gptq.scheme_for("model.layers.3.mlp.up_proj").bits == 4
    assert not gptq.scheme_for("lm_head").quantized
    assert parse_quantization_config({"quant_method": "gptq"}).default.checkpoint_format == "gptq"   # v1
    ct = parse_quantization_config({
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"a": {"targets": ["re:.*down_proj$"], "weights": {"num_bits": 8, "strategy": "channel"}},
                          "b": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group",
                                                                   "group_size": 32}}}})
    assert ct.scheme_for("model.layers.0.mlp.down_proj") == LayerScheme(bits=8, group_size=-1,
                                                                         checkpoint_format="pack-quantized")
    assert ct.scheme_for("model.layers.0.mlp.gate_proj") == LayerScheme(bits=4, group_size=32,
                                                                         checkpoint_format="pack-quantized")
    assert not ct.scheme_for("lm_head").quantized
    assert not ct.scheme_for("model.embed_tokens", "Embedding").quantized
    with pytest.raises(CheckpointError, match="'float-quantized'.*not supported"):
        parse_quantization_config({"quant_method": "compressed-tensors", "format": "float-quantized",
                                   "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8,
                                                                                              "type": "float"}}}})
    with pytest.warns(UserWarning, match="quantizes the input activations"):
        parse_quantization_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                   "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4},
                                                           "input_activations": {"num_bits": 8}}}})


def _gptq_3bit_layer(k, n, gs, gen):
    """A 3-bit GPTQ layer: AutoGPTQ packs 32 codes of a column into 3 int32 words, i.e. a
    little-endian bit stream along K (codes straddle words), and the zero points along N."""
    q = rp.rand_codes((k, n), 3, gen)
    z = rp.rand_codes((k // gs, n), 3, gen, lo=1)
    s = rp.rand_scales((k // gs, n), torch.float16, gen)
    return q, z, s, {"qweight": rp.ct_pack(q - 4, 3, 0), "qzeros": rp.ct_pack(z - 1 - 4, 3, 1), "scales": s}


def test_dequantize_layer_is_each_formats_formula():
    gen = rp.gen_for("hf-fallback")
    k, n, gs = 256, 64, 64
    # 3-bit GPTQ (v1: zeros stored minus one), codes straddling words
    q, z, s, t = _gptq_3bit_layer(k, n, gs, gen)
    assert t["qweight"].shape == (k * 3 // 32, n) and t["qzeros"].shape == (k // gs, n * 3 // 32)
    g = torch.arange(k) // gs
    want = ((q - z[g]).to(torch.float16) * s[g]).t()
    got = dequantize_layer(QuantMethod.GPTQ, {f"L.{key}": v for key, v in t.items()}, "L",
                           LayerScheme(bits=3, group_size=gs, checkpoint_format="gptq"))
    assert_bitwise(got, want, "3-bit gptq")
    # the 2/4/8-bit formats against tests/reference_packers.py's reference dequantizers
    qweight, qzeros, scales = rp.make_awq(192, 64, gen)
    got = dequantize_layer(QuantMethod.AWQ, {"a.qweight": qweight, "a.qzeros": qzeros, "a.scales": scales}, "a",
                           LayerScheme(bits=4, group_size=64))
    assert_bitwise(got, rp.awq_reference_dequant(qweight, qzeros, scales, 64), "awq")
    g_idx = rp.random_act_order_g_idx(192, 32, gen)
    for fmt in ("gptq", "gptq_v2"):
        t = rp.make_gptq(192, 32, 8, False, fmt, torch.bfloat16, gen, g_idx=g_idx)
        got = dequantize_layer(QuantMethod.GPTQ, {f"p.{key}": v for key, v in t.items()}, "p",
                               LayerScheme(checkpoint_format=fmt))
        assert_bitwise(got, rp.gptq_reference_dequant(**t, bits=8, fmt=fmt), fmt)
    for zp_packed in (True, False):
        t = rp.make_ct(192, 64, 2, False, torch.bfloat16, gen, zp_packed=zp_packed)
        got = dequantize_layer(QuantMethod.COMPRESSED_TENSORS, {f"c.{key}": v for key, v in t.items()}, "c",
                               LayerScheme())
        assert_bitwise(got, rp.ct_reference_dequant(**t, bits=2), "ct")
    with pytest.raises(FormatError, match="'c': missing tensor 'c.weight_scale'"):
        dequantize_layer(QuantMethod.COMPRESSED_TENSORS, {"c.weight_packed": t["weight_packed"]}, "c", LayerScheme())


def test_package_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import mixgemm, mixgemm.hf, mixgemm.formats.config, mixgemm.hf.shards, mixgemm.hf.dequant\n"
            "try:\n    mixgemm.hf.from_pretrained('x')\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError: mixgemm.hf needs transformers: pip install 'mixgemm[hf]'" in out.stdout
    code = "import sys, mixgemm.hf; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("kind,scheme", [("ct-w4a8-token", "fp8-token"), ("ct-w2a8-static", "fp8-tensor"),
                                         ("ct-w4a8-int-token", "fp8-token"), ("ct-w2a8-int-static", "fp8-tensor")])
def test_w4a8_checkpoints_load_with_exact_activations_and_say_so(tmp_path, kind, scheme):
    """A compressed-tensors checkpoint whose layers also quantize their inputs to fp8 loads with
    the weights exact and the activations bf16 (static input scales read and kept on the layers,
    unused), with a warning that names the scheme and how to apply it; in both layouts of its
    codes (pack-quantized, and the int8 codes of int-quantized)."""
    ref = hc.WRITERS[kind](tmp_path / kind)
    with pytest.warns(UserWarning, match=f"to e4m3 \\({scheme}\\); from_pretrained computes with bf16/fp16 "
                                         f"activations"):
        model = load(tmp_path / kind)
    assert all(m.act_format == "bf16" and (m.input_scale is not None) == (scheme == "fp8-tensor")
               for m in model.modules() if isinstance(m, QuantLinear))
    assert_same_logits(model, ref)


def _checkpoint_tensors(model_dir) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("kind", ["ct-w2a8-static", "ct-w2a8-int-static"])
def test_static_input_scales_of_a_w4a8_checkpoint_reach_the_layers(tmp_path, kind):
    """act_format="fp8" on a compressed-tensors checkpoint with static (per-tensor) input scales:
    every quantized layer quantizes with its checkpoint scale, a fused q/k/v or gate/up layer with
    the largest of its parts' (they read the same input); without act_format the scales are kept,
    unused. On the reference path a layer's product is that of x rounded as compressed-tensors
    does it, e4m3(clamp(x / scale)) * scale (torch's float8 cast here), and the dequantized weight."""
    import torch.nn.functional as F

    import mixgemm

    hc.WRITERS[kind](tmp_path / "m")
    with pytest.warns(UserWarning, match="act_format='fp8', which quantizes with the layers' static input scales"):
        model = load(tmp_path / "m", act_format="fp8")
    ckpt = _checkpoint_tensors(tmp_path / "m")
    parts_of = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert {n.rpartition(".")[2] for n in layers} >= {"qkv_proj", "gate_up"}
    for name, layer in layers.items():
        parent, _, last = name.rpartition(".")
        want = max(float(ckpt[f"{parent}.{p}.input_scale"].float()) for p in parts_of.get(last, (last,)))
        assert layer.act_format == "fp8", name
        assert layer.input_scale is not None and layer.input_scale.dtype == torch.float32
        assert float(layer.input_scale) == want, name
    with pytest.warns(UserWarning, match="unless it is given act_format='fp8'"):
        exact = load(tmp_path / "m")
    for name, layer in exact.named_modules():
        if isinstance(layer, QuantLinear):
            assert layer.act_format == "bf16" and float(layer.input_scale) == float(layers[name].input_scale)
    layer = layers["model.layers.0.mlp.down_proj"]
    s = float(layer.input_scale)
    x = (torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0)) * 4 * s * 100).to(torch.bfloat16)
    xq = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    w = mixgemm.dequantize_reference(layer.packed).float()
    want = F.linear(xq, w, None if layer.bias is None else layer.bias.float()).to(torch.bfloat16)
    with torch.no_grad():
        got = reference_forward(layer, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (x.float().abs() > 448 * s).any()      # some values saturate at the static scale


def test_fp8_activations_where_the_e4m3_kernels_take_the_layer(tmp_path, caplog):
    """act_format="fp8": AWQ's 4-bit layers take e4m3 activations (the fused gate/up too), and
    8-bit GPTQ layers keep bf16 ones; the summary and a log line name them with the reason."""
    hc.write_awq(tmp_path / "awq", shards=1)
    model = load(tmp_path / "awq", act_format="fp8")
    formats = {n: m.act_format for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert any(n.endswith(".gate_up") for n in formats) and set(formats.values()) == {"fp8"}, formats
    assert not model.mixgemm_summary.bf16_activations
    assert {m.act_format for m in load(tmp_path / "awq").modules() if isinstance(m, QuantLinear)} == {"bf16"}
    hc.write_gptq(tmp_path / "g8", bits=8)
    with caplog.at_level(logging.INFO, logger="mixgemm.hf"):
        model = load(tmp_path / "g8", act_format="fp8")
    assert any("keep bf16 activations" in r.getMessage() for r in caplog.records)
    n = len(model.mixgemm_summary.quantized)
    assert f"{n} quantized layers with bf16 activations" in str(model.mixgemm_summary)
    assert {m.act_format for m in model.modules() if isinstance(m, QuantLinear)} == {"bf16"}
    assert len(model.mixgemm_summary.bf16_activations) == len(model.mixgemm_summary.quantized)
    assert all("takes u4, s4, u2 and s2" in why for why in model.mixgemm_summary.bf16_activations.values())


def test_a_bad_act_format_fails_before_the_device_step(tmp_path, no_device_step):
    hc.write_awq(tmp_path / "m", shards=1)
    with pytest.raises(ValueError, match="act_format must be one of"):
        load(tmp_path / "m", act_format="e4m3")
    for fmt in ("fp8", "auto"):
        with pytest.raises(ValueError, match="does not run tensor-parallel"):
            load(tmp_path / "m", act_format=fmt, tp_rank=0, tp_size=2)
