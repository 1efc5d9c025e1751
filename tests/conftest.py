"""Shared test helpers. Registers nothing global (markers live in pyproject.toml).

Tests mirror the package: ``tests/<subpackage>/`` holds the tests of ``mixgemm.<subpackage>``
(GPU tests, ``test_gpu_*.py``, included); ``tests/tools/`` those of ``tools/`` and
``benchmarks/tp_bench.py``; this folder the package's face (README, wheel, API errors) and
the helper modules the tests share. Test folders have no ``__init__.py``: pytest puts each
test's folder and, when it loads this file, this folder on ``sys.path``, so every test
imports the helpers by name, and test files' names must be unique across folders.

GPU tests are marked ``@pytest.mark.gpu`` and take the ``requires_gpu`` fixture, which skips
them unless torch sees an sm_90 (Hopper) GPU.

``pin_case`` records a bad-input or fault case that a test has just asserted (its exit status
or exception, the first line of its message, what it left behind) into the JSON-lines file
named by ``$MIXGEMM_CASE_LOG``, when that is set; ``tools/case_table.py`` renders the case
table from such a run. Without the variable it does nothing.
"""
import json
import os
import re

import pytest
import torch

from mixgemm.dispatch import plans


def has_hopper_gpu() -> bool:
    """True when torch can use CUDA and device 0 is compute capability 9.0 (sm_90)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


@pytest.fixture
def requires_gpu():
    """Skip the test unless an sm_90 GPU is available; returns the CUDA device."""
    if not has_hopper_gpu():
        pytest.skip("needs an NVIDIA Hopper (sm_90) GPU")
    return torch.device("cuda", 0)


@pytest.fixture
def library(requires_gpu):
    """The torch operator library (:data:`mixgemm.dispatch.plans.OPERATORS`), loaded; on a GPU
    machine it must load."""
    lib = plans.OPERATORS.attach()
    if lib is None:
        pytest.fail("the torch operator library did not load on a GPU machine")
    return lib


@pytest.fixture
def pin_case(request):
    """``pin_case(group, case, call, outcome, first_line, leftovers="none")``: call it after the
    assertions, with the values they checked."""
    def pin(group: str, case: str, call: str, outcome: str, first_line: str, leftovers: str = "none"):
        log = os.environ.get("MIXGEMM_CASE_LOG")
        if log:
            # the test's temporary directory is noise in a table
            first = re.sub(r"/\S*?/pytest-\d+/[^/\s]+", "<tmp>", first_line)
            row = {"group": group, "case": case, "call": call, "outcome": outcome,
                   "first_line": first, "leftovers": leftovers, "test": request.node.nodeid}
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    return pin
