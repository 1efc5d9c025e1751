"""A self-contained LLaMA / Qwen2 decoder layer stack for ``mixgemm bench --model``: the real
models' shapes, random weights, and the layer math of the models (RMSNorm, rotary embedding,
grouped-query attention over a static KV cache, SwiGLU MLP, residual adds), with the four linear
projections behind an interface (:class:`Projections`) so that every variant (bf16, mixgemm,
torch's int4) runs the very same layer code.

The projections are fused as serving engines fuse them: ``qkv`` is one linear whose rows are
``[q; k; v]`` (with a bias for Qwen2), and the MLP's gate and up are one linear followed by
``silu(gate) * up``. Nothing here needs a GPU: the tests run the layer on the CPU against a
loop-based reference.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..ops.norm import rms_norm as _rms_norm
from ..ops.rotary import rotary_kv_cache, rotate
from .grid import WEIGHT_STD


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """The shapes of one model's decoder layer.

    Attributes
    ----------
    name : str
        The ``--model`` name.
    source : str
        Where the numbers come from (the model's ``config.json`` on the Hugging Face Hub).
    hidden, intermediate : int
        ``hidden_size`` and ``intermediate_size``.
    heads, kv_heads, head_dim : int
        ``num_attention_heads``, ``num_key_value_heads`` and the head size.
    qkv_bias : bool
        Whether q, k and v have a bias (Qwen2: yes; LLaMA: no).
    rope_theta, rms_eps : float
        The rotary base and the RMSNorm epsilon.
    model_layers : int
        ``num_hidden_layers`` of the whole model (the benchmark runs a shorter stack).
    """

    name: str
    source: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool
    rope_theta: float
    rms_eps: float
    model_layers: int

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"{self.name}: head_dim must be even (rotary pairs), got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        """Output features of the fused qkv projection, ``[q; k; v]``."""
        return self.q_size + 2 * self.kv_size

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (N, K)}`` of the four linears as stored (``gate_up`` holds both halves)."""
        return {"qkv": (self.qkv_rows, self.hidden), "o": (self.hidden, self.q_size),
                "gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}


#: The presets of ``--model``. The numbers are those of each model's config.json on the Hugging
#: Face Hub (hidden_size / intermediate_size / num_attention_heads / num_key_value_heads;
#: head_dim = hidden_size / num_attention_heads in all four):
#:   meta-llama/Meta-Llama-3-8B   4096 / 14336 / 32 / 8, head_dim 128, rope_theta 5e5, eps 1e-5, 32 layers
#:   meta-llama/Meta-Llama-3-70B  8192 / 28672 / 64 / 8, head_dim 128, rope_theta 5e5, eps 1e-5, 80 layers
#:   Qwen/Qwen2.5-7B              3584 / 18944 / 28 / 4, head_dim 128, rope_theta 1e6, eps 1e-6, 28 layers
#:   Qwen/Qwen2.5-32B             5120 / 27648 / 40 / 8, head_dim 128, rope_theta 1e6, eps 1e-5, 64 layers
#: Qwen2 has a bias on q, k and v (attention_bias in its modeling code), LLaMA has none. LLaMA-3
#: (unlike 3.1) has no rope scaling; a scaling changes only the frequency table, not the time.
PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("llama3-8b", "meta-llama/Meta-Llama-3-8B", 4096, 14336, 32, 8, 128, False, 500000.0, 1e-5, 32),
    ModelPreset("llama3-70b", "meta-llama/Meta-Llama-3-70B", 8192, 28672, 64, 8, 128, False, 500000.0, 1e-5, 80),
    ModelPreset("qwen2.5-7b", "Qwen/Qwen2.5-7B", 3584, 18944, 28, 4, 128, True, 1000000.0, 1e-6, 28),
    ModelPreset("qwen2.5-32b", "Qwen/Qwen2.5-32B", 5120, 27648, 40, 8, 128, True, 1000000.0, 1e-5, 64),
)}


# ---------------------------------------------------------------------------------------------
# The layer's pieces
# ---------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """RMSNorm: ``weight * (x / sqrt(mean(x^2) + eps))``, of ``x + residual`` when given (then
    ``(y, x + residual)``): :func:`mixgemm.rms_norm`, one launch of mixgemm's kernel on an sm_90 GPU
    (the residual add fused in), else the add and ``F.rms_norm``. It computes in float32 and rounds
    once, where LLaMA's code rounds the normalized x before the weight multiplies it: at most an
    ulp apart. Every variant's layer runs it, so the comparisons between them are of the GEMMs."""
    return _rms_norm(x, weight, eps, residual)


