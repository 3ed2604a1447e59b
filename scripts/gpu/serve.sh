#!/usr/bin/env bash
# Through the server against in-process, on one GPU, in one run, from the bundle that
# scripts/gpu/bundle.sh packs (carry .device-bundle.tar.xz along):
#   1. kvfuse-server, $MODEL (default llama3-8b, synthetic bf16 weights), fp8 KV, split attention, graphs
#      on, and kvfuse-bench-serve at $STREAMS streams (prompt 32, $TOKENS tokens each) for
#      $SERVE_S seconds, overlap_fanout on and off in turn ($FANOUT: "on off" by default), $ROUNDS rounds;
#      then scripts/ci/router-check.sh: the router path through kvfuse-cli, every page free after;
#   2. kvfuse-bench-engine, the same engine in-process: the decode step at batch $STREAMS
#      x the streams' mean context (32 + $TOKENS / 2).
# Prints each run's ITL p50 and its ratio to the in-process step, and how many GEMM shapes
# each server chose (timed or read from the cache) after it reported engine_ready, that
# is while serving. The servers share one GEMM cache file, new for each run of this script
# (in $OUT): the first server starts from an empty cache, as a fresh machine or container
# does. Writes $OUT (or build-gpu-serve/): summary.txt and every program's output. Exit 0
# when everything ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-serve
[[ -x $bundle/kvfuse-server && -x $bundle/kvfuse-bench-serve && -x $bundle/kvfuse-cli ]] ||
  { note "FAIL: no server in $bundle (scripts/gpu/bundle.sh)"; exit 1; }
streams=${STREAMS:-64}
tokens=${TOKENS:-256}
serve_s=${SERVE_S:-15}
rounds=${ROUNDS:-2}
port=${PORT:-50151}
engine=(--set model="${MODEL:-llama3-8b}" --set kv_cache_dtype=fp8_e4m3 --set attention=split --set graphs=on)
note "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ), $streams streams x $tokens tokens"
status=0
export KVFUSE_GEMM_CACHE="$out/gemm-algos.json"
rm -f "$KVFUSE_GEMM_CACHE"

serve() {  # name, overlap_fanout value
  local name=$1 log="$out/server-$1.txt"
  if ! KVFUSE_GEMM_TUNE_LOG=1 start_server "$log" "${engine[@]}" --set max_running_seqs="$streams" \
    --set num_pages="${NUM_PAGES:-16384}" --set overlap_fanout="$2" --listen "127.0.0.1:$port"; then
    note "$name: server did not start"
    status=1
    return
  fi
  local pid=$server_pid
  "$bundle/kvfuse-bench-serve" --addr "127.0.0.1:$port" --concurrency "$streams" --duration-s "$serve_s" \
    --prompt-len 32 --max-tokens "$tokens" >"$out/bench-$name.txt" 2>"$out/bench-$name.err"
  local rc=$?
  # The router path once the streams are done: Prefill, Decode and retries, Release, no page left.
  if ! scripts/ci/router-check.sh "$bundle/kvfuse-cli" "127.0.0.1:$port" >"$out/router-$name.txt" 2>&1; then
    status=1
  fi
  note "$name: $(tail -1 "$out/router-$name.txt")"
  kill -TERM $pid
  wait $pid
  ((rc == 0)) || status=1
  local itl
  itl=$(awk '/^ITL/ {print $4}' "$out/bench-$name.txt")
  local chosen
  chosen=$(awk '/event=engine_ready/ {r = 1} r && /^kvfuse gemm tune \(/ {n++} END {print n + 0}' "$log")
  note "$name: exit $rc, ITL p50 ${itl:-?} ms, $(grep -E '^output' "$out/bench-$name.txt"), $chosen GEMM shapes chosen while serving"
  grep -E '^(TTFT|ITL)' "$out/bench-$name.txt" | sed "s/^/  $name /" | tee -a "$summary"
  echo "$name ${itl:-nan}" >>"$out/itl.txt"
}

: >"$out/itl.txt"
for r in $(seq "$rounds"); do
  for mode in ${FANOUT:-on off}; do serve "$mode-$r" "$mode"; done
done

ctx=$((32 + tokens / 2))
"$bundle/kvfuse-bench-engine" "${engine[@]}" --attention split --graphs on --batch "$streams" --context "$ctx" \
  --steps 32 --reps 5 --warmup 2 >"$out/engine.txt" 2>&1 || status=1
step=$(awk -v b="$streams" -v c="$ctx" '$1 == b && $2 == c && $3 == "split/graphs" {print $4; exit}' "$out/engine.txt")
note "in-process step, batch $streams x context $ctx: ${step:-?} ms"
if [[ -n $step ]]; then
  awk -v s="$step" '{printf "gpu-serve: %-6s ITL p50 %s ms = %.3f x the in-process step (%s ms)\n", $1, $2, $2 / s, s}' \
    "$out/itl.txt" | tee -a "$summary"
fi
note "$( ((status == 0)) && echo DONE || echo FAIL)"
exit $status
