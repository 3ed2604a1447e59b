#!/usr/bin/env bash
# smg's SGLang worker protocol against kvfuse.v1 on one server (docs/sglang.md), from the
# bundle (scripts/gpu/bundle.sh; carry .device-bundle.tar.xz along): one kvfuse-server with
# $MODEL (default llama3-8b), fp8 KV, split attention, graphs on, loaded by kvfuse-bench-serve
# with $STREAMS streams (default 64) of 512-token prompts and 128 tokens out, $SERVE_S seconds
# (default 30) a run: first $WARM_S seconds (default 10) of kvfuse.v1 to warm up (not
# counted), then kvfuse.v1 Generate and SGLang Generate in turn, $ROUNDS rounds (default 2),
# each round's two runs with the same prompts and seeds (prefix cache off). Prints every run's TTFT and ITL p50,
# then each protocol's ITL p50 (the mean over the rounds) and the ratio SGLang / kvfuse
# (target: within 2%). Writes $OUT (or build-gpu-sglang/): summary.txt and every program's
# output. Exit 0 when everything ran.
# The same on the CPU with a local build, e.g.:
#   BUNDLE_DIR=build MODEL=tiny STREAMS=8 SERVE_S=3 WARM_S=1 scripts/gpu/sglang.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-sglang
bundle=${BUNDLE_DIR:-$bundle}  # start_server runs $bundle/kvfuse-server
[[ -x $bundle/kvfuse-server && -x $bundle/kvfuse-bench-serve ]] ||
  { note "FAIL: no server in $bundle (scripts/gpu/bundle.sh)"; exit 1; }
streams=${STREAMS:-64}
serve_s=${SERVE_S:-30}
rounds=${ROUNDS:-2}
port=${PORT:-50171}
# prefix_cache off: the two runs of a round send the same prompts, and the second would
# find the first's in the cache.
engine=(--set model="${MODEL:-llama3-8b}" --set kv_cache_dtype=fp8_e4m3 --set attention=split --set graphs=on
        --set max_running_seqs="$streams" --set num_pages="${NUM_PAGES:-16384}" --set prefix_cache=off)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
note "${gpu:-no GPU}, $(date -u +%FT%TZ), $streams streams, $rounds rounds of ${serve_s}s"
status=0
export KVFUSE_GEMM_CACHE="$out/gemm-algos.json"
rm -f "$KVFUSE_GEMM_CACHE"
: >"$out/figures.txt"

load() {  # protocol, run name, seconds, seed
  local protocol=$1 name=$2 seconds=$3 seed=$4
  local f="$out/bench-$name.txt"
  "$bundle/kvfuse-bench-serve" --addr "127.0.0.1:$port" --protocol "$protocol" --concurrency "$streams" \
    --duration-s "$seconds" --prompt-len 512 --max-tokens 128 --seed "$seed" >"$f" 2>"$out/bench-$name.err" ||
    status=1
  grep -q "^ITL" "$f" || { note "$name: no ITL line (see $f)"; status=1; }
}

if ! start_server "$out/server.txt" "${engine[@]}" --listen "127.0.0.1:$port"; then
  note "FAIL: the server did not start (see $out/server.txt)"
  exit 1
fi
load kvfuse warmup "${WARM_S:-10}" 1
for r in $(seq "$rounds"); do
  for protocol in kvfuse sglang; do
    name=$protocol-$r
    load "$protocol" "$name" "$serve_s" $((r + 1))
    # round protocol req/s TTFT-p50 ITL-p50
    awk -v n="$r" -v p="$protocol" '/^requests/ {q = $(NF-1)} /^TTFT/ {t = $4} /^ITL/ {i = $4}
         END {printf "%s %s %s %s %s\n", n, p, q, t, i}' "$out/bench-$name.txt" | tee -a "$out/figures.txt"
  done
done
kill -TERM "$server_pid"
wait "$server_pid"
# Each protocol's ITL p50 over the rounds, and the ratio.
ratio=$(awk '$5 != "" {s[$2] += $5; n[$2]++}
  END {
    if (n["kvfuse"] == 0 || n["sglang"] == 0 || s["kvfuse"] == 0) {print "ITL p50: a protocol has no runs"; exit 1}
    k = s["kvfuse"] / n["kvfuse"]; g = s["sglang"] / n["sglang"]
    printf "ITL p50 kvfuse.v1 %.3f ms, SGLang %.3f ms: SGLang/kvfuse %.4f (target within 2%%: %s)\n",
           k, g, g / k, (g / k <= 1.02 && g / k >= 0.98) ? "met" : "NOT met"
  }' "$out/figures.txt") || status=1
{
  echo "round protocol req/s TTFT-p50-ms ITL-p50-ms (each line one run)"
  cat "$out/figures.txt"
  echo "$ratio"
} | tee -a "$summary"
note "$( ((status == 0)) && echo DONE || echo FAIL)"
exit $status
