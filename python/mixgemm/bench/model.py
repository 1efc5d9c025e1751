"""``mixgemm bench --model``: what is measured and how it is reported (everything here is a pure
function of the measurements, tested on the CPU; the GPU run is :mod:`.model_run`).

One decode step of a stack of decoder layers with a real model's shapes (:mod:`.decoder`), for
each batch size, and one prefill, for each variant (:mod:`.variants`) and mode (``graph``: the
whole step captured in a CUDA graph and replayed; ``eager``: plain Python calls on an idle GPU;
``compiled``, on request: the step through ``torch.compile(fullgraph=True)``, which fuses the
norms, rotary, residual adds and cache writes into a few kernels, then captured in a CUDA graph
and replayed, as a serving engine runs it).
Each point reports:

* ``us_per_layer``: the step's median time divided by the number of layers;
* ``bytes_per_layer`` (:func:`layer_traffic`): the weights the variant reads (codes + scales +
  zeros + biases + norms, as held), the KV cache read (``B * 2 * kv_heads * (context + T) *
  head_dim * 2`` bytes) and written (``B * 2 * kv_heads * T * head_dim * 2``), and the
  activations (see :func:`layer_traffic`);
* ``floor_us_per_layer``: those bytes over the read bandwidth measured in the same run, and
  ``frac_of_floor`` = floor / time (1.0 would stream at the measured read rate). A prefill is
  compute-bound, so its fraction of the byte floor is small by nature;
* ``speedup_vs_bf16``: the bf16 step's time over this one's, in the same mode;
* ``bound_speedup`` (when the run has a ``no-gemm`` point of the same preset, step and mode):
  ``bf16 / (no-gemm + the variant's weight bytes / read bandwidth)``, per layer: the speedup the
  step would reach with its GEMMs at their byte floor, since every variant also pays the layer's
  other kernels (norms, rotary, cache writes, attention, residual adds), which the no-gemm step
  times alone (:class:`.variants.NoGemmProjections`). The weight bytes only: the no-gemm step
  already reads the KV cache and moves the activations (and the norms, whose bytes are taken
  off); the speedup of the no-gemm point itself is the most any variant can gain;
* ``err``: ``||y - y_ref|| / ||y_ref - x||``, the step's output ``y`` against the bf16 step run
  on the variant's own dequantized weights (``y_ref``), relative to what the layers add to their
  input ``x``; ``kv_err``: the largest relative error of the keys and values the step wrote, over
  the layers; ``replay_err``: the graph's replayed output against the eager step's. Neither bf16
  (the reference) nor no-gemm (whose output means nothing) has ``err`` or ``kv_err``. The e4m3
  variants (``mixgemm-<wt>-fp8``, ``scaled-mm``) are compared with the same reference, exact
  activations included, so their errors hold the rounding of every linear's input to e4m3 and
  are held to their own bar (:data:`DEFAULT_MODEL_FP8_MAX_ERROR`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence

from .decoder import PRESETS, ModelPreset
from .grid import ERROR, FAIL, OK, UNAVAILABLE
from .preset_report import (ERR, ITERS, PERCENT_OF_FLOOR, SPEEDUP_VS_BF16, STATUS, VARIANT, Column, PresetReport,
                            PresetTable, failed, first_seen, megabytes, split_by_preset, write_report_json)
from .report import MachineInfo, fmt
from .run_support import RunOutputs
from .timing import TimingStats, floor_us
from .variants import (BF16, DEFAULT_VARIANTS, ELEMENT_BYTES, NO_GEMM, SCALE_BYTES, Variant, is_e4m3,
                       layer_weight_bytes, parse_variant, parse_variants)

MODEL_SCHEMA = "mixgemm.bench.model/1"
DEFAULT_LAYERS = 8
DEFAULT_BATCHES = (1, 16, 64, 256)
#: Tokens already in each sequence's KV cache at the decode step.
DEFAULT_CONTEXT = 1024
#: Tokens of the prefill (batch 1, from position 0); 0 skips it.
DEFAULT_PREFILL = 2048
#: Timed replays (graph) or calls (eager) per point, and the fewest without --quick.
MODEL_ITERS = 50
MODEL_WARMUP = 5
#: A slow point gets fewer runs than --iters to stay within this many seconds (at least 10):
#: the prefill of a 70B-sized stack through torch's int4 kernel takes about a second per step.
DEFAULT_POINT_BUDGET_S = 4.0
#: The check's bar on ``err``, ``kv_err`` and ``replay_err``. Each quantized linear differs from
#: the bf16 linear on the same (dequantized) weights by ~1e-3 (float32 accumulation in another
#: order, one rounding) and the fused swiglu by ~5e-3 (bf16 rounds gate and up before
#: silu * up: the MLP block of ``--block`` measures 5e-3); over 8 layers that stays near 1e-2
#: (the errors add up roughly like sqrt(layers), and the residual stream carries them). A wrong
#: kernel, layout, bias or gate/up pairing is off by > 0.3. Deeper stacks may need a larger bar.
DEFAULT_MODEL_MAX_ERROR = 5e-2
#: The bar on ``err``, ``kv_err`` and ``replay_err`` of the e4m3 variants (``mixgemm-<wt>-fp8``,
#: ``scaled-mm``), checked against the same reference with exact activations: each linear rounds
#: its input to e4m3 (3 mantissa bits, about 2-3% per value), and the layers carry that forward
#: and grow it (the attention's softmax over sharp logits, the residual stream). A CPU emulation
#: of the e4m3 step (the quantizer's definition, the exact weight, float64 sums) against this
#: reference gave, on random weights with llama3-8b's shapes: err 0.08-0.09 over 2 layers,
#: 0.12-0.13 over 4 and 0.18-0.19 over 8 (kv_err 0.07, 0.11, 0.16-0.18; decode and prefill), about
#: sqrt(layers); 0.05-0.06 over 8 layers of a 512-wide stack; scaled-mm against the bf16 step on
#: its own e4m3 weights as much. A reference that rounds every input to e4m3 as well does not
#: track the kernels much closer: the sums of the two differ in their last bits (the FP8 tensor
#: cores accumulate with fewer bits inside a k-tile), which flips some e4m3 roundings in the next
#: layer, and that compounds (512 wide, 8 layers: 0.047-0.054 against such a reference, the short
#: accumulation emulated, where this one gave 0.050-0.056). So this
#: bar catches a broken step only (in the emulation with llama3-8b's shapes, activations in the
#: wrong K order or gate and up swapped gave 1.2-1.4 over 8 layers; 512 wide, the swap gave only
#: 0.34-0.41, under the bar); the e4m3 GEMMs themselves are held to the e4m3 GEMM
#: tests' bound by the grid (``mixgemm bench --impls mixgemm-<wt>-fp8,scaled_mm``). Larger models
#: and deeper stacks drift further (``--model-fp8-max-error``). The replays too: a compiled step
#: fuses the norms and the quantizer into other kernels, whose last-bit differences flip e4m3
#: roundings as well.
DEFAULT_MODEL_FP8_MAX_ERROR = 0.5
#: every mode, and those a run measures unless ``--modes`` says otherwise
MODES = ("graph", "eager", "compiled")
DEFAULT_MODES = ("graph", "eager")
DECODE, PREFILL = "decode", "prefill"


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One step: ``batch`` sequences of ``tokens`` new tokens each, after ``context`` cached ones."""

    phase: str
    batch: int
    tokens: int
    context: int

    @property
    def m(self) -> int:
        """Rows of every linear's input (tokens in the step)."""
        return self.batch * self.tokens

    @property
    def cache_length(self) -> int:
        """KV cache positions the step reads (its own included)."""
        return self.context + self.tokens

    @property
    def label(self) -> str:
        return f"decode b{self.batch}" if self.phase == DECODE else f"prefill {self.tokens}"


