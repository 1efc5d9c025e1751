"""``mixgemm bench --generate``: transformers' ``generate()`` as a user runs it, bf16 against
mixgemm's weight types (what is measured and how it is reported; everything here is a pure
function of its inputs, tested on the CPU; the GPU run is :mod:`.generate_run`).

The model is a transformers causal LM: a preset's shapes (:data:`.decoder.PRESETS`, random
weights, all its layers unless ``--layers``) or a model directory. Each variant runs on its own
copy: ``bf16``, then, per type of ``--types`` and per ``--fuse-layers`` setting, the same bf16
model through ``mixgemm.nn.quantize_model(model, bits, group_size, symmetric, fuse_layers=...,
act_format=...)`` (``fuse_layers=False``: mixgemm's fused projections, q/k/v in one GEMM and
gate/up in one with the swiglu epilogue; ``True``: mixgemm's whole decoder layer with its own
static KV cache). A type is a weight type (``u4``, ``u2``, ``s8``, ...: ``u`` asymmetric with
zero points, ``s`` symmetric; exact activations, ``act_format="bf16"``), or a 4- or 2-bit one with
a suffix that sets the activations of every QuantLinear: ``-fp8`` (``u4-fp8``, row
``mixgemm-u4-fp8``): ``act_format="fp8"``, each call rounds its input to e4m3 per token and runs
the e4m3 GEMM; ``-auto`` (``u2-auto``, row ``mixgemm-u2-auto``): ``act_format="auto"``, each call
on the e4m3 path where the GPU's tuning table measured it faster for that layer shape and token
count, else exact (each ``-auto`` point's note says how many layers take e4m3 at its decode step
and prompt). 8-bit types have no e4m3 kernel: ``s8-fp8`` and ``s8-auto`` are refused. A
directory with a ``quantization_config`` is loaded by :func:`mixgemm.hf.from_pretrained` and is
its only quantized variant; it has no bf16 baseline (its bf16 rows are ``n/a``). A plain
transformers directory is loaded in bf16 and quantized like a preset.

The modes (:data:`MODE_DEFINITIONS`), every one greedy with ``min_new_tokens = max_new_tokens``:

* ``eager``: the model's default cache (transformers' dynamic cache; the static cache for a
  ``fuse_layers=True`` model, which makes it its default), ``generation_config.disable_compile=True``:
  no compile at all;
* ``compile``: a static cache and ``model.forward = torch.compile(model.forward, fullgraph=True)``
  (inductor's default mode); generate()'s own compile disabled;
* ``static``: a static cache and generate()'s own compile of the decode step, with the model's
  ``CompileConfig`` (transformers' default; for a ``fuse_layers=True`` model
  :func:`mixgemm.nn.guards.decode_compile_config`; the run records each variant's:
  ``static_compile_config``);
* ``reduce-overhead``: a static cache and generate()'s own compile of the decode step with
  ``compile_config=CompileConfig(mode="reduce-overhead", fullgraph=True)``: CUDA-graph trees,
  and no graph break allowed. (A user's ``model.forward = torch.compile(model.forward,
  mode="reduce-overhead")`` compiles the prompt too and, for bf16 on transformers 5.17, skips
  its CUDA graphs because the static cache is an input the step writes, then stalls in
  recompiles; generate()'s compile is the way transformers documents.)

What each point (variant x fuse x mode x batch) reports:

* ``generate_ms``: the median wall time of ``generate(max_new_tokens=N)`` over ``--repeats``
  calls, after warm-up calls (the first one compiles; its time is ``first_generate_s``), each
  call between two ``torch.cuda.synchronize()``;
* ``prefill_ms``: the median wall time of ``generate(max_new_tokens=1)`` on the same prompt: the
  prompt's forward and the choice of the first token, with generate()'s set-up. Subtracting one
  median from the other gives the per-token time with everything both calls share cancelled
  (the set-up, the prompt, the first token);
* ``ms_per_token``: ``(generate_ms - prefill_ms) / (N - 1)``: one decode step as generate() runs
  it (the forward, the logits processors, the stopping check);
* ``tok_s``: ``batch * N / generate_ms``: new tokens per second of the whole call, prompt
  included, as a user who times ``generate()`` sees it; ``decode_tok_s``: ``batch / ms_per_token``;
* ``speedup_vs_bf16`` (``decode_speedup_vs_bf16``): ``tok_s`` (``decode_tok_s``) over bf16's in
  the same mode and batch (the bf16 model, exact activations, for every mixgemm row: ``-fp8`` and
  ``-auto`` ones too);
* ``gpu_step_ms``: the ceiling: one decode step of the model (the eager forward of one token per
  sequence on a static cache holding ``prompt + N`` positions, the same for every mode) captured
  in a CUDA graph with ``torch.cuda.graph`` and replayed, the median of ``--iters`` replays timed
  with CUDA events; no host work at all. ``ceiling_tok_s = batch / gpu_step_ms``;
* ``host_ms_per_token``: the host's wall time to issue that decode step while the GPU sleeps
  (nothing waits for the GPU: :func:`.host.measure_host`), median of a few calls. In ``eager``,
  the eager forward (Python, the modules, every launch; on the static cache of the ceiling's
  step, where the dynamic cache would add a concatenation per layer); in ``compile``, the compiled forward
  (Dynamo's guards, inductor's wrapper and its kernel launches); in ``static`` and
  ``reduce-overhead``, generate()'s compiled call (guards, copying the new inputs into the CUDA
  graph's buffers, the replay launch). Every
  call first resets the static cache's position counters (one small launch) so that calls
  repeat. A step that still waits for the GPU after a
  :data:`STEP_MAX_SLEEP_US` sleep (transformers' eager mask code synchronizes) gets no host
  time, and a note that says why;
* ``mode_step_ms``: the GPU time of that decode step as the mode runs it (the kernels the host
  measurement queued behind the sleep, from the first to the last): in ``eager`` the eager
  forward's launches, in ``compile`` inductor's kernels and mixgemm's, in ``static`` and
  ``reduce-overhead`` the CUDA-graph tree's replay. Beside ``gpu_step_ms`` (the same forward in
  one graph for every mode) it shows what a mode costs the GPU, and beside ``ms_per_token`` what
  generate()'s own work per token adds.

A point FAILs when a timed ``generate()`` made other than ``N`` new tokens per sequence, or the
captured step's logits are not finite.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence

from .decoder import PRESETS, ModelPreset
from .grid import ERROR, FAIL, OK, UNAVAILABLE
from .preset_report import SPEEDUP_VS_BF16, STATUS, VARIANT, Column, PresetReport, PresetTable, first_seen
from .report import fmt, gpu_line
from .run_support import RunOutputs
from .timing import TimingStats
from .variants import AUTO_SUFFIX, BF16, FP8_SUFFIX, Variant, VariantKind, parse_variant

GENERATE_SCHEMA = "mixgemm.bench.generate/1"
GEN_MODES = ("eager", "compile", "static", "reduce-overhead")
#: How each mode runs ``generate()`` (written into the report's config).
MODE_DEFINITIONS = {
    "eager": "the model's default cache (dynamic; static for fuse_layers=True, which sets it), "
             "generation_config.disable_compile=True (no torch.compile)",
    "compile": "static cache, model.forward = torch.compile(model.forward, fullgraph=True) (inductor, default "
               "mode); generate()'s own compile disabled",
    "static": "static cache, generate()'s own compile of the decode step with the model's CompileConfig "
              "(transformers' default; a fuse_layers=True model's own: static_compile_config); the prompt runs eager",
    "reduce-overhead": "static cache, generate()'s own compile of the decode step with "
                       "compile_config=CompileConfig(mode='reduce-overhead', fullgraph=True); the prompt runs eager",
}
#: ``--fuse-layers`` values: the ``fuse_layers`` settings each runs.
FUSE_SETTINGS = {"off": (False,), "on": (True,), "both": (False, True)}
DEFAULT_FUSE = "both"
DEFAULT_TYPES = ("u4",)
DEFAULT_GEN_BATCHES = (1, 16)
DEFAULT_PROMPT_TOKENS = 128
DEFAULT_NEW_TOKENS = 64
DEFAULT_REPEATS = 3
#: Untimed full ``generate()`` calls before the timed ones (the first compiles; the second lets
#: CUDA-graph trees record what they only warmed up in the first), then one of a single token.
WARMUP_GENERATES = 2
#: Timed replays of the ceiling's graph (the median is reported), and the fewest without --quick.
STEP_ITERS = 50
STEP_WARMUP = 5
#: Host-time calls of one decode step per point (the median is reported).
HOST_STEP_REPEATS = 5
#: The longest GPU sleep behind a decode step's host timing (µs): a step that still waits for
#: the GPU after it (transformers' eager mask code synchronizes) gets no host time.
STEP_MAX_SLEEP_US = 250_000.0
#: The ``fuse`` label of bf16 (no mixgemm layers to fuse).
NO_FUSE = "-"
#: Where the model comes from.
PRESET, HF_DIR, QUANTIZED_DIR = "preset", "hf", "quantized"


def fuse_label(fuse: Optional[bool]) -> str:
    """``-`` (bf16), ``off`` or ``on``."""
    return NO_FUSE if fuse is None else ("on" if fuse else "off")


# ---------------------------------------------------------------------------------------------
# The presets as transformers models
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PresetModel:
    """What a preset's transformers model needs beyond its layer shapes: the ``model_type`` (its
    config and model class), the vocabulary and the context length of the model's config.json."""

    model_type: str
    vocab: int
    max_positions: int


