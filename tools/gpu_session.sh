#!/usr/bin/env bash
# One call of the device tool: set up, then run the GPU work named by the arguments.
#   tools/gpu_session.sh [build] [tests] [quick-tests] [sanitize] [bench] [bench-quick]
# Carry `.whl` (wheels from ../shared/gpu/wheels.sh) and `.gpu` (the kernel cache as
# .gpu/cache.tgz, built on the workstation). Everything it writes goes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/mixgemm-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1
export MIXGEMM_CACHE_DIR=/tmp/mixgemm-cache
mkdir -p "$MIXGEMM_CACHE_DIR"
[ -f .gpu/cache.tgz ] && tar xzf .gpu/cache.tgz -C "$MIXGEMM_CACHE_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
nvcc --version | tail -2 | tee -a "$OUT/gpu.txt"
rc=0
for step in "$@"; do
  echo "=== $step"
  case "$step" in
    build)   # a no-op when the carried cache matches; else builds what is missing, 16 at a time
      timeout 200 python3 -m mixgemm generate --build --jobs 16 2>&1 | tail -3 | tee "$OUT/build.log" || rc=1 ;;
    tests)
      MIXGEMM_GPU_REPORT="$OUT/gpu-report.json" timeout 300 python3 -m pytest -q --maxfail=25 -m gpu tests/ \
        -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -45 | tee "$OUT/gpu-tests.log" || rc=1 ;;
    quick-tests)
      MIXGEMM_GPU_TESTS=quick timeout 400 python3 -m pytest -q -x -m gpu tests/ -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu-tests.log" || rc=1 ;;
    sanitize)
      timeout 100 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize.py 2>&1 | tail -30 | tee "$OUT/sanitize.log" || rc=1 ;;
    bench)
      timeout 540 python3 -m mixgemm bench --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tail -120 | tee "$OUT/bench.log" || rc=1 ;;
    bench-quick)
      timeout 110 python3 -m mixgemm bench --iters 100 --shapes 28672x8192,4096x4096 --m 1,16,4096 \
        --impls mixgemm-u4,mixgemm-u2,mixgemm-s8,torch_int4 --json "$OUT/bench.json" 2>&1 | tail -40 | tee "$OUT/bench.log" || rc=1 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
