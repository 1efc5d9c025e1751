"""Every mixgemm op under torch.compile in every mode, CUDA-graph trees included, against eager.

``mode="reduce-overhead"`` records each shape's graph in CUDA-graph trees, which refuse a graph
that leaves anything allocated in their memory pool besides its outputs: the GEMMs' workspaces
and stream-K locks must come from outside the pool (mixgemm.dispatch.plans.StreamArenas). A module that
mixes every op runs at token counts from 1 to 8192 in turn, each replayed with new data, and its
outputs (each an op's own output) must equal eager's bit for bit. A transformers model, with
fused projections and with fused layers, generates the same tokens compiled as eager.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixgemm
from mixgemm.nn import QuantLinear, QuantMoE

pytestmark = pytest.mark.gpu

H, I, HEADS, KV, D, EXPERTS, TOPK = 1024, 2048, 8, 2, 128, 8, 2
CACHE = 8192 + 64
TOKENS = (1, 16, 64, 300, 2048, 8192, 1)


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)


class Mix(nn.Module):
    """rms_norm with its residual, a QuantLinear qkv, rotary_kv_cache into a static cache,
    mixgemm.gemm of a PackedWeight with swiglu, a QuantLinear down, QuantMoE: each op's output
    returned as it is."""

    def __init__(self, dev):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(0)

        def linear(n, k):
            lin = nn.Linear(k, n, bias=False)
            lin.weight.data = torch.randn(n, k, generator=g) * 0.02
            return lin.to(dev, torch.bfloat16)

        self.norm = nn.Parameter(torch.rand(H, generator=g).to(dev, torch.bfloat16) + 0.5, requires_grad=False)
        self.qkv = QuantLinear.from_linear(linear((HEADS + 2 * KV) * D, H), bits=4, group_size=128)
        gate, up = linear(I, H), linear(I, H)
        self.gate_up = QuantLinear.from_gate_up(gate, up, bits=2, group_size=64).packed
        self.down = QuantLinear.from_linear(linear(H, I), bits=8, group_size=128, symmetric=True)
        experts = []
        for _ in range(EXPERTS):
            e = _Experts()
            for p in e.parameters():
                p.data = torch.randn(p.shape, generator=g) * 0.02
            experts.append(e.to(dev, torch.bfloat16))
        self.moe = QuantMoE.from_mlps(experts, bits=4, group_size=128)
        pos = torch.arange(CACHE, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(D // 2) / (D // 2))
        angles = torch.cat([pos, pos], dim=-1)
        self.register_buffer("cos", angles.cos().to(dev, torch.bfloat16))
        self.register_buffer("sin", angles.sin().to(dev, torch.bfloat16))
        self.register_buffer("k_cache", torch.zeros(1, KV, CACHE, D, device=dev, dtype=torch.bfloat16))
        self.register_buffer("v_cache", torch.zeros(1, KV, CACHE, D, device=dev, dtype=torch.bfloat16))

    def forward(self, x, residual, positions, topk_weights, topk_ids):
        h, s = mixgemm.rms_norm(x, self.norm, 1e-5, residual=residual)
        qkv = self.qkv(h)
        q = mixgemm.rotary_kv_cache(qkv, self.cos, self.sin, self.k_cache, self.v_cache, positions, HEADS, KV)
        act = mixgemm.gemm(h, self.gate_up, activation="swiglu")
        y = self.down(act)
        m = self.moe(h[0], topk_weights, topk_ids)
        return h, s, qkv, q, act, y, m


def _inputs(t: int, dev, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(1, t, H, device=dev, dtype=torch.bfloat16, generator=g)
    residual = torch.randn(1, t, H, device=dev, dtype=torch.bfloat16, generator=g)
    positions = torch.arange(t, device=dev)[None] + seed % 50
    logits = torch.randn(t, EXPERTS, device=dev, generator=g)
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    return x, residual, positions, topk_weights.to(torch.bfloat16), topk_ids.to(torch.int32)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_every_op_compiled_equals_eager_at_every_token_count(requires_gpu, mode):
    dev = requires_gpu
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    eager = Mix(dev)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, mode=mode, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for step, t in enumerate(TOKENS):
            for replay in range(3):                  # each shape recorded, then replayed with new data
                args = _inputs(t, dev, seed=100 * step + replay)
                if mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                got = [o.clone() for o in compiled(*args)]
                want = eager(*args)
                for name, a, b in zip(("h", "s", "qkv", "q", "act", "y", "moe"), got, want):
                    assert torch.equal(a, b), f"{mode} T={t} replay {replay}: {name} differs"
                assert torch.equal(compiled_module.k_cache, eager.k_cache), f"{mode} T={t}: k_cache"
                assert torch.equal(compiled_module.v_cache, eager.v_cache), f"{mode} T={t}: v_cache"
    if mode == "reduce-overhead":
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def _llama(dev, layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=128, num_hidden_layers=layers,
                                      vocab_size=4096, max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                         attn_implementation="sdpa").to(dev).eval()


def assert_same_greedy(got, want, prompt: int, rtol: float = 2e-2) -> None:
    """Two greedy generate() results (with scores) of one model, compiled and eager: the scores
    agree (relative L2 below ``rtol``) at every step up to the first token that differs, and
    there the eager top-2 gap is within the scores' difference (a near tie that rounding decides:
    compiled graphs fuse the torch ops around the GEMMs in other orders), never a wrong logit."""
    for b in range(want.sequences.shape[0]):
        g, w = got.sequences[b, prompt:], want.sequences[b, prompt:]
        differ = (g != w).nonzero()
        last = int(differ[0]) if len(differ) else len(w) - 1
        for t in range(last + 1):
            a, r = got.scores[t][b].double(), want.scores[t][b].double()
            finite = r.isfinite()    # (the logits processors mask tokens with -inf: EOS before min_new_tokens)
            assert torch.equal(finite, a.isfinite()), f"row {b} step {t}: masked tokens differ"
            a, r = a[finite], r[finite]
            assert ((a - r).norm() / r.norm()).item() < rtol, f"row {b} step {t}: scores differ"
        if len(differ):
            r = want.scores[last][b].double()
            finite = r.isfinite()
            top = r[finite].topk(2).values
            err = (got.scores[last][b].double()[finite] - r[finite]).abs().max()
            assert (top[0] - top[1]).item() <= 2 * err.item(), f"row {b} step {last}: a token flip that is no tie"


@pytest.mark.parametrize("fuse_layers, config", [(False, "reduce-overhead"), (True, "reduce-overhead"),
                                                 (True, "the model's")])
def test_a_transformers_model_generates_the_eager_tokens_under_reduce_overhead(requires_gpu, fuse_layers, config):
    """generate() with a static cache: eager, and generate()'s own compile with
    ``mode="reduce-overhead", fullgraph=True`` or the fused model's own compile config
    (CUDA-graph trees without module guards): the same greedy tokens up to near ties, batch 1
    and 4 (:func:`assert_same_greedy`), and the second compiled call's cache in the first's
    tensors (the graphs replay for them)."""
    from transformers import CompileConfig

    dev = requires_gpu
    torch._dynamo.reset()
    model = _llama(dev)
    mixgemm.nn.quantize_model(model, bits=4, group_size=128, progress=False, fuse_layers=fuse_layers)
    for batch in (1, 4):
        ids = torch.randint(0, 4096, (batch, 37), device=dev, generator=torch.Generator(device=dev).manual_seed(batch))
        kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, cache_implementation="static",
                  output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            want = model.generate(ids, disable_compile=True, **kw)
            extra = {} if config == "the model's" else {"compile_config": CompileConfig(fullgraph=True,
                                                                                         mode="reduce-overhead")}
            keys = []
            for _ in range(2):                   # the second call replays the recorded graphs
                got = model.generate(ids, **extra, **kw)
                assert_same_greedy(got, want, ids.shape[1])
                keys.append(got.past_key_values.layers[0].keys.data_ptr())
                del got
            assert keys[0] == keys[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 8, 64), (32, 8, 128), (16, 2, 256)])
def test_flash_decode_attention_reads_only_the_filled_slots(requires_gpu, dtype, heads, kv_heads, head_dim):
    """blocks._flash_decode_attention over a 300-slot cache whose slots past the position hold
    large values: within twice the masked SDPA's (blocks._decode_attention) error of float64 on
    the filled slots, at the first, a middle and the last position (one slot too many or too few
    is far outside that)."""
    from types import SimpleNamespace

    from mixgemm.nn import blocks

    dev = requires_gpu
    slots = 300
    g = torch.Generator(device=dev).manual_seed(heads + head_dim)
    attn = SimpleNamespace(heads=heads, kv_heads=kv_heads, head_dim=head_dim, scaling=head_dim ** -0.5, layer_idx=0)
    for pos in (0, 137, slots - 1):
        keys = torch.randn(1, kv_heads, slots, head_dim, device=dev, generator=g).to(dtype)
        values = torch.randn(1, kv_heads, slots, head_dim, device=dev, generator=g).to(dtype)
        keys[:, :, pos + 1:] = 8.0                 # what an empty slot must not contribute
        values[:, :, pos + 1:] = 8.0
        q = torch.randn(1, heads, 1, head_dim, device=dev, generator=g).to(dtype)
        mask = (torch.arange(slots, device=dev) <= pos).view(1, 1, 1, slots)
        position = torch.tensor([[pos]], device=dev)
        got = blocks._flash_decode_attention(attn, q, keys, values, SimpleNamespace(), position)
        want = blocks._decode_attention(attn, q, keys, values, mask)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double().reshape(1, kv_heads, heads // kv_heads, head_dim), keys[:, :, :pos + 1].double(),
            values[:, :, :pos + 1].double(), scale=attn.scaling).reshape(1, heads, 1, head_dim).transpose(1, 2)
        assert got.shape == want.shape == (1, 1, heads, head_dim) and got.dtype == dtype
        err, err_sdpa = (got.double() - ref).abs().max().item(), (want.double() - ref).abs().max().item()
        assert err <= 2 * err_sdpa + 1e-2, (pos, err, err_sdpa)


def test_one_sequence_decodes_through_flash_attention_over_the_filled_slots(requires_gpu, monkeypatch):
    """fuse_layers=True, one sequence, eagerly: every decode step of every layer attends through
    FlashAttention over the filled slots (blocks._flash_decode_attention), with the greedy tokens
    and scores of the masked SDPA over the whole cache (:func:`assert_same_greedy`); a
    left-padded sequence keeps the masked path, and so does the compiled step (the same tokens
    up to near ties)."""
    from transformers import CompileConfig

    from mixgemm.nn import blocks

    dev = requires_gpu
    torch._dynamo.reset()
    model = _llama(dev)
    mixgemm.nn.quantize_model(model, bits=4, group_size=128, progress=False, fuse_layers=True)
    for layer in model.model.layers:
        layer.one_call = False     # (part by part: the attention's Python entry is counted)
    ids = torch.randint(0, 4096, (1, 37), device=dev, generator=torch.Generator(device=dev).manual_seed(7))
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, cache_implementation="static",
              output_scores=True, return_dict_in_generate=True)
    calls = []
    real = blocks._flash_decode_attention
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(blocks, "_flash_decode_attention", lambda *a: calls.append(1) or real(*a))
            flash = model.generate(ids, disable_compile=True, **kw)
            assert len(calls) == 2 * 23, "two layers, 23 decode steps"
            calls.clear()
            padded = torch.ones_like(ids)
            padded[0, :4] = 0
            model.generate(ids, attention_mask=padded, disable_compile=True, **kw)
            assert not calls
        with monkeypatch.context() as m:
            m.setattr(blocks, "_flash_decodes", lambda *a: False)
            masked = model.generate(ids, disable_compile=True, **kw)
        assert_same_greedy(flash, masked, ids.shape[1])
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        compiled = model.generate(ids, compile_config=CompileConfig(fullgraph=True, backend=backend, mode=None), **kw)
        assert graphs and not any("_flash_attention_forward" in str(gm.graph) for gm in graphs)
        assert_same_greedy(compiled, flash, ids.shape[1])
        torch._dynamo.reset()
        again = model.generate(ids, **kw)                    # the model's own config: CUDA-graph trees
        assert_same_greedy(again, flash, ids.shape[1])


@pytest.mark.parametrize("batch", [1, 2])
def test_an_eager_decode_step_is_one_call_with_the_part_by_part_results(requires_gpu, batch):
    """fuse_layers=True, eagerly: once the prompt has loaded the torch operator library, every
    decode step of every layer is one call that the C++ kernel of mixgemm::decode_layer takes
    (FlashAttention for one sequence, the masked SDPA for two), with the tokens and scores of the
    same model run part by part (one_call off), bit for bit; and a step captured in a CUDA graph
    replays the eager step's logits."""
    from mixgemm.bench.generate_run import logits_of, record_decode_step
    from mixgemm.bench.run_support import cuda_capture
    from mixgemm.dispatch import plans

    dev = requires_gpu
    model = _llama(dev)
    mixgemm.nn.quantize_model(model, bits=4, group_size=128, progress=False, fuse_layers=True)
    layers = list(model.model.layers)
    ids = torch.randint(0, 4096, (batch, 37), device=dev, generator=torch.Generator(device=dev).manual_seed(9))
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, output_scores=True,
              return_dict_in_generate=True, disable_compile=True)

    def run(one_call):
        for layer in layers:
            layer.one_call = one_call
        return model.generate(ids, **kw)

    with torch.no_grad():
        run(True)                                  # the prompt loads the library; the plans are made
        lib = plans.OPERATORS.lib
        assert lib is not None
        before = lib.layer_calls()
        one = run(True)
        assert lib.layer_calls() - before == len(layers) * 23, "every layer of the 23 decode steps"
        parts = run(False)
        assert lib.layer_calls() - before == len(layers) * 23
        assert torch.equal(one.sequences, parts.sequences)
        for a, b in zip(one.scores, parts.scores):
            assert torch.equal(a, b)
        # one decode step as generate() called it, eagerly and captured in a CUDA graph
        for layer in layers:
            layer.one_call = True
        step = record_decode_step(model, ids, 8, 0)
        calls = lib.layer_calls()
        eager = logits_of(step.call(model)()).clone()
        assert lib.layer_calls() - calls == len(layers)
        graph, out = cuda_capture(step.call(model))
        assert lib.layer_calls() - calls == 3 * len(layers), "the warm-up and the capture"
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(logits_of(out), eager)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_blocks_on_the_kernels_match_per_layer_quantization(requires_gpu, family):
    """The fused projections and layers of tests/nn/test_blocks.py on the GPU kernels: logits within
    the GEMM tolerance of the per-layer model's, and greedy tokens over two turns."""
    from tiny_models import tiny_model

    dev = requires_gpu
    models = {}
    for name, kw in (("plain", dict(fuse_projections=False)), ("fused", {}), ("layers", dict(fuse_layers=True))):
        m = tiny_model(family, layers=2).to(dev, torch.bfloat16)
        mixgemm.nn.quantize_model(m, bits=4, group_size=64, progress=False, **kw)
        models[name] = m
    ids = torch.randint(0, 160, (2, 21), device=dev, generator=torch.Generator(device=dev).manual_seed(3))
    with torch.no_grad():
        ref = models["plain"](ids).logits.double()
        for name in ("fused", "layers"):
            got = models[name](ids).logits.double()
            assert ((got - ref).norm() / ref.norm()).item() < 2e-2, name
        one = ids[:1]
        for turn in range(2):
            kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", disable_compile=True)
            want = models["plain"].generate(one, **kw)
            for name in ("fused", "layers"):
                got = models[name].generate(one, **kw)
                agree = (got[0, one.shape[1]:] == want[0, one.shape[1]:]).float().mean().item()
                assert agree >= 0.75, (name, turn, agree)
            one = torch.cat([want, ids[:1, :5]], dim=1)
