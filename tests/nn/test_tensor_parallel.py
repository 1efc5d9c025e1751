"""The tensor-parallel layers on the CPU: their sharding, and their collectives wired through a
real ``torch.distributed`` process group (gloo, two processes).

QuantLinear's GEMM needs an sm_90 GPU, so here ``QuantLinear.forward`` is replaced by a
reference (the exact dequantized weight, float64 products, one rounding): what is tested is
which rows, columns, bias slices and permutation entries each rank holds, and the all-gather /
all-reduce around the GEMM. ``benchmarks/tp_bench.py`` runs the real kernels on two GPUs.
"""
from __future__ import annotations

import socket
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_worker import exit_without_teardown, process_group
from mixgemm.nn import ColumnParallelQuantLinear, QuantLinear, RowParallelQuantLinear
from mixgemm.weights.quantize import GATE_UP_STRIPE, dequantize_reference

DTYPE = torch.bfloat16


def reference_forward(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """QuantLinear's result computed on the CPU: float64 products of the exact dequantized
    weight, the activation in float64, one rounding to x's dtype."""
    if self.perm is not None:
        x = x.index_select(-1, self.perm)
    y = x.double() @ dequantize_reference(self.packed).double().T
    if self.bias is not None:
        y = y + self.bias.double()
    if self.activation == "swiglu":
        pairs = y.view(*y.shape[:-1], -1, 2, GATE_UP_STRIPE)
        y = (F.silu(pairs[..., 0, :]) * pairs[..., 1, :]).reshape(*y.shape[:-1], -1)
    elif self.activation == "silu":
        y = F.silu(y)
    elif self.activation == "gelu":
        y = F.gelu(y)
    return y.to(x.dtype)


@pytest.fixture
def reference_gemm():
    with mock.patch.object(QuantLinear, "forward", reference_forward):
        yield


def _linear(n: int, k: int, seed: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(DTYPE)
    if bias:
        with torch.no_grad():
            lin.bias.normal_()
    return lin


def layers(seed: int = 0) -> dict:
    """Whole (unsharded) layers of every kind the tests shard."""
    torch.manual_seed(seed)
    qkv = QuantLinear.from_linear(_linear(128 + 2 * 64, 256, seed + 1), bits=4, group_size=64)
    gate, up = _linear(256, 256, seed + 2, bias=False), _linear(256, 256, seed + 3, bias=False)
    gate_up = QuantLinear.from_gate_up(gate, up, bits=4, group_size=128, symmetric=True)
    down = QuantLinear.from_linear(_linear(128, 256, seed + 4), bits=8, group_size=64, symmetric=True)
    silu = QuantLinear.from_linear(_linear(64, 128, seed + 5), bits=2, group_size=32)
    silu.activation = "silu"
    act_order = QuantLinear.from_packed(QuantLinear.from_linear(_linear(64, 256, seed + 6), bits=4,
                                                                group_size=64).packed,
                                        bias=torch.randn(64).to(DTYPE), perm=torch.randperm(256))
    per_channel = QuantLinear.from_linear(_linear(64, 256, seed + 7), bits=4, group_size=256)
    return dict(qkv=qkv, gate_up=gate_up, down=down, silu=silu, act_order=act_order, per_channel=per_channel)


def test_column_shards_concatenate_to_the_whole_output(reference_gemm):
    """Without a process group (tp_rank / tp_size given): each rank's output features are the
    whole layer's slice, for plain, silu, swiglu and sectioned (q/k/v) layers."""
    whole = layers()
    x = torch.randn(3, 256).to(DTYPE)
    for name, sections in (("qkv", (128, 64, 64)), ("gate_up", None), ("qkv", None)):
        layer = whole[name]
        y = layer(x)
        outs = [ColumnParallelQuantLinear.from_quant_linear(layer, tp_rank=r, tp_size=2, gather_output=False,
                                                            sections=sections)(x) for r in range(2)]
        if sections is None:
            assert torch.equal(torch.cat(outs, -1), y), name
        else:   # each rank holds its slice of q, of k and of v
            q, k, v = y.split(sections, -1)
            for r, out in enumerate(outs):
                want = torch.cat([t.chunk(2, -1)[r] for t in (q, k, v)], -1)
                assert torch.equal(out, want)
    x = torch.randn(2, 128).to(DTYPE)
    y = whole["silu"](x)
    outs = [ColumnParallelQuantLinear.from_quant_linear(whole["silu"], tp_rank=r, tp_size=2,
                                                        gather_output=False)(x) for r in range(2)]
    assert torch.equal(torch.cat(outs, -1), y)


def test_tp_size_one_needs_no_process_group(reference_gemm):
    whole = layers()
    x = torch.randn(2, 256).to(DTYPE)
    col = ColumnParallelQuantLinear.from_quant_linear(whole["qkv"], tp_rank=0, tp_size=1)
    row = RowParallelQuantLinear.from_quant_linear(whole["down"], tp_rank=0, tp_size=1, input_is_parallel=False)
    assert torch.equal(col(x), whole["qkv"](x))
    # the bias is added after the (here empty) reduction, to the rounded product
    assert torch.equal(row(x), QuantLinear.from_packed(whole["down"].packed)(x) + whole["down"].bias)


def test_bad_splits_are_refused():
    whole = layers()
    with pytest.raises(ValueError, match="pass tp_rank and tp_size"):
        ColumnParallelQuantLinear.from_quant_linear(whole["qkv"])
    with pytest.raises(ValueError, match="cannot split a 'swiglu' layer along K"):
        RowParallelQuantLinear.from_quant_linear(whole["gate_up"], tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="input_is_parallel=False"):
        RowParallelQuantLinear.from_quant_linear(whole["act_order"], tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="whole 16-row atoms"):
        ColumnParallelQuantLinear.from_quant_linear(whole["qkv"], tp_rank=0, tp_size=2, sections=(160, 48, 48))
    with pytest.raises(ValueError, match="one section"):
        ColumnParallelQuantLinear.from_quant_linear(whole["gate_up"], tp_rank=0, tp_size=2, sections=(256, 256))
    with pytest.raises(ValueError, match="tp_rank < tp_size"):
        ColumnParallelQuantLinear.from_quant_linear(whole["qkv"], tp_rank=2, tp_size=2)
    with pytest.raises(TypeError, match="QuantLinear"):
        ColumnParallelQuantLinear.from_quant_linear(nn.Linear(64, 64), tp_rank=0, tp_size=2)


def test_state_dict_round_trip_and_rank_mismatch():
    whole = layers()
    src = RowParallelQuantLinear.from_quant_linear(whole["down"], tp_rank=1, tp_size=2)
    sd = src.state_dict()
    assert set(k for k in sd if not k.startswith("linear.")) == {"bias", "_extra_state"}
    dst = RowParallelQuantLinear.from_quant_linear(whole["down"], tp_rank=1, tp_size=2)
    dst.load_state_dict(sd)
    other = RowParallelQuantLinear.from_quant_linear(whole["down"], tp_rank=0, tp_size=2)
    with pytest.raises((ValueError, RuntimeError), match="mismatch"):
        other.load_state_dict(sd)


# ---------------------------------------------------------------------------------------------
# Two processes, a gloo process group: the collectives
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int) -> None:
    with process_group(rank=rank, world_size=world, port=port):
        with mock.patch.object(QuantLinear, "forward", reference_forward):
            _check_collectives(rank, world)
    exit_without_teardown()         # passed (see tests/dist_worker.py for why)


def _check_collectives(rank: int, world: int) -> None:
    whole = layers(seed=5)                 # the same weights in every process (seeded)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 256, generator=gen).to(DTYPE)

    # column parallel, gathered: the whole output, exactly (each feature is computed alone)
    for name, sections in (("qkv", (128, 64, 64)), ("gate_up", None)):
        col = ColumnParallelQuantLinear.from_quant_linear(whole[name], sections=sections)   # rank from the group
        assert (col.tp_rank, col.tp_size) == (rank, world)
        assert torch.equal(col(x), whole[name](x)), name

    # row parallel: the sum of the ranks' rounded partial products, then the bias once
    def partial(layer, r, x_full):
        shard = RowParallelQuantLinear.from_quant_linear(layer, tp_rank=r, tp_size=world, input_is_parallel=False)
        xin = x_full if shard.linear.perm is not None else x_full.chunk(world, -1)[r]
        return shard.linear(xin)

    for name in ("down", "act_order", "per_channel"):
        layer = whole[name]
        row = RowParallelQuantLinear.from_quant_linear(layer, input_is_parallel=False)
        got = row(x)
        parts = [partial(layer, r, x) for r in range(world)]
        want = sum(p.float() for p in parts).to(DTYPE)
        if layer.bias is not None:
            want = want + layer.bias
        assert torch.equal(got, want), name
        full = whole[name](x).double()
        assert float((got.double() - full).norm() / full.norm()) < 1e-2, name   # bf16 roundings only

    # the input already split: a column-parallel gate/up (not gathered), then a row-parallel down
    up = ColumnParallelQuantLinear.from_quant_linear(whole["gate_up"], gather_output=False)
    down = RowParallelQuantLinear.from_quant_linear(whole["down"], input_is_parallel=True)
    mid = up(x)
    assert mid.shape[-1] == 256 // world
    got = down(mid)
    ref = whole["down"](whole["gate_up"](x)).double()
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-2
    # every rank ends with the same tensor
    gathered = [torch.empty_like(got) for _ in range(world)]
    import torch.distributed as dist
    dist.all_gather(gathered, got)
    assert all(torch.equal(g, got) for g in gathered)


def test_collectives_with_a_gloo_process_group():
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)
