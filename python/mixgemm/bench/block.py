"""``mixgemm bench --block``: a LLaMA-3 8B MLP block (gate+up with swiglu, then down), bf16
against mixgemm int4, both under CUDA graphs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..nn.linear import QuantLinear
from ..weights.quantize import deinterleave_rows, dequantize_reference
from .grid import DEFAULT_MS, WEIGHT_STD, BenchConfig, relative_error
from .report import align, atomic_write_text
from .timing import flush_size, time_cuda

#: The block's shape: LLaMA-3 8B's hidden and intermediate sizes.
BLOCK_HIDDEN = 4096
BLOCK_INTERMEDIATE = 14336


@dataclasses.dataclass(frozen=True)
class BlockResult:
    m: int
    bf16_us: float
    mixgemm_us: float
    rel_err: float          # mixgemm block vs the bf16 block on the same dequantized weights

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.mixgemm_us


def bench_block(device: torch.device, ms: Sequence[int], iters: int, warmup: int,
                hidden: int = BLOCK_HIDDEN, intermediate: int = BLOCK_INTERMEDIATE,
                group_size: int = 128, seed: int = 0) -> list[BlockResult]:
    """Time ``down(silu(gate(x)) * up(x))`` in bf16 (three cuBLAS GEMMs and the elementwise op)
    and with mixgemm (:meth:`QuantLinear.from_gate_up`: one launch for gate, up and swiglu, then
    down: two launches at any M), each captured in a CUDA graph and replayed, L2 flushed before
    every replay. The bf16 block uses the very weights mixgemm dequantizes to, so the error is the
    kernels' alone."""

    torch.manual_seed(seed)
    dtype = torch.bfloat16
    gate = nn.Linear(hidden, intermediate, bias=False).to(device, dtype)
    up = nn.Linear(hidden, intermediate, bias=False).to(device, dtype)
    down = nn.Linear(intermediate, hidden, bias=False).to(device, dtype)
    for lin in (gate, up, down):
        lin.weight.data.normal_(0, WEIGHT_STD)
    q_gu = QuantLinear.from_gate_up(gate, up, bits=4, group_size=group_size)
    q_down = QuantLinear.from_linear(down, bits=4, group_size=group_size)
    # the bf16 block on the dequantized weights
    deq_gate, deq_up = deinterleave_rows(dequantize_reference(q_gu.packed))
    gate.weight.data.copy_(deq_gate)
    up.weight.data.copy_(deq_up)
    down.weight.data.copy_(dequantize_reference(q_down.packed))
    del deq_gate, deq_up

    def bf16_block(x):
        return down(torch.nn.functional.silu(gate(x)) * up(x))

    def mixgemm_block(x):
        return q_down(q_gu(x))

    flush = flush_size(torch.cuda.get_device_properties(device).L2_cache_size)
    out: list[BlockResult] = []
    for m in ms:
        x = torch.randn(m, hidden, device=device, dtype=dtype)
        times = {}
        outputs = {}
        with torch.no_grad():
            for name, fn in (("bf16", bf16_block), ("mixgemm", mixgemm_block)):
                fn(x)                                     # warm-up: loads the kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = fn(x)
                stats = time_cuda(graph.replay, iters, warmup, flush, device=device)
                times[name] = stats.median_us
                outputs[name] = y.clone()
                del graph
        err = relative_error(outputs["mixgemm"].float(), outputs["bf16"].double())
        out.append(BlockResult(m, times["bf16"], times["mixgemm"], err))
    return out


def run_block_cli(cfg: BenchConfig, device: torch.device, log: Callable[[str], None]) -> int:
    ms = cfg.ms if tuple(cfg.ms) != tuple(DEFAULT_MS) else (1,)
    props = torch.cuda.get_device_properties(device)
    log(f"mixgemm bench --block on {props.name}: LLaMA MLP hidden {BLOCK_HIDDEN}, intermediate "
        f"{BLOCK_INTERMEDIATE}, int4 g{cfg.group_size} asymmetric, CUDA graphs, median of {cfg.iters} replays")
    results = bench_block(device, ms, cfg.iters, cfg.warmup, group_size=cfg.group_size, seed=cfg.seed)
    rows = [("M", "bf16 us", "mixgemm us", "speedup", "rel err")]
    rows += [(str(r.m), f"{r.bf16_us:.1f}", f"{r.mixgemm_us:.1f}", f"{r.speedup:.2f}x", f"{r.rel_err:.1e}")
             for r in results]
    for line in align(rows, [True] * 5):
        log(line)
    if cfg.json_path:
        payload = {"gpu": props.name, "block": {"hidden": BLOCK_HIDDEN, "intermediate": BLOCK_INTERMEDIATE,
                                                 "bits": 4, "group_size": cfg.group_size},
                   "results": [dict(dataclasses.asdict(r), speedup=r.speedup) for r in results]}
        atomic_write_text(Path(cfg.json_path), json.dumps(payload, indent=1))
        log(f"wrote {cfg.json_path}")
    bad = [r for r in results if not r.rel_err < 5e-2]
    return 1 if bad else 0


__all__ = ["BLOCK_HIDDEN", "BLOCK_INTERMEDIATE", "BlockResult", "bench_block", "run_block_cli"]
