"""The GPU run of ``mixgemm bench --moe`` (what it measures and reports: :mod:`.moe`).

Per preset: the bf16 expert weights are made once on the GPU (``w13 [E, 2I, H]``, each expert's
gate rows then its up rows, and ``w2 [E, H, I]``; deterministic from the seed), shared by every
variant. Then one variant at a time is built from them (quantized on the GPU), checked and
timed at every (routing, tokens) point, and freed before the next (DeepSeek-V3's 256 experts are
22.5 GB in bf16). Each point's routing (:func:`.moe.make_routing`) is the same for every variant.

For each point:

1. correctness: the layer (eager) against :func:`mixgemm.moe.fused_moe_reference` on the
   variant's own dequantized weights, dequantized expert by expert as the reference asks for
   them (so that no dense copy of every expert is held);
2. the whole layer (routing, w13 + swiglu, w2, combine) captured in a CUDA graph (after a warm-up
   run on a side stream, which also loads the kernels) and replayed, :func:`.timing.time_cuda`
   with the L2 flushed before each replay; the replayed output is compared with the eager one;
3. the layer called from Python on an idle GPU (the L2 flushed, then a synchronization; CUDA
   events around the call, :func:`.timing.eager_clock`): what a user's eager loop sees, the
   host's time for the call's launches included.

The per-expert loops (the bf16 fallback and torch-int4) slice the sorted rows with expert row
counts computed on the host before the capture, for that point's routing; mixgemm's
``fused_moe`` and ``torch._grouped_mm`` read the counts on the GPU.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..dtypes import ActType
from ..jit.specs import MoeLayoutSpec
from ..moe import combine, fused_moe, fused_moe_reference, plan_fused_moe, route
from ..moe.routing import routing_specs
from ..weights import quantize
from ..weights.experts import PackedExperts
from ..weights.quantize import dequantize_reference, interleave_rows
from .grid import relative_error
from .moe import MOE_PRESETS, MoeConfig, MoeMeasurement, MoePreset, expert_counts, make_routing
from .peer_formats import TORCH_INT4_GROUP_SIZES, ImplUnavailable, torch_int4_dequant, torch_int4_mm, torch_int4_pack
from .run_support import (Log, cuda_capture, describe, free, prebuild_variants, recover, run_presets, run_variants, sync,
                          variant_available)
from .timing import Clock, CudaEventClock, budgeted_iters, device_flush_size, eager_clock, time_cuda
from .variants import Variant, VariantKind

#: ``capture(fn) -> (graph, out)``: ``graph.replay()`` reruns ``fn`` into ``out`` (tests pass a
#: CPU stand-in; the default captures a CUDA graph).
Capture = Callable[[Callable[[], torch.Tensor]], tuple]
WEIGHT_STD = 0.02


# ---------------------------------------------------------------------------------------------
# Weights and layers
# ---------------------------------------------------------------------------------------------
def base_weights(preset: MoePreset, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 experts ``(w13 [E, 2I, H], w2 [E, H, I])``, ``randn * 0.02`` drawn in bf16 (no
    float32 copy); w13 holds each expert's gate rows, then its up rows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, e = preset.hidden, preset.intermediate, preset.experts
    w13 = torch.randn((e, 2 * i, h), generator=gen, dtype=torch.bfloat16, device=device).mul_(WEIGHT_STD)
    w2 = torch.randn((e, h, i), generator=gen, dtype=torch.bfloat16, device=device).mul_(WEIGHT_STD)
    return w13, w2


class PerExpert:
    """``obj[e]``: a tensor made on demand (what :func:`fused_moe_reference` indexes)."""

    def __init__(self, make: Callable[[int], torch.Tensor]):
        self._make = make

    def __getitem__(self, e: int) -> torch.Tensor:
        return self._make(int(e))


def _interleaved(gate_up: torch.Tensor) -> torch.Tensor:
    """``[2I, H]`` gate rows then up rows -> interleaved in 8-row stripes (the reference's layout)."""
    i = gate_up.shape[0] // 2
    return interleave_rows(gate_up[:i], gate_up[i:])


def _swiglu_halves(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in bf16 from ``[R, 2I]`` (gate columns, then up columns)."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def _spans(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, end)`` of every expert with rows, from the host counts."""
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append((e, start, start + c))
        start += c
    return out


class MoeLayer:
    """One variant's layer: ``layer(x, topk_ids, topk_weights, counts) -> [T, H]``; ``counts`` (the
    host row counts of that routing) is used by the per-expert loops only."""

    impl = ""
    expert_bytes = 0

    def __call__(self, x, topk_ids, topk_weights, counts) -> torch.Tensor:
        raise NotImplementedError

    def reference_weights(self) -> tuple[PerExpert, PerExpert]:
        """The variant's dequantized ``w13[e]`` (interleaved, ``[2I, H]``) and ``w2[e]``."""
        raise NotImplementedError


def grouped_mm_probe(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch._grouped_mm`` exists and computes ``x @ w_e.T`` per expert here (a small
    problem against a loop); ``(False, reason)`` if not."""
    if not hasattr(torch, "_grouped_mm"):
        return False, f"this PyTorch ({torch.__version__}) has no torch._grouped_mm"
    try:
        gen = torch.Generator(device=device).manual_seed(7)
        x = torch.randn((24, 64), generator=gen, device=device).to(torch.bfloat16)
        w = torch.randn((3, 32, 64), generator=gen, device=device).to(torch.bfloat16)
        offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        ref = torch.cat([x[:8].float() @ w[0].float().T, x[8:].float() @ w[2].float().T])
        err = relative_error(y, ref)
        if not err < 1e-2:
            return False, f"torch._grouped_mm disagrees with a loop (relative error {err:.1e})"
    except Exception as e:
        return False, f"torch._grouped_mm failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return True, ""


class Bf16Layer(MoeLayer):
    """bf16 experts: ``torch._grouped_mm`` over the sorted rows, or a per-expert loop."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, grouped: bool, why_not: str = ""):
        self.w13, self.w2, self.grouped = w13, w2, grouped
        self.impl = "torch._grouped_mm" if grouped else f"per-expert loop ({why_not})" if why_not else \
            "per-expert loop"
        self.expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()

    def __call__(self, x, topk_ids, topk_weights, counts):
        routing = route(topk_ids, self.w13.shape[0])
        xs = x[routing.tokens]
        if self.grouped:
            offs = routing.expert_offsets[1:].clone()      # the end of each expert's rows, its own allocation
            h = _swiglu_halves(torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs))
            y = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=offs)
        else:
            y = torch.empty_like(xs)
            for e, a, b in _spans(counts):
                h = _swiglu_halves(xs[a:b] @ self.w13[e].T)
                y[a:b] = h @ self.w2[e].T
        return combine(y, routing, topk_weights)

    def reference_weights(self):
        return PerExpert(lambda e: _interleaved(self.w13[e])), PerExpert(lambda e: self.w2[e])


class TorchInt4Layer(MoeLayer):
    """PyTorch's tinygemm int4 (asymmetric, mixgemm's round-to-nearest codes) expert by expert."""

    impl = "per-expert loop of aten._weight_int4pack_mm"

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, group_size: int):
        if group_size not in TORCH_INT4_GROUP_SIZES:
            raise ImplUnavailable(f"tinygemm supports group sizes {TORCH_INT4_GROUP_SIZES}, not {group_size}")
        self.base13, self.base2, self.group_size = w13, w2, group_size
        self._quantize = lambda w: quantize.quantize(w, 4, group_size, symmetric=False, dtype=torch.bfloat16)
        self.w13 = [torch_int4_pack(self._quantize(w13[e])) for e in range(w13.shape[0])]
        self.w2 = [torch_int4_pack(self._quantize(w2[e])) for e in range(w2.shape[0])]
        self.expert_bytes = sum(t.numel() * t.element_size() for t in (*self.w13[0], *self.w2[0]))

    def __call__(self, x, topk_ids, topk_weights, counts):
        routing = route(topk_ids, len(self.w13))
        xs = x[routing.tokens]
        y = torch.empty_like(xs)
        g = self.group_size
        for e, a, b in _spans(counts):
            h = _swiglu_halves(torch_int4_mm(xs[a:b], self.w13[e][0], g, self.w13[e][1]))
            y[a:b] = torch_int4_mm(h, self.w2[e][0], g, self.w2[e][1])
        return combine(y, routing, topk_weights)

    def _dequant(self, base: torch.Tensor, packed: list, e: int) -> torch.Tensor:
        qw = self._quantize(base[e])            # round-to-nearest is deterministic: the codes packed
        return torch_int4_dequant(qw.qweight, packed[e][1], self.group_size)

    def reference_weights(self):
        return (PerExpert(lambda e: _interleaved(self._dequant(self.base13, self.w13, e))),
                PerExpert(lambda e: self._dequant(self.base2, self.w2, e)))


