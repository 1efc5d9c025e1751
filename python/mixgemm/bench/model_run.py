"""The GPU run of ``mixgemm bench --model`` (what it measures and reports: :mod:`.model`).

Per preset: the layers' norm weights and KV caches are made once (shared by every variant, so
that a variant and its reference read the same cache); then one variant at a time is built on
the GPU (random float weights, quantized there), checked and timed at every step, and freed
before the next (a LLaMA-3 70B layer is ~1.7 GB of bf16 weights). For each step:

1. correctness: the variant's step (eager) against the bf16 step on its own dequantized weights
   (:func:`.variants.build_layer`'s reference), the output and the keys and values written;
2. ``graph``: the step captured in a CUDA graph (after a warm-up run on a side stream, which also
   loads mixgemm's kernels) and replayed, :func:`.timing.time_cuda` with the L2 flushed before
   each replay; the replayed output is compared with the eager one;
3. ``eager``: the step called from Python on an idle GPU (L2 flushed, then a synchronization),
   CUDA events around the call: the GPU waits on Python's launches, as a user's eager loop does;
4. ``compiled`` (only when asked for): the step through ``torch.compile(fullgraph=True)``
   (inductor's default mode: Triton kernels fuse the norms, rotary, residual adds and cache
   writes; mixgemm's GEMMs stay its custom op), captured in a CUDA graph and replayed as in 2;
   the replayed output is compared with the eager one. Dynamo's caches are reset before each
   point, so every point compiles its own step. mixgemm's e4m3 calls are the op
   ``mixgemm::gemm_fp8`` in the compiled graph.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from .decoder import PRESETS, DecoderStack, LayerState, ModelPreset, Rotary, layer_state, random_tensor, tensor_seed
from .grid import relative_error
from .model import DECODE, ModelConfig, StepMeasurement, StepShape
from .run_support import (Log, cuda_capture, describe, free, prebuild_variants, recover, run_presets, run_variants, sync,
                          variant_available)
from .timing import Clock, CudaEventClock, budgeted_iters, device_flush_size, eager_clock, time_cuda
from .variants import Variant, build_layer, kernel_specs

#: ``make_clock(mode)``: the clock that times a mode's runs (tests pass a CPU one).
ClockFactory = Callable[[str], Clock]
#: torch.compile's backend for the ``compiled`` mode (the CPU tests trace with "eager")
COMPILE_BACKEND = "inductor"
#: the modes that time replays of a captured CUDA graph
GRAPH_MODES = ("graph", "compiled")


def run_kernel_specs(cfg: ModelConfig, presets: Sequence[ModelPreset]) -> list:
    """Every mixgemm kernel the run launches (to build them before anything is timed)."""
    ms = sorted({s.m for s in cfg.shapes()})
    specs = {s.name: s for p in presets for v in cfg.variants for s in kernel_specs(p, v, ms)}
    return list(specs.values())


def prebuild(cfg: ModelConfig, presets: Sequence[ModelPreset], log: Log) -> dict[str, str]:
    """Build the run's mixgemm kernels; ``{variant name: reason}`` for the variants whose kernels
    did not build (their points are reported as errors)."""
    ms = sorted({s.m for s in cfg.shapes()})
    return prebuild_variants(cfg.variants, lambda v: [s for p in presets for s in kernel_specs(p, v, ms)], log)


def mode_problem(variant: Variant, mode: str) -> Optional[str]:
    """Why ``variant`` has no ``mode`` point (reported n/a), or None: every variant runs in every
    mode (mixgemm's e4m3 path traces as the op ``mixgemm::gemm_fp8``)."""
    return None


def _delta_error(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> float:
    """``||y - ref|| / ||ref - x||`` in float64: the error relative to what the layers added."""
    ref64 = ref.double()
    return float((y.double() - ref64).norm() / (ref64 - x.double()).norm())


def _written_kv(states: Sequence[LayerState], shape: StepShape) -> list[torch.Tensor]:
    lo, hi = shape.context, shape.context + shape.tokens
    return [t[:shape.batch, :, lo:hi].clone() for s in states for t in (s.k_cache, s.v_cache)]


class PresetRun:
    """The shared state of one preset's run: caches, norms, rotary table and step inputs."""

    def __init__(self, preset: ModelPreset, cfg: ModelConfig, device: torch.device,
                 make_clock: Optional[ClockFactory] = None):
        self.preset, self.cfg, self.device = preset, cfg, device
        dtype = torch.bfloat16
        shapes = cfg.shapes()
        decode = [s for s in shapes if s.phase == DECODE]
        self.decode_states = [layer_state(preset, i, cfg.seed, max(s.batch for s in decode), cfg.context + 1,
                                          device, dtype) for i in range(cfg.layers)] if decode else []
        prefill = [s for s in shapes if s.phase != DECODE]
        self.prefill_states: list[LayerState] = []
        if prefill:
            length = max(s.cache_length for s in prefill)
            norms = (self.decode_states or [layer_state(preset, i, cfg.seed, 1, 1, device, dtype)
                                            for i in range(cfg.layers)])
            self.prefill_states = [LayerState(n.attn_norm, n.mlp_norm,
                                              torch.zeros(1, preset.kv_heads, length, preset.head_dim, dtype=dtype, device=device),
                                              torch.zeros(1, preset.kv_heads, length, preset.head_dim, dtype=dtype, device=device))
                                   for n in norms]
        self.rotary = Rotary(preset.head_dim, preset.rope_theta, max(s.cache_length for s in shapes), dtype, device)
        self.inputs = {s: random_tensor((s.batch, s.tokens, preset.hidden), tensor_seed(cfg.seed, 10_000 + i, 0),
                                        device).to(dtype) for i, s in enumerate(shapes)}
        self.flush = device_flush_size(device) if device.type == "cuda" else 0
        self.make_clock = make_clock or self._cuda_clock
        self._clocks: dict[str, Clock] = {}

    def _cuda_clock(self, mode: str) -> Clock:
        """Graph replays: the host queues ahead (a GPU-side spin first); eager: an idle GPU. One
        of each per preset (each holds a flush buffer of twice the L2)."""
        if mode not in self._clocks:
            self._clocks[mode] = (CudaEventClock(self.flush, self.device) if mode in GRAPH_MODES
                                  else eager_clock(self.flush, self.device))
        return self._clocks[mode]

    def states(self, shape: StepShape) -> list[LayerState]:
        return self.decode_states if shape.phase == DECODE else self.prefill_states

    def measure(self, variant: Variant, projections: list, references: Optional[list], shape: StepShape,
                log: Log) -> list[StepMeasurement]:
        """Check, then time ``shape``'s step in every mode."""
        cfg, preset = self.cfg, self.preset
        base = dict(preset=preset.name, phase=shape.phase, batch=shape.batch, tokens=shape.tokens,
                    context=shape.context, layers=cfg.layers, variant=variant.name)
        states = self.states(shape)
        stack = DecoderStack(preset, projections, states, self.rotary)
        wbytes = stack.weight_bytes() // cfg.layers
        x, pos = self.inputs[shape], shape.context
        try:
            with torch.no_grad():
                y = stack(x, pos)                 # the first call also loads the kernels
                sync(self.device)
                t0 = time.perf_counter()
                stack(x, pos)
                sync(self.device)
                single_us = (time.perf_counter() - t0) * 1e6   # sizes the iteration budget
                finite = bool(torch.isfinite(y).all())
                err = kv_err = None
                if references is not None:
                    kv = _written_kv(states, shape)
                    y_ref = DecoderStack(preset, references, states, self.rotary)(x, pos)
                    kv_ref = _written_kv(states, shape)
                    err = _delta_error(y, y_ref, x)
                    kv_err = max(relative_error(a, b) for a, b in zip(kv, kv_ref))
                    del kv, kv_ref, y_ref
        except Exception as e:   # a kernel fault may leave the context unusable: record it, go on
            return [StepMeasurement(**base, mode=mode, weight_bytes=wbytes, error=describe(e)) for mode in cfg.modes]
        iters, warmup = budgeted_iters(single_us, cfg.iters, cfg.warmup, cfg.point_budget_s)
        out = []
        for mode in cfg.modes:
            why = mode_problem(variant, mode)
            if why:
                out.append(StepMeasurement(**base, mode=mode, weight_bytes=wbytes, error=why, unavailable=True))
                continue
            try:
                with torch.no_grad():
                    if mode == "compiled" and self.device.type != "cuda":   # the CPU tests: no graph
                        step = _compiled(stack, pos)
                        y_c = step(x)
                        stats = time_cuda(lambda: step(x), iters, warmup, self.flush, clock=self.make_clock(mode))
                        replay_err = _delta_error(y_c, y, x)
                        finite_mode = finite and bool(torch.isfinite(y_c).all())
                    elif mode in GRAPH_MODES:
                        if mode == "compiled":
                            step = _compiled(stack, pos)
                            graph, y_graph = cuda_capture(lambda: step(x))
                        else:
                            graph, y_graph = cuda_capture(lambda: stack(x, pos))
                        stats = time_cuda(graph.replay, iters, warmup, self.flush, clock=self.make_clock(mode))
                        graph.replay()
                        sync(self.device)
                        replay_err = _delta_error(y_graph, y, x)
                        finite_mode = finite and bool(torch.isfinite(y_graph).all())
                        del graph, y_graph
                    else:
                        stats = time_cuda(lambda: stack(x, pos), iters, warmup, self.flush,
                                          clock=self.make_clock(mode))
                        replay_err, finite_mode = None, finite
                out.append(StepMeasurement(**base, mode=mode, weight_bytes=wbytes, timing=stats, err=err,
                                           kv_err=kv_err, replay_err=replay_err, output_finite=finite_mode))
            except Exception as e:
                out.append(StepMeasurement(**base, mode=mode, weight_bytes=wbytes, error=describe(e)))
                recover()
        log(f"  {preset.name} {shape.label} {variant.name}: " + ", ".join(
            f"{m.mode} {m.timing.median_us / cfg.layers:.1f} us/layer" if m.timing else f"{m.mode} {m.error}"
            for m in out) + ("" if err is None else f", err {err:.1e}"))
        return out


def _compiled(stack: DecoderStack, pos: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> stack(x, pos)`` through ``torch.compile(fullgraph=True)`` (a graph break raises),
    after a reset of Dynamo's caches: each point's stack is new, and the code object is shared."""
    torch._dynamo.reset()

    def step(x: torch.Tensor) -> torch.Tensor:
        return stack(x, pos)

    return torch.compile(step, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND)


def build_stack(preset: ModelPreset, variant: Variant, cfg: ModelConfig,
                device: torch.device) -> tuple[list, Optional[list]]:
    """Every layer's projections for ``variant`` and, for a quantized one, their references."""
    projections: list = []
    references: Optional[list] = [] if variant.quantized else None
    for layer in range(cfg.layers):
        proj, ref = build_layer(preset, variant, layer, cfg.seed, device, cfg.group_size)
        projections.append(proj)
        if references is not None:
            references.append(ref)
    return projections, references


def run_preset(preset: ModelPreset, cfg: ModelConfig, device: torch.device, build_failures: dict[str, str],
               log: Log, make_clock: Optional[ClockFactory] = None) -> list[StepMeasurement]:
    """Every (step, variant, mode) point of one preset; exceptions are recorded, never raised."""
    run = PresetRun(preset, cfg, device, make_clock)
    shapes = cfg.shapes()
    out: list[StepMeasurement] = []

    def skipped(variant: Variant, why: str, unavailable: bool) -> None:
        out.extend(StepMeasurement(preset.name, s.phase, s.batch, s.tokens, s.context, cfg.layers, variant.name,
                                   mode, error=why, unavailable=unavailable) for s in shapes for mode in cfg.modes)

    def measure(variant: Variant, built, seconds: float) -> None:
        log(f"{preset.name} {variant.name}: {cfg.layers} layers built in {seconds:.1f} s")
        projections, references = built
        for shape in shapes:
            out.extend(run.measure(variant, projections, references, shape, log))

    run_variants(cfg.variants, build_failures, skipped, lambda v: build_stack(preset, v, cfg, device), measure,
                 "layers")
    del run
    free()
    return out


def run_model(cfg: ModelConfig, device: torch.device, log: Log = print, make_clock: Optional[ClockFactory] = None,
              presets: Optional[Sequence[ModelPreset]] = None) -> list[StepMeasurement]:
    """Every point of every preset of ``cfg`` (``presets`` overrides the names' presets), the
    kernels built first."""
    presets = list(presets) if presets is not None else [PRESETS[name] for name in cfg.presets]
    return run_presets(presets, lambda ps, lg: prebuild(cfg, ps, lg),
                       lambda p, failures: run_preset(p, cfg, device, failures, log, make_clock), log)

__all__ = ["variant_available", "run_kernel_specs", "prebuild", "mode_problem", "PresetRun", "build_stack", "run_preset",
           "run_model"]
