#!/usr/bin/env bash
# Packs a baseline revision for scripts/gpu/compare.sh, which runs this tree's GPU
# benchmarks and the baseline's side by side on one GPU (a refactor that must not change
# speed is checked this way, as ratios inside one run):
#
#   scripts/gpu/baseline.sh REV
#
# Writes .device-baseline/ (git-ignored): src.tar.xz, the baseline's sources (the device
# builds its kernel benchmarks from them), and kvfuse-bench-engine, the baseline's engine
# benchmark built here with the CUDA backend (sm_90a) in a worktree under build-baseline/.
# Its shared libraries come from .device-bundle/lib (scripts/gpu/bundle.sh), plus any it
# needs that are not there. Carry .device-baseline and .device-bundle to the device.
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:?usage: scripts/gpu/baseline.sh REV}
sha=$(git rev-parse --verify "$rev^{commit}")
arch=${KVFUSE_CUDA_ARCH:-90a}
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc)
wt=build-baseline/src
out=.device-baseline
say() { echo "gpu-baseline: $*"; }

if [[ ! -d $wt ]] || [[ $(git -C "$wt" rev-parse HEAD 2>/dev/null) != "$sha" ]]; then
  git worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
  git worktree prune
  git worktree add --detach "$wt" "$sha" >/dev/null
fi
say "baseline $(git log --oneline -1 "$sha")"
cmake -S "$wt" -B build-baseline/cuda -G Ninja -DKVFUSE_GPU=CUDA -DKVFUSE_BUILD_SERVER=OFF \
  -DKVFUSE_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" >/dev/null
ninja -C build-baseline/cuda -j"${KVFUSE_JOBS:-$(nproc)}" kvfuse-bench-engine

rm -rf "$out"
mkdir -p "$out/lib"
git archive "$sha" | xz -T0 >"$out/src.tar.xz"
echo "$sha" >"$out/REV"
cp build-baseline/cuda/bench/engine/kvfuse-bench-engine "$out/"
ldd "$out/kvfuse-bench-engine" | awk '/=> \// {print $3}' |
  grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*|libstdc\+\+|libgcc_s)\.so' | grep -v '/cuda' |
  while read -r lib; do
    [[ -e .device-bundle/lib/$(basename "$lib") ]] || cp -L "$lib" "$out/lib/"
  done
du -sh "$out"