#: From each model's config.json on the Hugging Face Hub (``vocab_size``,
#: ``max_position_embeddings``); Qwen2 always has a bias on q, k and v, LLaMA none.
PRESET_MODELS: dict[str, PresetModel] = {
    "llama3-8b": PresetModel("llama", 128256, 8192),
    "llama3-70b": PresetModel("llama", 128256, 8192),
    "qwen2.5-7b": PresetModel("qwen2", 152064, 131072),
    "qwen2.5-32b": PresetModel("qwen2", 152064, 131072),
}


def preset_config_kwargs(preset: ModelPreset, layers: Optional[int] = None) -> dict:
    """The keyword arguments of ``transformers.AutoConfig.for_model(model_type, **kwargs)`` for
    ``preset`` with ``layers`` decoder layers (default: all the model's)."""
    family = PRESET_MODELS[preset.name]
    kwargs = dict(vocab_size=family.vocab, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
                  num_hidden_layers=preset.model_layers if layers is None else int(layers),
                  num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads, head_dim=preset.head_dim,
                  rope_theta=preset.rope_theta, rms_norm_eps=preset.rms_eps,
                  max_position_embeddings=family.max_positions, tie_word_embeddings=False)
    if family.model_type == "llama":
        kwargs["attention_bias"] = preset.qkv_bias
    return kwargs


