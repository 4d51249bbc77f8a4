#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks for `runtime serve` (cp312,
# manylinux, no dependencies resolved: the machine's image has the rest), into .whl/ (ignored by git).
# tools/gpu_check.sh installs them there when the device call carries .whl:
#   bash tools/gpu_wheels.sh && (device run, carry [".whl"]) bash tools/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
WHEELS="starlette==1.10.0 uvicorn==0.54.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
referencing==0.37.0 rpds-py==2026.9.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
grpcio==1.85.1 annotated-doc==0.0.7"
# A call carries 64 MiB, tracked files (~58.3 MB, the bundled models most of it) included. httptools is left out
# (uvicorn falls back to h11): its 0.55 MB put a call over. The openai client (openai, pydantic, pydantic_core,
# jiter, ...) does not fit either: tools/bench_gpu.py reads the same stream with httpx there.
PLATFORMS=""
for n in 17 24 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_2_${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS --platform manylinux2014_x86_64 --platform any -d .whl $WHEELS
du -sh .whl
