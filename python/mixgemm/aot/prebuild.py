"""Building ahead of time exactly the kernels a model can run, so that no call waits for nvcc.

Which kernel a GEMM launches (:func:`mixgemm.dispatch.heuristic.select_spec`) depends on the weight's
shape ``N x K``, its types (weight and activation), the activation the call fuses, and the token
count M only through M's bucket (:data:`mixgemm.dispatch.heuristic.TOKEN_BUCKETS`: the heuristic's choice
is constant within a bucket up to 512 tokens; above, it picks one of two configs by M and the
GPU's SM count). So the kernels a weight can ever need are ``select_spec(m, w, activation)`` for
one M per bucket, and both configs above 512 tokens
(:func:`mixgemm.dispatch.heuristic.select_specs_any_gpu`); a model's are the union over its weights:
:func:`specs_for`. :func:`build_for` builds them in
parallel (:func:`mixgemm.jit.build.build_many`, with a progress bar) together with the compiled
launcher that every planned call uses.

What a model's layers launch (:mod:`mixgemm.dispatch.uses`)
-----------------------------------------------------------
Every module inside an ``nn.Module`` that launches kernels says which through its
``kernel_uses()`` (:class:`~mixgemm.dispatch.uses.LaunchesKernels`), and this module walks them. A
:class:`~mixgemm.nn.QuantLinear` gives a :class:`WeightUse`: its packed weight (``N`` is twice
``out_features`` for a swiglu layer) and its ``activation``; a bare :class:`~mixgemm.PackedWeight`
is taken without an activation. A weight with zero offsets (HQQ imports) runs its activation after
the kernel, in torch (:func:`mixgemm.gemm`), so it needs the kernel without one. Files and model
directories are read by :mod:`mixgemm.aot.checkpoint` (headers only, no tensor data).

A :class:`~mixgemm.nn.moe.QuantMoE` gives an :class:`ExpertsUse` (as a checkpoint's stacked experts
do, :mod:`mixgemm.aot.checkpoint`), which adds the kernels a MoE layer can launch
(:func:`moe_specs_for`): the grouped kernels of its two GEMMs at every row count, the layout kernel,
and the routing and combine kernels. A :class:`~mixgemm.nn.RMSNorm` gives the RMSNorm kernel of its
dtype, and the fused decoder layers of :mod:`mixgemm.nn.blocks` their rotary and add + RMSNorm
kernels.

The dequantizer kernels (:func:`mixgemm.dequantize`) are not on the GEMM path and are not
included.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable as _Iterable
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from .. import moe
from ..dispatch.heuristic import select_specs_any_gpu, TOKEN_BUCKETS
from ..dispatch.uses import ExpertsUse, KernelUse, LaunchesKernels, WeightUse
from ..errors import BuildError
from ..jit import build, launcher as launcher_mod, torch_ops
from ..jit.specs import Activation, KernelKind, KernelSpec, MoeLayoutSpec
from ..moe.layer import SPLIT_FROM_ROWS
from ..moe.routing import routing_specs
from ..weights.types import PackedWeight

__all__ = ["WeightUse", "ExpertsUse", "token_counts", "uses_of", "specs_for", "moe_specs_for", "build_for"]


def token_counts(max_tokens: Optional[int] = None) -> list[int]:
    """One token count per bucket of :data:`mixgemm.dispatch.heuristic.TOKEN_BUCKETS` (its smallest M) and
    513, the first M above the table, up to ``max_tokens`` (every bucket when None):
    ``[1, 9, 17, 33, 65, 129, 257, 513]`` today."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    firsts, seen = [], set()
    for m in range(1, len(TOKEN_BUCKETS)):
        if TOKEN_BUCKETS[m] not in seen:
            seen.add(TOKEN_BUCKETS[m])
            firsts.append(m)
    firsts.append(len(TOKEN_BUCKETS))   # the first M above the table (heuristic.token_bucket)
    return [m for m in firsts if max_tokens is None or m <= max_tokens]


Item = Union[WeightUse, ExpertsUse, PackedWeight, torch.nn.Module]


def uses_of(items: Union[Item, Iterable[Item]]) -> list[WeightUse]:
    """The :class:`WeightUse` of each item: a WeightUse as is; a PackedWeight without an
    activation; every one that the modules inside an ``nn.Module`` report (the module itself
    included): a :class:`~mixgemm.nn.QuantLinear`'s with its activation (tensor-parallel layers
    hold one). Repeats are kept."""
    return [use for use in _kernel_uses(items) if isinstance(use, WeightUse)]


