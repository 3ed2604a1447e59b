#!/usr/bin/env bash
# The machine code of the decode-size KV write beside its Triton peer's, for reading side
# by side: builds the standalone GPU build of tests/gpu as scripts/gpu/check.sh does (its
# KVFUSE_CHECK_BUILD_ONLY mode), dumps the SASS of every kv_write_fused_kernel and
# kv_write_token_kernel instance in bench_kv_write, runs bench/anchor/kv_write_triton.py
# once (T = 1) and dumps the SASS and PTX of the kernel Triton compiled. NVIDIA only.
# Environment: KVFUSE_CUDA_ARCH (default 90a), KVFUSE_GPU_BUILD_DIR (default
# build-gpu-check). Writes $OUT (or build-gpu-sass/): kvfuse_kv_write.sass,
# triton_kv_write.sass, triton_kv_write.ptx, summary.txt, build/ (gpu-check's build log).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-build-gpu-sass}
mkdir -p "$out"
note() { echo "gpu-kv-write-sass: $*" | tee -a "$out/summary.txt"; }
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc)
cuobjdump=$(dirname "$nvcc")/cuobjdump
build=${KVFUSE_GPU_BUILD_DIR:-build-gpu-check}
KVFUSE_GPU=CUDA KVFUSE_CHECK_BUILD_ONLY=1 KVFUSE_GPU_BUILD_DIR="$build" OUT="$out/build" scripts/gpu/check.sh \
  >/dev/null || { note "FAIL: building tests/gpu (build/build.log)"; exit 1; }
"$cuobjdump" -sass "$build/bench/bench_kv_write" | awk '
  /Function : / { keep = ($0 ~ /kv_write_(fused|token)_kernel/) }
  keep { print }' >"$out/kvfuse_kv_write.sass"
note "kvfuse: $(grep -c 'Function : ' "$out/kvfuse_kv_write.sass") kv_write_fused_kernel and kv_write_token_kernel instances"
cache=$(mktemp -d)
TRITON_CACHE_DIR=$cache python3 bench/anchor/kv_write_triton.py --rounds 3 --tokens 1 >"$out/triton_run.txt" 2>&1 ||
  { note "FAIL: the Triton anchor (triton_run.txt)"; exit 1; }
cubin=$(find "$cache" -name 'kv_write_kernel*.cubin' | head -1)
ptx=$(find "$cache" -name 'kv_write_kernel*.ptx' | head -1)
[[ -n $cubin ]] || { note "FAIL: no kv_write_kernel cubin in Triton's cache"; exit 1; }
"$cuobjdump" -sass "$cubin" >"$out/triton_kv_write.sass"
[[ -n $ptx ]] && cp "$ptx" "$out/triton_kv_write.ptx"
note "triton: $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "$out/triton_kv_write.sass") instructions"
