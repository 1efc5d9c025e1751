"""mixgemm.nn.blocks on the CPU: fused projections and fused decoder layers in transformers models.

The GEMM kernels need a Hopper GPU, so here each QuantLinear computes its product from the
reference dequantization (``x @ dequantize_reference(w).T`` in float32, the epilogue after it):
the fused model must give the logits of the same model quantized layer by layer, and greedy
``generate()`` the same tokens, with a dynamic and a static cache, over several turns whose
cache grows past the prompt. tests/ops/test_gpu_compile.py runs the same models on the kernels.
"""
from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the fused blocks are transformers modules")

import mixgemm  # noqa: E402
from mixgemm.nn import blocks  # noqa: E402
from mixgemm.dispatch import plans  # noqa: E402
from mixgemm.dtypes import WeightType  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402
from mixgemm.ops import layer as layer_ops  # noqa: E402
from linear_numerics import swiglu  # noqa: E402
from tiny_models import reference_forward, tiny_model  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture
def reference_gemm(monkeypatch):
    """QuantLinear computes from the reference dequantization (no GPU here)."""
    monkeypatch.setattr(QuantLinear, "forward", reference_forward)


def quantized(family: str, **kw):
    """A float32 tiny model quantized (fp16 scales; the reference product runs in float32)."""
    model = tiny_model(family)
    summary = mixgemm.nn.quantize_model(model, bits=4, group_size=64, progress=False, dtype=torch.float16, **kw)
    return model, summary