def _kernel_uses(items: Union[Item, Iterable[Item]]) -> list[KernelUse]:
    """The kernel uses of ``items``: WeightUses and ExpertsUses as they are, a PackedWeight's
    WeightUse without an activation, and what the modules inside each ``nn.Module`` report."""
    if isinstance(items, (WeightUse, PackedWeight, torch.nn.Module)):
        items = [items]
    elif not isinstance(items, _Iterable) or isinstance(items, (str, bytes)):
        raise TypeError(f"expected PackedWeights, QuantLinear layers, nn.Modules or WeightUses, got "
                        f"{type(items).__name__}")
    out: list[KernelUse] = []
    for item in items:
        if isinstance(item, (WeightUse, ExpertsUse)):
            out.append(item)
        elif isinstance(item, PackedWeight):
            out.append(WeightUse.of_packed(item))
        elif isinstance(item, torch.nn.Module):
            out.extend(_reported(item))
        else:
            raise TypeError(f"expected a PackedWeight, a QuantLinear layer, an nn.Module or a WeightUse, got "
                            f"{type(item).__name__}")
    return out


def _reported(module: torch.nn.Module) -> Iterator[KernelUse]:
    """What ``module`` and every module inside it report through ``kernel_uses()``
    (:class:`~mixgemm.dispatch.uses.LaunchesKernels`); a WeightUse or ExpertsUse without a name
    is named by where its module sits."""
    for name, mod in module.named_modules():
        if isinstance(mod, LaunchesKernels):
            for use in mod.kernel_uses():
                named = isinstance(use, (WeightUse, ExpertsUse)) and not use.name
                yield dataclasses.replace(use, name=name) if named else use


def specs_for(items: Union[Item, Iterable[Item]], max_tokens: Optional[int] = None) -> list[KernelSpec]:
    """Every kernel the GEMMs of ``items`` can select, at any token count up to ``max_tokens``
    (every count when None).

    Parameters
    ----------
    items : PackedWeight, QuantLinear, nn.Module, WeightUse, or an iterable of them
        See :func:`uses_of`.
    max_tokens : int, optional
        The largest M the model will be called with (tokens per call: batch x sequence).

    Returns
    -------
    list of KernelSpec
        Without repeats, sorted by name: ``{select_spec(m, w, activation)}`` for every weight
        and one M per token bucket, on any GPU (:func:`mixgemm.dispatch.heuristic.select_specs_any_gpu`);
        :func:`moe_specs_for` of every ExpertsUse; and the kernel specs that the modules report.
    """
    ms = token_counts(max_tokens)
    uses = _kernel_uses(items)
    specs: dict[str, KernelSpec] = {}
    for use in set(use for use in uses if isinstance(use, WeightUse)):
        w = use.meta_weight()
        activation = use.kernel_activation
        for m in ms:
            specs.update((spec.name, spec) for spec in
                         select_specs_any_gpu(m, w, None if activation is Activation.NONE else activation.value))
    for use in uses:
        if isinstance(use, ExpertsUse):
            specs.update((spec.name, spec) for spec in moe_specs_for(use, max_tokens))
        elif isinstance(use, KernelSpec):
            specs[use.name] = use
    return [specs[name] for name in sorted(specs)]


