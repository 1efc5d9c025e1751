"""Step 1 of :func:`mixgemm.hf.from_pretrained`, on the CPU: build the model on the meta device,
read, convert and prepack every quantized layer (fusing each attention's q, k and v into one
layer and each gated MLP's gate and up into one swiglu layer), and check every other tensor
against the model. Everything that can be wrong with a checkpoint is found here; the
:class:`Plan` it returns holds what step 2 (:mod:`mixgemm.hf.materialize`) puts on the device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ..errors import CheckpointError, ShardError, UnsupportedLayerError
from ..formats import Format, ImportedLayer, import_layer
from ..formats.compressed_tensors import stores_int_codes
from ..formats.dequant import dequantize_layer
from ..nn import blocks as _blocks
from ..nn.blocks import find_attentions, find_gated_mlps
from ..weights.layout import prepack, unpack
from ..weights.quantize import GATE_UP_STRIPE, interleave_gate_up, interleave_rows
from ..weights.types import PackedWeight, QuantizedWeight
from ..formats.config import (LayerScheme, QuantizationConfig, parse_quantization_config,
                              resolve_dtype)
from .parallel import TensorParallel, check_linears, shard_config
from .shards import Shards

__all__ = ["Plan", "plan"]

_log = logging.getLogger("mixgemm.hf")


@dataclasses.dataclass
class _Layer:
    """One quantized layer on the CPU: its logical weight (imported) or its packed weight
    (mixgemm files), bias and act-order permutation."""

    qweight: Optional[QuantizedWeight]
    packed: Optional[PackedWeight]
    bias: Optional[torch.Tensor]
    perm: Optional[torch.Tensor]
    swiglu: bool = False
    sections: Optional[Tuple[int, ...]] = None     # a fused q/k/v layer: the rows of q, k and v (the rank's)
    input_scale: Optional[torch.Tensor] = None     # a static e4m3 activation scale (compressed-tensors W4A8)

    def logical(self) -> QuantizedWeight:
        return self.qweight if self.qweight is not None else unpack(self.packed)

    def shard(self, name: str, dim: Optional[int], tp: TensorParallel) -> "_Layer":
        """The rank's shard (``self`` when the layer is not split)."""
        if dim is None:
            return self
        if dim == 1 and self.perm is not None:
            raise ShardError(f"layer {name!r} is act-order (its groups are not contiguous in K: GPTQ desc_act or "
                             f"compressed-tensors actorder='group'): a row-parallel shard of it needs the whole "
                             f"input, which a rank does not have at tp_size={tp.size}; load it with tp_size=1")
        where = f"layer {name!r}: tensor-parallel split {tp.rank}/{tp.size} along {'N' if dim == 0 else 'K'}"
        try:
            if self.packed is not None:
                qweight, packed = None, self.packed.shard(dim, tp.rank, tp.size)
            else:
                qweight, packed = self.qweight.shard(dim, tp.rank, tp.size), None
        except ValueError as e:
            raise ShardError(f"{where}: {e}") from None
        bias = self.bias if self.bias is None or dim == 1 else tp.rows(self.bias, 0)
        return dataclasses.replace(self, qweight=qweight, packed=packed, bias=bias)

    def prepacked(self) -> "_Layer":
        if self.packed is not None:
            return self
        return dataclasses.replace(self, qweight=None, packed=prepack(self.qweight))


@dataclasses.dataclass
class Plan:
    """Everything step 1 decided; step 2 only moves it onto the device."""

    model: nn.Module
    shards: Shards
    dtype: torch.dtype
    method: Format
    quantized: Dict[str, _Layer]                     # module name -> packed layer
    fused: Dict[str, str]                            # MLP name -> its gate_up entry in quantized
    full: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor], str]]   # linear -> (weight, bias, why)
    plain: List[Tuple[List[str], List[str]]]         # ([checkpoint keys], [parameter names])
    buffers: List[Tuple[str, str]]                   # (checkpoint key, buffer name)
    tp: TensorParallel = TensorParallel()
    sliced: Dict[str, int] = dataclasses.field(default_factory=dict)   # plain parameter -> dim read in part
    attentions: Dict[str, str] = dataclasses.field(default_factory=dict)   # attention -> its qkv_proj entry

    def fused_parts(self) -> List[str]:
        """The linear layers of the model that a fused layer replaces (q/k/v, gate/up)."""
        return ([f"{m}.{p}" for m in self.fused for p in GATE_UP] +
                [f"{a}.{p}" for a in self.attentions for p in QKV])


