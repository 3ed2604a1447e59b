#!/usr/bin/env bash
# llama3-70b in FP8 on one GPU (an H200: ~68 GiB of FP8 weights, the rest for KV pages),
# from the bundle (scripts/gpu/bundle.sh with kvfuse-bench-engine, kvfuse-server,
# kvfuse-bench-serve and kvfuse-cli; carry .device-bundle.tar.xz along):
#   1. scripts/gpu/bench.sh engine-70b: the decode step at batch 1,8,32,64 x context
#      512,8192 against the roofline (a cell whose KV does not fit is skipped, saying so);
#   2. scripts/gpu/serve.sh with the model and a pool sized to fit (num_pages 0, as in
#      config/h200-llama3-70b-fp8.json): Generate at $STREAMS streams (default 32) for
#      $SERVE_S seconds (default 20), ITL p50 against the in-process step; the server's
#      loading time and memory split (event=device_memory) from its log.
# Each model load makes ~70 GB of synthetic weights on the host (about 200 s on a 16-core
# machine); step 1 loads once, step 2 twice, so on a runner with a 10-minute limit run
# them as two calls: LLAMA70B_SKIP="2", then LLAMA70B_SKIP="1". Writes $OUT (or
# build-gpu-llama70b/): summary.txt, and llama70b.tgz with the steps' output (bench/,
# serve/). Exit 0 when all ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-llama70b
skip=" ${LLAMA70B_SKIP:-} "
status=0
note "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1), $(date -u +%FT%TZ)"
if [[ $skip != *" 1 "* ]]; then
  OUT="$out/bench" scripts/gpu/bench.sh engine-70b || status=1
  grep -vE '^gpu-bench: (machine|git)' "$out/bench/summary.txt" | tee -a "$summary" >/dev/null
fi
if [[ $skip != *" 2 "* ]]; then
  OUT="$out/serve" MODEL=llama3-70b-fp8 NUM_PAGES=0 STREAMS=${STREAMS:-32} SERVE_S=${SERVE_S:-20} FANOUT=on \
    ROUNDS=1 TOKENS=${TOKENS:-256} scripts/gpu/serve.sh || status=1
  grep -hE "event=(weights_loaded|device_memory)" "$out"/serve/server-*.txt | sed 's/^/  /' | tee -a "$summary"
  tail -8 "$out/serve/summary.txt" | tee -a "$summary" >/dev/null
fi
# The device runner returns a few files: the summary, and the rest in one archive.
tar czf "$out/llama70b.tgz" -C "$out" $(cd "$out" && ls -d bench serve 2>/dev/null) &&
  rm -rf "$out/bench" "$out/serve"
note "$( ((status == 0)) && echo DONE || echo FAIL)"
exit $status
