"""Plots (matplotlib, optional: without it nothing is drawn and the caller is told why): the
grid's speedup over cuBLAS against M, and the model step's speedup over bf16 per batch.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

from ..jit.catalog import TILE_CONFIGS
from .generate import GEN_MODES
from .grid import OK, PointResult
from .peers import BASELINE, E4M3, activations_of, base_name
from .variants import NO_GEMM


def _matplotlib():
    """``(Figure, FigureCanvasAgg)``, or None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg   # deferred: optional dependency (mixgemm[bench])
        from matplotlib.figure import Figure   # deferred: optional dependency (mixgemm[bench])
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib): no plot"


def save_figure(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Save ``fig`` to a temporary file beside ``path``, then rename it into place (the format
    from ``path``'s suffix, PNG by default)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".").lower() or "png")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _finish(fig: Any, axes: Any, width: float, title: str, path: Path,
            inches_per_entry: float = 2.0) -> tuple[bool, str]:
    """One legend under the panels (each label once, in the order first drawn; a row holds one
    entry per ``inches_per_entry`` of the figure's width), the title, then the figure saved:
    ``(True, path)``."""
    handles, names = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                names.append(lab)
    if names:
        fig.legend([handles[n] for n in names], names, loc="outside lower center",
                   ncol=max(1, min(len(names), int(width / inches_per_entry))), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return True, str(save_figure(fig, path))


def write_plot(results: Sequence[PointResult], path: Path, title: str = "") -> tuple[bool, str]:
    """Plot speedup over cuBLAS against M (log2 axis): one panel per (N, K), one line per
    implementation (ok points only; peers dashed, mixgemm solid, its e4m3-activation rows
    dash-dotted, its ``@config`` variants dotted in the colour of their weight type). Needs
    matplotlib (optional).

    Returns
    -------
    (bool, str)
        ``(True, path)`` when written, ``(False, reason)`` when matplotlib is missing or
        nothing can be plotted.
    """
    mpl = _matplotlib()
    if mpl is None:
        return False, NO_MATPLOTLIB
    Figure, FigureCanvasAgg = mpl
    shapes: list[tuple[int, int]] = []
    impls: list[str] = []
    for r in results:
        if (r.n, r.k) not in shapes:
            shapes.append((r.n, r.k))
        if r.impl not in impls and r.impl != BASELINE:
            impls.append(r.impl)
    if not shapes:
        return False, "no results to plot"
    ncols = min(4, len(shapes))
    nrows = math.ceil(len(shapes) / ncols)
    width = max(4.2 * ncols, 8.0)
    fig = Figure(figsize=(width, 3.4 * nrows + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    # colour by base implementation, marker (and a dotted line) by mixgemm tile config
    bases = list(dict.fromkeys(base_name(name) for name in impls))
    config_markers = {tc.label: mk for tc, mk in zip(TILE_CONFIGS, "vs^DPX*")}
    colors = {name: f"C{bases.index(base_name(name)) % 10}" for name in impls}
    markers = {name: config_markers.get(name.partition("@")[2], "o") for name in impls}
    styles = {name: (":" if "@" in name else "--" if not name.startswith("mixgemm")
                     else "-." if activations_of(name) == E4M3 else "-") for name in impls}
    all_ms = sorted({r.m for r in results})
    for ax, (n, k) in zip(axes.flat, shapes):
        ax.axhline(1.0, color="black", lw=0.8, ls=":", label="cuBLAS (bf16/fp16 weight)")
        for name in impls:
            pts = sorted((r.m, r.speedup_vs_cublas) for r in results
                         if r.impl == name and (r.n, r.k) == (n, k) and r.status == OK
                         and r.speedup_vs_cublas is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[name], ms=3, lw=1.2,
                        ls=styles[name], color=colors[name], label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ms)
        ax.set_xticklabels([str(m) for m in all_ms], rotation=45, fontsize=7)
        ax.set_title(f"N={n} K={k}", fontsize=9)
        ax.set_xlabel("M (tokens)", fontsize=8)
        ax.set_ylabel("speedup over cuBLAS", fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    for ax in list(axes.flat)[len(shapes):]:
        ax.set_visible(False)
    return _finish(fig, axes, width, title, path, inches_per_entry=2.3)


def write_model_plot(points: Sequence[Any], path: Path, title: str = "") -> tuple[bool, str]:
    """Plot ``--model`` points (:class:`.model.ModelPoint`): one column per preset; top row the
    speedup over bf16 per step (the decode batches, then the prefill), bottom row the fraction
    of the byte floor reached; one colour per variant, solid for CUDA graphs, dashed for eager.
    The no-gemm variant (the step without its GEMMs: the ceiling of every variant's speedup) is
    drawn in the top row only, grey, with crosses (dotted for graphs, dash-dotted for eager). Ok points only. Needs matplotlib
    (optional).

    Returns
    -------
    (bool, str)
        ``(True, path)`` when written, ``(False, reason)`` when matplotlib is missing or nothing
        can be plotted.
    """
    mpl = _matplotlib()
    if mpl is None:
        return False, NO_MATPLOTLIB
    Figure, FigureCanvasAgg = mpl
    ok = [p for p in points if p.status == OK]
    presets = list(dict.fromkeys(p.preset for p in ok))
    if not presets:
        return False, "no ok points to plot"
    variants = list(dict.fromkeys(p.variant for p in points))
    colors = {v: f"C{i % 10}" for i, v in enumerate(v for v in variants if v != NO_GEMM.name)}
    colors[NO_GEMM.name] = "0.5"
    width = max(4.2 * len(presets), 6.0)
    fig = Figure(figsize=(width, 7.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(presets), squeeze=False)
    for col, preset in enumerate(presets):
        mine = [p for p in ok if p.preset == preset]
        steps = list(dict.fromkeys((p.phase, p.batch, p.tokens) for p in
                                   sorted(mine, key=lambda p: (p.phase != "decode", p.batch, p.tokens))))
        labels = [f"b{b}" if ph == "decode" else f"prefill\n{t}" for ph, b, t in steps]
        top, bottom = axes[0][col], axes[1][col]
        top.axhline(1.0, color="black", lw=0.8, ls=":")
        for variant in variants:
            for mode, style in (("graph", "-"), ("eager", "--")):
                pts = [p for p in mine if p.variant == variant and p.mode == mode]
                no_gemm = variant == NO_GEMM.name
                for ax, attr in ((top, "speedup_vs_bf16"), (bottom, "frac_of_floor")):
                    xy = sorted((steps.index((p.phase, p.batch, p.tokens)), getattr(p, attr)) for p in pts
                                if getattr(p, attr) is not None)
                    if xy and not (ax is top and variant == "bf16") and not (ax is bottom and no_gemm):
                        ax.plot([a for a, _ in xy], [b for _, b in xy], marker="x" if no_gemm else "o",
                                ms=4 if no_gemm else 3, lw=1.0 if no_gemm else 1.2, ls=(":" if mode == "graph" else "-.") if no_gemm else style,
                                color=colors[variant], label=f"{variant} ({mode})")
        for ax, ylabel in ((top, "speedup over bf16 (same mode)"), (bottom, "fraction of byte floor")):
            ax.set_xticks(range(len(steps)))
            ax.set_xticklabels(labels, fontsize=7)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(True, alpha=0.3)
        top.set_title(preset, fontsize=9)
        bottom.set_ylim(bottom=0)
    return _finish(fig, axes, width, title, path)


def write_moe_plot(points: Sequence[Any], path: Path, title: str = "") -> tuple[bool, str]:
    """Plot ``--moe`` points (:class:`.moe.MoePoint`): one column per preset; top row the speedup
    over bf16 against the tokens (log scale), bottom row the fraction of the byte floor; one
    colour per variant, solid for uniform routing, dashed for Zipf. Ok points only. Needs
    matplotlib (optional).

    Returns
    -------
    (bool, str)
        ``(True, path)`` when written, ``(False, reason)`` when matplotlib is missing or nothing
        can be plotted.
    """
    mpl = _matplotlib()
    if mpl is None:
        return False, NO_MATPLOTLIB
    Figure, FigureCanvasAgg = mpl
    ok = [p for p in points if p.status == OK]
    presets = list(dict.fromkeys(p.preset for p in ok))
    if not presets:
        return False, "no ok points to plot"
    variants = list(dict.fromkeys(p.variant for p in points))
    colors = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    width = max(4.2 * len(presets), 6.0)
    fig = Figure(figsize=(width, 7.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(presets), squeeze=False)
    for col, preset in enumerate(presets):
        mine = [p for p in ok if p.preset == preset]
        top, bottom = axes[0][col], axes[1][col]
        top.axhline(1.0, color="black", lw=0.8, ls=":")
        for variant in variants:
            for routing, style in (("uniform", "-"), ("zipf", "--")):
                pts = [p for p in mine if p.variant == variant and p.routing == routing]
                for ax, attr in ((top, "speedup_vs_bf16"), (bottom, "frac_of_floor")):
                    xy = sorted((p.tokens, getattr(p, attr)) for p in pts if getattr(p, attr) is not None)
                    if xy and not (ax is top and variant == "bf16"):
                        ax.plot([a for a, _ in xy], [b for _, b in xy], marker="o", ms=3, lw=1.2, ls=style,
                                color=colors[variant], label=f"{variant} ({routing})")
        for ax, ylabel in ((top, "speedup over bf16"), (bottom, "fraction of byte floor")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(True, alpha=0.3)
        top.set_title(preset, fontsize=9)
        bottom.set_ylim(bottom=0)
    return _finish(fig, axes, width, title, path)


def write_generate_plot(points: Sequence[Any], path: Path, title: str = "") -> tuple[bool, str]:
    """Plot ``--generate`` points (:class:`.generate.GenPoint`): one panel per batch size; per
    mode, one bar per variant and ``fuse_layers`` setting, its height the tokens per second of
    the whole ``generate()`` call, a black tick at its ceiling (batch / GPU decode step). Ok points
    only. Needs matplotlib (optional); returns as :func:`write_model_plot` does.
    """
    mpl = _matplotlib()
    if mpl is None:
        return False, NO_MATPLOTLIB
    Figure, FigureCanvasAgg = mpl
    ok = [p for p in points if p.status == OK and p.tok_s is not None]
    if not ok:
        return False, "no ok points to plot"
    batches = sorted({p.batch for p in ok})
    series = list(dict.fromkeys((p.variant, p.fuse) for p in points))
    modes = sorted({p.mode for p in points}, key=lambda m: (GEN_MODES.index(m) if m in GEN_MODES else 9, m))
    bar = 0.8 / len(series)
    width = max(4.5 * len(batches), 6.0)
    fig = Figure(figsize=(width, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(batches), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for i, (variant, fuse) in enumerate(series):
            mine = {p.mode: p for p in ok if p.batch == batch and (p.variant, p.fuse) == (variant, fuse)}
            xs = [modes.index(m) - 0.4 + (i + 0.5) * bar for m in modes if m in mine]
            label = variant if fuse == "-" else f"{variant} fuse_layers={fuse}"
            ax.bar(xs, [mine[m].tok_s for m in modes if m in mine], bar * 0.9, color=f"C{i % 10}",
                   hatch=("", "//", "..")[i // 10 % 3], label=label)   # (more series than colors: hatched)
            ceil = [(x, mine[m].ceiling_tok_s) for x, m in zip(xs, [m for m in modes if m in mine])
                    if mine[m].ceiling_tok_s is not None]
            if ceil:
                ax.scatter([x for x, _ in ceil], [c for _, c in ceil], marker="_", s=120, color="black",
                           label="GPU step ceiling")
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(modes, fontsize=8)
        ax.set_ylabel("tokens/s (generate())", fontsize=8)
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    return _finish(fig, axes, width, title, path)


__all__ = ["save_figure", "write_plot", "write_model_plot", "write_moe_plot", "write_generate_plot", "NO_MATPLOTLIB"]
