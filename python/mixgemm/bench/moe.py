"""``mixgemm bench --moe``: what is measured and how it is reported (pure functions of the
measurements, tested on the CPU; the GPU run is :mod:`.moe_run`).

One mixture-of-experts layer's experts (routing, gate/up with swiglu, down, the weighted sum of
the top-k) with a real model's shapes (:data:`MOE_PRESETS`; DeepSeek-V3's routed experts only),
for each token count and routing (:func:`make_routing`: uniform at random, or Zipf-skewed), for
each variant:

* ``bf16``: ``torch._grouped_mm`` (when the installed torch has it and it runs here; else a
  bf16 per-expert loop of ``x @ w.T``), silu * up in torch;
* ``torch-int4``: PyTorch's tinygemm (``aten._weight_int4pack_mm``) in a per-expert loop;
* ``mixgemm-<wt>``: :func:`mixgemm.moe.fused_moe` (two grouped launches, swiglu fused).

Every variant runs the whole layer, routing included, captured in one CUDA graph and replayed
(median of many replays, the L2 flushed before each). mixgemm and ``_grouped_mm`` read the
expert row counts on the GPU; the per-expert loops need them on the host, so they are computed
before the capture for that point's routing (each point's graph is captured for its routing).

Each point reports:

* ``time_us``: the layer's median time (graph replays); ``eager_us``: the same layer called from
  Python on an idle GPU (median; the host's time for the launches included: what an eager loop
  sees);
* ``weight_bytes`` (:func:`moe_traffic`): the bytes of the experts the routing touches (at least
  one token), as the variant holds them (codes + scales + zeros, or bf16 weights);
* ``act_bytes``: the activations (see :func:`moe_traffic`);
* ``floor_us``: those bytes over the read bandwidth measured in the same run, and
  ``frac_of_floor`` = floor / time;
* ``speedup_vs_bf16``: the bf16 layer's time over this one's, same routing and tokens;
* ``err``: ``||y - y_ref|| / ||y_ref||``, the output against
  :func:`mixgemm.moe.fused_moe_reference` (bf16, float32 accumulation) on the variant's own
  dequantized weights; ``replay_err``: the graph's replayed output against the eager layer's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence

import torch

from .grid import ERROR, FAIL, OK, UNAVAILABLE
from .preset_report import (ERR, ITERS, PERCENT_OF_FLOOR, SPEEDUP_VS_BF16, STATUS, VARIANT, Column, PresetReport,
                            PresetTable, failed, first_seen, megabytes, split_by_preset, write_report_json)
from .report import MachineInfo, fmt
from .run_support import RunOutputs
from .timing import TimingStats, floor_us
from .variants import (BF16, DEFAULT_VARIANTS, ELEMENT_BYTES, Variant, parse_variant, parse_variants,
                       projection_weight_bytes)

MOE_SCHEMA = "mixgemm.bench.moe/1"
DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096)
UNIFORM, ZIPF = "uniform", "zipf"
ROUTINGS = (UNIFORM, ZIPF)
#: Zipf's exponent: expert of popularity rank r (1-based) is drawn with weight r^-s.
ZIPF_EXPONENT = 1.2
MOE_ITERS = 50
MOE_WARMUP = 5
#: A slow point gets fewer replays to stay within this many seconds (at least 10 replays).
DEFAULT_MOE_POINT_BUDGET_S = 3.0
#: The bar on ``err`` and ``replay_err``. One layer; each variant against bf16 on its own
#: dequantized weights: float32 accumulation in another order and the swiglu intermediate rounded
#: to bf16 (~5e-3 for mixgemm's fused epilogue); a wrong expert, layout or routing is off by > 0.3.
DEFAULT_MOE_MAX_ERROR = 2e-2
#: ``--moe``'s default variants: ``--model``'s but no-gemm (a ``--model`` variant only).
MOE_VARIANTS = tuple(v for v in DEFAULT_VARIANTS if v != "no-gemm")


@dataclasses.dataclass(frozen=True)
class MoePreset:
    """One model's routed-expert layer: ``experts`` experts of ``[hidden] -> [intermediate]``
    (gate, up) and ``[intermediate] -> [hidden]`` (down), ``topk`` of them per token."""

    name: str
    model: str
    hidden: int
    intermediate: int
    experts: int
    topk: int

    @property
    def expert_elements(self) -> int:
        """Weights of one expert: gate, up and down."""
        return 3 * self.hidden * self.intermediate


MOE_PRESETS: dict[str, MoePreset] = {p.name: p for p in (
    MoePreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", hidden=2048, intermediate=768, experts=128, topk=8),
    MoePreset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", hidden=4096, intermediate=14336, experts=8, topk=2),
    MoePreset("deepseek-v3", "deepseek-ai/DeepSeek-V3 (routed experts only)", hidden=7168, intermediate=2048,
              experts=256, topk=8),
)}


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------
def routing_seed(seed: int, tokens: int, routing: str) -> int:
    """The generator seed of one point's routing (the same for every variant of the point)."""
    return (seed * 1_000_003 + tokens * 101 + ROUTINGS.index(routing)) % (2 ** 63)


