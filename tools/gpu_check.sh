#!/usr/bin/env bash
# Everything #8 must verify on a lent GPU, in one device call (its time is short):
#   build plugins/cuda for the local GPU, run the kernel tests against PyTorch, measure decode attention.
# Run from the repository root on the GPU machine (its image has PyTorch, onnx, CMake, nvcc, pytest):
#   bash tools/gpu_check.sh            # logs and paged_attention.json land in $OUT (or /tmp/qs-gpu)
set -o pipefail
OUT=${OUT:-/tmp/qs-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 QS_CUDA_BUILD=$PWD/build/gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
cmake -S . -B build/gpu -DQS_BUILD_PYTHON=OFF -DQS_BUILD_CUDA=ON -DQS_CUDA_ARCHS=90 > "$OUT/build.log" 2>&1 &&
  cmake --build build/gpu -j "$(nproc)" >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
python3 -m pytest -q -p no:cacheprovider -rs tests/plugins/test_cuda_gpu.py tests/plugins/test_cuda_api.py \
  2>&1 | tee "$OUT/gpu_tests.log"
python3 tools/bench_paged_attention.py --lib build/gpu/libqs_cuda.so --out "$OUT/paged_attention.json" \
  2>&1 | tee "$OUT/bench.log"
