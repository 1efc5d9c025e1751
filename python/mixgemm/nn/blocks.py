"""A transformers decoder made of mixgemm's launches: fused projections, fused layers, and
:func:`quantize_model`, which builds them.

A transformers LLaMA-style decoder layer runs seven projections (q, k, v, o, gate, up, down),
each a launch of its own, and a few dozen small torch ops around them. This module regroups
them, keeping the model a transformers model (``generate()``, caches, attention backends,
``torch.compile`` all work as before):

* :class:`FusedQKVAttention`: the model's attention with q, k and v in **one** GEMM (their
  weights stacked along N: ``[q; k; v]``), the rest as transformers computes it (rotary
  embedding, ``cache.update``, the model's attention function, ``o_proj``);
* :class:`GatedMLP`: gate and up in one GEMM with the ``silu(gate) * up`` epilogue, then down;
* :class:`FusedDecoderLayer` (``fuse_layers=True``): the whole decoder layer in mixgemm's
  launches -- RMSNorm, the qkv GEMM, rotary embedding and the KV-cache write in one launch
  (:func:`mixgemm.ops.rotary.rotary_kv_cache`) into transformers' static cache, the model's
  attention function over that cache, o, the residual add with the second RMSNorm in one launch,
  gate/up with swiglu, down, and the residual add.

The families recognized are those whose attention is LLaMA's (LLaMA, Mistral, Mixtral, Qwen2,
Qwen3 and their MoE variants: :data:`ATTENTIONS`); elsewhere :func:`quantize_model` replaces
each linear layer alone and logs that it did.
"""
from __future__ import annotations

import importlib
import logging
import re
import warnings
import weakref
from typing import Iterable, Optional

import torch
from torch import nn

from .linear import act_format_problem, QuantizeSummary, QuantLinear, apply_act_format, unsupported_reason
from ..dtypes import WeightType
from ..dispatch import plans
from ..dispatch.uses import KernelUse
from ..ops.layer import LINEARS, flash_decode_attention, grouped_decode_attention
from ..ops.norm import LLAMA_STYLE_NORMS, RMSNorm, norm_spec, rms_norm
from ..ops.rotary import rope_spec, rotary_kv_cache
from .guards import decode_compile_config
from .static_kv import StaticKVStore

__all__ = ["ATTENTIONS", "FusedQKVAttention", "GatedMLP", "FusedDecoderLayer", "RopeTable", "find_attentions",
           "find_gated_mlps", "quantize_model"]

_log = logging.getLogger("mixgemm")

#: transformers attention classes whose forward is LLaMA's: ``q/k/v/o_proj`` linears, the model
#: module's ``apply_rotary_pos_emb``, ``cache.update``, the attention function of
#: ``config._attn_implementation`` (Qwen3's add a per-head RMSNorm of q and k, Qwen2's and
#: Mistral's pass their ``sliding_window``)
ATTENTIONS = frozenset({"LlamaAttention", "MistralAttention", "MixtralAttention", "Qwen2Attention",
                        "Qwen2MoeAttention", "Qwen3Attention", "Qwen3MoeAttention"})

#: attention classes that pass their config's ``sliding_window`` to the attention function at each
#: call (they hold none of their own)
_CONFIG_WINDOW = frozenset({"MistralAttention", "MixtralAttention"})

#: rotary embeddings whose cos / sin depend on the position alone (a table serves every call)
_STATIC_ROPE = frozenset({"default", "llama3", "linear"})

#: the longest rotary table :class:`RopeTable` makes (caches longer than it take torch's path)
MAX_ROPE_TABLE = 32768


