"""PyTorch integration: :class:`QuantLinear` and :func:`quantize_model`.

Under ``torch.compile`` (``fullgraph=True`` included) a :class:`QuantLinear` calls the
``torch.ops.mixgemm.gemm`` operator (:func:`mixgemm.ops.gemm_op`, registered by
:mod:`mixgemm.dispatch.library` with a fake implementation for tracing), so that the compiled graph
launches the GEMM through one Python kernel; CUDA graphs, plain or torch.compile's
``mode="reduce-overhead"``, capture it (after a warm-up call has loaded the kernel: loading never
happens during capture).

In eager mode :meth:`QuantLinear.forward` runs the GEMM's cached launch plan directly
(:mod:`mixgemm.dispatch.plans`) instead of going through the operator's dispatch, whenever nothing needs
the operator -- no tracing (``torch.compiler.is_compiling()``), no tensor subclass, meta tensor or
dispatch mode (fake tensors, FlopCounterMode, ...), no autograd recording. Both run the same
kernel with the same arguments.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

import torch
from torch import nn

from ..dispatch import plans
from ..dispatch.uses import KernelUse, WeightUse
from ..dtypes import WeightType
from ..errors import UnsupportedLayerError
from ..jit.specs import Fp8GemmSpec
from ..ops.dense import TOKEN_BUCKETS, gemm, gemm_op, gemm_tensors_full
from ..ops.fp8 import (ACT_FORMATS, check_input_scale_value, fp8_gemm_specs, fp8_problem, layer_prefers_fp8,
                       quant_spec)
from ..weights.layout import ATOM_K, ATOM_N, prepack, unpack
from ..weights.quantize import GATE_UP_STRIPE, deinterleave_rows, interleave_gate_up, interleave_rows, quantize
from ..weights.types import LAYOUT_VERSION, PackedWeight, QuantizedWeight, check_group_size


# ---------------------------------------------------------------------------------------------
# QuantLinear
# ---------------------------------------------------------------------------------------------
def _packed_shapes(in_features: int, out_features: int, bits: int, group_size: int):
    g = in_features // group_size
    return ((out_features // ATOM_N, in_features // ATOM_K, ATOM_N * ATOM_K * bits // 8), (g, out_features))


class QuantLinear(nn.Module):
    """A linear layer with a prepacked low-bit weight: ``y = x @ dequant(W).T + b``.

    Parameters
    ----------
    in_features, out_features : int
        K and N; need ``out_features % 16 == 0`` and ``in_features % 64 == 0``.
    bits : int
        8, 4 or 2.
    group_size : int
        32, 64, 128, 256 or ``in_features`` (per-channel).
    symmetric : bool
        Signed codes without zero points (True) or unsigned codes with zero points (False).
    bias : bool
        Whether the layer has a bias (shape ``[out_features]``, in ``dtype``).
    dtype : torch.dtype
        Activation dtype, bf16 or fp16 (scales, zeros, bias and output use it too).
    device : torch.device, optional
    activation : {"none", "silu", "gelu", "swiglu"}
        Fused into the GEMM's epilogue (below).
    act_format : {"bf16", "fp8", "auto"}
        ``"bf16"`` (the default): the activations are used exactly. ``"fp8"``: they are
        quantized to e4m3 and multiplied on the FP8 tensor cores (``mixgemm.gemm(...,
        act_format="fp8")``, docs/fp8.md), with a scale per token, or with the static
        ``input_scale`` buffer when it is set (:meth:`set_input_scale`); 4- and 2-bit weights,
        every activation, eager, compiled (the op ``torch.ops.mixgemm.gemm_fp8``) and in CUDA
        graphs. ``"auto"``: per call, ``"fp8"`` where the GPU's tuning table measured the e4m3
        path faster for this layer at the call's token count, else ``"bf16"``
        (:func:`mixgemm.ops.fp8.resolve_act_format`): the numerics change with M.

    Notes
    -----
    The weight lives in three buffers in the sm90a prepacked layout (see
    :mod:`mixgemm.weights.layout`): ``qdata`` uint8 ``[N/16, K/64, 128*bits]``, ``scales`` ``[G, N]`` and,
    when asymmetric, ``zeros`` ``[G, N]``. An optional ``perm`` buffer (int64 ``[K]``) permutes the
    input features first (GPTQ act-order checkpoints). The state dict carries the metadata
    (bits, group size, symmetry, activation, layout version) as extra state and refuses a mismatch.

    ``activation`` ("none", "silu", "gelu" or "swiglu") is fused into the GEMM's epilogue (see
    :func:`mixgemm.gemm`). A "swiglu" layer (:meth:`from_gate_up`) holds a gated MLP's gate and up
    projections as one ``[2 * out_features, in_features]`` weight, interleaved in 8-row stripes,
    and returns ``silu(x @ gate.T + b_g) * (x @ up.T + b_u)`` from one kernel launch at any M.
    Its state records the stripe; a state saved by mixgemm 0.1 (16-row stripes) is re-striped
    on load.
    """

    activation = "none"
    act_format = "bf16"

    def __init__(self, in_features: int, out_features: int, bits: int = 4, group_size: int = 128,
                 symmetric: bool = False, bias: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device=None, activation: str = "none", act_format: str = "bf16"):
        super().__init__()
        if activation not in ("none", "silu", "gelu", "swiglu"):
            raise ValueError(f"activation must be none, silu, gelu or swiglu, got {activation!r}")
        why = act_format_problem(act_format, WeightType.of(bits, symmetric), activation)
        if why:
            raise ValueError(why)
        self.activation = activation
        _store_act_format(self, act_format)
        if out_features % ATOM_N or in_features % ATOM_K:
            raise ValueError(f"QuantLinear needs out_features % {ATOM_N} == 0 and in_features % {ATOM_K} == 0, "
                             f"got {out_features} x {in_features}")
        check_group_size(group_size, in_features)
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"dtype must be bfloat16 or float16, got {dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.weight_type = WeightType.of(bits, symmetric)
        self.group_size = group_size
        rows = out_features * (2 if activation == "swiglu" else 1)
        qshape, sshape = _packed_shapes(in_features, rows, bits, group_size)
        self.register_buffer("qdata", torch.zeros(qshape, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(sshape, dtype=dtype, device=device))
        self.register_buffer("zeros", None if symmetric else torch.zeros(sshape, dtype=dtype, device=device))
        self.register_buffer("perm", None)
        self.register_buffer("zero_offsets", None)   # fractional zero points (HQQ imports)
        self.register_buffer("input_scale", None)    # the static e4m3 activation scale (act_format="fp8")
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    @property
    def bits(self) -> int:
        return self.weight_type.bits

    @property
    def symmetric(self) -> bool:
        return self.weight_type.signed

    @property
    def weight_rows(self) -> int:
        """N of the packed weight: out_features, or twice that for a swiglu (gate + up) layer."""
        return self.out_features * (2 if self.activation == "swiglu" else 1)

    def kernel_uses(self) -> list[KernelUse]:
        """The GEMM's weight as its kernels see it (:class:`~mixgemm.dispatch.uses.LaunchesKernels`);
        with ``act_format="fp8"``, instead, the activation quantizer and the e4m3 GEMM of every
        token tile (each call launches the one its token count picks:
        :func:`mixgemm.ops.fp8.select_fp8_launch`); with ``"auto"``, both."""
        packed = self.packed
        fp8 = self.act_format == "fp8" or (self.act_format == "auto" and fp8_problem(packed) is None)
        uses = [] if self.act_format == "fp8" else [WeightUse.of_packed(packed, self.activation)]
        if fp8:   # ("auto": the calls that the tuning table sends to the e4m3 path)
            uses += [quant_spec(self.scales.dtype),
                     *fp8_gemm_specs(packed.act_type, packed.weight_type,
                                     None if self.activation == "none" else self.activation)]
        return uses

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.qdata, self.scales, self.zeros, self.weight_type, self.group_size,
                            self.weight_rows, self.in_features, zero_offsets=self.zero_offsets)

    def set_input_scale(self, input_scale: Optional[torch.Tensor]) -> None:
        """Set (or, with None, remove) the static activation scale that ``act_format="fp8"``
        quantizes every token with: a tensor of one element, positive and finite (checked
        here), stored as float32 on the layer's device in the ``input_scale`` buffer (and in
        the state dict)."""
        if input_scale is not None:
            if not isinstance(input_scale, torch.Tensor) or input_scale.numel() != 1 \
                    or not input_scale.is_floating_point():
                what = (list(input_scale.shape) if isinstance(input_scale, torch.Tensor)
                        else type(input_scale).__name__)
                raise ValueError(f"input_scale must be a floating-point tensor of one element, got {what}")
            check_input_scale_value(input_scale)
            input_scale = input_scale.detach().reshape(()).to(self.qdata.device, torch.float32).clone()
        self.register_buffer("input_scale", input_scale)

    def set_act_format(self, act_format: str) -> None:
        """Switch between exact (``"bf16"``), e4m3 (``"fp8"``) and per-call (``"auto"``)
        activations; the weight is the same for all."""
        why = act_format_problem(act_format, self.weight_type, self.activation)
        if why:
            raise ValueError(why)
        _store_act_format(self, act_format)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmt = self.act_format
        if fmt != "bf16" and (fmt == "fp8" or torch.compiler.is_compiling() or self.auto_fp8(math.prod(x.shape[:-1]),
                                                                                          x.device)):
            return self._forward_fp8(x)
        if torch.compiler.is_compiling():
            return _forward_op(self, x, self._buffers, self.bias)
        # (attributes read without nn.Module.__getattr__: this is the hot path)
        params, buffers = self._parameters, self._buffers
        bias = params["bias"] if "bias" in params else self.bias
        if (type(x) is not torch.Tensor or x.is_meta or torch._C._len_torch_dispatch_stack()
                or (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)))):
            return _forward_op(self, x, buffers, bias)   # a subclass, meta or a dispatch mode sees the op; autograd records it
        perm = buffers.get("perm")
        if perm is not None:
            x = x.index_select(-1, perm)
        activation = None if self.activation == "none" else self.activation
        qdata, scales, zeros = buffers["qdata"], buffers["scales"], buffers["zeros"]
        offsets = buffers.get("zero_offsets")
        n = self.weight_rows
        y = plans.run(x, qdata, scales, zeros, offsets, bias, None, self.weight_type, self.group_size, n,
                      self.in_features, activation, TOKEN_BUCKETS)
        if y is None:   # no plan yet, or something unusual: the full path (checks, errors, a new plan)
            y = gemm_tensors_full(x, qdata, scales, zeros, offsets, bias, self.weight_type, self.group_size, n,
                                  self.in_features, activation)
        return y

    def auto_fp8(self, m: int, device: torch.device) -> bool:
        """Whether ``act_format="auto"`` computes a call of ``m`` tokens on ``device`` with e4m3
        activations (:func:`mixgemm.ops.fp8.resolve_act_format`; False for another format)."""
        return self.act_format == "auto" and layer_prefers_fp8(
            m, self.weight_type, self.group_size, self._buffers.get("zero_offsets") is not None, self.weight_rows,
            self.in_features, device)

    def _forward_fp8(self, x: torch.Tensor) -> torch.Tensor:
        """forward with e4m3 activations (``mixgemm.gemm(..., act_format="fp8")``; with ``"auto"``
        under torch.compile, the op that chooses per call; eagerly ``forward`` has resolved it)."""
        act_format = self.act_format if torch.compiler.is_compiling() else "fp8"
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        scale = self.input_scale
        if scale is not None and scale.dtype != torch.float32:   # a model cast by .to(dtype)
            scale = scale.float()
        return gemm(x, self.packed, self.bias, activation=None if self.activation == "none" else self.activation,
                    act_format=act_format, input_scale=scale)

    def extra_repr(self) -> str:
        act = "" if self.activation == "none" else f", activation={self.activation}"
        if self.act_format != "bf16":
            act += f", act_format={self.act_format}" + (", input_scale=static" if self.input_scale is not None else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, bias={self.bias is not None}, "
                f"dtype={self.scales.dtype}{act}, layout=sm90a/v{LAYOUT_VERSION}")

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_packed(cls, packed: PackedWeight, bias: Optional[torch.Tensor] = None,
                    perm: Optional[torch.Tensor] = None, *, act_format: str = "bf16",
                    input_scale: Optional[torch.Tensor] = None) -> "QuantLinear":
        """Wrap an existing PackedWeight (no copy of its tensors); ``act_format`` and
        ``input_scale`` as for the constructor and :meth:`set_input_scale`."""
        if not isinstance(packed, PackedWeight):
            raise TypeError(f"expected a PackedWeight, got {type(packed).__name__}")
        why = act_format_problem(act_format, packed.weight_type, "none")
        if why:
            raise ValueError(why)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        _store_act_format(layer, act_format)
        layer.in_features, layer.out_features = packed.k, packed.n
        layer.weight_type, layer.group_size = packed.weight_type, packed.group_size
        layer.register_buffer("qdata", packed.qdata)
        layer.register_buffer("scales", packed.scales)
        layer.register_buffer("zeros", packed.zeros)
        layer.register_buffer("zero_offsets", packed.zero_offsets)
        if perm is not None and (perm.shape != (packed.k,) or perm.dtype != torch.int64):
            raise ValueError(f"perm must be int64 of shape [{packed.k}]")
        layer.register_buffer("perm", perm)
        layer.set_input_scale(input_scale)
        if bias is not None:
            if bias.shape != (packed.n,):
                raise ValueError(f"bias must have shape [{packed.n}], got {list(bias.shape)}")
            bias = nn.Parameter(bias.to(packed.dtype), requires_grad=False)
        layer.bias = bias
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                    dtype: Optional[torch.dtype] = None) -> "QuantLinear":
        """Quantize (round-to-nearest, :func:`mixgemm.quantize`) and prepack an ``nn.Linear``.
        ``dtype`` defaults to the linear's dtype if it is bf16/fp16, else bf16. A layer the
        kernels cannot take (``out_features % 16``, ``in_features % 64``, a group size that does
        not divide ``in_features``) raises :class:`mixgemm.errors.UnsupportedLayerError` (a
        ValueError)."""
        why = unsupported_reason(linear, group_size)
        if why:
            raise UnsupportedLayerError(f"QuantLinear.from_linear: {why} (mixgemm's kernels need "
                                        f"out_features % {ATOM_N} == 0 and in_features % {ATOM_K} == 0; "
                                        f"quantize_model keeps such a layer as nn.Linear)")
        w = linear.weight.detach()
        if dtype is None:
            dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        qw = quantize(w, bits, group_size, symmetric=symmetric, dtype=dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls.from_packed(prepack(qw), bias=bias)

    @classmethod
    def from_gate_up(cls, gate: nn.Linear, up: nn.Linear, bits: int = 4, group_size: int = 128,
                     symmetric: bool = False, dtype: Optional[torch.dtype] = None) -> "QuantLinear":
        """A fused gated-MLP input layer: ``silu(gate(x)) * up(x)`` in one GEMM launch.

        ``gate`` and ``up`` are ``nn.Linear(K, I)`` each (``I % 8 == 0``); each is quantized on
        its own (the same result as quantizing it alone), then their rows are interleaved in
        8-row stripes (:func:`mixgemm.weights.quantize.interleave_gate_up`) and prepacked as one
        ``[2I, K]`` weight. The layer's ``out_features`` is ``I``.
        """
        if gate.in_features != up.in_features or gate.out_features != up.out_features:
            raise ValueError("gate and up must have the same shape")
        if (gate.bias is None) != (up.bias is None):
            raise ValueError("gate and up must both have a bias or both have none")
        w = gate.weight.detach()
        if dtype is None:
            dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        qg = quantize(w, bits, group_size, symmetric=symmetric, dtype=dtype)
        qu = quantize(up.weight.detach(), bits, group_size, symmetric=symmetric, dtype=dtype)
        bias = None
        if gate.bias is not None:
            bias = interleave_rows(gate.bias.detach().to(dtype), up.bias.detach().to(dtype))
        layer = cls.from_packed(prepack(interleave_gate_up(qg, qu)), bias=bias)
        layer.activation = "swiglu"
        layer.out_features = gate.out_features
        return layer

    # -- state dict metadata ----------------------------------------------------------------
    def get_extra_state(self):
        state = {"format": "mixgemm.QuantLinear", "weight_type": self.weight_type.value,
                 "group_size": self.group_size, "in_features": self.in_features,
                 "out_features": self.out_features, "activation": self.activation,
                 "layout_version": LAYOUT_VERSION, "arch": "sm90a"}
        if self.activation == "swiglu":
            state["gate_up_stripe"] = GATE_UP_STRIPE
        if self.act_format != "bf16":     # absent: bf16 (the states of mixgemm before act_format)
            state["act_format"] = self.act_format
        return state

    def set_extra_state(self, state) -> None:
        mine = self.get_extra_state()
        if not isinstance(state, dict) or state.get("format") != mine["format"]:
            raise ValueError("not a mixgemm QuantLinear state")
        if state.get("layout_version", 0) > LAYOUT_VERSION:
            raise ValueError(f"state has layout version {state['layout_version']}; upgrade mixgemm to read it")
        # absent keys: mixgemm 0.1's states (_load_from_state_dict re-stripes a 0.1 swiglu state
        # and records today's stripe before this runs)
        default = {"activation": "none", "gate_up_stripe": 16, "act_format": "bf16"}
        mine.setdefault("act_format", "bf16")
        diff = {k: (state.get(k, default.get(k)), v) for k, v in mine.items() if state.get(k, default.get(k)) != v}
        if diff:
            raise ValueError(f"QuantLinear metadata mismatch (state, module): {diff}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The act-order permutation, the zero offsets and the static input scale are optional:
        # create the buffers to match the state.
        for name in ("perm", "zero_offsets", "input_scale"):
            key = prefix + name
            if key in state_dict and getattr(self, name) is None:
                self.register_buffer(name, torch.empty_like(state_dict[key], device=self.qdata.device))
        extra = state_dict.get(prefix + "_extra_state")
        # mixgemm 0.1's 16-row stripes are re-striped; any other stripe meets the mismatch error
        if (self.activation == "swiglu" and isinstance(extra, dict) and extra.get("activation") == "swiglu"
                and _state_stripe(extra) == 16 != GATE_UP_STRIPE):
            _restripe_state(state_dict, prefix, self, 16)
            state_dict[prefix + "_extra_state"] = {**extra, "gate_up_stripe": GATE_UP_STRIPE}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _forward_op(layer: QuantLinear, x: torch.Tensor, buffers: dict, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``layer``'s forward through the custom op (what torch.compile traces), ``buffers`` its
    ``_buffers``.

    Under torch.compile every piece of module state read here becomes a guard that each call of
    the compiled function checks again, so it reads as little as it can: the buffers from their
    dict (``layer.qdata`` would go through ``nn.Module.__getattr__``: several guards a read), and
    N, K and the group size from the shapes of qdata ``[N/16, K/64, .]`` and scales
    ``[K/group_size, N]`` (what :class:`~mixgemm.weights.types.PackedWeight` requires of them, and
    guarded already with the tensors) instead of the attributes that repeat them.
    """
    perm = buffers.get("perm")
    if perm is not None:
        x = x.index_select(-1, perm)
    qdata, scales = buffers["qdata"], buffers["scales"]
    k = qdata.shape[1] * ATOM_K
    return torch.ops.mixgemm.gemm(x, qdata, scales, buffers["zeros"], buffers.get("zero_offsets"), bias,
                                  layer.weight_type.value, k // scales.shape[0], scales.shape[1], k, layer.activation)


def _store_act_format(layer: QuantLinear, act_format: str) -> None:
    """Set ``layer.act_format``. The default, bf16, is the class attribute and stays out of the
    instance dict: a compiled forward then reads it without a guard on the layer
    (tests/nn/test_compile_guards.py); fp8 is an instance attribute."""
    if act_format == "bf16":
        layer.__dict__.pop("act_format", None)
    else:
        layer.act_format = act_format


def act_format_problem(act_format, weight_type: WeightType, activation: str = "none") -> Optional[str]:
    """Why a QuantLinear of ``weight_type`` and ``activation`` cannot take ``act_format``, or None."""
    if act_format not in ACT_FORMATS:
        return f"act_format must be one of {ACT_FORMATS}, got {act_format!r}"
    if act_format == "fp8" and weight_type.value not in Fp8GemmSpec.WEIGHTS:
        return (f"act_format='fp8' takes u4, s4, u2 and s2 weights (their codes, minus integer zero points, are "
                f"exact in e4m3); this layer is {weight_type.value}: use act_format='bf16'")
    return None


def apply_act_format(layers: Iterable[tuple[str, "QuantLinear"]], act_format: str) -> dict[str, str]:
    """Give each ``(name, layer)`` ``act_format`` where the kernels compute it (its weight type,
    activation and packed weight: :func:`act_format_problem`, :func:`mixgemm.ops.fp8.fp8_problem`);
    returns the layers left as they were, name -> reason."""
    kept = {}
    for name, layer in layers:
        why = act_format_problem(act_format, layer.weight_type, layer.activation)
        if why is None and act_format in ("fp8", "auto"):
            why = fp8_problem(layer.packed)
        if why:
            kept[name] = why
        else:
            layer.set_act_format(act_format)
    return kept


def _state_stripe(extra: dict) -> int:
    """The gate/up stripe of a swiglu layer's saved state: mixgemm 0.1 had 16 and did not say."""
    return int(extra.get("gate_up_stripe", 16))


def _restripe_state(state_dict: dict, prefix: str, layer: "QuantLinear", old: int) -> None:
    """Re-interleave a swiglu layer's saved tensors from ``old``-row stripes to GATE_UP_STRIPE,
    in ``state_dict`` (exact: unpack, permute the rows, prepack)."""
    def restripe(t: torch.Tensor) -> torch.Tensor:   # rows are dim 0
        return interleave_rows(*deinterleave_rows(t, old)).contiguous()

    def get(name):
        return state_dict.get(prefix + name)

    if get("qdata") is None or get("scales") is None:
        return   # an incomplete state: the usual missing-key error follows
    packed = PackedWeight(get("qdata"), get("scales"), get("zeros"), layer.weight_type, layer.group_size,
                          layer.weight_rows, layer.in_features, zero_offsets=get("zero_offsets"))
    qw = unpack(packed)
    qw = QuantizedWeight(restripe(qw.qweight), restripe(qw.scales),
                         None if qw.zeros is None else restripe(qw.zeros), qw.bits, qw.group_size,
                         qw.symmetric, None if qw.zero_offsets is None else restripe(qw.zero_offsets))
    repacked = prepack(qw)
    for name in ("qdata", "scales", "zeros", "zero_offsets"):
        if get(name) is not None:
            state_dict[prefix + name] = getattr(repacked, name)
    if get("bias") is not None:
        state_dict[prefix + "bias"] = restripe(get("bias"))


# ---------------------------------------------------------------------------------------------
# quantize_model
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class QuantizeSummary:
    """What :func:`quantize_model` did: the QuantLinear layers it made, the linear layers it kept
    (with the reason), the weight bytes before and after, and the modules whose projections it
    fused."""

    replaced: list[str]
    skipped: dict[str, str]
    bytes_before: int
    bytes_after: int
    fused: list[str] = dataclasses.field(default_factory=list)
    #: with act_format="fp8": the layers made that keep bf16 activations, with the reason
    bf16_activations: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        ratio = self.bytes_before / self.bytes_after if self.bytes_after else float("nan")
        kept = f" ({len(self.bf16_activations)} with bf16 activations)" if self.bf16_activations else ""
        return (f"replaced {len(self.replaced)} Linear layers{kept}, skipped {len(self.skipped)}; weight bytes "
                f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB ({ratio:.2f}x)")


def unsupported_reason(linear: nn.Linear, group_size: int) -> Optional[str]:
    """Why mixgemm's kernels cannot take this layer's shape, or None."""
    n, k = linear.out_features, linear.in_features
    if n % ATOM_N:
        return f"out_features={n} is not a multiple of {ATOM_N}"
    if k % ATOM_K:
        return f"in_features={k} is not a multiple of {ATOM_K}"
    try:
        check_group_size(group_size, k)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


__all__ = ["QuantLinear", "QuantizeSummary", "act_format_problem", "apply_act_format", "unsupported_reason"]
