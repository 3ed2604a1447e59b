#!/usr/bin/env bash
# FP8 weights on one GPU, from the bundle (nothing is compiled on the GPU machine):
#   1. the kernel parity tests the bundle has (KVFUSE_BUNDLE_KERNEL_TESTS="test_gemv_fp8_gpu
#      test_norm_fp8_gpu" scripts/gpu/bundle.sh, here);
#   2. test_gpu_fp8 (FP8 projections and FP8 models, GPU against CPU), then the GPU
#      backend, sampling and engine tests (test_gpu_backend, test_gpu_logprobs,
#      test_gpu_engine), each under FP8_TEST_TIMEOUT seconds (default 300);
#   3. tests/hf_reference_fp8.py on the CPU and the GPU, when the bundle has kvfuse-eval and
#      the machine torch and transformers: FP8 checkpoints against Hugging Face;
#   4. scripts/gpu/bench.sh engine-fp8: llama3-8b against llama3-8b-fp8, alternating, with
#      the GEMM tuner's timings of the FP8 shapes;
#   5. with FP8_PROFILE=1, scripts/gpu/profile.sh of llama3-8b-fp8 at 1 x 512 (fused_rope), the
#      GEMVs one row per shape: where the step's time goes.
# FP8_SKIP_TESTS=1 leaves out 1 to 3, FP8_SKIP_BENCH=1 leaves out 4; FP8_ROUNDS and FP8_AB_ENV
# go to the benchmark (scripts/gpu/bench.sh says what they do). Writes $OUT (or
# build-gpu-fp8/): summary.txt, the benchmark's gpu-bench.tgz and the profile's table.
# Exit 0 when all passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-fp8
note "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), $(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
status=0
check() {  # name, command...
  local name=$1 rc
  shift
  timeout "${FP8_TEST_TIMEOUT:-300}" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  grep -E "^gpu fp8 engine|passed|failed|test cases|assertions" "$out/$name.txt" | tail -8 | sed "s/^/  /" |
    tee -a "$summary"
  note "$name: exit $rc"
  ((rc == 0)) || status=1
}
if [[ ${FP8_SKIP_TESTS:-0} != 1 ]]; then
  for t in "$bundle"/kernel-tests/*; do [[ -x $t ]] && check "$(basename "$t")" "$t"; done
  for t in test_gpu_fp8 test_gpu_backend test_gpu_logprobs test_gpu_engine; do [[ -x $bundle/$t ]] && check "$t" "$bundle/$t"; done
  if [[ -x $bundle/kvfuse-eval ]] && python3 -c "import torch, transformers" 2>/dev/null; then
    FP8_TEST_TIMEOUT=${FP8_HF_TIMEOUT:-400} check hf_reference_fp8 python3 tests/hf_reference_fp8.py \
      --kvfuse-bin "$bundle/kvfuse-eval" --device cpu --device cuda --json-out "$out/hf_reference_fp8.json"
    grep -E "PASS|FAIL|sigma" "$out/hf_reference_fp8.txt" | sed "s/^/  /" | tee -a "$summary"
  fi
fi
if [[ ${FP8_SKIP_BENCH:-0} != 1 ]]; then
  OUT=$out/bench scripts/gpu/bench.sh engine-fp8 >"$out/bench.txt" 2>&1 || status=1
  cat "$out/bench/summary.txt" >>"$summary"
  mv "$out/bench/gpu-bench.tgz" "$out/" 2>/dev/null
fi
if [[ ${FP8_PROFILE:-0} == 1 ]]; then
  MODEL=llama3-8b-fp8 BATCH=1 CONTEXT=512 PROFILE_ARGS="--kv-write fused_rope" PROFILE_BY_GRID=gemv \
    OUT=$out/profile scripts/gpu/profile.sh >"$out/profile.txt" 2>&1 || status=1
  grep -vE "^  +[0-9.]+ \.\." "$out/profile.txt" | head -60 >>"$summary"
  rm -rf "$out/profile"  # the table is in profile.txt; the trace and the tracer stay behind
fi
note "$( ((status == 0)) && echo PASS || echo FAIL)"
exit $status
