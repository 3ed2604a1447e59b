#!/usr/bin/env bash
# The prefix cache through the server on one GPU, from the bundle (scripts/gpu/bundle.sh;
# carry .device-bundle.tar.xz along): kvfuse-server with $MODEL (default llama3-8b), fp8 KV,
# split attention, graphs on, prefix_cache on and off in turn, $ROUNDS rounds (default 1),
# each loaded by kvfuse-bench-serve three ways:
#   shared  $STREAMS streams (default 32), every prompt a 2048-token shared prefix and 64
#           new tokens, 64 tokens out: TTFT with the cache against without, ITL unchanged;
#   turns   $STREAMS streams, 4-turn conversations after a 1024-token system prompt, 64 new
#           tokens a turn, 64 out: requests per second, and the hit rate;
#   random  $STREAMS streams of random 512-token prompts (nothing shared): TTFT and ITL
#           with the cache on as off.
# Each workload runs $SERVE_S seconds (default 30). Prints per workload and side the
# requests per second, TTFT and ITL p50 and the hit rate, then the ratios. Writes $OUT (or
# build-gpu-prefix/): summary.txt and every program's output. Exit 0 when everything ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-prefix
[[ -x $bundle/kvfuse-server && -x $bundle/kvfuse-bench-serve ]] ||
  { note "FAIL: no server in $bundle (scripts/gpu/bundle.sh)"; exit 1; }
streams=${STREAMS:-32}
serve_s=${SERVE_S:-30}
port=${PORT:-50161}
engine=(--set model="${MODEL:-llama3-8b}" --set kv_cache_dtype=fp8_e4m3 --set attention=split --set graphs=on
        --set max_running_seqs="$streams" --set num_pages="${NUM_PAGES:-16384}" --set max_seq_len=8192)
note "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ), $streams streams"
status=0
export KVFUSE_GEMM_CACHE="$out/gemm-algos.json"
rm -f "$KVFUSE_GEMM_CACHE"
: >"$out/figures.txt"

load() {  # side, workload name, bench-serve arguments...
  local side=$1 name=$2
  shift 2
  local f="$out/bench-$name-$side.txt"
  "$bundle/kvfuse-bench-serve" --addr "127.0.0.1:$port" --concurrency "$streams" --duration-s "$serve_s" \
    --max-tokens 64 "$@" >"$f" 2>"$out/bench-$name-$side.err" || status=1
  # side workload req/s TTFT-p50 ITL-p50 hit-rate
  awk -v s="$side" -v n="$name" '/^requests/ {r = $(NF-1)} /^TTFT/ {t = $4} /^ITL/ {i = $4}
       /^prefix cache/ {h = $NF} END {printf "%s %s %s %s %s %s\n", n, s, r, t, i, h}' "$f" | tee -a "$out/figures.txt"
}

serve() {  # side (on | off)
  local side=$1
  if ! start_server "$out/server-$side.txt" "${engine[@]}" --set prefix_cache="$side" --listen "127.0.0.1:$port"; then
    note "cache $side: server did not start"
    status=1
    return
  fi
  local pid=$server_pid
  load "$side" shared --shared-prefix-len 2048 --prompt-len 64
  load "$side" turns --shared-prefix-len 1024 --turns 4 --prompt-len 64
  load "$side" random --prompt-len 512 --seed $((RANDOM + 1))
  kill -TERM $pid
  wait $pid
}

for r in $(seq "${ROUNDS:-1}"); do
  for side in on off; do serve "$side"; done
done
{
  echo "workload side req/s TTFT-p50-ms ITL-p50-ms hit-rate (each line one run)"
  cat "$out/figures.txt"
  # The ratios of the last round: on against off.
  awk '{k = $1; v[k, $2, "r"] = $3; v[k, $2, "t"] = $4; v[k, $2, "i"] = $5}
       END {
         printf "shared: TTFT p50 off/on %.2fx (target >= 5), ITL p50 on/off %.3f (target within 3%%)\n",
                v["shared", "off", "t"] / v["shared", "on", "t"], v["shared", "on", "i"] / v["shared", "off", "i"]
         printf "turns: requests/s on/off %.2fx (target >= 1.5)\n", v["turns", "on", "r"] / v["turns", "off", "r"]
         printf "random: TTFT p50 on/off %.3f, ITL p50 on/off %.3f (target within 2%%)\n",
                v["random", "on", "t"] / v["random", "off", "t"], v["random", "on", "i"] / v["random", "off", "i"]
       }' "$out/figures.txt"
} | tee -a "$summary"
note "$( ((status == 0)) && echo DONE || echo FAIL)"
exit $status
