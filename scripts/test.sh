#!/usr/bin/env bash
# Builds kvfuse and runs every test (ctest). GPU tests, when built, skip with a
# message on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
jobs=${KVFUSE_JOBS:-$(nproc)}
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900
