"""What the commands share: the program's name, its exit statuses, argument types, byte counts."""
from __future__ import annotations

import argparse
import re
import signal

PROG = "mixgemm"
#: Exit statuses (see the module docstring).
EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


def fmt_bytes(n: int) -> str:
    """``1536`` -> ``"1.50 KiB (1,536 B)"``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} B)"
    return f"{n:,} B"


def group_size_arg(text: str):
    if text.lower() in ("channel", "per-channel", "k"):
        return "channel"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer (32, 64, 128, 256) or 'channel', got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def regex_arg(text: str) -> "re.Pattern[str]":
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"bad regular expression {text!r}: {e}") from None