def _ids(batch: int = 1, length: int = 9, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 160, (batch, length), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_projections_give_the_per_layer_logits(reference_gemm, family):
    """q/k/v in one GEMM and gate/up in one swiglu GEMM: four QuantLinear layers per decoder layer,
    the same codes and scales as quantizing each projection alone, the same logits."""
    fused, summary = quantized(family)
    plain, plain_summary = quantized(family, fuse_projections=False)
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn, blocks.FusedQKVAttention) and isinstance(layer.mlp, blocks.GatedMLP)
    quant = [n for n, m in fused.named_modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 4 * 2, quant
    assert sorted(summary.fused) == sorted([f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn", "mlp")])
    assert summary.bytes_before == plain_summary.bytes_before
    # the stacked weight is the three weights quantized alone, row for row
    attn = plain.model.layers[0].self_attn
    stacked = mixgemm.dequantize_reference(layer.self_attn.qkv_proj.packed)
    alone = torch.cat([mixgemm.dequantize_reference(p.packed) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
    assert torch.equal(stacked, alone)
    ids = _ids(batch=2)
    with torch.no_grad():
        got, want = fused(ids).logits, plain(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_generate_the_per_layer_tokens(reference_gemm, family):
    """fuse_layers=True: every decoder layer a FusedDecoderLayer, the static cache generate()'s
    default; greedy tokens and scores equal the per-layer model's over two turns (the second
    prompt continues the first answer, so the cache grows past the prompt), batch 1 and 2."""
    fused, _ = quantized(family, fuse_layers=True)
    plain, _ = quantized(family, fuse_projections=False)
    assert all(isinstance(layer, blocks.FusedDecoderLayer) for layer in fused.model.layers)
    assert fused.generation_config.cache_implementation == "static"
    for batch in (1, 2):
        ids = _ids(batch)
        for turn in range(2):
            kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
            with torch.no_grad():
                got = fused.generate(ids, **kw)
                want = plain.generate(ids, cache_implementation="static", **kw)
            assert torch.equal(got.sequences, want.sequences), (family, batch, turn)
            for a, b in zip(got.scores, want.scores):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            ids = torch.cat([got.sequences, _ids(batch, 3, seed=turn + 5)], dim=1)


def test_the_fused_rotary_path_is_taken_where_positions_are_slots(reference_gemm, monkeypatch):
    """A call over transformers' static cache whose positions are the cache slots (a batch
    without left padding) writes the cache through rotary_kv_cache (one call per layer and
    step); a left-padded batch, even of one sequence, and a dynamic cache take transformers'
    path, with the per-layer model's tokens."""
    model, _ = quantized("llama", fuse_layers=True)
    plain, _ = quantized("llama", fuse_projections=False)
    calls = []
    real = blocks.rotary_kv_cache
    monkeypatch.setattr(blocks, "rotary_kv_cache", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        for batch in (1, 2):
            calls.clear()
            model.generate(_ids(batch), max_new_tokens=3, do_sample=False)
            assert len(calls) == 2 * 3, (batch, "two layers, one prefill and two decode steps")
        calls.clear()
        model.generate(_ids(1), max_new_tokens=3, do_sample=False, cache_implementation="dynamic")
        assert not calls
        for batch in (2, 1):
            ids = _ids(batch)
            mask = torch.ones_like(ids)
            mask[-1, :3] = 0                       # the last sequence left-padded
            kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, cache_implementation="static")
            got = model.generate(ids, **kw)
            assert not calls
            want = plain.generate(ids, **kw)
            assert torch.equal(got.sequences, want.sequences)
            for a, b in zip(got.scores, want.scores):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_one_token_call_compares_its_positions_again(reference_gemm, family):
    """A call of one token does not keep the previous call's positions-are-slots answer: a chunked
    prompt whose last chunk is one token, of a row whose last prompt token is padding, has that
    row's position behind its slot; writing it at its position would overwrite an earlier slot.
    The fused layers give the per-layer model's tokens and scores at batch 1 and 3."""
    model, _ = quantized(family, fuse_layers=True)
    plain, _ = quantized(family, fuse_projections=False)
    for batch in (1, 3):
        ids = _ids(batch)
        mask = torch.ones_like(ids)
        mask[-1, -1] = 0                            # the last row's last prompt token is padding
        kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True, pad_token_id=0,
                  return_dict_in_generate=True, cache_implementation="static", prefill_chunk_size=4)
        with torch.no_grad():
            got, want = model.generate(ids, **kw), plain.generate(ids, **kw)
        assert torch.equal(got.sequences, want.sequences), batch
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _reference_op_gemm(x, qdata, scales, zeros, bias, weight_type, group_size, n, k, activation):
    """decode_layer's GEMM as the reference QuantLinear forward computes it (tiny_models.reference_forward)."""
    w = mixgemm.dequantize_reference(mixgemm.PackedWeight(qdata, scales, zeros, WeightType(weight_type), group_size,
                                                          n, k)).float()
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
    return swiglu(y) if activation == "swiglu" else y


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_eager_decode_step_in_one_call_gives_the_part_by_part_tokens(reference_gemm, monkeypatch, family):
    """With the torch operator library holding the kernels (imitated: on the CPU the operator
    runs its Python kernel), each eager decode step of a fused layer is one decode_layer call:
    batch 1 and 3 give the tokens and scores of the same model run part by part (one_call off),
    bit for bit (Qwen2's qkv bias included); a left-padded batch, whose positions are not its
    slots, is not taken."""
    model, _ = quantized(family, fuse_layers=True)
    layers = list(model.model.layers)
    monkeypatch.setattr(plans.OPERATORS, "holds_rope", lambda x: True)
    monkeypatch.setattr(layer_ops, "_gemm", _reference_op_gemm)
    calls = []
    real = blocks._DECODE_LAYER
    monkeypatch.setattr(blocks, "_DECODE_LAYER", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    kw = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)

    def run(ids, one_call, **extra):
        for layer in layers:
            layer.one_call = one_call
        with torch.no_grad():
            return model.generate(ids, **kw, **extra)

    for batch in (1, 3):
        ids = _ids(batch)
        calls.clear()
        got = run(ids, True)
        assert calls == [batch] * (len(layers) * 4), "every layer of the four decode steps"
        calls.clear()
        want = run(ids, False)
        assert not calls
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores):
            assert torch.equal(a, b)
    ids = _ids(2)
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    run(ids, True, attention_mask=mask)
    assert not calls


def test_an_auto_layer_decodes_in_one_call_where_it_keeps_exact_activations(reference_gemm, monkeypatch):
    """act_format="auto" layers take the one-call step at the token counts where auto keeps
    exact activations (here: one token), and part by part where a layer would take e4m3 ones."""
    model, _ = quantized("llama", fuse_layers=True, act_format="auto")
    monkeypatch.setattr(plans.OPERATORS, "holds_rope", lambda x: True)
    monkeypatch.setattr(layer_ops, "_gemm", _reference_op_gemm)
    monkeypatch.setattr("mixgemm.nn.linear.layer_prefers_fp8", lambda m, *a: m >= 2)
    calls = []
    real = blocks._DECODE_LAYER
    monkeypatch.setattr(blocks, "_DECODE_LAYER", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    layers = len(model.model.layers)
    with torch.no_grad():
        model.generate(_ids(1), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert calls == [1] * (2 * layers)
        calls.clear()
        model.generate(_ids(3), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert not calls


def test_the_lengths_a_decode_step_attends_by(monkeypatch):
    """The variable-length arguments of the FlashAttention decode step (run on the GPU:
    tests/ops/test_gpu_compile.py): the keys used are the position + 1, the offsets those of one
    query over the cache's slots; the later layers of one forward share them, and the next
    forward's first layer makes new ones, even from the same position tensor updated in place;
    a compiled step keeps none."""
    cache = type("Cache", (), {})()
    pos = torch.tensor([[41]])
    lengths, q_offsets, k_offsets = blocks._decode_lengths(cache, pos, 192, 0)
    assert lengths.dtype == q_offsets.dtype == k_offsets.dtype == torch.int32
    assert lengths.tolist() == [42] and q_offsets.tolist() == [0, 1] and k_offsets.tolist() == [0, 192]
    assert blocks._decode_lengths(cache, pos, 192, 1)[0] is lengths        # the next layer of the forward
    pos.add_(1)                                                            # the next forward, in place
    assert blocks._decode_lengths(cache, pos, 192, 0)[0].tolist() == [43]
    assert blocks._decode_lengths(cache, pos, 256, 1)[2].tolist() == [0, 256]
    assert blocks._decode_lengths(cache, torch.tensor([[50]]), 256, 2)[0].tolist() == [51]
    kept = cache._mixgemm_decode_lengths
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert blocks._decode_lengths(cache, torch.tensor([[7]]), 256, 3)[0].tolist() == [8]
    assert cache._mixgemm_decode_lengths is kept


def _flash_on_the_cpu(monkeypatch) -> list:
    """The eager FlashAttention decode step imitated on the CPU: its gate without the CUDA
    conditions, and its attention as what ``seqused_k`` means (SDPA over the first position + 1
    slots); returns the list its calls are counted in."""
    import torch.nn.functional as F

    calls = []

    def attend(attn, q, keys, values, cache, position_ids):
        calls.append(1)
        n = int(blocks._decode_lengths(cache, position_ids, keys.shape[2], attn.layer_idx)[0])
        g = attn.heads // attn.kv_heads
        k, v = keys[:, :, :n].repeat_interleave(g, 1), values[:, :, :n].repeat_interleave(g, 1)
        return F.scaled_dot_product_attention(q, k, v, scale=attn.scaling).transpose(1, 2)

    monkeypatch.setattr(blocks, "_flash_runs", lambda attn, batch, dtype, on_cuda, keys: batch == 1)
    monkeypatch.setattr(blocks, "_flash_decode_attention", attend)
    return calls


def _forward_loop(model, ids, steps=3, attention_mask=None, step_mask=None, position_buffer=False):
    """A prompt and ``steps`` greedy decode steps through the model's forward over a static cache
    (no generate()): the last logits of each step."""
    import inspect

    import transformers

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    out = model(ids, attention_mask=attention_mask, use_cache=True, **{name: cache})
    tok, logits, mask = out.logits[:, -1:].argmax(-1), [], attention_mask
    pos = torch.tensor([[ids.shape[1]]])
    for s in range(steps):
        kw = {name: cache}
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(1, 1)], 1)
            kw["attention_mask"] = mask
        if step_mask is not None:
            kw["attention_mask"] = step_mask(ids.shape[1] + s)
        if position_buffer:
            kw["position_ids"] = pos          # one tensor, updated in place (as a CUDA graph's input is)
        out = model(tok, use_cache=True, **kw)
        logits.append(out.logits[:, -1])
        tok = out.logits[:, -1:].argmax(-1)
        pos.add_(1)
    return torch.stack(logits)


def test_one_sequence_attends_by_its_length_where_its_mask_is_the_prefix(reference_gemm, monkeypatch):
    """The eager FlashAttention decode step of one sequence, imitated on the CPU (the GPU test
    runs the real one): taken at every decode step of generate(), two turns, and of a forward
    loop whose position tensor is updated in place, with the per-layer model's logits; not taken
    where the prompt's mask is not the prefix of the slots (a left-padded 2-D mask with the
    model's own positions) or a decode step's own mask hides a filled slot, where a sliding window
    is shorter than the cache, or where the layers' ``flash_decode`` is off."""
    model, _ = quantized("llama", fuse_layers=True)
    plain, _ = quantized("llama", fuse_projections=False)
    calls = _flash_on_the_cpu(monkeypatch)
    ids = _ids(1)
    with torch.no_grad():
        kw = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  cache_implementation="static")
        turn = ids
        for _ in range(2):
            calls.clear()
            got, want = model.generate(turn, **kw), plain.generate(turn, **kw)
            assert len(calls) == 2 * 3, "two layers, three decode steps"
            assert torch.equal(got.sequences, want.sequences)
            for a, b in zip(got.scores, want.scores):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            turn = torch.cat([got.sequences, _ids(1, 3, seed=9)], dim=1)

        calls.clear()
        torch.testing.assert_close(_forward_loop(model, ids, position_buffer=True),
                                   _forward_loop(plain, ids, position_buffer=True), rtol=1e-4, atol=1e-4)
        assert len(calls) == 2 * 3

        padded = torch.ones_like(ids)
        padded[0, :3] = 0
        calls.clear()
        torch.testing.assert_close(_forward_loop(model, ids, attention_mask=padded),
                                   _forward_loop(plain, ids, attention_mask=padded), rtol=1e-4, atol=1e-4)
        assert not calls

        def hide_slot_2(p):
            allow = torch.zeros(1, 1, 1, 32, dtype=torch.bool)
            allow[..., :p + 1] = True
            allow[..., 2] = False
            return allow

        calls.clear()                              # a decode mask of its own, checked at each forward
        torch.testing.assert_close(_forward_loop(model, ids, step_mask=hide_slot_2),
                                   _forward_loop(plain, ids, step_mask=hide_slot_2), rtol=1e-4, atol=1e-4)
        assert not calls
        for m in model.modules():
            if isinstance(m, blocks.FusedQKVAttention):
                m.flash_decode = False
        _forward_loop(model, ids, position_buffer=True)
        assert not calls
        for m in model.modules():
            if isinstance(m, blocks.FusedQKVAttention):
                m.flash_decode = True
                m.sliding_window = 16             # (shorter than the cache's 32 slots)
        _forward_loop(model, ids)
        assert not calls
        for m in model.modules():
            if isinstance(m, blocks.FusedQKVAttention):
                m.sliding_window = 32
        _forward_loop(model, ids)
        assert len(calls) == 2 * 3


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_the_fused_attention_passes_the_models_window(reference_gemm, family):
    """Mistral's and Mixtral's attention pass their config's sliding window to the attention
    function at each call (the flash-attention backends take it from there); so does the fused
    attention that replaces them."""
    import transformers

    cls = transformers.MistralConfig if family == "mistral" else transformers.MixtralConfig
    config = cls(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=1, vocab_size=160, head_dim=32, sliding_window=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    mixgemm.nn.quantize_model(model, bits=4, group_size=64, progress=False, dtype=torch.float16)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, blocks.FusedQKVAttention)
    seen = []
    real = attn._functions["sdpa"]

    def probe(module, *args, **kwargs):
        seen.append(kwargs.get("sliding_window", "not passed"))
        return real(module, *args, **kwargs)

    attn._functions = {"sdpa": probe}
    with torch.no_grad():
        model(_ids(1))
    assert seen == [4]


def test_unrecognized_models_keep_per_layer_replacement(reference_gemm, caplog):
    """A model with no recognized attention or MLP: each linear replaced alone, and the log says so."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 128))
    with caplog.at_level(logging.INFO, logger="mixgemm"):
        summary = mixgemm.nn.quantize_model(model, group_size=64, progress=False, skip=())
    assert summary.replaced == ["0", "2"] and not summary.fused
    assert "each linear layer is replaced alone" in caplog.text


def test_skip_of_one_projection_leaves_the_attention_unfused(reference_gemm):
    model = tiny_model("llama")
    summary = mixgemm.nn.quantize_model(model, group_size=64, progress=False, skip=("lm_head", r"layers\.0\.self_attn\.k_proj"))
    assert not isinstance(model.model.layers[0].self_attn, blocks.FusedQKVAttention)
    assert isinstance(model.model.layers[1].self_attn, blocks.FusedQKVAttention)
    assert isinstance(model.model.layers[0].self_attn.k_proj, torch.nn.Linear)
    assert "model.layers.0.self_attn.q_proj" in summary.replaced


def test_fuse_layers_needs_fused_projections():
    with pytest.raises(ValueError, match="fuse_layers=True needs fuse_projections=True"):
        mixgemm.nn.quantize_model(tiny_model("llama"), group_size=64, progress=False, fuse_projections=False,
                                  fuse_layers=True)


def test_fused_modules_keep_the_models_training_mode(reference_gemm):
    """A FusedQKVAttention / FusedDecoderLayer is in the mode of the module it replaces: an eval
    model stays in eval mode, so an attention with a dropout rate applies none (the same logits
    on every call), and a training model stays in training mode."""
    for training in (False, True):
        model = tiny_model("llama").train(training)
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.5
        mixgemm.nn.quantize_model(model, bits=4, group_size=64, progress=False, dtype=torch.float16, fuse_layers=True)
        fused = [m for m in model.modules() if isinstance(m, (blocks.FusedQKVAttention, blocks.FusedDecoderLayer))]
        assert len(fused) == 4 and all(m.training is training for m in fused)
        if not training:
            with torch.no_grad():
                assert torch.equal(model(_ids()).logits, model(_ids()).logits)


@pytest.mark.parametrize("batch", (1, 3))
@pytest.mark.parametrize("kv_heads", (1, 2, 4))
@pytest.mark.parametrize("mask_kind", ("bool", "additive"))
def test_decode_attention_equals_repeated_kv_heads(kv_heads, mask_kind, batch):
    """One query token against the static cache with each KV head's query group taken as its
    query rows: the output of transformers' sdpa function (each KV head repeated) to float64
    rounding, for a boolean and an additive mask that hides the cache's unwritten slots, one
    sequence or several with their own masks."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads, d, slots, filled = 4, 16, 24, 11
    attn = torch.nn.Module()
    attn.heads, attn.kv_heads, attn.scaling = heads, kv_heads, d ** -0.5
    attn.num_key_value_groups, attn.is_causal = heads // kv_heads, True
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(batch, heads, 1, d, generator=g, dtype=torch.float64)
    keys, values = (torch.randn(batch, kv_heads, slots, d, generator=g, dtype=torch.float64) for _ in range(2))
    # per sequence its own filled length (a left-padded batch hides other slots per row)
    keep = torch.arange(slots) < torch.tensor([filled - 3 * i for i in range(batch)]).view(batch, 1, 1, 1)
    mask = keep if mask_kind == "bool" else torch.zeros(batch, 1, 1, slots, dtype=torch.float64).masked_fill(
        ~keep, torch.finfo(torch.float64).min)
    attn.attention_dropout = 0.0
    assert blocks._packs_decode(attn.eval(), q.shape, keys, mask, {})
    got = blocks._decode_attention(attn, q, keys, values, mask)
    want, _ = sdpa_attention_forward(attn, q, keys, values, mask, scaling=attn.scaling)
    assert got.shape == want.shape == (batch, 1, heads, d)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the slots past the mask do not count: changing them changes nothing
    keys[..., filled:, :] += 100.0
    torch.testing.assert_close(blocks._decode_attention(attn, q, keys, values, mask), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fuse_layers", (True, False))
def test_decode_steps_take_the_packed_attention(reference_gemm, monkeypatch, fuse_layers):
    """Over the static cache every decode step's attention is _decode_attention (one call per
    layer and step, batch 1 and 2, fused layers or fused projections alone), the prompt's is
    transformers'; a dynamic cache without a mask keeps transformers' path."""
    model, _ = quantized("llama", fuse_layers=fuse_layers)
    calls = []
    real = blocks._decode_attention
    monkeypatch.setattr(blocks, "_decode_attention", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    with torch.no_grad():
        for batch in (1, 2):
            calls.clear()
            model.generate(_ids(batch), max_new_tokens=4, do_sample=False, cache_implementation="static")
            assert calls == [batch] * (2 * 3), "two layers, three decode steps"
        calls.clear()
        model.generate(_ids(1), max_new_tokens=3, do_sample=False, cache_implementation="dynamic")
    assert not calls


def test_packed_attention_refuses_what_it_does_not_compute():
    """Several query tokens, no mask, a mask per query row or of another length, attention
    weights asked for, or a soft cap: transformers' function runs."""
    attn = torch.nn.Module().eval()
    attn.heads, attn.kv_heads, attn.attention_dropout = 4, 2, 0.0
    q, keys = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 16, 8)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    assert blocks._packs_decode(attn, q.shape, keys, mask, {})
    assert not blocks._packs_decode(attn, (1, 4, 3, 8), keys, torch.ones(1, 1, 3, 16, dtype=torch.bool), {})
    assert not blocks._packs_decode(attn, q.shape, keys, None, {})
    assert not blocks._packs_decode(attn, q.shape, keys, torch.ones(1, 1, 1, 12, dtype=torch.bool), {})
    assert not blocks._packs_decode(attn, q.shape, keys, torch.ones(1, 4, 1, 16, dtype=torch.bool), {})
    assert not blocks._packs_decode(attn, q.shape, keys, mask, {"output_attentions": True})
    assert not blocks._packs_decode(attn, q.shape, keys, mask, {"softcap": 30.0})


def test_quantize_model_with_fp8_activations():
    """act_format="fp8": every QuantLinear takes e4m3 activations, the fused gate/up (the gated
    e4m3 kernel) included; with 4-bit weights none keeps bf16 ones."""
    model, summary = quantized("llama", act_format="fp8")
    formats = {n: m.act_format for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(formats) == 8 and set(formats.values()) == {"fp8"}, formats
    assert not summary.bf16_activations and "bf16 activations" not in str(summary)
    # per layer: the seven projections all take e4m3 activations
    plain, plain_summary = quantized("llama", act_format="fp8", fuse_projections=False)
    assert {m.act_format for m in plain.modules() if isinstance(m, QuantLinear)} == {"fp8"}
    assert not plain_summary.bf16_activations
    # the default is today's exact activations
    exact, exact_summary = quantized("llama")
    assert {m.act_format for m in exact.modules() if isinstance(m, QuantLinear)} == {"bf16"}
    assert not exact_summary.bf16_activations


@pytest.mark.parametrize("kw, words", [(dict(act_format="fp16"), "act_format must be one of"),
                                       (dict(act_format="fp8", bits=8), "takes u4, s4, u2 and s2"),
                                       (dict(act_format="e4m3"), "act_format must be one of")])
def test_quantize_model_refuses_an_act_format_before_touching_the_model(kw, words):
    model = tiny_model("llama")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=words):
        mixgemm.nn.quantize_model(model, **{"group_size": 64, "progress": False, **kw})
    assert {n: type(m) for n, m in model.named_modules()} == before


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_fp8_activations_change_the_logits_by_the_e4m3_rounding(reference_gemm, fuse_layers):
    """On the reference product: the e4m3 model's logits differ from the exact-activation model's
    (the activations are rounded), by a few percent (3 mantissa bits, a scale per token), and its
    greedy tokens follow the same path over most steps."""
    exact, _ = quantized("llama", fuse_layers=fuse_layers)
    e4m3, _ = quantized("llama", fuse_layers=fuse_layers, act_format="fp8")
    ids = _ids(batch=2)
    with torch.no_grad():
        a, b = exact(ids).logits.double(), e4m3(ids).logits.double()
    err = ((b - a).norm() / a.norm()).item()
    assert 1e-3 < err < 0.1, err
    assert (a.argmax(-1) == b.argmax(-1)).double().mean() >= 0.75


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static",
                              output_scores=True, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_static_cache_tensors_are_reused_across_generate_calls(reference_gemm, fuse_layers):
    """Each generate() call makes a new static cache; its layers take the previous call's tensors
    (fixed addresses for the CUDA-graph trees) reset to zeros: garbage left in them changes
    nothing, and the tokens and scores are those of the first call."""
    model, _ = quantized("llama", fuse_layers=fuse_layers)
    ids = _ids(1)
    first = _generate(model, ids)
    kept = [(layer.keys, layer.values) for layer in first.past_key_values.layers]
    want_seq, want_scores = first.sequences, first.scores
    del first
    for keys, values in kept:            # what a stale slot could hold
        keys.fill_(float("nan"))
        values.fill_(float("nan"))
    second = _generate(model, ids)
    for (keys, values), layer in zip(kept, second.past_key_values.layers):
        assert layer.keys is keys and layer.values is values
    assert torch.equal(second.sequences, want_seq)
    for a, b in zip(second.scores, want_scores):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_live_cache_keeps_its_tensors(reference_gemm):
    """A cache still referenced (a returned past_key_values, kept for the next turn) is never
    handed to another call: the next call allocates its own, and the kept cache is unchanged."""
    model, _ = quantized("llama", fuse_layers=True)
    held = _generate(model, _ids(1))
    snapshot = [layer.keys.clone() for layer in held.past_key_values.layers]
    other = _generate(model, _ids(1, seed=7))
    pairs = list(zip(held.past_key_values.layers, other.past_key_values.layers))
    assert all(a.keys.data_ptr() != b.keys.data_ptr() for a, b in pairs)
    assert all(torch.equal(a.keys, before) for a, before in zip(held.past_key_values.layers, snapshot))
    del pairs
    mine = [layer.keys for layer in other.past_key_values.layers]
    del other                            # the store now keeps the second call's tensors
    third = _generate(model, _ids(1))
    assert all(layer.keys is keys for layer, keys in zip(third.past_key_values.layers, mine))
    assert all(torch.equal(a.keys, before) for a, before in zip(held.past_key_values.layers, snapshot))


def test_release_kv_storage_frees_the_kept_tensors(reference_gemm):
    import copy
    import pickle

    model, _ = quantized("llama", fuse_layers=True)
    out = _generate(model, _ids(1))
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):   # copies start empty
        assert mixgemm.nn.release_kv_storage(twin) == 0
    keys = out.past_key_values.layers[0].keys
    nbytes = sum(layer.keys.nbytes + layer.values.nbytes + layer.cumulative_length.nbytes
                 for layer in out.past_key_values.layers)
    del out
    assert mixgemm.nn.release_kv_storage(model) == nbytes
    assert mixgemm.nn.release_kv_storage(model) == 0
    again = _generate(model, _ids(1))
    assert again.past_key_values.layers[0].keys is not keys


def _shapes_backend(frames: list):
    """A torch.compile backend that keeps the graph and returns outputs of its traced shapes
    (the graph never runs: the GEMM op has no CPU kernel)."""
    def backend(gm, example_inputs):
        frames.append(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        values = [torch.zeros(a.meta["example_value"].shape, dtype=a.meta["example_value"].dtype)
                  if isinstance(a, torch.fx.Node) else a for a in out.args[0]]
        return lambda *args: values
    return backend


def test_fused_models_compile_their_decode_step_without_module_guards():
    """fuse_layers=True gives generate() a compile config with CUDA-graph trees and the module
    guard filter (unless the model has one); the filter drops the guards on module internals but
    keeps the inputs', `training`, `act_format` and the attention backend's: a compiled forward is
    not recompiled for new inputs, and is when a layer's act_format or the backend changes."""
    from mixgemm.nn import guards

    model, _ = quantized("llama", fuse_layers=True)
    cc = model.generation_config.compile_config
    assert cc.mode is None and cc.options == {"triton.cudagraphs": True, "guard_filter_fn": guards.module_guard_filter}
    mine = transformers.CompileConfig(fullgraph=True)
    other = tiny_model("llama")
    other.generation_config.compile_config = mine
    mixgemm.nn.quantize_model(other, bits=4, group_size=64, progress=False, dtype=torch.float16, fuse_layers=True)
    assert other.generation_config.compile_config is mine

    kept, frames = [], []

    def spy(entries):
        keep = guards.module_guard_filter(entries)
        kept.append(([e.name for e, k in zip(entries, keep) if k], len(entries)))
        return keep

    torch._dynamo.reset()
    step = torch.compile(model.__call__, backend=_shapes_backend(frames), dynamic=False,
                         options={"guard_filter_fn": spy})
    with torch.no_grad():
        step(input_ids=_ids(1, 5), use_cache=False)
        step(input_ids=_ids(1, 5, seed=3), use_cache=False)
        assert len(frames) == 1
        names, total = kept[-1]
        assert len(names) < total / 2, (len(names), total)
        assert any(n.endswith("['act_format']") or n.endswith(".act_format") for n in names)
        assert any(n.endswith(".training") for n in names)
        assert any(n.endswith("._attn_implementation_internal") for n in names)
        assert not any("_buffers" in n or "_parameters" in n for n in names), "module tensors are not guarded"
        model.model.layers[0].mlp.down_proj.act_format = "fp8"
        step(input_ids=_ids(1, 5), use_cache=False)
        assert len(frames) == 2, "the changed act_format recompiles"
        model.set_attn_implementation("eager")
        step(input_ids=_ids(1, 5), use_cache=False)
    assert len(frames) == 3, "the changed attention backend recompiles"
    torch._dynamo.reset()


@pytest.mark.parametrize("padded", [False, True])
def test_a_compiled_decode_step_takes_the_fused_rotary_path_where_positions_are_slots(monkeypatch, padded):
    """generate()'s decode step traced by torch.compile after an eager prompt, batch 2: without
    padding it writes the cache through the rotary_kv_cache op (one per layer), with a left-padded
    sequence through transformers' cache.update."""
    model, _ = quantized("llama", fuse_layers=True)
    ids = _ids(2)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    monkeypatch.setattr(QuantLinear, "forward", reference_forward)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, disable_compile=True)
    monkeypatch.undo()                   # traced: the GEMM op (its fake kernel gives the shapes)
    hook.remove()
    frames = []
    torch._dynamo.reset()
    step = torch.compile(model.__call__, backend=_shapes_backend(frames), fullgraph=True, dynamic=False)
    with torch.no_grad():
        step(**seen[-1])
    ops = [str(n.target) for n in frames[0].graph.nodes if n.op == "call_function"]
    assert ops.count("mixgemm.rotary_kv_cache") == (0 if padded else 2), ops
    torch._dynamo.reset()
