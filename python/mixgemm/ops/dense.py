"""The GEMM and dequantize calls: validation, kernel choice, launch.

Every check here runs before anything is launched: a bad input raises a Python error naming the
problem, never a CUDA fault or a silently wrong result.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:  # codegen and specs are imported lazily: `import mixgemm` stays cheap
    from ..jit.specs import DecodeSpec, GemmSpec, Raster

from ..dispatch import checks, heuristic, plans, tuning
from ..dispatch.library import custom_op
from ..dispatch.heuristic import TOKEN_BUCKETS, select_spec, select_tile, tile_labels, token_bucket  # noqa: F401 (the API)
from ..dtypes import WeightType
from ..weights.types import PackedWeight
from ..jit import loader as runtime
from ..jit.catalog import launch_order
from ..jit.specs import Activation, DequantSpec, Epilogue, GEMM_KINDS, Raster, SWIZZLES
from ..weights.quantize import GATE_UP_STRIPE as S
from . import args, fp8


def _tuned_splits(spec, w: PackedWeight, device: torch.device) -> int:
    """The measured split-K factor of a decode launch (mixgemm.dispatch.tuning), else 0: the planner's."""
    if spec.max_tokens is None:
        return 0
    return tuning.decode_splits(heuristic.gpu_name(device.index), w.n, w.k, spec.tokens, spec.weight.bits)


def supports(x_shape: Sequence[int], w: PackedWeight, dtype: Optional[torch.dtype] = None,
             act_format: str = "bf16") -> tuple[bool, str]:
    """Whether ``gemm(x, w, act_format=act_format)`` can run for an ``x`` of shape ``x_shape``;
    the reason if not (w's device first: a weight on the CPU, or no usable GPU, is the reason
    before any other).

    Parameters
    ----------
    x_shape : sequence of int
        Shape of the activations ``[..., K]``.
    w : PackedWeight
        The prepacked weight.
    dtype : torch.dtype, optional
        dtype of x; defaults to w's activation dtype.
    act_format : {"bf16", "fp8", "auto"}
        As :func:`gemm`'s: ``"fp8"`` also needs a u4, s4, u2 or s2 weight with integer zero
        points (:func:`mixgemm.ops.fp8.fp8_problem`); ``"auto"`` runs wherever ``"bf16"`` does.

    Returns
    -------
    (bool, str)
        ``(True, "")`` or ``(False, reason)``.
    """
    why = args.weight_problem(w) or args.shape_problem(x_shape, w, dtype)
    if why:
        return False, why
    if act_format != "bf16":
        why = fp8.unknown_act_format(act_format) or (fp8.fp8_problem(w) if act_format == "fp8" else None)
        if why:
            return False, why
    return True, ""


