#!/usr/bin/env bash
# The GEMM tuner's decisions for a model's decode shapes, from a fresh GEMM cache, and the
# decode step they give, on one GPU, from the bundle (scripts/gpu/bundle.sh) and, when
# .device-baseline/ is there (scripts/gpu/baseline.sh REV), the baseline's engine too:
#   for each side: KVFUSE_GEMM_TUNE_LOG=1 kvfuse-bench-engine at batch $TUNE_BATCH x
#   context 512 with its own empty cache file, so each side tunes on its own (the
#   log's lines: every candidate's time per call in a graph, and the choice);
#   then this bundle again with KVFUSE_GEMV=0 (no GEMV) and with KVFUSE_GEMM_SKINNY=0 (no
#   skinny GEMM), each against the bundle's own side in the same run.
# Environment: MODEL (default llama3-8b), TUNE_BATCH (default 1,8). Writes $OUT (or
# build-gpu-gemm-tune/): summary.txt and every run's output.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-gemm-tune .device-baseline/lib
[[ -x $bundle/kvfuse-bench-engine ]] || { note "FAIL: no $bundle (scripts/gpu/bundle.sh)"; exit 1; }
note "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%FT%TZ), ${MODEL:-llama3-8b}"
status=0
work=$(mktemp -d)
side() {  # name, env..., binary
  local name=$1
  shift
  env KVFUSE_GEMM_CACHE="$work/cache-$name.json" KVFUSE_GEMM_TUNE_LOG=1 "$@" --set model="${MODEL:-llama3-8b}" \
    --set kv_cache_dtype=fp8_e4m3 --batch "${TUNE_BATCH:-1,8}" --context 512 --attention split --graphs on --reps 3 \
    >"$out/$name.txt" 2>&1 || status=1
  note "$name:"
  grep -E "^kvfuse gemm tune|^ +[0-9]+ +512 " "$out/$name.txt" | sed 's/^/  /' | tee -a "$summary"
}
if [[ -x .device-baseline/kvfuse-bench-engine ]]; then
  side "baseline-$(cut -c1-7 .device-baseline/REV 2>/dev/null)" .device-baseline/kvfuse-bench-engine
fi
side bundle "$bundle/kvfuse-bench-engine"
side bundle-no-gemv KVFUSE_GEMV=0 "$bundle/kvfuse-bench-engine"
side bundle-no-skinny KVFUSE_GEMM_SKINNY=0 "$bundle/kvfuse-bench-engine"
rm -rf "$work"
note "$( ((status == 0)) && echo DONE || echo FAIL)"
exit $status
