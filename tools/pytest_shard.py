"""A pytest plugin for running one suite as several processes (``tools/gpu_suite.py``).

Load it with ``-p pytest_shard`` (``tools/`` on ``sys.path``). It adds three options:

``--shard I/N``
    Keep the tests whose node id hashes (crc32) to ``I`` modulo ``N``; the N shards of a suite
    are disjoint and together hold every test, whatever the machine, worker count or order.
``--skip-done FILE``
    Deselect the node ids that FILE lists as done (a ``--record`` file of an earlier run: its
    passed and skipped tests), so that a run cut short can be resumed.
``--record FILE``
    Append ``outcome node-id`` for every test as it finishes (``passed``, ``failed``,
    ``skipped`` or ``error``), one line each, flushed at once: what a run did survives a kill.
    Under pytest-xdist only the controlling process writes.
"""
from __future__ import annotations

import zlib

import pytest

DONE = ("passed", "skipped")
SHARD = pytest.StashKey[tuple]()


def pytest_addoption(parser):
    group = parser.getgroup("shard", "run one suite as several processes")
    group.addoption("--shard", default=None, metavar="I/N", help="keep the tests whose node id hashes to I mod N")
    group.addoption("--skip-done", default=None, metavar="FILE",
                    help="deselect the tests that a --record FILE lists as passed or skipped")
    group.addoption("--record", default=None, metavar="FILE", help="append 'outcome node-id' per finished test")


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``; ValueError otherwise."""
    try:
        i, n = (int(p) for p in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (two integers), got {spec!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {spec}: need 0 <= I < N")
    return i, n


def in_shard(nodeid: str, i: int, n: int) -> bool:
    return zlib.crc32(nodeid.encode()) % n == i


def read_record(path) -> dict[str, str]:
    """``{node id: last outcome}`` of a ``--record`` file (a later line wins: a test run again)."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            outcome, _, nodeid = line.rstrip("\n").partition(" ")
            if nodeid:
                out[nodeid] = outcome
    return out


def pytest_configure(config):
    spec = config.getoption("--shard")
    if spec is not None:
        try:
            config.stash[SHARD] = parse_shard(spec)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    path = config.getoption("--record")
    if path and not hasattr(config, "workerinput"):   # (an xdist worker: its controller records)
        config.pluginmanager.register(Recorder(path), "pytest_shard_recorder")


def pytest_collection_modifyitems(config, items):
    keep, drop = list(items), []
    done_file = config.getoption("--skip-done")
    if done_file:
        done = {k for k, v in read_record(done_file).items() if v in DONE}
        drop += [it for it in keep if it.nodeid in done]
        keep = [it for it in keep if it.nodeid not in done]
    shard = config.stash.get(SHARD, None)
    if shard is not None:
        drop += [it for it in keep if not in_shard(it.nodeid, *shard)]
        keep = [it for it in keep if in_shard(it.nodeid, *shard)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class Recorder:
    """Appends each finished test's outcome to a file (registered by :func:`pytest_configure`)."""

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        outcome = None
        if report.when == "call":
            outcome = report.outcome
        elif report.when == "setup" and report.outcome != "passed":
            outcome = "skipped" if report.skipped else "error"
        elif report.when == "teardown" and report.failed:
            outcome = "error"
        if outcome is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"{outcome} {report.nodeid}\n")
