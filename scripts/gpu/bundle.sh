#!/usr/bin/env bash
# Builds the engine with the CUDA backend here (sm_90a) and packs the GPU engine tests,
# kvfuse-run (kvfuse-eval and kvfuse-calibrate for tests/hf_reference.py), the benchmarks,
# and kvfuse-server with its clients kvfuse-cli and kvfuse-bench-serve, with the non-system shared libraries they
# need, into .device-bundle/ and .device-bundle.tar.xz (both git-ignored), for a CUDA
# machine that has the driver and CUDA 13 but none of the Debian libraries. cuBLASLt and
# the CUDA runtime are not packed: the machine's own /usr/local/cuda provides them.
# scripts/gpu/check.sh, scripts/gpu/tp.sh and scripts/gpu/serve.sh run the bundle when it is there
# (unpacking the archive first when only it was carried along).
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/install-deps.sh
build=${KVFUSE_CUDA_BUILD_DIR:-build-cuda}
arch=${KVFUSE_CUDA_ARCH:-90a}
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc)
cmake -S . -B "$build" -G Ninja -DKVFUSE_GPU=CUDA -DKVFUSE_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$arch" >/dev/null
targets=(kvfuse-run kvfuse-eval kvfuse-calibrate kvfuse-ab kvfuse-bench-engine test_gpu_backend test_gpu_fp8 test_gpu_logprobs
  test_gpu_engine test_gpu_nccl test_gpu_peer_allreduce test_gpu_tp kvfuse-bench-allreduce kvfuse-server kvfuse-bench-serve kvfuse-cli)
ninja -C "$build" -j"${KVFUSE_JOBS:-$(nproc)}" "${targets[@]}"
bundle=.device-bundle
rm -rf "$bundle"
mkdir -p "$bundle/lib"
cp "$build/kvfuse-run" "$build/kvfuse-eval" "$build/kvfuse-calibrate" "$build/bench/ab/kvfuse-ab" \
  "$build/bench/engine/kvfuse-bench-engine" "$build/tests/test_gpu_backend" "$build/tests/test_gpu_fp8" \
  "$build/tests/test_gpu_logprobs" \
  "$build/tests/test_gpu_engine" "$build/tests/test_gpu_nccl" "$build/tests/test_gpu_peer_allreduce" \
  "$build/tests/test_gpu_tp" \
  "$build/bench/allreduce/kvfuse-bench-allreduce" "$build/kvfuse-server" "$build/kvfuse-bench-serve" "$build/kvfuse-cli" "$bundle/"
# KVFUSE_BUNDLE_KERNEL_TESTS="test_gemv_gpu ...": these kernel parity tests (tests/gpu) too,
# in kernel-tests/ (scripts/gpu/ab.sh runs them), so the GPU machine compiles nothing.
if [[ -n ${KVFUSE_BUNDLE_KERNEL_TESTS:-} ]]; then
  # shellcheck disable=SC2086  # a list of target names
  ninja -C "$build" -j"${KVFUSE_JOBS:-$(nproc)}" $KVFUSE_BUNDLE_KERNEL_TESTS
  mkdir -p "$bundle/kernel-tests"
  for t in $KVFUSE_BUNDLE_KERNEL_TESTS; do cp "$build/tests/gpu/$t" "$bundle/kernel-tests/"; done
fi
# KVFUSE_BUNDLE_KERNEL_BENCHES="bench_attention ...": these kernel benchmarks (bench/) too,
# in kernel-benches/.
if [[ -n ${KVFUSE_BUNDLE_KERNEL_BENCHES:-} ]]; then
  # shellcheck disable=SC2086  # a list of target names
  ninja -C "$build" -j"${KVFUSE_JOBS:-$(nproc)}" $KVFUSE_BUNDLE_KERNEL_BENCHES
  mkdir -p "$bundle/kernel-benches"
  for t in $KVFUSE_BUNDLE_KERNEL_BENCHES; do cp "$build/bench/$t" "$bundle/kernel-benches/"; done
fi
# KVFUSE_BUNDLE_PROGRAMS="test_gpu_fp8 kvfuse-bench-engine ...": only these programs (and the
# kernel tests and benchmarks above) are packed. Each program carries every kernel (about
# 26 MB), and the device runner carries at most 64 MiB: a run that needs a few of them
# packs just those.
if [[ -n ${KVFUSE_BUNDLE_PROGRAMS:-} ]]; then
  for bin in "$bundle"/kvfuse-* "$bundle"/test_gpu_*; do
    [[ " $KVFUSE_BUNDLE_PROGRAMS " == *" $(basename "$bin") "* ]] || rm -f "$bin"
  done
fi
# Every shared library outside libc's own set and the CUDA toolkit.
shopt -s nullglob  # KVFUSE_BUNDLE_PROGRAMS may leave no test_gpu_* (or no kvfuse-*)
for bin in "$bundle"/kvfuse-* "$bundle"/test_gpu_*; do
  ldd "$bin" | awk '/=> \// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*|libstdc\+\+|libgcc_s)\.so' |
  grep -v '/cuda' | while read -r lib; do cp -L "$lib" "$bundle/lib/"; done
du -sh "$bundle"
echo "gpu-bundle: $(ls "$bundle/lib" | wc -l) libraries packed into $bundle"
# -9e: the dictionary spans the programs, whose device code is mostly the same kernels
# (67 MiB at xz -6 against 22 MiB at -9e for nine programs).
XZ_OPT=${XZ_OPT:--9e -T2} tar cJf "$bundle.tar.xz" "$bundle"
echo "gpu-bundle: $(du -h "$bundle.tar.xz" | cut -f1) in $bundle.tar.xz (carry it instead of $bundle/)"
# The device runner carries at most 64 MiB: say so when the archive is larger.
if (($(stat -c %s "$bundle.tar.xz") > 64 * 1024 * 1024)); then
  echo "gpu-bundle: WARNING: $bundle.tar.xz is over the device runner's 64 MiB; pack only the programs the run" \
    "needs (KVFUSE_BUNDLE_PROGRAMS=\"test_gpu_fp8 kvfuse-bench-engine ...\")" >&2
fi
