"""The ``mixgemm`` command line.

Subcommands are registered in :data:`SUBCOMMANDS`: each entry maps a name to a builder
function that adds its parser to the ``argparse`` subparsers and sets ``func`` (the function
that runs it: ``func(args) -> int`` exit status). To add a subcommand, write a
``_add_<name>(subparsers)`` builder and a ``_run_<name>(args)`` runner and add the builder to
:data:`SUBCOMMANDS`. Runners report user errors by raising :class:`CliError`; :func:`main`
prints them on stderr and returns 1.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from types import MappingProxyType
from typing import Callable, List, Optional, Sequence

from .errors import CliError

PROG = "mixgemm"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} B)"
    return f"{n:,} B"


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


# ---------------------------------------------------------------------------------- prepack

#: Tensors prepack quantizes by default: names ending in ``.weight``...
DEFAULT_INCLUDE = r"\.weight$"
#: ...except embeddings, norms and the LM head (matched with ``re.search`` on the name).
DEFAULT_EXCLUDE = r"embed|(^|\.)(wte|wpe)\.|lm_head|(^|\.)output\.weight$|norm|(^|\.)ln_"

#: safetensors dtypes of the tensors prepack can quantize.
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


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
            "group size; prepack checks every tensor before writing anything."),
    )
    p.add_argument("input", metavar="IN.safetensors",
                   help="unquantized checkpoint; with --from, a quantized checkpoint file or a "
                        "directory of *.safetensors shards")
    p.add_argument("-o", "--output", metavar="OUT.safetensors", required=True,
                   help="where to write the packed checkpoint (replaced atomically)")
    p.add_argument("--from", dest="from_format", metavar="FORMAT", default=None,
                   choices=("awq", "gptq", "compressed-tensors", "hqq", "auto"),
                   help="convert an already quantized checkpoint (awq, gptq, compressed-tensors, "
                        "hqq, or auto-detect per layer) without re-quantizing; --bits/--group-size "
                        "then come from the checkpoint")
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
    p.add_argument("--include", metavar="REGEX", action="append", default=None,
                   help=f"select names matching REGEX (repeatable; replaces the default "
                        f"{DEFAULT_INCLUDE!r})")
    p.add_argument("--exclude", metavar="REGEX", action="append", default=None,
                   help="skip names matching REGEX (repeatable; added to the default excludes)")
    p.add_argument("--no-default-exclude", action="store_true",
                   help="do not apply the default exclude regex")
    p.set_defaults(func=_run_prepack)


def _compile(patterns: Sequence[str], option: str) -> List["re.Pattern[str]"]:
    out = []
    for pattern in patterns:
        try:
            out.append(re.compile(pattern))
        except re.error as e:
            raise CliError(f"bad regular expression {pattern!r} for {option}: {e}") from None
    return out


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
        raise CliError("--bits, --group-size and --symmetric come from the checkpoint with --from")
    if src.is_dir():
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise CliError(f"{src} holds no *.safetensors shard")
    elif src.is_file():
        files = [src]
    else:
        raise CliError(f"{src}: no such file or directory")
    if any(Path(dst).resolve() == f.resolve() for f in files):
        raise CliError("the output would overwrite the input")
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
    before = sum(t.numel() * t.element_size() for t in tensors.values())
    after = sum(v.nbytes if hasattr(v, "qdata") else v.numel() * v.element_size() for v in out.values())
    try:
        mio.save(dst, out, metadata={"source": str(src), "source_format": str(args.from_format),
                                     "mixgemm_version": __version__})
    except (OSError, ValueError) as e:
        raise CliError(f"cannot write {dst}: {e}") from None
    perms = sum(1 for k in out if k.endswith(".perm"))
    print(f"converted {len(packed)} {args.from_format} layers ({perms} with an act-order permutation), "
          f"copied {len(out) - len(packed) - perms} tensors; {_fmt_bytes(before)} -> {_fmt_bytes(after)}; "
          f"wrote {dst}")
    return 0


def _run_prepack(args: argparse.Namespace) -> int:
    if args.from_format is not None:
        return _run_prepack_from(args)
    if args.bits is None or args.group_size is None:
        raise CliError("--bits and --group-size are required (unless --from converts a quantized checkpoint)")
    from safetensors import safe_open
    from tqdm import tqdm

    from . import io as mio
    from ._version import __version__
    from .layout import ATOM_K, ATOM_N, prepack
    from .quantize import quantize
    from .types import check_group_size

    src, dst = args.input, args.output
    include = _compile(args.include or [DEFAULT_INCLUDE], "--include")
    exclude = _compile(([] if args.no_default_exclude else [DEFAULT_EXCLUDE])
                       + (args.exclude or []), "--exclude")

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
    dst_dir = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(dst_dir):
        raise CliError(f"cannot write {dst}: directory {dst_dir} does not exist")
    if os.path.isdir(dst):
        raise CliError(f"cannot write {dst}: it is a directory")
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise CliError(f"the output {dst} is the input file; write to another file")

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
            raise CliError(
                f"cannot prepack {len(problems)} selected tensor(s) of {src}:\n  "
                + "\n  ".join(problems)
                + f"\nskip a tensor with --exclude, e.g. --exclude '^{re.escape(first)}$'{hint}")
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
                    raise CliError(f"cannot quantize {name}: {e}\nskip it with --exclude "
                                   f"'^{re.escape(name)}$'") from None
                out[name] = packed
                packed_before += size
                packed_after += packed.nbytes
                bytes_after += packed.nbytes
            else:
                out[name] = tensor
                bytes_after += size

    out_metadata = {key: value for key, value in metadata.items()}
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
    print(f"tensors: {n_packed} packed ({args.bits}-bit, group size {args.group_size}, "
          f"{'symmetric' if args.symmetric else 'asymmetric'}), {n_copied} copied unchanged")
    print(f"packed tensors: {_fmt_bytes(packed_before)} -> {_fmt_bytes(packed_after)} "
          f"({packed_before / max(packed_after, 1):.2f}x smaller)")
    print(f"total: {_fmt_bytes(bytes_before)} -> {_fmt_bytes(bytes_after)} "
          f"(ratio {bytes_after / max(bytes_before, 1):.3f})")
    return 0


# ------------------------------------------------------------------------------------- demo

_DEMO_N = _DEMO_K = 4096
_DEMO_M = 64
_DEMO_SEED = 0
#: The GEMM result is flagged when its relative error exceeds this (fp32 accumulation and a
#: bf16/fp16 output give ~1e-3).
_DEMO_GEMM_RTOL = 2e-2
NO_GPU_MESSAGE = "the GEMM needs an NVIDIA Hopper (sm_90) GPU; none found, skipping it"


def _add_demo(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="quantize + prepack an example layer, and run the GEMM if a Hopper GPU is present",
        description=(f"Quantize and prepack a built-in example layer (seeded random "
                     f"{_DEMO_N}x{_DEMO_K} bf16 weight), report sizes and errors and check the "
                     f"unpack(prepack) round trip; on an sm_90 GPU, also run mixgemm.gemm and "
                     f"compare it with a float reference."),
    )
    p.add_argument("--bits", type=int, choices=(8, 4, 2), default=4, help="bits per code (default 4)")
    p.add_argument("--group-size", type=_group_size_arg, default=128, metavar="N",
                   help="32, 64, 128 (default), 256 or 'channel'")
    p.add_argument("--symmetric", action="store_true",
                   help="signed codes without zero points (default: asymmetric)")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from .layout import prepack, unpack
    from .quantize import dequantize_reference, quantize

    n, k = _DEMO_N, _DEMO_K
    group_size = k if args.group_size == "channel" else args.group_size
    gen = torch.Generator().manual_seed(_DEMO_SEED)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    kind = "symmetric" if args.symmetric else "asymmetric"
    print(f"example layer: weight [N={n}, K={k}] bf16, seeded random (seed {_DEMO_SEED}), "
          f"{_fmt_bytes(w.numel() * w.element_size())}")
    try:
        qw = quantize(w, args.bits, group_size, symmetric=args.symmetric)
    except (TypeError, ValueError) as e:
        raise CliError(str(e)) from None
    print(f"quantized: int{args.bits} {kind} ({qw.weight_type.value}), group size {group_size}, "
          f"round-to-nearest; codes {list(qw.qweight.shape)} {qw.qweight.dtype}, "
          f"scales {list(qw.scales.shape)} {qw.scales.dtype}"
          + ("" if qw.zeros is None else f", zeros {list(qw.zeros.shape)} {qw.zeros.dtype}"))

    packed = prepack(qw)
    before = w.numel() * w.element_size()
    print(f"prepacked for sm90a (layout v{packed.layout_version}): qdata "
          f"{list(packed.qdata.shape)} uint8, scales {list(packed.scales.shape)}"
          + ("" if packed.zeros is None else f", zeros {list(packed.zeros.shape)}"))
    print(f"bytes: {_fmt_bytes(before)} -> {_fmt_bytes(packed.nbytes)} "
          f"({before / packed.nbytes:.2f}x smaller)")

    deq = dequantize_reference(qw)
    err = (w.double() - deq.double()).abs()
    rel = float(err.norm() / w.double().norm())
    bound = (qw.scales.double().repeat_interleave(group_size, dim=1) / 2
             + _half_ulp(deq))
    print(f"quantization error vs the bf16 weight: max |w - deq| = {float(err.max()):.3e}, "
          f"relative (Frobenius) = {rel:.3e}")
    if bool((err <= bound).all()):
        print("error bound |w - deq| <= s/2 + ulp(deq)/2 holds for every element")
    else:
        print("ERROR: the quantization error bound is violated", file=sys.stderr)
        return 1

    back = unpack(packed)
    same = (torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
            and (qw.zeros is None or torch.equal(back.zeros, qw.zeros)))
    if not same:
        print("ERROR: unpack(prepack(q)) differs from q", file=sys.stderr)
        return 1
    print("round trip: unpack(prepack(q)) == q exactly")

    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return _demo_gemm(packed, deq, gen)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"found {torch.cuda.get_device_name()} (sm_{major}{minor}), which is not Hopper")
    print(NO_GPU_MESSAGE)
    return 0


def _half_ulp(x):
    """Half the spacing of ``x``'s dtype at ``x`` (float64 tensor)."""
    import torch

    finfo = torch.finfo(x.dtype)
    _, exponent = torch.frexp(x.double().abs().clamp(min=finfo.tiny))  # x = m * 2^e, m in [.5, 1)
    return torch.ldexp(torch.full_like(x, finfo.eps / 2, dtype=torch.float64), exponent - 1)


