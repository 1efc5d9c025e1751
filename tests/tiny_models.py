"""Tiny random transformers models (LLaMA, Qwen2, Qwen3) in shapes the kernels take, and a
QuantLinear forward that computes from the reference dequantization: the fused blocks' CPU tests
(tests/nn/test_blocks.py, tests/hf/test_hf.py) and their GPU run (tests/ops/test_gpu_compile.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="the fused blocks are transformers modules")

import mixgemm  # noqa: E402
from linear_numerics import swiglu  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402
from mixgemm.ops.fp8 import dequantize_fp8, quantize_fp8_reference  # noqa: E402


def tiny_model(family: str, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """A random 2-layer model of ``family`` in float32, shapes the kernels take."""
    common = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=layers, vocab_size=160, max_position_embeddings=256, rms_norm_eps=1e-5)
    if family == "llama":
        config = transformers.LlamaConfig(**common, head_dim=32)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
    else:
        config = transformers.Qwen3Config(**common, head_dim=32)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if family == "qwen2":       # Qwen2's q/k/v have a bias: make it non-zero
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_()
    return model.eval()


def reference_forward(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """QuantLinear.forward from the reference dequantization, in float32 (no GPU). With
    ``act_format="fp8"`` the activations are first what the e4m3 GEMM multiplies: x in the
    scales' dtype, rounded to e4m3 by the quantizer's definition, times its scales."""
    w = mixgemm.dequantize_reference(self.packed).float()
    if self.perm is not None:
        x = x.index_select(-1, self.perm)
    a = x.float()
    if self.act_format == "fp8":
        a = dequantize_fp8(*quantize_fp8_reference(x.to(self.scales.dtype), self.input_scale))
    y = F.linear(a, w, None if self.bias is None else self.bias.float()).to(x.dtype)
    return swiglu(y) if self.activation == "swiglu" else y