class MixgemmLayer(MoeLayer):
    """:func:`mixgemm.moe.fused_moe` on :class:`mixgemm.moe.PackedExperts` (w13 gate/up
    interleaved per expert, quantized per expert)."""

    impl = "mixgemm.moe.fused_moe"

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, variant: Variant, group_size: int):

        wt = variant.weight_type
        q = lambda w: quantize.quantize(w, wt.bits, group_size, symmetric=wt.signed, dtype=torch.bfloat16)  # noqa: E731
        self.w13 = PackedExperts.from_quantized([q(_interleaved(w13[e])) for e in range(w13.shape[0])])
        self.w2 = PackedExperts.from_quantized([q(w2[e]) for e in range(w2.shape[0])])
        if self.w13.weight_type is not wt:
            raise ValueError(f"quantized to {self.w13.weight_type.value}, wanted {wt.value}")
        self.expert_bytes = self.w13.expert_nbytes + self.w2.expert_nbytes

    def __call__(self, x, topk_ids, topk_weights, counts):
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)

    def reference_weights(self):
        return (PerExpert(lambda e: dequantize_reference(self.w13.expert(e))),
                PerExpert(lambda e: dequantize_reference(self.w2.expert(e))))


def build_layer(variant: Variant, w13: torch.Tensor, w2: torch.Tensor, group_size: int,
                device: torch.device) -> MoeLayer:
    """``variant``'s layer from the bf16 experts."""
    if variant.kind is VariantKind.DENSE:
        ok, why = grouped_mm_probe(device) if device.type == "cuda" else (False, "not on a CUDA device")
        return Bf16Layer(w13, w2, ok, why)
    if variant.kind is VariantKind.TORCH_INT4:
        return TorchInt4Layer(w13, w2, group_size)
    return MixgemmLayer(w13, w2, variant, group_size)


