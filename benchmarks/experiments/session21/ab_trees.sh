#!/usr/bin/env bash
# Session 21 (NOTES 27c, 27d): one GPU call that times a benchmark script on this tree and on a
# copy patched by a Python patch script, each build in its own kernel cache and each run in its
# own process, alternating base / variant / base / variant (the grouped decode kernels' time
# moves 3-10% with code they do not run, so a kernel change is measured against a base rebuilt
# and rerun in the same call).
#   usage (through the device tool, carrying .whl):
#   bash benchmarks/experiments/session21/ab_trees.sh PATCH.py KERNEL_REGEX BENCH.py
#   e.g. (from the repository root; paths relative to it)
#   bash benchmarks/experiments/session21/ab_trees.sh benchmarks/experiments/session21/trigger_patch.py \
#     "gdecode_bf16_u[42]_m8|moe_route_i64|moe_combine_bf16_wf32" benchmarks/experiments/session21/moe_routed_ab.py
# PATCH.py takes the copy's root as its argument; BENCH.py takes an output JSON path ($OUT/...).
set -euo pipefail
patch=$1 kernels=$2 bench=$3
OUT=${OUT:-/tmp/ab-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
root=$PWD
variant=/tmp/ab-variant
rm -rf "$variant" && mkdir -p "$variant" && cp -r cutlass_ext converters python benchmarks "$variant"/
python3 "$patch" "$variant"
nvidia-smi --query-gpu=name --format=csv,noheader
for run in base variant base2 variant2; do
  case $run in base*) src=$root;; *) src=$variant;; esac
  export PYTHONPATH=/tmp/site:$src/python MIXGEMM_CACHE_DIR=/tmp/ab-cache-$(basename "$src")
  python3 -m mixgemm generate --build --jobs 16 --kernels "$kernels" 2>&1 | tail -1
  echo "== $run"
  python3 "$root/$bench" "$OUT/ab-$run.json"
done
