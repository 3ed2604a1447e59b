#!/usr/bin/env bash
# This tree's GPU benchmarks against a baseline revision's, in one run on one GPU, as
# ratios (new / baseline): the KV-write and attention kernel benchmarks, and the engine
# benchmark's decode step. Runs alternate (baseline, new, baseline, new, ...) so drift
# of a shared machine falls on both sides.
#
#   scripts/gpu/baseline.sh REV     (here: packs .device-baseline/)
#   scripts/gpu/bundle.sh           (here: packs .device-bundle/)
#   scripts/gpu/compare.sh          (on the GPU machine, both folders carried along)
#
# COMPARE_ENV="NAME=VALUE ..." compares this tree with itself instead: the baseline side is
# this bundle's engine benchmark run with those variables set (an A/B of a switch such as
# KVFUSE_GEMV=0, no baseline folder needed), and the kernel benchmarks are left out.
#
# Environment: COMPARE_ROUNDS (alternations, default 2), COMPARE_BATCH / COMPARE_CONTEXT
# (engine cells, default 1,8,64 x 512,2048), COMPARE_KERNELS=0 (engine benchmark only),
# COMPARE_ENGINE_ARGS (more kvfuse-bench-engine arguments for both sides, e.g. "--set
# kv_write=fused_rope"), COMPARE_ENGINE=0 (kernel benchmarks only:
# then .device-baseline needs only src.tar.xz, e.g. `git archive REV | xz`), KVFUSE_CUDA_ARCH
# (default 90a).
# Writes $OUT (or build-gpu-compare/): summary.txt and compare.tgz with every run's
# table and JSON. Exit 0 when every run succeeded (the ratios are for reading).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-compare .device-baseline/lib
rounds=${COMPARE_ROUNDS:-2}
work=$(mktemp -d)
mkdir -p "$work/runs"
status=0
engine=${COMPARE_ENGINE:-1}
env_base=${COMPARE_ENV:-}
needs=(.device-baseline/src.tar.xz)
((engine)) && needs+=(.device-baseline/kvfuse-bench-engine .device-bundle/kvfuse-bench-engine)
[[ -n $env_base ]] && needs=(.device-bundle/kvfuse-bench-engine) && engine=1
for need in "${needs[@]}"; do
  [[ -e $need ]] || { note "FAIL: $need missing (scripts/gpu/baseline.sh REV, scripts/gpu/bundle.sh)"; exit 1; }
done
base_name=$(cat .device-baseline/REV 2>/dev/null || echo '?')
[[ -n $env_base ]] && base_name="this tree with $env_base"
note "baseline $base_name, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%FT%TZ)"

# The kernel benchmarks of both trees, from the standalone GPU build (tests/gpu).
kernels=${COMPARE_KERNELS:-1}
[[ -n $env_base ]] && kernels=0
mkdir -p "$work/base"
if ((kernels)); then
  tar -xJf .device-baseline/src.tar.xz -C "$work/base"
  for side in base new; do
    src=$PWD
    [[ $side == base ]] && src=$work/base
    if ! build_gpu_targets "$src" "$work/build-$side" "$work/runs/build-$side.log" bench_kv_write bench_attention; then
      tail -20 "$work/runs/build-$side.log"
      note "FAIL: build of the $side kernel benchmarks"
      exit 1
    fi
  done
  note "kernel benchmarks built"
fi

batch=${COMPARE_BATCH:-1,8,64}
context=${COMPARE_CONTEXT:-512,2048}
# shellcheck disable=SC2206  # the arguments are words
engine_args=(${COMPARE_ENGINE_ARGS:-})
run() {  # side, name, command...
  local side=$1 name=$2
  shift 2
  if ! "$@" >"$work/runs/$name.txt" 2>&1; then
    tail -5 "$work/runs/$name.txt"
    note "FAIL: $name"
    status=1
  fi
}
for r in $(seq 1 "$rounds"); do
  for side in base new; do
    for b in bench_kv_write bench_attention; do
      ((kernels)) || continue
      run "$side" "$b.$side.$r" "$work/build-$side/bench/$b" --json "$work/runs/$b.$side.$r.json" --rounds 5
    done
    eng=(.device-bundle/kvfuse-bench-engine)
    if [[ $side == base ]]; then
      eng=(.device-baseline/kvfuse-bench-engine)
      # shellcheck disable=SC2206  # the assignments are words
      [[ -n $env_base ]] && eng=(env $env_base .device-bundle/kvfuse-bench-engine)
    fi
    ((engine)) && run "$side" "engine.$side.$r" "${eng[@]}" --set model=llama3-8b --set device=cuda --set kv_cache_dtype=fp8_e4m3 \
      --batch "$batch" --context "$context" --attention split --graphs on --reps 3 "${engine_args[@]}" \
      --json "$work/runs/engine.$side.$r.json"
    note "round $r $side done"
  done
done

# Ratios new / baseline per cell, the median over rounds of each side's figure.
python3 - "$work/runs" "$rounds" <<'EOF' | tee -a "$summary"
import json, statistics, sys, os
d, rounds = sys.argv[1], int(sys.argv[2])
def load(name, side):
    out = []
    for r in range(1, rounds + 1):
        p = os.path.join(d, f"{name}.{side}.{r}.json")
        if os.path.exists(p):
            out.append(json.load(open(p)))
    return out
def kernel_rows(name, key, value):
    per = {}
    for side in ("base", "new"):
        for doc in load(name, side):
            for row in doc["results"]:
                per.setdefault(key(row), {}).setdefault(side, []).append(row[value])
    return per
def show(title, per, unit):
    print(f"\n{title}: new / baseline (median of {rounds} runs each side)")
    ratios = []
    for k, v in per.items():
        if "base" in v and "new" in v and statistics.median(v["base"]) > 0:
            b, n = statistics.median(v["base"]), statistics.median(v["new"])
            ratios.append(n / b)
            print(f"  {k:<60} {b:10.3f} {n:10.3f} {unit}  x{n / b:.3f}")
    if ratios:
        print(f"  geometric mean x{statistics.geometric_mean(ratios):.3f} over {len(ratios)} cells"
              f" (min x{min(ratios):.3f}, max x{max(ratios):.3f})")
show("KV write", kernel_rows("bench_kv_write",
     lambda r: f"T={r['T']} {r['kernel']} pdl={r['pdl']} {r['mode']} block={r['block']}", "us_per_call"), "us")
show("attention", kernel_rows("bench_attention",
     lambda r: f"b{r['batch']} x {r['context']} {r['dtype']} {r['variant']} {r['mode']} p{r['partition']}", "us_per_call"), "us")
per = {}
for side in ("base", "new"):
    for doc in load("engine", side):
        for cell in doc["cells"]:
            for v in cell["variants"]:
                per.setdefault(f"b{cell['batch']} x {cell['context']} {v['variant']}", {}).setdefault(side, []).append(v["step_ms"])
show("engine step (llama3-8b, fp8 KV)", per, "ms")
EOF
tar -czf "$out/compare.tgz" -C "$work" runs
note "$( ((status == 0)) && echo DONE || echo FAILED)"
exit $status
