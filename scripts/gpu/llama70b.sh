#!/usr/bin/env bash
# llama3-70b in FP8 on one GPU (an H200: ~68 GiB of FP8 weights, the rest for KV pages),
# from the bundle (scripts/gpu/bundle.sh with kvfuse-bench-engine, kvfuse-server,
# kvfuse-bench-serve and kvfuse-cli; carry .device-bundle.tar.xz along):
#   1. scripts/gpu/bench.sh engine-70b: the decode step at batch 1,8,32,64 x context
#      512,8192 against the roofline (a cell whose KV does not fit is skipped, saying so);
#   2. scripts/gpu/serve.sh with the model and a pool sized to fit (num_pages 0, as in
#      config/h200-llama3-70b-fp8.json): Generate at $STREAMS streams (default 32) for
#      $SERVE_S seconds (default 20), ITL p50 against the in-process step; the server's
#      loading time and memory split (event=device_memory) from its log;
#   3. scripts/gpu/profile.sh at batch 1 x context 512: where the step's time goes, each FP8
#      GEMV shape on its own row.
# LLAMA70B_AB_ENV="KVFUSE_X=0 ...": step 1 runs twice, as is and then under these variables
# (the A/B of a switch; bench-ab/ in the archive).
# Each model load makes ~70 GB of synthetic weights on the host (64 s on the H200 machine's
# 16 cores); steps 1 and 3 load once each (step 1 twice with LLAMA70B_AB_ENV), step 2
# twice. LLAMA70B_SKIP="2 3" leaves steps out. Writes $OUT (or build-gpu-llama70b/):
# summary.txt, and llama70b.tgz with the steps' output (bench/, bench-ab/, serve/,
# profile/). Exit 0 when all ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-llama70b
skip=" ${LLAMA70B_SKIP:-} "
status=0
note "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1), $(date -u +%FT%TZ)"
if [[ $skip != *" 1 "* ]]; then
  OUT="$out/bench" scripts/gpu/bench.sh engine-70b || status=1
  grep -vE '^gpu-bench: (machine|git)' "$out/bench/summary.txt" | tee -a "$summary" >/dev/null
  if [[ -n ${LLAMA70B_AB_ENV:-} ]]; then
    note "step 1 again under $LLAMA70B_AB_ENV"
    # shellcheck disable=SC2086  # a list of VAR=value words
    env $LLAMA70B_AB_ENV OUT="$out/bench-ab" scripts/gpu/bench.sh engine-70b || status=1
  fi
fi
if [[ $skip != *" 2 "* ]]; then
  OUT="$out/serve" MODEL=llama3-70b-fp8 NUM_PAGES=0 STREAMS=${STREAMS:-32} SERVE_S=${SERVE_S:-20} FANOUT=on \
    ROUNDS=1 TOKENS=${TOKENS:-256} scripts/gpu/serve.sh || status=1
  grep -hE "event=(weights_loaded|device_memory)" "$out"/serve/server-*.txt | sed 's/^/  /' | tee -a "$summary"
  tail -8 "$out/serve/summary.txt" | tee -a "$summary" >/dev/null
fi
if [[ $skip != *" 3 "* ]]; then
  OUT="$out/profile" MODEL=llama3-70b-fp8 PROFILE_BY_GRID=gemv PROFILE_ARGS="--kv-write fused_rope --max-kv-gib 2" \
    scripts/gpu/profile.sh || status=1
  grep -E "gemv|attention|step kernels|idle between" "$out/profile/summary.txt" | sed 's/^/  /' | tee -a "$summary"
fi
# The device runner returns a few files: the summary, and the rest in one archive.
tar czf "$out/llama70b.tgz" -C "$out" $(cd "$out" && ls -d bench bench-ab serve profile 2>/dev/null) &&
  rm -rf "$out/bench" "$out/bench-ab" "$out/serve" "$out/profile"
note "$( ((status == 0)) && echo DONE || echo FAIL)"
exit $status
