#!/usr/bin/env bash
# One kernel benchmark of several revisions, side by side on one GPU: which commit moved a
# kernel's speed. Each revision's sources are a tarball in .device-revs/ (git-ignored), the
# tree it runs in is the last side ("new"); the benchmark of each is built here on the GPU
# machine from the standalone GPU build (tests/gpu), then all run in turn, REVS_ROUNDS
# times, so drift of a shared machine falls on every side.
#
#   mkdir -p .device-revs && for r in REV1 REV2; do git archive $r | xz > .device-revs/$r.tar.xz; done  (here)
#   REVS_BENCH=bench_attention REVS_GREP='^ +64 +4096 ' scripts/gpu/kernel-revs.sh                    (GPU machine)
#
# Environment: REVS_BENCH (default bench_attention), REVS_ARGS (its arguments), REVS_GREP
# (an extended regex: the table rows to put in the summary, default every row),
# REVS_ROUNDS (default 2), KVFUSE_CUDA_ARCH (default 90a).
# Writes $OUT (or build-gpu-kernel-revs/): summary.txt (each round's rows per side) and revs.tgz
# with every build log and run. Exit 0 when every build and run succeeded.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-kernel-revs
bench=${REVS_BENCH:-bench_attention}
work=$(mktemp -d)
mkdir -p "$work/runs"
status=0
note "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%FT%TZ)"
sides=()
for t in .device-revs/*.tar.xz; do
  [[ -e $t ]] || continue
  name=$(basename "$t" .tar.xz)
  mkdir -p "$work/src-$name"
  tar -xJf "$t" -C "$work/src-$name"
  sides+=("$name")
done
sides+=(new)
for side in "${sides[@]}"; do
  src=$work/src-$side
  [[ $side == new ]] && src=$PWD
  if build_gpu_targets "$src" "$work/build-$side" "$work/runs/build-$side.log" "$bench"; then
    note "built $side"
  else
    tail -20 "$work/runs/build-$side.log"
    note "FAIL: build of $side"
    status=1
  fi
done
# shellcheck disable=SC2206  # the arguments are words
args=(${REVS_ARGS:-})
for r in $(seq 1 "${REVS_ROUNDS:-2}"); do
  for side in "${sides[@]}"; do
    exe=$(find "$work/build-$side" -name "$bench" -type f -perm -u+x | head -1)
    [[ -n $exe ]] || continue
    if ! "$exe" "${args[@]}" >"$work/runs/$side.$r.txt" 2>&1; then
      tail -5 "$work/runs/$side.$r.txt"
      note "FAIL: $side round $r"
      status=1
    fi
    { echo "== $side, round $r"; grep -E "${REVS_GREP:-.}" "$work/runs/$side.$r.txt"; } >>"$summary"
  done
  note "round $r done"
done
tar -czf "$out/revs.tgz" -C "$work" runs
note "$( ((status == 0)) && echo DONE || echo FAILED)"
exit $status
