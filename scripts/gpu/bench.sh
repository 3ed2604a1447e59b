#!/usr/bin/env bash
# End-to-end GPU runs from the bundle that scripts/gpu/bundle.sh builds (a CUDA machine
# with the driver and CUDA 13, none of the Debian libraries): the engine tests, the
# engine benchmark and the fused/unfused A/B, as named jobs, in one command:
#
#   scripts/gpu/bench.sh [JOB ...]      (default: tests engine-llama ab-target)
#
# Jobs:
#   tests          test_gpu_backend, test_gpu_logprobs and test_gpu_engine (GPU vs CPU, graph
#                  replay vs eager)
#   engine-llama   kvfuse-bench-engine, llama3-8b, fp8_e4m3 KV: batch x context grid,
#                  unified/split x eager/graphs
#   engine-hybrid  the same for hybrid-swa (engine-qwen: qwen2.5-7b, engine-mistral:
#                  mistral-7b)
#   engine-writes  kvfuse-bench-engine, llama3-8b: the three KV write paths (unfused, fused,
#                  fused_rope) as variants of one engine, graphs on, unified/split,
#                  batch 1,8,32,64 x context 512,2048,8192
#   engine-fp8     kvfuse-bench-engine, llama3-8b, llama3-8b-fp8 (FP8 weights) and
#                  llama3-8b-fp8 under FP8_AB_ENV (NAME=VALUE words, default
#                  KVFUSE_GEMV_FP8_QUANT=0) alternating, FP8_ROUNDS rounds (default 2), graphs on, unified:
#                  batch 1,64 x context 512,2048, the FP8 model with the unfused, fused and
#                  fused_rope writes; the FP8 runs log the GEMM tuner's timings (gemm_tune_*.log)
#   engine-70b     kvfuse-bench-engine, llama3-70b-fp8 (FP8 weights) on one GPU, graphs on, split,
#                  fused_rope: batch 1,8,32,64 x context 512,8192, at most 60 GiB of KV pages
#                  (BENCH_MAX_KV_GIB; a cell that needs more is skipped, saying so)
#   ab-target      kvfuse-ab, llama3-8b, split, graphs on: batch 32 x context 8192 (the
#                  issue's cell), 10 repetitions
#   ab-grid        kvfuse-ab grids: llama3-8b split and unified, hybrid-swa split and
#                  unified, graphs on, batch 1,4,16,32,64 x context 2048,8192
# Environment: BENCH_BATCH / BENCH_CONTEXT / BENCH_ATTENTION override the engine grids, AB_BATCH /
# AB_CONTEXT / AB_REPS / AB_STEPS the A/B grids.
#
# Everything lands in $OUT (or build-gpu-bench/): summary.txt, and one gpu-bench.tgz with
# every job's log, table, JSON and SVG (the device runner returns at most 8 files).
# Exit status 0 if every job succeeded.
set -uo pipefail
cd "$(dirname "$0")/../.."
bundle=.device-bundle
out=${OUT:-build-gpu-bench}
res=$(mktemp -d)/gpu-bench
mkdir -p "$out" "$res"
summary="$out/summary.txt"
: >"$summary"
t0=$(date +%s)
note() { echo "gpu-bench: $* ($(($(date +%s) - t0))s)" | tee -a "$summary"; }
if [[ ! -x $bundle/kvfuse-bench-engine ]]; then
  note "FAIL: no $bundle; build it with scripts/gpu/bundle.sh and carry it"
  exit 1
fi
cuda_lib=$(dirname "$(ls /usr/local/cuda/lib64/libcublasLt.so* /usr/local/cuda/lib/libcublasLt.so* 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$PWD/$bundle/lib:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(git status --porcelain 2>/dev/null | wc -l) changed"
} | tee -a "$summary" >"$res/machine.txt"

status=0
run() {  # name, command...
  local name=$1
  shift
  echo "\$ $*" >"$res/$name.log"
  "$@" >>"$res/$name.log" 2>&1
  local rc=$?
  ((rc == 0)) || status=1
  note "$name: exit $rc"
  return $rc
}

