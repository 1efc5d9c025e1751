"""Tensor-parallel imports on the CPU: the converters of mixgemm.formats, import_layer and
mixgemm.load with ``tp_rank`` / ``tp_size`` return the rank's shard, equal to the same slice
of the whole layer's import (codes, scales, zeros, bias and act-order permutation), and refuse
splits the layer cannot take."""
from __future__ import annotations

import pytest
import torch

import mixgemm
from mixgemm.errors import ShardError
from mixgemm.formats import from_awq, from_compressed_tensors, from_gptq, import_layer
from mixgemm.weights.layout import prepack

import reference_packers as rp   # the formats' independent reference packers

N, K, GS = 64, 512, 128


def awq_tensors(seed=0, n=N, k=K, gs=GS):
    gen = rp.gen_for("tp-awq", seed)
    q_kn = rp.rand_codes((k, n), 4, gen)
    z_gn = rp.rand_codes((k // gs, n), 4, gen)
    return dict(qweight=rp.awq_pack(q_kn), qzeros=rp.awq_pack(z_gn), scales=rp.rand_scales((k // gs, n), rp.FP16, gen))


def assert_same_qw(a, b, what=""):
    assert (a.bits, a.group_size, a.symmetric, a.n, a.k) == (b.bits, b.group_size, b.symmetric, b.n, b.k), what
    for name in ("qweight", "scales", "zeros", "zero_offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), (what, name)
        if x is not None:
            assert torch.equal(x, y), (what, name)


@pytest.mark.parametrize("dim", [0, 1])
def test_awq_shard_is_the_slice_of_the_whole_import(dim):
    t = awq_tensors()
    whole = from_awq(**t, group_size=GS)
    for rank in range(2):
        got = from_awq(**t, group_size=GS, tp_rank=rank, tp_size=2, tp_dim=dim)
        assert_same_qw(got.qweight, whole.qweight.shard(dim, rank, 2), f"rank {rank}")
        assert got.qweight.k == (K if dim == 0 else K // 2) and got.qweight.n == (N // 2 if dim == 0 else N)
        # prepack of the shard = shard of the whole prepacked layer
        assert torch.equal(prepack(got.qweight).qdata, prepack(whole.qweight).shard(dim, rank, 2).qdata)


def test_gptq_act_order_shards_keep_the_permutation():
    k, gs, bits = 384, 64, 4
    gen = rp.gen_for("tp-gptq", 1)
    g_idx = rp.random_act_order_g_idx(k, gs, gen)
    t = rp.make_gptq(k, gs, bits, False, "gptq", rp.FP16, gen, g_idx=g_idx)
    whole = from_gptq(**t, checkpoint_format="gptq", bits=bits, group_size=gs)
    assert whole.perm is not None
    # column parallel: the rank's rows, the whole permutation (it selects input columns)
    col = from_gptq(**t, checkpoint_format="gptq", bits=bits, group_size=gs, tp_rank=1, tp_size=3, tp_dim=0)
    assert_same_qw(col.qweight, whole.qweight.shard(0, 1, 3))
    assert torch.equal(col.perm, whole.perm)
    # row parallel: the rank's entries of the permutation, indices into the whole input
    x = torch.randint(-4, 5, (2, k), generator=gen).double()
    y = whole.permute_input(x) @ mixgemm.dequantize_reference(whole.qweight).double().t()
    parts = []
    for rank in range(2):
        row = from_gptq(**t, checkpoint_format="gptq", bits=bits, group_size=gs, tp_rank=rank, tp_size=2, tp_dim=1)
        assert torch.equal(row.perm, whole.perm[rank * k // 2:(rank + 1) * k // 2])
        parts.append(row.permute_input(x) @ mixgemm.dequantize_reference(row.qweight).double().t())
    assert torch.equal(parts[0] + parts[1], y)     # exact: small integers times 2^-k scales


def test_compressed_tensors_and_import_layer_shard_the_bias():
    k, gs, bits = 256, 64, 4
    gen = rp.gen_for("tp-ct", 2)
    t = rp.make_ct(k, gs, bits, False, rp.BF16, gen)
    whole = from_compressed_tensors(**t, bits=bits, group_size=gs)
    half = from_compressed_tensors(**t, bits=bits, group_size=gs, tp_rank=1, tp_size=3, tp_dim=0)
    assert_same_qw(half.qweight, whole.qweight.shard(0, 1, 3))

    n = whole.qweight.n
    tensors = {f"l.{name}": v for name, v in t.items()}
    tensors["l.bias"] = torch.randn(n, generator=gen).to(rp.BF16)
    for dim in (0, 1):
        for rank in range(3 if dim == 0 else 2):
            size = 3 if dim == 0 else 2
            got = import_layer("compressed-tensors", tensors, "l", bits=bits, group_size=gs, tp_rank=rank,
                               tp_size=size, tp_dim=dim)
            assert_same_qw(got.qweight, whole.qweight.shard(dim, rank, size))
            want_bias = tensors["l.bias"].chunk(size)[rank] if dim == 0 else tensors["l.bias"]
            assert torch.equal(got.bias, want_bias)   # row parallel: the whole bias, added once


def test_sections_split_each_section():
    t = awq_tensors(seed=3, n=128)
    whole = from_awq(**t, group_size=GS)
    tensors = {f"qkv.{k}": v for k, v in t.items()}
    tensors["qkv.bias"] = torch.arange(128, dtype=torch.float16)
    got = import_layer("awq", tensors, "qkv", tp_rank=1, tp_size=2, tp_sections=(64, 32, 32))
    assert_same_qw(got.qweight, whole.qweight.shard(0, 1, 2, sections=(64, 32, 32)))
    assert got.bias.tolist() == list(range(32, 64)) + list(range(80, 96)) + list(range(112, 128))


def test_bad_splits_are_refused_with_the_layer_name():
    t = awq_tensors()
    with pytest.raises(ShardError, match=r"'q_proj'.*16-row atoms"):
        from_awq(**t, group_size=GS, name="q_proj", tp_rank=0, tp_size=8, tp_dim=0)   # 8 rows
    with pytest.raises(ShardError, match=r"'o_proj'.*whole groups of 128"):
        from_awq(**t, group_size=GS, name="o_proj", tp_rank=0, tp_size=8, tp_dim=1)   # 64 columns
    with pytest.raises(ShardError, match="64-column atoms"):
        from_awq(**t, group_size=GS, tp_rank=0, tp_size=16, tp_dim=1)                 # 32 columns
    with pytest.raises(ValueError, match="tp_rank < tp_size"):
        from_awq(**t, group_size=GS, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="tp_dim must be 0"):
        from_awq(**t, group_size=GS, tp_rank=0, tp_size=2, tp_dim=2)
    with pytest.raises(TypeError, match="tp_size must be an int"):
        from_awq(**t, group_size=GS, tp_rank=0, tp_size=2.0)
    assert issubclass(ShardError, ValueError)


def test_load_shards_the_named_packed_weights(tmp_path):
    gen = torch.Generator().manual_seed(5)
    q = prepack(mixgemm.quantize(torch.randn(64, 256, generator=gen), 4, 64, dtype=torch.bfloat16))
    o = prepack(mixgemm.quantize(torch.randn(32, 256, generator=gen), 8, 128, symmetric=True, dtype=torch.bfloat16))
    norm = torch.randn(256)
    path = tmp_path / "m.safetensors"
    mixgemm.save(str(path), {"q.weight": q, "o.weight": o, "norm": norm})
    for rank in range(2):
        got = mixgemm.load(path, tp_rank=rank, tp_size=2, tp_dims={"q.weight": 0, "o.weight": 1})
        for name, want in (("q.weight", q.shard(0, rank, 2)), ("o.weight", o.shard(1, rank, 2))):
            assert (got[name].n, got[name].k) == (want.n, want.k)
            assert torch.equal(got[name].qdata, want.qdata) and torch.equal(got[name].scales, want.scales)
        assert torch.equal(got["norm"], norm)
    kept = mixgemm.load(path, tp_rank=1, tp_size=2, tp_dims={"q.weight": 0})
    assert torch.equal(kept["o.weight"].qdata, o.qdata)        # not named: replicated
    with pytest.raises(ValueError, match="needs tp_dims"):
        mixgemm.load(path, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="not packed weights"):
        mixgemm.load(path, tp_rank=0, tp_size=2, tp_dims={"norm": 0})
    with pytest.raises(ShardError, match="'o.weight'.*whole groups of 128"):
        mixgemm.load(path, tp_rank=0, tp_size=4, tp_dims={"o.weight": 1})
