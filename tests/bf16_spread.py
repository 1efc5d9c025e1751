"""The bar of tests/formats/test_gguf_smollm2.py: a kernel path against the spread of bf16 paths.

A model's kernel path (the mixgemm kernels, or their emulation) is compared with other bf16
computations of the same weights (:mod:`linear_numerics`: ONE_ROUNDING, F_LINEAR, BF16_OPS), each
against the float32 model on those weights, over several prompts, in three ways. Why several: one
prompt's logits amplify any bf16 rounding chaotically (docs/accuracy.md: on a 5-token
prompt, equally exact bf16 paths land 2.3-4.9% from float32), so a bar on one prompt against one
path measures the prompt, not the kernels.

* layers (not chaotic; the sharp part): every QuantLinear on each prompt's own input, captured
  from the float32 model and rounded to bf16, against float32 on that input; per layer and
  token-count bucket (one decode kernel each: M <= 8, 16, 32), the median over the bucket's
  tokens of the per-token relative error. The kernel path's over the worst bf16 path's: at most
  LAYER_RATIO everywhere and LAYER_MEDIAN_RATIO in the median over layers and buckets (a kernel
  rounds no worse than a bf16 GEMM, layer by layer; the median catches a small systematic
  excess). Measured: 0.9 in the median and 1.22 at most for the kernels' two roundings.
* logits (end to end, chaotic): the kernel path's median relative error over the prompts at most
  LOGITS_MEDIAN_RATIO x the median of the worst bf16 path (the path with the largest median); on
  each prompt at most LOGITS_PROMPT_RATIO x the larger of the bf16 paths' worst error on that
  prompt and the median over prompts of that worst (a prompt on which every bf16 path happens to
  land close does not make a tiny bar).
* greedy tokens: GREEDY_TOKENS continued tokens identical to float32's on at least as many
  prompts as the least-agreeing bf16 path, minus GREEDY_SLACK.

Faults injected into the kernels' emulation show what each part catches (the test file's FAULTS):
the layers part every one, down to a scale 1% off on one of 180 layers; the end-to-end parts only
faults far outside bf16's spread.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

import torch

import linear_numerics as ln
from mixgemm.ops import dense as ops
from mixgemm.nn import QuantLinear

LAYER_RATIO, LAYER_MEDIAN_RATIO = 1.5, 1.1
LOGITS_MEDIAN_RATIO, LOGITS_PROMPT_RATIO = 1.5, 2.0
GREEDY_TOKENS, GREEDY_SLACK = 8, 1
#: the bf16 paths, by label (Numerics values)
BF16_PATHS = [p.value for p in ln.BF16_PATHS]
#: the decode kernels' token-count buckets (mixgemm.ops.dense.token_bucket 0, 1, 2)
BUCKETS = ["dec8", "dec16", "dec32"]
PAD = 2   # SmolLM2's pad token (generate wants one)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@dataclasses.dataclass
class Reference:
    """The float32 model's run over ``prompts``: logits and greedy continuation per prompt, and
    for each QuantLinear (by name) its input per prompt (rounded to bf16) with its float32 output
    on that input."""
    prompts: list
    logits: list
    continuations: list
    layers: dict      # name -> [(x bf16 [1, T, K], y float32 [1, T, N']) per prompt]


@dataclasses.dataclass
class PathFigures:
    """One path against a Reference: logits relative error and whether the greedy continuation is
    float32's, per prompt; the layers' errors ``[layers, buckets]`` (float64; see the module)."""
    logits: list
    agrees: list
    continuations: list
    layers: torch.Tensor


@dataclasses.dataclass
class Ratios:
    """A kernel path's figures over the bf16 paths', each bounded by the bar: ``layers``
    ``[layers, buckets]``; ``logits_median``; ``logits_prompts`` per prompt (over the larger of the
    prompt's worst bf16 error and the median of those); ``greedy``: the kernel's count of
    float32 continuations minus the least-agreeing bf16 path's."""
    layers: torch.Tensor
    logits_median: float
    logits_prompts: list
    greedy: int


def _ids(p: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([list(p)], device=device)


def _continue(model, ids: torch.Tensor) -> list:
    seq = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=PAD)
    return seq[0, ids.shape[1]:].tolist()


def run_reference(f32, prompts: Sequence[Sequence[int]], device) -> Reference:
    """``f32``: the float32 model (linear_numerics.emulate(model, FLOAT32))."""
    mods = dict(f32.named_modules())
    inputs = {n: [] for n, m in mods.items() if isinstance(m, ln.EmulatedLinear)}
    hooks = [mods[n].register_forward_hook(lambda m, a, out, n=n: inputs[n].append(a[0].detach().to(ln.BF16)))
             for n in inputs]
    try:
        with torch.no_grad():
            logits = [f32(_ids(p, device)).logits.float() for p in prompts]
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        continuations = [_continue(f32, _ids(p, device)) for p in prompts]
        layers = {n: [(x, mods[n](x.float())) for x in xs] for n, xs in inputs.items()}
    return Reference([list(p) for p in prompts], logits, continuations, layers)


def run_path(model, ref: Reference, device) -> PathFigures:
    """The figures of ``model`` (a bf16 model with the Reference's layer names, each a QuantLinear
    or an EmulatedLinear)."""
    mods = dict(model.named_modules())
    assert all(isinstance(mods.get(n), (QuantLinear, ln.EmulatedLinear)) for n in ref.layers)
    buckets = [ops.token_bucket(len(p)) for p in ref.prompts]
    with torch.no_grad():
        logits = [rel_err(model(_ids(p, device)).logits, want) for p, want in zip(ref.prompts, ref.logits)]
        continuations = [_continue(model, _ids(p, device)) for p in ref.prompts]
        rows = []
        for name, pairs in ref.layers.items():
            per_token = [[] for _ in BUCKETS]
            for (x, want), b in zip(pairs, buckets):
                got, want = mods[name](x).double(), want.double()
                per_token[b].append(((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten())
            rows.append([torch.cat(t).median().item() if t else float("nan") for t in per_token])
    agrees = [c == r for c, r in zip(continuations, ref.continuations)]
    return PathFigures(logits, agrees, continuations, torch.tensor(rows, dtype=torch.float64))


def ratios(figs: dict, path: str) -> Ratios:
    """``figs[path]`` over ``figs``' BF16_PATHS."""
    kernel, paths = figs[path], [figs[p] for p in BF16_PATHS]
    layers = kernel.layers / torch.stack([f.layers for f in paths]).amax(0)
    worst_median = max(statistics.median(f.logits) for f in paths)
    edge = [max(f.logits[i] for f in paths) for i in range(len(kernel.logits))]
    floor = statistics.median(edge)
    return Ratios(layers, statistics.median(kernel.logits) / worst_median,
                  [e / max(m, floor) for e, m in zip(kernel.logits, edge)],
                  sum(kernel.agrees) - min(sum(f.agrees) for f in paths))


def violations(figs: dict, path: str, names: Sequence[str], scale: float = 1.0) -> list:
    """What of the bar (each bound times ``scale``) ``figs[path]`` breaks; empty: it passes. Each
    line starts with the part: ``layers``, ``logits`` or ``greedy``. ``names``: the layers'."""
    r, out = ratios(figs, path), []
    for i, b in (r.layers > scale * LAYER_RATIO).nonzero().tolist():
        out.append(f"layers: {names[i]} ({BUCKETS[b]}): {figs[path].layers[i, b]:.2e}, "
                   f"{r.layers[i, b]:.2f}x the worst bf16 path's (bar {scale * LAYER_RATIO:.2f})")
    valid = r.layers[~r.layers.isnan()].tolist()
    if statistics.median(valid) > scale * LAYER_MEDIAN_RATIO:
        out.append(f"layers: median ratio {statistics.median(valid):.2f} to the worst bf16 path "
                   f"(bar {scale * LAYER_MEDIAN_RATIO:.2f})")
    if r.logits_median > scale * LOGITS_MEDIAN_RATIO:
        out.append(f"logits: median {statistics.median(figs[path].logits):.4f}, {r.logits_median:.2f}x the "
                   f"worst bf16 path's (bar {scale * LOGITS_MEDIAN_RATIO:.2f})")
    for i, x in enumerate(r.logits_prompts):
        if x > scale * LOGITS_PROMPT_RATIO:
            out.append(f"logits: prompt {i} {figs[path].logits[i]:.4f}, {x:.2f}x the bf16 paths' edge "
                       f"(bar {scale * LOGITS_PROMPT_RATIO:.2f})")
    if r.greedy < -GREEDY_SLACK:
        out.append(f"greedy: {sum(figs[path].agrees)} of {len(r.logits_prompts)} continuations are float32's, "
                   f"{-r.greedy} fewer than the least-agreeing bf16 path's")
    return out


def table(figs: dict, prompts: Sequence[Sequence[int]]) -> str:
    """The figures, one column per path: logits error per prompt (``*``: the continuation is
    float32's), the medians, the agreeing count; the layers' median error per bucket, and the
    largest ratio to the worst bf16 path."""
    paths = list(figs)
    lines = [f"{'prompt':>6} {'tokens':>6} {'kernel':>6} " + " ".join(f"{p[:19]:>20}" for p in paths)]
    for i, ids in enumerate(prompts):
        cells = [f"{figs[p].logits[i]:.4f}{'*' if figs[p].agrees[i] else ' '}" for p in paths]
        lines.append(f"{i:6d} {len(ids):6d} {BUCKETS[ops.token_bucket(len(ids))]:>6} "
                     + " ".join(f"{c:>20}" for c in cells))
    lines.append(f"{'logits median':>20} " + " ".join(f"{statistics.median(figs[p].logits):19.4f} " for p in paths))
    lines.append(f"{'float32 tokens':>20} " + " ".join(f"{sum(figs[p].agrees)}/{len(prompts)}".rjust(20)
                                                     for p in paths))
    worst = torch.stack([figs[p].layers for p in BF16_PATHS]).amax(0)
    for b, label in enumerate(BUCKETS):
        lines.append(f"{'layers ' + label:>20} "
                     + " ".join(f"{figs[p].layers[:, b].nanmedian():19.2e} " for p in paths))
    for label, fn in (("layers ratio median", torch.nanmedian), ("layers ratio max", lambda t: t.nan_to_num().max())):
        lines.append(f"{label:>20} " + " ".join(f"{fn(figs[p].layers / worst):19.2f} " for p in paths))
    return "\n".join(lines)
