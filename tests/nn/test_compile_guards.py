"""What torch.compile sees of mixgemm's modules (CPU): the op's arguments, the guards, and the
graphs generate() traces.

A compiled decode step (generate() with a static cache) checks all its guards before every
call, so each piece of module state that a traced forward reads is host time on every token.
QuantLinear reads its buffers from their dict and takes N, K and the group size from the
buffers' shapes; these tests check that the op still gets the layer's values and that no guard
is left on the attributes that repeat them (or on nn.Module.__getattr__'s lookups). A graph
break or a recompile would cost more: the step traces as one graph, once, in every way
generate() gets it compiled. The compiled graphs never run here: the backend returns outputs of
the traced shapes.
"""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._C._dynamo.guards import DictGuardManager

transformers = pytest.importorskip("transformers", reason="the fused blocks are transformers modules")

import mixgemm  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402
from mixgemm.weights.quantize import quantize  # noqa: E402
from mixgemm.weights.layout import prepack  # noqa: E402
from tiny_models import reference_forward, tiny_model  # noqa: E402

eval_frame = pytest.importorskip("torch._dynamo.eval_frame")
if not hasattr(eval_frame, "_debug_get_cache_entry_list"):
    pytest.skip("this torch does not expose Dynamo's cache entries", allow_module_level=True)


