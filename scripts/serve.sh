#!/usr/bin/env bash
# Builds kvfuse-server (only the server and what it needs, not the tests) and runs it
# on the default config (CPU backend, tiny synthetic model).
# Extra arguments go to the program, e.g. scripts/serve.sh --set kv_write=unfused.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x build/kvfuse-server ]]; then
  echo "serve.sh: first build of kvfuse-server: about 2 minutes on 2 cores (later builds are incremental)"
fi
KVFUSE_TARGETS=kvfuse-server scripts/build.sh
exec build/kvfuse-server --config config/cpu-default.json "$@"