engine_bench() {  # model [name, batch, context, extra options...]
  local model=$1 name=${2:-engine_$1} batch=${3:-1,8,32,64,128,256} context=${4:-512,2048,8192,32768}
  shift $(($# < 4 ? $# : 4))
  local extra=("$@")
  ((${#extra[@]})) || extra=(--graphs off,on)
  run "$name" "$bundle/kvfuse-bench-engine" --set model="$model" --set device=cuda \
    --set kv_cache_dtype=fp8_e4m3 --batch "${BENCH_BATCH:-$batch}" \
    --context "${BENCH_CONTEXT:-$context}" --attention "${BENCH_ATTENTION:-unified,split}" "${extra[@]}" \
    --json "$res/$name.json" --svg "$res/$name.svg"
  grep -vE '^kvfuse-bench-engine: cell|\r' "$res/$name.log" | tail -60 | tee -a "$summary"
}

ab() {  # name, model, attention, batch, context, reps
  local name=$1 model=$2 attn=$3
  run "$name" "$bundle/kvfuse-ab" --set model="$model" --set device=cuda --set kv_cache_dtype=fp8_e4m3 \
    --set attention="$attn" --set graphs=on --batch "$4" --context "$5" --reps "$6" --steps "${AB_STEPS:-8}" \
    --json "$res/$name.json" --svg "$res/$name.svg"
  grep -E '^ +[0-9]+ +[0-9]+ \||batch +context|kvfuse-ab: fused vs' "$res/$name.log" | tee -a "$summary"
}

jobs=("$@")
((${#jobs[@]})) || jobs=(tests engine-llama ab-target)
for job in "${jobs[@]}"; do
  case $job in
    tests)
      run test_gpu_backend "$bundle/test_gpu_backend"
      run test_gpu_logprobs "$bundle/test_gpu_logprobs"
      run test_gpu_engine "$bundle/test_gpu_engine" -s
      grep -E "^graphs |passed|failed" "$res/test_gpu_engine.log" | tail -20 | tee -a "$summary"
      ;;
    engine-llama) engine_bench llama3-8b ;;
    engine-hybrid) engine_bench hybrid-swa ;;
    engine-qwen) engine_bench qwen2.5-7b ;;
    engine-mistral) engine_bench mistral-7b ;;
    engine-fp8)
      for ((r = 1; r <= ${FP8_ROUNDS:-2}; r++)); do
        BENCH_ATTENTION=${BENCH_ATTENTION:-unified} engine_bench llama3-8b "engine_bf16_r$r" 1,64 512,2048 \
          --graphs on --kv-write fused_rope
        KVFUSE_GEMM_TUNE_LOG=1 BENCH_ATTENTION=${BENCH_ATTENTION:-unified} engine_bench llama3-8b-fp8 \
          "engine_fp8_r$r" 1,64 512,2048 --graphs on --kv-write unfused,fused,fused_rope
        grep -E '^kvfuse gemm tune' "$res/engine_fp8_r$r.log" >"$res/gemm_tune_r$r.log"
        (  # the A/B side's switches in a subshell of their own
          for kv in ${FP8_AB_ENV:-KVFUSE_GEMV_FP8_QUANT=0}; do export "${kv?}"; done
          KVFUSE_GEMM_TUNE_LOG=1 BENCH_ATTENTION=${BENCH_ATTENTION:-unified} engine_bench llama3-8b-fp8 \
            "engine_fp8_ab_r$r" 1,64 512,2048 --graphs on --kv-write fused_rope
          exit $status
        ) || status=1
        grep -E '^kvfuse gemm tune' "$res/engine_fp8_ab_r$r.log" >"$res/gemm_tune_ab_r$r.log"
      done
      ;;
    engine-70b)
      BENCH_ATTENTION=${BENCH_ATTENTION:-split} engine_bench llama3-70b-fp8 engine_llama3-70b-fp8 1,8,32,64 \
        512,8192 --graphs on --kv-write fused_rope --max-kv-gib "${BENCH_MAX_KV_GIB:-60}"
      ;;
    engine-writes)
      engine_bench llama3-8b engine_writes_llama3-8b 1,8,32,64 512,2048,8192 --graphs on \
        --kv-write unfused,fused,fused_rope
      ;;
    ab-target) ab ab_target_llama3-8b_split llama3-8b split 32 8192 "${AB_REPS:-10}" ;;
    ab-grid)
      for run in llama3-8b:split llama3-8b:unified hybrid-swa:split hybrid-swa:unified; do
        ab "ab_${run%%:*}_${run##*:}" "${run%%:*}" "${run##*:}" "${AB_BATCH:-1,4,16,32,64}" \
          "${AB_CONTEXT:-2048,8192}" "${AB_REPS:-5}"
      done
      ;;
    *)
      note "unknown job '$job'"
      status=1
      ;;
  esac
  # After every job, so that a run stopped at a time limit still returns what finished.
  tar -C "$(dirname "$res")" -czf "$out/gpu-bench.tgz" gpu-bench
done
note "$( ((status == 0)) && echo PASS || echo FAIL); results in $out/gpu-bench.tgz"
exit $status
