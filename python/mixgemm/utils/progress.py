"""A progress indicator for long work that reports no progress of its own (an nvcc build).

On a terminal, one line that counts the seconds (``compiling ... | 12 s``), rewritten in place;
elsewhere (a log file, CI), a line when the work starts, one every ``quiet_interval`` seconds,
and one when it ends, so that a log shows what the process is doing without filling up.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional, TextIO

_SPIN = "|/-\\"


class Elapsed:
    """Context manager: show ``message`` with the elapsed time until the block ends.

    Parameters
    ----------
    message : str
        What is being done, e.g. ``"compiling mixgemm_gemm_..."``.
    stream : text stream, optional
        Where to write (default ``sys.stderr``).
    tty : bool, optional
        Rewrite one line in place (default: whether ``stream`` is a terminal).
    interval : float
        Seconds between two updates of the terminal line.
    quiet_interval : float
        Seconds between two "still ..." lines when not on a terminal.
    """

    def __init__(self, message: str, stream: Optional[TextIO] = None, *, tty: Optional[bool] = None,
                 interval: float = 0.25, quiet_interval: float = 15.0):
        self.message = message
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            try:
                tty = bool(self.stream.isatty())
            except (AttributeError, OSError, ValueError):
                tty = False
        self.tty = tty
        self.interval = interval
        self.quiet_interval = quiet_interval
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = 0.0

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):   # a closed or broken stream must not break the work
            pass

    def _tick(self) -> None:
        i = 1
        wait = self.interval if self.tty else self.quiet_interval
        while not self._stop.wait(wait):
            t = time.monotonic() - self._t0
            if self.tty:
                self._write(f"\r{self.message} {_SPIN[i % len(_SPIN)]} {t:.0f} s")
            else:
                self._write(f"  ... still working: {t:.0f} s\n")
            i += 1

    def __enter__(self) -> "Elapsed":
        if self.stream is not sys.stdout:   # what was printed before comes first in a shared log
            try:
                sys.stdout.flush()
            except (OSError, ValueError, AttributeError):
                pass
        self._t0 = time.monotonic()
        self._write(f"{self.message} {_SPIN[0]} 0 s" if self.tty else f"{self.message} ...\n")
        self._thread = threading.Thread(target=self._tick, name="mixgemm-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds = time.monotonic() - self._t0
        if exc_type is None:
            end = f"done in {self.seconds:.1f} s"
        else:
            what = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed"
            end = f"{what} after {self.seconds:.1f} s"
        line = f"{self.message}: {end}"
        # on a terminal, overwrite the whole spinner line (it may be longer than this one)
        self._write(f"\r{line:<{len(self.message) + 12}}\n" if self.tty else line + "\n")
