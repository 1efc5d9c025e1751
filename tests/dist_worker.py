"""How the tests' ``torch.distributed`` workers start and end (the ``mp.spawn`` workers of
tests/hf/test_hf_tp.py and tests/nn/test_tensor_parallel.py, and tests/gpu/hf_tp_check.py under
``torchrun``, which finds this module through the tests folder it puts on ``sys.path``).

Two ends that torch's CPU gloo backend (2.13) needs, both seen failing in CI:

* a barrier before ``destroy_process_group`` (:func:`process_group`): a rank that tore the group
  down while its peer's last collective was in flight aborted at interpreter exit in about 1 run
  in 4 ("terminate called without an active exception");
* no interpreter teardown (:func:`exit_without_teardown`): even after the barrier and the
  destroy, the teardown still aborted about 1 run in 30 (a still-joinable C++ thread).

A worker that fails raises before either, so that ``mp.spawn`` / ``torchrun`` report it.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, NoReturn, Optional


@contextlib.contextmanager
def process_group(backend: str = "gloo", *, rank: Optional[int] = None, world_size: Optional[int] = None,
                  port: Optional[int] = None) -> Iterator[None]:
    """``init_process_group(backend)`` for the body; then, when the body passed, a barrier (every
    rank done), and in any case ``destroy_process_group``.

    ``rank``, ``world_size`` and ``port`` (on 127.0.0.1) for an ``mp.spawn`` worker; none of them
    under ``torchrun``, which sets the environment.
    """
    import torch.distributed as dist

    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = {} if rank is None else {"rank": rank, "world_size": world_size}
    dist.init_process_group(backend, **ranks)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Flush stdout and stderr, then leave the process with ``code`` at once (``os._exit``): no
    interpreter teardown, where gloo may abort after all has passed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
