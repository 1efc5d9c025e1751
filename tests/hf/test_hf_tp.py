"""mixgemm.hf.from_pretrained with tensor parallelism, on the CPU.

Two processes joined by a gloo process group each load their rank's part of a tiny LLaMA
checkpoint (tests/hf_checkpoints.py) with ``tp_size=2``; their logits must equal those of the
same checkpoint loaded whole (``tp_size=1``). QuantLinear's GEMM needs an sm_90 GPU, so each
QuantLinear is swapped for a float32 linear on its own dequantized weight (its shard's, for the
split model) and the model runs in float32: what is tested is which rows, columns, heads,
biases and features each rank holds, the all-reduces of the row-parallel layers, and the
config the rank's model is built from. Splits a model cannot take must be refused before the
device step.
"""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers", reason="mixgemm.hf needs transformers (pip install 'mixgemm[hf]')")

import hf_checkpoints as hc  # noqa: E402
from dist_worker import exit_without_teardown, process_group  # noqa: E402
import mixgemm  # noqa: E402
from mixgemm import hf  # noqa: E402
from mixgemm.nn.blocks import FusedDecoderLayer  # noqa: E402
from mixgemm.errors import ShardError  # noqa: E402
from mixgemm.hf import materialize  # noqa: E402
from mixgemm.nn import ColumnParallelQuantLinear, QuantLinear, RowParallelQuantLinear  # noqa: E402
from mixgemm.weights.quantize import GATE_UP_STRIPE  # noqa: E402
from mixgemm.nn.parallel import RowParallelLinear  # noqa: E402

#: checkpoints loaded split and whole: asymmetric AWQ with tied embeddings, a per-channel 2-bit
#: GPTQ (a per-channel weight stays per-channel over its K slice), a mixgemm file, and
#: compressed-tensors whose o_proj is kept in full precision (the plain row-parallel layer)
KINDS = {
    "awq-tied": lambda d: hc.write_awq(d, tie=True, shards=1),
    "gptq-v2-2bit-channel": lambda d: hc.write_gptq(d, bits=2, group_size=-1, fmt="gptq_v2"),
    "mixgemm": lambda d: hc.write_mixgemm(d),
    "ct-o-proj-full": lambda d: hc.write_compressed_tensors(d, tensor_strategy_o_proj=True),
}


