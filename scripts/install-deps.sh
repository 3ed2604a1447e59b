#!/usr/bin/env bash
# Installs kvfuse's build and test dependencies from Debian 12 packages.
# Idempotent: packages already present are left alone, and apt-get update runs
# only when something is missing. Used by the README commands, .ci/run and the
# Dockerfiles.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev nlohmann-json3-dev catch2 libcli11-dev
  libopenblas-dev libcpp-httplib-dev
  libboost-math-dev  # Student's t quantiles of the benchmarks (header-only)
  clang libclang-rt-14-dev python3  # the libFuzzer targets (scripts/ci/fuzz.sh)
)
# Optional extras, only on request: mmdebstrap for the HIP build in a Debian sid root
# (scripts/ci/ci-hip-build.sh; the root brings its own ROCm); podman and runc for the
# container image check (scripts/ci/container-check.sh).
if [[ "${KVFUSE_WITH_HIP_CHECK:-0}" == 1 ]]; then
  packages+=(mmdebstrap)
fi
if [[ "${KVFUSE_WITH_CONTAINERS:-0}" == 1 ]]; then
  packages+=(mmdebstrap podman runc uidmap)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) != 0 ]]; then SUDO=sudo; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