#: the projections of an attention that one fused layer computes, in its row order
QKV = ("q_proj", "k_proj", "v_proj")
#: the projections of a gated MLP that one swiglu layer computes
GATE_UP = ("gate_proj", "up_proj")


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device; buffers stay where they are
    created (so the model computes them as usual, e.g. the rotary frequencies). Patches
    ``nn.Module.register_parameter`` for the duration (the approach of accelerate's
    ``init_empty_weights``). A layer's parameter is created uninitialized on the CPU and moved as
    it is registered, before the layer initializes it: its memory is allocated for that moment
    but never written."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: no such directory")
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (a transformers model directory has one)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return raw


def _build_meta_model(transformers, model_dir: Path, dtype: torch.dtype, attn_implementation: Optional[str],
                      tp: TensorParallel):
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{model_dir / 'config.json'}: transformers cannot read it: {e}") from None
    shard_config(config, tp, str(model_dir / "config.json"))   # the rank's heads and MLP features
    # the model is built as a plain one: its quantized layers are mixgemm's business
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with _parameters_on_meta():
            return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as e:
        raise CheckpointError(f"{model_dir / 'config.json'}: transformers cannot build a causal-LM model from it: "
                              f"{e}") from None


def _children(shards: Shards) -> Dict[str, Dict[str, str]]:
    """prefix -> {last name component: key} over the checkpoint's keys."""
    out: Dict[str, Dict[str, str]] = {}
    for key in shards:
        prefix, _, last = key.rpartition(".")
        out.setdefault(prefix, {})[last] = key
    return out


def _fuse_reason(gate: _Layer, up: _Layer) -> Optional[str]:
    """Why gate and up cannot share one swiglu layer, or None."""
    g, u = gate.logical(), up.logical()
    if (g.n, g.k, g.bits, g.group_size, g.symmetric, g.dtype) != (u.n, u.k, u.bits, u.group_size, u.symmetric, u.dtype):
        return (f"gate is {g.weight_type.value}/g{g.group_size} {g.n}x{g.k}, up is "
                f"{u.weight_type.value}/g{u.group_size} {u.n}x{u.k}")
    if (g.zero_offsets is None) != (u.zero_offsets is None):
        return "only one of gate and up has fractional zero points"
    if (gate.bias is None) != (up.bias is None):
        return "only one of gate and up has a bias"
    if (gate.perm is None) != (up.perm is None) or (gate.perm is not None and not torch.equal(gate.perm, up.perm)):
        return "gate and up have different act-order permutations"
    if g.n % GATE_UP_STRIPE:
        return f"{g.n} rows are not a multiple of {GATE_UP_STRIPE}"
    return None


def _fuse(gate: _Layer, up: _Layer) -> _Layer:
    qw = interleave_gate_up(gate.logical(), up.logical())
    bias = None if gate.bias is None else interleave_rows(gate.bias, up.bias)
    return _Layer(None, prepack(qw), bias, gate.perm, swiglu=True, input_scale=_shared_input_scale([gate, up]))


def _describe(w: QuantizedWeight) -> str:
    return f"{w.weight_type.value}/g{w.group_size} {w.n}x{w.k} {str(w.dtype).removeprefix('torch.')}"


