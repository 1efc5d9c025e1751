"""``mixgemm bench --host``: the host's cost of one call, beside the GPU's.

For ``mixgemm.gemm`` and ``QuantLinear.forward`` (4096 x 4096, u4 g128, kernel loaded), next to
``torch.nn.functional.linear`` (bf16) and torch's int4 kernel, at M = 1, 16 and 256, in one
process:

* ``host_us``: Python's time per call. The GPU is first put to sleep (``torch.cuda._sleep``) for
  longer than the whole loop takes to queue, so that no launch waits for the GPU; then
  :data:`HOST_CALLS` calls (well below the launch queue's depth) are timed with
  ``time.perf_counter``; the median per call over :data:`HOST_REPEATS` repeats is reported.
  ``queued`` says that in every repeat the GPU was still asleep when the last call had been
  queued (an event recorded after the sleep had not completed); if not, the sleep is doubled and
  the repeat redone (up to :data:`SLEEP_RETRIES` times).
* ``gpu_loop_us``: the GPU's time per call over the same loop (events before and after the
  calls, which all sat in the queue): back to back, the weight warm in L2 after the first call.
* ``gpu_us``: one call with the L2 flushed (:func:`.timing.time_cuda`), as in a model, where the
  other layers' weights pass through L2 in between.

**Compiled modes.** Each op also runs as a chain of :data:`HOST_CHAIN` calls (the output of one
the input of the next, as a model's layers) inside one function, eagerly and compiled with
``torch.compile(fullgraph=True)`` in the default mode and in ``mode="reduce-overhead"`` (CUDA-graph
trees), at M = 1: ``F.linear`` (bf16) beside ``QuantLinear``, ``mixgemm.gemm``, ``QuantMoE``,
``rms_norm`` and ``rotary_kv_cache`` (:data:`CHAIN_IMPLS`). Their times are per call in the chain
(the loop's time divided by the chain's length); ``mode`` and ``chain`` say which. A compiled
call's host time includes its share of the compiled function's guards and wrapper.

A loop is host-bound when ``host_us`` exceeds the GPU's time per call (``bound``). The run also
times the eager decode step of the ``llama3-8b`` layer stack (:mod:`.model_run`) for bf16 and
mixgemm int4: the step time a user of eager PyTorch sees, beside the same step in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..aot.prebuild import specs_for
from ..dtypes import ActType, WeightType
from ..jit.specs import Activation
from ..nn.linear import QuantLinear
from ..nn.moe import QuantMoE
from ..ops import dense, rotary
from ..ops.dense import select_tile
from ..ops.norm import norm_spec, rms_norm
from ..ops.rotary import rope_spec
from ..weights import quantize
from ..weights.layout import prepack
from . import peers
from .grid import ERROR, OK, WEIGHT_STD
from .model import ModelConfig, ModelPoint, analyze_model, format_model_table
from .model_run import run_model
from .peer_formats import torch_int4_mm, torch_int4_pack
from .peers import prebuild_kernels, torch_int4_available
from .preset_report import point_to_dict
from .report import MachineInfo, align, fmt, gpu_line, machine_line, write_json_doc
from .timing import device_flush_size, time_cuda
from .variants import BF16, Variant, VariantKind

HOST_SCHEMA = "mixgemm.bench.host/1"
#: The layer timed per call: (N, K) = LLaMA-3 8B's o projection.
HOST_SHAPE = (4096, 4096)
HOST_MS = (1, 16, 256)
HOST_WEIGHT = WeightType.U4
HOST_GROUP_SIZE = 128
#: Calls per timed loop (the CUDA launch queue holds about a thousand), and loops per point.
HOST_CALLS = 200
HOST_REPEATS = 9
#: The first sleep (microseconds) before a loop; doubled when a loop outlasts it.
HOST_SLEEP_US = 20_000.0
SLEEP_RETRIES = 4
#: The longest sleep: a call that waits for the GPU itself (a host sync inside it) is never
#: queued behind any sleep, and is reported so (``queued`` False) rather than retried forever.
MAX_SLEEP_US = 1_000_000.0
HOST_IMPLS = ("F.linear", "torch-int4", "mixgemm.gemm", "QuantLinear")
#: The compiled modes: the ops chained HOST_CHAIN times in one function, at M = 1.
HOST_MODES = ("eager", "compile", "reduce-overhead")
HOST_CHAIN = 32
CHAIN_IMPLS = ("F.linear", "QuantLinear", "mixgemm.gemm", "QuantMoE", "rms_norm", "rotary_kv_cache")
#: the chained MoE layer (K = HOST_SHAPE's) and the rotary op's heads and cache
CHAIN_MOE = dict(experts=16, intermediate=1024, topk=2)
CHAIN_ROPE = dict(heads=32, kv_heads=8, head_dim=128, cache=2048)
#: The eager decode step: this preset, bf16 and mixgemm int4.
STEP_PRESET = "llama3-8b"
STEP_VARIANTS = (BF16, Variant(VariantKind.MIXGEMM, HOST_WEIGHT))


@dataclasses.dataclass(frozen=True)
class HostPoint:
    """One implementation at one M (times in microseconds per call)."""

    impl: str
    m: int
    n: int
    k: int
    status: str
    note: str = ""
    host_us: Optional[float] = None
    host_min_us: Optional[float] = None
    gpu_us: Optional[float] = None
    gpu_loop_us: Optional[float] = None
    bound: Optional[str] = None
    queued: Optional[bool] = None
    calls: int = HOST_CALLS
    repeats: int = HOST_REPEATS
    mode: str = "eager"
    chain: int = 1


def loop_bound(host_us: Optional[float], gpu_loop_us: Optional[float]) -> Optional[str]:
    """``"host"`` when a loop of calls is limited by Python (the host takes longer per call than
    the GPU back to back), else ``"gpu"``; None when either is unknown."""
    if host_us is None or gpu_loop_us is None:
        return None
    return "host" if host_us > gpu_loop_us else "gpu"


def sleep_cycles(sleep_us: float, cycles_per_us: float) -> int:
    """GPU clock cycles for ``torch.cuda._sleep`` to last ``sleep_us`` microseconds."""
    return max(1, int(sleep_us * cycles_per_us))


def host_point(impl: str, m: int, n: int, k: int, host_samples: Sequence[float], gpu_loop_samples: Sequence[float],
               gpu_us: Optional[float], queued: bool, calls: int = HOST_CALLS) -> HostPoint:
    """A point from the per-call host and GPU-loop times of each repeat (medians reported)."""
    host = statistics.median(host_samples)
    loop = statistics.median(gpu_loop_samples)
    return HostPoint(impl, m, n, k, OK, host_us=host, host_min_us=min(host_samples), gpu_us=gpu_us,
                     gpu_loop_us=loop, bound=loop_bound(host, loop), queued=queued, calls=calls,
                     repeats=len(host_samples))


@dataclasses.dataclass(frozen=True)
class HostReport:
    """A whole ``--host`` run: the per-call points and the decode step's."""

    machine: MachineInfo
    config: dict
    calls: list
    step: list


