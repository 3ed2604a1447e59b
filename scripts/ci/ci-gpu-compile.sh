#!/usr/bin/env bash
# CI compile checks of the CUDA code on a machine without a GPU: nvcc compiles the kernels,
# GPU tests and benchmarks (the NCCL communicator included) for sm_90a, and the kernels and
# the communicator for sm_80 too (objects only), -Werror on host and device code; the
# sm_90a PTX of the KV writes (kv_write.cu, and kv_write_rope.cu with RoPE in it) must use the packed
# saturating conversions (cvt.rn.satfinite.e4m3x2 / e5m2x2). Skipped with a message
# when nvcc is absent. The HIP side (server, tools, benchmarks, GPU tests, gfx942 and gfx950, as machine
# code) is scripts/ci/ci-hip-build.sh. Exit 1 on any failure.
# Outputs (objects, PTX) go to build-ci-gpu/ (or $KVFUSE_CI_GPU_DIR).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${KVFUSE_CI_GPU_DIR:-build-ci-gpu}
mkdir -p "$out"
start=$(date +%s)
fail=0
say() { echo "ci-gpu-compile: $*"; }
bad() {
  say "FAIL: $*"
  fail=1
}

# The tensor-parallel parts (NCCL communicator, its test, the all-reduce benchmark) include
# absl and Catch2 from the system, as the engine build does; NCCL itself is dlopen'ed.
sources=(kernels/*/*.cu kernels/*/*/*.cu tests/gpu/*.cu bench/*.cu src/parallel/*.cu bench/allreduce/*.cu)
common=(-std=c++20 -O3 -I. -DKVFUSE_TEST_DATA_DIR=\"tests/data\")

# --- CUDA ------------------------------------------------------------------------------
nvcc=$(command -v nvcc || true)
if [[ -z $nvcc ]]; then
  nvcc=$(ls -d /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -1 || true)
fi
if [[ -z $nvcc ]]; then
  say "SKIP CUDA: nvcc not found (PATH, /usr/local/cuda*/bin)"
else
  say "CUDA: $("$nvcc" --version | tail -2 | head -1)"
  # One nvcc per core ($KVFUSE_JOBS, default nproc): each compile writes its log beside
  # its object and a .failed marker when it fails; the markers are read once all are done.
  njobs=${KVFUSE_JOBS:-$(nproc)}
  compile_one() {  # arch source: compile one source, log beside the object
    local arch=$1 src=$2 obj
    obj="$out/$(tr / _ <<<"${src%.cu}").$arch.o"  # by path: kernels/ and src/ share file names
    rm -f "$obj.failed"
    "$nvcc" "${common[@]}" -arch="$arch" -Xcompiler=-Wall,-Wextra,-Werror --Werror all-warnings \
      -c "$src" -o "$obj" 2>"$obj.log" || touch "$obj.failed"
  }
  # sm_80 (no hardware FP8 conversions: the bit-manipulation paths) for the kernels and the
  # communicator; the tests' and benchmarks' device code is thin wrappers around the same
  # device functions, checked at sm_90a (their host code is the same for both archs).
  kernel_sources=(kernels/*/*.cu kernels/*/*/*.cu src/parallel/*.cu)
  for arch in sm_90a sm_80; do
    arch_sources=("${sources[@]}")
    [[ $arch == sm_80 ]] && arch_sources=("${kernel_sources[@]}")
    for src in "${arch_sources[@]}"; do
      while (($(jobs -rp | wc -l) >= njobs)); do wait -n || true; done
      compile_one "$arch" "$src" &
    done
    wait
    for src in "${arch_sources[@]}"; do
      obj="$out/$(tr / _ <<<"${src%.cu}").$arch.o"
      if [[ -e $obj.failed ]]; then
        cat "$obj.log"
        bad "nvcc -arch=$arch $src"
      fi
    done
    say "nvcc $arch: ${#arch_sources[@]} sources compiled, $njobs at a time ($(($(date +%s) - start)) s)"
  done
  for write in kv_write/kv_write kv_write/kv_write_rope; do
    ptx="$out/$(basename "$write").sm_90a.ptx"
    if "$nvcc" "${common[@]}" -arch=sm_90a -ptx "kernels/$write.cu" -o "$ptx"; then
      for ins in cvt.rn.satfinite.e4m3x2.f32 cvt.rn.satfinite.e5m2x2.f32; do
        n=$(grep -c "$ins" "$ptx" || true)
        ((n > 0)) && say "sm_90a PTX of $write: $ins x$n" || bad "sm_90a PTX of kernels/$write.cu lacks $ins"
      done
    else
      bad "nvcc -ptx kernels/$write.cu"
    fi
  done
fi

say "$( ((fail == 0)) && echo OK || echo FAILED) in $(($(date +%s) - start)) s"
exit $fail
