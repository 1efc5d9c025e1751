"""The GPU run of ``mixgemm bench --generate`` (what it measures and how it is reported:
:mod:`.generate`).

One variant at a time (bf16, then each weight type and activation format with each
``fuse_layers`` setting): the model is built (a preset's shapes with random weights, seeded, so
that every variant starts from the same bf16 weights) or loaded, quantized (with the variant's
``act_format``; a model where no layer takes it is reported n/a), its mixgemm kernels (for
``"fp8"`` and ``"auto"`` the quantizer and the e4m3 GEMMs too) built in parallel
(:func:`mixgemm.aot.prebuild.build_for`) so that no nvcc run falls in a timed region, measured, and
freed (with Dynamo's caches) before the next: an 8B bf16 model and its int4 copy never share
the GPU.

Per batch size, first the figures every mode shares:

1. the decode step is recorded: an eager ``generate()`` on a static cache with the forward
   wrapped, which keeps the keywords of its last one-token call (the cache, positions, mask)
   and the cache's position counters before it (transformers' static cache advances a
   counter on the GPU at every call; :class:`DecodeStep` puts it back before each call, one
   small launch, so that calls repeat);
2. the ceiling: that step (eager forward) captured in a CUDA graph (:func:`.run_support.cuda_capture`)
   and replayed, :func:`.timing.time_cuda` with the L2 flushed before each replay;
3. the eager step's host time (:func:`.host.measure_host`: one call at a time, queued behind a
   GPU sleep).

Then per mode (:func:`mode_forward`: the mode's forward in place, Dynamo reset before and
after) and batch: ``WARMUP_GENERATES`` untimed ``generate()`` calls and a one-token one, then
``--repeats`` pairs of a full call and a one-token call (:func:`time_generate`), and, for the
compiled modes, the host time of one call of the compiled step. A failure is recorded in its
point, never raised.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from .. import hf
from ..aot.prebuild import build_for
from ..nn.blocks import quantize_model
from ..nn.linear import QuantizeSummary, QuantLinear
from ..ops.fp8 import resolve_act_format
from . import peers
from .decoder import PRESETS, ModelPreset
from .generate import (HF_DIR, HOST_STEP_REPEATS, STEP_MAX_SLEEP_US, PRESET_MODELS, QUANTIZED_DIR, WARMUP_GENERATES,
                       NO_FUSE, GenerateConfig, GenMeasurement, RunVariant, accepts_keyword, act_format_outcome,
                       auto_note, compile_config_record, fuse_note, generate_kwargs,
                       model_description, preset_config_kwargs, unavailable_reason)
from .grid import OK
from .host import HostPoint, measure_cycles_per_us, measure_host
from .run_support import Log, cuda_capture, describe, free, frozen_heap, recover, sync
from .timing import Clock, CudaEventClock, TimingStats, device_flush_size, time_cuda


def import_transformers():
    """The ``transformers`` module (ImportError that says what needs it when it is missing)."""
    try:
        import transformers   # deferred: optional dependency (mixgemm[hf])
    except ImportError as e:
        raise ImportError(f"mixgemm bench --generate needs transformers (pip install transformers): {e}") from None
    return transformers


# ---------------------------------------------------------------------------------------------
# The models
# ---------------------------------------------------------------------------------------------
def preset_config(preset: ModelPreset, layers: Optional[int] = None):
    """``transformers.AutoConfig.for_model(...)`` of ``preset`` (a ``LlamaConfig`` or
    ``Qwen2Config``) with ``layers`` decoder layers (default: all the model's)."""
    transformers = import_transformers()
    return transformers.AutoConfig.for_model(PRESET_MODELS[preset.name].model_type,
                                             **preset_config_kwargs(preset, layers))


def build_preset_model(preset: ModelPreset, layers: Optional[int], device, seed: int,
                       dtype: torch.dtype = torch.bfloat16):
    """``AutoModelForCausalLM.from_config`` of :func:`preset_config`, created on ``device`` (its
    weights drawn there by transformers' own initialization after ``torch.manual_seed(seed)``: the
    same weights for the same seed and device), in eval mode without gradients. ``device="meta"``
    gives the shapes without memory."""
    transformers = import_transformers()
    config = preset_config(preset, layers)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def fuse_support() -> dict[str, bool]:
    """Whether ``mixgemm.nn.quantize_model`` and ``mixgemm.hf.from_pretrained`` take ``fuse_layers``."""

    return {"quantize_model": accepts_keyword(quantize_model, "fuse_layers"),
            "from_pretrained": accepts_keyword(hf.from_pretrained, "fuse_layers")}


def load_model(cfg: GenerateConfig, run: RunVariant, device: torch.device,
               support: Mapping[str, bool]) -> tuple[Any, Optional[QuantizeSummary]]:
    """The model of ``run`` and, for a mixgemm weight type, what quantizing it did: the preset
    built (or the directory loaded) in bf16, then quantized in place by
    :func:`mixgemm.nn.quantize_model` with the run's ``act_format``; a quantized directory through
    :func:`mixgemm.hf.from_pretrained` (no summary)."""
    transformers = import_transformers()
    if cfg.source == QUANTIZED_DIR:
        kwargs = {"fuse_layers": bool(run.fuse)} if support.get("from_pretrained") else {}
        return hf.from_pretrained(cfg.target, device=device, dtype=torch.bfloat16, **kwargs), None
    if cfg.source == HF_DIR:
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.bfloat16)
        model = model.to(device).eval().requires_grad_(False)
    else:
        model = build_preset_model(PRESETS[cfg.name], cfg.layers, device, cfg.seed)
    if run.weight_type is None:
        return model, None
    kwargs = dict(bits=run.weight_type.bits, group_size=cfg.group_size, symmetric=run.weight_type.signed,
                  progress=False, act_format=run.act_format)
    if support.get("quantize_model"):
        kwargs["fuse_layers"] = bool(run.fuse)
    return model, quantize_model(model, **kwargs)


