"""For ncu: python ncu_cfg.py N K M BITS TOK KS SPLITS [act]"""
import sys
import torch
import mixgemm
from mixgemm import ops
from mixgemm.specs import Activation, DecodeSpec
from mixgemm.types import ActType, WeightType
n, k, m, bits, tok, ks, s = (int(a) for a in sys.argv[1:8])
act = sys.argv[8] if len(sys.argv) > 8 else None
dev = torch.device("cuda", 0)
w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
pw = mixgemm.prepack(mixgemm.quantize(w, bits, 128, symmetric=(bits == 8)))
wt = pw.weight_type
spec = DecodeSpec(ActType.BF16, wt, tok, 8, max(1024, 128 * bits), 4, Activation(act or "none"), ks)
x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
buf = torch.empty(100 << 20, dtype=torch.uint8, device=dev)
for i in range(6):
    buf.fill_(i)
    y = ops.gemm_with_spec(x, pw, spec, activation=act, splits=s)
torch.cuda.synchronize()
print("done", spec.name, s)
