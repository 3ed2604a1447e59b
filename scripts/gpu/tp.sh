#!/usr/bin/env bash
# Tensor parallelism on a machine with two GPUs (or more), in one run, from the bundle that
# scripts/gpu/bundle.sh packs (carry .device-bundle or .device-bundle.tar.xz along):
#   1. test_gpu_nccl, test_gpu_peer_allreduce (the all-reduce over peer memory against the
#      rank-ordered sum, graphs, abort/timeout) and tests/gpu/test_gpu_tp.cc (tp 2 against tp 1:
#      logits, greedy tokens, graphs on and off, layer-0 KV bytes per rank; the peer
#      all-reduce against NCCL's at tp 2);
#   2. kvfuse-bench-allreduce: NCCL and the peer all-reduce per call, 8 KB - 8 MB (the peer
#      all-reduce's calls as plain launches, then as programmatic dependents), and --layers:
#      a layer's reduction with no collective, all-reduced, and pushed into the norm;
#   3. kvfuse-bench-engine, llama3-8b at tp 1, at tp 2 with the peer all-reduce (the
#      default, its calls programmatic dependents), at tp 2 with tp_allreduce push (partial
#      sums pushed into the norms instead), with KVFUSE_PEER_PDL=0 (plain launches) and
#      with KVFUSE_PEER_ALLREDUCE=0 (NCCL only), batch 1/8/64 x
#      context 512/2048, split attention, graphs on; the tp 2 runs time the step's
#      collectives alone too (their tables and the path they took go to the summary);
#   4. llama3-70b (synthetic weights, 141 GB in bf16) at tp 2: kvfuse-run with a KV pool of
#      $TP_70B_PAGES pages per GPU (default 25000: 30.5 GiB of fp8 KV per GPU); with
#      TP_70B_BENCH=1 also the engine benchmark at batch 1/8/64 x 512 (the slow part);
#   5. tp 2 across two processes: llama3-8b, a follower kvfuse-run holding rank 1 on GPU 1
#      and the leader kvfuse-run (rank 0) on GPU 0, meeting at tp_rendezvous
#      127.0.0.1:$TP_PORT (default 29500) over NCCL; their greedy tokens must equal those of
#      tp 2 in one process (NCCL's all-reduce there too), and the follower must exit 0
#      once the leader is done. With 4 GPUs or more, also tp 4 across two processes of two
#      GPUs each (ranks 0-1 on GPUs 0,1; ranks 2-3 on GPUs 2,3).
# After step 3, scripts/gpu/tp-ratios.py prints every tp 2 variant's step against tp 1 per cell,
# the targets' verdicts and push against auto. GPU_TP_ONLY picks steps by name, a comma
# list of tests (1), allreduce (2), engine (3), 70b (4), processes (5); one-process is steps
# 1-4; unset, every step. Step 3 builds five llama3-8b engines and step 4 llama3-70b's from 141 GB of synthetic
# weights (one rank's half took 205 s to be ready on one H200), so the whole run may not fit
# a 10-minute limit per call: then run GPU_TP_ONLY=tests,allreduce,engine, and
# GPU_TP_ONLY=70b,processes after it. On a machine
# of one GPU: (a) the peer all-reduce with two ranks sharing the GPU (a test mode: the
# protocol, kernels, graphs and abort, and the kernel's own cost per call; not the links):
# test_gpu_peer_allreduce, test_gpu_tp (its tp 2 engines then run both ranks on the GPU,
# Config::tp_share_gpu: tp 2 against tp 1, each rank's KV bytes, pushed sums against the
# all-reduce) and kvfuse-bench-allreduce --share-gpu (per call, and --layers: a layer's
# reduction all-reduced against pushed into the norm), with and without --pdl
# (GPU_TP_ONLY=tests: the two tests; allreduce: the benchmark); (c) same-gpu: two processes
# of one group both given GPU 0 must each fail with NCCL's reason, not hang, and tp 2 in
# one process must be refused naming GPU 1; (d) nccl-setup: test_gpu_nccl's one-GPU cases
# (the bounded set-up on the real library), and a follower failing inside NCCL's set-up
# must stop the leader at once;
# (b) kvfuse-bench-engine --tp-rank-alone: rank 0 of tp 2 alone (its shard, no collectives)
# against tp 1 for llama3-8b, alternating twice, and llama3-70b's rank 0 with its KV pool
# (TP_70B_ALONE=0 leaves it out; TP_ALONE_ROUNDS=0 leaves llama3-8b out). GPU_TP_ONLY=peer
# runs (a) (tests,allreduce), GPU_TP_ONLY=rank-alone (b).
# NCCL comes from the loader's path, KVFUSE_NCCL_LIBRARY, or a pip-installed
# libnccl.so.2; NCCL_NVLS_ENABLE=0 unless the environment sets it. Writes $OUT (or
# build-gpu-tp/): summary.txt and every program's output. Exit 0 when everything passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/common.sh gpu-tp
[[ -x $bundle/test_gpu_tp ]] || { note "FAIL: no $bundle (scripts/gpu/bundle.sh)"; exit 1; }
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
((gpus >= 1)) || { note "FAIL: no GPU visible"; exit 1; }
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
if [[ -z ${KVFUSE_NCCL_LIBRARY:-} ]] && ! ldconfig -p 2>/dev/null | grep -q libnccl.so.2; then
  nccl_lib=$(find /opt /usr -name libnccl.so.2 2>/dev/null | head -1)
  [[ -n $nccl_lib ]] && export KVFUSE_NCCL_LIBRARY=$nccl_lib
