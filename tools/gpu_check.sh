#!/usr/bin/env bash
# The whole GPU verification in one device call (its time is short; budget ~6 minutes):
#   1. build plugins/cuda for the local GPU;
#   2. the kernel tests (random order, poisoned workspaces) against PyTorch;
#   3. compute-sanitizer initcheck on the decode tests (must report 0 errors);
#   4. decode attention bandwidth vs SDPA (tools/bench_paged_attention.py);
#   5. end to end (tools/bench_gpu.py): the cuda backend on the smollm2-135m shape and the bundled pair — parity
#      with the CPU engine, TTFT, decode, aggregate, speculation, transformers beside it, the API.
# Run from the repository root on the GPU machine; carry .whl (tools/gpu_wheels.sh) for runtime serve's packages:
#   bash tools/gpu_check.sh            # logs and JSON land in $OUT (or /tmp/qs-gpu)
#   QS_GPU_STEPS="tests e2e" bash tools/gpu_check.sh     # some of: tests initcheck bandwidth e2e (build always)
set -o pipefail
OUT=${OUT:-/tmp/qs-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 QS_CUDA_BUILD=$PWD/build/gpu QS_CUDA_LIBRARY=$PWD/build/gpu/libqs_cuda.so
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
t0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
STEPS=" ${QS_GPU_STEPS:-tests initcheck bandwidth e2e} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
stamp build
cmake -S . -B build/gpu -DQS_BUILD_PYTHON=OFF -DQS_BUILD_CUDA=ON -DQS_CUDA_ARCHS=90 > "$OUT/build.log" 2>&1 &&
  cmake --build build/gpu -j "$(nproc)" >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
stamp "kernel tests"
want tests && python3 -m pytest -q -p no:cacheprovider -rs tests/plugins/test_cuda_gpu.py tests/plugins/test_cuda_api.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -5
stamp initcheck
want initcheck && QS_TEST_POISON=0 compute-sanitizer --tool initcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider -x \
  tests/plugins/test_cuda_gpu.py -k "decode" > "$OUT/initcheck.log" 2>&1
want initcheck && grep -E "ERROR SUMMARY|passed|failed" "$OUT/initcheck.log" | tail -3
stamp bandwidth
want bandwidth && python3 tools/bench_paged_attention.py --lib build/gpu/libqs_cuda.so --out "$OUT/paged_attention.json" \
  > "$OUT/bench.log" 2>&1 && tail -22 "$OUT/bench.log"
stamp "end to end"
want e2e && python3 tools/bench_gpu.py --out "$OUT/gpu_serving.json" ${QS_BENCH_ARGS:-} 2>&1 | tee "$OUT/e2e.log" \
  | grep -E "^\[|checkpoint|Error|error" | cut -c1-400
stamp done