def moe_kernel_specs(preset: MoePreset, variant: Variant, tokens: Sequence[int]) -> list:
    """The mixgemm kernels ``variant`` launches at these token counts (none for the others): the
    grouped kernels, then the routing and combine kernels (int64 ids, float32 weights)."""

    if variant.kind is not VariantKind.MIXGEMM:
        return []
    specs = {}
    for t in tokens:
        plan = plan_fused_moe(t * preset.topk, ActType.BF16, variant.weight_type, preset.experts, preset.hidden,
                              preset.intermediate)
        for s in plan.specs + ((MoeLayoutSpec(),) if plan.kind in ("tiles", "split") else ()):
            specs[s.name] = s
    for s in routing_specs(ActType.BF16, torch.int64, torch.float32):
        specs[s.name] = s
    return list(specs.values())


def run_kernel_specs(cfg: MoeConfig, presets: Sequence[MoePreset]) -> list:
    specs = {s.name: s for p in presets for v in cfg.variants for s in moe_kernel_specs(p, v, cfg.tokens)}
    return list(specs.values())


def prebuild(cfg: MoeConfig, presets: Sequence[MoePreset], log: Log) -> dict[str, str]:
    """Build the run's mixgemm kernels; ``{variant name: reason}`` for variants whose kernels
    did not build."""
    return prebuild_variants(cfg.variants, lambda v: [s for p in presets for s in moe_kernel_specs(p, v, cfg.tokens)],
                             log, "grouped mixgemm kernels")


# ---------------------------------------------------------------------------------------------
# Points
# ---------------------------------------------------------------------------------------------
class PointInputs:
    """One (routing, tokens) point: hidden states and routing on the device, host counts."""

    def __init__(self, preset: MoePreset, routing: str, tokens: int, seed: int, device: torch.device):
        self.routing, self.tokens = routing, tokens
        ids, weights = make_routing(preset.experts, preset.topk, tokens, routing, seed)
        self.counts = expert_counts(ids, preset.experts)
        self.topk_ids, self.topk_weights = ids.to(device), weights.to(device)
        gen = torch.Generator().manual_seed(seed * 7919 + tokens)
        self.x = torch.randn((tokens, preset.hidden), generator=gen).to(torch.bfloat16).to(device)

    @property
    def experts_touched(self) -> int:
        return sum(1 for c in self.counts if c)

    @property
    def max_rows(self) -> int:
        return max(self.counts)


