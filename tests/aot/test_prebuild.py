"""mixgemm.aot.prebuild: the kernels a model can select, and building them ahead of time.

The claim under test: ``specs_for(model)`` is exactly the set of kernels the model's GEMMs
select at some token count. It is checked against the heuristic at every M from 1 to 400, and
against what the real call path (QuantLinear.forward on the fake GPU of tests/fake_gpu.py)
asks the kernel cache for.
"""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import fake_driver
import pytest
import torch
from torch import nn

from mixgemm.jit import driver
from mixgemm.jit import build
from mixgemm.dispatch import heuristic
from mixgemm.ops import dense as ops
from mixgemm.aot import prebuild
from mixgemm.nn import QuantLinear
from mixgemm.aot.prebuild import WeightUse, specs_for, token_counts
from mixgemm.jit.specs import Activation
from mixgemm.dtypes import ActType, WeightType

from fake_nvcc import fake_env  # noqa: F401  (the fake nvcc and a private cache)


class Tiny(nn.Module):
    """Layers on both sides of every size bound of the heuristic (2^25, 2^26, 60M and 48M
    weights), every activation, and zero offsets; zero-filled buffers (nothing quantized)."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.small = QuantLinear(1024, 2048, bits=4, group_size=128, dtype=dtype)                       # 2M
        self.mlp_in = QuantLinear(4096, 4096, bits=4, group_size=128, dtype=dtype, activation="swiglu")  # 33.5M
        self.act = QuantLinear(4096, 4096, bits=8, group_size=128, symmetric=True, dtype=dtype,
                               activation="gelu")                                                     # 16.8M
        self.mid = QuantLinear(4096, 14336, bits=2, group_size=64, dtype=dtype)                          # 58.7M
        self.big = QuantLinear(8192, 8192, bits=4, group_size=128, dtype=dtype, bias=False)               # 67.1M
        self.offsets = QuantLinear(1024, 512, bits=4, group_size=128, dtype=dtype, activation="silu")
        self.offsets.register_buffer("zero_offsets", torch.zeros(8, 512))


#: every M up to 600 (each bucket of the table and the first Ms above it), then every 64th up to
#: 5000, on GPUs of three SM counts: above 512 tokens the choice follows both (heuristic.xl_evens_waves)
BRUTE_MS = (*range(1, 601), *range(601, 5000, 64))
BRUTE_SMS = (132, 114, 78)


def brute_force(model: nn.Module, ms=BRUTE_MS, sms=BRUTE_SMS) -> set:
    """select_spec for every M in ``ms`` on every SM count in ``sms``, every QuantLinear (with
    gemm's rule: zero offsets take the kernel without activation)."""
    names = set()
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            w = layer.packed
            act = None if layer.activation == "none" or w.zero_offsets is not None else layer.activation
            names |= {ops.select_spec(m, w, act, s).name for m in ms for s in sms}
    return names


def test_token_counts_cover_every_bucket():
    counts = token_counts()
    assert counts[0] == 1
    assert [ops.token_bucket(m) for m in counts] == sorted(set(ops.TOKEN_BUCKETS[1:])) + [heuristic.LARGE_M_BUCKETS[0]]
    for m in counts[1:]:
        assert ops.token_bucket(m - 1) != ops.token_bucket(m), "each count is the first of its bucket"
    assert token_counts(16) == [m for m in counts if m <= 16] and token_counts(1) == [1]
    with pytest.raises(ValueError, match="max_tokens"):
        token_counts(0)


def test_specs_for_equals_the_heuristic_at_every_m():
    model = Tiny()
    names = [s.name for s in specs_for(model)]
    assert names == sorted(set(names)), "sorted, without repeats"
    assert set(names) == brute_force(model)
    # fewer tokens: the kernels of the buckets up to there
    assert {s.name for s in specs_for(model, max_tokens=20)} == brute_force(model, range(1, 21))


def test_specs_for_items_of_every_kind():
    model = Tiny()
    w = model.small.packed
    assert [s.name for s in specs_for(w)] == [s.name for s in specs_for(model.small)]
    use = WeightUse(w.n, w.k, w.weight_type, ActType.BF16, Activation.SWIGLU)
    assert {s.name for s in specs_for(use)} == brute_force(
        QuantLinear(w.k, w.n // 2, bits=4, group_size=128, activation="swiglu"))
    both = {s.name for s in specs_for([model.small, model.big])}
    assert both == brute_force(model.small) | brute_force(model.big)
    fp16 = {s.name for s in specs_for(Tiny(torch.float16))}
    assert fp16 and all("_fp16_" in n for n in fp16)
    assert specs_for(nn.Linear(64, 64)) == []
    with pytest.raises(TypeError, match="PackedWeight"):
        specs_for([object()])
    with pytest.raises(TypeError):
        specs_for("model.safetensors")


def test_any_module_that_reports_its_kernels_brings_them():
    """specs_for knows no layer class: it asks each module for its kernel_uses()."""
    from mixgemm.dispatch.uses import LaunchesKernels
    from mixgemm.ops.norm import norm_spec

    class Custom(nn.Module):
        def kernel_uses(self):
            return [WeightUse(2048, 1024, WeightType.U4, ActType.BF16), norm_spec(torch.float16, True)]

    model = nn.Sequential(nn.Linear(2, 2), Custom())
    assert isinstance(model[1], LaunchesKernels) and not isinstance(model[0], LaunchesKernels)
    assert [u.name for u in prebuild.uses_of(model)] == ["1"], "named by where the module sits"
    names = {s.name for s in specs_for(model)}
    assert names == brute_force(Tiny().small) | {"mixgemm_add_rmsnorm_fp16"}


def test_aot_does_not_import_nn():
    """mixgemm.aot stands beside mixgemm.nn, not above it: the layers report their kernels."""
    import subprocess
    import sys

    import mixgemm

    here = str(Path(mixgemm.__file__).parent.parent)   # this mixgemm, installed or not
    code = "import sys, mixgemm.aot; print('mixgemm.nn' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"


def test_weight_use_checks_its_shape():
    with pytest.raises(ValueError, match="N % 16"):
        WeightUse(24, 128, WeightType.U4, ActType.BF16)
    with pytest.raises(ValueError, match="K % 64"):
        WeightUse(32, 96, WeightType.U4, ActType.BF16, name="x.weight")
    assert WeightUse(32, 128, WeightType.U4, ActType.BF16, name="a") == \
        WeightUse(32, 128, WeightType.U4, ActType.BF16, name="b"), "the name is not compared"


@pytest.mark.skipif(fake_driver.compiler() is None or fake_driver.real_driver_present(),
                    reason="needs a C compiler for the fake CUDA driver, and no real one")
def test_the_runtime_asks_for_exactly_these_kernels(tmp_path, monkeypatch):
    """QuantLinear.forward at every M up to 300, and at 513, 600, 769 and 1025 (above 512 tokens),
    on the fake GPU (the real call path, fake kernels, 132 SMs) requests from the kernel cache
    exactly specs_for's kernels. (specs_for takes both 128x256 kernels above 512 tokens; the two
    8192-row layers pick "xl" there only on other SM counts, but their types' "xl" kernels are
    asked for at 257-512 tokens.)"""
    from fake_gpu import FakeGpu

    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    model = Tiny()
    asked = set()
    with FakeGpu(tmp_path / "fake", launcher_mode="python", helpers="fake") as gpu:
        gpu.driver.reset(params_size=ctypes.sizeof(driver.GemmArgs))
        get = gpu.kernels.get

        def recording_get(spec, device):
            asked.add(spec.name)
            return get(spec, device)

        monkeypatch.setattr(gpu.kernels, "get", recording_get)
        with torch.no_grad():
            for m in [*range(1, 301), 513, 600, 769, 1025]:
                for layer in model.modules():
                    if isinstance(layer, QuantLinear):
                        layer(torch.zeros(m, layer.in_features, dtype=torch.bfloat16))
    every = {s.name for s in specs_for(model)}
    assert {s.name for s in specs_for(model, max_tokens=600)} == every
    assert asked == every, "every bucket is reached"


def test_build_for_builds_the_kernels_and_the_launcher(fake_env, monkeypatch):  # noqa: F811
    monkeypatch.delenv("MIXGEMM_LAUNCHER", raising=False)
    model = nn.Sequential(QuantLinear(1024, 2048, bits=4, group_size=128),
                          QuantLinear(2048, 1024, bits=2, group_size=64, activation="swiglu"))
    arts = prebuild.build_for(model, max_tokens=16, jobs=2, progress=False)
    want = specs_for(model, max_tokens=16)
    assert [a.spec.name for a in arts] == [s.name for s in want]
    cache = Path(os.environ["MIXGEMM_CACHE_DIR"])
    built = {p.name.rsplit("-", 1)[0] for p in (cache / "kernels").iterdir()}
    assert built == {s.name for s in want}
    host = list((cache / "host").iterdir())
    assert len(host) == 1 and host[0].name.startswith("launcher-")
    assert json.loads((host[0] / "meta.json").read_text())["name"] == "launcher"
    # everything is cached now: a second call builds nothing
    calls = (fake_env / "calls.log").read_text()
    prebuild.build_for(model, max_tokens=16, progress=False)
    assert (fake_env / "calls.log").read_text() == calls


def test_build_for_without_the_launcher_in_python_mode(fake_env, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MIXGEMM_LAUNCHER", "python")
    prebuild.build_for(QuantLinear(1024, 1024), max_tokens=1, progress=False)
    cache = Path(os.environ["MIXGEMM_CACHE_DIR"])
    assert not (cache / "host").exists()
    assert len(list((cache / "kernels").iterdir())) == 1


def test_build_for_reports_a_failed_launcher(fake_env, monkeypatch, caplog):  # noqa: F811
    """auto: a warning (calls launch from Python); compiled: an error."""
    from mixgemm.jit import launcher

    def fail():
        raise build.BuildError("no compiler today")

    monkeypatch.setattr(launcher, "build_compiled", fail)
    monkeypatch.setenv("MIXGEMM_LAUNCHER", "auto")
    prebuild.build_for(QuantLinear(1024, 1024), max_tokens=1, progress=False)
    assert any("launcher did not build" in r.message for r in caplog.records)
    monkeypatch.setenv("MIXGEMM_LAUNCHER", "compiled")
    with pytest.raises(build.BuildError, match="not the compiled launcher: no compiler today"):
        prebuild.build_for(QuantLinear(1024, 1024), max_tokens=1, progress=False)


def _quant_moe(e, h, i, bits=4):
    from torch import nn

    from mixgemm.nn.moe import QuantMoE

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)

    torch.manual_seed(0)
    return QuantMoE.from_mlps([Mlp().to(torch.bfloat16) for _ in range(e)], bits, 64)


@pytest.mark.parametrize("e,h,i", [(8, 256, 128), (4, 4096, 128), (16, 128, 4096)])
def test_moe_layers_bring_every_kernel_their_forward_can_launch(e, h, i):
    from torch import nn

    from mixgemm import moe
    from mixgemm.jit.specs import KernelKind, MoeLayoutSpec

    layer = _quant_moe(e, h, i)
    got = {s.name for s in prebuild.specs_for(nn.Sequential(nn.Linear(2, 2), layer))}
    want = set()
    w13 = layer.experts("w13")
    for rows in range(1, e * 300):                 # every row count up to 300 per expert, brute force
        chosen = [moe.select_grouped_spec(rows, ex, act) for ex, act in ((w13, "swiglu"), (layer.experts("w2"), None))]
        for spec in chosen + list(moe.plan_fused_moe(rows, w13.act_type, w13.weight_type, e, h, i).specs):
            want.add(spec.name)
            if spec.kind is KernelKind.GROUPED_GEMM:
                want.add(MoeLayoutSpec().name)
    assert want <= got
    assert {"mixgemm_moe_route_i32", "mixgemm_moe_route_i64", "mixgemm_moe_combine_bf16_wf32"} <= got
    assert got - want <= {n for n in got if n.startswith(("mixgemm_moe_route", "mixgemm_moe_combine"))}
    # at most one token: the grouped decode kernels only
    few = {s.name for s in prebuild.moe_specs_for(layer, max_tokens=1)}
    assert not any("ggemm" in n or n == "mixgemm_moe_layout" for n in few) and any("gdecode" in n for n in few)


def test_a_moe_checkpoint_brings_its_grouped_kernels(tmp_path):
    import mixgemm
    from mixgemm.aot import checkpoint as checkpoint_weights
    from mixgemm.weights.experts import PackedExperts
    from mixgemm.aot.prebuild import ExpertsUse

    w13 = PackedExperts.quantize(torch.randn(4, 256, 128, dtype=torch.bfloat16), 4, 64)
    w2 = PackedExperts.quantize(torch.randn(4, 128, 128, dtype=torch.bfloat16), 4, 64)
    dense = mixgemm.quantize(torch.randn(128, 128, dtype=torch.bfloat16), 4, 64)
    path = tmp_path / "moe.safetensors"
    mixgemm.save(path, {"layers.0.mlp.experts.w13.weight": w13, "layers.0.mlp.experts.w2.weight": w2,
                        "layers.0.self_attn.o_proj.weight": mixgemm.prepack(dense)})
    uses = checkpoint_weights.weight_uses(path)
    experts = [u for u in uses if isinstance(u, ExpertsUse)]
    assert experts == [ExpertsUse(4, 128, 128, w13.weight_type, w13.act_type)]
    assert experts[0].name == "layers.0.mlp.experts"
    names = {s.name for s in prebuild.specs_for(uses)}
    assert {s.name for s in prebuild.moe_specs_for(experts[0])} <= names
    # the dense layer keeps its own kernels; the experts bring no dense GEMM of their shape
    assert names == {s.name for s in prebuild.specs_for([u for u in uses if not isinstance(u, ExpertsUse)])} \
        | {s.name for s in prebuild.moe_specs_for(experts[0])}


@pytest.mark.parametrize("keep", ("w13", "w2"))
def test_stacked_experts_without_a_partner_are_refused(tmp_path, keep):
    import mixgemm
    from mixgemm.aot import checkpoint as checkpoint_weights
    from mixgemm.errors import UserError
    from mixgemm.weights.experts import PackedExperts

    ex = {"w13": PackedExperts.quantize(torch.randn(4, 256, 128, dtype=torch.bfloat16), 4, 64),
          "w2": PackedExperts.quantize(torch.randn(4, 128, 128, dtype=torch.bfloat16), 4, 64)}
    path = tmp_path / "half.safetensors"
    mixgemm.save(path, {f"layers.0.mlp.experts.{keep}.weight": ex[keep]})
    with pytest.raises(UserError, match="no partner"):
        checkpoint_weights.weight_uses(path)


def test_stacked_experts_that_do_not_fit_are_refused(tmp_path):
    import mixgemm
    from mixgemm.aot import checkpoint as checkpoint_weights
    from mixgemm.errors import UserError
    from mixgemm.weights.experts import PackedExperts

    path = tmp_path / "bad.safetensors"
    mixgemm.save(path, {"e.w13.weight": PackedExperts.quantize(torch.randn(4, 256, 128, dtype=torch.bfloat16), 4, 64),
                        "e.w2.weight": PackedExperts.quantize(torch.randn(4, 128, 192, dtype=torch.bfloat16), 4, 64)})
    with pytest.raises(UserError, match="do not make one MoE layer"):
        checkpoint_weights.weight_uses(path)