def step_shapes(batches: Sequence[int], context: int, prefill: int) -> list[StepShape]:
    """The decode steps (one token per sequence after ``context``) for every batch size, then the
    prefill of ``prefill`` tokens at batch 1 (none when 0)."""
    shapes = [StepShape(DECODE, b, 1, context) for b in batches]
    if prefill:
        shapes.append(StepShape(PREFILL, 1, prefill, 0))
    return shapes


@dataclasses.dataclass(frozen=True)
class ModelConfig(RunOutputs):
    """Validated options of one ``--model`` run."""

    presets: tuple[str, ...] = ("llama3-8b",)
    layers: int = DEFAULT_LAYERS
    batches: tuple[int, ...] = DEFAULT_BATCHES
    context: int = DEFAULT_CONTEXT
    prefill: int = DEFAULT_PREFILL
    variants: tuple[Variant, ...] = dataclasses.field(default_factory=lambda: parse_variants(DEFAULT_VARIANTS))
    modes: tuple[str, ...] = DEFAULT_MODES
    iters: int = MODEL_ITERS
    warmup: int = MODEL_WARMUP
    max_error: float = DEFAULT_MODEL_MAX_ERROR
    point_budget_s: float = DEFAULT_POINT_BUDGET_S
    fp8_max_error: float = DEFAULT_MODEL_FP8_MAX_ERROR

    def shapes(self) -> list[StepShape]:
        return step_shapes(self.batches, self.context, self.prefill)

    def to_json(self) -> dict:
        return {"presets": list(self.presets), "layers": self.layers, "batches": list(self.batches),
                "context": self.context, "prefill": self.prefill, "variants": [v.name for v in self.variants],
                "modes": list(self.modes), "group_size": self.group_size, "iters": self.iters,
                "warmup": self.warmup, "quick": self.quick, "max_error": self.max_error,
                "fp8_max_error": self.fp8_max_error,
                "point_budget_s": self.point_budget_s, "seed": self.seed, "dtype": "bf16",
                "weights": "randn * 0.02 (float32), quantized on the GPU", "keys": "cache randn * 2",
                "flush": "2x L2 written before every run"}


