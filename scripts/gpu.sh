#!/usr/bin/env bash
# One entry for the GPU work: scripts/gpu.sh COMMAND [ARGS...] runs scripts/gpu/COMMAND.sh.
#   bundle        (here, with nvcc) build the CUDA binaries and pack them with their libraries
#   check         (GPU machine) kernel parity tests, memcheck, engine tests, the HF comparison
#   bench         (GPU machine) the end-to-end benchmarks behind bench/RESULTS.md, by job name
#   ab            (GPU machine) fused/unfused A/B of the engine, and of any KVFUSE_* switch
#   engine        (GPU machine) the bundle's GPU tests and the router path, in a minute or two
#   serve         (GPU machine) through the server against in-process; the router path
#   tp            (GPU machine) tensor parallelism: tests, all-reduce, sharded engine, processes
#   profile       (GPU machine) kernel traces of decode steps
#   compare       (GPU machine) this tree's benchmarks against another commit's, alternating
#   baseline      (here) pack a baseline revision for compare
#   verify        (GPU machine) before a kernel or engine change lands: check, a short serve, compare
#   fp8           (GPU machine) FP8 weights: their tests, and llama3-8b against llama3-8b-fp8
#   prefix        (GPU machine) the prefix cache through the server: shared prefix, multi-turn, random
#   llama70b      (GPU machine) llama3-70b in FP8 on one GPU: memory split, step grid, server ITL
#   sglang        (GPU machine) smg's SGLang Generate against kvfuse.v1 Generate on one server: ITL p50
#   gemm-tune     (GPU machine) the GEMM tuner's choices and timings
#   kernel-revs   (GPU machine) kernel revisions side by side
#   kv-write-sass (GPU machine) the KV write's machine code
# Each script's header says what it runs, its variables and where its output goes
# (docs/gpus.md has the whole picture). Every command but bundle runs on the bundle that
# `bundle` packs (.device-bundle.tar.xz carried to the GPU machine).
set -euo pipefail
here=$(dirname "$0")
cmd=${1:-}
if [[ -z $cmd || $cmd == -h || $cmd == --help || ! -f $here/gpu/$cmd.sh || $cmd == common ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  [[ -z $cmd || $cmd == -h || $cmd == --help ]] && exit 0
  echo "gpu.sh: unknown command '$cmd'" >&2
  exit 2
fi
shift
exec "$here/gpu/$cmd.sh" "$@"
