"""Session 11 (runs on commit b79b5f3, where the direct kernel exists): run ``mixgemm bench`` with the heuristic's M <= 8 choice set to a given decode
config ("dec8": the ring kernel, the shipped choice; "direct8": the register-direct kernel of
cutlass_ext/mixgemm/decode_direct.hpp), so that a whole decode step (``--model``) can be timed
with either kernel in separate processes, each with its own bf16 baseline.

    python benchmarks/experiments/session11/direct_heuristic.py direct8 --model llama3-8b ...
"""
import sys

from mixgemm import ops
from mixgemm.bench.command import main

label = sys.argv.pop(1)
assert label in ("dec8", "direct8"), label
ops._HEURISTIC = tuple((m, s, label if lab == "dec8" else lab) for m, s, lab in ops._HEURISTIC)
assert ops.select_tile(1, 4096, 4096).label == label
sys.exit(main())