def _stack_reason(parts: Dict[str, _Layer], logical: Dict[str, QuantizedWeight]) -> Optional[str]:
    """Why an attention's q, k and v (``parts``, their weights ``logical``) cannot be stacked
    into one layer, or None: they must agree on K, bits, group size, symmetry, dtype,
    zero-offset presence, bias presence and act-order permutation."""
    if len({(w.k, w.bits, w.group_size, w.symmetric, w.dtype) for w in logical.values()}) != 1:
        return ", ".join(f"{attr.removesuffix('_proj')} is {_describe(w)}" for attr, w in logical.items())
    if len({w.zero_offsets is None for w in logical.values()}) != 1:
        return "only some of q, k and v have fractional zero points"
    if len({layer.bias is None for layer in parts.values()}) != 1:
        return "only some of q, k and v have a bias"
    perms = [layer.perm for layer in parts.values()]
    first = perms[0]
    if any((p is None) != (first is None) or (p is not None and not torch.equal(p, first)) for p in perms[1:]):
        return "q, k and v have different act-order permutations"
    return None


def _stack(parts: Dict[str, _Layer], logical: Dict[str, QuantizedWeight]) -> _Layer:
    """One layer whose rows are q's, then k's, then v's (codes, scales, zeros, zero offsets and
    biases alike): ``x @ W.T`` is ``[q | k | v]``."""
    ws = [logical[attr] for attr in QKV]

    def cat(field: str) -> Optional[torch.Tensor]:
        ts = [getattr(w, field) for w in ws]
        return None if ts[0] is None else torch.cat(ts)

    first = ws[0]
    qw = QuantizedWeight(cat("qweight"), cat("scales"), cat("zeros"), first.bits, first.group_size, first.symmetric,
                         cat("zero_offsets"))
    biases = [parts[attr].bias for attr in QKV]
    bias = None if biases[0] is None else torch.cat(biases)
    return _Layer(None, prepack(qw), bias, parts["q_proj"].perm, sections=tuple(w.n for w in ws),
                  input_scale=_shared_input_scale([parts[attr] for attr in QKV]))


def _check_linear(name: str, lin: nn.Linear, n: int, k: int, bias: Optional[torch.Tensor], where: str,
                  whole: Optional[Tuple[int, int]] = None) -> None:
    """The checkpoint's whole layer ``[n, k]`` (and bias) against the model's: ``whole`` is the
    whole layer's (out_features, in_features) when the model holds a tensor-parallel part."""
    want_n, want_k = whole if whole is not None else (lin.out_features, lin.in_features)
    if (n, k) != (want_n, want_k):
        raise CheckpointError(f"{where}: layer {name!r} holds a [{n}, {k}] weight, but the config makes it "
                              f"[{want_n}, {want_k}] (out_features, in_features)")
    if (bias is None) != (lin.bias is None):
        raise CheckpointError(f"{where}: layer {name!r} " + (
            f"has no bias tensor {name + '.bias'!r}, which the model's layer has" if bias is None else
            f"has a bias tensor {name + '.bias'!r}, which the model's layer does not have"))
    if bias is not None and tuple(bias.shape) != (n,):
        raise CheckpointError(f"{where}: {name + '.bias'!r} has shape {list(bias.shape)}, expected [{n}]")


