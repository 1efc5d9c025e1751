#!/usr/bin/env python3
"""mixgemm.hf.from_pretrained with tensor parallelism on two GPUs, as a user runs it::

    torchrun --nproc-per-node 2 tests/gpu/hf_tp_check.py --dir /tmp/tp_ckpts --json hf_tp.json

Rank 0 writes tiny LLaMA checkpoints (tests/hf_checkpoints.py) into ``--dir``; every rank loads
each one whole (``tp_size=1``) and split (``tp_rank=rank, tp_size=2``) on its own GPU
(``cuda:LOCAL_RANK``) and runs one forward of the same tokens through both with the real kernels
and NCCL. The split model's logits must match the whole model's within ``--max-error``
(relative; the two differ only in how the row-parallel products are summed and rounded), and
be the same on every rank. ``--cpu``: gloo and a reference GEMM instead (the CPU test suite
runs it). Exit status 0 when every check passes, 1 otherwise; rank 0 writes ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from dist_worker import exit_without_teardown, process_group  # noqa: E402

#: fp16 u4/g64 (AWQ), bf16 s4/g64 (compressed-tensors), bf16 u4/g64 + s8/g128 (mixgemm): the
#: kernels tests/hf/test_gpu_hf.py builds too
KINDS = ("awq", "ct-sym", "mixgemm")


def reference_forward(self, x):
    import torch.nn.functional as F

    from mixgemm.weights.quantize import GATE_UP_STRIPE, dequantize_reference

    if self.perm is not None:
        x = x.index_select(-1, self.perm)
    y = x.double() @ dequantize_reference(self.packed).double().T
    if self.bias is not None:
        y = y + self.bias.double()
    if self.activation == "swiglu":
        pairs = y.view(*y.shape[:-1], -1, 2, GATE_UP_STRIPE)
        y = (F.silu(pairs[..., 0, :]) * pairs[..., 1, :]).reshape(*y.shape[:-1], -1)
    return y.to(x.dtype)


def run(args) -> int:
    with process_group("gloo" if args.cpu else "nccl"):          # a barrier, then destroy
        return _check(args)


def _check(args) -> int:
    """Every rank's checks in the process group; 0 when all pass, else 1."""
    import torch.distributed as dist

    import hf_checkpoints as hc
    from mixgemm import hf

    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if rank == 0:
        for kind in args.kinds:
            hc.WRITERS[kind](args.dir / kind)
    dist.barrier()
    ids = hc.input_ids(batch=1, length=8).to(device)
    results, ok = {}, True
    for kind in args.kinds:
        path = args.dir / kind
        with torch.no_grad():
            whole = hf.from_pretrained(path, device=device, attn_implementation="sdpa")
            want = whole(ids).logits.float()
            del whole
            split = hf.from_pretrained(path, device=device, attn_implementation="sdpa", tp_rank=rank, tp_size=world)
            got = split(ids).logits.float()
        err = float((got.double() - want.double()).norm() / want.double().norm())
        gathered = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(gathered, got)
        same = all(torch.equal(g, got) for g in gathered)
        errs = [None] * world
        dist.all_gather_object(errs, err)
        passed = same and max(errs) <= args.max_error
        ok = ok and passed
        results[kind] = {"rel_err": errs, "same_on_every_rank": same, "ok": passed,
                         "summary": str(split.mixgemm_summary)}
        if rank == 0:
            print(f"{kind}: split logits vs whole: rel err {max(errs):.2e} (bar {args.max_error:g}), "
                  f"same on every rank: {same} -> {'OK' if passed else 'FAILED'}")
        del split
    if rank == 0 and args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"schema": "mixgemm.hf_tp_check/1", "tp": world, "cpu": args.cpu,
                                         "kinds": results, "ok": ok}, indent=2) + "\n")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="where rank 0 writes the tiny checkpoints")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), help=f"checkpoints (default {' '.join(KINDS)})")
    p.add_argument("--max-error", type=float, default=1e-2, help="bar on the relative error of the logits")
    p.add_argument("--cpu", action="store_true", help="gloo and a reference GEMM, on the CPU")
    args = p.parse_args(argv)
    import hf_checkpoints as hc

    bad = [k for k in args.kinds if k not in hc.WRITERS]
    if bad:
        p.error(f"unknown --kinds {bad}; choose from {sorted(hc.WRITERS)}")
    if args.cpu:
        from unittest import mock

        from mixgemm.nn import QuantLinear
        with mock.patch.object(QuantLinear, "forward", reference_forward):
            return run(args)
    return run(args)


if __name__ == "__main__":
    # no interpreter teardown, where CPU gloo may abort after all has passed (tests/dist_worker.py)
    exit_without_teardown(main())