def gemm(x: torch.Tensor, w: PackedWeight, bias: Optional[torch.Tensor] = None,
         out: Optional[torch.Tensor] = None, activation: Optional[str] = None,
         act_format: str = "bf16", input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = act(x @ dequant(w).T (+ bias))`` with the dequantization fused into the GEMM.

    Parameters
    ----------
    x : torch.Tensor
        Activations, bfloat16 or float16, shape ``[..., K]``, on an sm_90 CUDA device. A
        non-contiguous or non-16-byte-aligned x is copied first (``x.contiguous()``).
    w : PackedWeight
        Weight ``[N, K]`` prepacked by :func:`mixgemm.prepack` for the same dtype and device.
        ``dequant(w)`` is ``q*s`` (symmetric) or ``(q - z)*s`` (asymmetric), group-wise along K;
        a weight with ``zero_offsets`` (fractional zero points, HQQ) adds them after the
        kernel, ``y += xsum_per_group @ zero_offsets`` in float32, and then applies the
        activation in torch.
    bias : torch.Tensor, optional
        Shape ``[N]``, x's dtype.
    out : torch.Tensor, optional
        Preallocated output ``[..., N]`` (``[..., N/2]`` for swiglu), x's dtype, contiguous and
        16-byte aligned.
    activation : {None, "silu", "gelu", "swiglu"}, optional
        Applied in float32 to ``acc + bias`` before the one rounding to x's dtype. ``"swiglu"``
        takes a weight built by :func:`mixgemm.weights.quantize.interleave_gate_up` (gate and up 8-row
        stripes alternating, ``N = 2I``) and returns ``silu(gate) * up``, ``[..., I]`` (a bias
        must be interleaved the same way). Every activation is fused into every kernel's
        epilogue: one launch, at any M (swiglu by a GEMM kernel with the gated epilogue).
    act_format : {"bf16", "fp8", "auto"}
        ``"bf16"`` (the default): x is used as given (bf16 or fp16), exactly. ``"fp8"``: x is
        quantized to e4m3 with one scale per token (:func:`mixgemm.ops.fp8.quantize_fp8`, a
        launch of its own) and multiplied on the FP8 tensor cores
        (:func:`mixgemm.ops.fp8.gemm_fp8`, docs/fp8.md): u4, s4, u2 and s2 weights with integer
        zero points, activation None, ``"silu"``, ``"gelu"`` or ``"swiglu"``; under torch.compile
        through the custom op ``torch.ops.mixgemm.gemm_fp8``. The weights are used exactly; only
        the activations are rounded (3 mantissa bits). The prepacked weight is the same for both
        formats. ``"auto"``: per call, ``"fp8"`` where the GPU's tuning table measured the e4m3
        path faster for this layer shape at this token count, else ``"bf16"``
        (:func:`mixgemm.ops.fp8.resolve_act_format`): **its numerics change with M**, and it is
        ``"bf16"`` on GPUs, layer shapes and weight types the table does not list.
    input_scale : torch.Tensor, optional
        ``act_format="fp8"`` (or ``"auto"``, for the calls it computes in e4m3) only: a static
        per-tensor activation scale (a W4A8 checkpoint's
        ``input_scale``), float32 with one element on x's device, positive and finite (not
        read here: a check would synchronize with the GPU). Every token is then quantized as
        ``e4m3(clamp(x / input_scale, -448, 448))`` instead of with its own ``amax / 448``;
        values beyond ``448 * input_scale`` saturate.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` (``[..., N/2]`` for swiglu) in x's dtype, contiguous.

    Notes
    -----
    The kernel is chosen by :func:`select_tile` from the number of tokens ``M = prod(x.shape[:-1])``;
    a decode kernel's split-K factor comes from the measured table of :mod:`mixgemm.dispatch.tuning` for
    the layer shapes it lists, else from the kernel's own planner.
    Accumulation is in float32; the result is rounded once to x's dtype.

    The first call for a weight, token-count bucket (:func:`token_bucket`), activation, dtype,
    device and graph-capture state validates everything and makes a launch plan
    (:mod:`mixgemm.dispatch.plans`); later calls check themselves against it with a few attribute reads
    and launch it (one C call), and anything unusual takes the full path again.

    The decode kernels (M <= 16) use programmatic dependent launch: they may start while the
    kernels queued just before them finish, and they request the weight's tensors (``qdata``,
    ``scales``, ``zeros``) before waiting for those kernels; only x, the bias and the output wait.
    So write a packed weight's tensors in place (``copy_``) at load time, not in the last two
    launches before a call that reads them on the same stream.
    """
    if act_format != "bf16":
        why = fp8.unknown_act_format(act_format)
        if why:
            raise ValueError(why)
        if act_format == "auto":
            if torch.compiler.is_compiling():   # the op resolves it when it runs
                return _gemm_fp8_compiling(x, w, bias, out, activation, input_scale, "auto")
            if not isinstance(w, PackedWeight):
                raise TypeError(f"w must be a mixgemm.PackedWeight (see mixgemm.prepack), got {type(w).__name__}")
            act_format = fp8.resolve_act_format(act_format, math.prod(x.shape[:-1]), w, x.device)
            if act_format == "bf16":
                input_scale = None   # the static e4m3 scale is for the calls that take the e4m3 path
        if act_format == "fp8":
            if torch.compiler.is_compiling():
                return _gemm_fp8_compiling(x, w, bias, out, activation, input_scale)
            return fp8.gemm_fp8(x, w, bias, out, activation, input_scale=input_scale)
    if input_scale is not None:
        raise ValueError("input_scale is the static scale of act_format='fp8'; act_format='bf16' uses x exactly "
                         "and takes none")
    if torch.compiler.is_compiling():
        return _gemm_compiling(x, w, bias, out, activation)
    if type(w) is PackedWeight:
        y = plans.run(x, w.qdata, w.scales, w.zeros, w.zero_offsets, bias, out, w.weight_type, w.group_size,
                      w.n, w.k, activation, TOKEN_BUCKETS)
        if y is not None:
            return y
    return _gemm_planned(x, w, bias, out, activation)


def gemm_tensors(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 zero_offsets: Optional[torch.Tensor], bias: Optional[torch.Tensor], weight_type: WeightType,
                 group_size: int, n: int, k: int, activation: Optional[str] = None) -> torch.Tensor:
    """:func:`gemm` of a weight given as its tensors and fields (the custom op and
    :class:`mixgemm.nn.QuantLinear`): a :class:`PackedWeight` is built (and checked) only when the
    call misses its plan."""
    y = plans.run(x, qdata, scales, zeros, zero_offsets, bias, None, weight_type, group_size, n, k, activation,
                  TOKEN_BUCKETS)
    if y is not None:
        return y
    return gemm_tensors_full(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k, activation)


def gemm_tensors_full(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k,
                      activation=None) -> torch.Tensor:
    """:func:`gemm_tensors` without trying the cached plan first (its caller did)."""
    w = PackedWeight(qdata, scales, zeros, weight_type, group_size, n, k, zero_offsets=zero_offsets)
    return _gemm_planned(x, w, bias, None, activation)


# ---------------------------------------------------------------------------------------------
# The custom op: what torch.compile traces (mixgemm.dispatch.library registers it lean)
# ---------------------------------------------------------------------------------------------
_WEIGHT_TYPES = {wt.value: wt for wt in WeightType}


@custom_op("mixgemm::gemm_py", mutates_args=())
def _gemm_py_op(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                zero_offsets: Optional[torch.Tensor], bias: Optional[torch.Tensor], weight_type: str,
                group_size: int, n: int, k: int, activation: str = "none") -> torch.Tensor:
    """The Python kernel of ``mixgemm::gemm``: the cached plan, else the full path (checks,
    errors, a new plan). The C++ kernel of ``mixgemm::gemm`` (mixgemm.jit.torch_ops) calls it
    for every call it does not launch itself."""
    wt = _WEIGHT_TYPES.get(weight_type) or WeightType(weight_type)   # the enum's error for a bad name
    return gemm_tensors(x, qdata, scales, zeros, zero_offsets, bias, wt, group_size, n, k,
                        None if activation == "none" else activation)


@custom_op("mixgemm::gemm", mutates_args=())
def _gemm_op(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
             zero_offsets: Optional[torch.Tensor], bias: Optional[torch.Tensor], weight_type: str,
             group_size: int, n: int, k: int, activation: str = "none") -> torch.Tensor:
    if x.is_cuda:   # the first CUDA call loads the C++ kernel, which takes every later one
        plans.OPERATORS.attach()
    return _gemm_py_op.fn(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k, activation)


def _gemm_fake(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k, activation="none"):
    return x.new_empty((*x.shape[:-1], n // 2 if activation == "swiglu" else n))


_gemm_op.register_fake(_gemm_fake)
_gemm_py_op.register_fake(_gemm_fake)


def gemm_op(x: torch.Tensor, w: PackedWeight, bias: Optional[torch.Tensor] = None,
            activation: Optional[str] = None) -> torch.Tensor:
    """:func:`gemm` through the registered custom op ``torch.ops.mixgemm.gemm`` (what
    torch.compile traces; :func:`gemm` itself takes it while compiling)."""
    return torch.ops.mixgemm.gemm(x, w.qdata, w.scales, w.zeros, w.zero_offsets, bias, w.weight_type.value,
                                  w.group_size, w.n, w.k, activation or "none")


def _gemm_compiling(x, w, bias, out, activation) -> torch.Tensor:
    """:func:`gemm` while torch.compile traces it: the op, and ``out`` written by a copy."""
    if not isinstance(w, PackedWeight):
        raise TypeError(f"w must be a mixgemm.PackedWeight (see mixgemm.prepack), got {type(w).__name__}")
    if activation is not None and activation not in args.ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {args.ACTIVATIONS}, got {activation!r}")
    y = gemm_op(x, w, bias, activation)
    if out is None:
        return y
    out.copy_(y)
    return out


def _gemm_fp8_compiling(x, w, bias, out, activation, input_scale, act_format="fp8") -> torch.Tensor:
    """:func:`gemm` with ``act_format="fp8"`` or ``"auto"`` while torch.compile traces it: the
    eager call's refusals of w and the activation, then the op ``mixgemm::gemm_fp8`` (which
    resolves ``"auto"`` when it runs: the choice depends on the token count only), ``out``
    written by a copy."""
    if not isinstance(w, PackedWeight):
        raise TypeError(f"w must be a mixgemm.PackedWeight (see mixgemm.prepack), got {type(w).__name__}")
    why = fp8.fp8_problem(w) if act_format == "fp8" else None
    if why:
        raise ValueError(why)
    if activation is not None and activation not in args.ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {args.ACTIVATIONS}, got {activation!r}")
    y = torch.ops.mixgemm.gemm_fp8(x, w.qdata, w.scales, w.zeros, w.zero_offsets, bias, w.weight_type.value,
                                   w.group_size, w.n, w.k, activation or "none", input_scale, act_format)
    if out is None:
        return y
    out.copy_(y)
    return out


@custom_op("mixgemm::gemm_fp8", mutates_args=())
def _gemm_fp8_op(x: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                 zero_offsets: Optional[torch.Tensor], bias: Optional[torch.Tensor], weight_type: str,
                 group_size: int, n: int, k: int, activation: str = "none",
                 input_scale: Optional[torch.Tensor] = None, act_format: str = "fp8") -> torch.Tensor:
    """``gemm(..., act_format="fp8" or "auto")`` of a weight given as its tensors and fields, with
    every check of the eager call (what torch.compile traces)."""
    w = PackedWeight(qdata, scales, zeros, _WEIGHT_TYPES.get(weight_type) or WeightType(weight_type), group_size,
                     n, k, zero_offsets=zero_offsets)
    return gemm(x, w, bias, None, None if activation == "none" else activation, act_format=act_format,
                input_scale=input_scale)


@_gemm_fp8_op.register_fake
def _gemm_fp8_fake(x, qdata, scales, zeros, zero_offsets, bias, weight_type, group_size, n, k, activation="none",
                   input_scale=None, act_format="fp8"):
    return x.new_empty((*x.shape[:-1], n // 2 if activation == "swiglu" else n))


def _gemm_planned(x: torch.Tensor, w: PackedWeight, bias, out, activation: Optional[str]) -> torch.Tensor:
    """The full path of :func:`gemm`: every check, the kernel choice, and a launch plan that the
    next calls reuse."""
    args.check_gemm_inputs(x, w, bias, out, activation)
    lead = x.shape[:-1]
    m = math.prod(lead)
    # zero offsets (fractional zero points) are added after the kernel, so the activation too
    fused = w.zero_offsets is None
    sms = heuristic.sm_count(x.get_device())
    spec = select_spec(m, w, activation if fused else None, sms)
    splits = _tuned_splits(spec, w, x.device)
    if activation is not None and not fused:
        return _gemm_then_activate(x, w, spec, bias, out, activation, splits)
    if m == 0:
        n_out = w.n // 2 if activation == "swiglu" else w.n
        return out if out is not None else torch.empty((*lead, n_out), dtype=x.dtype, device=x.device)

    capturing = plans.capturing()
    key = plans.plan_key(w.qdata, token_bucket(m, w.n, w.k, sms), activation, x.dtype, x.device)
    plan = plans.PLANS.get(key, capturing)
    if plan is None or not plan.made_for(w, spec, splits):   # new, or the weight's tensors changed
        raster, swizzle = launch_order(spec)
        kernel = runtime.KERNELS.get(spec, x.device)   # the activation fused in the kernel
        plan = plans.make_plan(spec, kernel, w, dtype=x.dtype, device=x.device, activation=activation,
                               splits=splits, raster=raster, swizzle=swizzle, sm_count=sms,
                               capturing=capturing, key=key)
        plans.PLANS.put(plan)
    return plans.execute(plan, x, m, (*lead, plan.n_out), bias, out, w.zero_offsets)


def _gemm_then_activate(x, w, spec, bias, out, activation, splits) -> torch.Tensor:
    """The kernel without an activation, then ``activation`` in torch (:func:`_activate`), into
    ``out`` if given: the unfused path of :func:`gemm` and :func:`gemm_with_spec`."""
    r = _activate(gemm_with_spec(x, w, spec, bias=bias, splits=splits, _checked=True), activation)
    if out is None:
        return r
    out.copy_(r)
    return out


def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """The epilogue functions in torch, in float32 with one rounding (for the unfused paths);
    swiglu pairs the stripes of a gate/up interleaved weight."""
    if activation is None:
        return y
    if activation == "swiglu":
        pairs = y.view(*y.shape[:-1], y.shape[-1] // (2 * S), 2, S)
        r = (torch.nn.functional.silu(pairs[..., 0, :].float()) * pairs[..., 1, :].float()).to(y.dtype)
        return r.reshape(*y.shape[:-1], y.shape[-1] // 2)
    fn = torch.nn.functional.silu if activation == "silu" else torch.nn.functional.gelu
    return fn(y.float()).to(y.dtype)


def gemm_with_spec(x: torch.Tensor, w: PackedWeight, spec: "GemmSpec | DecodeSpec", bias: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None, *, activation: Optional[str] = None, splits: int = 0,
                   raster: "Raster | None" = None, swizzle: Optional[int] = None,
                   _checked: bool = False) -> torch.Tensor:
    """:func:`gemm` with an explicit kernel (tests and benchmarks use it to run every kernel).

    ``activation``: a decode spec, and a GEMM spec with the gated (swiglu) epilogue, fix their
    own (None means the spec's; another value is an error); the other GEMM specs apply none /
    silu / gelu per call. ``splits``: 0 lets the kernel choose; ``>= 1`` forces a decode
    kernel's split-K factor, ``> 1`` a stream-K GEMM's. ``raster`` (a :class:`specs.Raster`)
    and ``swizzle`` (one of ``specs.SWIZZLES``) override a GEMM kernel's tile order (default:
    its tile config's, :func:`mixgemm.jit.catalog.launch_order`); the decode kernels ignore them."""

    if not isinstance(spec, GEMM_KINDS):
        raise TypeError(f"spec must be a GemmSpec or DecodeSpec, got {type(spec).__name__}")
    own_raster, own_swizzle = launch_order(spec)
    raster = own_raster if raster is None else raster
    swizzle = own_swizzle if swizzle is None else swizzle
    if not isinstance(raster, Raster):
        raise TypeError(f"raster must be a mixgemm.jit.specs.Raster, got {raster!r}")
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES}, got {swizzle!r}")
    fixed = spec.fixed_activation   # None: chosen per call
    if fixed is not None:
        own = None if fixed is Activation.NONE else fixed.value
        if activation is not None and activation != own:
            raise ValueError(f"kernel {spec.name} fuses activation {fixed.value!r}, not {activation!r}")
        activation = own
    elif activation == "swiglu":
        raise ValueError(f"kernel {spec.name} does not fuse swiglu; the same tile with the gated "
                         f"epilogue does ({dataclasses.replace(spec, epilogue=Epilogue.SWIGLU).name})")
    kernel_activation = activation
    if w.zero_offsets is not None and activation is not None:
        if fixed is not None:
            raise ValueError(f"kernel {spec.name} fuses {activation!r}, but w's zero offsets must be "
                             f"added before it: use the spec without activation, or mixgemm.gemm")
        kernel_activation = None     # applied in torch after the offsets
    if not _checked:
        args.check_gemm_inputs(x, w, bias, out, activation)
    if spec.act is not w.act_type or spec.weight is not w.weight_type:
        raise ValueError(f"kernel {spec.name} is for {spec.act.value} x {spec.weight.value}, "
                         f"w is {w.act_type.value} x {w.weight_type.value}")
    lead = x.shape[:-1]
    m = math.prod(lead)
    if spec.max_tokens is not None and m > spec.max_tokens:
        raise ValueError(f"kernel {spec.name} takes at most {spec.max_tokens} tokens, x has M={m}")
    n_out = w.n // 2 if kernel_activation == "swiglu" else w.n
    if kernel_activation != activation:       # zero offsets, then the activation in torch
        return _gemm_then_activate(x, w, spec, bias, out, activation, splits)
    y = out if out is not None else torch.empty((*lead, n_out), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # a launch plan like gemm's, cached under the caller's choice of kernel and launch order in
    # the place of the token bucket; the helper checks the problem before anything launches
    splits = max(0, int(splits))
    capturing = plans.capturing()
    key = plans.plan_key(w.qdata, ("spec", spec, splits, raster, swizzle), activation, x.dtype, x.device)
    plan = plans.PLANS.get(key, capturing)
    if plan is None or not plan.made_for(w, spec, splits):
        kernel = runtime.KERNELS.get(spec, x.device)
        plan = plans.make_plan(spec, kernel, w, dtype=x.dtype, device=x.device, activation=activation,
                               splits=splits, raster=raster, swizzle=swizzle, sm_count=heuristic.sm_count(x.get_device()),
                               capturing=capturing, key=key)
        plans.PLANS.put(plan)
    return plans.execute(plan, x, m, (*lead, n_out), bias, y, w.zero_offsets)


def dequantize(w: PackedWeight, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Dequantize a prepacked weight on the GPU with the kernels' own converters.

    Parameters
    ----------
    w : PackedWeight
        On an sm_90 CUDA device.
    dtype : torch.dtype, optional
        Must equal w's activation dtype (the converters produce it directly, no float32 round
        trip); defaults to it.

    Returns
    -------
    torch.Tensor
        ``[N, K]`` in w's dtype: exactly :func:`mixgemm.dequantize_reference` of ``w``.
    """

    why = args.weight_problem(w) or checks.device_problem(w.device)
    if why:
        raise ValueError(why)
    if dtype is not None and dtype != w.dtype:
        raise TypeError(f"w dequantizes to {w.dtype} (its scales' dtype), not {dtype}")
    out = torch.empty((w.n, w.k), dtype=w.dtype, device=w.device)
    kernel = runtime.KERNELS.get(DequantSpec(w.act_type, w.weight_type), w.device)
    runtime.launch_dequant(kernel, w.qdata.data_ptr(), w.scales.data_ptr(),
                           0 if w.zeros is None else w.zeros.data_ptr(), out.data_ptr(),
                           w.n, w.k, w.group_size)
    if w.zero_offsets is not None:   # as dequantize_reference: float32 sum, one more rounding
        out = (out.float() + w.zero_offsets.t().repeat_interleave(w.group_size, dim=1)).to(w.dtype)
    return out


__all__ = ["gemm", "gemm_op", "gemm_with_spec", "dequantize", "supports", "select_tile", "select_spec"]