# ---------------------------------------------------------------------------------------------
# Bytes per layer
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerTraffic:
    """Bytes one layer moves at least in one step."""

    weights: int
    kv_read: int
    kv_write: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_read + self.kv_write + self.activations


def layer_traffic(preset: ModelPreset, shape: StepShape, weight_bytes: int, e4m3: bool = False) -> LayerTraffic:
    """The bytes one layer moves in ``shape``'s step, ``weight_bytes`` being its weights.

    * KV read: ``B * 2 (k, v) * kv_heads * (context + T) * head_dim * 2`` bytes (every cached
      position once, the step's own included);
    * KV write: ``B * 2 * kv_heads * T * head_dim * 2``;
    * activations, ``2`` bytes per element of ``M = B * T`` rows: the layer's input and output
      (``2 * hidden``), each linear's input and output (qkv: ``hidden + q + 2 kv``; o:
      ``q + hidden``; gate/up with its activation fused: ``hidden + intermediate``; down:
      ``intermediate + hidden``). Written once and read once by a fused implementation; an
      unfused one (bf16's separate silu * up) moves more, which is its own cost;
    * with ``e4m3`` (a variant that quantizes each linear's input per token: ``mixgemm-<wt>-fp8``,
      ``scaled-mm``), also the e4m3 codes (1 byte per element of each linear's input: ``hidden``,
      ``q``, ``hidden``, ``intermediate``) and a float32 scale per token and linear, each written by
      the quantizer and read back by the GEMM.
    """
    kv_row = 2 * preset.kv_heads * preset.head_dim * ELEMENT_BYTES
    per_token = (2 * preset.hidden + (preset.hidden + preset.qkv_rows) + (preset.q_size + preset.hidden)
                 + (preset.hidden + preset.intermediate) + (preset.intermediate + preset.hidden))
    codes = 2 * (2 * preset.hidden + preset.q_size + preset.intermediate + 4 * SCALE_BYTES) if e4m3 else 0
    return LayerTraffic(weights=int(weight_bytes), kv_read=shape.batch * shape.cache_length * kv_row,
                        kv_write=shape.batch * shape.tokens * kv_row,
                        activations=shape.m * (per_token * ELEMENT_BYTES + codes))


# ---------------------------------------------------------------------------------------------
# Measurements and their analysis
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """What was measured for one (preset, step, variant, mode). ``timing`` is None when it did
    not run (``error`` says why; ``unavailable``: not supported here)."""

    preset: str
    phase: str
    batch: int
    tokens: int
    context: int
    layers: int
    variant: str
    mode: str
    weight_bytes: Optional[int] = None      # per layer, the tensors the variant holds
    timing: Optional[TimingStats] = None
    err: Optional[float] = None
    kv_err: Optional[float] = None
    replay_err: Optional[float] = None
    output_finite: bool = True
    error: Optional[str] = None
    unavailable: bool = False

    @property
    def shape(self) -> StepShape:
        return StepShape(self.phase, self.batch, self.tokens, self.context)


