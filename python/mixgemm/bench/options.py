"""The options of ``mixgemm bench`` and their validation into a run's config (no GPU needed:
a bad option is reported before anything else)."""
from __future__ import annotations

import argparse
import importlib.util
import re
from typing import Callable, Optional, Sequence

from ..errors import BenchError
from .block import BLOCK_HIDDEN, BLOCK_INTERMEDIATE
from .decoder import PRESETS
from .generate import (DEFAULT_FUSE, DEFAULT_GEN_BATCHES, DEFAULT_NEW_TOKENS, DEFAULT_PROMPT_TOKENS, DEFAULT_REPEATS,
                       DEFAULT_TYPES, FUSE_SETTINGS, GEN_MODES, PRESET, QUANTIZED_DIR, STEP_ITERS, STEP_WARMUP,
                       GenerateConfig, parse_gen_modes, parse_types, resolve_target)
from .grid import (DEFAULT_CHECK_ROWS, DEFAULT_GROUP_SIZE, DEFAULT_MAX_ERROR, DEFAULT_MS, DEFAULT_PEER_MAX_ERROR,
                   DEFAULT_SEED, DEFAULT_SHAPES, DEFAULT_WARMUP, MIN_ITERS, QUICK_ITERS, QUICK_WARMUP, BenchConfig)
from .host import STEP_PRESET, STEP_VARIANTS
from .model import (DEFAULT_BATCHES, DEFAULT_CONTEXT, DEFAULT_LAYERS, DEFAULT_MODEL_FP8_MAX_ERROR,
                    DEFAULT_MODEL_MAX_ERROR, DEFAULT_POINT_BUDGET_S, DEFAULT_MODES, DEFAULT_PREFILL, MODEL_ITERS,
                    MODEL_WARMUP, MODES, ModelConfig)
from .moe import (DEFAULT_MOE_MAX_ERROR, DEFAULT_MOE_POINT_BUDGET_S, DEFAULT_TOKENS, MOE_ITERS, MOE_PRESETS,
                  MOE_VARIANTS, MOE_WARMUP, ROUTINGS, MoeConfig, parse_moe_presets, parse_routings)
from .peers import BASELINE, impl_names, select_impl_names
from .variants import DEFAULT_VARIANTS, NO_GEMM, parse_variants

# ------------------------------------------------------------------------------------------
# Argument parsing helpers (pure)
# ------------------------------------------------------------------------------------------
_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """Parse ``"4096x4096,28672x8192"`` (NxK, comma separated) into ``((4096, 4096), ...)``.

    Raises
    ------
    argparse.ArgumentTypeError
        An entry is not ``NxK`` with positive integers, or the list is empty.
    """
    entries = [e for e in text.split(",") if e.strip()]
    if not entries:
        raise argparse.ArgumentTypeError("expected a comma-separated list of NxK shapes, "
                                         "e.g. 4096x4096,28672x8192; got an empty list")
    shapes = []
    for entry in entries:
        m = _SHAPE_RE.match(entry)
        if not m or int(m[1]) <= 0 or int(m[2]) <= 0:
            raise argparse.ArgumentTypeError(
                f"bad shape {entry.strip()!r}: expected NxK (out_features x in_features) with "
                f"positive integers, e.g. 4096x4096,28672x8192")
        shapes.append((int(m[1]), int(m[2])))
    return tuple(shapes)


def parse_int_list(text: str) -> tuple[int, ...]:
    """Parse ``"1,16,128"`` into ``(1, 16, 128)`` (positive integers).

    Raises
    ------
    argparse.ArgumentTypeError
        An entry is not a positive integer, or the list is empty.
    """
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers, "
                                         "e.g. 1,16,128; got an empty list")
    out = []
    for entry in entries:
        try:
            value = int(entry)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad value {entry!r}: expected a positive integer") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"bad value {entry!r}: expected a positive integer")
        out.append(value)
    return tuple(out)


