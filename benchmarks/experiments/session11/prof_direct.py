"""Session 11 (runs on commit b79b5f3, where the direct kernel exists): one launch each of the ring (dec8) and register-direct (direct8) decode kernels at
M = 1, u4 g128, on a small and a large layer, for ncu (``ncu -k regex:mixgemm_decode``)."""
import torch

import mixgemm
from mixgemm import codegen, ops
from mixgemm.types import ActType, WeightType

dev = torch.device("cuda", 0)
labels = {tc.label: tc for tc in codegen.TILE_CONFIGS}
for n, k in ((4608, 3584), (57344, 8192)):
    w = torch.randn(n, k, device=dev) * 0.02
    packed = mixgemm.prepack(mixgemm.quantize(w, 4, 128, symmetric=False, dtype=torch.bfloat16))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    for label in ("dec8", "direct8"):
        spec = labels[label].spec(ActType.BF16, WeightType.U4)
        for _ in range(2):
            ops.gemm_with_spec(x, packed, spec)
        torch.cuda.synchronize()
        print(n, k, label, spec.name, flush=True)