fi
note "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $gpus, $(date -u +%FT%TZ), NCCL ${KVFUSE_NCCL_LIBRARY:-from the loader path}"
status=0
run() {  # name, command...
  local name=$1
  shift
  "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  note "$name: exit $rc"
  ((rc == 0)) || status=1
  return $rc
}
# The llama3-8b engine cells, at one GPU (tp 1 against rank 0 alone) and at two. Context
# 2048, not 8192: batch 64 x 2048 is the cell the tp 2 target is set at, and shorter runs
# leave time.
bench=("$bundle/kvfuse-bench-engine" --attention split --graphs on --steps 16 --reps 5 --warmup 1)
cells=(--batch 1,8,64 --context 512,2048 --max-kv-gib 60)

# Rank 1 (the follower, with the environment in follower_env) and rank 0 (the leader) of
# one tp 2 group of kvfuse-run, started at once, each under `timeout $2`: writes
# $out/$1-leader.txt and $out/$1-follower.txt, sets lrc and frc (their exit statuses) and
# took (the leader's seconds), and notes them with the first line of each output that
# matches $3.
group_of_two() {  # name, timeout, pattern, kvfuse-run args...
  local name=$1 limit=$2 pattern=$3
  shift 3
  local start_s follower who
  start_s=$(date +%s)
  env "${follower_env[@]}" timeout "$limit" "$bundle/kvfuse-run" "$@" --set tp_rank=1 \
    >"$out/$name-follower.txt" 2>&1 &
  follower=$!
  timeout "$limit" "$bundle/kvfuse-run" "$@" >"$out/$name-leader.txt" 2>&1
  lrc=$?
  took=$(($(date +%s) - start_s))
  wait $follower
  frc=$?
  note "$name: leader exit $lrc after ${took} s, follower exit $frc"
  for who in leader follower; do
    grep -m1 -E "$pattern" "$out/$name-$who.txt" | cut -c1-500 | tee -a "$summary"
  done
}

