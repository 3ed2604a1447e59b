#!/usr/bin/env bash
# The one command that builds and runs the GPU parity tests and the kernel benchmarks
# on a CUDA or ROCm machine:
#
#   scripts/gpu/check.sh                    # NVIDIA (nvcc), e.g. an H200
#   KVFUSE_GPU=HIP scripts/gpu/check.sh     # AMD (ROCm clang), e.g. an MI300X or MI355X
#
# KVFUSE_GPU defaults to CUDA where nvcc is found, else HIP where a ROCm clang is.
# It needs only the vendor toolkit, cmake (>= 3.22) and a host compiler: it configures the
# standalone GPU build of tests/gpu/CMakeLists.txt (kernels, the CPU KV-write, attention
# and FP8 GEMM references, the tests and bench/; no absl, gRPC or BLAS), builds it, runs
# the parity programs, bench_kv_write and bench_attention (and, where torch and Triton
# are installed, bench/anchor/kv_write_triton.py), then (if compute-sanitizer
# is there and works) the KV-write, attention and FP8 GEMV tests once more under memcheck
# (reduced matrices). Files go to $OUT (the device runner's output folder; at most 8 files come
# back from it; this writes 10: summary.txt, build.log, gpu_tests.log with every test
# program's and memcheck's output, engine.log, hf_reference.log and .json, and per
# benchmark its table and JSON; the device run packs them into one archive) or,
# if unset, build-gpu-check/logs. Exit status: 0 if the build and every test passed (or
# were skipped for lack of a GPU), 1 otherwise.
#
# On AMD it builds for the GPU's own arch (rocm_agent_enumerator or amdgpu-arch; else
# gfx942 and gfx950), runs the same parity programs plus test_mfma_gpu (the matrix
# instructions' lane layouts against the host emulator) and the benchmarks, whose tables
# give the fraction of the device's HBM peak (MI300X 5.3 TB/s, MI325X 6, MI355X 8); there
# is no memcheck and no engine bundle step on AMD.
#
# Environment: KVFUSE_GPU (CUDA or HIP), KVFUSE_CUDA_ARCH (default 90a), KVFUSE_HIP_ARCH
# (default: the GPU's), KVFUSE_GPU_BUILD_DIR (default build-gpu-check), KVFUSE_BENCH_ROUNDS
# (default 15), KVFUSE_ATTN_BENCH_ROUNDS (default 9), KVFUSE_SANITIZER_TIMEOUT (s per
# memcheck run, 150), KVFUSE_CHECK_BENCHES_ONLY=1 (build, then only the two kernel
# benchmarks: no tests, memcheck or engine step), KVFUSE_CHECK_BUILD_ONLY=1 (configure and
# build, nothing else: scripts/gpu/kv-write-sass.sh builds this way), KVFUSE_CHECK_TESTS="t1 t2"
# (only these parity programs, and memcheck of those of them memcheck covers; no
# benchmarks, no engine step: a kernel's own check).
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${KVFUSE_GPU_BUILD_DIR:-build-gpu-check}
out=${OUT:-$build/logs}
mkdir -p "$out"
summary="$out/summary.txt"
log="$out/build.log"
: >"$summary"
note() { echo "gpu-check: $*" | tee -a "$summary"; }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0))s"; }

nvcc=$(command -v nvcc || true)
if [[ -z $nvcc ]]; then
  nvcc=$(ls -d /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -1 || true)
fi
hipcxx=""
for c in /opt/rocm/llvm/bin/clang++ "$(command -v clang++-21 || true)"; do
  [[ -n $c && -x $c ]] && { hipcxx=$c; break; }
