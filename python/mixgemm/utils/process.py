"""Whether a process still runs: what decides that a temporary file or directory left by another
mixgemm process (a save, a kernel build) is stale and may be removed."""
from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """True unless no process ``pid`` exists on this host (a process of another user counts as
    alive: it cannot be signalled, but it may still own its files)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True
