#!/usr/bin/env bash
# The engine on the GPU in a minute or two, from the bundle (scripts/gpu/bundle.sh): the
# bundle's GPU tests (backend op parity, logprobs, the CPU-vs-GPU engine, NCCL, the peer
# all-reduce, tensor parallelism on one GPU), then the router path
# (scripts/ci/router-check.sh) against a tiny-model server on the GPU. For a change whose
# kernels the full scripts/gpu/check.sh has already covered. Writes $OUT (or
# build-gpu-engine/): summary.txt and each program's output. Exit 0 when all passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-engine
[[ -x $bundle/test_gpu_backend && -x $bundle/kvfuse-server ]] || { note "FAIL: no bundle (scripts/gpu/bundle.sh)"; exit 1; }
status=0
for t in test_gpu_backend test_gpu_fp8 test_gpu_logprobs test_gpu_engine test_gpu_nccl test_gpu_peer_allreduce test_gpu_tp; do
  "$bundle/$t" >"$out/$t.txt" 2>&1
  rc=$?
  note "$t: exit $rc, $(grep -E "test cases|passed|SKIP" "$out/$t.txt" | tail -1)"
  ((rc == 0)) || status=1
done
port=${PORT:-50161}
if start_server "$out/server.txt" --set model=tiny --set device=cuda --listen "127.0.0.1:$port"; then
  scripts/ci/router-check.sh "$bundle/kvfuse-cli" "127.0.0.1:$port" >"$out/router.txt" 2>&1
  rc=$?
  cat "$out/router.txt" >>"$summary"
  note "router-check on a tiny-model CUDA server: exit $rc"
  ((rc == 0)) || status=1
else
  note "FAIL: the tiny-model CUDA server did not start (server.txt)"
  status=1
fi
kill -TERM "$server_pid" 2>/dev/null
wait "$server_pid" 2>/dev/null
note "$( ((status == 0)) && echo PASS || echo FAIL)"
exit $status
