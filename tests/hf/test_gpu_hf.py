"""mixgemm.hf.from_pretrained on the GPU: the real GEMMs' logits against the same model in float32
on the dequantized weights, generate() in eager mode and with a static cache under torch.compile,
and what loading allocates.

Kept small for the kernels compiled on first use: up to 32 tokens per forward (the decode
kernels), except the one test marked ``slow`` (64 tokens: the sm90 GEMM kernels).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="mixgemm.hf needs transformers (pip install 'mixgemm[hf]')")

import hf_checkpoints as hc  # noqa: E402
from mixgemm import hf  # noqa: E402
from mixgemm.errors import CheckpointError  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402

pytestmark = pytest.mark.gpu

#: formats that share kernels where they can: fp16 u4/g64 (AWQ, GPTQ v2 act-order), bf16 s4/g64
#: (compressed-tensors), bf16 u4/g64 + s8/g128 (mixgemm)
WRITERS = {
    "awq": lambda d: hc.write_awq(d),
    "gptq-v2-act-order": lambda d: hc.write_gptq(d, bits=4, group_size=64, fmt="gptq_v2", act_order=True),
    "ct-sym": lambda d: hc.write_compressed_tensors(d),
    "mixgemm": lambda d: hc.write_mixgemm(d),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _compare(model, ref, dev, ids):
    """The loaded model's logits against float32 on the dequantized weights; the same float32
    model rounded to the activation dtype (plain torch) is the yardstick."""
    reference = hc.reference_model(ref, attn_implementation="sdpa").to(dev)
    lowp = hc.reference_model(ref, attn_implementation="sdpa", dtype=ref.dtype).to(dev)
    with torch.no_grad():
        got = model(ids).logits
        want = reference(ids).logits
        base = lowp(ids).logits
    err, err_base = rel_err(got, want), rel_err(base, want)
    assert got.dtype == ref.dtype and got.shape == want.shape
    assert err < 3e-2 and err <= 2 * err_base + 2e-3, (err, err_base)
    return err, err_base


@pytest.mark.parametrize("kind", list(WRITERS))
def test_logits_match_float32_on_the_dequantized_weights(requires_gpu, tmp_path, kind):
    dev = requires_gpu
    ref = WRITERS[kind](tmp_path / kind)
    model = hf.from_pretrained(tmp_path / kind, device=dev)
    assert model.mixgemm_summary.fused and all(
        m.qdata.is_cuda for m in model.modules() if isinstance(m, QuantLinear))
    _compare(model, ref, dev, hc.input_ids(batch=2, length=12).to(dev))     # 24 tokens


@pytest.mark.slow
def test_logits_through_the_gemm_kernels(requires_gpu, tmp_path):
    dev = requires_gpu
    ref = hc.write_awq(tmp_path / "m")
    model = hf.from_pretrained(tmp_path / "m", device=dev)
    _compare(model, ref, dev, hc.input_ids(batch=4, length=16).to(dev))     # 64 tokens


def _assert_near_greedy(reference, seq: torch.Tensor, prompt: int):
    """Each generated token is the float32 reference's argmax, up to a tenth of the logits' spread
    (the quantized model computes in fp16/bf16, so near-ties may go either way)."""
    with torch.no_grad():
        logits = reference(seq).logits.double()
    for b in range(seq.shape[0]):
        for t in range(prompt - 1, seq.shape[1] - 1):
            row, tok = logits[b, t], seq[b, t + 1]
            assert row[tok] >= row.max() - 0.1 * row.std(), (b, t, float(row.max() - row[tok]))


def test_generate_eager_and_static_cache_under_torch_compile(requires_gpu, tmp_path):
    dev = requires_gpu
    # Dynamo's recompile limit counts per code object across the process: the models other tests
    # compiled in this worker (their own norms' eps, shapes) must not push this fullgraph compile past it
    torch._dynamo.reset()
    ref = hc.write_gptq(tmp_path / "m", bits=4, group_size=64, fmt="gptq_v2", act_order=True)
    model = hf.from_pretrained(tmp_path / "m", device=dev)
    reference = hc.reference_model(ref, attn_implementation="sdpa").to(dev)
    ids = hc.input_ids(batch=1, length=8, seed=5).to(dev)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)

    eager = model.generate(ids, **kw)
    assert eager.shape == (1, 16)
    _assert_near_greedy(reference, eager, 8)

    # a static cache under torch.compile, fullgraph: a counting backend proves one graph, no break
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    static = model.generate(ids, cache_implementation="static",
                            compile_config=transformers.CompileConfig(fullgraph=True, backend=backend, mode=None),
                            **kw)
    assert graphs, "generate() did not compile the decoding step"
    assert any("mixgemm.gemm" in str(gm.graph) for gm in graphs)
    _assert_near_greedy(reference, static, 8)

    # and with inductor's CUDA graphs (transformers' default compile config for a static cache)
    model2 = hf.from_pretrained(tmp_path / "m", device=dev)
    inductor = model2.generate(ids, cache_implementation="static", **kw)
    _assert_near_greedy(reference, inductor, 8)


def test_loading_allocates_only_what_the_model_keeps(requires_gpu, tmp_path):
    dev = requires_gpu
    hc.write_gptq(tmp_path / "m", bits=4, group_size=64)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model = hf.from_pretrained(tmp_path / "m", device=dev)
    after = torch.cuda.memory_allocated(dev) - base
    peak = torch.cuda.max_memory_allocated(dev) - base
    s = model.mixgemm_summary
    # no transient copy: the smallest quantized layer in fp16 alone would be 128 KiB
    assert peak - after <= 64 * 1024, (peak, after)
    tensors = len({t.data_ptr() for t in list(model.parameters()) + list(model.buffers())})
    assert s.resident_bytes <= after <= s.resident_bytes + 512 * tensors   # the allocator's rounding
    assert s.quantized_bytes * 3 < s.bf16_bytes - s.other_bytes


def test_a_bad_checkpoint_touches_no_gpu_memory(requires_gpu, tmp_path):
    dev = requires_gpu
    hc.write_awq(tmp_path / "m")
    hc.edit_config(tmp_path / "m", intermediate_size=1024)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with pytest.raises(CheckpointError, match="holds a \\[512, 256\\] weight"):
        hf.from_pretrained(tmp_path / "m", device=dev)
    assert torch.cuda.max_memory_allocated(dev) == base