def host_report_to_dict(report: HostReport) -> dict:
    """The JSON document of a ``--host`` report."""
    return {"schema": HOST_SCHEMA, "machine": dataclasses.asdict(report.machine), "config": dict(report.config),
            "calls": [dataclasses.asdict(p) for p in report.calls],
            "step": [point_to_dict(p) for p in report.step]}


def host_report_from_dict(data: Mapping[str, Any]) -> HostReport:
    """Inverse of :func:`host_report_to_dict` (ValueError for another document)."""
    if data.get("schema") != HOST_SCHEMA:
        raise ValueError(f"not a {HOST_SCHEMA} document (schema {data.get('schema')!r})")
    return HostReport(MachineInfo(**data["machine"]), dict(data["config"]),
                      [HostPoint(**p) for p in data["calls"]], [ModelPoint(**p) for p in data["step"]])


def format_host_table(report: HostReport) -> str:
    """The calls' table, then the decode step's (us per step in each mode)."""
    lines = [gpu_line(report.machine), machine_line(report.machine), "",
             f"host time per call: {report.config.get('calls')} calls queued behind a GPU sleep, median of "
             f"{report.config.get('repeats')} loops; GPU time per call back to back (loop) and with the L2 "
             f"flushed (as in a model)"]
    rows = [["impl", "mode", "N x K", "M", "host us", "GPU us (loop)", "GPU us (flushed)", "bound", "queued",
             "x F.linear host", "status"]]
    notes = []
    linear = {(p.mode, p.m, p.chain): p.host_us for p in report.calls if p.impl == "F.linear"}
    for p in report.calls:
        base = linear.get((p.mode, p.m, p.chain))
        ratio = p.host_us / base if p.host_us and base else None
        mode = p.mode if p.chain == 1 else f"{p.mode} (chain {p.chain})"
        rows.append([p.impl, mode, f"{p.n}x{p.k}", str(p.m), fmt(p.host_us, ".1f"), fmt(p.gpu_loop_us, ".1f"),
                     fmt(p.gpu_us, ".1f"), p.bound or "-", "-" if p.queued is None else ("yes" if p.queued else "NO"),
                     fmt(ratio, ".2f", "x"), p.status])
        if p.note:
            notes.append(f"  {p.impl}{'' if p.chain == 1 else ' ' + p.mode} M={p.m}: {p.status}: {p.note}")
    lines += align(rows, [False, False, False, True, True, True, True, False, False, True, False]) + notes
    if report.step:
        lines += ["", f"decode step of the {STEP_PRESET} layer stack (us per step; eager = plain Python calls):"]
        rows = [["batch", "variant", "mode", "us/step", "us/layer", "x bf16", "status"]]
        for p in report.step:
            rows.append([str(p.batch), p.variant, p.mode, fmt(p.time_us, ".1f"), fmt(p.us_per_layer, ".1f"),
                         fmt(p.speedup_vs_bf16, ".2f", "x"), p.status])
        lines += align(rows, [True, False, False, True, True, True, False])
        lines += ["", format_model_table(report.step)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The GPU run
# ---------------------------------------------------------------------------------------------
def measure_cycles_per_us(device: torch.device, cycles: int = 10_000_000) -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep`` (its clock runs at the SM clock)."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return cycles / (start.elapsed_time(end) * 1e3)


def time_host_loop(fn: Callable[[], Any], calls: int, sleep: int) -> tuple[float, float, bool]:
    """One loop: the GPU sleeps ``sleep`` cycles, ``calls`` calls are queued and timed. Returns the
    host's and the GPU's microseconds per call and whether the GPU was still asleep when the last
    call had been queued."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    queued = not start.query()
    end.record()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls, start.elapsed_time(end) * 1e3 / calls, queued


def measure_host(fn: Callable[[], Any], impl: str, m: int, n: int, k: int, cycles_per_us: float, flush: int,
                 iters: int, warmup: int, calls: int = HOST_CALLS, repeats: int = HOST_REPEATS,
                 max_sleep_us: float = MAX_SLEEP_US) -> HostPoint:
    """:func:`time_host_loop` ``repeats`` times (a loop that outlasted its sleep is redone with a
    longer one, up to ``max_sleep_us``), and one call's GPU time with the L2 flushed."""
    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        sleep_us, hosts, loops, queued = HOST_SLEEP_US, [], [], True
        while len(hosts) < repeats:
            host, loop, ok = time_host_loop(fn, calls, sleep_cycles(sleep_us, cycles_per_us))
            retries = 0
            while not ok and retries < SLEEP_RETRIES and sleep_us < max_sleep_us:
                sleep_us = min(2 * sleep_us, max_sleep_us)
                retries += 1
                host, loop, ok = time_host_loop(fn, calls, sleep_cycles(sleep_us, cycles_per_us))
            queued &= ok
            hosts.append(host)
            loops.append(loop)
            if not ok:          # (it outlasted the longest sleep: it waits for the GPU; more repeats tell nothing)
                break
        gpu = time_cuda(fn, iters, warmup, flush).median_us
        return host_point(impl, m, n, k, hosts, loops, gpu, queued, calls)
    except Exception as e:
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return HostPoint(impl, m, n, k, ERROR, note=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def host_callables(w_float: torch.Tensor, impls: Sequence[str]) -> dict[str, Callable[[torch.Tensor], Any]]:
    """``{impl: f}`` with ``f(x)`` one call on ``x``, for the implementations of :data:`HOST_IMPLS`
    named in ``impls``; the weight ``w_float`` is quantized (u4 g128) and packed once here."""

    out: dict[str, Callable[[torch.Tensor], Any]] = {}
    qw = quantize.quantize(w_float, HOST_WEIGHT.bits, HOST_GROUP_SIZE, symmetric=HOST_WEIGHT.signed, dtype=torch.bfloat16)
    if "F.linear" in impls:
        w_bf16 = w_float.to(torch.bfloat16)
        out["F.linear"] = lambda x: torch.nn.functional.linear(x, w_bf16)
    if "torch-int4" in impls:
        packed_i4, sz = torch_int4_pack(qw)
        out["torch-int4"] = lambda x: torch_int4_mm(x, packed_i4, HOST_GROUP_SIZE, sz)
    if "mixgemm.gemm" in impls or "QuantLinear" in impls:
        packed = prepack(qw)
        layer = QuantLinear.from_packed(packed)
        out["mixgemm.gemm"] = lambda x: dense.gemm(x, packed)
        out["QuantLinear"] = layer
    return {name: f for name, f in out.items() if name in impls}


def chain_callables(device: torch.device, seed: int,
                    impls: Sequence[str] = CHAIN_IMPLS) -> tuple[dict[str, tuple], list]:
    """``({impl: (step, args)}, kernels)``: ``step(*args)`` runs :data:`HOST_CHAIN` calls of the
    op, each on the previous one's output where the shapes allow (the rotary op writes the same
    tokens again), at M = 1, for the implementations of :data:`CHAIN_IMPLS` named in ``impls``;
    ``kernels``: the mixgemm kernels they launch."""

    n, k = HOST_SHAPE
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(bf16)

    def chained(f):
        def step(x, *rest):
            for _ in range(HOST_CHAIN):
                x = f(x, *rest)
            return x
        return step

    x = rand(1, k)
    out: dict[str, tuple] = {}
    if "F.linear" in impls:
        w_bf16 = rand(n, k, scale=WEIGHT_STD)
        out["F.linear"] = (chained(lambda h: torch.nn.functional.linear(h, w_bf16)), (x,))
    if "QuantLinear" in impls or "mixgemm.gemm" in impls:
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=bf16)
        lin.weight.data = rand(n, k, scale=WEIGHT_STD)
        layer = QuantLinear.from_linear(lin, HOST_WEIGHT.bits, HOST_GROUP_SIZE, HOST_WEIGHT.signed)
        packed = layer.packed
        out["QuantLinear"] = (chained(layer), (x,))
        out["mixgemm.gemm"] = (chained(lambda h: dense.gemm(h, packed)), (x,))
    if "QuantMoE" in impls:
        e, i, topk = CHAIN_MOE["experts"], CHAIN_MOE["intermediate"], CHAIN_MOE["topk"]
        mlps = []
        for _ in range(e):
            mlp = torch.nn.Module()
            for name, (rows, cols) in (("gate_proj", (i, k)), ("up_proj", (i, k)), ("down_proj", (k, i))):
                lin = torch.nn.Linear(cols, rows, bias=False, device=device, dtype=bf16)
                lin.weight.data = rand(rows, cols, scale=WEIGHT_STD)
                setattr(mlp, name, lin)
            mlps.append(mlp)
        moe = QuantMoE.from_mlps(mlps, HOST_WEIGHT.bits, HOST_GROUP_SIZE, HOST_WEIGHT.signed)
        weights, ids = torch.softmax(torch.randn(1, e, generator=gen, device=device), -1).topk(topk, dim=-1)
        out["QuantMoE"] = (chained(moe), (x, weights.to(bf16), ids.to(torch.int32)))
    if "rms_norm" in impls:
        w = rand(k) + 1
        out["rms_norm"] = (chained(lambda h: rms_norm(h, w, 1e-5)), (x,))
    if "rotary_kv_cache" in impls:
        heads, kv, d, length = (CHAIN_ROPE[key] for key in ("heads", "kv_heads", "head_dim", "cache"))
        qkv = rand(1, 1, (heads + 2 * kv) * d)
        angles = torch.arange(length, device=device)[:, None] / 10000 ** (torch.arange(d, device=device) % (d // 2) / (d // 2))
        cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)
        caches = torch.zeros(2, 1, kv, length, d, device=device, dtype=bf16)
        torch._dynamo.mark_static_address(caches)   # a KV cache, as transformers' static cache marks its own
        positions = torch.full((1, 1), 7, device=device, dtype=torch.int64)

        def rope(q):    # q is only threaded through: every call rotates the same token
            return rotary.rotary_kv_cache(qkv, cos, sin, caches[0], caches[1], positions, heads, kv)
        out["rotary_kv_cache"] = (chained(rope), (qkv,))
    modules = [m for m in (locals().get("layer"), locals().get("moe")) if m is not None]
    kernels = (specs_for(modules, max_tokens=1) if modules else []) + [norm_spec(bf16, False), rope_spec(bf16)]
    return {name: v for name, v in out.items() if name in impls}, kernels


def run_host_modes(device: torch.device, modes: Sequence[str], iters: int, warmup: int, seed: int,
                   log: Callable[[str], None] = print, impls: Sequence[str] = CHAIN_IMPLS) -> list[HostPoint]:
    """The chained ops (:func:`chain_callables`) in each of ``modes`` (:data:`HOST_MODES`):
    per-call host and GPU times (the chain's divided by its length)."""

    from torch._dynamo.utils import counters   # (Dynamo takes 1.3 s to import: not for every `mixgemm` command)

    chains, kernels = chain_callables(device, seed, impls)
    prebuild_kernels(kernels, log)
    cycles_per_us = measure_cycles_per_us(device)
    flush = device_flush_size(device)
    n, k = HOST_SHAPE
    calls = max(1, HOST_CALLS // HOST_CHAIN)
    points: list[HostPoint] = []
    for impl, (step, args) in chains.items():
        for mode in modes:
            torch._dynamo.reset()
            counters.clear()
            if mode == "eager":
                fn = step
            else:
                compiled = torch.compile(step, fullgraph=True, dynamic=False,
                                         mode=None if mode == "compile" else mode)
                fn = compiled
            with torch.no_grad():
                p = measure_host(lambda: fn(*args), impl, 1, n, k, cycles_per_us, flush, iters, warmup, calls=calls)
            note = p.note
            skips = counters["inductor"].get("cudagraph_skips", 0) if mode == "reduce-overhead" else 0
            if skips:
                note = (note + "; " if note else "") + f"CUDA graphs skipped {skips} time(s)"
            per = 1.0 / HOST_CHAIN
            p = dataclasses.replace(
                p, mode=mode, chain=HOST_CHAIN, note=note,
                host_us=None if p.host_us is None else p.host_us * per,
                host_min_us=None if p.host_min_us is None else p.host_min_us * per,
                gpu_us=None if p.gpu_us is None else p.gpu_us * per,
                gpu_loop_us=None if p.gpu_loop_us is None else p.gpu_loop_us * per)
            log(f"  {impl} {mode}: host {fmt(p.host_us, '.1f')} us per call, GPU {fmt(p.gpu_loop_us, '.1f')} us")
            points.append(p)
    return points


def host_kernel_specs(ms: Sequence[int] = HOST_MS) -> list:
    """The mixgemm kernels of the per-call part (the step's come from :mod:`.model_run`)."""

    n, k = HOST_SHAPE
    return list({s.name: s for s in (select_tile(m, n, k).spec(ActType.BF16, HOST_WEIGHT, Activation.NONE)
                                     for m in ms)}.values())


def run_host(device: torch.device, step_cfg: Optional[ModelConfig], iters: int, warmup: int, seed: int,
             read_bw_gbps: Optional[float], log: Callable[[str], None] = print,
             ms: Sequence[int] = HOST_MS, impls: Sequence[str] = HOST_IMPLS) -> tuple[list[HostPoint], list[ModelPoint]]:
    """The calls' points and the step's (None ``step_cfg``: no step)."""

    mix_ok, mix_why = peers.mixgemm_available()
    i4_ok, i4_why = torch_int4_available()
    unavailable = {**({} if mix_ok else {"mixgemm.gemm": mix_why, "QuantLinear": mix_why}),
                   **({} if i4_ok else {"torch-int4": i4_why})}
    if mix_ok and prebuild_kernels(host_kernel_specs(ms), log) is not None:
        unavailable.update({"mixgemm.gemm": "its kernels did not build", "QuantLinear": "its kernels did not build"})
    n, k = HOST_SHAPE
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device) * WEIGHT_STD
    cycles_per_us = measure_cycles_per_us(device)
    flush = device_flush_size(device)
    log(f"GPU sleep clock: {cycles_per_us:.0f} cycles/us")
    calls = host_callables(w, [i for i in impls if i not in unavailable])
    points: list[HostPoint] = []
    for m in ms:
        x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
        for impl in impls:
            if impl in unavailable:
                points.append(HostPoint(impl, m, n, k, "n/a", note=unavailable[impl]))
                continue
            f = calls[impl]
            p = measure_host(lambda: f(x), impl, m, n, k, cycles_per_us, flush, iters, warmup)
            log(f"  {impl} M={m}: host {fmt(p.host_us, '.1f')} us, GPU {fmt(p.gpu_loop_us, '.1f')} us (loop) "
                f"{fmt(p.gpu_us, '.1f')} us (flushed)")
            points.append(p)
    del calls
    step: list[ModelPoint] = []
    if step_cfg is not None:
        meas = run_model(step_cfg, device, log)
        step = analyze_model(meas, read_bw_gbps, step_cfg.max_error, step_cfg.group_size,
                             fp8_max_error=step_cfg.fp8_max_error)
    return points, step


def write_host_json(path, report: HostReport):
    """Write the report as JSON, atomically (creating the folder); returns the path."""
    return write_json_doc(path, host_report_to_dict(report))


__all__ = ["HOST_SCHEMA", "HOST_SHAPE", "HOST_MS", "HOST_WEIGHT", "HOST_GROUP_SIZE", "HOST_CALLS", "HOST_REPEATS",
           "HOST_IMPLS", "HOST_MODES", "HOST_CHAIN", "CHAIN_IMPLS", "chain_callables", "run_host_modes", "STEP_PRESET", "STEP_VARIANTS", "HostPoint", "loop_bound", "sleep_cycles", "host_point",
           "HostReport", "host_report_to_dict", "host_report_from_dict", "format_host_table",
           "measure_cycles_per_us", "time_host_loop", "measure_host", "host_callables", "host_kernel_specs",
           "run_host", "write_host_json"]