@dataclasses.dataclass(frozen=True)
class ModelPoint:
    """One row of the report (see the module docstring for the columns)."""

    preset: str
    phase: str
    batch: int
    tokens: int
    context: int
    layers: int
    variant: str
    mode: str
    status: str
    note: str = ""
    time_us: Optional[float] = None
    us_per_layer: Optional[float] = None
    min_us: Optional[float] = None
    p90_us: Optional[float] = None
    iters: Optional[int] = None
    weight_bytes: Optional[int] = None
    kv_read_bytes: Optional[int] = None
    kv_write_bytes: Optional[int] = None
    act_bytes: Optional[int] = None
    bytes_per_layer: Optional[int] = None
    floor_us_per_layer: Optional[float] = None
    frac_of_floor: Optional[float] = None
    speedup_vs_bf16: Optional[float] = None
    bound_speedup: Optional[float] = None
    err: Optional[float] = None
    kv_err: Optional[float] = None
    replay_err: Optional[float] = None

    #: left out of the JSON when None (results written before the field existed lack it)
    OMIT_WHEN_NONE: ClassVar[tuple[str, ...]] = ("bound_speedup",)

    @property
    def key(self) -> tuple:
        return (self.preset, self.phase, self.batch, self.tokens, self.context, self.variant, self.mode)

    @property
    def shape(self) -> StepShape:
        return StepShape(self.phase, self.batch, self.tokens, self.context)

    @property
    def label(self) -> str:
        """The point in words (messages)."""
        return f"{self.variant} {self.mode} {self.preset} {self.phase} b{self.batch}"


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def classify_step(meas: StepMeasurement, max_error: float,
                  fp8_max_error: float = DEFAULT_MODEL_FP8_MAX_ERROR) -> tuple[str, str]:
    """Status and note: ``n/a`` / ``error`` when it did not run; ``FAIL`` for a non-finite output
    or an error (any of err, kv_err, replay_err) that is not finite or above ``max_error`` (for the
    e4m3 variants, :func:`.variants.is_e4m3`: ``fp8_max_error``); the quantized variants must have
    ``err`` and ``kv_err`` measured (bf16 and no-gemm have no reference)."""
    if meas.timing is None:
        return (UNAVAILABLE if meas.unavailable else ERROR), (meas.error or "did not run")
    if is_e4m3(meas.variant):
        max_error = fp8_max_error
    problems = [] if meas.output_finite else ["output has NaN/inf"]
    needed = ("err", "kv_err") if meas.variant not in (BF16.name, NO_GEMM.name) else ()
    for label in ("err", "kv_err", "replay_err"):
        value = getattr(meas, label)
        if value is None:
            if label in needed:
                problems.append(f"{label} not measured")
        elif not math.isfinite(value):
            problems.append(f"{label} is {value}")
        elif value > max_error:
            problems.append(f"{label} {value:.2e} > {max_error:.0e}")
    return (FAIL, "; ".join(problems)) if problems else (OK, "")


def bound_speedup(bf16_us_per_layer: Optional[float], no_gemm: Optional[tuple[float, int]], weight_bytes: int,
                  read_bw_gbps: Optional[float]) -> Optional[float]:
    """``bf16 / (no_gemm + floor(weight_bytes - no-gemm's weight bytes))``, per layer: the speedup
    over bf16 of a step whose GEMMs stream the variant's weights at ``read_bw_gbps`` and whose
    other kernels take what the no-gemm step took. ``no_gemm`` is ``(us per layer, weight bytes
    it read)`` (its norms: read in both, so counted once). None when anything is missing.
    """
    if bf16_us_per_layer is None or no_gemm is None or not read_bw_gbps:
        return None
    no_gemm_us, no_gemm_bytes = no_gemm
    return bf16_us_per_layer / (no_gemm_us + floor_us(max(0, weight_bytes - no_gemm_bytes), read_bw_gbps))


