"""``mixgemm prepack``: quantize and prepack a safetensors checkpoint's linear weights, or import
a quantized checkpoint (``--from awq|gptq|compressed-tensors|hqq|gguf``), into a mixgemm file.
Part of the command line (:mod:`mixgemm.cli.main` registers it); the package never imports it."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional, Sequence

from .._version import __version__
from ..errors import CliError, OutputPathError, OverflowQuantizeError, UsageError
from ..utils.atomic import check_target
from .args import fmt_bytes, group_size_arg, regex_arg

#: Tensors prepack quantizes by default: names ending in ``.weight``...
DEFAULT_INCLUDE = r"\.weight$"
#: ...except embeddings, norms and the LM head (matched with ``re.search`` on the name).
DEFAULT_EXCLUDE = r"embed|(^|\.)(wte|wpe)\.|lm_head|(^|\.)output\.weight$|norm|(^|\.)ln_"

#: safetensors dtypes of the tensors prepack can quantize.
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
#: Tensors a refusal names (in its one line); the rest are counted.
_MAX_PROBLEMS = 8


def add_prepack(subparsers) -> None:
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
                   help="convert an already quantized checkpoint (awq, gptq, compressed-tensors "
                        "pack-quantized or int-quantized, hqq, or auto-detect per layer) without "
                        "re-quantizing; --bits/--group-size then come from the checkpoint (and, for "
                        "compressed-tensors, the quantization_config of a config.json next to it); "
                        "a layer's input_scale is copied as a plain tensor. 'gguf': one llama.cpp "
                        "FILE.gguf (Q8_0, Q4_0, Q4_1 tensors; needs the gguf package); its token embedding and "
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
                   help="bits per weight code (required unless --from); with --from compressed-tensors "
                        "or auto, the width of int-quantized layers' int8 codes where no config.json "
                        "next to the checkpoint gives their num_bits (checked against every layer, "
                        "and refused where the config gives another)")
    p.add_argument("--group-size", type=group_size_arg, default=None, metavar="N",
                   help="K elements per scale: 32, 64, 128, 256, or 'channel' (one per row); "
                        "required unless --from")
    p.add_argument("--symmetric", action="store_true",
                   help="signed codes without zero points (default: asymmetric, with zeros)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                   help="activation dtype of scales/zeros (default: the weight's dtype if "
                        "bf16/fp16, else bf16)")
    p.add_argument("--include", metavar="REGEX", action="append", default=None, type=regex_arg,
                   help=f"select names matching REGEX (repeatable; replaces the default "
                        f"{DEFAULT_INCLUDE!r})")
    p.add_argument("--exclude", metavar="REGEX", action="append", default=None, type=regex_arg,
                   help="skip names matching REGEX (repeatable; added to the default excludes)")
    p.add_argument("--no-default-exclude", action="store_true",
                   help="do not apply the default exclude regex")
    p.set_defaults(func=_run_prepack)


def _check_output(dst: str, inputs: Sequence, force: bool) -> None:
    """Refuse an output path before any work (:func:`mixgemm.utils.atomic.check_target`: an empty path,
    a missing directory, a directory, a device node or FIFO, an existing file without ``force``),
    and one of the inputs."""

    if dst and os.path.exists(dst) and any(Path(f).exists() and os.path.samefile(f, dst) for f in inputs):
        raise CliError(f"the output {dst} is the input file; write to another file")
    check_target(dst, replace=force)


def _refuse_gguf(path, remedy: str) -> None:
    """A llama.cpp GGUF file given where safetensors is read: say so, with the option that reads it."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError:
        return                  # the safetensors reader reports it
    if magic == b"GGUF":
        raise CliError(f"{path} is a GGUF file, not safetensors; convert it with {remedy}")


def _quantization_configs(src, names: Sequence[str]) -> Iterator[tuple[Path, dict]]:
    """``(file, quantization_config)`` of each of ``names`` beside (or in) the input that holds
    one (its ``quantization_config``, or the file itself), in that order; unreadable files are
    skipped."""
    root = Path(src) if Path(src).is_dir() else Path(src).parent
    for name in names:
        cfg = root / name
        if not cfg.is_file():
            continue
        try:
            data = json.loads(cfg.read_text())
        except (OSError, ValueError):
            continue
        qc = data.get("quantization_config", data) if isinstance(data, dict) else None
        if isinstance(qc, dict):
            yield cfg, qc


def _gptq_checkpoint_format(src) -> Optional[str]:
    """checkpoint_format from a quantize_config.json / config.json beside (or in) the input."""
    for _, qc in _quantization_configs(src, ("quantize_config.json", "quant_config.json", "config.json")):
        if qc.get("checkpoint_format"):
            return str(qc["checkpoint_format"])
        if str(qc.get("quant_method", "")).lower() == "gptq":
            return "gptq"   # configs without the field are GPTQ v1
    return None


def _compressed_tensors_config(src):
    """The compressed-tensors ``quantization_config`` of a config.json / quantize_config.json
    beside (or in) the input, parsed (:func:`mixgemm.formats.config.parse_quantization_config`,
    without its warnings about ``from_pretrained``'s activations); None when none is
    compressed-tensors'. One the parser refuses is a CliError naming the file."""
    from ..formats.config import parse_quantization_config   # deferred: loads torch: only when the command runs

    for cfg, qc in _quantization_configs(src, ("config.json", "quantize_config.json", "quant_config.json")):
        if str(qc.get("quant_method", "")).lower().replace("_", "-") != "compressed-tensors":
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return parse_quantization_config(qc, str(cfg))
        except ValueError as e:
            raise CliError(str(e)) from None
    return None


