#!/usr/bin/env bash
# CI compile checks of the GPU code on a machine without a GPU (issue 3, item 5):
# 1. nvcc: kernels, GPU tests and benchmark compiled for sm_90a and sm_80 (objects
#    only), -Werror on host and device code; the sm_90a PTX of the KV write must use
#    the packed saturating conversions (cvt.rn.satfinite.e4m3x2 / e5m2x2).
# 2. clang-19 (HIP): the same sources compiled for gfx942 (host pass, and device pass
#    as bitcode), and the KV write's gfx942 ISA (-S); every fused FP8 write kernel must
#    contain v_cvt_pk_fp8_f32 (e4m3fn, e4m3fnuz) or v_cvt_pk_bf8_f32 (e5m2).
# A toolchain that is absent is skipped with a message (CI installs clang-19 and hipcc
# with KVFUSE_WITH_HIP_CHECK=1; nvcc comes with a CUDA toolkit). Exit 1 on any failure.
# Outputs (objects, PTX, ISA) go to build-ci-gpu/ (or $KVFUSE_CI_GPU_DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${KVFUSE_CI_GPU_DIR:-build-ci-gpu}
mkdir -p "$out"
start=$(date +%s)
fail=0
say() { echo "ci-gpu-compile: $*"; }
bad() {
  say "FAIL: $*"
  fail=1
}

sources=(kernels/*.cu tests/gpu/*.cu bench/*.cu)
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
  for arch in sm_90a sm_80; do
    for src in "${sources[@]}"; do
      obj="$out/$(basename "$src" .cu).$arch.o"
      if ! "$nvcc" "${common[@]}" -arch="$arch" -Xcompiler=-Wall,-Wextra,-Werror --Werror all-warnings \
        -c "$src" -o "$obj" 2>"$obj.log"; then
        cat "$obj.log"
        bad "nvcc -arch=$arch $src"
      fi
    done
    say "nvcc $arch: ${#sources[@]} sources compiled ($(($(date +%s) - start)) s)"
  done
  ptx="$out/kv_write.sm_90a.ptx"
  if "$nvcc" "${common[@]}" -arch=sm_90a -ptx kernels/kv_write.cu -o "$ptx"; then
    for ins in cvt.rn.satfinite.e4m3x2.f32 cvt.rn.satfinite.e5m2x2.f32; do
      n=$(grep -c "$ins" "$ptx" || true)
      ((n > 0)) && say "sm_90a PTX: $ins x$n" || bad "sm_90a PTX of kernels/kv_write.cu lacks $ins"
    done
  else
    bad "nvcc -ptx kernels/kv_write.cu"
  fi
fi

# --- HIP (gfx942) -------------------------------------------------------------------------
clang=$(command -v clang++-19 || true)
if [[ -z $clang ]]; then
  say "SKIP HIP: clang++-19 not found (scripts/install-deps.sh with KVFUSE_WITH_HIP_CHECK=1 installs it)"
elif [[ ! -f /usr/include/hip/hip_runtime.h ]]; then
  say "SKIP HIP: HIP headers not found (/usr/include/hip; the hipcc package)"
else
  hip=("$clang" -x hip --offload-arch=gfx942 --rocm-path=/usr -nogpulib "${common[@]}" -DKVFUSE_HIP
    -Wall -Wextra -Werror)
  for src in "${sources[@]}"; do
    base="$out/$(basename "$src" .cu).gfx942"
    "${hip[@]}" --cuda-host-only -c "$src" -o "$base.host.o" 2>"$base.log" || {
      cat "$base.log"
      bad "HIP host pass $src"
    }
    "${hip[@]}" --cuda-device-only -fgpu-rdc -c "$src" -o "$base.bc" 2>"$base.log" || {
      cat "$base.log"
      bad "HIP device pass $src"
    }
  done
  say "clang-19 gfx942: ${#sources[@]} sources compiled ($(($(date +%s) - start)) s)"
  isa="$out/kv_write.gfx942.s"
  if "${hip[@]}" --cuda-device-only -S kernels/kv_write.cu -o "$isa"; then
    # Per fused FP8 write kernel (2 sources x 3 formats x vector/scalar loads = 12), the
    # packed conversion it must use: Fp8FormatE0/E1 (e4m3fn/e4m3fnuz) -> fp8, E2 (e5m2) -> bf8.
    if ! awk '
      /^_Z[^ ]*kv_write_fused_kernel[^ ]*Fp8RowOp[^ ]*:/ {
        cur = $1; sub(/:$/, "", cur); match(cur, /Fp8FormatE[0-9]/)
        fmt[cur] = substr(cur, RSTART + 10, 1); n++
        match(cur, /KvSrcDtypeE[0-9]/); src[cur] = substr(cur, RSTART + 11, 1) == "0" ? "bf16" : "f16"
        match(cur, /EEELb[01]/); vec[cur] = substr(cur, RSTART + 5, 1) == "1" ? "16-byte loads" : "scalar loads"
        next
      }
      /^\.Lfunc_end/ { cur = "" }
      cur != "" && /v_cvt_pk_fp8_f32/ { fp8[cur]++ }
      cur != "" && /v_cvt_pk_bf8_f32/ { bf8[cur]++ }
      END {
        bad = 0
        for (f in fmt) {
          want = fmt[f] == "2" ? "v_cvt_pk_bf8_f32" : "v_cvt_pk_fp8_f32"
          c = fmt[f] == "2" ? bf8[f] + 0 : fp8[f] + 0
          name = fmt[f] == "0" ? "e4m3fn" : fmt[f] == "1" ? "e4m3fnuz" : "e5m2"
          printf "ci-gpu-compile: gfx942 fused %-8s from %-4s (%s): %s x%d%s\n", name, src[f], vec[f], want, c,
                 c ? "" : "  <-- MISSING"
          if (c == 0) bad = 1
        }
        if (n != 12) { printf "ci-gpu-compile: expected 12 fused FP8 kernels in the ISA, found %d\n", n; bad = 1 }
        exit bad
      }' "$isa"; then
      bad "gfx942 ISA of the fused KV write lacks the packed FP8 conversion ($isa)"
    fi
  else
    bad "clang-19 -S kernels/kv_write.cu for gfx942"
  fi
fi

say "$( ((fail == 0)) && echo OK || echo FAILED) in $(($(date +%s) - start)) s"
exit $fail