def parse_name_list(text: str) -> tuple[str, ...]:
    """Parse ``"cublas,mixgemm-u4"`` into ``("cublas", "mixgemm-u4")``."""
    names = tuple(e.strip() for e in text.split(",") if e.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of names, e.g. mixgemm-u4,gemlite")
    return names


def parse_presets(text: str) -> tuple[str, ...]:
    """``"llama3-8b,qwen2.5-7b"`` or ``"all"`` into preset names (known ones, no repeats).

    Raises
    ------
    argparse.ArgumentTypeError
        An unknown name, or an empty list.
    """
    names = [e.strip().lower() for e in text.split(",") if e.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected preset names or all; known: {', '.join(PRESETS)}")
    if "all" in names:
        return tuple(PRESETS)
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown model preset {', '.join(map(repr, unknown))}; known: "
                                         f"{', '.join(PRESETS)} (or all)")
    return tuple(dict.fromkeys(names))


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad value {text!r}: expected an integer >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"bad value {text!r}: expected an integer >= 0")
    return value


# ------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------
#: Options that only --model and --host take (None unless given).
_MODEL_OPTIONS = ("layers", "batch", "context", "prefill", "modes", "model_max_error", "model_fp8_max_error")
#: Options that --model, --host and --moe take.
_SHARED_OPTIONS = ("variants", "point_budget")
#: Options that only --moe takes.
_MOE_OPTIONS = ("tokens", "routing", "moe_max_error")
#: Options of --model and --host that --generate takes too.
_GENERATE_SHARED = ("layers", "batch")
#: Options that only --generate takes.
_GENERATE_OPTIONS = ("types", "fuse_layers", "gen_modes", "prompt_tokens", "new_tokens", "repeats")


