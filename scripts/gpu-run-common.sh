# The start that the scripts running the device bundle on a GPU machine share
# (gpu-serve.sh, gpu-gemm-tune.sh, gpu-tp.sh), sourced from the repository root:
#   source scripts/gpu-run-common.sh NAME [EXTRA_LIBRARY_DIR]
# sets out ($OUT, default build-NAME), summary ($out/summary.txt, emptied), note() (a line
# with the seconds since the start, to the terminal and the summary), bundle
# (.device-bundle, unpacked from .device-bundle.tar.xz when only the archive was carried
# along), and LD_LIBRARY_PATH (the bundle's libraries, EXTRA_LIBRARY_DIR, then the
# machine's own CUDA libraries for cuBLASLt and the runtime).
run_name=$1
out=${OUT:-build-$run_name}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
t0=$(date +%s)
note() { echo "$run_name: $* ($(($(date +%s) - t0))s)" | tee -a "$summary"; }
bundle=.device-bundle
[[ -d $bundle ]] || [[ ! -f $bundle.tar.xz ]] || tar xJf "$bundle.tar.xz"
cuda_lib=$(dirname "$(ls /usr/local/cuda/lib64/libcublasLt.so* /usr/local/cuda/lib/libcublasLt.so* 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$PWD/$bundle/lib${2:+:$PWD/$2}:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
