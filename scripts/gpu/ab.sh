#!/usr/bin/env bash
# A short GPU check of a change, for when device time is scarce: the parity tests of the
# kernels it touched, the GPU backend, engine and peer all-reduce tests, then an A/B of its switches
# in the decode step, all from the prebuilt bundle (nothing is compiled on the GPU machine).
#
#   KVFUSE_BUNDLE_KERNEL_TESTS="test_gemv_gpu test_attention_gpu" scripts/gpu/bundle.sh  (here)
#   AB_ENV="KVFUSE_GEMV_SILU=0;KVFUSE_ATTN_MERGE_KERNEL=1" scripts/gpu/ab.sh  (GPU machine)
#
# The kernel tests are those scripts/gpu/bundle.sh packed into .device-bundle/kernel-tests (built
# from tests/gpu for sm_90a). The A/B runs kvfuse-bench-engine (llama3-8b, fp8 KV, split
# attention, graphs) once with every switch of AB_ENV (';'-separated NAME=VALUE sets, one
# side each) and once with none, alternating for AB_ROUNDS rounds (default 2), all sides
# sharing one GEMM cache file, which the first run fills: each side runs the same GEMMs.
# Environment: AB_BATCH / AB_CONTEXT (cells, default 1 x 512,2048), AB_ARGS (more engine
# arguments for every side, e.g. "--set kv_write=fused_rope"), AB_TEST_ARGS (TEST:ARG words,
# an argument for a kernel test that takes one), AB_SKIP_TESTS=1, AB_TEST_TIMEOUT (seconds
# a test or kernel benchmark may run, default 900), AB_STOP_ON_FAIL=1 (no benchmark and no
# A/B after a failed test).
# Writes $OUT (or build-gpu-ab/): summary.txt (each step time and each side's ratio
# against the side with no switch, median over rounds) and ab.tgz with every run's output.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-ab
status=0
note "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), $(date -u +%FT%TZ)"
runs=$(mktemp -d)
check() {  # name, command...: a test, its last lines to the summary
  local name=$1 rc
  shift
  timeout "${AB_TEST_TIMEOUT:-900}" "$@" >"$runs/$name.txt" 2>&1
  rc=$?
  ((rc == 124)) && echo "$name: timed out after ${AB_TEST_TIMEOUT:-900} s" >>"$runs/$name.txt"
  grep -E "passed|failed|skipped|share GPU|test cases|assertions" "$runs/$name.txt" | tail -3 | sed "s/^/  /" |
    tee -a "$summary"
  note "$name: exit $rc"
  ((rc == 0)) || status=1
}
if [[ ${AB_SKIP_TESTS:-0} != 1 ]]; then
  for t in "$bundle"/kernel-tests/*; do
    [[ -x $t ]] || continue
    name=$(basename "$t")
    targs=()
    for a in ${AB_TEST_ARGS:-}; do [[ ${a%%:*} == "$name" ]] && targs+=("${a#*:}"); done
    check "$name" "$t" "${targs[@]}"
  done
  [[ -x $bundle/test_gpu_backend ]] && check test_gpu_backend "$bundle/test_gpu_backend"
  [[ -x $bundle/test_gpu_fp8 ]] && check test_gpu_fp8 "$bundle/test_gpu_fp8"
  [[ -x $bundle/test_gpu_logprobs ]] && check test_gpu_logprobs "$bundle/test_gpu_logprobs"
  [[ -x $bundle/test_gpu_engine ]] && check test_gpu_engine "$bundle/test_gpu_engine"
  [[ -x $bundle/test_gpu_peer_allreduce ]] &&
    check test_gpu_peer_allreduce env NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" "$bundle/test_gpu_peer_allreduce"
fi
# The kernel benchmarks scripts/gpu/bundle.sh packed into .device-bundle/kernel-benches
# (KVFUSE_BUNDLE_KERNEL_BENCHES), after the tests: their tables go into ab.tgz, their
# last lines to the summary. AB_BENCH_ARGS: NAME:ARG words, as AB_TEST_ARGS.
for b in "$bundle"/kernel-benches/*; do
  [[ -x $b ]] || continue
  ((status == 0)) || [[ ${AB_STOP_ON_FAIL:-0} != 1 ]] || break
  name=$(basename "$b")
  bargs=()
  for a in ${AB_BENCH_ARGS:-}; do [[ ${a%%:*} == "$name" ]] && bargs+=("${a#*:}"); done
  timeout "${AB_TEST_TIMEOUT:-900}" "$b" "${bargs[@]}" >"$runs/$name.txt" 2>&1
  rc=$?
  tail -4 "$runs/$name.txt" | sed "s/^/  /" | tee -a "$summary"
  note "$name: exit $rc"
done

if ((status != 0)) && [[ ${AB_STOP_ON_FAIL:-0} == 1 ]]; then
  tar -czf "$out/ab.tgz" -C "$runs" .
  note "FAILED: a test failed, no A/B (AB_STOP_ON_FAIL=1)"
  exit 1
fi
IFS=';' read -r -a sides <<<"${AB_ENV:-}"
sides=("" "${sides[@]}")
export KVFUSE_GEMM_CACHE="$runs/gemm-algos.json"
# shellcheck disable=SC2206  # the arguments are words
args=(${AB_ARGS:-})
for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  for i in "${!sides[@]}"; do
    # shellcheck disable=SC2206  # the assignments are words
    vars=(${sides[$i]})
    if ! env "${vars[@]}" "$bundle/kvfuse-bench-engine" --set model=llama3-8b --set device=cuda \
      --set kv_cache_dtype=fp8_e4m3 --batch "${AB_BATCH:-1}" --context "${AB_CONTEXT:-512,2048}" \
      --attention split --graphs on --reps 3 "${args[@]}" --json "$runs/engine.$i.$r.json" \
      >"$runs/engine.$i.$r.txt" 2>&1; then
      tail -5 "$runs/engine.$i.$r.txt"
      note "FAIL: engine side $i round $r"
      status=1
    fi
  done
  note "round $r done"
done
python3 - "$runs" "${AB_ROUNDS:-2}" "${sides[@]}" <<'EOF' | tee -a "$summary"
import json, os, statistics, sys
d, rounds, sides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
per = {}  # cell -> side -> [ms]
for i in range(len(sides)):
    for r in range(1, rounds + 1):
        p = os.path.join(d, f"engine.{i}.{r}.json")
        if not os.path.exists(p):
            continue
        for cell in json.load(open(p))["cells"]:
            for v in cell["variants"]:
                key = f"b{cell['batch']} x {cell['context']} {v['variant']}"
                per.setdefault(key, {}).setdefault(i, []).append(v["step_ms"])
print(f"\nengine step (llama3-8b, fp8 KV), median of {rounds} runs a side; ratio = side / no switch")
for key, by in per.items():
    if 0 not in by:
        continue
    base = statistics.median(by[0])
    print(f"  {key}: no switch {base:.3f} ms")
    for i in range(1, len(sides)):
        if i in by:
            m = statistics.median(by[i])
            print(f"    {sides[i]:<40} {m:.3f} ms  x{m / base:.3f}")
EOF
tar -czf "$out/ab.tgz" -C "$runs" .
note "$( ((status == 0)) && echo DONE || echo FAILED)"
exit $status
