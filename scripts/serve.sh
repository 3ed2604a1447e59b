#!/usr/bin/env bash
# Builds kvfuse-server and the clients the README calls it with (kvfuse-cli,
# kvfuse-bench-serve) — not the tests — and runs the server on the default config (CPU
# backend, tiny synthetic model). Extra arguments go to the server, e.g.
# scripts/serve.sh --set kv_write=unfused.
set -euo pipefail
cd "$(dirname "$0")/.."
targets="kvfuse-server kvfuse-cli kvfuse-bench-serve"
if [[ ! -x build/kvfuse-server ]]; then
  echo "serve.sh: first build of $targets: about 3 minutes on 2 cores (later builds are incremental)"
fi
KVFUSE_TARGETS="$targets" scripts/build.sh
exec build/kvfuse-server --config config/cpu-default.json "$@"
