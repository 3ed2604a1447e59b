#!/usr/bin/env bash
# The checks a change that touches kernels or the engine needs before it lands, in one
# run on one GPU machine, from the bundle (scripts/gpu/bundle.sh) and, for the kernel
# comparison, a baseline's sources (.device-baseline/src.tar.xz, e.g.
# `mkdir -p .device-baseline && git archive REV | xz >.device-baseline/src.tar.xz &&
# echo REV >.device-baseline/REV`):
#   1. scripts/gpu/check.sh: kernel parity tests, memcheck, the engine-level GPU tests
#      (backend, logprobs, engine) and the kernel benchmarks;
#   2. scripts/gpu/serve.sh, short: the server against in-process and the router path;
#   3. scripts/gpu/compare.sh with COMPARE_ENGINE=0: the kernel benchmarks against the
#      baseline's, as ratios (left out when there is no .device-baseline/src.tar.xz);
#   engine (not by default; in a minute or two, where check's full run does not fit): the
#      bundle's GPU tests (backend, logprobs, engine, NCCL, peer all-reduce, tp) and the
#      router path (scripts/ci/router-check.sh) against a tiny-model server on the GPU.
# VERIFY_STEPS (default "check serve compare") picks steps. Writes $OUT (or
# build-gpu-verify/): summary.txt (every step's summary) and verify.tgz (all their
# files). Exit 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-build-gpu-verify}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
work=$(mktemp -d)  # the steps' own output folders; $OUT keeps two files
status=0
step() {  # name, command...
  local name=$1
  shift
  local t0=$(date +%s)
  echo "== verify: $name" | tee -a "$summary"
  OUT="$work/$name" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  cat "$work/$name/summary.txt" >>"$summary" 2>/dev/null
  echo "== verify: $name exit $rc after $(($(date +%s) - t0)) s" | tee -a "$summary"
  ((rc == 0)) || status=1
}
engine_step() {  # the bundle's GPU tests, then the router path on a tiny-model server
  local bundle=.device-bundle rc=0 port=${PORT:-50161}
  [[ -d $bundle ]] || tar xJf "$bundle.tar.xz"
  local cuda_lib
  cuda_lib=$(dirname "$(ls /usr/local/cuda/lib64/libcublasLt.so* 2>/dev/null | head -1)")
  export LD_LIBRARY_PATH="$PWD/$bundle/lib:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  mkdir -p "$OUT"
  for t in test_gpu_backend test_gpu_logprobs test_gpu_engine test_gpu_nccl test_gpu_peer_allreduce test_gpu_tp; do
    "$bundle/$t" >"$OUT/$t.txt" 2>&1
    local r=$?
    echo "engine: $t exit $r, $(grep -E "test cases|passed|SKIP" "$OUT/$t.txt" | tail -1)" | tee -a "$OUT/summary.txt"
    ((r == 0)) || rc=1
  done
  "$bundle/kvfuse-server" --set model=tiny --set device=cuda --listen "127.0.0.1:$port" --metrics-port -1 \
    >"$OUT/server.txt" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    grep -q "event=engine_ready" "$OUT/server.txt" 2>/dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  scripts/ci/router-check.sh "$bundle/kvfuse-cli" "127.0.0.1:$port" >"$OUT/router.txt" 2>&1
  local r=$?
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
  echo "engine: router-check on a tiny-model CUDA server exit $r" | tee -a "$OUT/summary.txt"
  cat "$OUT/router.txt" >>"$OUT/summary.txt"
  ((r == 0)) || rc=1
  return $rc
}

for s in ${VERIFY_STEPS:-check serve compare}; do
  case $s in
    check) step check env KVFUSE_BENCH_ROUNDS="${KVFUSE_BENCH_ROUNDS:-5}" \
      KVFUSE_ATTN_BENCH_ROUNDS="${KVFUSE_ATTN_BENCH_ROUNDS:-3}" scripts/gpu/check.sh ;;
    engine) step engine engine_step ;;
    serve) step serve env ROUNDS="${ROUNDS:-1}" SERVE_S="${SERVE_S:-10}" FANOUT="${FANOUT:-on}" scripts/gpu/serve.sh ;;
    compare)
      if [[ -f .device-baseline/src.tar.xz ]]; then
        step compare env COMPARE_ENGINE=0 scripts/gpu/compare.sh
      else
        echo "== verify: compare skipped (no .device-baseline/src.tar.xz)" | tee -a "$summary"
      fi ;;
    *) echo "verify: unknown step $s" >&2; exit 2 ;;
  esac
done
tar -czf "$out/verify.tgz" -C "$work" . 2>/dev/null
echo "== verify: $( ((status == 0)) && echo PASS || echo FAIL)" | tee -a "$summary"
exit $status
