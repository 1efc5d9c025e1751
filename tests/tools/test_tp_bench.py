"""benchmarks/tp_bench.py (the two-GPU tensor-parallel layer stack: check and timing) and
tests/gpu/hf_tp_check.py (from_pretrained with tp_size=2 on two GPUs), launched as a user
would: ``torchrun --nproc-per-node 2`` in a subprocess.

On the CPU: its argument checks, the kernel list, and ``--dry-run`` (gloo, a small preset, a
reference GEMM) end to end, so that the GPU run does not fail on a trivial bug. On a machine
with two Hopper GPUs (``-m gpu``): the llama3-70b-shaped stack at TP=2 against TP=1, under CUDA
graphs, timed; the figures go to ``$MIXGEMM_TP_JSON`` (default: a temporary file) and the
test passes on the script's correctness checks (the speed is reported, not asserted).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "tp_bench.py"
HF_SCRIPT = ROOT / "tests" / "gpu" / "hf_tp_check.py"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, timeout: int, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 SCRIPT ARGS`` in its own process group, which is killed
    whole (workers included) if it runs past ``timeout``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(script), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun ran past {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)


def test_arguments_are_checked():
    assert _script("--help").returncode == 0
    for bad, msg in ((["--json", "x.json", "--layers", "0"], "--layers must be >= 1"),
                     (["--json", "x.json", "--weight-type", "u3"], "--weight-type must be one of"),
                     ([], "--json PATH is required"),
                     (["--json", "x.json", "--model", "gpt2"], "invalid choice")):
        out = _script(*bad)
        assert out.returncode == 2 and msg in out.stderr, (bad, out.stderr)


def test_kernel_list_is_the_decode_kernels_of_both_splits():
    out = _script("--list-kernels")
    assert out.returncode == 0, out.stderr
    names = out.stdout.split()
    # the decode kernels (M = 1) of the plain and the swiglu linears, u4 bf16, the RMSNorms and the
    # rotary / KV-cache kernel
    decode = [n for n in names if n.startswith("mixgemm_decode_bf16_u4_")]
    assert decode and {n.rsplit("_", 1)[1] for n in decode} == {"none", "swiglu"}
    assert sorted(set(names) - set(decode)) == ["mixgemm_add_rmsnorm_bf16", "mixgemm_rmsnorm_bf16",
                                                "mixgemm_rope_kv_bf16"]


def test_dry_run_on_the_cpu(tmp_path):
    out_json = tmp_path / "tp.json"
    out = _torchrun("--dry-run", "--layers", "2", "--context", "16", "--json", str(out_json), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out_json.read_text())
    assert doc["ok"] and doc["tp"] == 2 and doc["dry_run"]
    assert doc["checks"] == {"same_on_every_rank": True, "tp_matches_tp1": True, "kv_matches_tp1": True}
    assert 0 < doc["err"] < 5e-2
    assert doc["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert "TP=1 vs TP=2" in out.stdout


@pytest.mark.gpu
@pytest.mark.multigpu
def test_tp2_llama3_70b_stack_on_two_gpus(requires_gpu, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    if shutil.which("nvcc") is None and not os.environ.get("MIXGEMM_CACHE_DIR"):
        pytest.skip("needs nvcc or a warm kernel cache")
    out_json = Path(os.environ.get("MIXGEMM_TP_JSON", tmp_path / "tp.json"))
    out = _torchrun("--layers", "4", "--json", str(out_json), timeout=900)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out_json.read_text())
    assert doc["ok"] and all(doc["checks"].values()), doc["checks"]
    assert doc["timing"]["tp1"]["median_us"] > 0 and doc["timing"]["tp2_step_us"] > 0


def test_hf_split_check_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    out_json = tmp_path / "hf_tp.json"
    out = _torchrun("--cpu", "--kinds", "awq", "--dir", str(tmp_path / "ckpt"), "--json", str(out_json),
                    timeout=300, script=HF_SCRIPT)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out_json.read_text())
    assert doc["ok"] and doc["kinds"]["awq"]["same_on_every_rank"]
    assert 0 < max(doc["kinds"]["awq"]["rel_err"]) < 1e-2      # fp16 roundings of the partial sums
    assert "rank 0 of 2" in doc["kinds"]["awq"]["summary"]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_hf_split_model_on_two_gpus(requires_gpu, tmp_path):
    pytest.importorskip("transformers")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    out_json = Path(os.environ.get("MIXGEMM_HF_TP_JSON", tmp_path / "hf_tp.json"))
    out = _torchrun("--dir", str(tmp_path / "ckpt"), "--json", str(out_json), timeout=900, script=HF_SCRIPT)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out_json.read_text())["ok"]


def test_profile_sorts_kernels_by_kind():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tp_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kinds = {"mixgemm_decode_bf16_u4_m8_w8_b1024_s4_k1_swiglu": "gemm",
             "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
             "cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35": "attention",
             "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>": "other"}
    assert {name: mod.kernel_kind(name) for name in kinds} == kinds
    lines = []
    prof = {"kernels_us": 10.0, "by_kind_us": {"gemm": 7.0, "other": 3.0},
            "kernels": [{"kernel": "mixgemm_decode_x", "kind": "gemm", "calls": 2.0, "us": 7.0}]}
    mod.print_profile(lines.append, "TP=1 profile", prof, 12.5)
    assert lines[0] == "  TP=1 profile: kernels 10.0 us of the 12.5 us step (gemm 7.0, other 3.0)"
    assert "mixgemm_decode_x" in lines[1]
