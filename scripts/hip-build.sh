#!/usr/bin/env bash
# Builds the HIP target of kvfuse (server, tools, GPU tests, benchmarks) for gfx942
# and gfx950 with -Werror, links it against libamdhip64 and hipBLASLt, and checks the
# device code (scripts/ci/hip-kernel-report.py: per-kernel resource table and gates).
#
# One script, one set of flags, for both places the HIP build happens:
#   - CI, inside the Debian sid root (scripts/ci/ci-hip-build.sh): Debian's ROCm, clang-21;
#   - docker/Dockerfile.rocm, on AMD's ROCm 7 image: /opt/rocm's clang.
# Usage: scripts/hip-build.sh [build-dir]   (default build-hip)
# Environment: KVFUSE_JOBS (default nproc), KVFUSE_HIP_CXX (the HIP compiler),
# KVFUSE_HIP_ARCHS (default "gfx942;gfx950"), KVFUSE_HIP_CPU_TESTS (1: the CPU-only tests too).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-hip}
jobs=${KVFUSE_JOBS:-$(nproc)}
archs=${KVFUSE_HIP_ARCHS:-gfx942;gfx950}
say() { echo "hip-build: $*"; }

# The compiler: AMD's ROCm clang where /opt/rocm has one, else Debian's clang-21.
cxx=${KVFUSE_HIP_CXX:-}
if [[ -z $cxx ]]; then
  for c in /opt/rocm/llvm/bin/clang++ "$(command -v clang++-21 || true)"; do
    if [[ -n $c && -x $c ]]; then cxx=$c; break; fi
  done
fi
[[ -n $cxx ]] || { say "no HIP compiler (/opt/rocm/llvm/bin/clang++ or clang++-21)"; exit 1; }
prefix=()
[[ -d /opt/rocm ]] && prefix=(-DCMAKE_PREFIX_PATH=/opt/rocm)
say "$("$cxx" --version | head -1), archs $archs, $jobs jobs"

start=$(date +%s)
# Test discovery at ctest time, not at build time: the build machine has no GPU, and
# the build should not run test programs.
# The tests that run on the CPU alone are the CPU build's (scripts/test.sh): the same
# source, nothing in them changes with the GPU backend. KVFUSE_HIP_CPU_TESTS=1 builds
# them here too.
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFUSE_GPU=HIP \
  -DKVFUSE_BUILD_CPU_TESTS="$([[ ${KVFUSE_HIP_CPU_TESTS:-0} == 1 ]] && echo ON || echo OFF)" \
  -DCMAKE_HIP_COMPILER="$cxx" -DCMAKE_HIP_ARCHITECTURES="$archs" \
  -DCMAKE_CATCH_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST "${prefix[@]}" >/dev/null
cmake --build "$dir" -j "$jobs"
say "built in $(($(date +%s) - start)) s"

# The GPU programs link the HIP runtime and hipBLASLt (not a CPU-only fallback).
for bin in kvfuse-server bench/bench_kv_write tests/test_gpu_engine; do
  libs=$(ldd "$dir/$bin" | grep -oE 'lib(amdhip64|hipblaslt)\.so[.0-9]*' | sort -u | tr '\n' ' ')
  [[ $libs == *libamdhip64* && ($bin != kvfuse-server || $libs == *libhipblaslt*) ]] || {
    say "FAIL: $bin does not link libamdhip64/libhipblaslt ($libs)"
    exit 1
  }
  say "$bin links $libs"
done

# The device code as machine code: per-kernel table and gates (registers, scratch,
# occupancy, packed FP8 conversions), from the objects just built.
tools=$(dirname "$(readlink -f "$cxx")")
python3 scripts/ci/hip-kernel-report.py "$dir" "$tools"

# The FP8 conversion recipes of gfx942 and gfx950 against emulators of the instruction
# (host code; the GPU part of the test skips without a device).
"$dir/tests/gpu/test_fp8_convert_gpu"
say "done in $(($(date +%s) - start)) s"