class _Reference(nn.Module):
    """A QuantLinear's result in float32 on the CPU: its exact dequantized weight, its bias,
    input permutation and swiglu epilogue."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self.register_buffer("w", mixgemm.dequantize_reference(q.packed).float())
        self.register_buffer("b", None if q.bias is None else q.bias.detach().float())
        self.register_buffer("perm", q.perm)
        self.activation = q.activation
        self.in_features, self.out_features = q.in_features, q.out_features

    def forward(self, x):
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        y = F.linear(x.float(), self.w, self.b)
        if self.activation == "swiglu":
            pairs = y.view(*y.shape[:-1], -1, 2, GATE_UP_STRIPE)
            y = (F.silu(pairs[..., 0, :]) * pairs[..., 1, :]).reshape(*y.shape[:-1], -1)
        return y


def to_float32(model: nn.Module) -> nn.Module:
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantLinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, _Reference(mod))
    return model.float()


def load(model_dir, **kw):
    return hf.from_pretrained(model_dir, device="cpu", attn_implementation="eager", **kw)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return to_float32(model)(hc.input_ids()).logits


def check_rank_model(model, whole, rank: int, kind: str) -> None:
    """The rank's model: half the heads and MLP features, split layers wrapped, the rest whole."""
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == \
        (hc.HEADS // 2, hc.KV_HEADS // 2, hc.HEAD_DIM, 256)
    summary = model.mixgemm_summary
    assert (summary.tp_rank, summary.tp_size) == (rank, 2) and f"rank {rank} of 2" in str(summary)
    q, kv = hc.HEADS * hc.HEAD_DIM, hc.KV_HEADS * hc.HEAD_DIM
    assert summary.fused_attentions == [f"model.layers.{i}.self_attn" for i in range(hc.LAYERS)]
    for i in range(hc.LAYERS):
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        # one q/k/v layer: the rank's q rows, then its k rows, then its v rows; the rank's heads
        assert isinstance(attn, hf.FusedQKVAttention)
        assert (attn.heads, attn.kv_heads, attn.head_dim) == (hc.HEADS // 2, hc.KV_HEADS // 2, hc.HEAD_DIM)
        assert attn.sections == (q // 2, kv // 2, kv // 2) and attn.num_key_value_groups == hc.HEADS // hc.KV_HEADS
        layer = attn.qkv_proj
        assert isinstance(layer, ColumnParallelQuantLinear) and not layer.gather_output
        assert (layer.linear.out_features, layer.in_features, layer.out_features) == ((q + 2 * kv) // 2, hc.HIDDEN,
                                                                                      q + 2 * kv)
        assert layer.local_sections == attn.sections
        want = whole.model.layers[i].self_attn.qkv_proj.packed.shard(0, rank, 2, sections=(q, kv, kv))
        assert torch.equal(layer.linear.packed.qdata, want.qdata) and torch.equal(layer.linear.scales, want.scales)
        o = attn.o_proj
        if kind == "ct-o-proj-full":
            assert isinstance(o, RowParallelLinear) and o.weight.shape == (hc.HIDDEN, hc.HIDDEN // 2)
            assert torch.equal(o.weight, whole.model.layers[i].self_attn.o_proj.weight.chunk(2, 1)[rank])
        else:
            assert isinstance(o, RowParallelQuantLinear) and o.linear.in_features == hc.HIDDEN // 2
        assert isinstance(mlp, hf.GatedMLP) and isinstance(mlp.gate_up, ColumnParallelQuantLinear)
        assert mlp.gate_up.linear.out_features == 256 and mlp.gate_up.out_features == 512
        assert isinstance(mlp.down_proj, RowParallelQuantLinear) and mlp.down_proj.linear.in_features == 256
    assert model.lm_head.weight.shape == (hc.VOCAB, hc.HIDDEN)            # replicated
    assert torch.equal(model.lm_head.weight, whole.lm_head.weight)
    # each rank holds half the quantized bytes (within the per-layer scale rounding)
    ratio = summary.quantized_bytes / whole.mixgemm_summary.quantized_bytes
    assert 0.45 < ratio < 0.55, ratio


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist

    with process_group(rank=rank, world_size=world, port=port):
        torch.set_num_threads(1)
        for kind in KINDS:
            path = Path(root) / kind
            whole = load(path)
            split = load(path, tp_rank=rank, tp_size=world)
            check_rank_model(split, whole, rank, kind)
            want, got = logits(whole), logits(split)
            # the same products, summed in another order (two partial sums, one all-reduce)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{kind}: {m}")
            # every rank computes the same logits
            others = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(others, got)
            assert all(torch.equal(o, got) for o in others), kind
            if kind == "awq-tied":    # mixgemm's decoder layers over the rank's fused projections
                layers = load(path, tp_rank=rank, tp_size=world, fuse_layers=True)
                assert all(isinstance(layer, FusedDecoderLayer) for layer in layers.model.layers)
                torch.testing.assert_close(logits(layers), got, rtol=1e-4, atol=1e-4)
    exit_without_teardown()         # passed (see tests/dist_worker.py for why)


def test_split_model_gives_the_whole_models_logits(tmp_path):
    import torch.multiprocessing as mp

    for kind, write in KINDS.items():
        write(tmp_path / kind)
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)


# ---------------------------------------------------------------------------------------------
# Refusals, all before the device step
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_device_step(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained reached the device step")
    monkeypatch.setattr(materialize, "materialize", refuse)


def test_splits_the_model_cannot_take_are_refused(tmp_path, no_device_step):
    hc.write_awq(tmp_path / "awq")
    with pytest.raises(ShardError, match=r"num_attention_heads=4 does not divide by tp_size=3"):
        load(tmp_path / "awq", tp_rank=0, tp_size=3)
    with pytest.raises(ShardError, match=r"num_key_value_heads=2 does not divide by tp_size=4"):
        load(tmp_path / "awq", tp_rank=1, tp_size=4)
    hc.edit_config(tmp_path / "awq", intermediate_size=513)
    with pytest.raises(ShardError, match=r"intermediate_size=513 does not divide by tp_size=2"):
        load(tmp_path / "awq", tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match="tp_rank < tp_size"):
        load(tmp_path / "awq", tp_rank=2, tp_size=2)
    with pytest.raises(TypeError, match="tp_size must be an int"):
        load(tmp_path / "awq", tp_rank=0, tp_size="2")


def test_a_k_shard_that_would_cut_a_group_is_refused(tmp_path, no_device_step):
    # groups of 128, intermediate 384: down_proj's K split in two is 192 columns, 1.5 groups
    hc.write_gptq(tmp_path / "g128", bits=4, group_size=128, intermediate=384)
    with pytest.raises(ShardError, match=r"'model\.layers\.0\.mlp\.down_proj'.*whole groups of 128"):
        load(tmp_path / "g128", tp_rank=0, tp_size=2)


def test_act_order_row_parallel_layers_are_refused(tmp_path, no_device_step):
    hc.write_gptq(tmp_path / "act", bits=4, group_size=32, fmt="gptq", act_order=True)
    with pytest.raises(ShardError, match=r"o_proj' is act-order.*load it with tp_size=1"):
        load(tmp_path / "act", tp_rank=0, tp_size=2)


def test_without_a_process_group_a_rank_loads_alone(tmp_path):
    """Loading needs no process group (a rank's part can be inspected or converted); the
    plain weights of split layers are read as slices of the file."""
    hc.write_awq(tmp_path / "awq", shards=2)
    model = load(tmp_path / "awq", tp_rank=1, tp_size=2)
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, ColumnParallelQuantLinear)
    assert model.model.layers[1].self_attn.qkv_proj.tp_rank == 1
    assert model.model.embed_tokens.weight.shape == (hc.VOCAB, hc.HIDDEN)
