#!/usr/bin/env bash
# Makes (or reuses) the Debian sid root that CI builds the HIP target in: Debian's own
# ROCm packages (clang-21 with gfx950, HIP 6.4, hipBLASLt 7.1) plus kvfuse's build
# dependencies. Prints the root's path on stdout, progress on stderr.
#
# The root is cached outside the repository, because CI runs in a fresh clone: under
# $KVFUSE_SID_ROOT_CACHE (default /var/cache/kvfuse), in a folder named by a hash of the
# package list and this script's mmdebstrap options, so a changed list makes a new root
# and a warm machine reuses the old one. A root older than $KVFUSE_SID_ROOT_MAX_AGE_DAYS
# (default 30) is stale and made again: sid moves, and CI should follow it. A root is
# only used once complete (built in a temporary folder, renamed under a lock, so
# concurrent jobs make it once). Roots of other keys unused for a day are removed.
#
# Needs root and mmdebstrap (scripts/install-deps.sh with KVFUSE_WITH_HIP_CHECK=1).
# About 3 minutes and 2.5 GB on a cold cache.
set -euo pipefail

# Debian's ROCm, the compiler's binutils-like tools (llvm-objdump for the ISA, lld for
# the code objects), and the same libraries install-deps.sh installs on Debian 12.
packages=(
  clang-21 lld-21 llvm-21 hipcc libamdhip64-dev libhipblaslt-dev libhipblas-common-dev
  build-essential cmake ninja-build pkg-config python3
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev nlohmann-json3-dev catch2 libcli11-dev
  libopenblas-dev libcpp-httplib-dev libboost-math-dev
)
mirror=${KVFUSE_SID_MIRROR:-http://deb.debian.org/debian}
# The archive snapshot this machine's mirror serves has a sid Release file past its
# Valid-Until date; the signatures are still checked.
opts=(--mode=root --variant=apt --format=directory
  --aptopt='Acquire::Check-Valid-Until "false"' --aptopt='APT::Install-Recommends "false"')

cache=${KVFUSE_SID_ROOT_CACHE:-/var/cache/kvfuse}
key=$(printf '%s\n' "${packages[@]}" "${opts[@]}" "$mirror" | sha256sum | cut -c1-16)
root="$cache/sid-rocm-$key"
say() { echo "hip-sid-root: $*" >&2; }

max_age=${KVFUSE_SID_ROOT_MAX_AGE_DAYS:-30}

[[ $(id -u) == 0 ]] || { say "needs root (mmdebstrap --mode=root, chroot)"; exit 1; }
mkdir -p "$cache"
exec 9>"$cache/.sid-root.lock"
flock 9
if [[ -f $root/.kvfuse-root-complete && -n $(find "$root/.kvfuse-root-complete" -mtime "-$max_age") ]]; then
  say "reusing $root (made $(date -r "$root/.kvfuse-root-complete" -u +%FT%TZ))"
  touch "$root/.kvfuse-root-used"
  cat "$root/.kvfuse-root-versions" >&2
  echo "$root"
  exit 0
fi
command -v mmdebstrap >/dev/null || { say "mmdebstrap not found (apt-get install mmdebstrap)"; exit 1; }

for old in "$cache"/sid-rocm-*; do
  [[ -d $old ]] || continue
  if [[ $old == "$root" || -z $(find "$old" -maxdepth 1 -name .kvfuse-root-used -mtime -1) ]]; then
    say "removing stale root $old"
    rm -rf --one-file-system "$old"
  fi
done
tmp="$root.tmp.$$"
rm -rf --one-file-system "$tmp"
trap 'rm -rf --one-file-system "$tmp"' EXIT
start=$(date +%s)
say "making $root with mmdebstrap (sid, ${#packages[@]} packages)"
mmdebstrap "${opts[@]}" --include="$(IFS=,; echo "${packages[*]}")" sid "$tmp" "$mirror" >&2
# What the root holds, for the build log.
chroot "$tmp" dpkg-query -W -f='${Package} ${Version}\n' clang-21 hipcc libamdhip64-dev libhipblaslt-dev \
  cmake libgrpc++-dev catch2 >"$tmp/.kvfuse-root-versions"
touch "$tmp/.kvfuse-root-complete" "$tmp/.kvfuse-root-used"
mv "$tmp" "$root"
trap - EXIT
say "made $root in $(($(date +%s) - start)) s"
cat "$root/.kvfuse-root-versions" >&2
echo "$root"
