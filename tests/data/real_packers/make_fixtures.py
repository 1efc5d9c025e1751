"""Write the AWQ and GPTQ fixtures of tests/formats/test_formats_real_packers.py with the real packers.

AutoAWQ and AutoGPTQ need an older transformers (and CUDA) to import as packages, so this script
loads only their layer modules -- the code that packs a layer and the torch path that
dequantizes it -- from the installed distributions, with empty parent packages in place of their
``__init__`` (which import the model classes). Each case packs a seeded random weight with the
library's own ``pack`` / ``from_linear``, then computes the library's own dequantized weight by
running its layer's forward on the CPU (its torch path) on an identity input, and stores both::

    pip install --no-deps --target /tmp/agptq auto-gptq==0.7.1
    pip install --no-deps --target /tmp/aawq autoawq==0.2.9
    pip install --no-deps --target /tmp/accel accelerate
    PYTHONPATH=/tmp/agptq:/tmp/aawq:/tmp/accel python tests/data/real_packers/make_fixtures.py

Written with auto-gptq 0.7.1, autoawq 0.2.9, torch 2.13.0 (CPU). GPTQModel's fixtures (v1 and
gptq_v2 exports) are written by make_fixtures_gptqmodel.py, beside this script.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent


def bare_package(name: str) -> None:
    """Make ``name`` (and its parents) importable as namespace-like packages that run no
    ``__init__``: their submodules load from the installed files."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        full = ".".join(parts[:i])
        if full in sys.modules:
            continue
        spec = importlib.util.find_spec(parts[0]) if i == 1 else None
        root = Path(spec.submodule_search_locations[0]) if spec else Path(sys.modules[parts[0]].__path__[0])
        mod = types.ModuleType(full)
        mod.__path__ = [str(root.joinpath(*parts[1:i]))]
        sys.modules[full] = mod


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool):
    """Round-to-nearest scales and zero points ``[N, G]`` as GPTQ / AWQ's quantizers make them
    (min/max per group; symmetric: zero at 2^(b-1))."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    qmax = 2 ** bits - 1
    if sym:
        amax = wg.abs().amax(-1).clamp(min=1e-5)
        scale = 2 * amax / qmax
        zero = torch.full_like(scale, (qmax + 1) // 2)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / qmax).clamp(min=1e-5)
        zero = torch.round(-lo / scale).clamp(0, qmax)
    return scale, zero


def library_dequant(layer, k: int, dtype) -> torch.Tensor:
    """The layer's own weight ``[N, K]``: its forward (the torch path) on the identity."""
    with torch.no_grad():
        return layer(torch.eye(k, dtype=dtype)).t().contiguous()


def gptq_case(name, bits, group, sym, act_order=False, k=256, n=64, zero_point_zero=False, seed=0):
    from auto_gptq.nn_modules.qlinear import qlinear_cuda as q

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = w.half().float()
    scale, zero = rtn(lin.weight.data, bits, group, sym)
    if zero_point_zero:                       # every group's minimum at 0: the zero point 0
        lin.weight.data = lin.weight.data.abs()
        scale, zero = rtn(lin.weight.data, bits, group, sym)
        zero[:] = 0
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
        scale, zero = scale, zero   # groups by g_idx: quantize each column with its group's parameters
    layer = q.QuantLinear(bits, group, k, n, bias=False, weight_dtype=torch.float16)
    layer.g_idx = g_idx.to(torch.int32)
    layer.pack(lin, scale.half(), zero, g_idx.to(torch.int32))
    layer.autogptq_cuda_available = False
    ref = library_dequant(layer.half().float(), k, torch.float32).half()
    tensors = {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales.half(),
               "g_idx": layer.g_idx.to(torch.int32), "reference": ref}
    meta = {"library": "auto-gptq", "version": importlib.metadata.version("auto-gptq"), "packer": "qlinear_cuda",
            "bits": bits, "group_size": group, "sym": sym, "act_order": act_order,
            "checkpoint_format": "gptq", "zero_point_zero": zero_point_zero}
    save_file(tensors, str(OUT / f"{name}.safetensors"), metadata={"case": json.dumps(meta)})
    print(name, meta)


def awq_case(name, group, k=256, n=64, seed=0):
    from awq.modules.linear.gemm import WQLinear_GEMM

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = (torch.randn(n, k, generator=g) * 0.02).half().float()
    group = k if group == -1 else group
    scale, zero = rtn(lin.weight.data, 4, group, False)
    layer = WQLinear_GEMM.from_linear(lin, 4, group, scales=scale.t().contiguous().half(),
                                      zeros=zero.t().contiguous().to(torch.int32))   # ([G, N], as its quantizer passes them)
    ref = library_dequant(layer, k, torch.float16)
    tensors = {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales.half(), "reference": ref}
    meta = {"library": "autoawq", "version": importlib.metadata.version("autoawq"), "packer": "WQLinear_GEMM",
            "bits": 4, "group_size": group, "sym": False}
    save_file(tensors, str(OUT / f"{name}.safetensors"), metadata={"case": json.dumps(meta)})
    print(name, meta)


def main() -> None:
    bare_package("auto_gptq.nn_modules.qlinear")
    bare_package("awq.modules.linear")
    bare_package("awq.utils")
    gptq_case("gptq-v1-4bit-sym-g64", 4, 64, True)
    gptq_case("gptq-v1-4bit-asym-g64", 4, 64, False)
    gptq_case("gptq-v1-4bit-asym-act-order-g64", 4, 64, False, act_order=True)
    gptq_case("gptq-v1-8bit-asym-g128", 8, 128, False)
    gptq_case("gptq-v1-2bit-asym-g64", 2, 64, False)
    gptq_case("gptq-v1-3bit-asym-g64", 3, 64, False)
    gptq_case("gptq-v1-4bit-zero-point-zero-g64", 4, 64, False, zero_point_zero=True)
    awq_case("awq-g128", 128)
    awq_case("awq-per-channel", -1)


if __name__ == "__main__":
    main()