# ---------------------------------------------------------------------------------------------
# Finding the parts
# ---------------------------------------------------------------------------------------------
def find_gated_mlps(model: nn.Module) -> dict[str, nn.Module]:
    """MLP modules of the LLaMA kind: ``gate_proj``, ``up_proj``, ``down_proj`` linears and a SiLU
    ``act_fn``, nothing else, computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
    found = {}
    for name, mod in model.named_modules():
        kids = dict(mod.named_children())
        if set(kids) != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
            continue
        if not all(isinstance(kids[k], nn.Linear) for k in ("gate_proj", "up_proj", "down_proj")):
            continue
        if isinstance(kids["act_fn"], nn.SiLU) or type(kids["act_fn"]).__name__ in ("SiLUActivation", "SiLU"):
            found[name] = mod
    return found


def find_attentions(model: nn.Module) -> dict[str, nn.Module]:
    """Attention modules of :data:`ATTENTIONS` with ``q_proj``, ``k_proj``, ``v_proj`` and
    ``o_proj`` linears."""
    found = {}
    for name, mod in model.named_modules():
        if type(mod).__name__ not in ATTENTIONS:
            continue
        if all(isinstance(getattr(mod, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            found[name] = mod
    return found


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


# ---------------------------------------------------------------------------------------------
# The modules
# ---------------------------------------------------------------------------------------------
class GatedMLP(nn.Module):
    """A gated MLP with its gate and up projections fused: ``down_proj(gate_up(x))``.

    Parameters
    ----------
    gate_up : QuantLinear or ColumnParallelQuantLinear
        ``activation="swiglu"``: returns ``silu(x @ gate.T + b_g) * (x @ up.T + b_u)``,
        ``[..., I]`` for ``x`` ``[..., H]`` (with tensor parallelism, the rank's features of
        it: a ``ColumnParallelQuantLinear`` that does not gather).
    down_proj : nn.Module
        ``[..., I] -> [..., H]`` (a QuantLinear, or an ``nn.Linear`` kept in full precision).
    """

    def __init__(self, gate_up: nn.Module, down_proj: nn.Module):
        super().__init__()
        if getattr(gate_up, "activation", None) != "swiglu":
            raise TypeError("gate_up must be a QuantLinear (or ColumnParallelQuantLinear) with activation='swiglu'")
        self.gate_up = gate_up
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules = self._modules   # (read without nn.Module.__getattr__: the eager hot path)
        return modules["down_proj"](modules["gate_up"](x))


class RopeTable(nn.Module):
    """The cos / sin tables ``[P, D]`` of a model's rotary embedding at positions ``0 .. P-1``,
    for :func:`mixgemm.ops.rotary.rotary_kv_cache` (one table for all of a model's layers).

    Built from the model's own rotary module (``model.model.rotary_emb``), so the values are the
    model's, its ``attention_scaling`` included; only for rotary kinds whose values depend on
    the position alone (``rope_type`` default, llama3 or linear)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def from_rotary(cls, rotary: nn.Module, positions: int, dtype: torch.dtype,
                    device: torch.device) -> Optional["RopeTable"]:
        """The table of ``rotary`` (a transformers rotary-embedding module), or None when its
        kind is not static."""
        if getattr(rotary, "rope_type", None) not in _STATIC_ROPE:
            return None
        pos = torch.arange(positions, device=device)[None]
        with torch.no_grad():
            cos, sin = rotary(torch.empty(1, dtype=dtype, device=device), pos)
        return cls(cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous())

    @property
    def positions(self) -> int:
        return self.cos.shape[0]

    def kernel_uses(self) -> list[KernelUse]:
        """The rotary / KV-cache kernel of the table's dtype, where it is bf16 or fp16
        (:class:`~mixgemm.dispatch.uses.LaunchesKernels`)."""
        return [rope_spec(self.cos.dtype)] if self.cos.dtype in (torch.bfloat16, torch.float16) else []


#: per transformers modeling module (by name): its ``apply_rotary_pos_emb`` and
#: ``eager_attention_forward`` (see :func:`_modeling_functions`)
_MODELING: dict[str, tuple] = {}


def _modeling_functions(module: str) -> tuple:
    """``(apply_rotary_pos_emb, eager_attention_forward)`` of the transformers modeling module
    named ``module``. A :class:`FusedQKVAttention` keeps the name and looks them up here: under
    torch.compile that is a guard on a string per layer and one set of guards on the functions
    for all layers, where functions kept on each module are guarded on each (code, defaults)."""
    found = _MODELING.get(module)
    if found is None:
        modeling = importlib.import_module(module)
        found = _MODELING[module] = (modeling.apply_rotary_pos_emb, modeling.eager_attention_forward)
    return found


def _cache_of(kwargs: dict, past_key_values):
    """The cache a transformers layer was given (``past_key_values=``, or ``cache=`` in newer
    transformers), removed from ``kwargs``."""
    cache = kwargs.pop("cache", None)
    return past_key_values if past_key_values is not None else cache


class FusedQKVAttention(nn.Module):
    """A transformers attention of :data:`ATTENTIONS` with its q, k and v projections in one GEMM.

    Parameters
    ----------
    attention : nn.Module
        The model's attention module: its configuration, layer index, head size, scaling,
        sliding window, q/k norms (Qwen3) and ``o_proj`` are taken over; its q, k and v are not.
    qkv_proj : nn.Module
        ``[..., H] -> [..., (heads + 2 kv_heads) * D]``, the q rows, then k's, then v's (a
        QuantLinear of the stacked weights).

    Notes
    -----
    ``forward`` is the model's: it takes and returns what the model's attention does
    (``(output, attention weights or None)``). With a :class:`RopeTable` in ``rope`` (set by
    :func:`quantize_model` with ``fuse_layers=True``), a call whose cache layer is transformers'
    static layer and whose token positions are the cache slots they take (a batch without left
    padding: :func:`_positions_are_slots`) takes the rotary embedding and the KV-cache write in
    one launch (:func:`rotary_kv_cache`); any other call runs transformers' rotary embedding and
    ``cache.update``. With the ``sdpa`` backend, a decode step (one token per sequence, a mask of
    one row over the cache) attends in one SDPA call without repeating the KV heads
    (:func:`_decode_attention`), or, for one sequence on that one-launch path on a CUDA device,
    in one FlashAttention launch over the filled slots alone (:func:`_flash_decode_attention`);
    other calls run the model's attention function.
    """

    def __init__(self, attention: nn.Module, qkv_proj: nn.Module):
        super().__init__()
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS   # (the model's library: loaded)

        self.training = attention.training     # (a new module is in training mode: dropout)
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.num_key_value_groups = attention.num_key_value_groups
        self.scaling = attention.scaling
        self.attention_dropout = attention.attention_dropout
        self.is_causal = getattr(attention, "is_causal", True)
        self.heads = attention.config.num_attention_heads
        self.kv_heads = attention.config.num_key_value_heads
        # the window the model's attention passes its attention function: Qwen2's holds its own,
        # Mistral's and Mixtral's pass their config's
        if type(attention).__name__ in _CONFIG_WINDOW:
            self.sliding_window, self._passes_window = getattr(attention.config, "sliding_window", None), True
        else:
            self.sliding_window = getattr(attention, "sliding_window", None)
            self._passes_window = hasattr(attention, "sliding_window")
        self.q_norm = getattr(attention, "q_norm", None)
        self.k_norm = getattr(attention, "k_norm", None)
        self.qkv_proj = qkv_proj
        self.o_proj = attention.o_proj
        d = self.head_dim
        self.sections = (self.heads * d, self.kv_heads * d, self.kv_heads * d)
        self._modeling = type(attention).__module__
        _modeling_functions(self._modeling)
        self._functions = ALL_ATTENTION_FUNCTIONS
        self.rope: Optional[RopeTable] = None
        self.kv_store = StaticKVStore()
        #: an eager decode step of one sequence may attend by its length (:func:`_flash_decodes`)
        self.flash_decode = True
        self.original_class = type(attention).__name__

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        cache = _cache_of(kwargs, past_key_values)
        modules = self._modules   # (read without nn.Module.__getattr__: the eager hot path)
        lead = hidden_states.shape[:-1]
        qkv = modules["qkv_proj"](hidden_states)
        fast = _fused_rope_kv(self, qkv, cache, kwargs.get("position_ids"), attention_mask)
        if fast is not None:
            q, k, v = fast
        else:
            # [..., (heads + 2 kv_heads) * D] -> heads, kv heads, kv heads of D values
            q, k, v = qkv.view(*lead, -1, self.head_dim).split((self.heads, self.kv_heads, self.kv_heads), dim=-2)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            cos, sin = position_embeddings
            q, k = _modeling_functions(self._modeling)[0](q, k, cos, sin)
            if cache is not None:   # (transformers 5's caches take their positions from their own state)
                if not torch.compiler.is_compiling():   # (eager: no guards on the cache's layers)
                    layer = _static_layer(cache, self.layer_idx)
                    if layer is not None and not layer.is_initialized:
                        _initialize(self, layer, k, v)
                k, v = cache.update(k, v, self.layer_idx)
        impl = self.config._attn_implementation
        if impl == "sdpa" and _packs_decode(self, q.shape, k, attention_mask, kwargs):
            if fast is not None and _flash_decodes(self, q.shape[0], q.dtype, q.is_cuda, k, cache):
                out, weights = _flash_decode_attention(self, q, k, v, cache, kwargs["position_ids"]), None
            else:
                out, weights = _decode_attention(self, q, k, v, attention_mask), None
        else:
            attend = _modeling_functions(self._modeling)[1] if impl in (None, "eager") else self._functions[impl]
            extra = {"sliding_window": self.sliding_window} if self._passes_window else {}
            dropout = 0.0 if not self.training else self.attention_dropout
            out, weights = attend(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **extra,
                                  **kwargs)
        out = out.reshape(*lead, -1).contiguous()
        return modules["o_proj"](out), weights

    def extra_repr(self) -> str:
        return f"{self.original_class}, heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}"


def _static_layer(cache, layer_idx: int):
    """The cache's layer ``layer_idx`` where it is transformers' static layer (not offloaded), else None."""
    if getattr(cache, "offloading", False):
        return None
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) <= layer_idx:
        return None
    layer = layers[layer_idx]
    return layer if type(layer).__name__ == "StaticLayer" else None