def _read_layer(name: str, lin: nn.Linear, kids: Dict[str, str], shards: Shards, qconfig: QuantizationConfig,
                dtype: torch.dtype, where: str, tp: TensorParallel = TensorParallel()
                ) -> Union[_Layer, Tuple[torch.Tensor, Optional[torch.Tensor], str]]:
    """A quantized layer's tensors, converted (the whole layer checked against the model's, then
    cut to the rank's shard): a _Layer, or (weight, bias, why) when mixgemm cannot represent it."""
    dim = tp.dim_of(name)
    whole = tp.whole_shape(lin, dim)
    scheme: LayerScheme = qconfig.scheme_for(name, type(lin).__name__)
    if not scheme.quantized:
        raise CheckpointError(f"{where}: layer {name!r} holds quantized tensors, but the quantization_config "
                              f"says it is not quantized")
    tensors = {key: shards.get(key) for key in kids.values()}
    if qconfig.method is Format.MIXGEMM:
        packed = tensors[f"{name}.weight"]
        perm, bias = tensors.get(f"{name}.perm"), tensors.get(f"{name}.bias")
        _check_linear(name, lin, packed.n, packed.k, bias, where, whole)
        if perm is not None and (perm.dtype != torch.int64 or tuple(perm.shape) != (packed.k,)):
            raise CheckpointError(f"{where}: {name + '.perm'!r} must be int64 [{packed.k}], got {perm.dtype} "
                                  f"{list(perm.shape)}")
        if packed.dtype != dtype:   # the activation dtype: scales rounded to it, integer zeros exact
            packed = dataclasses.replace(packed, scales=packed.scales.to(dtype),
                                         zeros=None if packed.zeros is None else packed.zeros.to(dtype))
        return _Layer(None, packed, bias, perm).shard(name, dim, tp)
    try:
        layer: ImportedLayer = import_layer(qconfig.method, tensors, name, dtype, bits=scheme.bits,
                                            group_size=scheme.group_size,
                                            checkpoint_format=scheme.checkpoint_format,
                                            activations=scheme.activations)
    except UnsupportedLayerError as e:
        weight = dequantize_layer(qconfig.method, tensors, name, scheme)
        bias = tensors.get(f"{name}.bias")
        _check_linear(name, lin, weight.shape[0], weight.shape[1], bias, where, whole)
        if dim is not None:
            weight = tp.rows(weight, dim)
            bias = tp.rows(bias, 0) if bias is not None and dim == 0 else bias
        return weight, bias, str(e).removeprefix(f"layer {name!r}: ")
    _check_linear(name, lin, layer.qweight.n, layer.qweight.k, layer.bias, where, whole)
    return _Layer(layer.qweight, None, layer.bias, layer.perm, input_scale=layer.input_scale).shard(name, dim, tp)


def _shared_input_scale(parts: List[_Layer]) -> Optional[torch.Tensor]:
    """The static activation scale of one layer fused from ``parts`` (which all read the same
    input): the largest of theirs, so that no part's activations saturate sooner than in the
    checkpoint; None unless every part has one."""
    scales = [p.input_scale for p in parts]
    if any(s is None for s in scales):
        return None
    return torch.stack([s.reshape(()) for s in scales]).max()


def _is_ignorable(key: str, model: nn.Module) -> bool:
    """Tensors a checkpoint may hold that the model computes itself (old checkpoints' rotary
    frequencies) or says to ignore."""
    if key.endswith(".inv_freq"):
        return True
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(p, key) for p in patterns)


def plan(transformers, model_dir: Path, dtype, fuse_gate_up: bool, attn_implementation: Optional[str],
         tp: TensorParallel = TensorParallel(), fuse_qkv: bool = False) -> Plan:
    """Step 1: everything on the CPU, every check. Takes no device. With ``tp.size > 1`` the
    model is the rank's part (:mod:`mixgemm.hf.parallel`) and every split layer is cut as it is
    read (a fused q/k/v layer stacks the rank's q, k and v rows). ``fuse_gate_up`` and
    ``fuse_qkv``: fuse the gated MLPs' gate and up, the attentions' q, k and v."""
    raw = _read_config(model_dir)
    where = str(model_dir)
    if "quantization_config" not in raw:
        raise CheckpointError(f"{model_dir / 'config.json'} has no quantization_config: not a quantized checkpoint "
                              f"(load it with transformers, then mixgemm.nn.quantize_model to quantize it)")
    qconfig = parse_quantization_config(raw["quantization_config"], str(model_dir / "config.json"))
    dtype = resolve_dtype(dtype, raw)
    shards = Shards(model_dir)
    try:
        model = _build_meta_model(transformers, model_dir, dtype, attn_implementation, tp)
        check_linears(model, tp, where)
        plan = Plan(model, shards, dtype, qconfig.method, {}, {}, {}, [], [], tp)
        children = _children(shards)
        _plan_linears(plan, qconfig, children, where, fuse_gate_up, fuse_qkv)
        _plan_rest(plan, children, where)
        return plan
    except BaseException:
        shards.close()
        raise


