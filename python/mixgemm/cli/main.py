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
import sys
import traceback
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Optional, Sequence

from .._version import __version__
from ..errors import CliError, MixgemmError, UsageError
from ..utils.atomic import check_target, replacing
from . import kernels, prepack
from .args import (EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, PROG, group_size_arg,
                   positive_int, regex_arg)
from .kernels import add_cache, add_generate_for
from .prepack import add_prepack

# ---------------------------------------------------------------------------------- prepack

def _add_prepack(subparsers) -> None:
    add_prepack(subparsers)


# ------------------------------------------------------------------------------------- demo

#: Printed (last) by the demo without a Hopper GPU (mixgemm.cli.demo.NO_GPU_MESSAGE).
NO_GPU_MESSAGE = "the GEMM needs an NVIDIA Hopper (sm_90) GPU; none found, skipping it"


def _add_demo(subparsers) -> None:
    from . import demo   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

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
    p.add_argument("--group-size", type=group_size_arg, default=128, metavar="N",
                   help="32, 64, 128 (default), 256 or 'channel'")
    p.add_argument("--symmetric", action="store_true",
                   help="signed codes without zero points (default: asymmetric)")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from . import demo   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

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
    from . import doctor   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

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
    p.add_argument("--kernels", metavar="REGEX", default=None, type=regex_arg,
                   help="only kernels whose name matches REGEX")
    p.add_argument("--list", action="store_true", help="print the kernel names and exit")
    p.add_argument("--build", action="store_true", help="compile into the kernel cache (ahead of time)")
    p.add_argument("--jobs", "-j", type=positive_int, default=None, metavar="N",
                   help="parallel nvcc builds (default: half the CPU cores; each needs ~5 GB of memory)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    add_generate_for(p)
    p.set_defaults(func=_run_generate)


def _write_sources(out: str, specs: Sequence) -> None:
    """``generate --out DIR``: one ``<name>.cu`` per spec in DIR (made if missing), each written
    atomically; every target is checked before the first is written (a source that exists as a
    regular file is replaced, anything else there is refused)."""
    from ..jit.render import render   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

    if not out:
        raise CliError("cannot write kernel sources to '': the --out directory is empty")
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(f"cannot write kernel sources to {out}: it exists and is not a directory")
    up = out_dir.absolute()
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise CliError(f"cannot make the directory {out}: {up} is a file, not a directory")
    if out_dir.is_dir():
        for s in specs:
            check_target(out_dir / f"{s.name}.cu")
    out_dir.mkdir(parents=True, exist_ok=True)
    for s in specs:
        with replacing(out_dir / f"{s.name}.cu") as tmp, open(tmp, "w") as f:
            f.write(render(s))
    print(f"wrote {len(specs)} kernel sources to {out_dir}/")


def _run_generate(args: argparse.Namespace) -> int:
    from ..jit import catalog   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

    if args.for_path is None and (args.max_tokens is not None or args.dtype is not None or args.no_fuse_gate_up
                                  or args.no_fuse_norms):
        raise UsageError("--max-tokens, --dtype, --no-fuse-gate-up and --no-fuse-norms go with --for")
    if args.for_path is not None:
        from .kernels import model_specs   # deferred: loads torch: only when the command runs
        specs = model_specs(args)
    else:
        specs = catalog.default_specs()
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
        _write_sources(out, specs)
    if args.build:
        from ..jit import build   # deferred: loads torch: only when the command runs
        try:
            arts = build.build_many(specs, jobs=args.jobs, force=args.force, progress=True)
        except build.BuildError as e:
            raise CliError(str(e)) from None
        print(f"built {len(arts)} kernels into {build.cache_dir()}")
        from ..jit import launcher   # deferred: loads torch: only when the command runs
        try:
            path = launcher.build_compiled()
        except build.BuildError as e:
            raise CliError(f"the kernels are built, but not the compiled launcher: {e}") from None
        print(f"built the compiled launcher: {path}")
        from ..jit import torch_ops   # deferred: loads torch: only when the command runs
        if torch_ops.mode() != "python" and not torch_ops.available():
            try:
                print(f"built the torch operator library: {torch_ops.build()}")
            except build.BuildError as e:
                raise CliError(f"the kernels are built, but not the torch operator library: {e}") from None
    return 0


# ------------------------------------------------------------------------------------- cache

def _add_cache(subparsers) -> None:
    add_cache(subparsers)


# ------------------------------------------------------------------------------------- bench

def _add_bench(subparsers) -> None:
    from .. import bench   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

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


class _WatchedStdout:
    """``sys.stdout`` while a command runs, passing everything through, that remembers the error
    of a write or flush that failed (a full disk behind ``> FILE``, ``> /dev/full``): such an
    error is the report's, not the command's."""

    def __init__(self, stream):
        self._stream = stream
        self.failed: Optional[OSError] = None

    def _watch(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            self.failed = e
            raise

    def write(self, text):
        return self._watch(self._stream.write, text)

    def writelines(self, lines):
        return self._watch(self._stream.writelines, lines)

    def flush(self):
        return self._watch(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


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
    watched = sys.stdout = _WatchedStdout(sys.stdout)
    try:
        return _run(args, command, debug, watched)
    finally:
        if sys.stdout is watched:
            sys.stdout = watched._stream


def _run(args: argparse.Namespace, command: str, debug: bool, watched: _WatchedStdout) -> int:
    rc = None
    try:
        rc = int(args.func(args))
        sys.stdout.flush()       # a broken pipe shows here, not at exit
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as e:
        _report_error(command, e, debug)
        return EXIT_USAGE
    except OSError as e:
        if e is watched.failed:
            _silence_stdout()
            done = ("the command itself finished; only its report is lost" if rc == EXIT_OK else
                    "the command stopped there; any file it wrote before is complete")
            print(f"{PROG} {command}: error: cannot write to stdout: {e.strerror or e} ({done})", file=sys.stderr)
            return EXIT_ERROR
        _report_error(command, e, debug)
        return EXIT_ERROR
    except (MixgemmError, MemoryError) as e:
        _report_error(command, e, debug)
        return EXIT_ERROR
    except Exception as e:
        _report_error(command, e, debug, bug=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
