#!/usr/bin/env bash
# The batch-invariance tests (and every test that compares tokens or logits exactly across
# batches, padding or preemption) once per environment a CPU machine may bring: each
# OPENBLAS_CORETYPE that machines set, and each GEMM kernel this CPU runs
# (KVFUSE_CPU_GEMM). The CPU backend's bits must not depend on any of them. Needs a
# build from scripts/test.sh (or scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
jobs=${KVFUSE_JOBS:-$(nproc)}
exact='batch invariance|cpu gemm|engine graph padding|engine chunked prefill|scheduler: preemption|scheduler: seeded sampling|scheduler: continuous batching'
log=$(mktemp)
trap 'rm -f "$log"' EXIT
run() {
  echo "test-invariance-matrix: $*"
  # Each test's own TIMEOUT (tests/CMakeLists.txt) applies; --timeout only to one without.
  if ! env "$@" ctest --test-dir build --output-on-failure -j "$jobs" --timeout 120 -R "$exact" >"$log" 2>&1; then
    cat "$log"
    echo "test-invariance-matrix: FAILED under $*"
    exit 1
  fi
  grep -E "tests passed|tests failed" "$log"
}
for core in unset Haswell Zen SkylakeX; do
  if [[ $core == unset ]]; then
    run -u OPENBLAS_CORETYPE
  else
    run OPENBLAS_CORETYPE="$core"
  fi
done
# The vector kernels this CPU runs (the scalar kernel is checked against them bit for bit
# by the cpu gemm tests; it is too slow for the engine tests).
for isa in avx512 avx2; do
  if grep -qw "$([[ $isa == avx512 ]] && echo avx512f || echo avx2)" /proc/cpuinfo 2>/dev/null; then
    run KVFUSE_CPU_GEMM="$isa"
  else
    echo "test-invariance-matrix: KVFUSE_CPU_GEMM=$isa skipped: this CPU lacks it"
  fi
done