def shapes_backend(graphs: list):
    """A backend that keeps the graph and returns outputs of the traced shapes (runs nothing)."""
    def backend(gm, example_inputs):
        graphs.append(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        values = []
        for a in out.args[0]:
            v = a.meta["example_value"] if isinstance(a, torch.fx.Node) else a
            values.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
        return lambda *args: values
    return backend


def gemm_args(layer: QuantLinear, x: torch.Tensor) -> tuple:
    graphs = []
    torch._dynamo.reset()
    torch.compile(layer, fullgraph=True, backend=shapes_backend(graphs))(x)
    calls = [n for n in graphs[0].graph.nodes if n.target in (torch.ops.mixgemm.gemm, torch.ops.mixgemm.gemm.default)]
    assert len(calls) == 1
    return tuple(calls[0].args[6:])


def _linear(n, k, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("case", ["u4 g64 bias", "s2 per-channel", "u8 g128", "swiglu", "act-order"])
def test_the_compiled_op_gets_the_layers_values(case):
    """N, K and the group size that the traced forward derives from the buffers' shapes are the
    layer's (weight_rows, in_features, group_size), for every kind of layer."""
    if case == "u4 g64 bias":
        layer = QuantLinear.from_linear(_linear(80, 192), bits=4, group_size=64)
    elif case == "s2 per-channel":
        layer = QuantLinear.from_linear(_linear(64, 256, bias=False), bits=2, group_size=256, symmetric=True)
    elif case == "u8 g128":
        layer = QuantLinear.from_linear(_linear(48, 384), bits=8, group_size=128)
    elif case == "swiglu":
        layer = QuantLinear.from_gate_up(_linear(96, 128), _linear(96, 128, seed=1), bits=4, group_size=64)
    else:
        w = _linear(64, 128).weight.detach()
        perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
        layer = QuantLinear.from_packed(prepack(quantize(w, 4, 32, dtype=torch.bfloat16)), perm=perm)
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    want = (layer.weight_type.value, layer.group_size, layer.weight_rows, layer.in_features, layer.activation)
    assert gemm_args(layer, x) == want


def _guard_sources(guard_manager) -> list[str]:
    """The source of every leaf guard of a Dynamo cache entry's guard tree."""
    found = []

    def walk(mgr):
        found.extend(mgr.get_source() for _ in mgr.get_leaf_guards())
        if isinstance(mgr, DictGuardManager):
            children = [m for pair in mgr.get_key_value_managers().values() for m in pair if m is not None]
        else:
            children = mgr.get_child_managers()
        for child in children:
            walk(child)

    walk(guard_manager.root)
    return found


def _compiled_decode_guards(model) -> list[str]:
    """The guard sources of a decode step of ``model`` over a static cache, compiled as
    generate() compiles it (fullgraph), after an eager prefill."""
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    forward = QuantLinear.forward
    QuantLinear.forward = reference_forward          # (the eager steps: no GPU here)
    try:
        ids = torch.randint(0, 160, (1, 5), generator=torch.Generator().manual_seed(0))
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static", disable_compile=True)
    finally:
        QuantLinear.forward = forward
        hook.remove()
    torch._dynamo.reset()
    step = torch.compile(model, fullgraph=True, backend=shapes_backend([]))
    with torch.no_grad():
        step(**seen[-1])
    entries = eval_frame._debug_get_cache_entry_list(type(model).forward.__code__)
    assert len(entries) == 1
    return _guard_sources(entries[0].guard_manager)


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_a_compiled_decode_step_guards_only_what_quantlinear_must_read(fuse_layers):
    """Under a QuantLinear, the decode step's guards are on the module's type, its instance
    dict, its buffers (the three tensors, perm and zero_offsets), bias, activation and
    weight_type: none on in_features, out_features or group_size, none on the _parameters /
    _modules lookups of nn.Module.__getattr__."""
    model = tiny_model("llama")
    mixgemm.nn.quantize_model(model, bits=4, group_size=64, progress=False, dtype=torch.float16,
                              fuse_layers=fuse_layers)
    sources = _compiled_decode_guards(model)
    paths = {name: "".join(f"._modules['{part}']" for part in name.split("."))
             for name, mod in model.named_modules() if isinstance(mod, QuantLinear)}
    assert len(paths) == 4 * 2 and sources
    allowed = ("", ".__dict__", "._buffers", ".bias", ".activation", ".weight_type")
    read = {}
    for source in sources:
        for name, path in paths.items():
            at = source.find(path)
            if at >= 0 and not source[at + len(path):].startswith("._modules"):
                # the attribute read of the module ("" for the module itself or its type)
                read.setdefault(name, set()).add(re.match(r"(\.\w+)?", source[at + len(path):]).group(0))
    assert set(read) == set(paths), "every QuantLinear is guarded (its tensors at least)"
    for name, heads in read.items():
        assert heads <= set(allowed), f"{name}: guards on {sorted(heads - set(allowed))}"


def _reference_when_eager(forward):
    """``forward`` while Dynamo traces, the reference product otherwise (the eager prompt steps)."""
    def either(self, x):
        return forward(self, x) if torch.compiler.is_compiling() else reference_forward(self, x)
    return either


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_generate_traces_the_decode_step_once(monkeypatch, fuse_layers):
    """generate()'s own compile of the decode step with transformers' default CompileConfig
    (``fullgraph=False``, where a graph break would split the step) traces one graph and reuses it
    over generate() calls of two lengths, each on a new static cache; the model's forward compiled
    by hand (``fullgraph=True``, the prompt compiled too) traces two, the prompt's and the step's.
    No graph break, no recompile, for the fused projections and the fused layers."""
    if not hasattr(transformers.CompileConfig, "_compile_all_devices"):
        pytest.skip("this transformers compiles generate()'s step on accelerators only")
    monkeypatch.setattr(QuantLinear, "forward", _reference_when_eager(QuantLinear.forward))
    ids = torch.randint(0, 160, (1, 9), generator=torch.Generator().manual_seed(0))

    def traced(compile_forward: bool) -> int:
        torch._dynamo.reset()
        model = tiny_model("llama")
        mixgemm.nn.quantize_model(model, bits=4, group_size=64, progress=False, dtype=torch.float16,
                                  fuse_layers=fuse_layers)
        graphs = []
        config = transformers.CompileConfig()   # (generate()'s default, but for the backend)
        config.backend, config.mode, config._compile_all_devices = shapes_backend(graphs), None, True
        kw = dict(do_sample=False, cache_implementation="static", compile_config=config)
        if compile_forward:
            model.forward = torch.compile(model.forward, fullgraph=True, backend=shapes_backend(graphs))
            kw["disable_compile"] = True
        with torch.no_grad():
            for _ in range(3):
                for tokens in (5, 1):
                    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        return len(graphs)

    assert traced(compile_forward=False) == 1
    assert traced(compile_forward=True) == 2