def auto_choices(model, tokens: int, device: torch.device) -> tuple[int, int]:
    """``(e4m3, layers)``: how many of the model's ``act_format="auto"`` QuantLinear layers take
    the e4m3 path for a call of ``tokens`` tokens on ``device``
    (:func:`mixgemm.ops.fp8.resolve_act_format`: the GPU's tuning table), of how many."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.act_format == "auto"]
    e4m3 = sum(resolve_act_format("auto", tokens, m.packed, device) == "fp8" for m in layers)
    return e4m3, len(layers)


def prebuild_model(model, cfg: GenerateConfig, log: Log) -> Optional[str]:
    """Build (or find cached) every mixgemm kernel the model can launch up to the prompt's token
    count, in parallel (:func:`mixgemm.aot.prebuild.build_for`, default jobs: half the cores); the
    failure in words, or None."""
    t0 = time.perf_counter()
    try:
        arts = build_for(model, max(cfg.batches) * cfg.prompt_tokens, jobs=None, progress=True)
    except Exception as e:
        return f"its kernels did not build: {describe(e)}"
    log(f"  {len(arts)} mixgemm kernels built or found in the cache ({time.perf_counter() - t0:.1f} s)")
    return None


# ---------------------------------------------------------------------------------------------
# generate() and the decode step
# ---------------------------------------------------------------------------------------------
def pad_token_id(model) -> int:
    """The id ``generate()`` pads with: the generation config's pad, else its (first) EOS, else 0
    (given explicitly, so that batched calls do not log a warning each)."""
    gc = model.generation_config
    for value in (gc.pad_token_id, gc.eos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def prompt_ids(vocab: int, batch: int, tokens: int, seed: int, device) -> torch.Tensor:
    """``[batch, tokens]`` random token ids below ``vocab`` (seeded by ``seed`` and ``batch``)."""
    gen = torch.Generator(device=device).manual_seed(seed * 1009 + batch)
    return torch.randint(0, vocab, (batch, tokens), generator=gen, device=device)


def greedy(model, prompt: torch.Tensor, tokens: int, pad: int, **kwargs) -> torch.Tensor:
    """``model.generate`` greedy on ``prompt`` (no padding), exactly ``tokens`` new tokens."""
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad, **kwargs)


@contextlib.contextmanager
def replaced_forward(model, forward: Callable) -> Iterator[None]:
    """``model.forward = forward`` for the block (as a user assigns a compiled forward), then the
    model's own again."""
    before = vars(model).get("forward")
    model.forward = forward
    try:
        yield
    finally:
        if before is None:
            del model.forward
        else:
            model.forward = before