def _run_prepack_from(args: argparse.Namespace) -> int:
    """`prepack --from FORMAT`: convert a quantized checkpoint (file or shard directory)."""
    from safetensors.torch import load_file   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)
    from tqdm import tqdm   # deferred: loaded only when a progress bar is shown

    from .. import formats   # deferred: loads torch: only when the command runs
    from ..weights import io as mio   # deferred: loads torch: only when the command runs

    src, dst = Path(args.input), args.output
    takes_bits = args.from_format in ("compressed-tensors", "auto")
    if (args.bits is not None and not takes_bits) or args.group_size is not None or args.symmetric:
        raise UsageError("--bits, --group-size and --symmetric come from the checkpoint with --from (--from "
                         "compressed-tensors and auto take --bits: the width of int-quantized layers' int8 codes)")
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
    qconfig = _compressed_tensors_config(src) if takes_bits else None
    tensors: dict = {}
    for f in files:
        _refuse_gguf(f, "--from gguf instead")
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
        out = formats.import_checkpoint(args.from_format, tensors, dtype=dtype, bits=args.bits,
                                        checkpoint_format=gptq_format, progress=True,
                                        quantization_config=qconfig)
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
    except OutputPathError:
        raise
    except (OSError, ValueError) as e:
        raise CliError(f"cannot write {dst}: {e}") from None
    perms = sum(1 for k in out if k.endswith(".perm"))
    if experts_line:
        print(experts_line)
    print(f"converted {len(packed)} {args.from_format} layers ({perms} with an act-order permutation), "
          f"copied {len(out) - len(packed) - perms} tensors; {fmt_bytes(before)} -> {fmt_bytes(after)}; "
          f"wrote {dst}")
    return 0


def _stack_experts(out: dict) -> tuple[dict, str]:
    """Per-expert packed weights stacked (:func:`mixgemm.weights.stacking.stack_experts`), and the
    metadata line describing them ("" when there are none); a bad expert set is a CliError."""
    from ..weights.stacking import describe_stacked, stack_experts   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

    try:
        out = stack_experts(out)
    except ValueError as e:
        raise CliError(f"cannot stack the experts: {e}") from None
    return out, describe_stacked(out)


def _run_prepack_gguf(args: argparse.Namespace) -> int:
    """`prepack --from gguf FILE.gguf`: import a llama.cpp file's Q8_0/Q4_0/Q4_1 tensors."""

    from .. import formats   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)
    from ..weights import io as mio   # deferred: loads torch: only when the command runs
    from ..weights.layout import prepack   # deferred: loads torch: only when the command runs
    from ..weights.types import QuantizedWeight   # deferred: loads torch: only when the command runs

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
    except OutputPathError:
        raise
    except (OSError, ValueError) as e:
        raise CliError(f"cannot write {dst}: {e}") from None
    packed = sum(kinds.values())
    print(f"converted {packed} gguf tensors ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
          f"copied {len(out) - packed} tensors; {fmt_bytes(src.stat().st_size)} -> {fmt_bytes(after)}; "
          f"wrote {dst}")
    return 0


def _run_prepack(args: argparse.Namespace) -> int:
    if args.hf_names and args.from_format != "gguf":
        raise UsageError("--hf-names goes with --from gguf")
    if args.from_format is not None:
        return _run_prepack_from(args)
    if args.bits is None or args.group_size is None:
        raise UsageError("--bits and --group-size are required (unless --from converts a quantized checkpoint)")
    import torch   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)
    from safetensors import safe_open   # deferred: with torch, as above
    from tqdm import tqdm   # deferred: loaded only when a progress bar is shown

    from ..weights import io as mio   # deferred: loads torch: only when the command runs
    from ..weights.layout import ATOM_K, ATOM_N, prepack   # deferred: loads torch: only when the command runs
    from ..weights.quantize import quantize   # deferred: loads torch: only when the command runs
    from ..weights.types import check_group_size   # deferred: loads torch: only when the command runs

    src, dst = args.input, args.output
    include = args.include or [re.compile(DEFAULT_INCLUDE)]
    exclude = ([] if args.no_default_exclude else [re.compile(DEFAULT_EXCLUDE)]) + (args.exclude or [])

    # -- the input: a valid, plain (not yet packed) safetensors file
    _refuse_gguf(src, "--from gguf")
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
            if len(shape) == 2 and dtype.startswith("F8"):
                problems.append(f"{name} [N={shape[0]}, K={shape[1]}] {dtype}: an fp8 weight, whose values need the "
                                f"checkpoint's scale, which prepack does not apply")
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
                except OverflowQuantizeError as e:
                    act = "fp16" if e.act == torch.float16 else "bf16"
                    fix = ("pass --dtype bf16 (bf16 has fp32's range)" if act == "fp16"
                           else "no activation dtype holds these values")
                    raise CliError(f"cannot quantize {name}: the {e.what} overflow {act} (|w| up to {e.peak:.6g}); "
                                   f"{fix}, or skip it with --exclude '^{re.escape(name)}$'") from None
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
    except OutputPathError:
        raise
    except (OSError, ValueError, TypeError) as e:
        raise CliError(f"cannot write {dst}: {e}") from None

    n_packed = len(selected)
    n_copied = len(names) - n_packed
    print(f"wrote {dst}")
    if experts_line:
        print(experts_line)
    print(f"tensors: {n_packed} packed ({args.bits}-bit, group size {args.group_size}, "
          f"{'symmetric' if args.symmetric else 'asymmetric'}), {n_copied} copied unchanged")
    print(f"packed tensors: {fmt_bytes(packed_before)} -> {fmt_bytes(packed_after)} "
          f"({packed_before / max(packed_after, 1):.2f}x smaller)")
    print(f"total: {fmt_bytes(bytes_before)} -> {fmt_bytes(bytes_after)} "
          f"(ratio {bytes_after / max(bytes_before, 1):.3f})")
    return 0