def describe_model(config: Mapping[str, Any], source: str, model_layers: Optional[int] = None) -> dict:
    """The model's shapes for the report (``presets`` entry), from transformers config fields
    (``preset_config_kwargs`` or a config.json): model type, hidden / intermediate sizes, heads,
    KV heads, head size, vocabulary, the layers run and the model's own layer count."""
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads else None)
    layers = config.get("num_hidden_layers")
    return {"source": source, "model_type": config.get("model_type"), "hidden": config.get("hidden_size"),
            "intermediate": config.get("intermediate_size"), "heads": heads,
            "kv_heads": config.get("num_key_value_heads") or heads, "head_dim": head_dim,
            "vocab": config.get("vocab_size"), "layers": layers,
            "model_layers": layers if model_layers is None else model_layers}


# ---------------------------------------------------------------------------------------------
# Options (pure; :mod:`.options` turns their errors into BenchError)
# ---------------------------------------------------------------------------------------------
def resolve_target(text: str, presets: Mapping[str, ModelPreset] = PRESETS) -> tuple[str, str, Optional[str]]:
    """``(name, source, quant_method)`` of ``--generate``'s argument: a preset name (source
    :data:`PRESET`), or a directory with a transformers ``config.json``: :data:`QUANTIZED_DIR`
    with its ``quantization_config``'s ``quant_method``, else :data:`HF_DIR`. The name of a
    directory is its last component.

    Raises
    ------
    ValueError
        Neither a preset nor a directory, a directory without a readable config.json.
    """
    key = text.strip()
    if key.lower() in presets:
        return key.lower(), PRESET, None
    path = Path(key).expanduser()
    if not path.is_dir():
        raise ValueError(f"--generate: {key!r} is neither a model preset ({', '.join(presets)}) nor a model directory")
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--generate: {path} is not a transformers model directory: {config_path}: "
                         f"{type(e).__name__}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generate: {config_path} is not a JSON object")
    name = path.resolve().name
    qc = config.get("quantization_config")
    if qc is None:
        return name, HF_DIR, None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return name, QUANTIZED_DIR, str(method or "unknown")


def parse_types(names: Sequence[str]) -> tuple[Variant, ...]:
    """``--types``: mixgemm weight types (``u4``, ``u2``, ``s8``, ... or ``int4`` / ``mixgemm-u4``),
    each with exact activations, or with ``-fp8`` (e4m3 activations, ``act_format="fp8"``) or
    ``-auto`` (``act_format="auto"``) appended (``u4-fp8``, ``mixgemm-u2-auto``), without repeats.

    Raises
    ------
    ValueError
        An empty list, an unknown name, a variant that is not a mixgemm weight type, or an 8-bit
        type with ``-fp8`` or ``-auto`` (no e4m3 kernel: :attr:`.variants.Variant.e4m3_problem`).
    """
    out: list[Variant] = []
    for name in names:
        v = parse_variant(name)
        if v.kind is not VariantKind.MIXGEMM:
            raise ValueError(f"{name.strip()!r} is not a mixgemm weight type (u4, u2, s8, ...; bf16 always runs)")
        if v.e4m3_problem:
            raise ValueError(f"{name.strip()!r}: {v.e4m3_problem}")
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError("expected mixgemm weight types, e.g. u4,u2,s8")
    return tuple(out)


