"""Step 2 of :func:`mixgemm.hf.from_pretrained`: put a :class:`~mixgemm.hf.plan.Plan` on the device
(QuantLinear modules around the packed weights, :class:`FusedQKVAttention` for attentions whose
q, k and v are one layer, :class:`GatedMLP` for fused MLPs, the other tensors read from the
shards), and the :class:`LoadSummary` of the result.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

from ..nn.blocks import FusedQKVAttention, GatedMLP
from ..nn.linear import QuantLinear
from ..nn.parallel import ColumnParallelQuantLinear, RowParallelLinear, RowParallelQuantLinear
from .plan import Plan

__all__ = ["FusedQKVAttention", "GatedMLP", "LoadSummary", "materialize", "summary"]


@dataclasses.dataclass
class LoadSummary:
    """What :func:`from_pretrained` loaded (also ``model.mixgemm_summary``).

    Attributes
    ----------
    model_dir : str
    method : str
        The checkpoint's ``quant_method``.
    quantized : list of str
        The QuantLinear modules (a fused gate/up layer is ``"<mlp>.gate_up"``, a fused q/k/v
        layer ``"<attention>.qkv_proj"``).
    fused : list of str
        The MLPs whose gate and up projections were fused (:class:`GatedMLP`).
    full_precision : dict of str -> str
        Quantized layers kept as ``nn.Linear`` in full precision, with the reason.
    quantized_bytes, other_bytes : int
        Bytes held by the QuantLinear modules (codes, scales, zeros, biases, permutations) and by
        everything else (embeddings, norms, the LM head, full-precision layers, buffers).
    bf16_bytes : int
        What the same model takes with bf16 weights.
    tp_rank, tp_size : int
        This rank's place in a tensor-parallel split (the bytes are this rank's).
    norms : list of str
        The RMSNorm modules replaced by :class:`mixgemm.nn.RMSNorm` (``fuse_norms``).
    fused_attentions : list of str
        The attentions whose q, k and v projections were fused into one layer
        (:class:`FusedQKVAttention`; ``fuse_projections``).
    fused_layers : list of str
        The decoder layers replaced by :class:`mixgemm.nn.blocks.FusedDecoderLayer`
        (``fuse_layers``).
    bf16_activations : dict of str -> str
        With ``act_format="fp8"``: the QuantLinear modules that keep bf16 activations, with the
        reason.
    """

    model_dir: str
    method: str
    quantized: List[str]
    fused: List[str]
    full_precision: Dict[str, str]
    quantized_bytes: int
    other_bytes: int
    bf16_bytes: int
    tp_rank: int = 0
    tp_size: int = 1
    norms: List[str] = dataclasses.field(default_factory=list)
    fused_attentions: List[str] = dataclasses.field(default_factory=list)
    fused_layers: List[str] = dataclasses.field(default_factory=list)
    bf16_activations: Dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def resident_bytes(self) -> int:
        return self.quantized_bytes + self.other_bytes

    def __str__(self) -> str:
        ratio = self.bf16_bytes / self.resident_bytes if self.resident_bytes else float("nan")
        rank = f" rank {self.tp_rank} of {self.tp_size}" if self.tp_size > 1 else ""
        layers = f", {len(self.fused_layers)} decoder layers fused" if self.fused_layers else ""
        if self.bf16_activations:
            layers += f", {len(self.bf16_activations)} quantized layers with bf16 activations"
        return (f"mixgemm.hf: loaded {self.model_dir} ({self.method}){rank}: {len(self.quantized)} quantized layers "
                f"({len(self.fused_attentions)} attentions with q/k/v fused, {len(self.fused)} gated MLPs fused), "
                f"{len(self.full_precision)} kept in full precision, "
                f"{len(self.norms)} RMSNorms on mixgemm's kernel{layers}; "
                f"resident {_mib(self.resident_bytes)} (quantized {_mib(self.quantized_bytes)} + other "
                f"{_mib(self.other_bytes)}) vs {_mib(self.bf16_bytes)} in bf16 ({ratio:.2f}x smaller)")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _set(model: nn.Module, name: str, value) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, value)


def _parallel(layer: QuantLinear, name: str, plan: Plan, bias, sections=None) -> nn.Module:
    """The rank's QuantLinear wrapped for its place in the split (itself when not split);
    ``sections``: a fused q/k/v layer's rows of q, k and v on this rank."""
    tp = plan.tp
    dim = tp.dim_of(name)
    if dim == 0:
        whole = None if sections is None else tuple(s * tp.size for s in sections)
        return ColumnParallelQuantLinear(layer, layer.out_features * tp.size, tp_rank=tp.rank, tp_size=tp.size,
                                         gather_output=False, sections=whole, group=tp.group)
    if dim == 1:
        return RowParallelQuantLinear(layer, layer.in_features * tp.size, bias, tp_rank=tp.rank, tp_size=tp.size,
                                      input_is_parallel=True, group=tp.group)
    return layer