def _initialize(attn: FusedQKVAttention, layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A static cache layer's first write: transformers allocates its tensors, then (outside a
    trace) the attention's :class:`~mixgemm.nn.static_kv.StaticKVStore` gives it the tensors of
    the previous call's cache instead, so that CUDA graphs recorded for them replay."""
    layer.lazy_initialization(keys, values)
    if not torch.compiler.is_compiling():
        attn.kv_store.adopt(layer)


#: the cache attribute that says whether every sequence's positions are the slots its tokens take
POSITIONS_ARE_SLOTS = "mixgemm_positions_are_slots"
#: the cache attribute that says whether the last forward's positions were its slots and its
#: mask let its last token see every slot up to its own and none after it
MASK_IS_PREFIX = "mixgemm_mask_is_prefix"


def _prefix_row(mask, counter: torch.Tensor, t: int) -> Optional[torch.Tensor]:
    """Whether the last query row of a 4-D boolean or additive ``mask`` over the cache's slots
    allows exactly the slots ``0 .. counter + t - 1`` for every sequence (a 0-d bool tensor, not
    read here), or None for a mask that is not a tensor of 4 dimensions."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    row = mask[:, :, -1, :]
    allowed = row if row.dtype == torch.bool else row == 0
    want = torch.arange(row.shape[-1], device=row.device) < (counter.to(row.device) + t)
    return (allowed == want).all()


def _positions_are_slots(cache, layer, layer_idx: int, position_ids: torch.Tensor, t: int, mask=None) -> bool:
    """Whether each sequence's token positions are the cache slots transformers' static layer
    writes them to (``cumulative_length + 0 .. t-1``, the same for every sequence): true for a
    batch without left padding, false for a padded one, whose rotary positions run behind its
    slots. The one-launch rotary path writes a token at its position, so it serves a batch only
    where they agree.

    Every eager forward compares them at its first such layer, and checks that the mask's last
    row is the prefix of the slots filled (:func:`_prefix_row`; no mask at all is the prefix:
    transformers' sdpa mask function leaves it out only for a causal attention from slot 0 without
    padding), in one synchronization, and records both answers on the cache
    (:data:`POSITIONS_ARE_SLOTS`, :data:`MASK_IS_PREFIX`); the later layers of the same forward
    (the same position tensor, a higher layer index) share the comparison. (A one-token call
    cannot keep the previous call's answer: a chunked prompt's last chunk, or a next turn of
    one token, may have a padded row whose position is not its slot.) At a decode step of
    ``generate()`` the synchronization finds the GPU idle but for the layers before, since
    ``generate()`` read the previous token. A compiled call, and a call captured in a CUDA graph
    (which cannot synchronize), read the answer the last eager call recorded (False where there
    is none: a prompt traced with the model); ``generate()``'s compiled decode steps follow its
    eager prompt, whose rows each move one position and one slot a step."""
    if torch.compiler.is_compiling():
        return bool(getattr(cache, POSITIONS_ARE_SLOTS, False))
    seen = getattr(cache, "_mixgemm_positions_seen", None)   # (the position tensor, the layer that compared)
    known = getattr(cache, POSITIONS_ARE_SLOTS, None)
    if known is not None and seen is not None and seen[0]() is position_ids and layer_idx > seen[1]:
        return known
    if position_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return bool(known)
    counter = getattr(layer, "cumulative_length", None)
    if not isinstance(counter, torch.Tensor) or position_ids.dim() != 2:
        agree = prefix = False
    else:
        counter = counter.to(position_ids.device)
        slots = counter.to(position_ids.dtype) + torch.arange(t, device=position_ids.device, dtype=position_ids.dtype)
        checks = [(position_ids == slots).all()]
        row = _prefix_row(mask, counter, t)
        if row is not None:
            checks.append(row.to(checks[0].device))
        answers = torch.stack(checks).tolist()   # (the one synchronization)
        # No mask: transformers' sdpa mask leaves it out only where the attention is causal from
        # slot 0 with no padding (SDPA's is_causal then does the masking): the prefix
        agree, prefix = answers[0], answers[1] if row is not None else mask is None
    setattr(cache, POSITIONS_ARE_SLOTS, agree)
    setattr(cache, MASK_IS_PREFIX, bool(agree and prefix))
    cache._mixgemm_positions_seen = (weakref.ref(position_ids), layer_idx)
    return agree


def _rope_target(attn: FusedQKVAttention, like: torch.Tensor, cache, position_ids, mask=None) -> Optional[tuple]:
    """``(static layer, cos, sin)`` where one rotary_kv_cache launch writes a call of ``like``'s
    ``[B, T]`` tokens (its dtype and device) into the cache's static layer -- a rotary table, no
    q/k norms, transformers' static layer (initialized here at its first write), positions that
    are the slots, a cache no longer than the table -- or None where torch's path must run. (A
    function, not a method, and the cache length read from the keys' shape: under torch.compile
    every attribute read of a layer is a guard on each call.)"""
    rope = attn._modules.get("rope")   # (None, or the RopeTable; read without nn.Module.__getattr__)
    if rope is None or cache is None or position_ids is None or like.dim() != 3 or attn.q_norm is not None:
        return None
    layer = _static_layer(cache, attn.layer_idx)   # (None for an offloaded cache)
    if layer is None:
        return None
    b, t, _ = like.shape
    if not layer.is_initialized:
        kv = like.new_empty(b, attn.kv_heads, t, attn.head_dim)
        _initialize(attn, layer, kv, kv)
    if tuple(position_ids.shape) != (b, t) or not _positions_are_slots(cache, layer, attn.layer_idx, position_ids,
                                                                       t, mask):
        return None   # (a left-padded sequence, even alone: its positions run behind its slots)
    tables = rope._buffers
    cos, sin = tables["cos"], tables["sin"]
    if layer.keys.shape[2] > cos.shape[0]:   # (a cache longer than the table: torch's path)
        return None
    return layer, cos, sin


def _fused_rope_kv(attn: FusedQKVAttention, qkv: torch.Tensor, cache, position_ids, mask=None) -> Optional[tuple]:
    """(q, keys, values) from one rotary_kv_cache launch into the cache's static layer
    (:func:`_rope_target`), or None where torch's path must run."""
    target = _rope_target(attn, qkv, cache, position_ids, mask)
    if target is None:
        return None
    layer, cos, sin = target
    t = qkv.shape[1]
    keys, values = layer.keys, layer.values
    q = rotary_kv_cache(qkv, cos, sin, keys, values, position_ids, attn.heads, attn.kv_heads)
    counter = getattr(layer, "cumulative_length", None)
    if isinstance(counter, torch.Tensor):
        counter.add_(t)
    return q.transpose(1, 2), keys, values