def analyze_model(measurements: Iterable[StepMeasurement], read_bw_gbps: Optional[float],
                  max_error: float = DEFAULT_MODEL_MAX_ERROR, group_size: int = 128,
                  presets: Mapping[str, ModelPreset] = PRESETS,
                  fp8_max_error: float = DEFAULT_MODEL_FP8_MAX_ERROR) -> list[ModelPoint]:
    """Every reported number from the raw measurements (same order). Speedups are given for ok
    points over the ok bf16 point of the same preset, step and mode; bounds (with a read
    bandwidth) for the ok points of every variant but no-gemm, from the ok bf16 and no-gemm
    points of the same preset, step and mode (see the module docstring); the weight bytes are
    the measured ones, else the formula's (:func:`.variants.layer_weight_bytes`); the e4m3
    variants' errors are held to ``fp8_max_error`` and their activations move their e4m3 codes
    too (:func:`layer_traffic`)."""
    meas = list(measurements)
    status = {id(m): classify_step(m, max_error, fp8_max_error) for m in meas}

    def weight_bytes(m: StepMeasurement) -> int:
        if m.weight_bytes is not None:
            return m.weight_bytes
        return layer_weight_bytes(presets[m.preset], parse_variant(m.variant), group_size)

    def step_key(m: StepMeasurement) -> tuple:
        return (m.preset, m.phase, m.batch, m.tokens, m.context, m.mode)

    timed_ok = [m for m in meas if status[id(m)][0] == OK and m.timing is not None]
    base = {step_key(m): m.timing.median_us for m in timed_ok if m.variant == BF16.name}
    # per layer: the bf16 step, and the no-gemm step with the weight bytes it reads (its norms)
    base_layer = {step_key(m): m.timing.median_us / m.layers for m in timed_ok if m.variant == BF16.name}
    no_gemm = {step_key(m): (m.timing.median_us / m.layers, weight_bytes(m)) for m in timed_ok
               if m.variant == NO_GEMM.name}
    out = []
    for m in meas:
        st, note = status[id(m)]
        preset = presets[m.preset]
        traffic = layer_traffic(preset, m.shape, weight_bytes(m), e4m3=is_e4m3(m.variant))
        row: dict[str, Any] = dict(
            preset=m.preset, phase=m.phase, batch=m.batch, tokens=m.tokens, context=m.context, layers=m.layers,
            variant=m.variant, mode=m.mode, status=st, note=note, weight_bytes=traffic.weights,
            kv_read_bytes=traffic.kv_read, kv_write_bytes=traffic.kv_write, act_bytes=traffic.activations,
            bytes_per_layer=traffic.total, err=_finite(m.err), kv_err=_finite(m.kv_err),
            replay_err=_finite(m.replay_err))
        if read_bw_gbps:
            row["floor_us_per_layer"] = floor_us(traffic.total, read_bw_gbps)
        if m.timing is not None and m.timing.median_us > 0:
            t = m.timing.median_us
            row.update(time_us=t, us_per_layer=t / m.layers, min_us=m.timing.min_us, p90_us=m.timing.p90_us,
                       iters=m.timing.iters)
            if read_bw_gbps:
                row["frac_of_floor"] = row["floor_us_per_layer"] / row["us_per_layer"]
            ref = base.get(step_key(m))
            if st == OK and ref is not None:
                row["speedup_vs_bf16"] = ref / t
            bound = bound_speedup(base_layer.get(step_key(m)), no_gemm.get(step_key(m)), traffic.weights,
                                  read_bw_gbps)
            if st == OK and m.variant != NO_GEMM.name and bound is not None:
                row["bound_speedup"] = bound
        out.append(ModelPoint(**row))
    return out


# ---------------------------------------------------------------------------------------------
# The report (:mod:`.preset_report`): JSON, split, merge, table
# ---------------------------------------------------------------------------------------------
class ModelReport(PresetReport):
    """A whole ``--model`` run: where, how, the presets' shapes and every :class:`ModelPoint`."""

    SCHEMA = MODEL_SCHEMA
    POINT = ModelPoint


#: this module's names from before the report was shared (mixgemm.bench exports them; tools use them)
model_report_to_dict = ModelReport.to_dict
model_report_from_dict = ModelReport.from_dict
merge_model_reports = ModelReport.merge
write_model_json = write_report_json


def _model_order(points: list) -> Callable[[ModelPoint], tuple]:
    steps = first_seen((p.phase, p.batch, p.tokens) for p in points)
    variants = first_seen(p.variant for p in points)
    return lambda p: (steps[(p.phase, p.batch, p.tokens)], variants[p.variant],
                      MODES.index(p.mode) if p.mode in MODES else 9)


