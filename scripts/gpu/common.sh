# The start that the scripts running the device bundle on a GPU machine share
# (scripts/gpu/ab.sh, scripts/gpu/compare.sh, scripts/gpu/gemm-tune.sh, scripts/gpu/kernel-revs.sh, scripts/gpu/profile.sh,
# scripts/gpu/serve.sh, scripts/gpu/tp.sh), sourced from the repository root:
#   source scripts/gpu/common.sh NAME [EXTRA_LIBRARY_DIR]
# sets out ($OUT, default build-NAME), summary ($out/summary.txt, emptied), note() (a line
# with the seconds since the start, to the terminal and the summary), bundle
# (.device-bundle, unpacked from .device-bundle.tar.xz when only the archive was carried
# along), and LD_LIBRARY_PATH (the bundle's libraries, EXTRA_LIBRARY_DIR, then the
# machine's own CUDA libraries for cuBLASLt and the runtime); build_gpu_targets,
# wait_engine_ready and start_server.
run_name=$1
out=${OUT:-build-$run_name}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
t0=$(date +%s)
note() { echo "$run_name: $* ($(($(date +%s) - t0))s)" | tee -a "$summary"; }
bundle=.device-bundle
[[ -d $bundle ]] || [[ ! -f $bundle.tar.xz ]] || tar xJf "$bundle.tar.xz"
machine_ld_path=${LD_LIBRARY_PATH:-}  # the machine's own, for its tools (build_gpu_targets)
cuda_lib=$(dirname "$(ls /usr/local/cuda/lib64/libcublasLt.so* /usr/local/cuda/lib/libcublasLt.so* 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$PWD/$bundle/lib${2:+:$PWD/$2}:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# build_gpu_targets SRC BUILD LOG TARGET...: the targets of SRC's standalone GPU build
# (SRC/tests/gpu: kernels, kernel tests and benchmarks) for CUDA sm_$KVFUSE_CUDA_ARCH
# (default 90a), in BUILD, its output into LOG. Fails as the build does. The build's tools
# run with the machine's library path, not the bundle's Debian libraries.
build_gpu_targets() {
  local src=$1 build=$2 log=$3
  shift 3
  local nvcc gen=()
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc)
  command -v ninja >/dev/null && gen=(-G Ninja)
  (
    export LD_LIBRARY_PATH=$machine_ld_path
    cmake -S "$src/tests/gpu" -B "$build" "${gen[@]}" -DKVFUSE_GPU=CUDA -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="${KVFUSE_CUDA_ARCH:-90a}" &&
      cmake --build "$build" -j"$(nproc)" --target "$@"
  ) >"$log" 2>&1
}

# wait_engine_ready PID LOG: waits (up to 5 minutes) until the kvfuse-server PID has logged
# event=engine_ready to LOG; fails if it exits or does not get there.
wait_engine_ready() {
  local pid=$1 log=$2
  for _ in $(seq 600); do
    grep -q "event=engine_ready" "$log" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

# start_server LOG ARGS...: the bundle's kvfuse-server with ARGS and no metrics port, its
# output into LOG, in the background; server_pid is its pid. Returns once it is ready
# (wait_engine_ready); one that does not get there is stopped, and start_server fails.
start_server() {
  local log=$1
  shift
  "$bundle/kvfuse-server" "$@" --metrics-port -1 >"$log" 2>&1 &
  server_pid=$!
  wait_engine_ready "$server_pid" "$log" && return 0
  kill "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  return 1
}