def _packs_decode(attn: FusedQKVAttention, q_shape: tuple, keys: torch.Tensor, mask, kwargs: dict) -> bool:
    """Whether :func:`_decode_attention` computes this call: one query token per sequence (q's
    shape ``q_shape`` is ``[B, heads, 1, D]``), a boolean or additive mask of one query row over the cache
    (``[B or 1, 1, 1, L]`` over the cache's ``L`` slots, what transformers' sdpa mask functions
    give over a static cache), whole groups of query heads per KV head, no dropout, and nothing
    asked of the attention function that SDPA itself would have to do (attention weights, a soft
    cap, sinks)."""
    return (q_shape[2] == 1 and keys.shape[0] == q_shape[0] and isinstance(mask, torch.Tensor)
            and mask.dim() == 4 and mask.shape[0] in (1, q_shape[0]) and mask.shape[1] == 1
            and mask.shape[2] == 1 and mask.shape[3] == keys.shape[2]
            and attn.heads % attn.kv_heads == 0
            and not (attn.training and attn.attention_dropout)
            and not kwargs.get("output_attentions") and kwargs.get("softcap") is None
            and kwargs.get("s_aux") is None)


def _flash_has_seqused_k() -> bool:
    """Whether this torch has FlashAttention-2's kernels (a CUDA build) and their variable-length
    call takes ``seqused_k`` (the attention below calls it)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or not torch.backends.cuda.is_flash_attention_available():
        return False
    return any(a.name == "seqused_k" for a in op.default._schema.arguments)


_HAS_FLASH = _flash_has_seqused_k()


def _flash_decodes(attn: FusedQKVAttention, batch: int, dtype: torch.dtype, on_cuda: bool, keys: torch.Tensor,
                   cache) -> bool:
    """Whether an eager one-token decode step (q ``[batch, heads, 1, D]`` of ``dtype``, the
    one-launch rotary path having written the token at its position) attends through
    :func:`_flash_decode_attention`:
    FlashAttention-2 takes the call (a CUDA tensor of bf16 / fp16, a head size it has, keys
    contiguous in D) and the step may attend by its length (:func:`_attends_by_length`). A
    compiled step keeps the masked SDPA, which measured faster there (docs/compile-and-graphs.md)."""
    return (not torch.compiler.is_compiling() and _flash_runs(attn, batch, dtype, on_cuda, keys)
            and _attends_by_length(attn, keys, cache))


def _flash_runs(attn: FusedQKVAttention, batch: int, dtype: torch.dtype, on_cuda: bool, keys: torch.Tensor) -> bool:
    """Whether FlashAttention-2 takes a decode step of q ``[batch, heads, 1, D]`` of ``dtype``
    (on a CUDA device: ``on_cuda``) over ``keys``: one sequence."""
    return (_HAS_FLASH and on_cuda and batch == 1 and dtype in (torch.bfloat16, torch.float16)
            and attn.head_dim % 8 == 0 and attn.head_dim <= 256 and keys.stride(-1) == 1)


def _attends_by_length(attn: FusedQKVAttention, keys: torch.Tensor, cache) -> bool:
    """Whether one sequence's decode step over a static cache of ``keys.shape[2]`` slots may
    attend to the slots up to its position, without its mask: its positions are its slots and
    its mask's row is the prefix of the slots filled (both checked by this eager forward:
    :func:`_positions_are_slots`), no sliding window (the layer's or the model's) is shorter than
    the cache, and the layer's ``flash_decode`` is on (set it to False to keep the masked SDPA)."""
    slots = keys.shape[2]
    for window in (attn.sliding_window, getattr(attn.config, "sliding_window", None)):
        if window is not None and window < slots:
            return False
    return attn.flash_decode and getattr(cache, MASK_IS_PREFIX, False) is True   # (recorded only with the positions')