# Whether GPU_TP_ONLY (a comma list of step names, or an alias for several) asks for step
# $1; unset or empty: every step.
want() {
  local only=${GPU_TP_ONLY:-}
  case $only in
    one-process) only=tests,allreduce,engine,70b ;;
    peer) only=tests,allreduce ;;
  esac
  [[ -z $only || ,$only, == *,$1,* ]]
}
if ((gpus == 1)); then
  note "one GPU: tensor parallelism needs 2; what runs here is the peer all-reduce and the tp 2 engine with two ranks sharing the GPU (test modes), and rank 0 of tp 2 alone"
  if want tests; then
    run test_gpu_peer_allreduce "$bundle/test_gpu_peer_allreduce"
    grep -E "share GPU|skipped|passed|failed" "$out/test_gpu_peer_allreduce.txt" | tail -3 | tee -a "$summary"
    run test_gpu_tp timeout 900 "$bundle/test_gpu_tp"
    grep -E "^gpu tp|skipped|passed|failed" "$out/test_gpu_tp.txt" | tee -a "$summary"
  fi
  if want allreduce; then
    # Plain launches and programmatic dependents (--pdl), alternating twice.
    for round in 1 2; do
      for mode in plain pdl; do
        flag=()
        [[ $mode == pdl ]] && flag=(--pdl)
        run "bench-allreduce-shared-$mode-$round" "$bundle/kvfuse-bench-allreduce" --share-gpu --rounds 7 "${flag[@]}" \
          --json "$out/allreduce-shared-$mode-$round.json"
        grep -E "^ +[0-9]+ |share|SKIP" "$out/bench-allreduce-shared-$mode-$round.txt" | tee -a "$summary"
        run "bench-layers-shared-$mode-$round" "$bundle/kvfuse-bench-allreduce" --share-gpu --layers --rounds 7 \
          "${flag[@]}" --json "$out/layers-shared-$mode-$round.json"
        grep -E "^ +[0-9]+ |layers|SKIP" "$out/bench-layers-shared-$mode-$round.txt" | tee -a "$summary"
      done
    done
  fi
  if want rank-alone; then
    # What one rank of tp 2 computes, against tp 1, in one run (kvfuse-bench-engine
    # --tp-rank-alone: rank 0's shard with every collective left out), alternating twice;
    # the step of a real group adds its collectives and the wait for the slower rank.
    for round in $(seq 1 "${TP_ALONE_ROUNDS:-2}"); do
      for variant in tp1 tp2-alone; do
        flag=()
        [[ $variant == tp2-alone ]] && flag=(--set tensor_parallel=2 --tp-rank-alone)
        run "engine-llama3-8b-$variant-$round" "${bench[@]}" --set model=llama3-8b "${flag[@]}" "${cells[@]}" \
          --json "$out/engine-llama3-8b-$variant-$round.json"
        echo "llama3-8b $variant (round $round):" | tee -a "$summary"
        grep -E "^ +(1|8|64) " "$out/engine-llama3-8b-$variant-$round.txt" | tee -a "$summary"
      done
      if [[ -s $out/engine-llama3-8b-tp1-$round.json && -s $out/engine-llama3-8b-tp2-alone-$round.json ]]; then
        python3 scripts/gpu/tp-ratios.py "$out/engine-llama3-8b-tp1-$round.json" \
          "tp2-alone=$out/engine-llama3-8b-tp2-alone-$round.json" 2>&1 | tee -a "$summary"
      fi
    done
    # llama3-70b's rank 0 at tp 2: half its 141 GB of bf16 weights and a KV pool of
    # $TP_70B_PAGES pages (default 25000: 30.5 GiB of fp8 KV) on this GPU, what each of two
    # GPUs would hold.
    if [[ ${TP_70B_ALONE:-1} == 1 ]]; then
      run engine-llama3-70b-tp2-alone "${bench[@]}" --set model=llama3-70b --set tensor_parallel=2 --tp-rank-alone \
        --set num_pages="${TP_70B_PAGES:-25000}" --batch 1,8,64 --context 512 --max-kv-gib 40 \
        --json "$out/engine-llama3-70b-tp2-alone.json"
      grep -E "building engine|engine ready|^ +(1|8|64) " "$out/engine-llama3-70b-tp2-alone.txt" | tee -a "$summary"
    fi
  fi
  if want same-gpu; then
    # Two processes of one group given the same GPU, as a misconfigured node would: NCCL
    # holds one rank per GPU and refuses the communicator, so both processes must end with
    # its reason (its last warning, "Duplicate GPU detected"), and neither may hang.
    sg=(--set model=tiny --set tensor_parallel=2 --set tp_rendezvous=127.0.0.1:"${TP_PORT:-29500}"
      --set tp_rendezvous_timeout_s=60 --set devices=0 -n 2 -m 4 -q)
    follower_env=()
    group_of_two same-gpu 180 "error|Duplicate" "${sg[@]}"
    if ((lrc == 0 || lrc == 124 || frc == 0 || frc == 124)) ||
      ! grep -q "Duplicate GPU" "$out/same-gpu-leader.txt" || ! grep -q "Duplicate GPU" "$out/same-gpu-follower.txt"; then
      note "FAIL: same-gpu: both processes must fail with NCCL's duplicate-GPU warning, neither time out"
      status=1
    fi
    # tp 2 in one process on this one GPU: refused, naming the GPU that is not there.
    timeout 120 "$bundle/kvfuse-run" --set model=tiny --set tensor_parallel=2 -n 2 -m 4 -q >"$out/tp2-one-gpu.txt" 2>&1
    rc=$?
    note "tp2-one-gpu: exit $rc"
    grep -m1 -E "error|visible" "$out/tp2-one-gpu.txt" | cut -c1-400 | tee -a "$summary"
    if ((rc == 0 || rc == 124 || rc > 128)) || ! grep -q "GPU 1 does not exist" "$out/tp2-one-gpu.txt"; then
      note "FAIL: tp2-one-gpu: tp 2 on one GPU must be refused naming GPU 1"
      status=1
    fi
  fi
  if want nccl-setup; then
    # The bounded NCCL set-up on the real library: test_gpu_nccl's one-GPU cases (a group
    # of one rank through the non-blocking init and its split, collectives and a graph; a
    # rank whose peer never joins, stopped by the deadline and by a failed peer).
    run test_gpu_nccl "$bundle/test_gpu_nccl"
    grep -E "skipped|without its peer|passed|failed" "$out/test_gpu_nccl.txt" | tail -4 | tee -a "$summary"
    # Then two processes of one group where the follower fails inside NCCL's set-up (no
    # network interface by NCCL_SOCKET_IFNAME): the leader must stop at once, naming the
    # follower's closed connection, and not wait out its timeout (300 s here).
    fs=(--set model=tiny --set tensor_parallel=2 --set tp_rendezvous=127.0.0.1:"$((${TP_PORT:-29500} + 1))"
      --set tp_rendezvous_timeout_s=300 --set devices=0 -n 2 -m 4 -q)
    follower_env=(NCCL_SOCKET_IFNAME=kvfuse-no-such-if)
    group_of_two setup-fails 120 "error|closed" "${fs[@]}"
    if ((lrc == 0 || lrc == 124 || lrc > 128 || frc == 0 || frc == 124)) ||
      ! grep -q "rank 1's process closed its connection" "$out/setup-fails-leader.txt"; then
      note "FAIL: setup-fails: the leader must stop naming the follower's closed connection, before its timeout"
      status=1
    fi
  fi
  note "$( ((status == 0)) && echo PASS || echo FAIL)"
  exit $status
