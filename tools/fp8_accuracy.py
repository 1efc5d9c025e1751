"""What e4m3 activations cost a whole model: logits and greedy tokens of a quantized LLaMA-3-8B-shaped
stack with exact (``act_format="bf16"``), e4m3 (``"fp8"``) and ``"auto"`` activations, each against
the same model in bf16 (GPU).

    python tools/fp8_accuracy.py [OUT.json] [--layers 32] [--types u4,u2] [--batch 4] [--prompt 512]
        [--new-tokens 32] [--seed 0]

The model: transformers' ``LlamaForCausalLM`` with LLaMA-3-8B's shapes (``mixgemm.bench`` preset
``llama3-8b``, ``--layers`` of its decoder layers), random weights drawn by transformers' own
initialization, bf16. For each weight type, ``mixgemm.nn.quantize_model`` (group 128) quantizes a
copy of it once per activation format, so the three variants hold the same codes and scales and
differ only in how each linear layer's input is taken: exact, rounded to e4m3 with a scale per
token, or either by the GPU's tuning table (docs/fp8.md).

Per variant, on ``--batch`` random prompts of ``--prompt`` tokens (one forward of batch x prompt
tokens, the e4m3 path's regime), against the bf16 model and against the same weights with exact
activations (the ``<type> bf16`` row: the e4m3 rows' rounding of the activations alone):

* ``logits_rel_err``: ||logits - logits_ref|| / ||logits_ref|| over every position (float32);
* ``top1_agree``: the fraction of positions whose argmax is the reference's;

and over ``--new-tokens`` greedy tokens per prompt (``generate()``, batch x 1 tokens per step: the
exact path's regime, where ``"auto"`` keeps exact activations):

* ``greedy_agree``: the fraction of generated tokens equal to the reference's at the same position;
* ``first_divergence``: the median number of tokens generated before the first that differs.

The first row, ``bf16 bf16``, is the bf16 model run again: generate()'s own run-to-run variation
(a forward of the same input is bit for bit the same; the decode steps of two generate() calls
need not be), the floor of every greedy figure.

Random weights (transformers' initialization) make a model whose next-token distribution is flat
and whose layers amplify any perturbation with depth: at 32 layers the quantization alone
decorrelates the logits from bf16's, so the figures that say what e4m3 costs are those against
the exact-activation model, and those of a shallow stack (``--layers 4``).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys

import torch

FORMATS = ("bf16", "fp8", "auto")


def _compare(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    a, r = logits.float(), ref.float()
    return {"logits_rel_err": ((a - r).norm() / r.norm()).item(),
            "top1_agree": (a.argmax(-1) == r.argmax(-1)).float().mean().item()}


def _greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, disable_compile=True, pad_token_id=0)
    return out[:, ids.shape[1]:]


def _row(got: dict, ref: dict) -> dict:
    return {**_compare(got["logits"], ref["logits"]), **_agreement(got["tokens"], ref["tokens"])}


def _agreement(tokens: torch.Tensor, ref: torch.Tensor) -> dict:
    same = tokens == ref
    firsts = [int(row.logical_not().nonzero()[0]) if not bool(row.all()) else row.numel() for row in same]
    return {"greedy_agree": same.float().mean().item(), "first_divergence": statistics.median(firsts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="JSON file for the rows")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the 32 (default all)")
    ap.add_argument("--types", default="u4,u2", help="weight types (comma list of u4, s4, u2, s2)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    types = [t for t in a.types.split(",") if t]
    if any(t not in ("u4", "s4", "u2", "s2") for t in types) or a.layers < 1 or a.batch < 1 or a.prompt < 1 \
            or a.new_tokens < 1:
        ap.error("--types takes u4, s4, u2, s2; --layers, --batch, --prompt and --new-tokens are positive")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)):
        print("fp8_accuracy: needs an sm_90 (Hopper) GPU", file=sys.stderr)
        return 2

    import mixgemm
    from mixgemm.aot.prebuild import build_for
    from mixgemm.bench.decoder import PRESETS
    from mixgemm.bench.generate_run import build_preset_model

    dev = torch.device("cuda", 0)
    base = build_preset_model(PRESETS["llama3-8b"], a.layers, dev, a.seed)
    gen = torch.Generator(device="cpu").manual_seed(a.seed + 1)
    ids = torch.randint(0, base.config.vocab_size, (a.batch, a.prompt), generator=gen).to(dev)
    rows = []
    with torch.no_grad():
        ref = {"logits": base(ids).logits.float(), "tokens": _greedy(base, ids, a.new_tokens)}
        again = {"logits": base(ids).logits.float(), "tokens": _greedy(base, ids, a.new_tokens)}
        rows.append({"weight": "bf16", "act_format": "bf16", "vs_bf16": _row(again, ref)})
        print(f"bf16 again: greedy {rows[0]['vs_bf16']['greedy_agree']:.3f}, logits rel. err "
              f"{rows[0]['vs_bf16']['logits_rel_err']:.4f}", flush=True)
        for wt in types:
            exact = None
            for fmt in FORMATS:
                model = copy.deepcopy(base)
                mixgemm.nn.quantize_model(model, bits=int(wt[1]), group_size=128, symmetric=wt[0] == "s",
                                          progress=False, act_format=fmt)
                build_for(model, a.batch * a.prompt, progress=False)
                got = {"logits": model(ids).logits.float(), "tokens": _greedy(model, ids, a.new_tokens)}
                row = {"weight": wt, "act_format": fmt, "vs_bf16": _row(got, ref)}
                if exact is None:
                    exact = got
                else:
                    row["vs_exact"] = _row(got, exact)
                rows.append(row)
                print(f"{wt:>3} {fmt:>5}: " + "; ".join(
                    f"vs {k[3:]}: logits rel. err {v['logits_rel_err']:.4f}, top-1 {v['top1_agree']:.3f}, greedy "
                    f"{v['greedy_agree']:.3f} (first divergence at {v['first_divergence']})"
                    for k, v in row.items() if k.startswith("vs_")), flush=True)
                del model
                torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                       "config": vars(a), "rows": rows}, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