def expert_popularity(num_experts: int, routing: str, generator: torch.Generator) -> torch.Tensor:
    """float64 ``[E]`` sampling weights: all ones (uniform), or Zipf ``rank^-s`` over a random
    permutation of the experts (so that the hot experts are not always the first ids)."""
    if routing == UNIFORM:
        return torch.ones(num_experts, dtype=torch.float64)
    if routing != ZIPF:
        raise ValueError(f"unknown routing {routing!r}; expected one of {ROUTINGS}")
    ranks = torch.randperm(num_experts, generator=generator).double() + 1.0
    return ranks.pow(-ZIPF_EXPONENT)


def make_routing(num_experts: int, topk: int, tokens: int, routing: str, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic routing on the CPU: ``(topk_ids int64 [T, topk], topk_weights float32
    [T, topk])``. Each token gets ``topk`` distinct experts drawn without replacement with the
    :func:`expert_popularity` weights; its weights are a softmax of random logits (sum 1)."""
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, {num_experts}], got {topk}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; expected one of {ROUTINGS}")
    gen = torch.Generator().manual_seed(routing_seed(seed, tokens, routing))
    p = expert_popularity(num_experts, routing, gen)
    ids = torch.multinomial(p.expand(tokens, num_experts), topk, replacement=False, generator=gen)
    logits = torch.randn(tokens, topk, generator=gen)
    return ids.long(), torch.softmax(logits, dim=-1).float()


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> list[int]:
    """Rows (token, slot pairs) routed to each expert, on the host."""
    return torch.bincount(topk_ids.reshape(-1).cpu().long(), minlength=num_experts).tolist()


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------
def expert_weight_bytes(preset: MoePreset, variant: Variant, group_size: int) -> int:
    """Bytes of one expert as ``variant`` holds it: gate/up ``[2I, H]`` and down ``[H, I]``
    (:func:`.variants.projection_weight_bytes`)."""
    h, i = preset.hidden, preset.intermediate
    return (projection_weight_bytes(2 * i, h, variant, group_size)
            + projection_weight_bytes(h, i, variant, group_size))


@dataclasses.dataclass(frozen=True)
class MoeTraffic:
    """Bytes one layer moves at least."""

    weights: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.activations


def moe_traffic(preset: MoePreset, tokens: int, experts_touched: int, expert_bytes: int) -> MoeTraffic:
    """The bytes one layer moves for ``tokens`` tokens whose routing touches ``experts_touched``
    experts of ``expert_bytes`` each:

    * weights: ``experts_touched * expert_bytes`` (experts without tokens need not be read);
    * activations, 2 bytes per element: the layer's input and output (``2 T H``), and for each
      of the ``R = T * topk`` routed rows the gate/up GEMM's input and swiglu output
      (``H + I``) and the down GEMM's input and output (``I + H``); plus the routing's
      ``topk_ids`` and ``topk_weights`` (8 bytes per routed row).
    """
    h, i = preset.hidden, preset.intermediate
    rows = tokens * preset.topk
    act = ELEMENT_BYTES * (2 * tokens * h + rows * (h + i) + rows * (i + h)) + 8 * rows
    return MoeTraffic(weights=int(experts_touched) * int(expert_bytes), activations=act)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MoeConfig(RunOutputs):
    """Validated options of one ``--moe`` run."""

    presets: tuple[str, ...] = ("qwen3-30b-a3b",)
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    routings: tuple[str, ...] = ROUTINGS
    variants: tuple[Variant, ...] = dataclasses.field(default_factory=lambda: parse_variants(MOE_VARIANTS))
    iters: int = MOE_ITERS
    warmup: int = MOE_WARMUP
    max_error: float = DEFAULT_MOE_MAX_ERROR
    point_budget_s: float = DEFAULT_MOE_POINT_BUDGET_S

    def to_json(self) -> dict:
        return {"presets": list(self.presets), "tokens": list(self.tokens), "routings": list(self.routings),
                "zipf_exponent": ZIPF_EXPONENT, "variants": [v.name for v in self.variants],
                "group_size": self.group_size, "iters": self.iters, "warmup": self.warmup, "quick": self.quick,
                "max_error": self.max_error, "point_budget_s": self.point_budget_s, "seed": self.seed,
                "dtype": "bf16", "weights": "randn * 0.02 (bf16), quantized on the GPU",
                "timing": "the whole layer (routing included) in one CUDA graph, replayed; eager_us: the layer "
                          "called from Python on an idle GPU (L2 flushed, then a synchronization)",
                "host_counts": "per-expert loops (bf16 fallback, torch-int4): expert row counts computed on the "
                               "host before the capture, for that point's routing",
                "flush": "2x L2 written before every replay"}


def parse_routings(names: Sequence[str]) -> tuple[str, ...]:
    """``uniform`` / ``zipf`` (no repeats); ValueError for another name."""
    out = tuple(dict.fromkeys(n.strip().lower() for n in names))
    bad = [n for n in out if n not in ROUTINGS]
    if bad or not out:
        raise ValueError(f"unknown routing {', '.join(map(repr, bad))}; expected {' and/or '.join(ROUTINGS)}")
    return out


def parse_moe_presets(text: str) -> tuple[str, ...]:
    """``"qwen3-30b-a3b,mixtral-8x7b"`` or ``"all"`` into preset names; ValueError for others."""
    names = [e.strip().lower() for e in text.split(",") if e.strip()]
    if "all" in names:
        return tuple(MOE_PRESETS)
    unknown = [n for n in names if n not in MOE_PRESETS]
    if unknown or not names:
        raise ValueError(f"unknown MoE preset {', '.join(map(repr, unknown))}; known: {', '.join(MOE_PRESETS)} "
                         f"(or all)")
    return tuple(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------
# Measurements and their analysis
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MoeMeasurement:
    """What was measured for one (preset, routing, tokens, variant). ``timing`` is None when it
    did not run (``error`` says why; ``unavailable``: not supported here). ``impl`` names the
    computation (``torch._grouped_mm``, ``per-expert loop``, ``fused_moe``)."""

    preset: str
    routing: str
    tokens: int
    variant: str
    experts_touched: int
    max_expert_rows: int
    impl: str = ""
    expert_bytes: Optional[int] = None       # one expert as the variant holds it
    timing: Optional[TimingStats] = None
    eager_timing: Optional[TimingStats] = None
    err: Optional[float] = None
    replay_err: Optional[float] = None
    output_finite: bool = True
    error: Optional[str] = None
    unavailable: bool = False


@dataclasses.dataclass(frozen=True)
class MoePoint:
    """One row of the report (see the module docstring for the columns)."""

    preset: str
    routing: str
    tokens: int
    variant: str
    status: str
    note: str = ""
    impl: str = ""
    experts_touched: Optional[int] = None
    max_expert_rows: Optional[int] = None
    time_us: Optional[float] = None
    min_us: Optional[float] = None
    p90_us: Optional[float] = None
    iters: Optional[int] = None
    eager_us: Optional[float] = None
    expert_bytes: Optional[int] = None
    weight_bytes: Optional[int] = None
    act_bytes: Optional[int] = None
    total_bytes: Optional[int] = None
    floor_us: Optional[float] = None
    frac_of_floor: Optional[float] = None
    speedup_vs_bf16: Optional[float] = None
    err: Optional[float] = None
    replay_err: Optional[float] = None

    #: left out of the JSON when None (results written before the field existed lack it)
    OMIT_WHEN_NONE: ClassVar[tuple[str, ...]] = ("eager_us",)

    @property
    def key(self) -> tuple:
        return (self.preset, self.routing, self.tokens, self.variant)

    @property
    def label(self) -> str:
        """The point in words (messages)."""
        return f"{self.variant} {self.preset} {self.routing} T={self.tokens}"


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None


def classify_moe(meas: MoeMeasurement, max_error: float) -> tuple[str, str]:
    """Status and note: ``n/a`` / ``error`` when it did not run; ``FAIL`` for a non-finite output,
    an ``err`` not measured, or an ``err`` / ``replay_err`` that is not finite or above
    ``max_error``."""
    if meas.timing is None:
        return (UNAVAILABLE if meas.unavailable else ERROR), (meas.error or "did not run")
    problems = [] if meas.output_finite else ["output has NaN/inf"]
    for label in ("err", "replay_err"):
        value = getattr(meas, label)
        if value is None:
            if label == "err":
                problems.append("err not measured")
        elif not math.isfinite(value):
            problems.append(f"{label} is {value}")
        elif value > max_error:
            problems.append(f"{label} {value:.2e} > {max_error:.0e}")
    return (FAIL, "; ".join(problems)) if problems else (OK, "")


def analyze_moe(measurements: Iterable[MoeMeasurement], read_bw_gbps: Optional[float],
                max_error: float = DEFAULT_MOE_MAX_ERROR, group_size: int = 128,
                presets: Mapping[str, MoePreset] = MOE_PRESETS) -> list[MoePoint]:
    """Every reported number from the raw measurements (same order). Speedups for ok points over
    the ok bf16 point of the same preset, routing and tokens; the expert bytes are the measured
    ones, else the formula's (:func:`expert_weight_bytes`)."""
    meas = list(measurements)
    status = {id(m): classify_moe(m, max_error) for m in meas}
    base: dict[tuple, float] = {}
    for m in meas:
        if m.variant == BF16.name and status[id(m)][0] == OK and m.timing is not None:
            base[(m.preset, m.routing, m.tokens)] = m.timing.median_us
    out = []
    for m in meas:
        st, note = status[id(m)]
        preset = presets[m.preset]
        ebytes = m.expert_bytes if m.expert_bytes is not None else expert_weight_bytes(
            preset, parse_variant(m.variant), group_size)
        traffic = moe_traffic(preset, m.tokens, m.experts_touched, ebytes)
        row: dict[str, Any] = dict(
            preset=m.preset, routing=m.routing, tokens=m.tokens, variant=m.variant, status=st, note=note, impl=m.impl,
            experts_touched=m.experts_touched, max_expert_rows=m.max_expert_rows, expert_bytes=ebytes,
            weight_bytes=traffic.weights, act_bytes=traffic.activations, total_bytes=traffic.total,
            err=_finite(m.err), replay_err=_finite(m.replay_err))
        if read_bw_gbps:
            row["floor_us"] = floor_us(traffic.total, read_bw_gbps)
        if m.timing is not None and m.timing.median_us > 0:
            t = m.timing.median_us
            row.update(time_us=t, min_us=m.timing.min_us, p90_us=m.timing.p90_us, iters=m.timing.iters)
            if m.eager_timing is not None:
                row["eager_us"] = m.eager_timing.median_us
            if read_bw_gbps:
                row["frac_of_floor"] = row["floor_us"] / t
            ref = base.get((m.preset, m.routing, m.tokens))
            if st == OK and ref is not None:
                row["speedup_vs_bf16"] = ref / t
        out.append(MoePoint(**row))
    return out


# ---------------------------------------------------------------------------------------------
# The report (:mod:`.preset_report`): JSON, split, merge, table
# ---------------------------------------------------------------------------------------------
class MoeReport(PresetReport):
    """A whole ``--moe`` run: where, how, the presets' shapes and every :class:`MoePoint`. A merge
    (e.g. one preset, or a few token counts, per process) also checks that the group sizes agree,
    and lists the union of the token counts (and each run's)."""

    SCHEMA = MOE_SCHEMA
    POINT = MoePoint
    MERGE_SAME = (("group_size", "group sizes"),)
    MERGE_UNION = ("tokens",)


#: this module's names from before the report was shared (mixgemm.bench exports them; tools use them)
moe_report_to_dict = MoeReport.to_dict
moe_report_from_dict = MoeReport.from_dict
merge_moe_reports = MoeReport.merge
write_moe_json = write_report_json


def _moe_order(points: list) -> Callable[[MoePoint], tuple]:
    routings = first_seen(p.routing for p in points)
    variants = first_seen(p.variant for p in points)
    return lambda p: (routings[p.routing], p.tokens, variants[p.variant])


def _moe_footer(points: list) -> list[str]:
    impls = dict.fromkeys(f"{p.variant}: {p.impl}" for p in points if p.impl)
    return ((["  computed by: " + "; ".join(impls)] if impls else [])
            + ["  experts: touched (most rows on one expert)"])


MOE_TABLE = PresetTable(
    columns=(Column("routing", lambda p: p.routing, right=False), Column("tokens", lambda p: str(p.tokens)),
             Column("experts", lambda p: "" if p.experts_touched is None else
                    f"{p.experts_touched} (<={p.max_expert_rows})"), VARIANT,
             Column("us", lambda p: fmt(p.time_us, ".1f")), Column("eager us", lambda p: fmt(p.eager_us, ".1f")),
             Column("floor us", lambda p: fmt(p.floor_us, ".1f")),
             PERCENT_OF_FLOOR, SPEEDUP_VS_BF16, Column("MB", lambda p: megabytes(p.total_bytes)), ERR, ITERS, STATUS),
    how=lambda config: (f"the whole layer in a CUDA graph, median of up to {config.get('iters')} replays (L2 "
                        f"flushed before each); eager: called from Python on an idle GPU; floor = bytes of the "
                        f"experts touched + activations / read bandwidth"),
    heading=lambda name, preset, points: (f"{name}: hidden {preset.hidden}, expert intermediate "
                                          f"{preset.intermediate}, {preset.experts} experts, top-{preset.topk}"),
    order=_moe_order, note_key=lambda p: f"{p.variant} {p.routing} T={p.tokens}", footer=_moe_footer)
MOE_TABLE_HEADER = MOE_TABLE.header


def format_moe_table(points: Sequence[MoePoint], machine: Optional[MachineInfo] = None,
                     config: Optional[Mapping[str, Any]] = None,
                     presets: Mapping[str, MoePreset] = MOE_PRESETS) -> str:
    """The report as aligned text: one block per preset, rows by routing, tokens, then variant;
    the implementations and the reasons for any status but ok listed under each block."""
    return MOE_TABLE.format(points, machine, config, presets)


__all__ = ["MOE_SCHEMA", "DEFAULT_TOKENS", "UNIFORM", "ZIPF", "ROUTINGS", "ZIPF_EXPONENT", "MOE_ITERS", "MOE_WARMUP",
           "DEFAULT_MOE_POINT_BUDGET_S", "DEFAULT_MOE_MAX_ERROR", "MOE_VARIANTS", "MoePreset", "MOE_PRESETS",
           "routing_seed", "expert_popularity", "make_routing", "expert_counts", "expert_weight_bytes", "MoeTraffic",
           "moe_traffic", "floor_us", "MoeConfig", "parse_routings", "parse_moe_presets", "MoeMeasurement",
           "MoePoint", "classify_moe", "analyze_moe", "failed", "MoeReport", "moe_report_to_dict",
           "moe_report_from_dict", "write_moe_json", "split_by_preset", "merge_moe_reports", "MOE_TABLE",
           "MOE_TABLE_HEADER", "format_moe_table"]