fi
if want tests; then
  run test_gpu_nccl "$bundle/test_gpu_nccl"
  if [[ -x $bundle/test_gpu_peer_allreduce ]]; then
    run test_gpu_peer_allreduce "$bundle/test_gpu_peer_allreduce"
    grep -E "skipped|passed|failed" "$out/test_gpu_peer_allreduce.txt" | tail -3 | tee -a "$summary"
  fi
  run test_gpu_tp "$bundle/test_gpu_tp"
  grep -E "^gpu tp" "$out/test_gpu_tp.txt" | tee -a "$summary"
fi
if want allreduce; then
  run bench-allreduce "$bundle/kvfuse-bench-allreduce" --gpus 2 --rounds 5 --json "$out/allreduce.json"
  grep -E "^ +[0-9]+ |peer|link" "$out/bench-allreduce.txt" | tee -a "$summary"
  run bench-allreduce-pdl "$bundle/kvfuse-bench-allreduce" --gpus 2 --rounds 5 --pdl --json "$out/allreduce-pdl.json"
  grep -E "^ +[0-9]+ |peer|link" "$out/bench-allreduce-pdl.txt" | tee -a "$summary"
  run bench-layers "$bundle/kvfuse-bench-allreduce" --gpus 2 --layers --rounds 5 --pdl --json "$out/layers.json"
  grep -E "^ +[0-9]+ |layers" "$out/bench-layers.txt" | tee -a "$summary"
