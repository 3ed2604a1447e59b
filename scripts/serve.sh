#!/usr/bin/env bash
# Builds kvfuse and runs it on the default config (CPU backend, tiny synthetic model).
# Extra arguments go to the program, e.g. scripts/serve.sh --set kv_write=unfused.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
if [[ -x build/kvfuse-server ]]; then
  exec build/kvfuse-server --config config/cpu-default.json "$@"
fi
exec build/kvfuse-run --config config/cpu-default.json "$@"
