#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang (ASan + UBSan) and runs each for
# a bounded time. Exits non-zero if a target fails to build or finds a crash, a leak, a
# sanitizer report or a timeout; the reproducer is left in the build directory
# (crash-*, leak-*, timeout-*) and named in the output.
#
#   scripts/ci/fuzz.sh [seconds per target]      (default 60, or $FUZZ_SECONDS)
#
# Environment: FUZZ_CXX (default clang++), FUZZ_BUILD_DIR (default build-fuzz).
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-${FUZZ_SECONDS:-60}}
cxx=${FUZZ_CXX:-clang++}
out=${FUZZ_BUILD_DIR:-build-fuzz}
command -v "$cxx" >/dev/null || { echo "scripts/ci/fuzz.sh: $cxx not found (Debian: apt-get install clang)" >&2; exit 2; }

mkdir -p "$out/obj"
common=(-std=c++20 -O1 -g -fno-omit-frame-pointer -I. -Wall -Wextra -Werror)
san=(-fsanitize=address,undefined -fno-sanitize-recover=undefined)
read -r -a absl <<<"$(pkg-config --cflags --libs absl_strings absl_str_format absl_status absl_statusor)"
# config.cc logs through spdlog (a warning for an unknown KVFUSE_* variable).
read -r -a logging <<<"$(pkg-config --cflags --libs spdlog fmt)"

# Library sources of each target (everything else of src/ stays out: no backend, no BLAS).
lib=(src/loading/safetensors.cc src/loading/checkpoint.cc src/loading/checkpoint_fp8.cc src/loading/hf_config.cc
  src/loading/quant_config.cc src/loading/quant_config_formats.cc src/loading/model_spec.cc src/loading/config.cc
  src/loading/env_switches.cc src/loading/kv_scales.cc src/loading/rope.cc src/parallel/rendezvous.cc src/parallel/socket_io.cc)
declare -A deps=(
  [fuzz_safetensors]="${lib[*]}"
  [fuzz_config]="src/loading/hf_config.cc src/loading/quant_config.cc src/loading/quant_config_formats.cc
    src/loading/model_spec.cc src/loading/config.cc src/loading/env_switches.cc src/loading/kv_scales.cc
    src/loading/rope.cc src/parallel/rendezvous.cc src/parallel/socket_io.cc"
)

echo "scripts/ci/fuzz.sh: compiling with $("$cxx" --version | head -1)"
# The library objects, $KVFUSE_JOBS (default nproc) at a time; any failure fails the script.
jobs=${KVFUSE_JOBS:-$(nproc)}
pids=()
for s in "${lib[@]}"; do
  "$cxx" "${common[@]}" "${san[@]}" -fsanitize=fuzzer-no-link -c "$s" -o "$out/obj/$(basename "$s" .cc).o" &
  pids+=($!)
  if ((${#pids[@]} >= jobs)); then
    wait "${pids[0]}"
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
for t in "${!deps[@]}"; do
  objs=()
  for s in ${deps[$t]}; do objs+=("$out/obj/$(basename "$s" .cc).o"); done
  "$cxx" "${common[@]}" "${san[@]}" -fsanitize=fuzzer "tests/fuzz/$t.cc" "${objs[@]}" "${absl[@]}" "${logging[@]}" -o "$out/$t"
done

rm -rf "$out/seeds"
python3 tests/fuzz/make_seeds.py "$out/seeds"
status=0
for t in fuzz_safetensors fuzz_config; do
  dict=$PWD/tests/fuzz/${t#fuzz_}.dict
  mkdir -p "$out/corpus/$t"
  echo "scripts/ci/fuzz.sh: $t for ${secs}s"
  # -timeout: one input may take at most 10 s (a hang is a failure); -rss_limit_mb bounds
  # memory; reproducers go to $out (-artifact_prefix).
  if ! (cd "$out" && "./$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
        -print_final_stats=1 -artifact_prefix="./$t-" -dict="$dict" "corpus/$t" "seeds/$t"); then
    echo "scripts/ci/fuzz.sh: $t FAILED; reproduce with: $out/$t $out/$t-<artifact>" >&2
    status=1
  fi
done
exit $status