def _plan_linears(plan: Plan, qconfig: QuantizationConfig, children: Dict[str, Dict[str, str]], where: str,
                  fuse_gate_up: bool, fuse_qkv: bool = False) -> None:
    """Read, convert and pack every quantized linear layer (fusing attentions' q, k and v and
    gated MLPs' gate and up)."""
    model, shards = plan.model, plan.shards
    primary = qconfig.method.primary
    mlps = find_gated_mlps(model) if fuse_gate_up else {}
    attentions = find_attentions(model) if fuse_qkv else {}
    if fuse_qkv and not attentions:
        _log.info("mixgemm.hf: %s has no attention of a recognized family (%s): q, k and v are loaded as "
                  "separate layers", type(model).__name__, ", ".join(sorted(_blocks.ATTENTIONS)))
    # (module, kind) -> {attr: layer, or None when kept in full precision}, until all its parts are read
    pending: Dict[Tuple[str, str], Dict[str, object]] = {}
    for name, lin in model.named_modules():
        if not isinstance(lin, nn.Linear):
            continue
        kids = children.get(name, {})
        quantized = primary in kids and (qconfig.method is not Format.MIXGEMM
                                         or shards.is_packed(kids[primary]))
        codes = not quantized and stores_int_codes(qconfig, name, type(lin).__name__, has=kids.__contains__)
        if not (quantized or codes):
            continue   # a plain (or tied) weight: _plan_rest loads it
        if qconfig.method is not Format.MIXGEMM and "weight" in kids and not codes:
            raise CheckpointError(f"{where}: layer {name!r} has both quantized tensors and a plain "
                                  f"{kids['weight']!r}")
        got = _read_layer(name, lin, kids, shards, qconfig, plan.dtype, where, plan.tp)
        if isinstance(got, tuple):
            warnings.warn(f"mixgemm.hf: keeping {name} in full precision ({plan.dtype}): {got[2]}", stacklevel=4)
            plan.full[name] = got
            got = None
        parent, _, attr = name.rpartition(".")
        if parent in mlps and attr in GATE_UP:
            pending.setdefault((parent, "mlp"), {})[attr] = got      # packed when both are read
            _maybe_fuse(plan, parent, pending)
        elif parent in attentions and attr in QKV:
            pending.setdefault((parent, "attention"), {})[attr] = got
            _maybe_fuse_qkv(plan, parent, pending)
        elif got is not None:
            plan.quantized[name] = got.prepacked()
    for (module, kind), parts in pending.items():     # a part is stored unquantized: each alone
        what = "gate and up" if kind == "mlp" else "q, k and v"
        plain = [a for a in (GATE_UP if kind == "mlp" else QKV) if a not in parts]
        _log.info("mixgemm.hf: %s: %s not fused: %s not quantized in the checkpoint", module, what,
                  " and ".join(plain) + (" is" if len(plain) == 1 else " are"))
        _pack_apart(plan, module, parts)


def _maybe_fuse(plan: Plan, mlp: str, pending: Dict[Tuple[str, str], Dict[str, object]]) -> None:
    """Once both of an MLP's gate and up are read: fuse them, or pack each alone."""
    parts = pending[(mlp, "mlp")]
    if set(parts) != set(GATE_UP):
        return
    gate, up = parts["gate_proj"], parts["up_proj"]
    del pending[(mlp, "mlp")]
    why = "one of them is kept in full precision" if gate is None or up is None else _fuse_reason(gate, up)
    if why is None:
        key = f"{mlp}.gate_up"
        plan.quantized[key] = _fuse(gate, up)
        plan.fused[mlp] = key
        return
    _log.info("mixgemm.hf: %s: gate and up not fused: %s", mlp, why)
    _pack_apart(plan, mlp, parts)


def _maybe_fuse_qkv(plan: Plan, attention: str, pending: Dict[Tuple[str, str], Dict[str, object]]) -> None:
    """Once an attention's q, k and v are all read: stack them into one layer, or pack each
    alone (with a log line that says why)."""
    parts = pending[(attention, "attention")]
    if set(parts) != set(QKV):
        return
    del pending[(attention, "attention")]
    kept = [attr for attr in QKV if parts[attr] is None]
    logical = {} if kept else {attr: parts[attr].logical() for attr in QKV}
    why = (f"{' and '.join(kept)} {'is' if len(kept) == 1 else 'are'} kept in full precision" if kept
           else _stack_reason(parts, logical))
    if why is None:
        key = f"{attention}.qkv_proj"
        plan.quantized[key] = _stack(parts, logical)
        plan.attentions[attention] = key
        return
    _log.info("mixgemm.hf: %s: q, k and v not fused: %s", attention, why)
    _pack_apart(plan, attention, parts)


