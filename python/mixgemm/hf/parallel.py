r"""Tensor parallelism for :func:`mixgemm.hf.from_pretrained` (``tp_rank``, ``tp_size``).

The split is Megatron-LM's, over the LLaMA-family layer names:

* column parallel (rows of the weight, :data:`COLUMN`): ``q_proj``, ``k_proj``, ``v_proj``,
  ``gate_proj``, ``up_proj``. Rank ``r`` computes heads ``r*H/P ..`` of the queries, heads
  ``r*KV/P ..`` of the keys and values, and features ``r*I/P ..`` of the MLP; a fused gate/up
  layer is built from the rank's gate and up rows, so its 8-row gate/up stripe pairs stay on
  one rank (:func:`mixgemm.weights.types.shard`, Notes);
* row parallel (columns, :data:`ROW`): ``o_proj`` and ``down_proj`` read the rank's heads or
  features and sum the ranks' partial products with one all-reduce each; a bias is added once,
  after it;
* replicated: the embeddings, the norms, the rotary tables and ``lm_head`` (every rank computes
  the whole logits; a vocabulary-parallel head would need an all-gather of the logits and buys
  little at the sizes this targets).

The model is built from its config with ``num_attention_heads``, ``num_key_value_heads`` and
``intermediate_size`` divided by ``tp_size`` (``head_dim`` kept), so its attention, its KV cache
(static or dynamic) and its MLP have the rank's sizes; the whole layers' shapes are checked
against the checkpoint before anything is cut. Each quantized layer is read and converted on
the CPU, cut to the rank's shard at once, and only the shard is kept; plain weights of split
layers are read as slices from the safetensors files. No rank holds the whole model.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import nn

from ..errors import ShardError

__all__ = ["COLUMN", "ROW", "TensorParallel", "shard_config", "check_linears"]

#: Linear layers split along their output features (rows).
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
#: Linear layers split along their input features (columns).
ROW = frozenset({"o_proj", "down_proj"})


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in the split: ``rank`` of ``size``, collectives over ``group``
    (``None``: the default process group)."""

    rank: int = 0
    size: int = 1
    group: object = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def dim_of(self, name: str) -> Optional[int]:
        """0 (column parallel), 1 (row parallel) or None (replicated) for the linear ``name``."""
        if not self.enabled:
            return None
        last = name.rpartition(".")[2]
        return 0 if last in COLUMN else 1 if last in ROW else None

    def whole_shape(self, lin: nn.Linear, dim: Optional[int]) -> Tuple[int, int]:
        """``(out_features, in_features)`` of the whole layer whose rank's part is ``lin``."""
        n, k = lin.out_features, lin.in_features
        return (n * self.size, k) if dim == 0 else (n, k * self.size) if dim == 1 else (n, k)

    def rows(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The rank's equal slice of ``t`` along ``dim`` (a copy)."""
        part = t.shape[dim] // self.size
        return t.narrow(dim, self.rank * part, part).contiguous()


def shard_config(config, tp: TensorParallel, where: str) -> None:
    """Divide the config's heads and intermediate size by ``tp.size`` (in place), keeping
    ``head_dim``.

    Raises
    ------
    ShardError
        A field missing, or not divisible by ``tp_size``.
    """
    if not tp.enabled:
        return
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None)
    hidden = getattr(config, "hidden_size", None)
    if not all(isinstance(v, int) for v in (heads, kv_heads, inter, hidden)):
        raise ShardError(f"{where}: tensor parallelism needs num_attention_heads, num_key_value_heads, "
                         f"intermediate_size and hidden_size in the config (a LLaMA-family model); "
                         f"{getattr(config, 'model_type', '?')!r} lacks some")
    for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                         ("intermediate_size", inter)):
        if value % tp.size:
            raise ShardError(f"{where}: {field}={value} does not divide by tp_size={tp.size}: every rank must "
                             f"hold whole {'heads' if 'heads' in field else 'features'} "
                             f"(use a tp_size that divides {field})")
    config.head_dim = getattr(config, "head_dim", None) or hidden // heads
    config.num_attention_heads = heads // tp.size
    config.num_key_value_heads = kv_heads // tp.size
    config.intermediate_size = inter // tp.size


def check_linears(model: nn.Module, tp: TensorParallel, where: str) -> None:
    """Every ``nn.Linear`` of the model is one tensor parallelism knows how to place: a
    column- or row-parallel projection, or the output embeddings (replicated).

    Raises
    ------
    ShardError
        Another linear layer (a model whose modules do not follow the LLaMA names).
    """
    if not tp.enabled:
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod is not head and tp.dim_of(name) is None:
            raise ShardError(f"{where}: tensor parallelism splits the layers named {sorted(COLUMN)} (by rows) and "
                             f"{sorted(ROW)} (by columns); {name!r} is none of them, so this model cannot be split "
                             f"(load it with tp_size=1)")
