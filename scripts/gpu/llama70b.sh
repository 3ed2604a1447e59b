#!/usr/bin/env bash
# llama3-70b in FP8 on one GPU (an H200: ~68 GiB of FP8 weights, the rest for KV pages),
# from the bundle (scripts/gpu/bundle.sh with kvfuse-bench-engine, kvfuse-server,
# kvfuse-bench-serve and kvfuse-cli; carry .device-bundle.tar.xz along):
#   1. kvfuse-server with config/h200-llama3-70b-fp8.json (num_pages 0: the pool takes
#      what the weights and workspaces leave, less 4 GiB): its memory split as logged
#      (event=device_memory) and the loading time;
#   2. scripts/gpu/bench.sh engine-70b: the decode step at batch 1,8,32,64 x context
#      512,8192 against the roofline (a cell whose KV does not fit is skipped, saying so);
#   3. scripts/gpu/serve.sh with the same model and pool: Generate at $STREAMS streams
#      (default 32) for $SERVE_S seconds (default 20), ITL p50 against the in-process step.
# LLAMA70B_SKIP lists steps to leave out (e.g. "2 3"). Writes $OUT (or build-gpu-llama70b/):
# summary.txt, and llama70b.tgz with the steps' output (memory/, bench/, serve/). Exit 0
# when all ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-llama70b
skip=" ${LLAMA70B_SKIP:-} "
status=0
note "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1), $(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [[ $skip != *" 1 "* ]]; then
  mkdir -p "$out/memory"
  log="$out/memory/server.txt"
  t=$(date +%s)
  if start_server "$log" --config config/h200-llama3-70b-fp8.json --listen 127.0.0.1:50181; then
    note "server ready in $(($(date +%s) - t)) s"
    grep -E "event=(weights_loaded|device_memory|engine_ready)" "$log" | sed 's/^/  /' | tee -a "$summary"
    kill -TERM "$server_pid"
    wait "$server_pid"
  else
    note "FAIL: the server did not start"
    tail -5 "$log" | tee -a "$summary"
    status=1
  fi
fi
if [[ $skip != *" 2 "* ]]; then
  OUT="$out/bench" scripts/gpu/bench.sh engine-70b || status=1
  grep -vE '^gpu-bench: (machine|git)' "$out/bench/summary.txt" | tee -a "$summary" >/dev/null
fi
if [[ $skip != *" 3 "* ]]; then
  OUT="$out/serve" MODEL=llama3-70b-fp8 NUM_PAGES=0 STREAMS=${STREAMS:-32} SERVE_S=${SERVE_S:-20} FANOUT=on \
    ROUNDS=1 TOKENS=${TOKENS:-256} scripts/gpu/serve.sh || status=1
  tail -8 "$out/serve/summary.txt" | tee -a "$summary" >/dev/null
fi
# The device runner returns a few files: the summary, and the rest in one archive.
tar czf "$out/llama70b.tgz" -C "$out" $(cd "$out" && ls -d memory bench serve 2>/dev/null) &&
  rm -rf "$out/memory" "$out/bench" "$out/serve"
note "$( ((status == 0)) && echo DONE || echo FAIL)"
exit $status