def parse_gen_modes(names: Sequence[str]) -> tuple[str, ...]:
    """``--gen-modes``: names of :data:`GEN_MODES`, without repeats, in the order given.

    Raises
    ------
    ValueError
        An empty list or an unknown mode.
    """
    modes = tuple(dict.fromkeys(n.strip().lower() for n in names if n.strip()))
    bad = [m for m in modes if m not in GEN_MODES]
    if bad or not modes:
        what = f"unknown {', '.join(map(repr, bad))}" if bad else "no mode given"
        raise ValueError(f"{what}; expected {', '.join(GEN_MODES)}")
    return modes


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def compile_config_record(config: Mapping[str, Any]) -> dict:
    """A ``CompileConfig.to_dict()`` as JSON data: functions (a ``guard_filter_fn``) by their
    qualified name, nested dicts alike."""
    def value(v):
        if isinstance(v, Mapping):
            return {str(k): value(x) for k, x in v.items()}
        if callable(v):
            return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', repr(v))}"
        return v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)
    return value(config)


def generate_kwargs(mode: str) -> dict:
    """The ``generate()`` keywords of ``mode`` beyond the greedy ones (the model's forward is
    replaced apart, for ``compile``); ``eager`` leaves the cache to the
    model's generation config."""
    if mode == "eager":
        return {"disable_compile": True}
    if mode == "static":
        return {"cache_implementation": "static", "disable_compile": False}
    if mode == "reduce-overhead":
        from transformers import CompileConfig   # (the bench's model library: loaded by then)

        return {"cache_implementation": "static", "disable_compile": False,
                "compile_config": CompileConfig(mode="reduce-overhead", fullgraph=True)}
    if mode == "compile":
        return {"cache_implementation": "static", "disable_compile": True}
    raise ValueError(f"unknown mode {mode!r}; expected {', '.join(GEN_MODES)}")


@dataclasses.dataclass(frozen=True)
class RunVariant:
    """One model the run times: its variant name, its weight type (None: bf16 or a quantized
    checkpoint's own), its ``fuse_layers`` (None: bf16) and the ``act_format`` its layers take
    (``quantize_model``'s: ``"bf16"``, ``"fp8"`` or ``"auto"``)."""

    name: str
    weight_type: Any = None
    fuse: Optional[bool] = None
    act_format: str = "bf16"

    @property
    def fuse_label(self) -> str:
        return fuse_label(self.fuse)

    @property
    def label(self) -> str:
        return self.name if self.fuse is None else f"{self.name} fuse_layers={self.fuse_label}"


def unavailable_reason(cfg: "GenerateConfig", run: RunVariant, fuse_supported: Mapping[str, bool],
                       mixgemm: tuple[bool, str] = (True, "")) -> Optional[str]:
    """Why ``run`` cannot run here (None: it can): bf16 of a quantized checkpoint (no baseline),
    e4m3 or per-call activations on a weight type without an e4m3 kernel, a mixgemm variant without
    mixgemm's kernels (``mixgemm``: :func:`.peers.mixgemm_available`'s answer), ``fuse_layers=True``
    where the loader has no such keyword (``fuse_supported``: ``{"quantize_model": bool,
    "from_pretrained": bool}``)."""
    if run.fuse is None:
        if cfg.source == QUANTIZED_DIR:
            return (f"the checkpoint is already quantized ({cfg.quant_method}): no bf16 baseline (run the "
                    f"unquantized model's directory for one)")
        return None
    if run.act_format != "bf16":
        why = Variant(VariantKind.MIXGEMM, run.weight_type, run.act_format).e4m3_problem
        if why:
            return why
    if not mixgemm[0]:
        return mixgemm[1]
    loader = "mixgemm.hf.from_pretrained" if cfg.source == QUANTIZED_DIR else "mixgemm.nn.quantize_model"
    if run.fuse and not fuse_supported.get(loader.rpartition(".")[2], False):
        return f"fuse_layers=on: {loader} has no fuse_layers keyword in this mixgemm"
    return None