def moe_specs_for(use: Union[ExpertsUse, torch.nn.Module], max_tokens: Optional[int] = None) -> list[KernelSpec]:
    """Every kernel a MoE layer (an :class:`ExpertsUse`, or a :class:`~mixgemm.nn.moe.QuantMoE`)
    can launch for up to ``max_tokens`` tokens (any number when None): for every row count
    ``T * topk`` (at most ``max_tokens * E``), the grouped kernel of gate/up (swiglu) and of down
    (:func:`mixgemm.moe.grouped_spec_for`: QuantMoE's forward) and those of
    :func:`mixgemm.moe.plan_fused_moe` (both piecewise constant in the rows per expert, so one
    row count per piece is enough), the layout kernel where the grouped GEMM runs, and the routing
    kernels (int32 and int64 ids) and combine kernels (float32, bf16 and fp16 routing weights) of
    its activation type. Sorted by name, without repeats."""

    if not isinstance(use, ExpertsUse):
        use = ExpertsUse.of_layer(use)
    e, h, i = use.num_experts, use.hidden, use.intermediate

    per_expert = {1, SPLIT_FROM_ROWS, moe.TILES_FROM_ROWS_LONG_K, moe.TILES_FROM_ROWS, moe.TILE128_FROM_ROWS,
                  moe.TILE256_FROM_ROWS}
    rows = set(range(1, 17)) | {e * r for r in per_expert}
    if max_tokens is not None:
        rows = {r for r in rows if r <= max_tokens * e} or {1}
    specs: dict[str, KernelSpec] = {}
    for r in sorted(rows):
        # QuantMoE's forward (one grouped_gemm per GEMM) and fused_moe's plans
        chosen = [moe.grouped_spec_for(r, use.act, use.weight_type, activation, e, n, k)
                  for activation, n, k in (("swiglu", 2 * i, h), (None, h, i))]
        for spec in chosen + list(moe.plan_fused_moe(r, use.act, use.weight_type, e, h, i).specs):
            specs[spec.name] = spec
            if spec.kind is KernelKind.GROUPED_GEMM:
                specs[MoeLayoutSpec().name] = MoeLayoutSpec()
    for ids in (torch.int32, torch.int64):
        for weights in (torch.float32, torch.bfloat16, torch.float16):
            specs.update((spec.name, spec) for spec in routing_specs(use.act, ids, weights))
    return [specs[name] for name in sorted(specs)]


def build_for(items: Union[Item, Iterable[Item]], max_tokens: Optional[int] = None, *, jobs: Optional[int] = None,
              progress: bool = True, force: bool = False, launcher: bool = True) -> list:
    """Build (or find in the cache) every kernel of :func:`specs_for` in parallel, and the
    compiled launcher, before the first call needs them.

    Parameters
    ----------
    items, max_tokens
        As for :func:`specs_for` (``from_pretrained(..., prebuild=True)`` passes the model).
    jobs : int, optional
        Parallel nvcc builds (default: half the CPU cores; a GEMM kernel's build takes about
        5 GB of memory and 65-100 s).
    progress : bool
        A progress bar over the kernels.
    force : bool
        Rebuild even what is cached.
    launcher : bool
        Also build the compiled launcher (``csrc/launcher.cpp``), unless ``MIXGEMM_LAUNCHER``
        is ``python``, and the torch operator library (``csrc/torch_ops.cpp``: the C++ kernel
        that torch.compile's graphs call), unless ``MIXGEMM_TORCH_OPS`` is ``python`` or this
        torch has no CUDA; they build while the kernels do.

    Returns
    -------
    list of mixgemm.jit.build.Artifacts
        The kernels' cache entries, in :func:`specs_for`'s order.

    Raises
    ------
    mixgemm.errors.BuildError
        A kernel failed to build (after the others finished), or the launcher did while
        ``MIXGEMM_LAUNCHER=compiled``; with ``auto`` a launcher that does not build is a
        warning (calls then launch from Python), as at run time.
    """

    specs = specs_for(items, max_tokens)
    outcome: dict[str, Any] = {}
    thread = None
    mode = launcher_mod.mode()
    if launcher and mode != "python":
        def build_launcher() -> None:
            try:
                outcome["path"] = launcher_mod.build_compiled()
            except (BuildError, OSError) as e:
                outcome["error"] = e
                return
            if torch_ops.mode() != "python" and not torch_ops.available():
                try:
                    torch_ops.build()
                except (BuildError, OSError) as e:
                    outcome["torch_ops_error"] = e

        thread = threading.Thread(target=build_launcher, name="mixgemm-launcher-build", daemon=True)
        thread.start()
    try:
        arts = build.build_many(specs, jobs=jobs, force=force, progress=progress) if specs else []
    finally:
        if thread is not None:
            thread.join()
    if "error" in outcome:
        if mode == "compiled":
            raise BuildError(f"the kernels are built, but not the compiled launcher: {outcome['error']}")
        build.log.warning("mixgemm: the compiled launcher did not build (%s); calls will launch from Python",
                          str(outcome["error"]).splitlines()[0])
    if "torch_ops_error" in outcome:
        if torch_ops.mode() == "compiled":
            raise BuildError(f"the kernels are built, but not the torch operator library: {outcome['torch_ops_error']}")
        build.log.warning("mixgemm: the torch operator library did not build (%s); compiled graphs will call the "
                          "Python kernel", str(outcome["torch_ops_error"]).splitlines()[0])
    return arts
