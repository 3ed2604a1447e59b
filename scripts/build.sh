#!/usr/bin/env bash
# Configures and builds kvfuse into build/ (Release). Extra arguments go to cmake's
# configure step, e.g. scripts/build.sh -DKVFUSE_GPU=CUDA. KVFUSE_TARGETS (space-
# separated) builds only those targets and what they need, e.g. KVFUSE_TARGETS=kvfuse-server;
# the default is everything, tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
"$(dirname "$0")/install-deps.sh"
jobs=${KVFUSE_JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
targets=()
for t in ${KVFUSE_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build build -j "$jobs" "${targets[@]}"