class Rotary:
    """Rotary position embedding (the "rotate half" form of the LLaMA and Qwen2 code): dimension
    ``i < D/2`` of a head pairs with ``i + D/2`` and the pair turns by ``pos * theta^(-2i/D)``.

    ``cos`` and ``sin`` ``[positions, D]`` are computed once in float32 and kept in ``dtype``.
    """

    def __init__(self, head_dim: int, theta: float, positions: int, dtype: torch.dtype,
                 device: Optional[torch.device] = None):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
        angles = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.positions = positions

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Rotate ``x [B, T, heads, D]`` whose tokens sit at positions ``pos .. pos + T - 1``."""
        t = x.shape[1]
        if pos + t > self.positions:
            raise ValueError(f"positions {pos}..{pos + t - 1} exceed the table's {self.positions}")
        return rotate(x, self.cos[pos:pos + t][None, :, None, :], self.sin[pos:pos + t][None, :, None, :])


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
    """Causal grouped-query attention of ``T`` new tokens at positions ``pos .. pos + T - 1``.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, heads, T, D]``.
    keys, values : torch.Tensor
        ``[B, kv_heads, pos + T, D]``: the cache up to and including the new tokens. Query head
        ``h`` reads KV head ``h // (heads / kv_heads)`` (as the models' ``repeat_kv``).

    Returns
    -------
    torch.Tensor
        ``[B, heads, T, D]``, through ``torch.nn.functional.scaled_dot_product_attention`` with
        its own grouped-query support (``enable_gqa``, PyTorch >= 2.5; the KV heads repeated
        before): one new token (decode) needs no mask, a prefill from position 0 is
        ``is_causal``, anything else gets an explicit mask. (Folding each KV head's query heads
        into the query length instead took twice the time at decode on an H100: one CTA per KV
        head, docs/benchmarking.md.)
    """
    b, heads, t, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if length != pos + t:
        raise ValueError(f"the cache holds {length} positions, expected pos + T = {pos + t}")
    if t == 1:
        kw = {}
    elif pos == 0:
        kw = {"is_causal": True}
    else:
        kw = {"attn_mask": (torch.arange(length, device=q.device)[None, :]
                            <= pos + torch.arange(t, device=q.device)[:, None])}
    if _SDPA_GQA:
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, **kw)
    group = heads // kv_heads
    return F.scaled_dot_product_attention(q, keys.repeat_interleave(group, dim=1),
                                          values.repeat_interleave(group, dim=1), **kw)


#: whether this PyTorch's scaled_dot_product_attention takes ``enable_gqa`` (2.5 and later)
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class Projections(abc.ABC):
    """The four linears of one layer, implemented by a variant (inputs ``[M, K]``)."""

    @abc.abstractmethod
    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, hidden]`` -> ``[M, q_size + 2 kv_size]``, rows ``[q; k; v]``, with the bias if any."""

    @abc.abstractmethod
    def o(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, q_size]`` -> ``[M, hidden]``."""

    @abc.abstractmethod
    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, hidden]`` -> ``silu(x @ gate^T) * (x @ up^T)``, ``[M, intermediate]``."""

    @abc.abstractmethod
    def down(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, intermediate]`` -> ``[M, hidden]``."""

    @abc.abstractmethod
    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the four linears read (codes, scales, zeros, biases): their bytes are
        the layer's weight traffic."""

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())


class DenseProjections(Projections):
    """``F.linear`` on dense weights (cuBLAS on a GPU): the bf16 variant, and the reference
    that a quantized variant is checked against (on its own dequantized weights).

    Parameters
    ----------
    qkv : torch.Tensor
        ``[q_size + 2 kv_size, hidden]``, rows ``[q; k; v]``.
    o, down : torch.Tensor
        ``[hidden, q_size]`` and ``[hidden, intermediate]``.
    gate_up : torch.Tensor
        ``[2 intermediate, hidden]``: the gate's rows, then the up projection's.
    qkv_bias : torch.Tensor, optional
        ``[q_size + 2 kv_size]``.
    """

    def __init__(self, qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 qkv_bias: Optional[torch.Tensor] = None):
        if gate_up.shape[0] % 2:
            raise ValueError("gate_up must hold two halves of equal size")
        self.w_qkv, self.w_o, self.w_gate_up, self.w_down, self.b_qkv = qkv, o, gate_up, down, qkv_bias
        self.intermediate = gate_up.shape[0] // 2

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w_qkv, self.b_qkv)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w_o)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.w_gate_up)
        return F.silu(h[..., :self.intermediate]) * h[..., self.intermediate:]

    def down(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w_down)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w_qkv, self.b_qkv, self.w_o, self.w_gate_up, self.w_down) if t is not None]


