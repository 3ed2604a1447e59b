#!/usr/bin/env bash
# Where a decode step's time goes on the GPU: a kernel trace (bench/profile/kvfuse_trace.cc,
# CUPTI's activity API, built here against the machine's toolkit) of kvfuse-bench-engine
# for one cell, from the bundle (scripts/gpu/bundle.sh), reduced by
# scripts/gpu/profile-table.py to the kernels of one replay of the step's graph (count, total
# and mean time), the device's idle time inside the step and between steps.
# Environment: MODEL (default llama3-8b), BATCH (1), CONTEXT (512), PROFILE_ENV (extra
# environment for the engine, e.g. "KVFUSE_GEMV=0"), PROFILE_ARGS (more kvfuse-bench-engine
# arguments, e.g. "--set tensor_parallel=2 --tp-rank-alone"), PROFILE_BY_GRID (a regex: those
# kernels grouped by grid too, e.g. "gemv" for one row per projection shape). Writes $OUT (or
# build-gpu-profile/).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-profile
cupti=
for d in /usr/local/cuda/extras/CUPTI /usr/local/cuda/targets/x86_64-linux /usr/local/cuda; do
  [[ -f $d/include/cupti.h ]] && { cupti=$d; break; }
done
[[ -n $cupti ]] || { note "no CUPTI (cupti.h) in the CUDA toolkit: nothing to trace with"; exit 2; }
lib=$cupti/lib64
[[ -d $lib ]] || lib=$cupti/lib
record=$(grep -o 'CUpti_ActivityKernel[0-9]*' "$cupti/include/cupti_activity.h" | sort -V | tail -1)
memcpy_record=$(grep -o 'CUpti_ActivityMemcpy[0-9]*\b' "$cupti/include/cupti_activity.h" | sort -V | tail -1)
tracer=$(realpath "$out")/libkvfuse_trace.so
g++ -O2 -shared -fPIC -DKVFUSE_KERNEL_RECORD="$record" -DKVFUSE_MEMCPY_RECORD="$memcpy_record" -I"$cupti/include" -I/usr/local/cuda/include \
  bench/profile/kvfuse_trace.cc -o "$tracer" -L"$lib" -Wl,-rpath,"$lib" -lcupti ||
  { note "FAIL: building the tracer"; exit 1; }
note "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ), tracer with $record"
# shellcheck disable=SC2086  # PROFILE_ENV and PROFILE_ARGS are lists of words
env ${PROFILE_ENV:-} CUDA_INJECTION64_PATH="$tracer" KVFUSE_TRACE_OUT="$out/trace.csv" \
  "$bundle/kvfuse-bench-engine" --set model="${MODEL:-llama3-8b}" --set kv_cache_dtype=fp8_e4m3 \
  --batch "${BATCH:-1}" --context "${CONTEXT:-512}" --attention split --graphs on --reps 3 --warmup 2 ${PROFILE_ARGS:-} \
  >"$out/engine.txt" 2>&1 || { note "FAIL: the traced engine"; tail -20 "$out/engine.txt"; exit 1; }
grep -E "^ +[0-9]+ +[0-9]+ " "$out/engine.txt" | tee -a "$summary"
python3 scripts/gpu/profile-table.py "$out/trace.csv" ${PROFILE_BY_GRID:+--by-grid "$PROFILE_BY_GRID"} | tee -a "$summary"
xz -T0 "$out/trace.csv"
rm -f "$tracer"
note DONE
