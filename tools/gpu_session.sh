#!/usr/bin/env bash
# One call of the device tool: set up, then run the GPU work named by the arguments.
#   tools/gpu_session.sh [build] [tests] [quick-tests] [sanitize] [bench] [bench-quick] [bench-model]
#                        [bench-model-smoke] [bench-host] [host] [decode-trace] [first-run] [installed-demo] [script] ...
#                        (each step is a case below)
# Carry `.whl` (wheels from ../shared/gpu/wheels.sh) and `.gpu` (the kernel cache as
# .gpu/cache.tgz or its 15 MiB parts .gpu/cache.part.*). Everything it writes goes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/mixgemm-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1
export MIXGEMM_CACHE_DIR=/tmp/mixgemm-cache
mkdir -p "$MIXGEMM_CACHE_DIR"
for t in .gpu/*.tgz; do [ -f "$t" ] && tar xzf "$t" -C "$MIXGEMM_CACHE_DIR"; done
# a cache split under the 16 MiB per-file limit of $OUT: split -b 15m cache.tgz .gpu/cache.part.
if ls .gpu/cache.part.* > /dev/null 2>&1; then cat .gpu/cache.part.* | tar xz -C "$MIXGEMM_CACHE_DIR"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
nvcc --version | tail -2 | tee -a "$OUT/gpu.txt"
rc=0
for step in "$@"; do
  echo "=== $step"
  case "$step" in
    build)   # a no-op when the carried cache matches; else builds what is missing, 16 at a time
      timeout 200 python3 -m mixgemm generate --build --jobs 16 2>&1 | tail -3 | tee "$OUT/build.log" || rc=1 ;;
    tests)   # the whole GPU suite on every GPU, resumable: on a warm machine the step goes on where it stopped
      suite=/tmp/mixgemm-gpu-suite; resume=; [ -f "$suite/record.txt" ] && resume=--resume
      timeout 590 python3 tools/gpu_suite.py --out "$suite" --deadline "${MIXGEMM_SUITE_DEADLINE:-500}" $resume \
        2>&1 | tail -40 | tee "$OUT/gpu-tests.log" || rc=1
      cp "$suite"/record.txt "$suite"/summary.json "$suite"/*.log "$OUT/" 2>/dev/null ;;
    quick-tests)
      MIXGEMM_GPU_TESTS=quick timeout 400 python3 -m pytest -q -x -m gpu tests/ -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu-tests.log" || rc=1 ;;
    sanitize)   # memory errors only: cuda-bindings' symbol lookups return expected API errors
      timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
        python3 tests/gpu/sanitize.py > "$OUT/sanitize.log" 2>&1 || rc=1; head -40 "$OUT/sanitize.log"; tail -5 "$OUT/sanitize.log" ;;
    retest)
      timeout 120 python3 -m pytest -q -m gpu tests/nn/test_gpu_nn.py "tests/ops/test_gpu_gemm.py::test_bad_inputs_raise_before_launch" \
        -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/retest.log" || rc=1 ;;
    pytest)    # the tests named by $MIXGEMM_PYTEST_ARGS
      MIXGEMM_GPU_REPORT="$OUT/gpu-report.json" timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
        --junitxml="$OUT/pytest.xml" $MIXGEMM_PYTEST_ARGS 2>&1 | tail -20 | tee "$OUT/pytest.log" || rc=1 ;;
    profile)   # profiler sections and SASS of the decode (M=1) and large (M=4096) kernels
      for m in 1 4096; do
        timeout 120 ncu --clock-control none --kernel-name regex:mixgemm_gemm --launch-skip 3 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
          --section Occupancy --section LaunchStats python3 tools/profile_kernels.py $m > "$OUT/ncu_m$m.txt" 2>&1 || rc=1
        grep -E "Duration|Throughput|DRAM|Registers|Stall|Issued|Eligible|Warp Cycles|Shared Memory Config|Achieved" "$OUT/ncu_m$m.txt" | head -40
      done
      for c in "$MIXGEMM_CACHE_DIR"/kernels/mixgemm_gemm_bf16_u4_t128x64x64*/kernel.cubin "$MIXGEMM_CACHE_DIR"/kernels/mixgemm_gemm_bf16_u4_t128x128x64*/kernel.cubin; do
        { echo "== $c"; cuobjdump -res-usage "$c"; cuobjdump -sass "$c" | grep -oE "^ +/\*[0-9a-f]{4}\*/ +[A-Z0-9_.]+" | awk '{print $2}' | sort | uniq -c | sort -rn | head -45; } >> "$OUT/sass.txt" 2>&1
      done; grep -E "REG|STACK|LDL|STL|HGMMA|LDS" "$OUT/sass.txt" | head -30 ;;
    profile-decode)   # ncu sections of the decode kernel (M=1, 16) and its SASS
      for m in 1 16; do
        timeout 100 ncu --clock-control none --kernel-name regex:mixgemm_decode --launch-skip 3 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
          --section Occupancy --section LaunchStats --section InstructionStats python3 tools/profile_kernels.py $m > "$OUT/ncu_dec_m$m.txt" 2>&1 || rc=1
        grep -E "Duration|Throughput|Registers|Stall|Issued|Eligible|Warp Cycles|Achieved|Block Limit|Executed Ipc|Grid Size|Waves" "$OUT/ncu_dec_m$m.txt" | head -40
      done
      for c in "$MIXGEMM_CACHE_DIR"/kernels/mixgemm_decode_bf16_s4_m8*/kernel.cubin; do
        cuobjdump -sass "$c" > "$OUT/sass_decode_s4_m8.txt" 2>&1
      done ;;
    bench)     # the full grid (impls and M overridable: gemlite's autotuning alone can take minutes)
      timeout ${MIXGEMM_BENCH_TIMEOUT:-540} python3 -m mixgemm bench ${MIXGEMM_BENCH_M:+--m $MIXGEMM_BENCH_M} \
        ${MIXGEMM_BENCH_IMPLS:+--impls $MIXGEMM_BENCH_IMPLS} --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 \
        | grep -v "mixgemm build" | tail -150 | tee "$OUT/bench.log" || rc=1 ;;
    bench-block)   # the LLaMA MLP block, bf16 vs mixgemm, under CUDA graphs
      timeout 200 python3 -m mixgemm bench --block --m 1,4,16 --iters 200 --json "$OUT/bench-block.json" 2>&1 \
        | grep -v "mixgemm build" | tail -12 | tee "$OUT/bench-block.log" || rc=1 ;;
    build-decode)   # the decode kernels only (seconds each), 16 at a time; packed for the workstation
      timeout 200 python3 -m mixgemm generate --build --jobs 16 --kernels "$MIXGEMM_BUILD_REGEX" 2>&1 | tail -2 || rc=1
      [ -n "${MIXGEMM_PACK:-}" ] && tar czf "$OUT/decode-cache.tgz" -C "$MIXGEMM_CACHE_DIR" kernels ;;
    sweep-decode)   # split-K x stage-size sweep of the decode kernels (tools/sweep_decode.py)
      timeout ${MIXGEMM_SWEEP_TIMEOUT:-200} python3 tools/sweep_decode.py "$OUT/sweep-decode.json" ${MIXGEMM_SWEEP_ARGS:-} \
        > "$OUT/sweep-decode.log" 2>&1 || rc=1; tail -3 "$OUT/sweep-decode.log" ;;
    decode-tests)
      MIXGEMM_GPU_REPORT="$OUT/gpu-report.json" timeout 300 python3 -m pytest -q --maxfail=10 -m gpu tests/ops/test_gpu_gemm.py \
        -k "decode" -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/decode-tests.log" || rc=1 ;;
    bench-decode)   # the decode kernels against cuBLAS and the peers at M <= 32
      timeout 300 python3 -m mixgemm bench --iters 100 --shapes ${MIXGEMM_BENCH_SHAPES:-28672x8192,4096x4096,8192x28672,57344x8192} \
        --m ${MIXGEMM_BENCH_M:-1,4,16,32} --impls ${MIXGEMM_BENCH_IMPLS:-mixgemm-u4,mixgemm-s4,mixgemm-u2,mixgemm-s8,torch_int4,gemlite-u4,gemlite-u2} \
        --json "$OUT/bench-decode.json" 2>&1 | tail -60 | tee "$OUT/bench-decode.log" || rc=1 ;;
    bench-quick)
      timeout 110 python3 -m mixgemm bench --iters 100 --shapes 28672x8192,4096x4096 --m 1,16,4096 \
        --impls mixgemm-u4,mixgemm-u2,mixgemm-s8,torch_int4 --json "$OUT/bench.json" 2>&1 | tail -40 | tee "$OUT/bench.log" || rc=1 ;;
    bench-model-smoke)   # the decoder stack, 2 layers, batch 1 and the prefill, every variant: structure and checks
      timeout 300 python3 -m mixgemm bench --model llama3-8b --layers 2 --batch 1 --quick --iters 5 \
        --json "$OUT/model-smoke.json" 2>&1 | grep -v "mixgemm build" | tail -45 | tee "$OUT/model-smoke.log" || rc=1 ;;
    bench-model)   # the decoder stack of $MIXGEMM_MODEL (default llama3-8b; a list or all), saved per preset
      timeout ${MIXGEMM_MODEL_TIMEOUT:-570} python3 -m mixgemm bench --model ${MIXGEMM_MODEL:-llama3-8b} \
        ${MIXGEMM_MODEL_ARGS:-} --save --results-dir "$OUT" 2>&1 | grep -v "mixgemm build" | tail -80 \
        | tee "$OUT/model.log" || rc=1 ;;
    bench-host)   # host us per call (mixgemm.gemm, QuantLinear, F.linear, torch int4) and the eager decode step
      timeout 300 python3 -m mixgemm bench --host --save --results-dir "$OUT" 2>&1 | grep -v "mixgemm build" \
        | tail -40 | tee "$OUT/host.log" || rc=1 ;;
    host)      # host time per GEMM call and per step, and the 8B-shaped eager decode stack (docs/host-overhead.md)
      timeout ${MIXGEMM_HOST_TIMEOUT:-500} python3 tools/profile_host.py --stack --json "$OUT/host-profile.json" 2>&1 \
        | grep -v "mixgemm build" | tee "$OUT/host-profile.log" || rc=1 ;;
    decode-trace)   # the decode kernel's phase trace of the llama3-8b projections and stack (tools/decode_trace.py, docs/decode.md)
      MIXGEMM_NVCC_FLAGS=-DMIXGEMM_DECODE_TRACE timeout ${MIXGEMM_SCRIPT_TIMEOUT:-300} python3 tools/decode_trace.py \
        "$OUT/decode-trace.json" ${MIXGEMM_TRACE_WEIGHTS:-u4,u2} 2>&1 | grep -v "mixgemm build" | tee "$OUT/decode-trace.log" || rc=1 ;;
    script)   # a one-off script: python3 $MIXGEMM_SCRIPT (e.g. tools/profile_kernels.py), output under $OUT
      timeout ${MIXGEMM_SCRIPT_TIMEOUT:-300} python3 $MIXGEMM_SCRIPT 2>&1 | grep -v "mixgemm build" | tee "$OUT/script.log" || rc=1 ;;
    first-run)   # issue #15: doctor and demo on an empty kernel cache (they compile: a progress line), then cached
      rm -rf /tmp/mixgemm-first
      for n in 1 2; do
        MIXGEMM_CACHE_DIR=/tmp/mixgemm-first timeout 200 python3 -m mixgemm doctor > "$OUT/doctor-$n.txt" 2>&1
        echo "exit status $?" >> "$OUT/doctor-$n.txt"
        MIXGEMM_CACHE_DIR=/tmp/mixgemm-first timeout 300 python3 -m mixgemm demo > "$OUT/demo-$n.txt" 2>&1
        echo "exit status $?" >> "$OUT/demo-$n.txt"
      done
      tail -n 16 "$OUT"/doctor-1.txt "$OUT"/doctor-2.txt "$OUT"/demo-1.txt "$OUT"/demo-2.txt ;;
    installed-demo)   # issue #15: the wheel in a fresh venv (no checkout on sys.path; deps through a .pth), run from /tmp
      ( set -e
        unset PYTHONPATH   # (the in-tree build's python/mixgemm.egg-info would pass for an installed mixgemm)
        rm -rf /tmp/dist /tmp/venv
        python3 -m pip wheel -q --no-deps --no-build-isolation -w /tmp/dist .
        python3 -m venv /tmp/venv
        /tmp/venv/bin/python -m pip install --no-deps --no-index /tmp/dist/mixgemm-*.whl
        ls /tmp/venv/bin
        site=$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' > "$site/deps.pth"
        echo /tmp/site >> "$site/deps.pth"
        cd /tmp && export MIXGEMM_CACHE_DIR=/tmp/mixgemm-installed
        timeout 200 /tmp/venv/bin/mixgemm doctor || echo "doctor: exit status $?"
        timeout 300 /tmp/venv/bin/mixgemm demo
      ) > "$OUT/installed-demo.txt" 2>&1 || rc=1
      echo "exit status $rc" >> "$OUT/installed-demo.txt"; tail -n 30 "$OUT/installed-demo.txt" ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