def materialize(plan: Plan, device: torch.device) -> nn.Module:
    """Step 2: put the planned model on ``device``."""
    model, dtype, tp = plan.model, plan.dtype, plan.tp
    fused_keys = set(plan.fused.values()) | set(plan.attentions.values())
    layers: Dict[str, QuantLinear] = {}
    for name in list(plan.quantized):
        layer = plan.quantized.pop(name)           # frees the CPU copy as it goes
        bias = None if layer.bias is None else layer.bias.to(device, dtype)
        row = tp.dim_of(name) == 1                 # a row-parallel layer adds its bias after the all-reduce
        q = QuantLinear.from_packed(layer.packed.to(device), bias=None if row else bias,
                                    perm=None if layer.perm is None else layer.perm.to(device))
        if layer.swiglu:
            q.activation, q.out_features = "swiglu", layer.packed.n // 2
        if layer.input_scale is not None:   # kept beside the weight; act_format="fp8" quantizes with it
            q.set_input_scale(layer.input_scale)
        # a fused layer is split as its first part is (column parallel)
        part = (name.replace(".gate_up", ".gate_proj") if layer.swiglu else
                name.replace(".qkv_proj", ".q_proj") if layer.sections is not None else name)
        q = _parallel(q, part, plan, bias, layer.sections)
        layers[name] = q
        if name not in fused_keys:
            _set(model, name, q)
    for name, (weight, bias, _) in plan.full.items():
        lin = model.get_submodule(name)
        lin.weight = nn.Parameter(weight.to(device, dtype), requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias.to(device, dtype), requires_grad=False)
    for mlp, key in plan.fused.items():
        _set(model, mlp, GatedMLP(layers[key], model.get_submodule(mlp).down_proj))
    for keys, names in plan.plain:
        params = {}
        for name in names:
            key = name if name in keys else keys[0]
            if key not in params:
                like = model.get_parameter(name)
                if name in plan.sliced:            # the rank's part of a split layer's plain weight
                    t = plan.shards.get_part(key, plan.sliced[name], tp.rank, tp.size)
                else:
                    t = plan.shards.get(key)
                params[key] = nn.Parameter(t.to(device, like.dtype), requires_grad=False)
            _set(model, name, params[key])
    if tp.enabled:    # full-precision row-parallel layers: all-reduce, then the bias
        for name, mod in list(model.named_modules()):
            if type(mod) is nn.Linear and tp.dim_of(name) == 1:
                _set(model, name, RowParallelLinear(mod.weight.detach(), None if mod.bias is None else mod.bias.detach(),
                                                    mod.in_features * tp.size, tp_rank=tp.rank, tp_size=tp.size,
                                                    group=tp.group))
    for key, name in plan.buffers:
        buf = model.get_buffer(name)
        _set_buffer(model, name, plan.shards.get(key).to(device, buf.dtype))
    for mod in model.modules():
        for bname, buf in list(mod._buffers.items()):
            if buf is not None and buf.device != device:
                mod._buffers[bname] = buf.to(device)
    for attention, key in plan.attentions.items():   # last: it takes over the attention's finished o_proj
        _set(model, attention, FusedQKVAttention(model.get_submodule(attention), layers[key]))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:   # every parameter was planned: this is a bug, not a checkpoint problem
        raise RuntimeError(f"mixgemm.hf: {left[:3]} were left on the meta device")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, attr = name.rpartition(".")
    (model.get_submodule(parent) if parent else model)._buffers[attr] = value


def summary(model: nn.Module, plan: Plan, model_dir: Path, quantized: List[str]) -> LoadSummary:
    seen, qbytes, total, bf16 = set(), 0, 0, 0
    qtensors = set()
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            for t in list(mod.buffers(recurse=False)) + list(mod.parameters(recurse=False)):
                qtensors.add(id(t))
            bf16 += 2 * mod.weight_rows * mod.in_features + (0 if mod.bias is None else 2 * mod.bias.numel())
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = (t.untyped_storage().data_ptr(), t.device)
        if ptr in seen:
            continue
        seen.add(ptr)
        nbytes = t.untyped_storage().nbytes()
        total += nbytes
        if id(t) in qtensors:
            qbytes += nbytes
        else:
            bf16 += 2 * t.numel() if t.is_floating_point() and isinstance(t, nn.Parameter) else nbytes
    return LoadSummary(str(model_dir), plan.method.value, quantized, list(plan.fused),
                       {name: why for name, (_, _, why) in plan.full.items()}, qbytes, total - qbytes, bf16,
                       plan.tp.rank, plan.tp.size, fused_attentions=list(plan.attentions))