def _decode_lengths(cache, position_ids: torch.Tensor, slots: int, layer_idx: int) -> tuple:
    """FlashAttention's variable-length arguments for one decode token of one sequence over a
    static cache of ``slots`` slots: the keys it uses (``position + 1``, int32 ``[1]``), and the
    query and key offsets ``[0, 1]`` and ``[0, slots]``. Eagerly, the later layers of one forward
    share them (kept on the cache with the position tensor and the layer that made them: the
    first layer of the next forward makes new ones, even from the same position tensor updated
    in place); a compiled step, and a step captured in a CUDA graph (whose memory must not
    outlive the capture), make them for each layer."""
    keep = not torch.compiler.is_compiling() and not (position_ids.is_cuda
                                                       and torch.cuda.is_current_stream_capturing())
    if keep:
        kept = getattr(cache, "_mixgemm_decode_lengths", None)
        if kept is not None and kept[0]() is position_ids and kept[1] == slots and layer_idx > kept[2]:
            return kept[3]
    offsets = torch.arange(2, device=position_ids.device, dtype=torch.int32)
    made = ((position_ids[:, -1] + 1).to(torch.int32), offsets, offsets * slots)
    if keep:
        cache._mixgemm_decode_lengths = (weakref.ref(position_ids), slots, layer_idx, made)
    return made


def _flash_decode_attention(attn: FusedQKVAttention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            cache, position_ids: torch.Tensor) -> torch.Tensor:
    """One decode token of one sequence attending over the filled slots of a static cache, in one
    FlashAttention-2 launch (:func:`mixgemm.ops.layer.flash_decode_attention`: the length is read
    on the GPU, so the step needs no synchronization and replays in a CUDA graph). ``q [1, heads,
    1, D]`` against ``keys / values [1, kv_heads, L, D]``; returns ``[1, 1, heads, D]``, the
    layout transformers' attention functions return. Where :func:`_flash_decodes` holds, the same
    result as :func:`_decode_attention` with the prefix mask, without reading the empty slots (on
    an H200 at 192 slots 9.5 against 14.2 us, at 4096 slots 18 against 88:
    docs/compile-and-graphs.md)."""
    lengths, q_offsets, k_offsets = _decode_lengths(cache, position_ids, keys.shape[2], attn.layer_idx)
    return flash_decode_attention(q, keys, values, lengths, q_offsets, k_offsets, attn.scaling)