done
vendor=${KVFUSE_GPU:-$([[ -n $nvcc || -z $hipcxx ]] && echo CUDA || echo HIP)}
generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
if [[ $vendor == HIP ]]; then
  if [[ -z $hipcxx ]]; then
    note "FAIL: KVFUSE_GPU=HIP but no ROCm clang (/opt/rocm/llvm/bin/clang++ or clang++-21)"
    exit 1
  fi
  arch=${KVFUSE_HIP_ARCH:-}
  if [[ -z $arch ]]; then
    for probe in rocm_agent_enumerator /opt/rocm/bin/rocm_agent_enumerator amdgpu-arch /opt/rocm/llvm/bin/amdgpu-arch; do
      if command -v "$probe" >/dev/null 2>&1; then
        arch=$("$probe" 2>/dev/null | grep -E '^gfx9(42|50)' | sort -u | paste -sd';' -)
        [[ -n $arch ]] && break
      fi
    done
  fi
  arch=${arch:-gfx942;gfx950}
  prefix=()
  [[ -d /opt/rocm ]] && prefix=(-DCMAKE_PREFIX_PATH=/opt/rocm)
  configure=(-DKVFUSE_GPU=HIP -DCMAKE_HIP_COMPILER="$hipcxx" -DCMAKE_HIP_ARCHITECTURES="$arch" "${prefix[@]}")
  tool="$hipcxx"
elif [[ -z $nvcc ]]; then
  note "FAIL: no nvcc on PATH or under /usr/local/cuda*/bin (KVFUSE_GPU=HIP for AMD)"
  exit 1