@dataclasses.dataclass
class LayerState:
    """What a layer keeps whatever the variant: its two RMSNorm weights ``[hidden]`` and its KV
    cache ``[B, kv_heads, L, D]`` (keys and values)."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def decoder_layer(x: torch.Tensor, pos: int, preset: ModelPreset, proj: Projections, state: LayerState,
                  rotary: Rotary) -> torch.Tensor:
    """One decoder layer on ``x [B, T, hidden]``, tokens at positions ``pos .. pos + T - 1``.

    ``h = x + o(attention(rope(q), rope(k), v))`` with q, k, v from ``qkv(rms_norm(x))`` and the
    new keys and values written to ``state``'s cache at ``pos .. pos + T - 1`` (the attention
    reads the cache's positions ``0 .. pos + T - 1``, which must be all of it: size the cache to
    the step); then ``h + down(mlp_in(rms_norm(h)))``. Returns ``[B, T, hidden]``.
    """
    x, delta = decoder_layer_parts(x, None, pos, preset, proj, state, rotary)
    return x + delta


def decoder_layer_parts(x: torch.Tensor, delta: Optional[torch.Tensor], pos: int, preset: ModelPreset,
                        proj: Projections, state: LayerState, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decoder_layer` of ``x + delta`` (``delta`` None: of ``x``), returning its output as
    ``(x', delta')`` with the last residual add left to the caller: a stack adds it in the next
    layer's first RMSNorm (one launch for the add and the norm, as serving engines fuse them)."""
    b, t, hidden = x.shape
    if delta is None:
        h = rms_norm(x, state.attn_norm, preset.rms_eps)
    else:
        h, x = rms_norm(delta, state.attn_norm, preset.rms_eps, residual=x)
    qkv = proj.qkv(h.reshape(b * t, hidden))
    # q and k turned, k and v written into the cache at pos .. pos + t - 1: one launch
    q = rotary_kv_cache(qkv.reshape(b, t, -1), rotary.cos, rotary.sin, state.k_cache, state.v_cache, pos,
                        preset.heads, preset.kv_heads)
    k_cache, v_cache = state.k_cache[:b], state.v_cache[:b]
    attn = attention(q.transpose(1, 2), k_cache[:, :, :pos + t], v_cache[:, :, :pos + t], pos)
    o = proj.o(attn.transpose(1, 2).reshape(b * t, preset.q_size)).reshape(b, t, hidden)
    h, x = rms_norm(o, state.mlp_norm, preset.rms_eps, residual=x)     # x + o, then its norm: one launch
    return x, proj.down(proj.mlp_in(h.reshape(b * t, hidden))).reshape(b, t, hidden)


class DecoderStack:
    """A stack of decoder layers sharing one rotary table: ``stack(x, pos)`` runs them in order.

    Parameters
    ----------
    preset : ModelPreset
    projections : sequence of Projections
        One per layer.
    states : sequence of LayerState
        One per layer (norm weights and KV cache).
    rotary : Rotary
    """

    def __init__(self, preset: ModelPreset, projections: Sequence[Projections], states: Sequence[LayerState],
                 rotary: Rotary):
        if len(projections) != len(states):
            raise ValueError(f"{len(projections)} projections for {len(states)} layer states")
        self.preset, self.projections, self.states, self.rotary = preset, list(projections), list(states), rotary

    @property
    def layers(self) -> int:
        return len(self.projections)

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        delta = None
        for proj, state in zip(self.projections, self.states):
            x, delta = decoder_layer_parts(x, delta, pos, self.preset, proj, state, self.rotary)
        return x if delta is None else x + delta

    def weight_bytes(self) -> int:
        """Bytes of every weight the stack reads: projections and norms."""
        norms = sum(s.attn_norm.numel() * s.attn_norm.element_size() + s.mlp_norm.numel() * s.mlp_norm.element_size()
                    for s in self.states)
        return sum(p.weight_bytes() for p in self.projections) + norms


