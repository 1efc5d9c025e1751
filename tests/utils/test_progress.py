"""mixgemm.utils.progress.Elapsed: the indicator shown while a kernel compiles."""
import io
import re
import time

import pytest

from mixgemm.utils.progress import Elapsed


def test_terminal_line_counts_the_seconds():
    out = io.StringIO()
    with Elapsed("compiling k", out, tty=True, interval=0.02) as e:
        time.sleep(0.15)
    text = out.getvalue()
    updates = text.split("\r")
    assert updates[0] == "compiling k | 0 s"
    assert len(updates) >= 4 and all(re.fullmatch(r"compiling k [|/\-\\] \d+ s", u) for u in updates[1:-1])
    assert {u.split()[2] for u in updates[1:-1]} >= {"/", "-"}, "the spinner turns"
    assert re.fullmatch(r"compiling k: done in 0\.\d s *\n", updates[-1])
    assert 0.15 <= e.seconds < 5


def test_log_gets_a_start_a_heartbeat_and_an_end():
    out = io.StringIO()
    with Elapsed("compiling k", out, tty=False, quiet_interval=0.05):
        time.sleep(0.18)
    lines = out.getvalue().splitlines()
    assert lines[0] == "compiling k ..." and re.fullmatch(r"compiling k: done in 0\.\d s", lines[-1])
    assert 2 <= len(lines[1:-1]) <= 4 and all(re.fullmatch(r"  \.\.\. still working: \d+ s", ln) for ln in lines[1:-1])


@pytest.mark.parametrize("exc,word", [(RuntimeError, "failed"), (KeyboardInterrupt, "interrupted")])
def test_the_end_line_says_how_it_ended(exc, word):
    out = io.StringIO()
    with pytest.raises(exc):
        with Elapsed("compiling k", out, tty=False):
            raise exc()
    assert re.fullmatch(rf"compiling k \.\.\.\ncompiling k: {word} after 0\.\d s\n", out.getvalue())


def test_a_closed_stream_does_not_break_the_work():
    out = io.StringIO()
    out.close()
    for tty in (True, None):
        with Elapsed("compiling k", out, tty=tty, interval=0.01):
            time.sleep(0.03)