def measure_point(layer: MoeLayer, variant: Variant, preset: MoePreset, pt: PointInputs, cfg: MoeConfig,
                  clock: Clock, flush: int, capture: Capture, device: torch.device, log: Log,
                  eager: Optional[Clock] = None) -> MoeMeasurement:
    """Check, capture and time one point (graph replays on ``clock``, eager calls on ``eager``);
    exceptions are recorded, never raised."""
    base = dict(preset=preset.name, routing=pt.routing, tokens=pt.tokens, variant=variant.name,
                experts_touched=pt.experts_touched, max_expert_rows=pt.max_rows, impl=layer.impl,
                expert_bytes=layer.expert_bytes)
    call = lambda: layer(pt.x, pt.topk_ids, pt.topk_weights, pt.counts)  # noqa: E731
    try:
        with torch.no_grad():
            y = call()                            # the first call also loads the kernels
            sync(device)
            t0 = time.perf_counter()
            call()
            sync(device)
            single_us = (time.perf_counter() - t0) * 1e6
            finite = bool(torch.isfinite(y).all())
            w13_ref, w2_ref = layer.reference_weights()
            ref = fused_moe_reference(pt.x, w13_ref, w2_ref, pt.topk_weights, pt.topk_ids)
            err = relative_error(y, ref)
            del ref
            iters, warmup = budgeted_iters(single_us, cfg.iters, cfg.warmup, cfg.point_budget_s)
            graph, y_graph = capture(call)
            stats = time_cuda(graph.replay, iters, warmup, flush, clock=clock)
            graph.replay()
            sync(device)
            replay_err = relative_error(y_graph, y)
            finite = finite and bool(torch.isfinite(y_graph).all())
            del graph, y_graph
            eager_stats = time_cuda(call, iters, warmup, flush, clock=eager or clock)
    except Exception as e:        # a kernel fault may leave the context unusable: record it, go on
        recover()
        return MoeMeasurement(**base, error=describe(e))
    log(f"  {preset.name} {pt.routing} T={pt.tokens} ({pt.experts_touched} experts) {variant.name}: "
        f"{stats.median_us:.1f} us (eager {eager_stats.median_us:.1f}), err {err:.1e}")
    return MoeMeasurement(**base, timing=stats, eager_timing=eager_stats, err=err, replay_err=replay_err,
                          output_finite=finite)


def run_preset(preset: MoePreset, cfg: MoeConfig, device: torch.device, build_failures: dict[str, str], log: Log,
               clock: Optional[Clock] = None, capture: Optional[Capture] = None) -> list[MoeMeasurement]:
    """Every (routing, tokens, variant) point of one preset; exceptions are recorded, never raised.
    ``clock`` times both the replays and the eager calls (tests); default: CUDA events, the host
    queueing ahead for the replays and an idle GPU for the eager calls."""
    capture = capture or cuda_capture
    flush = device_flush_size(device) if device.type == "cuda" else 0
    eager = clock or eager_clock(flush, device)
    clock = clock or CudaEventClock(flush, device)
    points = [PointInputs(preset, r, t, cfg.seed, device) for r in cfg.routings for t in cfg.tokens]
    t0 = time.perf_counter()
    w13, w2 = base_weights(preset, cfg.seed, device)
    log(f"{preset.name}: {preset.experts} bf16 experts ({(w13.numel() + w2.numel()) * 2 / 1e9:.1f} GB) made in "
        f"{time.perf_counter() - t0:.1f} s")
    out: list[MoeMeasurement] = []

    def skipped(variant: Variant, why: str, unavailable: bool) -> None:
        out.extend(MoeMeasurement(preset.name, p.routing, p.tokens, variant.name, p.experts_touched, p.max_rows,
                                  error=why, unavailable=unavailable) for p in points)

    def measure(variant: Variant, layer, seconds: float) -> None:
        log(f"{preset.name} {variant.name}: experts built in {seconds:.1f} s ({layer.impl})")
        for pt in points:
            out.append(measure_point(layer, variant, preset, pt, cfg, clock, flush, capture, device, log, eager))

    run_variants(cfg.variants, build_failures, skipped, lambda v: build_layer(v, w13, w2, cfg.group_size, device),
                 measure, "experts")
    del w13, w2
    free()
    return out


def run_moe(cfg: MoeConfig, device: torch.device, log: Log = print, clock: Optional[Clock] = None,
            capture: Optional[Capture] = None, presets: Optional[Sequence[MoePreset]] = None) -> list[MoeMeasurement]:
    """Every point of every preset of ``cfg`` (``presets`` overrides the names' presets), the
    kernels built first."""
    presets = list(presets) if presets is not None else [MOE_PRESETS[n] for n in cfg.presets]
    return run_presets(presets, lambda ps, lg: prebuild(cfg, ps, lg),
                       lambda p, failures: run_preset(p, cfg, device, failures, log, clock, capture), log)

__all__ = ["base_weights", "PerExpert", "MoeLayer", "grouped_mm_probe", "Bf16Layer", "TorchInt4Layer", "MixgemmLayer",
           "variant_available", "build_layer", "moe_kernel_specs", "run_kernel_specs", "prebuild", "cuda_capture",
           "PointInputs", "measure_point", "run_preset", "run_moe"]
