"""Count a GEMM kernel's mainloop instructions per k-tile in its SASS (no GPU needed).

    python tools/sass_count.py KERNEL.cubin [...]           per k-loop: instructions per k-tile by kind
    python tools/sass_count.py KERNEL.cubin --ops           ... and every opcode's count
    python tools/sass_count.py KERNEL.cubin --stream        the instruction stream, addresses and
                                                            encodings stripped (to diff two builds)
    python tools/sass_count.py --kernel REGEX [--cache DIR] the cubins of the cached kernels whose
                                                            name matches (mixgemm's kernel cache)
    python tools/sass_count.py --ncu-source SOURCE.csv      a profiled kernel's executed instructions
                                                            and warp stall samples, by kind (below)

``--ncu-source`` reads the source page of an Nsight Compute report, exported per kernel with
``ncu --import R.ncu-rep --page source --csv --print-source sass -k REGEX > SOURCE.csv`` (or
the same gzipped, ``.csv.gz``) from a
report taken with ``--set full`` (or the SourceCounters section): per kind, the warp-level
instructions executed (per warp and k-tile, the k-tiles counted from the wgmma issues) and the
share of the warp stall samples, the stall reasons, and the instructions with the most samples.

A k-loop is a conditional backward branch whose body holds wgmma issues (HGMMA/QGMMA) and no
shorter such loop: each k-loop form the mainloop compiles (the e4m3 mainloop has one per number
of group rows in a k-tile) is reported on its own. The body's counts are static (every
instruction once, conditional blocks included: for groups of one k-tile, the zero-point table
rebuild runs every k-tile) and divided by the k-tiles the body spans: its wgmma issues over the
issues per k-tile (BLK_K / the instruction's K, BLK_K read from the kernel's `_t<M>x<N>x<K>`
name; `--ktile-mmas` overrides it). A wgmma batch is a run of wgmmas up to the one that closes
it (`gsb0`): the e4m3 mainloop commits one per group row of a k-tile.

Kinds, by opcode (the first dot-separated part; a few by their full form):

    mma         HGMMA, QGMMA                               (wgmma issues)
    convert     PRMT, LOP3, SHF, SEL, I2F, I2FP, F2F, F2FP, HADD2, HFMA2, HMUL2
    promote     FFMA, FADD, FMUL
    wait        WARPGROUP (arrive, depbar), WARPSYNC, BAR, DEPBAR, SYNCS (mbarrier waits, arrives)
    division    I2F.RP / I2F.U32.RP, MUFU.RCP, F2I.*TRUNC, IABS: a runtime integer `/` or `%`
    smem        LDS, LDSM, STS
    other       everything else (IMAD, IADD3, ISETP, MOV, uniform-datapath ops, branches, ...)

cuobjdump is looked up on PATH, next to nvcc, then in the nvidia-cuda-cuobjdump wheel
(`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, whose nvdisasm cuobjdump needs).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from mixgemm.jit.build import cache_dir
from mixgemm.jit.cache import list_entries

KINDS = ("mma", "convert", "promote", "wait", "division", "smem", "other")
_CONVERT = {"PRMT", "LOP3", "SHF", "SEL", "I2F", "I2FP", "F2F", "F2FP", "HADD2", "HFMA2", "HMUL2"}
_PROMOTE = {"FFMA", "FADD", "FMUL"}
_WAIT = {"WARPGROUP", "WARPSYNC", "BAR", "DEPBAR", "SYNCS"}
_SMEM = {"LDS", "LDSM", "STS"}

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
_TARGET = re.compile(r"\bBRA\b(?:\s+!?U?P[T0-9]+,)?\s+(0x[0-9a-f]+)")


def kind(op: str) -> str:
    """The kind of one instruction, op its full opcode (e.g. ``I2F.U32.RP``)."""
    base = op.split(".")[0]
    if base in ("HGMMA", "QGMMA"):
        return "mma"
    if (base == "I2F" and ".RP" in op) or op == "MUFU.RCP" or (base == "F2I" and "TRUNC" in op) or base == "IABS":
        return "division"
    if base in _CONVERT:
        return "convert"
    if base in _PROMOTE:
        return "promote"
    if base in _WAIT:
        return "wait"
    if base in _SMEM:
        return "smem"
    return "other"


def find_cuobjdump() -> str:
    candidates = [shutil.which("cuobjdump")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent / "cuobjdump"))
    candidates += [str(Path(p) / "cuobjdump") for p in ("/usr/local/cuda/bin",)]
    try:
        import nvidia
        for root in nvidia.__path__:
            candidates += glob.glob(os.path.join(root, "cu*", "bin", "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and Path(c).is_file():
            return c
    sys.exit("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def cuobjdump(flag: str, cubin: str) -> str:
    tool = find_cuobjdump()
    env = dict(os.environ)
    # cuobjdump -sass runs nvdisasm; the wheel puts it in cuobjdump's own folder.
    env["PATH"] = str(Path(tool).parent) + os.pathsep + env.get("PATH", "")
    res = subprocess.run([tool, flag, cubin], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"cuobjdump {flag} {cubin} failed: {res.stderr.strip()[-400:]}")
    return res.stdout


def sass(cubin: str) -> str:
    text = cuobjdump("-sass", cubin)
    if "Function :" not in text:
        sys.exit(f"cuobjdump -sass {cubin}: no functions")
    return text


def resources(cubin: str) -> dict[str, str]:
    """name -> 'REG:n STACK:n LOCAL:n' (registers per thread before setmaxnreg, local memory)."""
    found = {}
    for m in re.finditer(r"Function (\S+):\s*\n\s*(REG:\d+) (STACK:\d+) \S+ (LOCAL:\d+)", cuobjdump("-res-usage", cubin)):
        found[m.group(1)] = " ".join(m.group(2, 3, 4))
    return found


def functions(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """name -> [(address, opcode, instruction text without predicate)]."""
    funcs = {}
    for part in text.split("Function : ")[1:]:
        name, body = part.split("\n", 1)
        insns = []
        for line in body.splitlines():
            m = _INSN.match(line)
            if not m:
                continue
            text_ = _PRED.sub("", m.group(2))
            insns.append((int(m.group(1), 16), text_.split()[0], m.group(2)))
        funcs[name.strip()] = insns
    return funcs


def k_loops(insns):
    """(first, last) indices of the innermost conditional backward-branch loops that issue wgmmas."""
    index = {addr: i for i, (addr, _, _) in enumerate(insns)}
    loops = []
    for i, (addr, op, full) in enumerate(insns):
        if op != "BRA" or not full.startswith("@"):
            continue
        m = _TARGET.search(full)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr and target in index:
            first = index[target]
            if any(kind(insns[j][1]) == "mma" for j in range(first, i + 1)):
                loops.append((first, i))
    return [lp for lp in loops
            if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]


def ktile_mmas(name: str, body) -> int | None:
    m = re.search(r"_t(\d+)x(\d+)x(\d+)", name)
    shape = next((re.search(r"GMMA\.\d+x\d+x(\d+)", full) for _, op, full in body if kind(op) == "mma"), None)
    if not m or not shape:
        return None
    return int(m.group(3)) // int(shape.group(1))


def report(cubin: str, show_ops: bool, per_ktile_override: int | None) -> None:
    usage = resources(cubin)
    for name, insns in functions(sass(cubin)).items():
        loops = k_loops(insns)
        print(f"{name}  ({len(insns)} instructions, {usage.get(name, '?')}, {len(loops)} k-loop(s))  {cubin}")
        for first, last in loops:
            body = insns[first:last + 1]
            ops = collections.Counter(full_op(full) for _, _, full in body)
            kinds = collections.Counter()
            for op, n in ops.items():
                kinds[kind(op)] += n
            per = per_ktile_override or ktile_mmas(name, body)
            tiles = kinds["mma"] / per if per else 1.0
            commits = sum(1 for _, op, full in body if kind(op) == "mma" and "gsb0" in full)
            line = "  ".join(f"{k} {kinds[k] / tiles:g}" for k in KINDS)
            print(f"  k-loop 0x{body[0][0]:x}-0x{body[-1][0]:x}: {len(body)} instructions, {tiles:g} k-tiles, "
                  f"{commits / tiles:g} wgmma batches per k-tile; per k-tile: total {len(body) / tiles:g}  {line}")
            if show_ops:
                for op, n in sorted(ops.items(), key=lambda kv: (KINDS.index(kind(kv[0])), -kv[1], kv[0])):
                    print(f"      {kind(op):9s} {op:36s} {n / tiles:g}")


def full_op(full: str) -> str:
    return _PRED.sub("", full).split()[0]


def stream(cubin: str) -> None:
    for name, insns in functions(sass(cubin)).items():
        print(f"Function : {name}")
        for _, _, full in insns:
            print(full)


def cached_cubins(pattern: str, cache: str | None) -> list[str]:
    """The cubins of the kernel cache's current entries whose name matches ``pattern`` (stale
    entries, built from other headers, are left out: :func:`mixgemm.jit.cache.list_entries`)."""
    if cache:
        os.environ["MIXGEMM_CACHE_DIR"] = cache
    found = [str(e.directory / "kernel.cubin") for e in list_entries(re.compile(pattern))
             if e.kind == "kernels" and e.state == "current" and (e.directory / "kernel.cubin").is_file()]
    if not found:
        sys.exit(f"no current cached kernel matching {pattern!r} under {cache_dir()}/kernels")
    return found


def _int(v: str) -> int:
    v = v.replace(",", "").strip()
    return int(float(v)) if v else 0


def ncu_source(path: str, top: int = 15, ktile_mmas: int | None = None, out=None) -> dict:
    """Summarize an ``ncu --page source --csv --print-source sass`` export (see the module
    docstring); prints the summary and returns it (``kinds``: kind -> (executed, samples),
    ``reasons``: stall reason -> samples, ``per_ktile``: executed per warp and k-tile)."""
    import csv
    import gzip

    out = out or sys.stdout
    with (gzip.open(path, "rt", newline="") if str(path).endswith(".gz") else open(path, newline="")) as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if head is None:
        sys.exit(f"{path}: no 'Address' header row: not an ncu source-page CSV export")
    name = next((r[1] for r in rows[:head] if r and r[0] == "Kernel Name" and len(r) > 1), "?")
    cols = {c: i for i, c in enumerate(rows[head])}
    for need in ("Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"):
        if need not in cols:
            sys.exit(f"{path}: no {need!r} column (profile with --set full or the SourceCounters section)")
    reasons = [c for c in rows[head] if c.startswith("stall_") and not c.endswith("(Not Issued)")]
    kinds = {k: [0, 0] for k in KINDS}
    stalls = collections.Counter()
    mma_exec = 0
    insns = []
    for r in rows[head + 1:]:
        if len(r) < len(rows[head]) or not r[cols["Source"]].strip():
            continue
        op = full_op(r[cols["Source"]].strip())
        k = kind(op)
        ex, sm = _int(r[cols["Instructions Executed"]]), _int(r[cols["Warp Stall Sampling (All Samples)"]])
        kinds[k][0] += ex
        kinds[k][1] += sm
        if k == "mma":
            mma_exec += ex
        why = {c: _int(r[cols[c]]) for c in reasons}
        stalls.update(why)
        insns.append((sm, r[cols["Source"]].strip(), why))
    total_ex = sum(v[0] for v in kinds.values()) or 1
    total_sm = sum(v[1] for v in kinds.values()) or 1
    per = ktile_mmas or ktile_mmas_of(name)
    ktiles = mma_exec / per if per and mma_exec else None
    print(f"{name}: {total_ex} warp instructions executed, {total_sm} warp stall samples", file=out)
    print(f"{'kind':<10}{'executed':>12}{'share':>8}{'per warp, k-tile':>18}{'samples':>10}{'share':>8}", file=out)
    for k in KINDS:
        ex, sm = kinds[k]
        pk = f"{ex / ktiles:.1f}" if ktiles else "-"
        print(f"{k:<10}{ex:>12}{100 * ex / total_ex:>7.1f}%{pk:>18}{sm:>10}{100 * sm / total_sm:>7.1f}%", file=out)
    print("stall reasons (share of the samples; the rest carry no reason in the export):", file=out)
    for c, v in stalls.most_common():
        if v:
            print(f"  {c[len('stall_'):]:<20}{v:>8}{100 * v / total_sm:>7.1f}%", file=out)
    print(f"the {top} instructions with the most samples:", file=out)
    for sm, src, why in sorted(insns, key=lambda t: -t[0])[:top]:
        lead = ", ".join(f"{c[len('stall_'):]} {v}" for c, v in sorted(why.items(), key=lambda t: -t[1])[:2] if v)
        print(f"  {sm:>7}  {src[:64]:<64}  {lead}", file=out)
    return {"kernel": name, "kinds": {k: tuple(v) for k, v in kinds.items()}, "reasons": dict(stalls),
            "per_ktile": (total_ex / ktiles) if ktiles else None}


def ktile_mmas_of(name: str) -> int | None:
    """wgmma issues per warp and k-tile from a kernel name's ``_t<M>x<N>x<K>`` (K / 32 for the
    e4m3 kernels' k32 MMAs, K / 16 for the 16-bit ones'), None without a tile in the name."""
    m = re.search(r"_t\d+x\d+x(\d+)", name)
    if not m:
        return None
    return int(m.group(1)) // (32 if "f8gemm" in name else 16)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cubins", nargs="*")
    ap.add_argument("--kernel", help="cached kernels whose directory name matches this regex")
    ap.add_argument("--cache", help="kernel cache (default: $MIXGEMM_CACHE_DIR or ~/.cache/mixgemm)")
    ap.add_argument("--ops", action="store_true", help="also every opcode's count per k-tile")
    ap.add_argument("--stream", action="store_true", help="print the instruction stream instead")
    ap.add_argument("--ktile-mmas", type=int, help="wgmma issues per k-tile (default: from the name)")
    ap.add_argument("--ncu-source", metavar="CSV", help="summarize an ncu source-page export instead")
    ap.add_argument("--top", type=int, default=15, help="--ncu-source: instructions listed")
    args = ap.parse_args(argv)
    if args.ncu_source:
        ncu_source(args.ncu_source, args.top, args.ktile_mmas)
        return
    cubins = list(args.cubins) + (cached_cubins(args.kernel, args.cache) if args.kernel else [])
    if not cubins:
        ap.error("give cubins or --kernel")
    for c in cubins:
        if args.stream:
            stream(c)
        else:
            report(c, args.ops, args.ktile_mmas)


if __name__ == "__main__":
    main()