else
  arch=${KVFUSE_CUDA_ARCH:-90a}
  configure=(-DKVFUSE_GPU=CUDA -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$arch")
  tool="$nvcc"
fi
{
  date -u
  if [[ $vendor == HIP ]]; then
    rocm-smi 2>&1 || rocminfo 2>&1 | grep -E "Marketing Name|gfx" | head -8 || echo "rocm-smi unavailable"
  else
    nvidia-smi 2>&1 || echo "nvidia-smi unavailable"
  fi
  "$tool" --version
  cmake --version | head -1
  c++ --version 2>&1 | head -1
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(git status --porcelain 2>/dev/null | wc -l) changed"
} >"$log" 2>&1
note "$vendor: $tool, arch $arch, logs in $out"

if ! cmake -S tests/gpu -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${configure[@]}" >>"$log" 2>&1; then
  tail -30 "$log"
  note "FAIL: configure (see build.log) after $(elapsed)"
  exit 1
fi
if ! cmake --build "$build" -j"$(nproc)" >>"$log" 2>&1; then
  grep -E "error|Error" "$log" | head -30
  note "FAIL: build (see build.log) after $(elapsed)"
  exit 1
fi
note "built in $(elapsed)"
[[ ${KVFUSE_CHECK_BUILD_ONLY:-0} == 1 ]] && exit 0

status=0
tests_log="$out/gpu_tests.log"
: >"$tests_log"
tests=(test_fp8_convert_gpu test_kv_write_gpu test_kv_write_rope_gpu test_attention_gpu test_attention_rope_gpu test_gemv_gpu test_gemv_fp8_gpu)
[[ $vendor == HIP ]] && tests+=(test_mfma_gpu)
benches_only=${KVFUSE_CHECK_BENCHES_ONLY:-0}
[[ $benches_only == 1 ]] && tests=()
only=${KVFUSE_CHECK_TESTS:-}
[[ -n $only ]] && read -r -a tests <<<"$only"
for t in "${tests[@]}"; do
  echo "=== $t" >>"$tests_log"
  "$build/$t" >"$build/$t.log" 2>&1
  rc=$?
  cat "$build/$t.log" >>"$tests_log"
  grep -E "^FAIL|^SKIP|^FATAL|passed,|conversion for|device 0|^matrix|^bench shape" "$build/$t.log" | head -40
  note "$t: exit $rc, $(tail -1 "$build/$t.log") ($(elapsed))"
  ((rc == 0)) || status=1
done

benches=(bench_kv_write bench_kv_write_probe bench_attention)
[[ -n $only ]] && benches=()
for b in "${benches[@]}"; do
  rounds=${KVFUSE_BENCH_ROUNDS:-15}
  [[ $b == bench_attention ]] && rounds=${KVFUSE_ATTN_BENCH_ROUNDS:-9}
  "$build/bench/$b" --json "$out/$b.json" --rounds "$rounds" >"$out/$b.txt" 2>&1
  rc=$?
  cat "$out/$b.txt"
  note "$b: exit $rc ($(elapsed))"
  ((rc == 0)) || status=1
done

# The Triton peer of the fused write (bench/anchor/kv_write_triton.py), timed the way
# bench_kv_write times its own, in the same run: where torch and Triton are installed.
if [[ -n $only ]]; then
  note "benchmarks: SKIP (KVFUSE_CHECK_TESTS)"
elif [[ $vendor == CUDA ]] && python3 -c "import torch, triton" >/dev/null 2>&1; then
  python3 bench/anchor/kv_write_triton.py --rounds "${KVFUSE_BENCH_ROUNDS:-15}" >"$out/kv_write_triton.txt" 2>&1
  rc=$?
  cat "$out/kv_write_triton.txt"
  note "kv_write_triton: exit $rc ($(elapsed))"
  ((rc == 0)) || status=1
else
  note "kv_write_triton: SKIP (needs CUDA, torch and Triton)"
fi

if [[ $benches_only == 1 ]]; then
  note "tests, memcheck, engine: SKIP (KVFUSE_CHECK_BENCHES_ONLY=1)"
  note "$( ((status == 0)) && echo PASS || echo FAIL) after $(elapsed)"
  exit $status
fi

# Out-of-bounds accesses would not always change the values compared above: memcheck
# the KV-write, attention and FP8 GEMV tests (reduced matrices), output appended to
# gpu_tests.log. "Device not supported" (gVisor) is a skip.
san=""
[[ $vendor == CUDA ]] && san=$(command -v compute-sanitizer || ls -d /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [[ $vendor == HIP ]]; then
  note "compute-sanitizer: SKIP (NVIDIA only)"
elif [[ -n $san ]]; then
  for t in test_kv_write_gpu test_kv_write_rope_gpu test_attention_gpu test_gemv_fp8_gpu; do
    [[ -z $only || " $only " == *" $t "* ]] || continue
    KVFUSE_GPU_TEST_QUICK=1 timeout "${KVFUSE_SANITIZER_TIMEOUT:-150}" "$san" --tool memcheck --error-exitcode 3 \
      "$build/$t" >"$build/$t.memcheck.log" 2>&1
    rc=$?
    { echo "=== memcheck $t (exit $rc)"; tail -60 "$build/$t.memcheck.log"; } >>"$tests_log"
    if grep -q "Device not supported\|not supported on this" "$build/$t.memcheck.log"; then
      note "compute-sanitizer $t: SKIP (device not supported here)"
      san=""
      break
    elif ((rc == 124)); then
      note "compute-sanitizer $t: SKIP (timed out; see gpu_tests.log)"
    else
      note "compute-sanitizer memcheck $t: exit $rc, $(grep -E 'ERROR SUMMARY' "$build/$t.memcheck.log" | tail -1) ($(elapsed))"
      ((rc == 0)) || status=1
    fi
  done
else
  note "compute-sanitizer: SKIP (not found)"
fi

if [[ -n $only ]]; then
  note "$( ((status == 0)) && echo PASS || echo FAIL) after $(elapsed) (KVFUSE_CHECK_TESTS: $only)"
  exit $status
fi

# The engine on the GPU: backend op parity and CPU-vs-GPU engine tests, from the
# bundle scripts/gpu/bundle.sh builds on a machine with the Debian libraries (the device
# machine has none of them). Skipped when no bundle was carried along.
bundle=.device-bundle
[[ -d $bundle ]] || [[ ! -f $bundle.tar.xz ]] || tar xJf "$bundle.tar.xz"
if [[ $vendor == HIP ]]; then
  note "engine tests: SKIP (the device bundle is CUDA's; on AMD run the HIP build's test_gpu_backend, test_gpu_logprobs and test_gpu_engine)"
elif [[ -x $bundle/test_gpu_backend ]]; then
  cuda_lib=$(dirname "$(ls /usr/local/cuda/lib64/libcublasLt.so* /usr/local/cuda/lib/libcublasLt.so* 2>/dev/null | head -1)")
  export LD_LIBRARY_PATH="$PWD/$bundle/lib:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  : >"$out/engine.log"
  for t in test_gpu_backend test_gpu_fp8 test_gpu_logprobs test_gpu_engine; do
    "$bundle/$t" >>"$out/engine.log" 2>&1
    rc=$?
    grep -E "^gpu engine|failed|Passed|passed" "$out/engine.log" | tail -20
    note "$t: exit $rc ($(elapsed))"
    ((rc == 0)) || status=1
  done
  # The sampling and argmax kernels live only behind the backend: memcheck them there.
  if [[ -n $san ]]; then
    timeout "${KVFUSE_SANITIZER_TIMEOUT:-150}" "$san" --tool memcheck --error-exitcode 3 \
      "$bundle/test_gpu_logprobs" "[sampling]" >>"$out/engine.log" 2>&1
    rc=$?
    note "compute-sanitizer memcheck test_gpu_logprobs [sampling]: exit $rc, $(grep -E 'ERROR SUMMARY' "$out/engine.log" | tail -1) ($(elapsed))"
    ((rc == 0)) || status=1
  fi
  # The NCCL communicator on two GPUs (it skips, saying why, with one GPU or no NCCL).
  # NCCL is dlopen'ed: where no libnccl.so.2 is on the loader's path, take a pip one.
  if [[ -z ${KVFUSE_NCCL_LIBRARY:-} ]] && ! ldconfig -p 2>/dev/null | grep -q libnccl.so.2; then
    nccl_lib=$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)
    [[ -n $nccl_lib ]] && export KVFUSE_NCCL_LIBRARY=$nccl_lib
  fi
  NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} "$bundle/test_gpu_nccl" >>"$out/engine.log" 2>&1
  rc=$?
  grep -E "skipped|passed|failed" "$out/engine.log" | tail -3
  note "test_gpu_nccl: exit $rc ($(elapsed))"
  ((rc == 0)) || status=1
  # The all-reduce over peer memory on two GPUs or more; with one GPU, two ranks share it
  # (the protocol, kernels, graphs and abort run, the links do not; the NCCL part skips).
  if [[ -x $bundle/test_gpu_peer_allreduce ]]; then
    NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} "$bundle/test_gpu_peer_allreduce" >>"$out/engine.log" 2>&1
    rc=$?
    grep -E "share GPU|skipped|passed|failed" "$out/engine.log" | tail -3
    note "test_gpu_peer_allreduce: exit $rc ($(elapsed))"
    ((rc == 0)) || status=1
  fi
  # The sharded engine on two GPUs against one; with one GPU its tp 2 engines run both ranks
  # on it (Config::tp_share_gpu), and the comparison with NCCL skips.
  NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} "$bundle/test_gpu_tp" >>"$out/engine.log" 2>&1
  rc=$?
  grep -E "^gpu tp|skipped|passed|failed" "$out/engine.log" | tail -8
  note "test_gpu_tp: exit $rc ($(elapsed))"
  ((rc == 0)) || status=1
  "$bundle/kvfuse-run" --set device=cuda -n 8 -m 32 -q >>"$out/engine.log" 2>&1
  rc=$?
  tail -3 "$out/engine.log"
  note "kvfuse-run on cuda: exit $rc ($(elapsed))"
  ((rc == 0)) || status=1
  # Against Hugging Face transformers on random small checkpoints (plain and scaled RoPE,
  # GQA, biases, windows; and FP8 checkpoints in the compressed-tensors and Quark layouts),
  # on the CPU and the GPU: needs torch and transformers.
  if [[ -x $bundle/kvfuse-eval ]] && python3 -c "import torch, transformers" 2>/dev/null; then
    for ref in hf_reference hf_reference_fp8; do
      python3 "tests/$ref.py" --kvfuse-bin "$bundle/kvfuse-eval" --device cpu --device cuda \
        --json-out "$out/$ref.json" >"$out/$ref.log" 2>&1
      rc=$?
      tail -25 "$out/$ref.log"
      note "$ref.py (cpu, cuda): exit $rc ($(elapsed))"
      ((rc == 0)) || status=1
    done
  else
    note "hf_reference.py: SKIP (no kvfuse-eval in the bundle, or no torch/transformers)"
  fi
else
  note "engine tests: SKIP (no $bundle; build it with scripts/gpu/bundle.sh)"
fi

note "$( ((status == 0)) && echo PASS || echo FAIL) after $(elapsed)"
exit $status
