"""mixgemm.ops.layer.decode_layer's refusals (the step itself is checked against the part-by-part
fused layer in tests/nn/test_blocks.py on the CPU and tests/ops/test_gpu_compile.py on the GPU)."""
from __future__ import annotations

import pytest
import torch

from mixgemm.ops import decode_layer


def _args(**change):
    h, d, heads, kv = 64, 16, 2, 1
    x = torch.randn(1, 1, h)
    k_cache, v_cache = torch.zeros(1, kv, 8, d), torch.zeros(1, kv, 8, d)
    args = dict(x=x, norms=[torch.ones(h), torch.ones(h)], eps=[1e-6, 1e-6], weights=[None] * 16,
                weight_types="u4,u4,u4,u4", shapes=[64, 64, 64] * 4, cos=torch.ones(8, d), sin=torch.zeros(8, d),
                k_cache=k_cache, v_cache=v_cache, positions=torch.zeros(1, 1, dtype=torch.long),
                counter=torch.zeros(1, dtype=torch.long), heads=heads, kv_heads=kv, scaling=d ** -0.5,
                mask=torch.ones(1, 1, 1, 8, dtype=torch.bool))
    args.update(change)
    return args


@pytest.mark.parametrize("change, message", [
    (dict(norms=[torch.ones(64)]), "2 norms"),
    (dict(weights=[None] * 12), "16 weight tensors"),
    (dict(shapes=[64] * 9), "12 sizes"),
    (dict(weight_types="u4,u4"), "4 weight types"),
    (dict(mask=None), "needs a mask"),
    (dict(lengths=torch.ones(1, dtype=torch.int32)), "together"),
])
def test_bad_arguments_are_refused_before_anything_is_written(change, message):
    args = _args(**change)
    with pytest.raises(ValueError, match=message):
        decode_layer(**args)
    assert not args["k_cache"].any() and not args["v_cache"].any() and int(args["counter"]) == 0
