"""The ``mixgemm`` command line.

Subcommands are registered in :data:`SUBCOMMANDS`: each entry maps a name to a builder
function that adds its parser to the ``argparse`` subparsers and sets ``func`` (the function
that runs it: ``func(args) -> int`` exit status). To add a subcommand, write a
``_add_<name>(subparsers)`` builder and a ``_run_<name>(args)`` runner and add the builder to
:data:`SUBCOMMANDS`. Runners report user errors by raising :class:`CliError`.

It behaves like a Unix tool (:func:`main`):

* exit status 0 on success, 1 on a reported error (any :class:`mixgemm.errors.MixgemmError`,
  an ``OSError``, or a bug), 2 on a usage error (argparse's, or a :class:`UsageError`), 130 when
  interrupted (SIGINT), and 141 (128 + SIGPIPE, what the shell reports for a tool killed by
  SIGPIPE) when stdout is closed early, as in ``mixgemm generate --list | head``: quietly;
* an error is one line on stderr, ``mixgemm <command>: error: <what>``; a longer message (a
  compiler's output) or a traceback is printed only with ``--debug``.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from types import MappingProxyType
from typing import Callable, Optional, Sequence

from .errors import CliError, MixgemmError, UsageError

PROG = "mixgemm"
#: Exit statuses (see the module docstring).
EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def _fmt_bytes(n: int) -> str:
    from .demo import fmt_bytes
    return fmt_bytes(n)


def _group_size_arg(text: str):
    if text.lower() in ("channel", "per-channel", "k"):
        return "channel"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer (32, 64, 128, 256) or 'channel', got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _regex_arg(text: str) -> "re.Pattern[str]":
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"bad regular expression {text!r}: {e}") from None


# ---------------------------------------------------------------------------------- prepack

#: Tensors prepack quantizes by default: names ending in ``.weight``...
DEFAULT_INCLUDE = r"\.weight$"
#: ...except embeddings, norms and the LM head (matched with ``re.search`` on the name).
DEFAULT_EXCLUDE = r"embed|(^|\.)(wte|wpe)\.|lm_head|(^|\.)output\.weight$|norm|(^|\.)ln_"

#: safetensors dtypes of the tensors prepack can quantize.
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
#: Tensors a refusal names (in its one line); the rest are counted.
_MAX_PROBLEMS = 8


def _add_prepack(subparsers) -> None:
    p = subparsers.add_parser(
        "prepack",
        help="quantize and prepack the linear weights of a safetensors checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Quantize (round-to-nearest, group-wise along K) every selected 2-D weight of a\n"
            "safetensors file and prepack it into the sm90a layout; copy every other tensor\n"
            "unchanged. Writes one mixgemm safetensors file (read it with mixgemm.load).\n\n"
            "A tensor is selected when it is 2-D floating point (fp16/bf16/fp32/fp64), its name\n"
            "matches an --include regex and no --exclude regex (re.search). Defaults:\n"
            f"  include: {DEFAULT_INCLUDE}\n"
            f"  exclude: {DEFAULT_EXCLUDE}\n"
            "           (embeddings, norms and the LM head: embed*, wte/wpe, lm_head,\n"
            "            output.weight, *norm*, ln_*)\n"
            "Selected weights [N, K] need N % 16 == 0, K % 64 == 0 and K divisible by the\n"
            "group size; prepack checks every tensor before writing anything.\n\n"
            "Mixture-of-experts weights (...experts.<e>.{gate,up,down}_proj.weight, or Mixtral's\n"
            "...experts.<e>.{w1,w3,w2}.weight) are written as one stacked tensor per projection\n"
            "(mixgemm.moe.PackedExperts): ...experts.w13.weight (gate/up interleaved, as\n"
            "mixgemm.moe.fused_moe takes it) and ...experts.w2.weight (down). Experts of different\n"
            "shapes or types, a missing expert or non-contiguous ids are refused, with no output."),
    )
    p.add_argument("input", metavar="IN.safetensors",
                   help="unquantized checkpoint; with --from, a quantized checkpoint file or a "
                        "directory of *.safetensors shards")
    p.add_argument("-o", "--output", metavar="OUT.safetensors", required=True,
                   help="where to write the packed checkpoint: written to a temporary file in the "
                        "same directory, then renamed; an existing file is refused unless --force")
    p.add_argument("--force", action="store_true",
                   help="replace an existing OUT (atomically: readers see the old or the new file)")
    p.add_argument("--from", dest="from_format", metavar="FORMAT", default=None,
                   choices=("awq", "gptq", "compressed-tensors", "hqq", "auto", "gguf"),
                   help="convert an already quantized checkpoint (awq, gptq, compressed-tensors, "
                        "hqq, or auto-detect per layer) without re-quantizing; --bits/--group-size "
                        "then come from the checkpoint. 'gguf': one llama.cpp FILE.gguf (Q8_0, "
                        "Q4_0, Q4_1 tensors; needs the gguf package); its token embedding and "
                        "the quantized tensors matching --exclude are written dense (dequantized "
                        "to --dtype, default fp16) instead of packed")
    p.add_argument("--hf-names", action="store_true",
                   help="with --from gguf, a Llama file: write Hugging Face tensor names "
                        "(model.layers.N.self_attn.q_proj.weight, ...), q/k rows in Hugging "
                        "Face's order (default: the GGUF names, blk.N.attn_q.weight, ...)")
    p.add_argument("--gptq-format", choices=("gptq", "gptq_v2"), default=None,
                   help="GPTQ zero-point convention (v1 'gptq' stores z-1); default: the "
                        "checkpoint_format of a quantize_config.json/config.json next to IN")
    p.add_argument("--bits", type=int, choices=(8, 4, 2), default=None,
                   help="bits per weight code (required unless --from)")
    p.add_argument("--group-size", type=_group_size_arg, default=None, metavar="N",
                   help="K elements per scale: 32, 64, 128, 256, or 'channel' (one per row); "
                        "required unless --from")
    p.add_argument("--symmetric", action="store_true",
                   help="signed codes without zero points (default: asymmetric, with zeros)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                   help="activation dtype of scales/zeros (default: the weight's dtype if "
                        "bf16/fp16, else bf16)")
    p.add_argument("--include", metavar="REGEX", action="append", default=None, type=_regex_arg,
                   help=f"select names matching REGEX (repeatable; replaces the default "
                        f"{DEFAULT_INCLUDE!r})")
    p.add_argument("--exclude", metavar="REGEX", action="append", default=None, type=_regex_arg,
                   help="skip names matching REGEX (repeatable; added to the default excludes)")
    p.add_argument("--no-default-exclude", action="store_true",
                   help="do not apply the default exclude regex")
    p.set_defaults(func=_run_prepack)


def _check_output(dst: str, inputs: Sequence, force: bool) -> None:
    """Refuse an output path before any work: a missing directory, a directory, one of the
    inputs, or an existing file (unless ``force``)."""
    from pathlib import Path

    dst_dir = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(dst_dir):
        raise CliError(f"cannot write {dst}: directory {dst_dir} does not exist")
    if os.path.isdir(dst):
        raise CliError(f"cannot write {dst}: it is a directory")
    if os.path.exists(dst):
        if any(Path(f).exists() and os.path.samefile(f, dst) for f in inputs):
            raise CliError(f"the output {dst} is the input file; write to another file")
        if not force:
            raise CliError(f"{dst} exists; pass --force to replace it")


def _gptq_checkpoint_format(src) -> Optional[str]:
    """checkpoint_format from a quantize_config.json / config.json beside (or in) the input."""
    import json
    from pathlib import Path

    root = Path(src) if Path(src).is_dir() else Path(src).parent
    for name in ("quantize_config.json", "quant_config.json", "config.json"):
        cfg = root / name
        if cfg.is_file():
            try:
                data = json.loads(cfg.read_text())
            except (OSError, ValueError):
                continue
            qc = data.get("quantization_config", data) if isinstance(data, dict) else {}
            if isinstance(qc, dict) and qc.get("checkpoint_format"):
                return str(qc["checkpoint_format"])
            if isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "gptq":
                return "gptq"   # configs without the field are GPTQ v1
    return None


def _run_prepack_from(args: argparse.Namespace) -> int:
    """`prepack --from FORMAT`: convert a quantized checkpoint (file or shard directory)."""
    from pathlib import Path

    from safetensors.torch import load_file
    from tqdm import tqdm

    from . import formats
    from . import io as mio
    from ._version import __version__

    src, dst = Path(args.input), args.output
    if args.bits is not None or args.group_size is not None or args.symmetric:
        raise UsageError("--bits, --group-size and --symmetric come from the checkpoint with --from")
    if args.from_format == "gguf":
        return _run_prepack_gguf(args)
    if src.is_dir():
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise CliError(f"{src} holds no *.safetensors shard")
    elif src.is_file():
        files = [src]
    else:
        raise CliError(f"{src}: no such file or directory")
    _check_output(dst, files, args.force)
    tensors: dict = {}
    for f in tqdm(files, desc="read shards", unit="file", disable=None):
        try:
            if mio.is_mixgemm_metadata(mio.read_metadata(str(f))):
                raise CliError(f"{f} is already a mixgemm packed file")
            part = load_file(str(f))
        except mio.MixgemmFormatError as e:
            raise CliError(str(e)) from None
        except CliError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CliError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        clash = set(part) & set(tensors)
        if clash:
            raise CliError(f"tensor {sorted(clash)[0]!r} appears in more than one shard")
        tensors.update(part)
    gptq_format = args.gptq_format or _gptq_checkpoint_format(src)
    dtype = {"bf16": "bfloat16", "fp16": "float16", None: None}[args.dtype]
    try:
        out = formats.import_checkpoint(args.from_format, tensors, dtype=dtype,
                                        checkpoint_format=gptq_format, progress=True)
    except (formats.FormatError, ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    packed = [k for k, v in out.items() if hasattr(v, "qdata")]
    if not packed:
        raise CliError(f"no {args.from_format} quantized layer found in {src}")
    out, experts_line = _stack_experts(out)
    before = sum(t.numel() * t.element_size() for t in tensors.values())
    after = sum(v.nbytes if hasattr(v, "qdata") else v.numel() * v.element_size() for v in out.values())
    metadata = {"source": str(src), "source_format": str(args.from_format), "mixgemm_version": __version__}
    if experts_line:
        metadata["prepack.experts"] = experts_line
    try:
        mio.save(dst, out, metadata=metadata)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot write {dst}: {e}") from None
    perms = sum(1 for k in out if k.endswith(".perm"))
    if experts_line:
        print(experts_line)
    print(f"converted {len(packed)} {args.from_format} layers ({perms} with an act-order permutation), "
          f"copied {len(out) - len(packed) - perms} tensors; {_fmt_bytes(before)} -> {_fmt_bytes(after)}; "
          f"wrote {dst}")
    return 0


def _stack_experts(out: dict) -> tuple[dict, str]:
    """Per-expert packed weights stacked (:func:`mixgemm.moe_checkpoint.stack_experts`), and the
    metadata line describing them ("" when there are none); a bad expert set is a CliError."""
    from .moe_checkpoint import describe_stacked, stack_experts

    try:
        out = stack_experts(out)
    except ValueError as e:
        raise CliError(f"cannot stack the experts: {e}") from None
    return out, describe_stacked(out)


def _run_prepack_gguf(args: argparse.Namespace) -> int:
    """`prepack --from gguf FILE.gguf`: import a llama.cpp file's Q8_0/Q4_0/Q4_1 tensors."""
    from collections import Counter
    from pathlib import Path

    from . import formats
    from . import io as mio
    from ._version import __version__
    from .layout import prepack
    from .types import QuantizedWeight

    src, dst = Path(args.input), args.output
    if src.is_dir():
        raise CliError(f"{src} is a directory: --from gguf reads one .gguf file")
    if not src.is_file():
        raise CliError(f"{src}: no such file or directory")
    _check_output(dst, [src], args.force)
    dense = ([] if args.no_default_exclude else [formats.gguf.EMBEDDING_TENSORS]) + \
        [r.pattern for r in args.exclude or []]
    try:
        tensors = formats.from_gguf(src, args.dtype, dense="|".join(f"(?:{d})" for d in dense) or None,
                                    hf_names=args.hf_names, progress=True)
        out = {name: prepack(v) if isinstance(v, QuantizedWeight) else v for name, v in tensors.items()}
    except ImportError as e:
        raise CliError(str(e)) from None
    except (formats.FormatError, ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    kinds = Counter(v.weight_type.value + (" with float zero offsets" if v.zero_offsets is not None else "")
                    for v in out.values() if hasattr(v, "qdata"))
    if not kinds:
        raise CliError(f"no Q8_0, Q4_0 or Q4_1 tensor to pack in {src} (all dense or plain)")
    after = sum(v.nbytes if hasattr(v, "qdata") else v.numel() * v.element_size() for v in out.values())
    try:
        mio.save(dst, out, metadata={"source": str(src), "source_format": "gguf",
                                     "mixgemm_version": __version__})
    except (OSError, ValueError) as e:
        raise CliError(f"cannot write {dst}: {e}") from None
    packed = sum(kinds.values())
    print(f"converted {packed} gguf tensors ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
          f"copied {len(out) - packed} tensors; {_fmt_bytes(src.stat().st_size)} -> {_fmt_bytes(after)}; "
          f"wrote {dst}")
    return 0


def _run_prepack(args: argparse.Namespace) -> int:
    if args.hf_names and args.from_format != "gguf":
        raise UsageError("--hf-names goes with --from gguf")
    if args.from_format is not None:
        return _run_prepack_from(args)
    if args.bits is None or args.group_size is None:
        raise UsageError("--bits and --group-size are required (unless --from converts a quantized checkpoint)")
    from safetensors import safe_open
    from tqdm import tqdm

    from . import io as mio
    from ._version import __version__
    from .layout import ATOM_K, ATOM_N, prepack
    from .quantize import quantize
    from .types import check_group_size

    src, dst = args.input, args.output
    include = args.include or [re.compile(DEFAULT_INCLUDE)]
    exclude = ([] if args.no_default_exclude else [re.compile(DEFAULT_EXCLUDE)]) + (args.exclude or [])

    # -- the input: a valid, plain (not yet packed) safetensors file
    try:
        metadata = mio.read_metadata(src)
        if mio.is_mixgemm_metadata(metadata):
            packed_names = mio.check_metadata(metadata, src)  # refuses files from the future
            raise CliError(f"{src} is already a mixgemm packed file ({len(packed_names)} packed "
                           f"weights); prepack reads an unquantized checkpoint")
    except mio.MixgemmFormatError as e:
        raise CliError(str(e)) from None

    # -- the output
    _check_output(dst, [src], args.force)

    # -- plan and validate every tensor before quantizing or writing anything
    with safe_open(src, framework="pt", device="cpu") as f:
        names = list(f.keys())
        selected = {}  # name -> group size
        problems = []
        for name in names:
            sl = f.get_slice(name)
            shape, dtype = list(sl.get_shape()), sl.get_dtype()
            if not (any(r.search(name) for r in include) and not any(r.search(name) for r in exclude)):
                continue
            if len(shape) != 2 or dtype not in _FLOAT_DTYPES:
                continue
            n, k = shape
            group_size = k if args.group_size == "channel" else args.group_size
            reasons = []
            if n == 0 or k == 0:
                reasons.append("it is empty")
            if n % ATOM_N:
                reasons.append(f"N={n} is not a multiple of {ATOM_N}")
            if k % ATOM_K:
                reasons.append(f"K={k} is not a multiple of {ATOM_K}")
            try:
                check_group_size(group_size, k)
            except ValueError as e:
                reasons.append(str(e))
            clashes = [f"{name}.{part}" for part in ("qdata", "scales", "zeros")
                       if f"{name}.{part}" in names]
            if clashes:
                reasons.append(f"its packed form would clash with the tensor {clashes[0]!r}")
            if reasons:
                problems.append(f"{name} [N={n}, K={k}] {dtype}: " + "; ".join(reasons))
            else:
                selected[name] = group_size
        if problems:
            first = problems[0].split(" ", 1)[0]
            hint = ""
            if any("group_size" in p for p in problems):
                hint = " (or choose a --group-size that divides every K, or 'channel')"
            shown = problems[:_MAX_PROBLEMS] + ([f"and {len(problems) - _MAX_PROBLEMS} more"]
                                                if len(problems) > _MAX_PROBLEMS else [])
            raise CliError(
                f"cannot prepack {len(problems)} selected tensor(s) of {src}: " + " | ".join(shown)
                + f"; skip a tensor with --exclude, e.g. --exclude '^{re.escape(first)}$'{hint}")
        if not selected:
            raise CliError(
                f"no tensor of {src} ({len(names)} tensors) is selected: prepack quantizes 2-D "
                f"floating-point tensors whose name matches --include "
                f"{[r.pattern for r in include]} and no --exclude {[r.pattern for r in exclude]}")

        # -- quantize + prepack, copy the rest
        out = {}
        bytes_before = bytes_after = packed_before = packed_after = 0
        for name in tqdm(names, desc="prepack", unit="tensor", disable=None, file=sys.stderr):
            try:
                tensor = f.get_tensor(name)
            except Exception as e:
                raise CliError(f"{src}: cannot read tensor {name!r} (corrupt file?): {e}") from None
            size = tensor.numel() * tensor.element_size()
            bytes_before += size
            if name in selected:
                try:
                    qw = quantize(tensor, args.bits, selected[name], symmetric=args.symmetric,
                                  dtype=args.dtype)
                    packed = prepack(qw)
                except (TypeError, ValueError) as e:
                    raise CliError(f"cannot quantize {name}: {e}; skip it with --exclude "
                                   f"'^{re.escape(name)}$'") from None
                out[name] = packed
                packed_before += size
                packed_after += packed.nbytes
                bytes_after += packed.nbytes
            else:
                out[name] = tensor
                bytes_after += size

    out, experts_line = _stack_experts(out)
    out_metadata = {key: value for key, value in metadata.items()}
    if experts_line:
        out_metadata["prepack.experts"] = experts_line
    out_metadata.update({
        "prepack.source": os.path.basename(src),
        "prepack.bits": str(args.bits),
        "prepack.group_size": str(args.group_size),
        "prepack.symmetric": str(args.symmetric).lower(),
        "prepack.dtype": args.dtype or "auto",
        "prepack.include": " | ".join(r.pattern for r in include),
        "prepack.exclude": " | ".join(r.pattern for r in exclude),
        "prepack.tool": f"mixgemm {__version__}",
    })
    try:
        mio.save(dst, out, metadata=out_metadata)
    except (OSError, ValueError, TypeError) as e:
        raise CliError(f"cannot write {dst}: {e}") from None

    n_packed = len(selected)
    n_copied = len(names) - n_packed
    print(f"wrote {dst}")
    if experts_line:
        print(experts_line)
    print(f"tensors: {n_packed} packed ({args.bits}-bit, group size {args.group_size}, "
          f"{'symmetric' if args.symmetric else 'asymmetric'}), {n_copied} copied unchanged")
    print(f"packed tensors: {_fmt_bytes(packed_before)} -> {_fmt_bytes(packed_after)} "
          f"({packed_before / max(packed_after, 1):.2f}x smaller)")
    print(f"total: {_fmt_bytes(bytes_before)} -> {_fmt_bytes(bytes_after)} "
          f"(ratio {bytes_after / max(bytes_before, 1):.3f})")
    return 0


# ------------------------------------------------------------------------------------- demo

#: Printed (last) by the demo without a Hopper GPU (mixgemm.demo.NO_GPU_MESSAGE).
NO_GPU_MESSAGE = "the GEMM needs an NVIDIA Hopper (sm_90) GPU; none found, skipping it"


def _add_demo(subparsers) -> None:
    from . import demo

    p = subparsers.add_parser(
        "demo",
        help="quantize + prepack an example layer, and run the GEMM if a Hopper GPU is present",
        description=(f"Quantize and prepack a built-in example layer (seeded random "
                     f"{demo.N}x{demo.K} bf16 weight), report sizes and errors and check the "
                     f"unpack(prepack) round trip; on an sm_90 GPU, also run mixgemm.gemm and "
                     f"compare it with a float reference. The first run on a GPU compiles the "
                     f"GEMM kernel ({demo.COMPILE_TIME_HINT}; cached)."),
    )
    p.add_argument("--bits", type=int, choices=(8, 4, 2), default=4, help="bits per code (default 4)")
    p.add_argument("--group-size", type=_group_size_arg, default=128, metavar="N",
                   help="32, 64, 128 (default), 256 or 'channel'")
    p.add_argument("--symmetric", action="store_true",
                   help="signed codes without zero points (default: asymmetric)")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(args.bits, args.group_size, args.symmetric)


# ------------------------------------------------------------------------------------- doctor

def _add_doctor(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="say whether this machine can run mixgemm's GPU kernels, and what to fix if not",
        description=("Check the package and its headers, CUTLASS, nvcc (>= 12.4), the GPU (sm_90), "
                     "cuda-bindings and the kernel cache; then build (or load) and run one tiny "
                     "kernel on the GPU, with its time. Exit status 0 when the GEMM path works, 1 "
                     "when it cannot (each problem comes with the next step)."),
    )
    p.add_argument("--no-kernel", action="store_true",
                   help="do not build or run the tiny kernel (only inspect the machine)")
    p.set_defaults(func=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    report = doctor.diagnose(run_kernel=not args.no_kernel)
    print(report.format(verbose=args.debug))
    return EXIT_OK if report.gemm_ok else EXIT_ERROR


# ------------------------------------------------------------------------------------- generate

def _add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="emit the CUTLASS kernel instantiations (one .cu per kernel) and optionally build them",
        description=("Emit one CUTLASS sm90a instantiation per kernel spec (the whole kernel matrix: "
                     "bf16/fp16 x int8/int4/int2 x symmetric/asymmetric x every tile config, plus "
                     "the GPU dequantizers and the grouped MoE decode kernels, named mixgemm_gdecode_*). With --build, compile them with nvcc into mixgemm's "
                     "kernel cache ($MIXGEMM_CACHE_DIR or ~/.cache/mixgemm), in parallel, and the "
                     "compiled launcher (the host library that launches them)."),
    )
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write the .cu files here (default: don't write sources unless --build is not given, "
                        "then ./mixgemm_kernels)")
    p.add_argument("--kernels", metavar="REGEX", default=None, type=_regex_arg,
                   help="only kernels whose name matches REGEX")
    p.add_argument("--list", action="store_true", help="print the kernel names and exit")
    p.add_argument("--build", action="store_true", help="compile into the kernel cache (ahead of time)")
    p.add_argument("--jobs", "-j", type=_positive_int, default=None, metavar="N",
                   help="parallel nvcc builds (default: half the CPU cores; each needs ~5 GB of memory)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    from .cli_kernels import add_generate_for
    add_generate_for(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import os
    import tempfile
    from pathlib import Path

    from . import codegen

    if args.for_path is None and (args.max_tokens is not None or args.dtype is not None or args.no_fuse_gate_up):
        raise UsageError("--max-tokens, --dtype and --no-fuse-gate-up go with --for")
    if args.for_path is not None:
        from .cli_kernels import model_specs
        specs = model_specs(args)
    else:
        specs = codegen.default_specs()
    if args.kernels:
        specs = [s for s in specs if args.kernels.search(s.name)]
        if not specs:
            raise CliError(f"no kernel name matches {args.kernels.pattern!r}")
    if args.list:
        for s in specs:
            print(s.name)
        return 0
    out = args.out if args.out is not None else (None if args.build else "mixgemm_kernels")
    if out is not None:
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        for s in specs:
            fd, tmp = tempfile.mkstemp(prefix=f".{s.name}.", suffix=".tmp", dir=out_dir)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(codegen.render(s))
                os.replace(tmp, out_dir / f"{s.name}.cu")
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        print(f"wrote {len(specs)} kernel sources to {out_dir}/")
    if args.build:
        from . import build
        try:
            arts = build.build_many(specs, jobs=args.jobs, force=args.force, progress=True)
        except build.BuildError as e:
            raise CliError(str(e)) from None
        print(f"built {len(arts)} kernels into {build.cache_dir()}")
        from . import launcher
        try:
            path = launcher.build_compiled()
        except build.BuildError as e:
            raise CliError(f"the kernels are built, but not the compiled launcher: {e}") from None
        print(f"built the compiled launcher: {path}")
    return 0


# ------------------------------------------------------------------------------------- cache

def _add_cache(subparsers) -> None:
    from .cli_kernels import add_cache
    add_cache(subparsers)


# ------------------------------------------------------------------------------------- bench

def _add_bench(subparsers) -> None:
    from . import bench

    p = subparsers.add_parser(
        "bench",
        help="time mixgemm against cuBLAS and the peers (torch int4, gemlite) on the GPU",
        description=("Time, in one process on one GPU and the same inputs, cuBLAS bf16, torch's int4 "
                     "kernel, gemlite (if installed) and mixgemm for every weight type, over LLaMA-3 "
                     "layer shapes and token counts: CUDA events, median of >= 100 runs, L2 flushed. "
                     "See benchmarks/README.md."),
    )
    bench.add_arguments(p)
    p.set_defaults(func=bench.run_cli)


# ------------------------------------------------------------------------------------- main

#: name -> builder(subparsers): adds the subcommand's parser and sets ``func``.
#: Read-only; add new subcommands here.
SUBCOMMANDS: "MappingProxyType[str, Callable]" = MappingProxyType({
    "prepack": _add_prepack,
    "demo": _add_demo,
    "generate": _add_generate,
    "bench": _add_bench,
    "doctor": _add_doctor,
    "cache": _add_cache,
})


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line: ``mixgemm <command>: error: <what> (see
    `mixgemm <command> --help`)``, exit status 2. (Subparsers are made of the same class.)"""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``mixgemm`` argument parser, with every subcommand of :data:`SUBCOMMANDS`."""
    from ._version import __version__

    parser = _Parser(
        prog=PROG,
        description="mixgemm: mixed-input (bf16/fp16 x int8/int4/int2) GEMMs for NVIDIA Hopper.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print the whole message and the traceback")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for builder in SUBCOMMANDS.values():
        builder(subparsers)
    parser.set_defaults(_subparsers=dict(subparsers.choices))
    return parser


def _report_error(command: str, e: BaseException, debug: bool, bug: bool = False) -> None:
    """One line on stderr (the message's first line); everything with ``debug``."""
    text = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and not isinstance(e, MixgemmError) and e.filename is not None:
        text = f"{e.filename}: {e.strerror or text}"
    first, more = text.splitlines()[0], len(text.splitlines()) > 1
    if debug:
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        if more:   # the whole message, also when the traceback shows only a wrapper's
            print(text, file=sys.stderr)
    if bug:
        line = (f"{PROG} {command}: internal error: {type(e).__name__}: {first} (a bug in mixgemm: "
                f"`{PROG} --debug {command} ...` prints the traceback; please report it)")
    else:
        line = f"{PROG} {command}: error: {first}"
        if more and not debug:
            line += f" (`{PROG} --debug {command} ...` prints the whole message)"
    print(line, file=sys.stderr)


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so that the interpreter's final flush
    does not fail again (Python's documented recipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``mixgemm`` command line.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; default ``sys.argv[1:]``.

    Returns
    -------
    int
        Exit status: 0 on success, 1 on a reported error, 2 on a usage error, 130 when
        interrupted, 141 when stdout was closed early (a broken pipe: nothing is printed).
    """
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if getattr(args, "func", None) is None:
            parser.error(f"a command is required: {', '.join(SUBCOMMANDS)}")
        if extra:   # reported by the subcommand's parser, which names the command
            args._subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # usage errors (2), --help / --version (0)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    command, debug = args.command, args.debug
    try:
        rc = int(args.func(args))
        sys.stdout.flush()       # a broken pipe shows here, not at exit
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        if debug:
            import traceback
            traceback.print_exc()
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as e:
        _report_error(command, e, debug)
        return EXIT_USAGE
    except (MixgemmError, OSError, MemoryError) as e:
        _report_error(command, e, debug)
        return EXIT_ERROR
    except Exception as e:
        _report_error(command, e, debug, bug=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