def _model_heading(name: str, preset: ModelPreset, points: list) -> str:
    return (f"{name}: hidden {preset.hidden}, intermediate {preset.intermediate}, heads "
            f"{preset.heads}/{preset.kv_heads} x {preset.head_dim}{', qkv bias' if preset.qkv_bias else ''}; "
            f"{points[0].layers} of its {preset.model_layers} layers; context {points[0].context} (decode)")


def _model_footer(points: list) -> list[str]:
    """What the no-gemm row and the bound mean, under a block that has a no-gemm point; what the
    e4m3 variants' err means, under a block that has one."""
    lines = []
    if any(is_e4m3(p.variant) for p in points):
        lines.append("  e4m3 variants (mixgemm-<wt>-fp8, scaled-mm): err and kv err against the bf16 step with exact "
                     "activations on their own weights, so they hold the e4m3 rounding of every linear's input "
                     "(FAIL only above the e4m3 bar; the GEMMs are checked by the grid)")
    if not any(p.variant == NO_GEMM.name for p in points):
        return lines
    return lines + ["  no-gemm: the same layers with every projection a broadcast view of its input (no GEMM, no weight, "
            "not checked: err -):",
            "    its time is the layer's other kernels (norms, rotary, cache writes, attention, residual adds), "
            "which every variant pays;",
            "    its x bf16 is the most any variant could gain. bound = bf16 / (no-gemm + the variant's weight "
            "bytes / read bandwidth):",
            "    the variant's x bf16 with its GEMMs at their byte floor (same step and mode; the KV cache and "
            "activations are in no-gemm's time)."]


#: The bound's column: the speedup over bf16 with the GEMMs at their byte floor.
BOUND = Column("bound", lambda p: fmt(p.bound_speedup, ".2f", "x"))

MODEL_TABLE = PresetTable(
    columns=(Column("step", lambda p: p.shape.label, right=False), VARIANT,
             Column("mode", lambda p: p.mode, right=False),
             Column("us/layer", lambda p: fmt(p.us_per_layer, ".1f")),
             Column("floor us", lambda p: fmt(p.floor_us_per_layer, ".1f")), PERCENT_OF_FLOOR, SPEEDUP_VS_BF16,
             BOUND, Column("MB/layer", lambda p: megabytes(p.bytes_per_layer)), ERR,
             Column("kv err", lambda p: fmt(p.kv_err, ".1e")), ITERS, STATUS),
    how=lambda config: (f"median of up to {config.get('iters')} runs (L2 flushed before each); "
                        f"floor = bytes / read bandwidth"),
    heading=_model_heading, order=_model_order, note_key=lambda p: f"{p.variant} {p.mode} {p.shape.label}",
    footer=_model_footer)
MODEL_TABLE_HEADER = MODEL_TABLE.header


def format_model_table(points: Sequence[ModelPoint], machine: Optional[MachineInfo] = None,
                       config: Optional[Mapping[str, Any]] = None,
                       presets: Mapping[str, ModelPreset] = PRESETS) -> str:
    """The report as aligned text: one block per preset, rows by step, variant, then mode; the
    reasons for any status but ok listed under each block."""
    return MODEL_TABLE.format(points, machine, config, presets)


__all__ = ["MODEL_SCHEMA", "DEFAULT_LAYERS", "DEFAULT_BATCHES", "DEFAULT_CONTEXT", "DEFAULT_PREFILL", "MODEL_ITERS",
           "MODEL_WARMUP", "DEFAULT_POINT_BUDGET_S", "DEFAULT_MODEL_MAX_ERROR", "DEFAULT_MODEL_FP8_MAX_ERROR", "MODES",
           "DEFAULT_MODES", "DECODE", "PREFILL",
           "StepShape", "step_shapes", "ModelConfig", "LayerTraffic", "layer_traffic", "floor_us", "StepMeasurement",
           "ModelPoint", "classify_step", "bound_speedup", "analyze_model", "BOUND", "ModelReport", "model_report_to_dict",
           "model_report_from_dict", "write_model_json", "split_by_preset", "merge_model_reports",
           "MODEL_TABLE", "MODEL_TABLE_HEADER", "format_model_table", "failed"]