def _decode_attention(attn: FusedQKVAttention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """One decode token per sequence attending over the cache in one SDPA call, the ``heads /
    kv_heads`` query heads that share a KV head taken as that head's query rows
    (:func:`mixgemm.ops.layer.grouped_decode_attention`): the same scores and softmax as
    repeating each KV head (transformers' ``repeat_kv``, which it does whenever a mask is given
    and always under torch.compile), without that copy of the cache. ``q [B, heads, 1, D]``;
    returns ``[B, 1, heads, D]``, the layout transformers' attention functions return."""
    return grouped_decode_attention(q, keys, values, mask, attn.kv_heads, attn.scaling)


def _one_call(layer: "FusedDecoderLayer", x: torch.Tensor, mask, position_ids, cache, kwargs: dict) -> Optional[tuple]:
    """The arguments of :func:`mixgemm.ops.layer.decode_layer` for an eager decode step of
    ``layer``, or None where the step must run part by part. It is the same step: one token per
    sequence on the one-launch rotary path (:func:`_rope_target`), attending as
    :meth:`FusedQKVAttention.forward` would (:func:`_flash_decode_attention` or
    :func:`_decode_attention`), through plain :class:`QuantLinear` layers with exact activations
    (``act_format`` ``"bf16"``, or ``"auto"`` where it keeps them at this token count), on a CUDA device whose torch operator library holds the kernels (after the first eager
    forward: the prompt's), and with nothing that records gradients."""
    if (type(x) is not torch.Tensor or x.dim() != 3 or x.shape[1] != 1 or not plans.OPERATORS.holds_rope(x)
            or cache is None or not isinstance(position_ids, torch.Tensor) or position_ids.dtype != torch.int64
            or torch._C._len_torch_dispatch_stack()):
        return None
    modules = layer._modules
    attn, mlp = modules["self_attn"], modules["mlp"]
    norm1, norm2 = modules["input_layernorm"], modules["post_attention_layernorm"]
    w1, w2 = norm1._parameters["weight"], norm2._parameters["weight"]
    if w1.dtype != x.dtype or w2.dtype != x.dtype:
        return None
    amods = attn._modules
    if attn.config._attn_implementation != "sdpa":
        return None
    linears = (amods["qkv_proj"], amods["o_proj"], mlp._modules["gate_up"], mlp._modules["down_proj"])
    weights, shapes, types = [], [], []
    grads = torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad or w2.requires_grad)
    b = x.shape[0]
    for m, (_, activation) in zip(linears, LINEARS):
        if type(m) is not QuantLinear or m.activation != activation or m.act_format not in ("bf16", "auto") \
                or m.auto_fp8(b, x.device):   # ("auto": exact activations at this token count)
            return None
        buffers, params = m._buffers, m._parameters
        if buffers.get("perm") is not None or buffers.get("zero_offsets") is not None:
            return None
        bias = params["bias"] if "bias" in params else m.bias
        grads = grads or (torch.is_grad_enabled() and bias is not None and bias.requires_grad)
        weights += (buffers["qdata"], buffers["scales"], buffers["zeros"], bias)
        shapes += (m.group_size, m.weight_rows, m.in_features)
        types.append(m.weight_type.value)
    if grads:
        return None
    static = _static_layer(cache, attn.layer_idx)   # (a decode step's: written by the prompt)
    if (static is None or not static.is_initialized
            or not _packs_decode(attn, (b, attn.heads, 1, attn.head_dim), static.keys, mask, kwargs)):
        return None
    target = _rope_target(attn, x, cache, position_ids, mask)
    if target is None:
        return None
    _, cos, sin = target
    keys, values = static.keys, static.values
    counter = getattr(static, "cumulative_length", None)
    counter = counter if isinstance(counter, torch.Tensor) else None
    lengths = q_offsets = k_offsets = None
    if _flash_decodes(attn, b, x.dtype, x.is_cuda, keys, cache):
        lengths, q_offsets, k_offsets = _decode_lengths(cache, position_ids, keys.shape[2], attn.layer_idx)
        mask = None
    return (x, [w1, w2], [norm1.variance_epsilon, norm2.variance_epsilon], weights, ",".join(types), shapes, cos, sin,
            keys, values, position_ids, counter, attn.heads, attn.kv_heads, attn.scaling, mask, lengths, q_offsets,
            k_offsets)


#: the eager decode step's operator (its overload: the call skips the packet's overload resolution)
_DECODE_LAYER = torch.ops.mixgemm.decode_layer.default


