#!/usr/bin/env bash
# The checks a change that touches kernels or the engine needs before it lands, in one
# run on one GPU machine, from the bundle (scripts/gpu/bundle.sh) and, for the kernel
# comparison, a baseline's sources (.device-baseline/src.tar.xz, e.g.
# `mkdir -p .device-baseline && git archive REV | xz >.device-baseline/src.tar.xz &&
# echo REV >.device-baseline/REV`):
#   1. scripts/gpu/check.sh: kernel parity tests, memcheck, the engine-level GPU tests
#      (backend, logprobs, engine) and the kernel benchmarks;
#   2. scripts/gpu/serve.sh, short: the server against in-process and the router path;
#   3. scripts/gpu/compare.sh: the kernel benchmarks against the baseline's, as ratios
#      (left out when there is no .device-baseline/src.tar.xz); COMPARE_ENGINE=1 adds the
#      engine benchmark (then .device-baseline/ needs scripts/gpu/baseline.sh's build);
#   engine (not by default; scripts/gpu/engine.sh, a minute or two): the bundle's GPU
#      tests and the router path against a tiny-model server on the GPU.
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
for s in ${VERIFY_STEPS:-check serve compare}; do
  case $s in
    check) step check env KVFUSE_BENCH_ROUNDS="${KVFUSE_BENCH_ROUNDS:-5}" \
      KVFUSE_ATTN_BENCH_ROUNDS="${KVFUSE_ATTN_BENCH_ROUNDS:-3}" scripts/gpu/check.sh ;;
    engine) step engine scripts/gpu/engine.sh ;;
    serve) step serve env ROUNDS="${ROUNDS:-1}" SERVE_S="${SERVE_S:-10}" FANOUT="${FANOUT:-on}" scripts/gpu/serve.sh ;;
    compare)
      if [[ -f .device-baseline/src.tar.xz ]]; then
        step compare env COMPARE_ENGINE="${COMPARE_ENGINE:-0}" scripts/gpu/compare.sh
      else
        echo "== verify: compare skipped (no .device-baseline/src.tar.xz)" | tee -a "$summary"
      fi ;;
    *) echo "verify: unknown step $s" >&2; exit 2 ;;
  esac
done
tar -czf "$out/verify.tgz" -C "$work" . 2>/dev/null
echo "== verify: $( ((status == 0)) && echo PASS || echo FAIL)" | tee -a "$summary"
exit $status
