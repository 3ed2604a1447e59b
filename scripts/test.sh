#!/usr/bin/env bash
# Builds kvfuse and runs every test (ctest). GPU tests, when built, skip with a
# message on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
jobs=${KVFUSE_JOBS:-$(nproc)}
# Every test has a TIMEOUT of its own (tests/CMakeLists.txt, tests/gpu/CMakeLists.txt),
# which wins over --timeout: this bound reaches only a test added without one.
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 120