def _pack_apart(plan: Plan, module: str, parts: Dict[str, object]) -> None:
    """Pack each read part of a module that is not fused as a layer of its own (a part kept in
    full precision is None)."""
    for attr, layer in parts.items():
        if layer is not None:
            plan.quantized[f"{module}.{attr}"] = layer.prepacked()


def _plan_rest(plan: Plan, children: Dict[str, Dict[str, str]], where: str) -> None:
    """Every parameter of the model that no quantized layer replaces, and the persistent
    buffers: which checkpoint tensor fills it, with its shape checked; then no tensor may be
    left over."""
    model, shards = plan.model, plan.shards
    modules = dict(model.named_modules())
    replaced = set(plan.quantized) | set(plan.full) | set(plan.fused_parts())
    consumed = {key for name in replaced for key in children.get(name, {}).values()}
    # tied parameters are one object under several names
    groups: Dict[int, Tuple[nn.Parameter, List[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.rpartition(".")[0] in replaced:
            continue
        groups.setdefault(id(param), (param, []))[1].append(name)
    missing = []
    for param, names in groups.values():
        keys = [n for n in names if n in shards]
        if not keys:
            missing.append(names[0])
            continue
        owner, _, pname = names[0].rpartition(".")
        dim = plan.tp.dim_of(owner) if isinstance(modules.get(owner), nn.Linear) else None
        want = tuple(param.shape)
        if dim is not None and not (pname == "bias" and dim == 1):   # a split linear's part: read in part
            cut = 0 if pname == "bias" else dim
            want = tuple(s * plan.tp.size if i == cut else s for i, s in enumerate(want))
            for n in names:
                plan.sliced[n] = cut
        for key in keys:
            if shards.is_packed(key):
                raise CheckpointError(f"{where}: {key!r} is a mixgemm packed weight, but " + (
                    f"the quantization_config's quant_method is {plan.method.value!r}"
                    if plan.method is not Format.MIXGEMM else "the model's is not a linear layer's weight"))
            shape = shards.shape(key)
            if tuple(shape) != want:
                raise CheckpointError(f"{where}: tensor {key!r} ({shards.file_of(key)}) has shape {list(shape)}, "
                                      f"but the config makes it {list(want)}")
            consumed.add(key)
        plan.plain.append((keys, names))
    if missing:
        raise CheckpointError(f"{where}: the checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. "
                              f"{missing[:3]} (truncated, or a config that does not match the weights?)")
    for mod_name, mod in model.named_modules():
        for bname, buf in mod._buffers.items():
            full = f"{mod_name}.{bname}" if mod_name else bname
            if buf is None or bname in mod._non_persistent_buffers_set or full not in shards:
                continue
            if tuple(shards.shape(full)) != tuple(buf.shape):
                raise CheckpointError(f"{where}: tensor {full!r} has shape {list(shards.shape(full))}, but the "
                                      f"model's buffer is {list(buf.shape)}")
            plan.buffers.append((full, full))
            consumed.add(full)
    unexpected = [k for k in shards if k not in consumed and not _is_ignorable(k, model)]
    for key in unexpected:       # quantized tensors of a module that is not an nn.Linear
        owner = modules.get(key.rpartition(".")[0])
        if owner is not None and not isinstance(owner, nn.Linear):
            raise CheckpointError(f"{where}: {key!r} belongs to {key.rpartition('.')[0]!r}, a "
                                  f"{type(owner).__name__}: mixgemm.hf reads quantized nn.Linear layers only")
    if unexpected:
        raise CheckpointError(f"{where}: {len(unexpected)} tensor(s) of the checkpoint belong to no layer of the "
                              f"model the config describes, e.g. {unexpected[:3]} (a config that does not match "
                              f"the weights?)")
