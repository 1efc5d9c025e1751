"""Where the mixgemm SmolLM2 model's bf16 logits drift: hidden states after every decoder layer,
mixgemm (bf16, kernels) vs float32 on mixgemm's weights, and transformers' bf16 vs float32 on gguf's."""
import os, sys, torch
sys.path.insert(0, "tests")
import hf_checkpoints as hc
import test_gguf_smollm2 as t
from mixgemm import hf
from pathlib import Path
src = Path(os.environ["MIXGEMM_SMOLLM2_GGUF"])
class TPF:
    def mktemp(self, name):
        import tempfile; return Path(tempfile.mkdtemp(prefix=name))
ck = t.checkpoint.__wrapped__(src, TPF())
r32 = t.reference32.__wrapped__(src)
dev = torch.device("cuda")
BF16 = torch.bfloat16
model = hf.from_pretrained(ck, device=dev, dtype=BF16, attn_implementation="sdpa")
own32 = hc.to_float32(hf.from_pretrained(ck, device="cpu", dtype=BF16, attn_implementation="sdpa")).to(dev)
own16 = hc.to_float32(hf.from_pretrained(ck, device="cpu", dtype=BF16, attn_implementation="sdpa")).to(dev).to(BF16)
lowp = t.reference(src, r32, BF16, "sdpa").to(dev)
full = t.reference(src, r32, torch.float32, "sdpa").to(dev)
def hiddens(m, ids):
    with torch.no_grad():
        out = m(ids, output_hidden_states=True)
    return [h.float() for h in out.hidden_states], out.logits.float()
for i in range(len(t.PROMPTS)):
    ids = t.prompt(i, dev)
    hm, lm = hiddens(model, ids); ho, lo = hiddens(own32, ids); h16, l16 = hiddens(own16, ids)
    hl, ll = hiddens(lowp, ids); hf32, lf = hiddens(full, ids)
    print(f"prompt {i}: layer: mixgemm-bf16 vs own32 | own-weights bf16 (F.linear) vs own32 | transformers bf16 vs f32")
    for j in range(len(hm)):
        if j % 3 == 0 or j == len(hm) - 1:
            print(f"  {j:2d}: {t.rel_err(hm[j], ho[j]):.4f} | {t.rel_err(h16[j], ho[j]):.4f} | {t.rel_err(hl[j], hf32[j]):.4f}")
    print(f"  logits: {t.rel_err(lm, lo):.4f} | {t.rel_err(l16, lo):.4f} | {t.rel_err(ll, lf):.4f}")