def _demo_gemm(packed, deq, gen) -> int:
    import torch

    import mixgemm

    name = torch.cuda.get_device_name()
    gemm = getattr(mixgemm, "gemm", None)
    if gemm is None:
        print(f"found {name} (sm_90), but this build of mixgemm has no mixgemm.gemm; skipping "
              f"the GEMM")
        return 0
    m = _DEMO_M
    print(f"found {name} (sm_90): running the GEMM via mixgemm.gemm(x, packed), "
          f"x [M={m}, K={packed.k}] {deq.dtype}")
    x = torch.randn(m, packed.k, generator=gen).to(deq.dtype).cuda()
    try:
        y = gemm(x, packed.to("cuda"))
        torch.cuda.synchronize()
    except Exception as e:  # report, don't crash the demo
        print(f"ERROR: mixgemm.gemm failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    ref = x.double() @ deq.cuda().double().t()
    diff = (y.double() - ref).abs()
    rel = float(diff.norm() / ref.norm())
    print(f"GEMM result {list(y.shape)} {y.dtype}: max |y - x @ deq^T| = {float(diff.max()):.3e}, "
          f"relative = {rel:.3e} (reference in float64)")
    if not rel <= _DEMO_GEMM_RTOL:
        print(f"ERROR: relative error {rel:.3e} exceeds {_DEMO_GEMM_RTOL}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------- generate

def _add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="emit the CUTLASS kernel instantiations (one .cu per kernel) and optionally build them",
        description=("Emit one CUTLASS sm90a instantiation per kernel spec (the whole kernel matrix: "
                     "bf16/fp16 x int8/int4/int2 x symmetric/asymmetric x every tile config, plus "
                     "the GPU dequantizers). With --build, compile them with nvcc into mixgemm's "
                     "kernel cache ($MIXGEMM_CACHE_DIR or ~/.cache/mixgemm), in parallel, and the "
                     "compiled launcher (the host library that launches them)."),
    )
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write the .cu files here (default: don't write sources unless --build is not given, "
                        "then ./mixgemm_kernels)")
    p.add_argument("--kernels", metavar="REGEX", default=None, help="only kernels whose name matches REGEX")
    p.add_argument("--list", action="store_true", help="print the kernel names and exit")
    p.add_argument("--build", action="store_true", help="compile into the kernel cache (ahead of time)")
    p.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help="parallel nvcc builds (default: half the CPU cores; each needs ~5 GB of memory)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import os
    import tempfile
    from pathlib import Path

    from . import codegen

    specs = codegen.default_specs()
    if args.kernels:
        pattern = _compile([args.kernels], "--kernels")[0]
        specs = [s for s in specs if pattern.search(s.name)]
        if not specs:
            raise CliError(f"no kernel name matches {args.kernels!r}")
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
            with os.fdopen(fd, "w") as f:
                f.write(codegen.render(s))
            os.replace(tmp, out_dir / f"{s.name}.cu")
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
})


def build_parser() -> argparse.ArgumentParser:
    """The ``mixgemm`` argument parser, with every subcommand of :data:`SUBCOMMANDS`."""
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="mixgemm: mixed-input (bf16/fp16 x int8/int4/int2) GEMMs for NVIDIA Hopper.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for builder in SUBCOMMANDS.values():
        builder(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``mixgemm`` command line.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name; default ``sys.argv[1:]``.

    Returns
    -------
    int
        Exit status: 0 on success, 1 on a reported error, 2 on a usage error.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2), --help / --version (0)
        return e.code if isinstance(e.code, int) else 1
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except CliError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
