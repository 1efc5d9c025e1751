"""Where mixgemm writes a file, and how. Every writer (:func:`mixgemm.save`, ``mixgemm prepack``,
``mixgemm generate --out``, ``mixgemm cache export``) checks its target with :func:`check_target`
before any work and writes it with :func:`replacing`.

* :func:`check_target` refuses, in one line, a path that must not be written: an empty path, a
  path ending in ``/``, a path whose directory is missing or is not a directory, a directory, and
  anything that exists and is not a regular file (a device node, a FIFO, a socket; symlinks are
  followed). An existing regular file is replaced only where the caller allows it (``--force``).
* :func:`replacing` writes under a temporary name in the target's directory,
  ``.<name>.<pid>.<random>.tmp`` (a file, or a private directory for writers that make temporary
  files of their own next to the file they write, as safetensors does), flushes it to disk, checks
  the target once more and renames the temporary over it (``os.replace``): readers see the old
  file or the complete new one, never a half-written file. An exception, KeyboardInterrupt
  (SIGINT), SIGTERM or SIGHUP (a closed terminal) removes the temporary; the two signals are then
  raised again, so that the process ends as it would have. A process killed outright (SIGKILL)
  cannot clean up: the next write to the same target removes every temporary of a process that no
  longer runs on this machine (:func:`stale_temporaries`).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from typing import Iterator, Union

from ..errors import OutputPathError
from .process import pid_alive

__all__ = ["check_target", "replacing", "stale_temporaries", "current_umask"]

PathLike = Union[str, os.PathLike]


class _NoDirectory(OutputPathError, FileNotFoundError):
    """The target's directory does not exist."""


class _IsDirectory(OutputPathError, IsADirectoryError):
    """The target is a directory."""


class _Exists(OutputPathError, FileExistsError):
    """The target exists and the caller does not replace files."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_existing(path: str, shown: str) -> bool:
    """Raise if ``path`` exists and is not a regular file; True if it is one, False if it does
    not exist."""
    try:
        st = os.stat(path)                 # follows symlinks: what a write would reach
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        return False                       # reported by the directory check
    except OSError as e:
        raise OutputPathError(f"cannot write {shown}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise _IsDirectory(f"cannot write {shown}: it is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"cannot write {shown}: it is {_kind(st.st_mode)}; mixgemm writes and "
                              f"replaces regular files only")
    return True


def check_target(path: PathLike, *, replace: bool = True) -> str:
    """Refuse, before any work, a path that a writer must not write.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write.
    replace : bool, default True
        Whether an existing regular file may be replaced (``--force`` on the command line).

    Returns
    -------
    str
        ``os.fspath(path)``.

    Raises
    ------
    mixgemm.errors.OutputPathError
        The path is empty or ends in ``/``; its directory does not exist (also a
        ``FileNotFoundError``) or is not a directory; it is a directory (also an
        ``IsADirectoryError``); it exists and is not a regular file (a device node, a FIFO, a
        socket); it is a regular file and ``replace`` is False (also a ``FileExistsError``; the
        message says to pass ``--force``).
    """
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise OutputPathError("cannot write '': the output path is empty")
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        if os.path.isdir(path):
            raise _IsDirectory(f"cannot write {path}: it is a directory")
        raise OutputPathError(f"cannot write {path}: a path ending in '{os.sep}' names a directory; "
                              f"give a file name")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        up = directory
        while up and not os.path.lexists(up) and os.path.dirname(up) != up:
            up = os.path.dirname(up)
        if os.path.lexists(up) and not os.path.isdir(up):
            raise OutputPathError(f"cannot write {path}: {up} is a file, not a directory")
        raise _NoDirectory(f"cannot write {path}: directory {directory} does not exist")
    if _refuse_existing(path, path) and not replace:
        raise _Exists(f"{path} exists; pass --force to replace it")
    return path


def current_umask() -> int:
    """The process's umask, read without changing it where the system allows."""
    try:  # Linux: read it without touching it
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _prefix(path: str) -> str:
    return f".{os.path.basename(path)}.{os.getpid()}."


def stale_temporaries(path: PathLike) -> list:
    """The temporaries that a write of ``path`` left behind when its process was killed outright:
    the files or directories ``.<name>.<pid>.<random>.tmp`` in ``path``'s directory whose process
    no longer runs on this machine. (A process of another machine writing to a shared directory
    cannot be checked; its temporary is removed too, which makes that write fail, never corrupts a
    file.)"""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(re.escape(f".{os.path.basename(path)}.") + r"(\d+)\.[^.]+\.tmp$")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        m = pattern.match(name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            found.append(os.path.join(directory, name))
    return sorted(found)


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while a temporary existed (raised by the handler that
    :func:`_cleanup_on_signals` installs, so that the temporary is removed on the way out)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


@contextlib.contextmanager
def _cleanup_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into an exception while the block runs (in the main thread, and
    only where the signal has its default action: a handler of the program's own, or an ignored
    SIGHUP under nohup, is left alone); after the block's clean-up, the signal is raised again
    with its default action."""
    installed = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is None:
                continue
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(sig) == signal.SIG_DFL:
                    signal.signal(sig, _raise_terminated)
                    installed.append(sig)

    def restore():
        for sig in installed:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, signal.SIG_DFL)
        installed.clear()

    try:
        yield
    except _Terminated as e:
        restore()
        os.kill(os.getpid(), e.signum)      # the default action: the process ends here
        raise SystemExit(128 + e.signum) from None
    finally:
        restore()


@contextlib.contextmanager
def replacing(path: PathLike, *, directory: bool = False) -> Iterator[str]:
    """Write ``path`` atomically: yield a temporary path to write, then rename it over ``path``.

    Parameters
    ----------
    path : str or os.PathLike
        The target, already accepted by :func:`check_target`.
    directory : bool, default False
        Yield ``<tmpdir>/<name>`` inside a private temporary directory (for writers that make
        temporary files of their own next to the file they write) instead of a temporary file.

    Yields
    ------
    str
        Where to write. The file is given the mode of a new file (``0o666`` less the umask),
        flushed to disk and renamed over ``path`` when the block ends normally; on an exception,
        KeyboardInterrupt, SIGTERM or SIGHUP it is removed and ``path`` is left as it was.

    Raises
    ------
    mixgemm.errors.OutputPathError
        The target became something other than a regular file while it was being written.
    """
    path = os.fspath(path)
    target_dir = os.path.dirname(os.path.abspath(path))
    for stale in stale_temporaries(path):
        _remove(stale)
    with _cleanup_on_signals():
        holder = None
        try:
            if directory:
                holder = tempfile.mkdtemp(prefix=_prefix(path), suffix=".tmp", dir=target_dir)
                tmp = os.path.join(holder, os.path.basename(path))
            else:
                fd, holder = tempfile.mkstemp(prefix=_prefix(path), suffix=".tmp", dir=target_dir)
                os.close(fd)
                tmp = holder
            yield tmp
            os.chmod(tmp, 0o666 & ~current_umask())
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            _refuse_existing(path, path)           # the target may have changed meanwhile
            os.replace(tmp, path)
            if not directory:
                holder = None
        finally:
            if holder is not None:
                _remove(holder)
    with contextlib.suppress(OSError):  # make the rename itself durable (best effort)
        dir_fd = os.open(target_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