def fuse_note(cfg: "GenerateConfig", fuse_supported: Mapping[str, bool]) -> str:
    """What ``fuse_layers=off`` runs when the loader has no ``fuse_layers`` keyword ("" when it has)."""
    loader = "from_pretrained" if cfg.source == QUANTIZED_DIR else "quantize_model"
    if fuse_supported.get(loader, False) or False not in cfg.fuse:
        return ""
    return (f"{loader} has no fuse_layers keyword in this mixgemm: 'off' is its call without it (no fused "
            f"layers; whatever projections it fuses by itself)")


def act_format_outcome(act_format: str, replaced: Sequence[str],
                       exact: Mapping[str, str]) -> tuple[Optional[str], str]:
    """``(unavailable, note)`` of a model quantized with ``act_format``: ``replaced`` names the
    QuantLinear layers made, ``exact`` those of them that keep exact activations, with the reason
    (``mixgemm.nn.QuantizeSummary``'s ``replaced`` and ``bf16_activations``). Unavailable (the
    variant would time exact activations under its name) when no layer takes ``act_format``; a
    note when some keep exact activations; ``(None, "")`` otherwise and for ``"bf16"``."""
    if act_format == "bf16" or not exact:
        return None, ""
    reasons = "; ".join(sorted(set(exact.values())))
    if len(exact) >= len(replaced):
        return f"act_format={act_format!r}: no layer takes it ({reasons})", ""
    return None, f"{len(exact)} of {len(replaced)} layers keep exact activations ({reasons})"


def auto_note(batch: int, prompt_tokens: int, decode: tuple[int, int], prompt: tuple[int, int]) -> str:
    """What ``act_format="auto"`` runs at one batch size: ``decode`` and ``prompt`` are ``(e4m3,
    layers)``, how many of the model's ``"auto"`` layers take the e4m3 path at the decode step's
    ``batch`` tokens and at the prompt's ``batch * prompt_tokens``
    (:func:`mixgemm.ops.fp8.resolve_act_format` on the run's GPU)."""
    return (f"act_format='auto': e4m3 in {decode[0]} of {decode[1]} layers at the decode step (M={batch}), "
            f"{prompt[0]} of {prompt[1]} at the prompt (M={batch * prompt_tokens})")


@dataclasses.dataclass(frozen=True)
class GenerateConfig(RunOutputs):
    """Validated options of one ``--generate`` run."""

    target: str = "llama3-8b"
    name: str = "llama3-8b"
    source: str = PRESET
    quant_method: Optional[str] = None
    layers: Optional[int] = None
    batches: tuple[int, ...] = DEFAULT_GEN_BATCHES
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    new_tokens: int = DEFAULT_NEW_TOKENS
    repeats: int = DEFAULT_REPEATS
    types: tuple[Variant, ...] = dataclasses.field(default_factory=lambda: parse_types(DEFAULT_TYPES))
    fuse: tuple[bool, ...] = FUSE_SETTINGS[DEFAULT_FUSE]
    modes: tuple[str, ...] = GEN_MODES
    iters: int = STEP_ITERS
    warmup: int = STEP_WARMUP

    def runs(self) -> list[RunVariant]:
        """bf16 first (the baseline), then each weight type with its activation format (or the
        quantized checkpoint) with each ``fuse_layers`` setting."""
        if self.source == QUANTIZED_DIR:
            quantized = [RunVariant(str(self.quant_method), None, f) for f in self.fuse]
        else:
            quantized = [RunVariant(v.name, v.weight_type, f, v.act_format) for v in self.types for f in self.fuse]
        return [RunVariant(BF16.name)] + quantized

    def to_json(self) -> dict:
        return {"target": self.target, "presets": [self.name], "source": self.source,
                "quant_method": self.quant_method, "layers": self.layers, "batches": list(self.batches),
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "repeats": self.repeats,
                "warmup_generates": WARMUP_GENERATES, "types": [v.name for v in self.types],
                "fuse_layers": [fuse_label(f) for f in self.fuse], "modes": list(self.modes),
                "mode_definitions": {m: MODE_DEFINITIONS[m] for m in self.modes}, "group_size": self.group_size,
                "step_iters": self.iters, "step_warmup": self.warmup, "host_repeats": HOST_STEP_REPEATS,
                "quick": self.quick, "seed": self.seed, "dtype": "bf16",
                "decoding": "greedy, min_new_tokens = max_new_tokens",
                "weights": "random (transformers' init, seeded)" if self.source == PRESET else self.target}


