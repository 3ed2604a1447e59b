#!/usr/bin/env bash
# End-to-end fused vs unfused KV writes on a CUDA machine, from the bundle that
# scripts/gpu-bundle.sh builds: kvfuse-ab on the llama3-8b and hybrid-swa presets
# (synthetic weights, fp8_e4m3 KV): llama3-8b with split and unified attention,
# hybrid-swa with split. Writes ab_tables.txt and a JSON and an SVG per run to $OUT (or
# build-ab/): 7 files. Arguments go to every kvfuse-ab call.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=.device-bundle
out=${OUT:-build-ab}
mkdir -p "$out"
cuda_lib=$(dirname "$(ls /usr/local/cuda/lib64/libcublasLt.so* /usr/local/cuda/lib/libcublasLt.so* 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$PWD/$bundle/lib:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
} | tee "$out/ab_tables.txt"
status=0
for run in llama3-8b:split llama3-8b:unified hybrid-swa:split; do
  model=${run%%:*}
  attn=${run##*:}
  {
    name=ab_${model}_${attn}
    "$bundle/kvfuse-ab" --set model=$model --set device=cuda --set kv_cache_dtype=fp8_e4m3 --set attention=$attn \
      --batch "${AB_BATCH:-1,32}" --context "${AB_CONTEXT:-8192}" --reps "${AB_REPS:-5}" --steps "${AB_STEPS:-16}" \
      --json "$out/$name.json" --svg "$out/$name.svg" "$@" 2>&1 | tee -a "$out/ab_tables.txt"
    ((${PIPESTATUS[0]} == 0)) || status=1
  }
done
exit $status