class FusedDecoderLayer(nn.Module):
    """A LLaMA-style decoder layer in mixgemm's launches (see the module docstring).

    ``h = x + attn(norm1(x)); y = h + mlp(norm2(h))``, where ``norm2`` and the add before it are
    one launch (:func:`mixgemm.rms_norm` with its residual). Built by :func:`quantize_model`
    with ``fuse_layers=True`` from a transformers decoder layer whose attention is a
    :class:`FusedQKVAttention`, whose MLP is a :class:`GatedMLP` and whose norms are LLaMA's.
    ``forward`` takes what the model's decoder layer takes and returns the hidden states.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        if not isinstance(layer.self_attn, FusedQKVAttention) or not isinstance(layer.mlp, GatedMLP):
            raise TypeError("a FusedDecoderLayer needs a FusedQKVAttention and a GatedMLP")
        self.training = layer.training
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = _mixgemm_norm(layer.input_layernorm)
        self.post_attention_layernorm = _mixgemm_norm(layer.post_attention_layernorm)
        self.original_class = type(layer).__name__
        #: an eager decode step runs as one operator call (:func:`_one_call`); False: part by part
        self.one_call = True

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        cache = _cache_of(kwargs, past_key_values)
        if not torch.compiler.is_compiling() and self.one_call:   # (compiled: no read, no guard)
            call = _one_call(self, hidden_states, attention_mask, position_ids, cache, kwargs)
            if call is not None:
                return _DECODE_LAYER(*call)
        modules = self._modules   # (read without nn.Module.__getattr__: the eager hot path)
        h = modules["input_layernorm"](hidden_states)
        a, _ = modules["self_attn"](h, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                    past_key_values=cache, position_ids=position_ids, use_cache=use_cache, **kwargs)
        norm = modules["post_attention_layernorm"]
        weight = norm._parameters["weight"]
        if a.dtype == weight.dtype:
            h, residual = rms_norm(a, weight, norm.variance_epsilon, residual=hidden_states)
        else:
            residual = hidden_states + a
            h = norm(residual)
        return residual + modules["mlp"](h)

    def kernel_uses(self) -> list[KernelUse]:
        """The RMSNorm with the residual add (before the MLP) of the norm's dtype, where it is bf16
        or fp16 (:class:`~mixgemm.dispatch.uses.LaunchesKernels`; the norms' own kernels are theirs)."""
        dtype = self.post_attention_layernorm.weight.dtype
        return [norm_spec(dtype, True)] if dtype in (torch.bfloat16, torch.float16) else []

    def extra_repr(self) -> str:
        return self.original_class


def _mixgemm_norm(norm: nn.Module) -> RMSNorm:
    return norm if isinstance(norm, RMSNorm) else RMSNorm.from_module(norm)


def _fusable_layer(layer: nn.Module) -> bool:
    return (isinstance(getattr(layer, "self_attn", None), FusedQKVAttention)
            and isinstance(getattr(layer, "mlp", None), GatedMLP)
            and all(isinstance(getattr(layer, n, None), RMSNorm) or type(getattr(layer, n, None)).__name__
                    in LLAMA_STYLE_NORMS for n in ("input_layernorm", "post_attention_layernorm"))
            and set(dict(layer.named_children())) == {"self_attn", "mlp", "input_layernorm",
                                                      "post_attention_layernorm"})


# ---------------------------------------------------------------------------------------------
# quantize_model
# ---------------------------------------------------------------------------------------------
def _stacked_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose weight (and bias) stacks the parts' along the output features."""
    first = parts[0]
    w = torch.cat([p.weight.detach() for p in parts])
    lin = nn.Linear(first.in_features, w.shape[0], bias=first.bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if first.bias is not None:
        lin.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return lin


def _qkv_reason(attn: nn.Module, names: list[str], patterns, group_size: int) -> Optional[str]:
    """Why an attention's q, k and v are not fused, or None."""
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    if any(p.search(n) for n in names for p in patterns):
        return "one of q/k/v matches skip"
    if len({(p.in_features, p.bias is None, p.weight.dtype, p.weight.device) for p in parts}) != 1:
        return "q, k and v differ in input size, bias, dtype or device"
    for part in parts:
        why = unsupported_reason(part, group_size)
        if why:
            return why
    return None


def quantize_model(model: nn.Module, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                   skip: Iterable[str] = ("lm_head",), device=None, dtype: Optional[torch.dtype] = None,
                   progress: bool = True, fuse_projections: bool = True,
                   fuse_layers: bool = False, act_format: str = "bf16") -> QuantizeSummary:
    """Replace the model's ``nn.Linear`` layers by :class:`~mixgemm.nn.QuantLinear`, in place.

    Parameters
    ----------
    model : nn.Module
    bits, group_size, symmetric :
        As for :func:`mixgemm.quantize`.
    skip : iterable of str
        Regular expressions; a layer whose qualified name matches one (``re.search``) is kept.
    device : torch.device, optional
        Where the quantized layers live (default: where each linear's weight is).
    dtype : torch.dtype, optional
        Activation dtype (default: each linear's dtype if bf16/fp16, else bf16).
    progress : bool
        Show a progress bar over layers.
    fuse_projections : bool, default True
        In a transformers model of a recognized family (:data:`ATTENTIONS`), the attention's q, k
        and v become one GEMM (:class:`FusedQKVAttention`) and a gated MLP's gate and up one GEMM
        with the swiglu epilogue (:class:`GatedMLP`): four GEMM launches per decoder layer
        instead of seven. Each part is quantized as it would be alone (the codes, scales and zero
        points are the same). A model with no recognized part keeps per-layer replacement (and
        the ``mixgemm`` logger says so).
    fuse_layers : bool, default False
        Also replace each decoder layer of the LLaMA kind by :class:`FusedDecoderLayer` (needs
        ``fuse_projections``), and make transformers' static cache the model's default for
        ``generate()`` (``generation_config.cache_implementation = "static"``), the cache whose
        layers the fused rotary / KV-cache launch writes; and, unless the generation config has
        one, its ``compile_config`` :func:`mixgemm.nn.guards.decode_compile_config` (CUDA-graph
        trees without Dynamo's checks of the modules' internals: modules must not be replaced
        after the first compiled call without ``torch.compiler.reset()``). transformers refuses a
        default cache implementation together with a cache object: a ``generate()`` call given
        a cache (``past_key_values`` / ``cache``), or one in assisted generation with this model
        as its assistant, passes ``cache_implementation=None``. The fused layers are not
        transformers' layer classes, so ``output_hidden_states`` and ``output_attentions`` return
        nothing for them.
    act_format : {"bf16", "fp8", "auto"}, default "bf16"
        The activations of every QuantLinear made (:class:`~mixgemm.nn.QuantLinear`'s
        ``act_format``). ``"fp8"`` rounds each call's activations to e4m3 with a scale per token
        and runs the e4m3 GEMM (docs/fp8.md; the fused gate/up on its gated form): the numerics
        change, and 4- and 2-bit weights only. A layer the e4m3 kernels do not compute would keep
        bf16 activations, named in the summary's ``bf16_activations`` with the reason.
        ``"auto"``: each call of a layer takes the e4m3 path where the GPU's tuning table
        measured it faster for that layer shape and token count, else exact activations
        (:func:`mixgemm.ops.fp8.resolve_act_format`): the numerics change with M.

    Returns
    -------
    QuantizeSummary
        Replaced layer names (a fused layer is ``"<attention>.qkv_proj"`` or ``"<mlp>.gate_up"``),
        skipped layers with the reason, weight bytes before and after, and the fused modules. A
        layer whose shape the kernels cannot take stays an ``nn.Linear``, with a warning that says
        why; it is never silently wrong.
    """
    from tqdm import tqdm   # (deferred: the progress bar is the only user)

    if fuse_layers and not fuse_projections:
        raise ValueError("fuse_layers=True needs fuse_projections=True (a fused layer runs the fused projections)")
    why = act_format_problem(act_format, WeightType.of(bits, symmetric))
    if why:
        raise ValueError(f"quantize_model: {why}")
    patterns = [re.compile(p) for p in skip]
    summary = QuantizeSummary([], {}, 0, 0)
    attentions = find_attentions(model) if fuse_projections else {}
    mlps = find_gated_mlps(model) if fuse_projections else {}
    jobs = len(attentions) + len(mlps) + sum(isinstance(m, nn.Linear) for m in model.modules())
    bar = tqdm(total=jobs, desc="mixgemm quantize", unit="layer", disable=not progress or None)

    def place(layer: QuantLinear) -> QuantLinear:
        return layer if device is None else layer.to(device)

    def count(parts: list[nn.Linear], q: QuantLinear) -> None:
        summary.bytes_before += sum(p.weight.numel() * p.weight.element_size() for p in parts)
        summary.bytes_after += q.packed.nbytes

    for name, attn in attentions.items():
        bar.update(1)
        names = [f"{name}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        why = _qkv_reason(attn, names, patterns, group_size)
        if why:
            _log.info("mixgemm.quantize_model: %s: q, k and v not fused: %s", name, why)
            continue
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        q = place(QuantLinear.from_linear(_stacked_linear(parts), bits, group_size, symmetric, dtype))
        count(parts, q)
        parent, attr = _parent(model, name)
        setattr(parent, attr, FusedQKVAttention(attn, q))
        summary.replaced.append(f"{name}.qkv_proj")
        summary.fused.append(name)
    for name, mlp in mlps.items():
        bar.update(1)
        names = [f"{name}.gate_proj", f"{name}.up_proj"]
        why = ("gate or up matches skip" if any(p.search(n) for n in names for p in patterns)
               else unsupported_reason(mlp.gate_proj, group_size) or unsupported_reason(mlp.up_proj, group_size))
        if why:
            _log.info("mixgemm.quantize_model: %s: gate and up not fused: %s", name, why)
            continue
        q = place(QuantLinear.from_gate_up(mlp.gate_proj, mlp.up_proj, bits, group_size, symmetric, dtype))
        count([mlp.gate_proj, mlp.up_proj], q)
        parent, attr = _parent(model, name)
        setattr(parent, attr, GatedMLP(q, mlp.down_proj))
        summary.replaced.append(f"{name}.gate_up")
        summary.fused.append(name)
    if fuse_projections and not summary.fused:
        _log.info("mixgemm.quantize_model: %s has no attention or gated MLP of a recognized family: "
                  "each linear layer is replaced alone", type(model).__name__)
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        bar.update(1)
        if any(p.search(name) for p in patterns):
            summary.skipped[name] = "matches skip"
            continue
        why = unsupported_reason(linear, group_size)
        if why:
            warnings.warn(f"mixgemm.quantize_model: keeping {name} as nn.Linear: {why}", stacklevel=2)
            summary.skipped[name] = why
            continue
        q = place(QuantLinear.from_linear(linear, bits, group_size, symmetric, dtype))
        count([linear], q)
        parent, attr = _parent(model, name)
        setattr(parent, attr, q)
        summary.replaced.append(name)
    bar.close()
    if act_format != "bf16":   # (the names of the layers made are their module paths)
        summary.bf16_activations = apply_act_format(((n, model.get_submodule(n)) for n in summary.replaced), act_format)
    if summary.bf16_activations:
        _log.info("mixgemm.quantize_model: %d layer(s) keep bf16 activations (act_format=%r): %s",
                  len(summary.bf16_activations), act_format, "; ".join(sorted(set(summary.bf16_activations.values()))))
    if fuse_layers:
        fuse_decoder_layers(model)
    return summary


def fuse_decoder_layers(model: nn.Module) -> list[str]:
    """Replace every decoder layer of ``model`` that :func:`quantize_model` fused the projections
    of (a :class:`FusedQKVAttention`, a :class:`GatedMLP` and two LLaMA-style norms) by a
    :class:`FusedDecoderLayer`, give their attentions the model's :class:`RopeTable`, and make
    the static cache ``generate()``'s default, compiled with :func:`.guards.decode_compile_config`
    (unless the model has a compile config); the names of the replaced layers."""
    targets = [(name, mod) for name, mod in model.named_modules() if _fusable_layer(mod)]
    done = []
    table = None
    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    for name, layer in targets:
        if table is None and rotary is not None:
            ref = layer.input_layernorm.weight     # the model's dtype and device
            positions = min(int(getattr(layer.self_attn.config, "max_position_embeddings", MAX_ROPE_TABLE)),
                            MAX_ROPE_TABLE)
            table = RopeTable.from_rotary(rotary, positions, ref.dtype, ref.device)
        layer.self_attn.rope = table
        parent, attr = _parent(model, name)
        setattr(parent, attr, FusedDecoderLayer(layer))
        done.append(name)
    if not done:
        _log.info("mixgemm.quantize_model: %s has no decoder layer to fuse", type(model).__name__)
    config = getattr(model, "generation_config", None)
    if done and config is not None:
        config.cache_implementation = "static"
        if getattr(config, "compile_config", None) is None:
            config.compile_config = decode_compile_config()
    return done
