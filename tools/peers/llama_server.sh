#!/usr/bin/env bash
# Build llama.cpp's llama-server (and llama-quantize) from the sources vendored in the llama-cpp-python sdist, and
# GGUF files of a checkpoint, for side-by-side API benchmarks (tools/bench_serve.py --llama-server).
# Cached under $QS_PEERS (default ~/.cache/quicksilver/peers): a second run only converts what is missing.
# ~25 min on 2 cores the first time. Built for this CPU (GGML_NATIVE) but never with AMX tiles: ggml's AMX path
# crashed on our Sapphire Rapids hosts, so the peer we measure is llama.cpp's AVX-512 build (LLAMA_CMAKE_ARGS adds
# flags).
#
#   bash tools/peers/llama_server.sh CKPT_DIR [q8_0 q4_0 ...]     → prints the paths it built
set -euo pipefail
CKPT=$(cd "$1" && pwd); shift
QUANTS=${*:-q8_0 q4_0}
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=${QS_PEERS:-$HOME/.cache/quicksilver/peers}
mkdir -p "$PEERS"; cd "$PEERS"
PY=${PYTHON:-python3}

if ! ls -d sdist/llama_cpp_python-*/ >/dev/null 2>&1; then
  "$PY" -m pip download --no-binary :all: --no-deps llama-cpp-python -d sdist
  tar xzf sdist/llama_cpp_python-*.tar.gz -C sdist
fi
LLAMA=$(ls -d "$PEERS"/sdist/llama_cpp_python-*/vendor/llama.cpp | head -1)

if [ ! -x build/bin/llama-server ] || [ ! -x build/bin/llama-quantize ]; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"     # explicit -mno-* win over -march=native in GCC
  cmake -S "$LLAMA" -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
        ${LLAMA_CMAKE_ARGS:-} >/dev/null
  cmake --build build --target llama-server llama-quantize -j "${JOBS:-2}"
fi

NAME=$(basename "$CKPT")
mkdir -p gguf
"$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q sentencepiece   # the converter imports it for any Llama
if [ ! -f "gguf/$NAME-f32.gguf" ]; then
  "$PY" "$HERE/to_gguf.py" "$LLAMA" "$CKPT" --outfile "gguf/$NAME-f32.gguf" --outtype f32 >/dev/null
fi
for q in $QUANTS; do
  [ -f "gguf/$NAME-$q.gguf" ] || build/bin/llama-quantize "gguf/$NAME-f32.gguf" "gguf/$NAME-$q.gguf" "$q" >/dev/null 2>&1
done
echo "llama-server: $PEERS/build/bin/llama-server"
for q in $QUANTS; do echo "gguf $q: $PEERS/gguf/$NAME-$q.gguf"; done