# ---------------------------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------------------------
#: Standard deviation of the cached keys: with queries of std ~1.3 (0.02 * sqrt(hidden) per
#: output of a unit-variance input) the attention logits have std ~2.5, so each query attends to
#: a few positions, as in a trained model, instead of averaging the cache to ~0 (which would
#: hide the attention branch from the correctness check).
KEY_STD = 2.0
#: The projections in generation order (their seeds).
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def tensor_seed(seed: int, layer: int, index: int) -> int:
    """The seed of one random tensor: distinct for every (run seed, layer, tensor)."""
    return (seed * 1_000_003 + layer) * 64 + index


def random_tensor(shape: Sequence[int], seed: int, device: torch.device, std: float = 1.0,
                  mean: float = 0.0) -> torch.Tensor:
    """``mean + std * randn(shape)`` in float32 from its own generator (reproducible alone)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    return t.mul_(std).add_(mean) if (std != 1.0 or mean != 0.0) else t


def float_weight(preset: ModelPreset, name: str, layer: int, seed: int, device: torch.device) -> torch.Tensor:
    """The float32 weight ``[N, K]`` of one projection (``q``, ``k``, ``v``, ``o``, ``gate``, ``up``
    or ``down``) of ``layer``: ``randn * WEIGHT_STD``, the same whatever the variant."""
    shapes = {"q": (preset.q_size, preset.hidden), "k": (preset.kv_size, preset.hidden),
              "v": (preset.kv_size, preset.hidden), "o": (preset.hidden, preset.q_size),
              "gate": (preset.intermediate, preset.hidden), "up": (preset.intermediate, preset.hidden),
              "down": (preset.hidden, preset.intermediate)}
    return random_tensor(shapes[name], tensor_seed(seed, layer, PROJECTIONS.index(name)), device, WEIGHT_STD)


def qkv_bias(preset: ModelPreset, layer: int, seed: int, device: torch.device,
             dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The qkv bias ``[q_size + 2 kv_size]`` of ``layer`` (Qwen2), else None: ``randn * 0.1``."""
    if not preset.qkv_bias:
        return None
    return random_tensor((preset.qkv_rows,), tensor_seed(seed, layer, 16), device, 0.1).to(dtype)


def layer_state(preset: ModelPreset, layer: int, seed: int, batch: int, length: int, device: torch.device,
                dtype: torch.dtype) -> LayerState:
    """A layer's norm weights (``1 + 0.1 randn``) and a KV cache of ``batch`` sequences of
    ``length`` positions filled with random keys (std :data:`KEY_STD`) and values (std 1)."""
    shape = (batch, preset.kv_heads, length, preset.head_dim)
    return LayerState(
        attn_norm=random_tensor((preset.hidden,), tensor_seed(seed, layer, 17), device, 0.1, 1.0).to(dtype),
        mlp_norm=random_tensor((preset.hidden,), tensor_seed(seed, layer, 18), device, 0.1, 1.0).to(dtype),
        k_cache=random_tensor(shape, tensor_seed(seed, layer, 19), device, KEY_STD).to(dtype),
        v_cache=random_tensor(shape, tensor_seed(seed, layer, 20), device).to(dtype))


def dense_projections(preset: ModelPreset, layer: int, seed: int, device: torch.device,
                      dtype: torch.dtype = torch.bfloat16) -> DenseProjections:
    """The bf16 (``dtype``) variant of ``layer``: the float weights rounded to ``dtype``."""
    def w(*names):
        return torch.cat([float_weight(preset, n, layer, seed, device) for n in names]).to(dtype)

    return DenseProjections(w("q", "k", "v"), w("o"), w("gate", "up"), w("down"),
                            qkv_bias(preset, layer, seed, device, dtype))


__all__ = ["ModelPreset", "PRESETS", "rms_norm", "Rotary", "attention", "decoder_layer_parts", "Projections", "DenseProjections",
           "LayerState", "decoder_layer", "DecoderStack", "KEY_STD", "PROJECTIONS", "tensor_seed",
           "random_tensor", "float_weight", "qkv_bias", "layer_state", "dense_projections"]
