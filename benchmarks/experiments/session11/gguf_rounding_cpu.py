"""Session 11: is the extra logits drift of the SmolLM2 Q4_1 model on the GPU (NOTES 12: 4.6%
against 2.9% for F.linear on the same weights, prompt 0) the fractional zero offsets' extra
rounding? On the CPU, every QuantLinear is replaced by an emulation of one numeric path, and
the model's logits are compared with float32 on mixgemm's own weights:

* ``kernel``: what the GPU path computes: the kernel's float32 sum of exact ``(q - z) * s``
  products rounded to bf16, then ``+ xsum @ o`` in float32 and a second rounding
  (plans.add_zero_offsets), then the activation (swiglu) in torch;
* ``one-rounding``: the offsets added to the float32 sum before the one output rounding (what a
  kernel epilogue that adds them would compute);
* ``F.linear``: bf16 F.linear on mixgemm's dequantized bf16 weights (the GPU test's "own16").

    MIXGEMM_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf python benchmarks/experiments/session11/gguf_rounding_cpu.py
"""
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, "tests")
import test_gguf_smollm2 as t  # noqa: E402
from mixgemm import dequantize_reference, hf  # noqa: E402
from mixgemm.layout import unpack  # noqa: E402
from mixgemm.nn import QuantLinear  # noqa: E402
from mixgemm.quantize import GATE_UP_STRIPE  # noqa: E402

BF16 = torch.bfloat16


class TPF:
    def mktemp(self, name):
        return Path(tempfile.mkdtemp(prefix=name))


class Emulated(torch.nn.Module):
    def __init__(self, q: QuantLinear, mode: str):
        super().__init__()
        qw = unpack(q.packed)
        s = qw.scales.float().repeat_interleave(qw.group_size, 1)
        z = qw.zeros.float().repeat_interleave(qw.group_size, 1)
        self.wq = (qw.qweight.float() - z) * s                              # exact (q - z) * s
        self.o = (torch.zeros_like(self.wq) if qw.zero_offsets is None
                  else qw.zero_offsets.float().repeat_interleave(qw.group_size, 1))
        self.w16 = dequantize_reference(q.packed).float()
        self.mode, self.activation = mode, q.activation
        assert q.bias is None and q.perm is None

    def forward(self, x):
        x32 = x.float()
        if self.mode == "kernel":
            y = (x32 @ self.wq.T).to(BF16)
            y = (y.float() + x32 @ self.o.T).to(BF16)
        elif self.mode == "one-rounding":
            y = (x32 @ (self.wq + self.o).T).to(BF16)
        elif self.mode == "F.linear":
            y = (x32 @ self.w16.T).to(BF16)
        else:   # float32
            y = x32 @ self.w16.T
        if self.activation == "swiglu":
            pairs = y.float().view(*y.shape[:-1], -1, 2, GATE_UP_STRIPE)
            y = (F.silu(pairs[..., 0, :]) * pairs[..., 1, :]).reshape(*y.shape[:-1], -1).to(y.dtype)
        return y.to(x.dtype)


def build(ck, mode):
    model = hf.from_pretrained(ck, device="cpu", dtype=BF16, attn_implementation="eager")
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantLinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, Emulated(mod, mode))
    return model.float() if mode == "float32" else model


src = Path(os.environ["MIXGEMM_SMOLLM2_GGUF"])
ck = t.checkpoint.__wrapped__(src, TPF())
models = {m: build(ck, m) for m in ("float32", "kernel", "one-rounding", "F.linear")}
for i in range(len(t.PROMPTS)):
    ids = t.prompt(i)
    with torch.no_grad():
        logits = {m: mod(ids).logits.float() for m, mod in models.items()}
    ref = logits.pop("float32")
    print(f"prompt {i} ({ids.shape[1]} tokens): logits vs float32 on mixgemm's weights: "
          + ", ".join(f"{m} {t.rel_err(v, ref):.4f}" for m, v in logits.items()), flush=True)
