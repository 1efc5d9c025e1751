"""Dynamo's guards on a compiled decode step: bf16 against mixgemm's u4 models, on the CPU.

    python tools/compile_guards.py [--layers 4 16] [--variants bf16 u4 u4-fused-layers u4-per-layer]
                                   [--rounds 15] [--dump DIR] [--json PATH]

generate() with a static cache compiles its decode step (torch.compile of the model; transformers'
default CompileConfig has ``fullgraph=False``, and the step traces to one graph either way); every call of the step first checks all the step's guards, on the host,
before the CUDA-graph tree replays the graph, so the guards are host time on every token
(docs/compile-and-graphs.md). This tool builds a tiny random LLaMA (hidden 256, intermediate
512, 4 heads, 2 KV heads of 64, vocabulary 1000) in bf16 and quantizes it with
``mixgemm.nn.quantize_model(bits=4, group_size=64)``:

  bf16             the model as transformers builds it;
  u4               fused projections (quantize_model's default);
  u4-fused-layers  ``fuse_layers=True``;
  u4-per-layer     ``fuse_projections=False`` (each linear layer replaced alone).

For each it runs generate()'s prompt and first steps eagerly over a static cache (QuantLinear
computing from the reference dequantization: no GPU needed), compiles the decode step as
generate() does with a backend that returns outputs of the traced shapes (the graph never runs),
calls it once, and reports: the guards (leaf guards, by kind), the guard managers (each an
attribute or item lookup on every check), the graph's inputs (the tensors the step reads:
parameters, buffers, cache tensors, inputs), the time of one check of all the guards
(``RootGuardManager.check`` on the step's frame; the minimum over --rounds rounds, taken round
robin across the variants so that the machine's drift hits them alike) and of one call of the
compiled step (guards, the bytecode that gathers the graph's inputs, the trivial backend, the
model's output). Times are this machine's CPU, not a GPU host's; the counts are the same on any.

--dump DIR writes each variant's guards, one a line (kind, source, code), to DIR/<variant>_<layers>.tsv,
to diff two variants or two revisions. --json PATH writes the rows.

Uses two private pieces of torch._dynamo (torch 2.13): it wraps
``torch._dynamo.guards.profile_guard_manager``, which Dynamo calls with the new guard tree and
the frame's locals after each compile, to get both, and walks the tree with the guard managers'
introspection methods.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import types
from pathlib import Path

import torch
import torch._dynamo.guards as dynamo_guards
import torch.nn.functional as F
from torch._C._dynamo.guards import DictGuardManager

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import mixgemm  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402
from mixgemm.weights.quantize import GATE_UP_STRIPE  # noqa: E402

VARIANTS = ("bf16", "u4", "u4-fused-layers", "u4-per-layer")


def build(layers: int, variant: str):
    import transformers

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, num_hidden_layers=layers,
                                      vocab_size=1000, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(torch.bfloat16).eval()
    if variant != "bf16":
        mixgemm.nn.quantize_model(model, bits=4, group_size=64, progress=False,
                                  fuse_projections=variant != "u4-per-layer",
                                  fuse_layers=variant == "u4-fused-layers")
    return model


def reference_forward(self, x):
    """QuantLinear.forward from the reference dequantization (the eager steps, on the CPU)."""
    w = mixgemm.dequantize_reference(self.packed).float()
    if self.perm is not None:
        x = x.index_select(-1, self.perm)
    y = F.linear(x.float(), w, None if self.bias is None else self.bias.float())
    if self.activation == "swiglu":      # (gate and up rows interleaved in stripes)
        gate, up = y.unflatten(-1, (-1, 2, GATE_UP_STRIPE)).unbind(-2)
        y = (F.silu(gate) * up).flatten(-2)
    return y.to(x.dtype)


def decode_kwargs(model) -> dict:
    """The keyword arguments of generate()'s last decode step (its cache initialized)."""
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    forward, QuantLinear.forward = QuantLinear.forward, reference_forward
    try:
        ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
        model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static", disable_compile=True)
    finally:
        QuantLinear.forward = forward
        hook.remove()
    return seen[-1]