def _moe_presets(text: str) -> tuple[str, ...]:
    try:
        return parse_moe_presets(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``mixgemm bench`` options to ``parser`` (the caller sets ``func=run_cli``)."""
    shapes = ",".join(f"{n}x{k}" for n, k in DEFAULT_SHAPES)
    grid = parser.add_argument_group("the grid (default mode)")
    grid.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES, metavar="NxK,...",
                      help=f"weight shapes N x K (out x in features), comma separated "
                           f"(default: LLaMA-3 8B/70B layers {shapes})")
    grid.add_argument("--m", type=parse_int_list, default=DEFAULT_MS, metavar="M,...", dest="m",
                      help=f"token counts (default {','.join(map(str, DEFAULT_MS))}; --block: 1)")
    grid.add_argument("--impls", type=parse_name_list, default=None, metavar="NAME,...",
                      help=f"implementations to run: names or prefixes, comma separated "
                           f"(default all: {', '.join(impl_names())}); {BASELINE} always runs; an exact "
                           f"name takes that row and its @<config> rows only (mixgemm-u4: not "
                           f"mixgemm-u4-fp8)")
    grid.add_argument("--all-configs", action="store_true",
                      help="also time every mixgemm tile config (mixgemm-<wt>@<label>), to tune the heuristic")
    grid.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                      help="activation dtype (default bf16; torch_int4 and scaled_mm need bf16; --model and "
                           "--host: bf16)")
    grid.add_argument("--max-error", type=float, default=DEFAULT_MAX_ERROR,
                      help=f"relative error vs the implementation's own weight above which a "
                           f"mixgemm or cuBLAS point FAILs (default {DEFAULT_MAX_ERROR:g})")
    grid.add_argument("--peer-max-error", type=float, default=DEFAULT_PEER_MAX_ERROR,
                      help=f"the same for torch_int4 and gemlite (default "
                           f"{DEFAULT_PEER_MAX_ERROR:g}: gemlite's GEMV accumulates in bf16)")
    grid.add_argument("--fp8-max-error", type=float, default=None,
                      help="the same for the e4m3-activation rows (mixgemm-<wt>-fp8, scaled_mm; default: the "
                           "e4m3 GEMM tests' bound, 4 u + 64 sqrt(K) 2^-24 + 2^-12 with u the output's "
                           "rounding: 8.3e-3 for bf16 at K = 4096)")
    grid.add_argument("--check-rows", type=int, default=DEFAULT_CHECK_ROWS,
                      help=f"output rows compared with the float64 reference (all when M is "
                           f"at most this; default {DEFAULT_CHECK_ROWS})")

    common = parser.add_argument_group("every mode")
    common.add_argument("--group-size", type=int, choices=(32, 64, 128, 256), default=DEFAULT_GROUP_SIZE,
                        help="quantization group size (default 128)")
    common.add_argument("--iters", type=int, default=None,
                        help=f"timed runs per point, the median is reported (default and minimum unless "
                             f"--quick: {MIN_ITERS} for the grid and --block, {MODEL_ITERS} for --model and --host)")
    common.add_argument("--warmup", type=int, default=None,
                        help=f"untimed runs before timing (default {DEFAULT_WARMUP}; --model {MODEL_WARMUP})")
    common.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_ITERS} iterations by default and no minimum "
                             f"(the numbers are not measurements)")
    common.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (default 0)")
    common.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON")
    common.add_argument("--plot", metavar="PATH", default=None,
                        help="write the plot as PNG (needs matplotlib; not for --block / --host)")
    common.add_argument("--save", action="store_true",
                        help="write the results to <results-dir>/<gpu-name-slug>/: bench.json and bench.png "
                             "(grid), model-<preset>.json and .png (--model), moe-<preset>.json and .png (--moe), "
                             "host.json (--host)")
    common.add_argument("--results-dir", metavar="DIR", default=None,
                        help="root of --save's folders (default benchmarks/results)")
    common.add_argument("--gpu-name", metavar="NAME", default=None,
                        help="GPU name for the report and the results folder (default: the device's name)")
    common.add_argument("--list-kernels", action="store_true",
                        help="no GPU: print the mixgemm kernels the run would launch (for `mixgemm generate "
                             "--build --kernels`) and exit")

    modes = parser.add_argument_group("modes (at most one)").add_mutually_exclusive_group()
    modes.add_argument("--block", action="store_true",
                       help=f"a LLaMA-style MLP block (hidden {BLOCK_HIDDEN}, intermediate {BLOCK_INTERMEDIATE}, "
                            "int4 asymmetric) at batch 1 (or --m), bf16 vs mixgemm, both under CUDA graphs")
    modes.add_argument("--model", type=parse_presets, default=None, metavar="NAME,...",
                       help=f"one decode step (and a prefill) of a decoder layer stack with a model's shapes: "
                            f"{', '.join(PRESETS)}, or all; bf16 vs mixgemm (exact or e4m3 activations), torch's "
                            f"int4 and torch._scaled_mm fp8, graph and eager")
    modes.add_argument("--moe", type=_moe_presets, default=None, metavar="NAME,...",
                       help=f"one mixture-of-experts layer (routing, gate/up + swiglu, down, top-k sum) with a "
                            f"model's expert shapes: {', '.join(MOE_PRESETS)}, or all; bf16 (torch._grouped_mm) vs "
                            f"mixgemm's fused_moe and torch's int4 per expert, under CUDA graphs")
    modes.add_argument("--host", action="store_true",
                       help="host microseconds per call of mixgemm.gemm / QuantLinear beside F.linear and torch's "
                            "int4 (4096x4096, M = 1, 16, 256), and the eager llama3-8b decode step")
    modes.add_argument("--generate", default=None, metavar="PRESET|DIR",
                       help=f"transformers' generate() as a user runs it: a causal LM with a preset's shapes "
                            f"({', '.join(PRESETS)}; random weights) or a model directory (a quantized one through "
                            f"mixgemm.hf.from_pretrained), bf16 and mixgemm weight types (exact, e4m3 or auto "
                            f"activations), with and without fuse_layers, in {', '.join(GEN_MODES)} modes")
    modes.add_argument("--merge", metavar="JSON", nargs="+", default=None,
                       help="no GPU run: merge the JSON reports of runs that split a grid (same GPU, dtype and "
                            "group size), or --model, --moe or --generate reports, into one; then write --json / "
                            "--plot / --save")

    model = parser.add_argument_group("--model and --host (--layers and --batch: --generate too)")
    model.add_argument("--layers", type=int, default=None,
                       help=f"decoder layers in the stack (default {DEFAULT_LAYERS}; --generate: all the model's)")
    model.add_argument("--batch", type=parse_int_list, default=None, metavar="B,...",
                       help=f"decode batch sizes (default {','.join(map(str, DEFAULT_BATCHES))}; --host: 1; "
                            f"--generate: {','.join(map(str, DEFAULT_GEN_BATCHES))})")
    model.add_argument("--context", type=_non_negative_int, default=None,
                       help=f"tokens already in each sequence's KV cache at the decode step (default {DEFAULT_CONTEXT})")
    model.add_argument("--prefill", type=_non_negative_int, default=None, metavar="TOKENS",
                       help=f"tokens of the prefill at batch 1 (default {DEFAULT_PREFILL}; 0: no prefill)")
    model.add_argument("--variants", type=parse_name_list, default=None, metavar="NAME,...",
                       help=f"variants (--model, --host and --moe; default {','.join(DEFAULT_VARIANTS)}, --moe without "
                            f"no-gemm; int4/int2/int8 = mixgemm u4/u2/s8, or mixgemm-<type>; a mixgemm name with "
                            f"-fp8 (int4-fp8, mixgemm-s2-fp8): e4m3 activations; scaled-mm: torch._scaled_mm "
                            f"W8A8-FP8; no-gemm: the step without its GEMMs, --model's bound); bf16 always runs")
    model.add_argument("--modes", type=parse_name_list, default=None, metavar="MODE,...",
                       help="graph, eager and/or compiled (torch.compile, then a CUDA graph; default graph,eager)")
    model.add_argument("--point-budget", type=float, default=None, metavar="SECONDS",
                       help=f"a point whose runs would take longer gets fewer (at least 10; default "
                            f"{DEFAULT_POINT_BUDGET_S:g} s: the 70B prefill through torch's int4 kernel; --moe "
                            f"{DEFAULT_MOE_POINT_BUDGET_S:g} s)")
    model.add_argument("--model-max-error", type=float, default=None,
                       help=f"the step's error bar (output, KV written, graph replay) vs bf16 on the same "
                            f"dequantized weights (default {DEFAULT_MODEL_MAX_ERROR:g})")
    model.add_argument("--model-fp8-max-error", type=float, default=None,
                       help=f"the same for the e4m3 variants (-fp8, scaled-mm), whose step also rounds every "
                            f"linear's input to e4m3 (default {DEFAULT_MODEL_FP8_MAX_ERROR:g})")
    moe = parser.add_argument_group("--moe")
    moe.add_argument("--tokens", type=parse_int_list, default=None, metavar="T,...",
                     help=f"tokens in the layer (default {','.join(map(str, DEFAULT_TOKENS))})")
    moe.add_argument("--routing", type=parse_name_list, default=None, metavar="KIND,...",
                     help=f"routings: {' and/or '.join(ROUTINGS)} (default both; the same routing for every "
                          f"variant of a point)")
    moe.add_argument("--moe-max-error", type=float, default=None,
                     help=f"the layer's error bar vs bf16 on the variant's own dequantized weights (default "
                          f"{DEFAULT_MOE_MAX_ERROR:g})")
    gen = parser.add_argument_group("--generate")
    gen.add_argument("--types", type=parse_name_list, default=None, metavar="TYPE,...",
                     help=f"mixgemm weight types beside bf16 (default {','.join(DEFAULT_TYPES)}): u4, u2, u8 "
                          f"(asymmetric, zero points) or s4, s2, s8 (symmetric), exact activations; a 4- or 2-bit "
                          f"one with -fp8 (u4-fp8: e4m3 activations, act_format='fp8') or -auto (u2-auto: "
                          f"act_format='auto', e4m3 where the GPU's tuning table measured it faster)")
    gen.add_argument("--fuse-layers", choices=tuple(FUSE_SETTINGS), default=None,
                     help=f"quantize_model's fuse_layers: off (fused projections), on (mixgemm's decoder layer "
                          f"with its static KV cache) or both (default {DEFAULT_FUSE})")
    gen.add_argument("--gen-modes", type=parse_name_list, default=None, metavar="MODE,...",
                     help=f"generate() modes (default all): {', '.join(GEN_MODES)}")
    gen.add_argument("--prompt-tokens", type=int, default=None,
                     help=f"prompt length (default {DEFAULT_PROMPT_TOKENS})")
    gen.add_argument("--new-tokens", type=int, default=None,
                     help=f"tokens generated per sequence, at least 2 (default {DEFAULT_NEW_TOKENS})")
    gen.add_argument("--repeats", type=int, default=None,
                     help=f"timed generate() calls per point after the warm-up, the median is reported "
                          f"(default {DEFAULT_REPEATS})")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m mixgemm.bench``)."""
    parser = argparse.ArgumentParser(
        prog="mixgemm bench",
        description="Time mixgemm's GEMMs against cuBLAS, torch's int4 kernel and gemlite on "
                    "LLaMA-3 layer shapes, a decoder layer stack (--model), or the host's cost "
                    "per call (--host). See benchmarks/README.md.")
    return add_arguments(parser)


def _iterations(args: argparse.Namespace, minimum: int, warmup_default: int) -> tuple[int, int, bool]:
    quick = bool(args.quick)
    iters = args.iters if args.iters is not None else (QUICK_ITERS if quick else minimum)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if quick else warmup_default)
    if iters < 1:
        raise BenchError(f"--iters must be at least 1, got {iters}")
    if iters < minimum and not quick:
        raise BenchError(f"--iters {iters} is below the minimum of {minimum} timed runs per "
                         f"point; pass --quick for a smoke run with fewer")
    if warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {warmup}")
    return iters, warmup, quick