def model_description(cfg: GenerateConfig, presets: Mapping[str, ModelPreset] = PRESETS) -> dict:
    """The report's entry for the run's model (:func:`describe_model`): from the preset, or from
    the directory's config.json."""
    if cfg.source == PRESET:
        preset = presets[cfg.name]
        family = PRESET_MODELS[preset.name]
        return describe_model({"model_type": family.model_type, **preset_config_kwargs(preset, cfg.layers)},
                              preset.source, preset.model_layers)
    config = json.loads((Path(cfg.target) / "config.json").read_text(encoding="utf-8"))
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]     # a multimodal model's language model
    return describe_model(config, str(Path(cfg.target).resolve()))


# ---------------------------------------------------------------------------------------------
# Measurements and their analysis
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GenRow:
    """What names a point: the model (``preset``: the preset, or the directory's name), the
    variant and its ``fuse_layers`` setting, the mode, the batch, and the run's shape."""

    preset: str
    variant: str
    fuse: str
    mode: str
    batch: int
    prompt_tokens: int
    new_tokens: int
    layers: int

    @property
    def key(self) -> tuple:
        return (self.preset, self.variant, self.fuse, self.mode, self.batch)

    @property
    def label(self) -> str:
        """The point in words (messages)."""
        fuse = "" if self.fuse == NO_FUSE else f" fuse_layers={self.fuse}"
        return f"{self.variant}{fuse} {self.mode} b{self.batch}"


@dataclasses.dataclass(frozen=True)
class GenMeasurement(GenRow):
    """What the GPU run measured for one point; times in seconds except the step's
    (:class:`.timing.TimingStats`, microseconds) and the host's (microseconds). ``error`` says why
    it did not run (``unavailable``: not here), or why its times are not the mode's."""

    generate_s: tuple[float, ...] = ()
    prefill_s: tuple[float, ...] = ()
    first_s: Optional[float] = None
    new_tokens_made: tuple[int, ...] = ()
    step: Optional[TimingStats] = None
    step_finite: Optional[bool] = None
    host_us: Optional[float] = None
    mode_step_us: Optional[float] = None
    host_queued: Optional[bool] = None
    note: str = ""
    error: Optional[str] = None
    unavailable: bool = False


@dataclasses.dataclass(frozen=True)
class GenPoint(GenRow):
    """One row of the report (see the module docstring for the figures)."""

    status: str
    note: str = ""
    repeats: Optional[int] = None
    generate_ms: Optional[float] = None
    prefill_ms: Optional[float] = None
    ms_per_token: Optional[float] = None
    tok_s: Optional[float] = None
    decode_tok_s: Optional[float] = None
    speedup_vs_bf16: Optional[float] = None
    decode_speedup_vs_bf16: Optional[float] = None
    first_generate_s: Optional[float] = None
    gpu_step_ms: Optional[float] = None
    ceiling_tok_s: Optional[float] = None
    step_iters: Optional[int] = None
    host_ms_per_token: Optional[float] = None
    mode_step_ms: Optional[float] = None
    host_queued: Optional[bool] = None


def generate_times(generate_s: Sequence[float], prefill_s: Sequence[float],
                   new_tokens: int) -> tuple[float, Optional[float], Optional[float]]:
    """``(generate_ms, prefill_ms, ms_per_token)`` from the timed calls (seconds): the medians,
    and ``(generate - prefill) / (new_tokens - 1)`` (None without prefill times, with one new
    token, or when the difference is not positive)."""
    gen = statistics.median(generate_s) * 1e3
    if not prefill_s:
        return gen, None, None
    pre = statistics.median(prefill_s) * 1e3
    per = (gen - pre) / (new_tokens - 1) if new_tokens > 1 else None
    return gen, pre, per if per is not None and per > 0 else None


def tokens_per_second(batch: int, tokens: int, ms: Optional[float]) -> Optional[float]:
    """``batch * tokens`` tokens in ``ms`` milliseconds, per second (None without a positive time)."""
    return batch * tokens / (ms / 1e3) if ms is not None and ms > 0 and math.isfinite(ms) else None


def classify_generate(m: GenMeasurement) -> tuple[str, str]:
    """Status and note: ``n/a`` / ``error`` when it did not run, ``error`` when it ran but not as
    its mode says (``error`` set: e.g. generate() compiled nothing in ``static``); ``FAIL`` when a
    timed call made other than ``new_tokens`` tokens per sequence, or the step's logits are not
    finite; else ok, with ``note``."""
    if not m.generate_s or m.error:
        return (UNAVAILABLE if m.unavailable else ERROR), (m.error or "did not run")
    problems = []
    wrong = sorted({n for n in m.new_tokens_made if n != m.new_tokens})
    if wrong or not m.new_tokens_made:
        problems.append(f"generate() made {', '.join(map(str, wrong)) or 'no'} new tokens, expected {m.new_tokens}")
    if m.step_finite is False:
        problems.append("the decode step's logits have NaN/inf")
    if problems:
        return FAIL, "; ".join(problems)
    return OK, m.note