def cache_counters(cache) -> list[torch.Tensor]:
    """The integer tensors of a transformers cache and of its layers (a static layer's
    ``cumulative_length``, the position its next call writes): the state a decode step advances."""
    out: list[torch.Tensor] = []
    for obj in (cache, *(getattr(cache, "layers", None) or ())):
        for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
            if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.numel() <= 64:
                out.append(value)
    return out


@dataclasses.dataclass
class DecodeStep:
    """One decode step as ``generate()`` called the forward: its keywords and the values of the
    cache's counters (:func:`cache_counters`) before the call."""

    kwargs: dict
    counters: list

    def reset(self) -> None:
        """Put the counters back (one ``_foreach_copy_`` launch)."""
        if self.counters:
            torch._foreach_copy_([t for t, _ in self.counters], [s for _, s in self.counters])

    def call(self, forward: Callable) -> Callable[[], Any]:
        """``() -> forward(**kwargs)`` after :meth:`reset`: the same step at every call."""
        def step():
            self.reset()
            return forward(**self.kwargs)

        return step


def record_decode_step(model, prompt: torch.Tensor, new_tokens: int, pad: int) -> DecodeStep:
    """Run an eager ``generate()`` on a static cache with the forward wrapped, and return its last
    one-token call (:class:`DecodeStep`). The cache then holds ``prompt + new_tokens`` positions,
    as in the timed runs.

    Raises
    ------
    RuntimeError
        ``generate()`` made no one-token call.
    """
    forward = model.forward
    last: dict[str, DecodeStep] = {}

    @functools.wraps(forward)      # transformers reads the forward's signature
    def recorder(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if not args and ids is not None and ids.shape[-1] == 1:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            last["step"] = DecodeStep(dict(kwargs), [(t, t.clone()) for t in cache_counters(cache)])
        return forward(*args, **kwargs)

    with replaced_forward(model, recorder):
        greedy(model, prompt, new_tokens, pad, cache_implementation="static", disable_compile=True)
    if "step" not in last:
        raise RuntimeError("generate() made no one-token forward call to record")
    return last["step"]


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def reset_compiled(model=None) -> None:
    """Forget every compiled graph: Dynamo's caches, the CUDA-graph trees, and generate()'s
    compiled call on ``model``."""
    if model is not None:
        for name in ("_compiled_call", "_last_compile_config"):
            vars(model).pop(name, None)
    torch._dynamo.reset()
    try:
        from torch._inductor import cudagraph_trees   # deferred: torch's compiler, only for the compiled modes

        cudagraph_trees.reset_cudagraph_trees()
    except Exception:
        pass


@contextlib.contextmanager
def mode_forward(model, mode: str) -> Iterator[Callable[[], Optional[Callable]]]:
    """The model set up for ``mode`` (:data:`.generate.MODE_DEFINITIONS`) for the block; yields a
    function giving the callable whose host time the mode reports (None: none, e.g. generate()
    compiled nothing). Dynamo's caches are reset before and after."""
    reset_compiled(model)
    try:
        if mode == "compile":
            with replaced_forward(model, torch.compile(model.forward, fullgraph=True)):
                yield lambda: model
        elif mode in ("static", "reduce-overhead"):
            yield lambda: getattr(model, "_compiled_call", None)
        else:
            yield lambda: model
    finally:
        reset_compiled(model)


@dataclasses.dataclass(frozen=True)
class GenTimes:
    """The timed ``generate()`` calls of one point (seconds) and the new tokens each full call made."""

    generate_s: tuple[float, ...]
    prefill_s: tuple[float, ...]
    first_s: float
    made: tuple[int, ...]


def time_generate(model, prompt: torch.Tensor, kwargs: Mapping[str, Any], new_tokens: int, repeats: int,
                  pad: int, device) -> GenTimes:
    """:data:`.generate.WARMUP_GENERATES` untimed full calls (the first one's time is kept: it
    compiles) and a one-token one, then ``repeats`` pairs of a full call (``new_tokens``) and a
    one-token call (the prefill), each between two synchronizations; the timed calls with the
    heap frozen (:func:`.run_support.frozen_heap`)."""
    def run(tokens: int) -> tuple[float, int]:
        sync(device)
        t0 = time.perf_counter()
        out = greedy(model, prompt, tokens, pad, **kwargs)
        sync(device)
        return time.perf_counter() - t0, out.shape[-1] - prompt.shape[-1]

    first = run(new_tokens)[0]
    for _ in range(WARMUP_GENERATES - 1):
        run(new_tokens)
    run(1)
    full, prefill, made = [], [], []
    with frozen_heap():
        for _ in range(repeats):
            t, n = run(new_tokens)
            full.append(t)
            made.append(n)
            prefill.append(run(1)[0])
    return GenTimes(tuple(full), tuple(prefill), first, tuple(made))


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunContext:
    """What every point's GPU timing shares."""

    device: torch.device
    flush: int
    clock: Clock
    cycles_per_us: float
    iters: int
    warmup: int
    disable_compile: bool


def time_ceiling(model, step: DecodeStep, ctx: RunContext) -> tuple[TimingStats, bool]:
    """The decode step (eager forward) captured in a CUDA graph and replayed: the replays' times,
    and whether the replayed logits are finite."""
    with torch.no_grad():
        graph, out = cuda_capture(step.call(model))
        stats = time_cuda(graph.replay, ctx.iters, ctx.warmup, ctx.flush, clock=ctx.clock)
        graph.replay()
        sync(ctx.device)
        finite = bool(torch.isfinite(logits_of(out)).all())
    del graph, out
    return stats, finite


def host_time(fn: Callable[[], Any], batch: int, ctx: RunContext) -> HostPoint:
    """The host's time to issue ``fn`` (one decode step) with the GPU asleep (:func:`.host.measure_host`,
    one call per loop, :data:`.generate.HOST_STEP_REPEATS` loops, the sleep at most
    :data:`.generate.STEP_MAX_SLEEP_US`); never raises."""
    with torch.no_grad(), frozen_heap():
        return measure_host(fn, "decode step", batch, 0, 0, ctx.cycles_per_us, 0, 1, 0, calls=1,
                            repeats=HOST_STEP_REPEATS, max_sleep_us=STEP_MAX_SLEEP_US)


@dataclasses.dataclass
class Shared:
    """One batch's figures that every mode shares: the recorded step, the ceiling, the eager host
    time, and the notes of the batch's points (what ``act_format="auto"`` runs at it, what went
    wrong with the shared figures)."""

    step: Optional[DecodeStep] = None
    ceiling: Optional[TimingStats] = None
    finite: Optional[bool] = None
    host: Optional[HostPoint] = None
    notes: tuple[str, ...] = ()


def shared_figures(model, prompt: torch.Tensor, cfg: GenerateConfig, pad: int, ctx: RunContext) -> Shared:
    try:
        with torch.no_grad():
            step = record_decode_step(model, prompt, cfg.new_tokens, pad)
    except Exception as e:
        recover()
        return Shared(notes=(f"no GPU step or host time: recording the decode step failed: {describe(e)}",))
    try:
        ceiling, finite = time_ceiling(model, step, ctx)
        notes: tuple[str, ...] = ()
    except Exception as e:
        recover()
        ceiling, finite, notes = None, None, (f"no GPU step: {describe(e)}",)
    return Shared(step, ceiling, finite, host_time(step.call(model), prompt.shape[0], ctx), notes)


def _host_figures(host: Optional[HostPoint]) -> tuple[Optional[float], Optional[float], Optional[bool], str]:
    """``(host_us, mode_step_us, queued, note)`` of a step's host measurement: the time to issue
    it, and its GPU time as the mode runs it (the kernels the loop queued behind the sleep)."""
    if host is None:
        return None, None, None, ""
    if host.status != OK:
        return None, None, None, f"no host time: {host.note}"
    if not host.queued:
        return None, None, False, (f"no host time: the step waits for the GPU (a host-device synchronization "
                                   f"inside it), past a {STEP_MAX_SLEEP_US / 1e3:.0f} ms sleep")
    return host.host_us, host.gpu_loop_us, host.queued, ""


def measure_mode(model, mode: str, cfg: GenerateConfig, prompts: Mapping[int, torch.Tensor],
                 shared: Mapping[int, Shared], pad: int, ctx: RunContext, base: Mapping[str, Any], note: str,
                 info: dict, log: Log) -> list[GenMeasurement]:
    """Every batch of one mode (the model set up by :func:`mode_forward`)."""
    out = []
    if mode == "compile" and not ctx.disable_compile:
        why = "this transformers has no generation_config.disable_compile: generate() would compile on top"
        return [GenMeasurement(**base, mode=mode, batch=b, error=why, unavailable=True) for b in cfg.batches]
    with mode_forward(model, mode) as host_callable:
        for b in cfg.batches:
            sh = shared[b]
            kw = dict(base, mode=mode, batch=b, step=sh.ceiling, step_finite=sh.finite)
            try:
                times = time_generate(model, prompts[b], generate_kwargs(mode), cfg.new_tokens, cfg.repeats, pad,
                                      ctx.device)
            except Exception as e:
                out.append(GenMeasurement(**kw, error=describe(e)))
                recover()
                continue
            error = None
            if mode in ("static", "reduce-overhead"):
                used = getattr(model, "_last_compile_config", None)
                if mode == "static" and used is not None and hasattr(used, "to_dict"):
                    label = base["variant"] + ("" if base["fuse"] == NO_FUSE else f" fuse_layers={base['fuse']}")
                    info["static_compile_config"][label] = compile_config_record(used.to_dict())
                if getattr(model, "_compiled_call", None) is None and hasattr(model, "get_compiled_call"):
                    error = "generate() compiled nothing (its auto-compile criteria were not met)"
            cache_note = ""
            if mode == "eager":
                host = sh.host
                default_cache = getattr(model.generation_config, "cache_implementation", None)
                if default_cache not in (None, "dynamic"):
                    cache_note = f"the model's default cache: {default_cache}"
            else:
                fn = host_callable() if sh.step is not None else None
                host = host_time(sh.step.call(fn), b, ctx) if fn is not None else None
            host_us, mode_step_us, queued, host_note = _host_figures(host)
            m = GenMeasurement(**kw, generate_s=times.generate_s, prefill_s=times.prefill_s, first_s=times.first_s,
                               new_tokens_made=times.made, host_us=host_us, mode_step_us=mode_step_us,
                               host_queued=queued,
                               note="; ".join(filter(None, (note, cache_note, *sh.notes, host_note))), error=error)
            out.append(m)
            log(f"  {base['variant']} {base['fuse']} {mode} b{b}: generate {1e3 * min(times.generate_s):.0f} ms "
                f"(first {times.first_s:.1f} s), prefill {1e3 * min(times.prefill_s):.0f} ms"
                + (f", GPU step {sh.ceiling.median_us / 1e3:.2f} ms" if sh.ceiling else "")
                + (f", host {host_us / 1e3:.2f} ms" if host_us is not None else "")
                + (f", GPU in this mode {mode_step_us / 1e3:.2f} ms" if mode_step_us is not None else ""))
    return out


def measure_variant(model, run: RunVariant, cfg: GenerateConfig, ctx: RunContext, note: str, info: dict,
                    log: Log) -> list[GenMeasurement]:
    """Every (mode, batch) point of one model."""
    base = dict(preset=cfg.name, variant=run.name, fuse=run.fuse_label, prompt_tokens=cfg.prompt_tokens,
                new_tokens=cfg.new_tokens, layers=int(model.config.get_text_config().num_hidden_layers))
    pad = pad_token_id(model)
    vocab = model.get_input_embeddings().num_embeddings
    prompts = {b: prompt_ids(vocab, b, cfg.prompt_tokens, cfg.seed, ctx.device) for b in cfg.batches}
    shared = {b: shared_figures(model, prompts[b], cfg, pad, ctx) for b in cfg.batches}
    if run.act_format == "auto":
        for b in cfg.batches:
            choice = auto_note(b, cfg.prompt_tokens, auto_choices(model, b, ctx.device),
                               auto_choices(model, b * cfg.prompt_tokens, ctx.device))
            shared[b] = dataclasses.replace(shared[b], notes=(choice, *shared[b].notes))
    out = []
    for mode in cfg.modes:
        out.extend(measure_mode(model, mode, cfg, prompts, shared, pad, ctx, base, note, info, log))
    return out


def run_generate(cfg: GenerateConfig, device: torch.device, log: Log = print) -> tuple[list[GenMeasurement], dict]:
    """Every point of ``cfg``, and what the report's config adds: the transformers version, whether
    the loaders take ``fuse_layers``, the ``CompileConfig`` that ``static`` used."""
    transformers = import_transformers()
    support = fuse_support()
    mixgemm = peers.mixgemm_available()
    layers = model_description(cfg)["layers"]
    info: dict = {"transformers_version": transformers.__version__, "fuse_layers_supported": support,
                  "static_compile_config": {}}
    note = fuse_note(cfg, support)
    if note:
        info["fuse_layers_note"] = note
        log(f"note: {note}")
    flush = device_flush_size(device)
    ctx = RunContext(device, flush, CudaEventClock(flush, device), measure_cycles_per_us(device), cfg.iters,
                     cfg.warmup, hasattr(transformers.GenerationConfig(), "disable_compile"))
    out: list[GenMeasurement] = []
    for run in cfg.runs():
        base = dict(preset=cfg.name, variant=run.name, fuse=run.fuse_label, prompt_tokens=cfg.prompt_tokens,
                    new_tokens=cfg.new_tokens, layers=layers)

        def skipped(why: str, unavailable: bool) -> list[GenMeasurement]:
            return [GenMeasurement(**base, mode=mode, batch=b, error=why, unavailable=unavailable)
                    for mode in cfg.modes for b in cfg.batches]

        why = unavailable_reason(cfg, run, support, mixgemm)
        if why:
            out.extend(skipped(why, True))
            continue
        t0 = time.perf_counter()
        failure = None
        try:
            model, summary = load_model(cfg, run, device, support)
        except Exception as e:
            failure = f"building the model failed: {describe(e)}"
        if failure is not None:
            out.extend(skipped(failure, False))
            free()        # outside the handler: the traceback no longer holds the partial model
            continue
        log(f"{cfg.name} {run.label}: model ready in {time.perf_counter() - t0:.1f} s")
        unavailable, act_note = (act_format_outcome(run.act_format, summary.replaced, summary.bf16_activations)
                                 if summary is not None else (None, ""))
        failure = prebuild_model(model, cfg, log) if run.fuse is not None and not unavailable else None
        if unavailable:
            out.extend(skipped(unavailable, True))
        elif failure is None:
            notes = "; ".join(filter(None, (note if run.fuse is False else "", act_note)))
            out.extend(measure_variant(model, run, cfg, ctx, notes, info, log))
        else:
            out.extend(skipped(failure, False))
        del model
        reset_compiled()
        free()
    return out, info


__all__ = ["import_transformers", "preset_config", "build_preset_model", "fuse_support", "load_model",
           "auto_choices", "prebuild_model", "pad_token_id", "prompt_ids", "greedy", "replaced_forward",
           "cache_counters",
           "DecodeStep", "record_decode_step", "reset_compiled", "mode_forward", "GenTimes",
           "time_generate", "RunContext", "time_ceiling", "host_time", "Shared", "shared_figures", "measure_mode",
           "measure_variant", "run_generate"]
