"""Random quantized weights, for the layout and shard tests of tests/weights/."""
import torch

from mixgemm.dtypes import WeightType
from mixgemm.weights.types import QuantizedWeight


def random_qw(n, k, bits, symmetric, group_size, dtype=torch.bfloat16, seed=0):
    """A QuantizedWeight with codes spread over the whole range of its type."""
    gen = torch.Generator().manual_seed(seed)
    wt = WeightType.of(bits, symmetric)
    q = torch.randint(wt.qmin, wt.qmax + 1, (n, k), generator=gen, dtype=torch.int16)
    q = q.to(torch.int8 if symmetric else torch.uint8)
    g = k // group_size
    scales = (torch.rand(n, g, generator=gen) * 0.1 + 1e-3).to(dtype)
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, wt.qmax + 1, (n, g), generator=gen).to(dtype)
    return QuantizedWeight(q, scales, zeros, bits, group_size, symmetric)