def shapes_backend(captured: dict):
    """A backend that records the graph's input count and returns outputs of the traced shapes."""
    def backend(gm, example_inputs):
        captured["inputs"] = len(example_inputs)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        values = []
        for a in out.args[0]:
            v = a.meta["example_value"] if isinstance(a, torch.fx.Node) else a
            values.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
        return lambda *args: values
    return backend


def tree(root) -> tuple[list, int]:
    """(leaf guards as (kind, source, code), guard managers) of a guard tree."""
    guards, managers = [], 0

    def walk(mgr):
        nonlocal managers
        managers += 1
        for g in mgr.get_leaf_guards():
            guards.append((type(g).__name__, mgr.get_source(), " ".join(g.verbose_code_parts())))
        if isinstance(mgr, DictGuardManager):
            kids = [m for pair in mgr.get_key_value_managers().values() for m in pair if m is not None]
        else:
            kids = mgr.get_child_managers()
        for kid in kids:
            walk(kid)

    walk(root)
    return guards, managers


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _call(model, kwargs):
    return model(**kwargs)


def measure(layers: int, variant: str, captured: dict) -> dict:
    captured.clear()
    model = build(layers, variant)
    kwargs = decode_kwargs(model)
    # the step through a code object of its own: Dynamo keeps its compiled entries per code
    # object, so each variant's calls meet only its own guards
    code = _call.__code__.replace(co_name=f"_call_{variant.replace('-', '_')}_{layers}")
    step = torch.compile(types.FunctionType(code, globals()), fullgraph=True, backend=shapes_backend(captured))
    with torch.no_grad():
        step(model, kwargs)
    root, scope = captured["root"], captured["scope"]
    guards, managers = tree(root)
    kinds = collections.Counter(kind for kind, _, _ in guards)
    return dict(variant=variant, layers=layers, guards=len(guards), managers=managers,
                tensor_guards=kinds.get("TENSOR_MATCH", 0), graph_inputs=captured["inputs"],
                kinds=dict(kinds.most_common()), _check=(root, scope), _step=lambda: step(model, kwargs),
                _guards=guards)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/compile_guards.py", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:3]))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dump", type=Path)
    p.add_argument("--json", type=Path)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        if e.code:
            print(__doc__)
        return int(e.code or 0) and 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("compile_guards: needs transformers")
        return 2
    if not hasattr(dynamo_guards, "profile_guard_manager"):
        print(f"compile_guards: torch {torch.__version__}'s Dynamo has no profile_guard_manager to hook")
        return 2
    captured: dict = {}
    real = dynamo_guards.profile_guard_manager

    def hook(root, scope, n):
        captured["root"], captured["scope"] = root, scope
        return real(root, scope, n)

    dynamo_guards.profile_guard_manager = hook
    try:
        rows = [measure(layers, v, captured) for layers in args.layers for v in args.variants]
    finally:
        dynamo_guards.profile_guard_manager = real
    check, call = [float("inf")] * len(rows), [float("inf")] * len(rows)
    with torch.no_grad():              # (the steps ran under no_grad: their guards check it)
        for _ in range(args.rounds):
            for i, row in enumerate(rows):
                root, scope = row["_check"]
                if not root.check(scope):
                    raise RuntimeError(f"{row['variant']}: the step's guards fail on its own frame")
                check[i] = min(check[i], per_call_us(lambda: root.check(scope), 500))
                call[i] = min(call[i], per_call_us(row["_step"], 100))
    print(f"{'variant':<16} {'layers':>6} {'guards':>7} {'managers':>8} {'tensor':>7} {'inputs':>7} "
          f"{'check us':>9} {'call us':>8}")
    for row, check_us, call_us in zip(rows, check, call):
        row["guard_check_us"], row["call_us"] = round(check_us, 1), round(call_us, 1)
        print(f"{row['variant']:<16} {row['layers']:>6} {row['guards']:>7} {row['managers']:>8} "
              f"{row['tensor_guards']:>7} {row['graph_inputs']:>7} {row['guard_check_us']:>9} {row['call_us']:>8}")
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            with open(args.dump / f"{row['variant']}_{row['layers']}.tsv", "w") as f:
                f.writelines(f"{kind}\t{source}\t{code}\n" for kind, source, code in row["_guards"])
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