def analyze_generate(measurements: Iterable[GenMeasurement]) -> list[GenPoint]:
    """Every reported figure from the raw measurements (same order). Speedups are given for ok
    points over the ok bf16 point of the same preset, mode and batch."""
    meas = list(measurements)
    status = {id(m): classify_generate(m) for m in meas}
    rows = []
    for m in meas:
        st, note = status[id(m)]
        row: dict[str, Any] = dict(preset=m.preset, variant=m.variant, fuse=m.fuse, mode=m.mode, batch=m.batch,
                                   prompt_tokens=m.prompt_tokens, new_tokens=m.new_tokens, layers=m.layers,
                                   status=st, note=note, first_generate_s=m.first_s, host_queued=m.host_queued)
        if m.generate_s:
            gen, pre, per = generate_times(m.generate_s, m.prefill_s, m.new_tokens)
            row.update(repeats=len(m.generate_s), generate_ms=gen, prefill_ms=pre, ms_per_token=per,
                       tok_s=tokens_per_second(m.batch, m.new_tokens, gen),
                       decode_tok_s=tokens_per_second(m.batch, 1, per))
        if m.step is not None:
            row.update(gpu_step_ms=m.step.median_us / 1e3, step_iters=m.step.iters,
                       ceiling_tok_s=tokens_per_second(m.batch, 1, m.step.median_us / 1e3))
        if m.host_us is not None:
            row["host_ms_per_token"] = m.host_us / 1e3
        if m.mode_step_us is not None:
            row["mode_step_ms"] = m.mode_step_us / 1e3
        rows.append(row)
    base = {(r["preset"], r["mode"], r["batch"]): r for r in rows
            if r["variant"] == BF16.name and r["fuse"] == NO_FUSE and r["status"] == OK}
    for r in rows:
        ref = base.get((r["preset"], r["mode"], r["batch"]))
        if r["status"] == OK and ref is not None:
            for mine, attr in (("speedup_vs_bf16", "tok_s"), ("decode_speedup_vs_bf16", "decode_tok_s")):
                if r.get(attr) and ref.get(attr):
                    r[mine] = r[attr] / ref[attr]
    return [GenPoint(**r) for r in rows]


# ---------------------------------------------------------------------------------------------
# The report (:mod:`.preset_report`): JSON, split, merge, table
# ---------------------------------------------------------------------------------------------
class GenerateReport(PresetReport):
    """A whole ``--generate`` run: where, how (with the transformers version and the compile
    settings used), the model's shapes and every :class:`GenPoint`."""

    SCHEMA = GENERATE_SCHEMA
    POINT = GenPoint
    MERGE_SAME: ClassVar[tuple[tuple[str, str], ...]] = (
        ("prompt_tokens", "prompt lengths"), ("new_tokens", "new token counts"), ("layers", "layer counts"),
        ("transformers_version", "transformers versions"))
    MERGE_UNION: ClassVar[tuple[str, ...]] = ("modes", "batches", "types")


def _gen_order(points: list) -> Callable[[GenPoint], tuple]:
    variants = first_seen(p.variant for p in points)
    fuses = (NO_FUSE, "off", "on")
    return lambda p: (variants[p.variant], fuses.index(p.fuse) if p.fuse in fuses else 9,
                      GEN_MODES.index(p.mode) if p.mode in GEN_MODES else 9, p.batch)


def _gen_heading(name: str, model: Mapping[str, Any], points: list) -> str:
    return (f"{name} ({model.get('source')}): {model.get('model_type')}, hidden {model.get('hidden')}, intermediate "
            f"{model.get('intermediate')}, heads {model.get('heads')}/{model.get('kv_heads')} x "
            f"{model.get('head_dim')}, vocab {model.get('vocab')}; {points[0].layers} of its "
            f"{model.get('model_layers')} layers; prompt {points[0].prompt_tokens} tokens, "
            f"{points[0].new_tokens} new")


