#!/usr/bin/env bash
# CI: the HIP target of kvfuse (all but the CPU-only tests) built in a Debian sid root that holds a current
# ROCm from Debian's own packages (scripts/ci/hip-sid-root.sh makes it once and caches it
# outside the repository), with scripts/hip-build.sh, the script docker/Dockerfile.rocm
# runs on AMD's image. Needs root (mmdebstrap, chroot). Exit status: the build's.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
start=$(date +%s)
root=$(scripts/ci/hip-sid-root.sh)
# The repository is bound into the root at /src; every mount lives in a private mount
# namespace and goes away with it.
mkdir -p "$root/src"
unshare --mount --propagation private --fork bash -euo pipefail -c '
  root=$1 repo=$2; shift 2
  mount --rbind /dev "$root/dev"
  mount -t proc proc "$root/proc"
  mount --bind "$repo" "$root/src"
  exec chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    KVFUSE_JOBS="${KVFUSE_JOBS:-2}" bash -c "cd /src && scripts/hip-build.sh \"\$@\"" hip-build "$@"
' ci-hip-build "$root" "$repo" "$@"
echo "ci-hip-build: done in $(($(date +%s) - start)) s"
