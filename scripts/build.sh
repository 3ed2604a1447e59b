#!/usr/bin/env bash
# Configures and builds kvfuse into build/ (Release). Extra arguments go to cmake's
# configure step, e.g. scripts/build.sh -DKVFUSE_GPU=CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
"$(dirname "$0")/install-deps.sh"
jobs=${KVFUSE_JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j "$jobs"