fi
if want engine; then
  # llama3-8b: tp 1, tp 2 all-reducing over peer memory, pushing into the norms, over NCCL alone.
  ratios=()
  for variant in tp1 tp2 tp2-push tp2-plain tp2-nccl; do
    tp=${variant:2:1}
    env=()
    keys=()
    [[ $variant == tp2-nccl ]] && env=(KVFUSE_PEER_ALLREDUCE=0)
    [[ $variant == tp2-push ]] && keys=(--set tp_allreduce=push)
    [[ $variant == tp2-plain ]] && env=(KVFUSE_PEER_PDL=0)
    run "engine-llama3-8b-$variant" env "${env[@]}" "${bench[@]}" --set model=llama3-8b --set tensor_parallel="$tp" "${keys[@]}" \
      "${cells[@]}" --json "$out/engine-llama3-8b-$variant.json"
    echo "llama3-8b $variant:" | tee -a "$summary"
    grep -E "^ +(1|8|64) |collectives" "$out/engine-llama3-8b-$variant.txt" | tee -a "$summary"
    [[ $variant != tp1 && -s $out/engine-llama3-8b-$variant.json ]] &&
      ratios+=("$variant=$out/engine-llama3-8b-$variant.json")
  done
  if [[ -s $out/engine-llama3-8b-tp1.json ]] && ((${#ratios[@]} > 0)); then
    python3 scripts/gpu/tp-ratios.py "$out/engine-llama3-8b-tp1.json" "${ratios[@]}" 2>&1 | tee -a "$summary"
  fi
fi
if want 70b; then
  pages=${TP_70B_PAGES:-25000}
  run run-llama3-70b-tp2 "$bundle/kvfuse-run" --set model=llama3-70b --set tensor_parallel=2 --set num_pages="$pages" \
    --set max_seq_len=4096 -n 8 -m 32 -q
  tail -3 "$out/run-llama3-70b-tp2.txt" | tee -a "$summary"
  if [[ ${TP_70B_BENCH:-0} == 1 ]]; then
    run engine-llama3-70b-tp2 "${bench[@]}" --set model=llama3-70b --set tensor_parallel=2 --batch 1,8,64 --context 512 \
      --max-kv-gib 30 --json "$out/engine-llama3-70b-tp2.json"
    grep -E "^ +(1|8|64) |collectives" "$out/engine-llama3-70b-tp2.txt" | tee -a "$summary"
  else
    note "llama3-70b engine benchmark: not run (TP_70B_BENCH=1 runs it)"
  fi
fi

# A group across two processes against the same group in one process (tp_allreduce nccl:
# both sum through NCCL), the same prompts, greedy tokens compared. KVFUSE_GEMM_TUNE=0:
# every run takes cuBLASLt's first heuristic choice for each GEMM, so that the runs compute
# with the same kernels whatever a timing would pick.
across_processes() {  # tp, ranks per process
  local tp=$1 local_ranks=$2 port=${TP_PORT:-29500}
  local lead_dev follow_dev name="llama3-8b-tp$1-x$2"
  lead_dev=$(seq -s, 0 $((local_ranks - 1)))
  follow_dev=$(seq -s, "$local_ranks" $((tp - 1)))
  local mp=(--set model=llama3-8b --set tensor_parallel="$tp" --set num_pages=4096 -n 8 -m 32 -q)
  run "run-$name-one-process" "$bundle/kvfuse-run" "${mp[@]}" --set tp_allreduce=nccl
  "$bundle/kvfuse-run" "${mp[@]}" --set tp_rendezvous=127.0.0.1:"$port" --set tp_rank="$local_ranks" \
    --set devices="$follow_dev" >"$out/run-$name-follower.txt" 2>&1 &
  local follower=$!
  run "run-$name-leader" "$bundle/kvfuse-run" "${mp[@]}" --set tp_rendezvous=127.0.0.1:"$port" \
    --set devices="$lead_dev"
  wait $follower
  local frc=$?
  note "run-$name-follower: exit $frc"
  ((frc == 0)) || status=1
  if diff <(grep '^sequence' "$out/run-$name-one-process.txt") \
    <(grep '^sequence' "$out/run-$name-leader.txt") >"$out/$name-processes-diff.txt" &&
    [[ $(grep -c '^sequence' "$out/run-$name-leader.txt") == 8 ]]; then
    note "tp $tp across two processes of $local_ranks GPU(s): greedy tokens equal tp $tp in one process (8 sequences x 32 tokens)"
  else
    note "FAIL: tp $tp across two processes of $local_ranks GPU(s): tokens differ from one process ($out/$name-processes-diff.txt)"
    status=1
  fi
  tail -1 "$out/run-$name-leader.txt" | tee -a "$summary"
}
if want processes; then
  export KVFUSE_GEMM_TUNE=0
  across_processes 2 1
  ((gpus >= 4)) && across_processes 4 2
  unset KVFUSE_GEMM_TUNE
fi

note "$( ((status == 0)) && echo PASS || echo FAIL)"
exit $status
