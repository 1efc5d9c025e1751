"""What the ``--model`` and ``--moe`` runs (:mod:`.model_run`, :mod:`.moe_run`) do alike around
their points: which variants can run here, building a run's mixgemm kernels up front, capturing
a CUDA graph, and keeping one failed point from spoiling the next."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..nn.linear import act_format_problem
from .peer_formats import ImplUnavailable
from .peers import kernel_is_cached, mixgemm_available, prebuild_kernels, scaled_mm_available, torch_int4_available
from .variants import Variant, VariantKind

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class RunOutputs:
    """The options every bench run (``--model``, ``--moe``) takes alike: its seed and where its
    results go. The runs' configs add their own fields after these."""

    group_size: int = 128
    quick: bool = False
    seed: int = 0
    json_path: Optional[str] = None
    plot_path: Optional[str] = None
    save: bool = False
    results_root: Optional[str] = None
    gpu_name: Optional[str] = None


def variant_available(variant: Variant) -> tuple[bool, str]:
    """Whether ``variant`` can run here; ``(False, reason)`` if not (an 8-bit weight with e4m3
    activations says so first, on any machine)."""
    if variant.kind is VariantKind.MIXGEMM:
        why = act_format_problem(variant.act_format, variant.weight_type)
        if why:
            return False, why
        return mixgemm_available()
    if variant.kind is VariantKind.TORCH_INT4:
        return torch_int4_available()
    if variant.kind is VariantKind.SCALED_MM:
        return scaled_mm_available()
    return True, ""


def launches_mixgemm_kernels(variant: Variant) -> bool:
    """Whether ``variant``'s step launches mixgemm's kernels here: every mixgemm variant, and
    scaled-mm where its activation quantizer is mixgemm's kernel (an sm_90 GPU)."""
    if variant.kind is VariantKind.MIXGEMM:
        return True
    return variant.kind is VariantKind.SCALED_MM and mixgemm_available()[0]


def prebuild_variants(variants: Sequence[Variant], specs_of: Callable[[Variant], list], log: Log,
                      what: str = "mixgemm kernels") -> dict[str, str]:
    """Build the kernels ``specs_of(v)`` of every variant that can run here and launches mixgemm's
    kernels (:func:`launches_mixgemm_kernels`); ``{variant name: reason}`` for the variants whose
    kernels did not build (their points are reported as errors)."""
    mix = [v for v in variants if launches_mixgemm_kernels(v) and variant_available(v)[0]]
    specs = [s for v in mix for s in specs_of(v)]
    if not specs:
        return {}
    log(f"building (or finding cached) {len({s.name for s in specs})} {what} ...")
    if prebuild_kernels(specs, log) is None:
        return {}
    failed = {}
    for v in mix:
        for spec in specs_of(v):
            ok, why = kernel_is_cached(spec)
            if not ok:
                failed[v.name] = why
                break
    return failed


def cuda_capture(fn: Callable[[], torch.Tensor], capture_error_mode: str = "global") -> tuple:
    """Warm ``fn`` up on a side stream (loads kernels, sets up cuBLAS workspaces and the stream's
    GEMM workspace and locks), then capture it on that stream: ``(graph, output)``.
    ``capture_error_mode`` as :class:`torch.cuda.graph`'s ("thread_local" where another thread
    may touch CUDA meanwhile, e.g. NCCL's watchdog)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode=capture_error_mode):
        out = fn()
    return graph, out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive now kept out of the garbage collector's passes for the block
    (``gc.collect()``, then ``gc.freeze()``; ``gc.unfreeze()`` after), as serving frameworks
    freeze their heap once the model is loaded and compiled. Each compiled variant leaves caches
    alive in the process (Dynamo, inductor, sympy), so without this the collector's full passes
    cost a later variant more host time per token than an earlier one (docs/benchmarking.md)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe(e: BaseException) -> str:
    """``Type: first line of the message``: a point's error in the report."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def run_variants(variants: Sequence[Variant], build_failures: dict[str, str],
                 skipped: Callable[[Variant, str, bool], None], build: Callable[[Variant], object],
                 measure: Callable[[Variant, object, float], None], what: str) -> None:
    """For each variant: ``skipped(variant, why, unavailable)`` when it cannot run here, its
    kernels did not build or ``build(variant)`` fails (building the ``what`` failed); else
    ``measure(variant, built, seconds to build)``, then what was built is released before the next
    variant is built."""
    for variant in variants:
        ok, why = variant_available(variant)
        if not ok:
            skipped(variant, why, True)
            continue
        if variant.name in build_failures:
            skipped(variant, build_failures[variant.name], False)
            continue
        t0 = time.perf_counter()
        failure: Optional[tuple[str, bool]] = None
        try:
            built = build(variant)
        except ImplUnavailable as e:
            failure = (str(e), True)
        except Exception as e:
            failure = (f"building the {what} failed: {describe(e)}", False)
        if failure is not None:
            skipped(variant, *failure)
            free()         # outside the handler: the traceback no longer holds the partial build
            continue
        measure(variant, built, time.perf_counter() - t0)
        del built
        free()


def run_presets(presets: Sequence, prebuild: Callable[[Sequence, Log], dict[str, str]],
                run_preset: Callable[[object, dict[str, str]], list], log: Log) -> list:
    """Every point of every preset, the kernels built first (``prebuild`` gives the variants whose
    kernels did not build)."""
    failures = prebuild(presets, log)
    out: list = []
    for preset in presets:
        out.extend(run_preset(preset, failures))
    return out


def recover() -> None:
    """After a failed point: wait for the GPU and release the cached memory, never raising."""
    try:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:
        pass


__all__ = ["RunOutputs", "run_variants", "run_presets", "variant_available", "launches_mixgemm_kernels",
           "prebuild_variants", "cuda_capture", "sync", "free", "frozen_heap", "describe", "recover"]
