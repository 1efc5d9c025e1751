"""``mixgemm.hf.from_pretrained(..., prebuild=True)`` on the CPU: with the fake nvcc of
test_build it builds, before it returns, exactly the kernels that the loaded model's forward
then asks the kernel cache for (run on the fake GPU of tests/fake_gpu.py at a token count in
every bucket), and the compiled launcher; ``mixgemm generate --build --for`` builds the same set.
The weight shapes ``--for`` reads from a checkpoint's headers are those of the GEMMs the loaded
model runs (its fused q/k/v and gate/up layers), whatever the fusion keywords.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import fake_driver
import pytest
import torch

pytest.importorskip("transformers", reason="mixgemm.hf needs transformers (pip install 'mixgemm[hf]')")

import hf_checkpoints as hc  # noqa: E402
from mixgemm import hf
from mixgemm.jit import driver
from mixgemm.jit import loader as runtime  # noqa: E402
from mixgemm.cli.main import main  # noqa: E402
from mixgemm.aot.checkpoint import kernel_specs, weight_uses  # noqa: E402
from mixgemm.aot.prebuild import specs_for, uses_of  # noqa: E402

from fake_nvcc import fake_env, nvcc_calls  # noqa: E402,F401  (the fake nvcc and a private cache)

#: (batch, sequence length): a token count M = batch x length in every bucket of the heuristic
#: (1, 9, 17, 33, 65, 129, 257, 513 and up), and some within them
SHAPES = [(1, 1), (2, 1), (1, 8), (1, 9), (2, 8), (1, 17), (1, 33), (1, 65), (1, 129), (2, 129), (2, 150),
          (4, 130)]


def built_kernels(cache: Path) -> set:
    return {p.name.rsplit("-", 1)[0] for p in (cache / "kernels").iterdir()} if (cache / "kernels").exists() else set()


@pytest.mark.skipif(fake_driver.compiler() is None or fake_driver.real_driver_present(),
                    reason="needs a C compiler for the fake CUDA driver, and no real one")
@pytest.mark.parametrize("kind", ["awq", "ct-asym-act-order"])
def test_prebuild_builds_what_the_forward_asks_for(tmp_path, fake_env, monkeypatch, kind):  # noqa: F811
    from fake_gpu import FakeGpu

    monkeypatch.delenv("MIXGEMM_LAUNCHER", raising=False)
    cache = Path(os.environ["MIXGEMM_CACHE_DIR"])
    hc.WRITERS[kind](tmp_path / kind)
    model = hf.from_pretrained(tmp_path / kind, device="cpu", attn_implementation="eager", prebuild=True, jobs=2)
    built = built_kernels(cache)
    assert built == {s.name for s in specs_for(model)}
    assert [p.name.split("-")[0] for p in (cache / "host").iterdir()] == ["launcher"]
    # the forward, on the fake GPU, asks for exactly these
    asked = set()
    with FakeGpu(tmp_path / "fake", launcher_mode="python", helpers="fake") as gpu:
        gpu.driver.reset(params_size=ctypes.sizeof(driver.GemmArgs))
        get = gpu.kernels.get

        def recording_get(spec, device):
            asked.add(spec.name)
            return get(spec, device)

        monkeypatch.setattr(gpu.kernels, "get", recording_get)
        with torch.no_grad():
            for batch, length in SHAPES:
                model(hc.input_ids(batch=batch, length=length))
    assert asked == built
    # loading again with prebuild builds nothing: everything is cached
    calls = nvcc_calls(fake_env)
    hf.from_pretrained(tmp_path / kind, device="cpu", attn_implementation="eager", prebuild=True)
    assert nvcc_calls(fake_env) == calls
    # and the command line builds the same set into an empty cache
    monkeypatch.setenv("MIXGEMM_CACHE_DIR", str(tmp_path / "cli-cache"))
    assert main(["generate", "--build", "--for", str(tmp_path / kind), "-j", "2"]) == 0
    assert built_kernels(tmp_path / "cli-cache") == built


def test_prebuild_is_off_by_default_and_checks_jobs(tmp_path, fake_env):  # noqa: F811
    hc.WRITERS["awq"](tmp_path / "m")
    hf.from_pretrained(tmp_path / "m", device="cpu", attn_implementation="eager")
    assert not built_kernels(Path(os.environ["MIXGEMM_CACHE_DIR"]))
    with pytest.raises(ValueError, match="jobs must be a positive int"):
        hf.from_pretrained(tmp_path / "m", device="cpu", prebuild=True, jobs=0)


#: from_pretrained's fusion keywords (passed the same to the header reader) -> GEMMs per decoder layer
FUSIONS = {(): 4, (("fuse_projections", False),): 7, (("fuse_gate_up", False),): 5,
           (("fuse_projections", False), ("fuse_gate_up", True)): 6}


@pytest.mark.parametrize("kind", ["awq", "gptq-v1-act-order", "ct-8bit-channel", "mixgemm"])
def test_the_headers_give_the_shapes_the_loaded_model_runs(tmp_path, kind):
    """weight_uses(dir) (what ``generate --for`` builds for) is the loaded model's GEMMs, shape
    for shape: one [N_q + N_k + N_v, K] use per attention (not three), one swiglu use per MLP;
    with each fusion keyword passed to both."""
    hc.WRITERS[kind](tmp_path / kind)
    for items, per_layer in FUSIONS.items():
        kw = dict(items)
        model = hf.from_pretrained(tmp_path / kind, device="cpu", attn_implementation="eager", **kw)
        got = sorted(weight_uses(tmp_path / kind, **kw), key=repr)
        assert got == sorted(uses_of(model), key=repr), (kind, kw)
        assert len(got) == per_layer * hc.LAYERS, kw
        qkv = [u for u in got if u.name.endswith(".qkv_proj")]
        assert len(qkv) == (hc.LAYERS if kw.get("fuse_projections", True) else 0), kw
        assert all((u.n, u.k) == ((hc.HEADS + 2 * hc.KV_HEADS) * hc.HEAD_DIM, hc.HIDDEN) for u in qkv)
        assert [s.name for s in kernel_specs(tmp_path / kind, **kw)] == [s.name for s in specs_for(model)]


def test_the_headers_keep_q_k_and_v_apart_where_the_loader_does(tmp_path):
    """q/k/v of different group sizes: three uses, as the loader keeps three layers."""
    hc.write_mixgemm(tmp_path / "m", k_proj_group_size=128)
    model = hf.from_pretrained(tmp_path / "m", device="cpu", attn_implementation="eager")
    assert not model.mixgemm_summary.fused_attentions
    assert sorted(weight_uses(tmp_path / "m"), key=repr) == sorted(uses_of(model), key=repr)


def test_prebuild_with_fused_layers_builds_their_kernels(tmp_path, fake_env):  # noqa: F811
    """fuse_layers=True: prebuild also builds the residual RMSNorm and the rotary / KV-cache
    kernels that the fused decoder layers launch."""
    hc.WRITERS["awq"](tmp_path / "m")
    model = hf.from_pretrained(tmp_path / "m", device="cpu", attn_implementation="eager", fuse_layers=True,
                               prebuild=True, jobs=2)
    built = built_kernels(Path(os.environ["MIXGEMM_CACHE_DIR"]))
    assert built == {s.name for s in specs_for(model)} | {"mixgemm_add_rmsnorm_fp16", "mixgemm_rope_kv_fp16"}
