#!/usr/bin/env bash
# The image check: builds the CPU image (docker/Dockerfile.cpu) with podman, runs it,
# and checks that health turns SERVING, a Generate streams its tokens, /metrics answers,
# and SIGTERM ends the server with exit status 0. Needs root on Debian 12.
#
# No registry is reachable from the CI machines, so the base image is made here:
# mmdebstrap writes Debian 12 to a tarball (cached in $KVFUSE_IMAGE_CACHE, default
# /var/cache/kvfuse/images), and `podman import` tags it debian:12, the name the
# Dockerfile uses; builds never pull. Podman runs with docker/podman/*.conf (runc, the
# host's network, cgroupfs, vfs storage). The container uses the host's network, so the
# server listens on free ports picked here, not on 50051/9400.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
say() { echo "container-check: $*"; }
export CONTAINERS_CONF=$PWD/docker/podman/containers.conf
export CONTAINERS_STORAGE_CONF=$PWD/docker/podman/storage.conf
KVFUSE_WITH_CONTAINERS=1 scripts/install-deps.sh

# --- the base image -------------------------------------------------------------------
cache=${KVFUSE_IMAGE_CACHE:-/var/cache/kvfuse/images}
if ! podman image exists debian:12; then
  tarball=$cache/debian-12.tar
  if [[ ! -f $tarball ]]; then
    mkdir -p "$cache"
    say "making debian:12 with mmdebstrap (bookworm, minbase)"
    mmdebstrap --variant=minbase --format=tar --aptopt='APT::Install-Recommends "false"' \
      bookworm "$tarball.tmp" http://deb.debian.org/debian
    mv "$tarball.tmp" "$tarball"
  fi
  podman import --change 'CMD ["bash"]' "$tarball" debian:12
fi

# --- build ----------------------------------------------------------------------------
podman build --pull=never -f docker/Dockerfile.cpu -t kvfuse:cpu .
say "image built ($(($(date +%s) - start)) s): $(podman image inspect kvfuse:cpu --format '{{.Id}} {{.Size}}')"

# --- run ------------------------------------------------------------------------------
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
grpc_port=$(free_port)
metrics_port=$(free_port)
name=kvfuse-check-$$
podman rm -f "$name" >/dev/null 2>&1 || true
trap 'podman rm -f "$name" >/dev/null 2>&1 || true' EXIT
podman run -d --name "$name" kvfuse:cpu --config /config/kvfuse.json \
  --listen "127.0.0.1:$grpc_port" --metrics-port "$metrics_port" >/dev/null
cli() { podman exec "$name" /opt/kvfuse/build/kvfuse-cli --addr "127.0.0.1:$grpc_port" "$@"; }

serving=0
for _ in $(seq 1 120); do
  if out=$(cli health 2>&1) && grep -q SERVING <<<"$out" && ! grep -q NOT_SERVING <<<"$out"; then
    serving=1
    break
  fi
  sleep 1
done
((serving)) || {
  podman logs "$name" | tail -20
  say "FAIL: health never became SERVING"
  exit 1
}
say "health: $out"
gen=$(cli generate --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 8)
echo "$gen"
[[ -n $gen ]] || { say "FAIL: Generate printed nothing"; exit 1; }
metrics=$(curl -fsS "http://127.0.0.1:$metrics_port/metrics")
grep -E '^kvfuse:(generation_tokens_total|num_requests_running)' <<<"$metrics" | head -5
grep -q '^kvfuse:generation_tokens_total' <<<"$metrics" || { say "FAIL: /metrics lacks kvfuse:generation_tokens_total"; exit 1; }

podman kill --signal TERM "$name" >/dev/null
status=$(podman wait "$name")
podman logs "$name" 2>&1 | tail -3
[[ $status == 0 ]] || { say "FAIL: after SIGTERM the server exited $status"; exit 1; }
say "OK: SERVING, Generate answered, /metrics served, SIGTERM exit 0 ($(($(date +%s) - start)) s)"