def _check_model_only(args: argparse.Namespace) -> None:
    model = bool(getattr(args, "model", None) or getattr(args, "host", False))
    moe = bool(getattr(args, "moe", None))
    generate = getattr(args, "generate", None) is not None
    flag = lambda names: ", ".join("--" + g.replace("_", "-") for g in names)  # noqa: E731
    given = [name for name in _MODEL_OPTIONS if getattr(args, name, None) is not None]
    if generate and not set(given) <= set(_GENERATE_SHARED):
        raise BenchError(f"{flag(n for n in given if n not in _GENERATE_SHARED)} do not apply to --generate")
    if given and not (model or generate):
        also = " (--layers and --batch also to --generate)" if set(given) <= set(_GENERATE_SHARED) else ""
        raise BenchError(f"{flag(given)} only apply to --model and --host{also}")
    given = [name for name in _GENERATE_OPTIONS if getattr(args, name, None) is not None]
    if given and not generate:
        raise BenchError(f"{flag(given)} only apply to --generate")
    given = [name for name in _SHARED_OPTIONS if getattr(args, name, None) is not None]
    if given and not (model or moe):
        raise BenchError(f"{flag(given)} only apply to --model, --host and --moe")
    given = [name for name in _MOE_OPTIONS if getattr(args, name, None) is not None]
    if given and not moe:
        raise BenchError(f"{flag(given)} only apply to --moe")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validate parsed options into the grid's (and --block's) :class:`BenchConfig`.

    Raises
    ------
    BenchError
        Too few iterations without ``--quick``, a negative warm-up, a bad ``--impls``,
        ``--check-rows`` below 1, a non-positive ``--max-error`` / ``--peer-max-error`` /
        ``--fp8-max-error``, or a
        ``--model`` option without ``--model``.
    """
    _check_model_only(args)
    iters, warmup, quick = _iterations(args, MIN_ITERS, DEFAULT_WARMUP)
    if args.check_rows < 1:
        raise BenchError(f"--check-rows must be at least 1, got {args.check_rows}")
    if not args.max_error > 0:
        raise BenchError(f"--max-error must be positive, got {args.max_error}")
    if not args.peer_max_error > 0:
        raise BenchError(f"--peer-max-error must be positive, got {args.peer_max_error}")
    if args.fp8_max_error is not None and not args.fp8_max_error > 0:
        raise BenchError(f"--fp8-max-error must be positive, got {args.fp8_max_error}")
    try:
        names = select_impl_names(impl_names(args.all_configs), args.impls)
    except ValueError as e:
        raise BenchError(str(e)) from None
    return BenchConfig(
        shapes=tuple(args.shapes), ms=tuple(args.m), impls=tuple(names), dtype=args.dtype,
        group_size=args.group_size, iters=iters, warmup=warmup, quick=quick,
        all_configs=bool(args.all_configs), max_error=float(args.max_error),
        peer_max_error=float(args.peer_max_error),
        fp8_max_error=None if args.fp8_max_error is None else float(args.fp8_max_error),
        check_rows=int(args.check_rows), seed=int(args.seed), json_path=args.json,
        plot_path=args.plot, save=bool(args.save), results_root=args.results_dir,
        gpu_name=args.gpu_name)


def model_config_from_args(args: argparse.Namespace, presets: Optional[Sequence[str]] = None,
                           default_batches: Sequence[int] = DEFAULT_BATCHES,
                           default_prefill: int = DEFAULT_PREFILL,
                           default_variants: Sequence[str] = DEFAULT_VARIANTS) -> ModelConfig:
    """Validate parsed options into a :class:`.model.ModelConfig` (``--model``, or the step of
    ``--host`` with its own defaults).

    Raises
    ------
    BenchError
        Too few iterations without ``--quick``, fewer than one layer, an unknown variant or
        mode, a non-positive error bar (``--model-max-error``, ``--model-fp8-max-error``) or point
        budget, fp16 activations, a ``--moe`` option.
    """
    _check_model_only(args)
    iters, warmup, quick = _iterations(args, MODEL_ITERS, MODEL_WARMUP)
    layers = DEFAULT_LAYERS if args.layers is None else args.layers
    if layers < 1:
        raise BenchError(f"--layers must be at least 1, got {layers}")
    if args.dtype != "bf16":
        raise BenchError("--model and --host run bf16 activations (torch's int4 kernel takes nothing else)")
    try:
        variants = parse_variants(args.variants if args.variants is not None else default_variants)
    except ValueError as e:
        raise BenchError(f"--variants: {e}") from None
    modes = tuple(m.lower() for m in (args.modes or DEFAULT_MODES))
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise BenchError(f"--modes: unknown {', '.join(map(repr, bad))}; expected {', '.join(MODES)}")
    max_error = DEFAULT_MODEL_MAX_ERROR if args.model_max_error is None else args.model_max_error
    if not max_error > 0:
        raise BenchError(f"--model-max-error must be positive, got {max_error}")
    fp8_max_error = DEFAULT_MODEL_FP8_MAX_ERROR if args.model_fp8_max_error is None else args.model_fp8_max_error
    if not fp8_max_error > 0:
        raise BenchError(f"--model-fp8-max-error must be positive, got {fp8_max_error}")
    budget = DEFAULT_POINT_BUDGET_S if args.point_budget is None else args.point_budget
    if not budget > 0:
        raise BenchError(f"--point-budget must be positive, got {budget}")
    return ModelConfig(
        presets=tuple(presets if presets is not None else args.model), layers=layers,
        batches=tuple(args.batch) if args.batch is not None else tuple(default_batches),
        context=DEFAULT_CONTEXT if args.context is None else args.context,
        prefill=default_prefill if args.prefill is None else args.prefill,
        variants=variants, modes=tuple(dict.fromkeys(modes)), group_size=args.group_size, iters=iters,
        warmup=warmup, quick=quick, max_error=float(max_error), point_budget_s=float(budget), seed=int(args.seed),
        fp8_max_error=float(fp8_max_error), json_path=args.json, plot_path=args.plot, save=bool(args.save),
        results_root=args.results_dir, gpu_name=args.gpu_name)


def moe_config_from_args(args: argparse.Namespace) -> MoeConfig:
    """Validate parsed options into a :class:`.moe.MoeConfig` (``--moe``).

    Raises
    ------
    BenchError
        Too few iterations without ``--quick``, an unknown variant (or no-gemm, or an e4m3 one) or
        routing, a non-positive error bar or point budget, fp16 activations, or a ``--model`` /
        grid option.
    """
    _check_model_only(args)
    iters, warmup, quick = _iterations(args, MOE_ITERS, MOE_WARMUP)
    if args.dtype != "bf16":
        raise BenchError("--moe runs bf16 activations (torch._grouped_mm and torch's int4 kernel take nothing else)")
    try:
        variants = parse_variants(args.variants if args.variants is not None else MOE_VARIANTS)
        routings = parse_routings(args.routing if args.routing is not None else ROUTINGS)
    except ValueError as e:
        raise BenchError(f"{'--routing' if 'routing' in str(e) else '--variants'}: {e}") from None
    if NO_GEMM in variants:
        raise BenchError("--variants: no-gemm is a --model (and --host) variant: --moe has no step without its GEMMs")
    e4m3 = [v.name for v in variants if v.e4m3]
    if e4m3:
        raise BenchError(f"--variants: {', '.join(e4m3)}: --moe has no e4m3-activation variant (mixgemm has no "
                         f"grouped e4m3 kernels yet, docs/fp8.md); they are --model (and --host) variants")
    max_error = DEFAULT_MOE_MAX_ERROR if args.moe_max_error is None else args.moe_max_error
    if not max_error > 0:
        raise BenchError(f"--moe-max-error must be positive, got {max_error}")
    budget = DEFAULT_MOE_POINT_BUDGET_S if args.point_budget is None else args.point_budget
    if not budget > 0:
        raise BenchError(f"--point-budget must be positive, got {budget}")
    return MoeConfig(
        presets=tuple(args.moe), tokens=tuple(dict.fromkeys(args.tokens or DEFAULT_TOKENS)), routings=routings,
        variants=variants, group_size=args.group_size, iters=iters, warmup=warmup, quick=quick,
        max_error=float(max_error), point_budget_s=float(budget), seed=int(args.seed), json_path=args.json,
        plot_path=args.plot, save=bool(args.save), results_root=args.results_dir, gpu_name=args.gpu_name)


def _parsed(prefix: str, parse: Callable, value):
    """``parse(value)``, its ValueError a :class:`BenchError` that starts with ``prefix``."""
    try:
        return parse(value)
    except ValueError as e:
        raise BenchError(f"{prefix}{e}") from None


def generate_config_from_args(args: argparse.Namespace) -> GenerateConfig:
    """Validate parsed options into a :class:`.generate.GenerateConfig` (``--generate``).

    Raises
    ------
    BenchError
        transformers missing; a target that is neither a preset nor a model directory; an unknown
        weight type or mode, or an 8-bit type with ``-fp8`` or ``-auto``; a batch, prompt, token or
        repeat count out of range; ``--layers`` for a directory or beyond the preset's; ``--types``
        for a quantized directory; too few step replays without ``--quick``; fp16 activations; an
        option of another mode.
    """
    _check_model_only(args)
    iters, warmup, quick = _iterations(args, STEP_ITERS, STEP_WARMUP)
    if args.dtype != "bf16":
        raise BenchError("--generate runs bf16 models (the baseline and mixgemm's activations)")
    if importlib.util.find_spec("transformers") is None:
        raise BenchError("--generate needs transformers (pip install transformers)")
    name, source, quant_method = _parsed("", resolve_target, args.generate)
    types = _parsed("--types: ", parse_types, args.types if args.types is not None else DEFAULT_TYPES)
    modes = _parsed("--gen-modes: ", parse_gen_modes, args.gen_modes if args.gen_modes is not None else GEN_MODES)
    if args.layers is not None:
        if source != PRESET:
            raise BenchError("--layers applies to a preset; a model directory runs all its layers")
        if not 1 <= args.layers <= PRESETS[name].model_layers:
            raise BenchError(f"--layers must be 1 to {PRESETS[name].model_layers} for {name}, got {args.layers}")
    if args.types is not None and source == QUANTIZED_DIR:
        raise BenchError(f"--types: {args.generate} is already quantized ({quant_method}): it is the only "
                         f"quantized variant")
    counts = {"--prompt-tokens": (args.prompt_tokens, DEFAULT_PROMPT_TOKENS, 1),
              "--new-tokens": (args.new_tokens, DEFAULT_NEW_TOKENS, 2), "--repeats": (args.repeats, DEFAULT_REPEATS, 1)}
    values = {}
    for flag, (given, default, low) in counts.items():
        values[flag] = default if given is None else given
        if values[flag] < low:
            why = " (one to time the prompt apart from the tokens)" if flag == "--new-tokens" else ""
            raise BenchError(f"{flag} must be at least {low}{why}, got {values[flag]}")
    return GenerateConfig(
        target=args.generate, name=name, source=source, quant_method=quant_method, layers=args.layers,
        batches=tuple(dict.fromkeys(args.batch)) if args.batch is not None else DEFAULT_GEN_BATCHES,
        prompt_tokens=values["--prompt-tokens"], new_tokens=values["--new-tokens"], repeats=values["--repeats"],
        types=types, fuse=FUSE_SETTINGS[args.fuse_layers or DEFAULT_FUSE], modes=modes, group_size=args.group_size,
        iters=iters, warmup=warmup, quick=quick, seed=int(args.seed), json_path=args.json, plot_path=args.plot,
        save=bool(args.save), results_root=args.results_dir, gpu_name=args.gpu_name)


def host_step_config(args: argparse.Namespace) -> ModelConfig:
    """The decode step of ``--host``: llama3-8b, batch 1 (or ``--batch``), no prefill, bf16 and
    mixgemm int4 (or ``--variants``), both modes."""
    return model_config_from_args(args, presets=(STEP_PRESET,), default_batches=(1,), default_prefill=0,
                                  default_variants=[v.name for v in STEP_VARIANTS])


__all__ = ["parse_shapes", "parse_int_list", "parse_name_list", "parse_presets", "add_arguments", "build_parser",
           "config_from_args", "model_config_from_args", "moe_config_from_args", "generate_config_from_args",
           "host_step_config"]
