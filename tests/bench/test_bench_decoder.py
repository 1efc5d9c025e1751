"""The decoder layer of ``mixgemm bench --model`` (mixgemm.bench.decoder) on the CPU: the presets'
shapes against the models' configs, and the layer math (RMSNorm, rotary, grouped-query attention
over the KV cache, causal prefill, the cache's write position, SwiGLU, residuals) against a
straightforward loop-based float64 implementation written from the models' definitions."""
from __future__ import annotations

import math

import pytest
import torch

from mixgemm.bench.decoder import (PRESETS, DecoderStack, DenseProjections, LayerState, ModelPreset, Rotary,
                                   attention, decoder_layer, dense_projections, float_weight, layer_state, rms_norm)

# ----------------------------------------------------------------------------------- presets
# (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, q/k/v bias)
# from each model's config.json on the Hugging Face Hub.
CONFIGS = {
    "llama3-8b": (4096, 14336, 32, 8, 128, False),
    "llama3-70b": (8192, 28672, 64, 8, 128, False),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, True),
    "qwen2.5-32b": (5120, 27648, 40, 8, 128, True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_presets_match_the_models_configs(name):
    p = PRESETS[name]
    assert (p.hidden, p.intermediate, p.heads, p.kv_heads, p.head_dim, p.qkv_bias) == CONFIGS[name]
    assert p.head_dim == p.hidden // p.heads            # all four: head_dim = hidden / heads
    assert p.q_size == p.hidden
    shapes = p.projection_shapes()
    assert shapes["qkv"] == ((p.heads + 2 * p.kv_heads) * p.head_dim, p.hidden)
    assert shapes["o"] == (p.hidden, p.hidden)
    assert shapes["gate_up"] == (2 * p.intermediate, p.hidden)
    assert shapes["down"] == (p.hidden, p.intermediate)
    for n, k in shapes.values():   # every linear fits mixgemm (N % 16, K % 64, g128) and tinygemm (K % 128)
        assert n % 16 == 0 and k % 128 == 0


def test_preset_literal_shapes():
    assert PRESETS["llama3-8b"].projection_shapes() == {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    assert PRESETS["llama3-70b"].projection_shapes()["qkv"] == (10240, 8192)
    assert PRESETS["qwen2.5-7b"].projection_shapes()["qkv"] == (4608, 3584)
    assert PRESETS["qwen2.5-32b"].projection_shapes()["gate_up"] == (55296, 5120)
    assert PRESETS["qwen2.5-7b"].group == 7 and PRESETS["llama3-70b"].group == 8


def test_preset_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="multiple"):
        ModelPreset("x", "", 64, 128, 3, 2, 16, False, 1e4, 1e-5, 1)
    with pytest.raises(ValueError, match="even"):
        ModelPreset("x", "", 63, 128, 3, 3, 21, False, 1e4, 1e-5, 1)


# ------------------------------------------------------------------------- a loop reference
TINY = ModelPreset("tiny", "test", hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8, qkv_bias=True,
                   rope_theta=10000.0, rms_eps=1e-6, model_layers=2)


def ref_rms(v, w, eps):
    return w * (v / math.sqrt(float((v * v).mean()) + eps))


def ref_rope(v, position, theta):
    """Turn each pair (v[i], v[i + D/2]) by position * theta^(-2i/D)."""
    d = v.shape[0]
    out = v.clone()
    for i in range(d // 2):
        angle = position * theta ** (-2.0 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = v[i] * c - v[i + d // 2] * s
        out[i + d // 2] = v[i + d // 2] * c + v[i] * s
    return out


def ref_layer(x, pos, p, w, state):
    """One layer, token by token, head by head, in float64: returns the output and writes the
    cache in place."""
    b, t, _ = x.shape
    d, group = p.head_dim, p.heads // p.kv_heads
    k_cache, v_cache = state.k_cache, state.v_cache
    qs = torch.zeros(b, t, p.heads, d, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            h = ref_rms(x[bi, ti], state.attn_norm, p.rms_eps)
            qkv = w["qkv"] @ h + (w["bias"] if w["bias"] is not None else 0)
            q, k, v = qkv[:p.q_size], qkv[p.q_size:p.q_size + p.kv_size], qkv[p.q_size + p.kv_size:]
            for hh in range(p.heads):
                qs[bi, ti, hh] = ref_rope(q[hh * d:(hh + 1) * d], pos + ti, p.rope_theta)
            for kh in range(p.kv_heads):
                k_cache[bi, kh, pos + ti] = ref_rope(k[kh * d:(kh + 1) * d], pos + ti, p.rope_theta)
                v_cache[bi, kh, pos + ti] = v[kh * d:(kh + 1) * d]
    out = torch.zeros_like(x)
    for bi in range(b):
        for ti in range(t):
            heads = []
            for hh in range(p.heads):
                kh = hh // group                                     # the models' repeat_kv
                keys = k_cache[bi, kh, :pos + ti + 1]                # causal: positions <= its own
                scores = keys @ qs[bi, ti, hh] / math.sqrt(d)
                weights = torch.softmax(scores, dim=0)
                heads.append(weights @ v_cache[bi, kh, :pos + ti + 1])
            h1 = x[bi, ti] + w["o"] @ torch.cat(heads)
            h2 = ref_rms(h1, state.mlp_norm, p.rms_eps)
            gate, up = w["gate_up"][:p.intermediate] @ h2, w["gate_up"][p.intermediate:] @ h2
            out[bi, ti] = h1 + w["down"] @ (gate * torch.sigmoid(gate) * up)
    return out


def make_layer(p=TINY, layer=0, batch=3, length=8, dtype=torch.float64, seed=1):
    proj = dense_projections(p, layer, seed, torch.device("cpu"), dtype)
    state = layer_state(p, layer, seed, batch, length, torch.device("cpu"), dtype)
    return proj, state


def weights_of(proj):
    return {"qkv": proj.w_qkv, "o": proj.w_o, "gate_up": proj.w_gate_up, "down": proj.w_down, "bias": proj.b_qkv}


def clone_state(s):
    return LayerState(s.attn_norm, s.mlp_norm, s.k_cache.clone(), s.v_cache.clone())


@pytest.mark.parametrize("batch,tokens,pos", [
    (3, 1, 7),      # decode: one token after 7 cached (the folded-GQA path)
    (2, 5, 0),      # prefill from position 0 (is_causal)
    (2, 3, 5),      # a chunk after 5 cached tokens (explicit mask)
])
def test_layer_matches_the_loop_reference(batch, tokens, pos):
    proj, state = make_layer(batch=batch, length=pos + tokens)
    x = torch.randn(batch, tokens, TINY.hidden, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    rotary = Rotary(TINY.head_dim, TINY.rope_theta, pos + tokens, torch.float64)
    mine, ref = clone_state(state), clone_state(state)
    y = decoder_layer(x, pos, TINY, proj, mine, rotary)
    y_ref = ref_layer(x, pos, TINY, weights_of(proj), ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mine.k_cache, ref.k_cache, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mine.v_cache, ref.v_cache, rtol=1e-10, atol=1e-10)
    # the new keys and values went to positions pos .. pos + T - 1 and nowhere else
    assert torch.equal(mine.k_cache[:, :, :pos], state.k_cache[:, :, :pos])
    assert not torch.equal(mine.k_cache[:, :, pos:], state.k_cache[:, :, pos:])
    # the cached values are read: other values at the old positions give another output
    if pos:
        other = clone_state(state)
        other.v_cache[:, :, :pos] += 1.0
        assert not torch.allclose(decoder_layer(x, pos, TINY, proj, other, rotary), y)


def test_only_the_first_sequences_of_a_larger_cache_are_used():
    proj, state = make_layer(batch=4, length=4)
    x = torch.randn(2, 1, TINY.hidden, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rotary = Rotary(TINY.head_dim, TINY.rope_theta, 4, torch.float64)
    mine = clone_state(state)
    decoder_layer(x, 3, TINY, proj, mine, rotary)
    assert torch.equal(mine.k_cache[2:], state.k_cache[2:])
    assert not torch.equal(mine.k_cache[:2, :, 3], state.k_cache[:2, :, 3])


def test_gqa_maps_query_heads_to_kv_heads_like_repeat_kv():
    """Head h reads KV head h // group: with a cache whose KV head 1 holds huge values, only the
    query heads of the second half see them."""
    b, heads, kv, d, length = 1, 4, 2, 8, 6
    q = torch.randn(b, heads, 1, d, dtype=torch.float64)
    keys = torch.randn(b, kv, length, d, dtype=torch.float64)
    values = torch.zeros(b, kv, length, d, dtype=torch.float64)
    values[:, 1] = 100.0
    out = attention(q, keys, values, length - 1)
    assert torch.all(out[:, :2].abs() < 1e-9) and torch.allclose(out[:, 2:], torch.full_like(out[:, 2:], 100.0))


def test_prefill_is_causal():
    """The first token's output must not change when later tokens change."""
    proj, state = make_layer(batch=1, length=4)
    rotary = Rotary(TINY.head_dim, TINY.rope_theta, 4, torch.float64)
    x = torch.randn(1, 4, TINY.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x2 = x.clone()
    x2[:, 1:] += 1.0
    y = decoder_layer(x, 0, TINY, proj, clone_state(state), rotary)
    y2 = decoder_layer(x2, 0, TINY, proj, clone_state(state), rotary)
    torch.testing.assert_close(y[:, 0], y2[:, 0])
    assert not torch.allclose(y[:, 1:], y2[:, 1:])


def test_rotary_and_rms_norm_pieces():
    rot = Rotary(8, 10000.0, 16, torch.float64)
    v = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    torch.testing.assert_close(rot(v, 0), v)                         # position 0: no turn
    turned = rot(v, 5)
    torch.testing.assert_close(turned[0, 0, 0], ref_rope(v[0, 0, 0], 5, 10000.0))
    torch.testing.assert_close(turned.norm(), v.norm())              # a rotation
    with pytest.raises(ValueError, match="exceed"):
        rot(v, 16)
    x = torch.randn(3, 32, dtype=torch.float64)
    w = torch.rand(32, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w, 1e-6)[1], ref_rms(x[1], w, 1e-6))


def test_stack_of_two_layers_and_bf16():
    """A two-layer stack equals two reference layers in float64; the same stack in bf16 stays
    within bf16's rounding of it."""
    p = TINY
    projs, states = zip(*(make_layer(p, layer=i, batch=2, length=6) for i in range(2)))
    x = torch.randn(2, 1, p.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    rotary = Rotary(p.head_dim, p.rope_theta, 6, torch.float64)
    y = DecoderStack(p, projs, [clone_state(s) for s in states], rotary)(x, 5)
    ref_states = [clone_state(s) for s in states]
    y_ref = ref_layer(ref_layer(x, 5, p, weights_of(projs[0]), ref_states[0]), 5, p, weights_of(projs[1]),
                      ref_states[1])
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)

    def to_bf16(proj):
        return DenseProjections(*(t.to(torch.bfloat16) for t in (proj.w_qkv, proj.w_o, proj.w_gate_up, proj.w_down,
                                                                  proj.b_qkv)))

    bf_states = [LayerState(*(t.to(torch.bfloat16) for t in (s.attn_norm, s.mlp_norm, s.k_cache, s.v_cache)))
                 for s in states]
    y16 = DecoderStack(p, [to_bf16(q) for q in projs], bf_states,
                       Rotary(p.head_dim, p.rope_theta, 6, torch.bfloat16))(x.to(torch.bfloat16), 5)
    assert y16.dtype == torch.bfloat16
    assert float((y16.double() - y_ref).norm() / (y_ref - x).norm()) < 5e-2


def test_random_weights_are_reproducible_and_distinct():
    dev = torch.device("cpu")
    a = float_weight(TINY, "q", 0, 7, dev)
    assert torch.equal(a, float_weight(TINY, "q", 0, 7, dev))
    assert not torch.equal(a, float_weight(TINY, "q", 1, 7, dev))           # another layer
    assert not torch.equal(float_weight(TINY, "gate", 0, 7, dev)[:4], float_weight(TINY, "up", 0, 7, dev)[:4])
    assert abs(float(float_weight(PRESETS["llama3-8b"], "o", 0, 0, dev).std()) - 0.02) < 1e-3
    proj = dense_projections(TINY, 0, 7, dev)
    assert proj.w_qkv.dtype == torch.bfloat16 and proj.w_qkv.shape == (TINY.qkv_rows, TINY.hidden)
    assert torch.equal(proj.w_gate_up[:TINY.intermediate], float_weight(TINY, "gate", 0, 7, dev).to(torch.bfloat16))
    assert proj.b_qkv is not None and proj.b_qkv.shape == (TINY.qkv_rows,)