def _gen_footer(points: list) -> list[str]:
    lines = ["  tok/s: batch x new tokens / generate() time (prompt included); ms/token: (generate - prefill) / "
             "(new tokens - 1);",
             "  GPU step: one decode step's forward in a CUDA graph (no host work), the ceiling (ceil tok/s = "
             "batch / step); host: the time to issue one decode step in that mode; mode GPU: that step's GPU "
             "time as the mode runs it"]
    if any(p.variant.startswith("mixgemm-") and p.variant.endswith((FP8_SUFFIX, AUTO_SUFFIX)) for p in points):
        lines.append(f"  {FP8_SUFFIX}: quantize_model(act_format='fp8'), every layer's input rounded to e4m3 per "
                     f"token; {AUTO_SUFFIX}: act_format='auto', the e4m3 path where the GPU's tuning table measured "
                     f"it faster for the layer and its token count; x bf16 is over the bf16 model in both")
    if any(p.host_queued is False for p in points):
        lines.append("  !: the GPU woke before the step had been issued: that host time may include waits for "
                     "the GPU")
    return lines + [f"  {p.label}: {p.note}" for p in points if p.status == OK and p.note]


def _host_cell(p: GenPoint) -> str:
    return fmt(p.host_ms_per_token, ".2f") + ("!" if p.host_queued is False else "")


GEN_TABLE = PresetTable(
    columns=(VARIANT, Column("fuse", lambda p: p.fuse, right=False), Column("mode", lambda p: p.mode, right=False),
             Column("batch", lambda p: str(p.batch)), Column("tok/s", lambda p: fmt(p.tok_s, ".1f")),
             SPEEDUP_VS_BF16, Column("prefill ms", lambda p: fmt(p.prefill_ms, ".1f")),
             Column("ms/token", lambda p: fmt(p.ms_per_token, ".2f")),
             Column("GPU step ms", lambda p: fmt(p.gpu_step_ms, ".2f")),
             Column("ceil tok/s", lambda p: fmt(p.ceiling_tok_s, ".1f")),
             Column("host ms/token", _host_cell), Column("mode GPU ms", lambda p: fmt(p.mode_step_ms, ".2f")),
             STATUS),
    how=lambda config: (f"greedy generate(), median of {config.get('repeats')} calls after "
                        f"{config.get('warmup_generates')} warm-up calls; GPU step: median of "
                        f"{config.get('step_iters')} graph replays"),
    heading=_gen_heading, order=_gen_order, note_key=lambda p: p.label, footer=_gen_footer)
GEN_TABLE_HEADER = GEN_TABLE.header


def format_generate_table(report: GenerateReport) -> str:
    """The report as aligned text: the GPU and the software (torch, transformers), how each mode
    runs ``generate()``, then the rows (variant x fuse x mode x batch) and the notes."""
    config = report.config
    lines = [gpu_line(report.machine),
             f"GPU {report.machine.gpu_name}, torch {report.machine.torch_version}, transformers "
             f"{config.get('transformers_version')}, mixgemm {report.machine.mixgemm_version}"]
    for mode, words in (config.get("mode_definitions") or {}).items():
        lines.append(f"  {mode}: {words}")
    records = config.get("static_compile_config") or {}
    if "mode" in records:          # (a report of one CompileConfig for every variant)
        records = {"every variant": records}
    for label, record in records.items():
        lines.append(f"  static's CompileConfig, {label}: {record}")
    if config.get("fuse_layers_note"):
        lines.append(f"  fuse_layers: {config['fuse_layers_note']}")
    return "\n".join(lines + [GEN_TABLE.format(report.points, None, config, report.presets)])


__all__ = ["GENERATE_SCHEMA", "GEN_MODES", "MODE_DEFINITIONS", "FUSE_SETTINGS", "DEFAULT_FUSE", "DEFAULT_TYPES",
           "DEFAULT_GEN_BATCHES", "DEFAULT_PROMPT_TOKENS", "DEFAULT_NEW_TOKENS", "DEFAULT_REPEATS",
           "WARMUP_GENERATES", "STEP_ITERS", "STEP_WARMUP", "HOST_STEP_REPEATS", "STEP_MAX_SLEEP_US", "NO_FUSE", "PRESET", "HF_DIR",
           "QUANTIZED_DIR", "fuse_label", "PresetModel", "PRESET_MODELS", "preset_config_kwargs", "describe_model",
           "resolve_target", "parse_types", "parse_gen_modes", "accepts_keyword", "generate_kwargs", "RunVariant",
           "unavailable_reason", "fuse_note", "act_format_outcome", "auto_note",
           "GenerateConfig", "model_description", "GenRow", "GenMeasurement", "GenPoint", "generate_times",
           "tokens_per_second", "classify_generate", "analyze_generate", "GenerateReport", "GEN_TABLE",
           "GEN_TABLE_HEADER", "format_generate_table"]
