"""The command line's kernel-cache parts: ``mixgemm generate --for MODEL`` (the kernels of one
model, :mod:`mixgemm.aot.prebuild`) and ``mixgemm cache list / export / import``
(:mod:`mixgemm.jit.cache`). :mod:`mixgemm.cli.main` registers them; the conventions (exit
statuses, one-line errors) are its.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from .args import EXIT_ERROR, EXIT_OK, PROG, fmt_bytes, positive_int, regex_arg


def add_generate_for(p) -> None:
    """``generate --for PATH``: the kernels of one model (mixgemm.aot.prebuild)."""
    g = p.add_argument_group(
        "kernels of one model (--for)",
        "Instead of the whole kernel matrix, exactly the kernels that the quantized layers of a model can select "
        "at any token count (one per layer shape, type and activation and token-count bucket), read from headers "
        "only: a mixgemm file or directory of them, or a Hugging Face model directory whose config.json has a "
        "quantization_config (awq, gptq, compressed-tensors, mixgemm), in the activation dtype mixgemm.hf.from_pretrained "
        "would use. A Llama MLP's gate_proj/up_proj pair counts as one fused swiglu layer where the loader fuses it. "
        "See mixgemm.aot.checkpoint.")
    g.add_argument("--for", dest="for_path", metavar="MODEL", default=None,
                   help="a mixgemm .safetensors file or a model directory")
    g.add_argument("--max-tokens", type=positive_int, default=None, metavar="M",
                   help="the most tokens per call the model will see (default: any number)")
    g.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                   help="activation dtype (default: as from_pretrained: the config's torch_dtype if bf16/fp16, else bf16; "
                        "for mixgemm files without a config, each weight's scales' dtype)")
    g.add_argument("--no-fuse-gate-up", action="store_true",
                   help="count gate_proj and up_proj as two plain layers")
    g.add_argument("--no-fuse-norms", action="store_true",
                   help="leave out the RMSNorm kernel (from_pretrained(fuse_norms=False))")


def model_specs(args: argparse.Namespace) -> list:
    """The kernels of ``--for``'s model (the options that only go with --for are checked here)."""
    from ..aot import checkpoint as checkpoint_weights   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

    uses = checkpoint_weights.weight_uses(args.for_path, dtype=args.dtype, fuse_gate_up=not args.no_fuse_gate_up)
    specs = checkpoint_weights.kernel_specs(args.for_path, dtype=args.dtype, fuse_gate_up=not args.no_fuse_gate_up,
                                            fuse_norms=not args.no_fuse_norms, max_tokens=args.max_tokens)
    if not args.list:
        print(f"{args.for_path}: {len(uses)} quantized layers -> {len(specs)} kernels"
              + (f" (up to {args.max_tokens} tokens per call)" if args.max_tokens else ""), file=sys.stderr)
    return specs


def add_cache(subparsers) -> None:
    p = subparsers.add_parser(
        "cache",
        help="list the kernel cache, or move it between machines (export / import)",
        description=("The kernel cache ($MIXGEMM_CACHE_DIR or ~/.cache/mixgemm) holds every built kernel and the "
                     "compiled launcher, each keyed by what built it. `export FILE` writes the entries this install "
                     "uses to a .tar.gz; `import FILE` checks every entry of one against this install (its key "
                     "must be the one this mixgemm, its headers, nvcc and flags give; its files must match their "
                     "sha256) and refuses stale or foreign entries, one line each; it takes only device code from "
                     "the archive unless --trust-host-code. See mixgemm.jit.cache."),
    )
    actions = p.add_subparsers(dest="cache_action", metavar="ACTION")
    ls = actions.add_parser("list", help="the cache's entries: current, stale, corrupt or foreign, build seconds")
    ls.add_argument("--kernels", metavar="REGEX", default=None, type=regex_arg,
                    help="only entries whose name matches REGEX")
    ex = actions.add_parser("export", help="write the current entries to FILE (a .tar.gz)")
    ex.add_argument("file", metavar="FILE")
    ex.add_argument("--kernels", metavar="REGEX", default=None, type=regex_arg,
                    help="only entries whose name matches REGEX")
    ex.add_argument("--force", action="store_true", help="replace an existing FILE")
    im = actions.add_parser(
        "import", help="check and add the entries of FILE (written by export)",
        description=("Check every entry of FILE against this install and add the valid ones to the kernel cache. "
                     "Only device code (kernel.cubin) is taken from FILE by default: the host libraries that "
                     "run in your process (each GEMM kernel's helper.so, the compiled launcher's launcher.so) "
                     "are compiled here from this install's sources, which needs nvcc and takes a while. With "
                     "--trust-host-code they are taken from FILE as they are: only for an archive you trust as "
                     "much as the code you run."))
    im.add_argument("file", metavar="FILE")
    im.add_argument("--trust-host-code", action="store_true",
                    help="take FILE's host libraries (helper.so, launcher.so) as they are instead of compiling "
                         "them here; they run in every process that uses the cache")
    im.add_argument("--jobs", "-j", type=positive_int, default=None, metavar="N",
                    help="host libraries compiled at a time (default: half the CPU cores)")
    p.set_defaults(func=_run_cache)


def _run_cache(args: argparse.Namespace) -> int:
    from ..jit import build, cache as cache_archive   # deferred: loads torch: only when the command runs (`mixgemm --help` stays fast)

    if args.cache_action is None:
        raise UsageError("an action is required: list, export or import")
    if args.cache_action == "list":
        entries = cache_archive.list_entries(args.kernels)
        for e in entries:
            seconds = f"{e.build_seconds:7.1f} s" if e.build_seconds is not None else "      -  "
            detail = f"  ({e.detail})" if e.detail else ""
            print(f"{e.state:9s} {seconds} {fmt_bytes(e.nbytes):>10s}  {e.kind}/{e.directory.name}{detail}")
        counts = {s: sum(e.state == s for e in entries) for s in ("current", "stale", "corrupt", "foreign",
                                                                   "unchecked")}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        print(f"{len(entries)} entries in {build.cache_dir()}" + (f": {summary}" if summary else ""),
              file=sys.stderr)
        return 0
    if args.cache_action == "export":
        report = cache_archive.export_cache(args.file, args.kernels, force=args.force)
        print(f"exported {len(report.exported)} entries ({fmt_bytes(report.nbytes)}) to {report.path}"
              + (f"; skipped {len(report.skipped)} stale, corrupt or foreign" if report.skipped else ""))
        return 0
    report = cache_archive.import_cache(args.file, trust_host_code=args.trust_host_code, jobs=args.jobs)
    for what, why in report.refused:
        print(f"{PROG} cache import: refused {what}: {why}", file=sys.stderr)
    if report.host_built:
        host = f" (the host code of {len(report.host_built)} compiled here; --trust-host-code takes the archive's)"
    elif args.trust_host_code and report.imported:
        host = " (host code taken from the archive: --trust-host-code)"
    else:
        host = ""
    print(f"imported {len(report.imported)} entries{host}, {len(report.present)} already present, "
          f"{len(report.refused)} refused, into {build.cache_dir()}")
    return EXIT_OK if report.ok else EXIT_ERROR
