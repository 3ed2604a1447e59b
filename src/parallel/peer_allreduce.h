// The all-reduce of a decode step over peer memory (NVLink, or xGMI on AMD), for the
// tensor-parallel ranks of one process (one thread per GPU, src/runtime/rank_thread.h).
// NCCL captured in a graph costs 17-21 us per call for the 8-512 KB messages of decode;
// one kernel that reads every rank's copy over the links directly ("one-shot", vLLM's and
// SGLang's custom all-reduce) costs a few. All ranks are threads of one process, so the
// other GPUs' buffers are plain device pointers once peer access is enabled: no IPC.
//
// Per rank the group allocates two staging buffers (`staging_bytes` each), a flags area
// flags[block][rank] of 64-bit words that the peers store into, and a call counter (one
// copy per block index, so that the blocks of a call agree on its number without waiting
// for each other). One call is one kernel launch per rank on that rank's stream; the grid,
// kBlockThreads threads per block, depends on the byte count only, so it is the same on
// every rank, and block b owns the same chunk of the message on every rank. Block b of
// rank r, at call number e (the counter is advanced by the kernel itself, so it advances on
// every graph replay too):
//   1. copies its chunk of the input into staging[r][e % 2];
//   2. __syncthreads(), then stores e into flags[b][r] of every rank with a release at
//      system scope;
//   3. polls its own flags[b][p] until each is >= e, then an acquire fence at system scope
//      and __syncthreads();
//   4. reads chunk b of staging[p][e % 2] of every rank p (its own input for p == r),
//      sums in fp32 in rank order 0, 1, ..., n-1, rounds once (bf16) and writes the result
//      over its input. The order is fixed, so every rank gets the same bits, and they are
//      CpuCommunicator's (reference_sum_bf16/f32).
//
// Why this is safe (memory ordering). The staging writes of step 1 happen before the flag
// store of step 2 (the barrier, then the release is cumulative over what the block wrote),
// and a rank that sees flag >= e performs the acquire before it reads (step 3), so step 4
// reads rank p's complete chunk of call e. Rank p next writes staging[p][e % 2] at call
// e + 2, and it only starts call e + 2 after finishing call e + 1, whose step 3 waited for
// every rank's call-(e + 1) flag, which each rank stores only after its call e has ended
// (stream order: call e + 1 touches memory only after call e has completed, reads
// included: a call launched as a programmatic dependent, PeerAllReduceOptions::pdl, waits
// for the kernel before it, griddepcontrol.wait, before its first access). So two buffers
// chosen by the call's parity (the same for all its blocks, whatever the chunk sizes of
// the calls before) are never written while a peer still reads them. The flags only grow
// (call numbers, never reset): a peer may already have
// stored e + 1 when a rank polls for e, hence >=, and a flag >= e can only come from a
// peer that has written its chunk of call e and cannot yet overwrite it (that needs this
// rank's flag e + 1). So one barrier per call is enough.
//
// Failures. A peer that never arrives (its rank failed, or its thread stopped launching)
// would leave the others polling forever; the poll checks, every few hundred reads, a word
// of mapped host memory that abort() sets, and a wall-clock timeout (`timeout_s`). Either
// ends the kernel without a result; a timeout also records which rank waited for which
// (status()) and sets the abort word, so the other ranks' kernels end at once instead of
// each waiting out the timeout. Kernels do not trap: on AMD a device trap ends the process.
// The group is then unusable (status() says why): later calls return the error, kernels
// already enqueued or replayed from a graph end at once, and the engine must be restarted.
//
// Pushed partial sums (push_targets, push_add_rmsnorm). In a decoder layer each all-reduce
// sits between a row-parallel projection and the residual add + RMSNorm after it. There the
// group can do without a kernel of its own: the projection stores its bf16 partial sums
// into every peer's inbox as well as into its own output (the GEMV from its epilogue,
// kernels/gemm/gemv.cuh; other GEMMs through launch_push_copy, kernels/parallel/tp_push.cuh), and the
// norm kernel of each rank sums its own partial and its inbox's, in rank order, before the
// add and the norm: the bits of all_reduce_sum followed by the backend's add_rmsnorm. No
// flags: every inbox element holds kPushEmpty (kernels/parallel/tp_push.h) until a peer stores a
// value, which is never kPushEmpty, and the norm polls each 16-byte chunk until none of its
// elements is, then stores kPushEmpty back ("Lamport" buffers, as TensorRT-LLM's one-shot
// all-reduce). A call costs the remote stores, which the projection issues as it finishes,
// and the norm's polls of its local inbox; the links are crossed once, one way.
//
// Inboxes: per rank kPushSlots x size() buffers of staging_bytes, [slot][source rank],
// allocated only for a group made with PeerAllReduceOptions::push (tp_allreduce push).
// The model numbers the pushed calls of a forward pass 0, 1, 2, ... (`call`), the same on
// every rank; call 0 uses slot 0 and call c > 0 slot 1 + (c - 1) % 2, so two calls in a row
// never share a slot, whether they are of one pass or the last of a pass and the first of
// the next (and a graph replays the same numbers). Why that is enough: rank p stores into
// slot s of rank r at call e only after its own norm of call e - 1, which waited for rank
// r's push of call e - 1, which rank r issues after its norm of call e - 2 has completed
// (stream order; every kernel of the step waits for the one before it, griddepcontrol.wait
// under programmatic launch, before touching memory). Rank r's last use of slot s before
// call e is call e - 2 or earlier (calls e - 1 and e differ), so its reads and its reset to
// kPushEmpty are done before rank p's stores of call e start.
//
// A norm that waits for a peer that never pushes ends on abort() or the timeout, as the
// all-reduce's kernel does, leaving its output undefined and the group stopped.
//
// When it applies: 2 .. kMaxRanks ranks on distinct GPUs of this process, peer access
// between every pair (check() says why not), and count * element size <= staging_bytes;
// PeerAllReduceCommunicator sends everything else to NCCL. KVFUSE_PEER_ALLREDUCE=0 turns
// it off (peer_allreduce_disabled_by_env).
//
// Ranks sharing a GPU (PeerAllReduceOptions::share_devices), for tests only: on a machine
// of one GPU the protocol, the kernels, graph capture and replay, abort and the timeout
// all run, with several ranks' buffers on the same GPU; the links between GPUs do not,
// and the sum is no faster than one rank's. A block spins until its peers' blocks have
// stored their flags, so the ranks' kernels on one GPU must all be resident at once:
// check() refuses a GPU that cannot hold (ranks on it) * kMaxBlocks blocks. Nothing a rank
// does before its call may wait for the GPU's running kernels either, a peer's spinning
// one among them: each rank's stream must reach the GPU through a hardware queue of its
// own (CUDA hands its CUDA_DEVICE_MAX_CONNECTIONS queues, 8 by default, to streams in turn
// as they are created; with CUDA_DEVICE_MAX_CONNECTIONS=1 two ranks on an H200 hang until
// the timeout in their first call), every rank allocates its memory before any rank calls
// (an allocation may synchronise the GPU), and a group's first call is not the first work
// of a fresh stream (seen to hang now and then on an H200). tests/gpu/test_gpu_peer_allreduce.cu
// does all three (run_ranks, Allocated). The engine's ranks sharing a GPU
// (Config::tp_share_gpu, tests/gpu/test_gpu_tp.cc) meet on the host before each collective
// (SharedGpuCommunicator) instead, and the test loads every kernel at start-up. What is
// left: a kernel that needs many SMs at once (a persistent GEMM sized to the GPU, a
// cluster launch) may wait behind a peer's spinning blocks; a graph replay, which meets
// nobody on the host, may then stall until the timeout.
//
// The kernels: kernels/parallel/peer_allreduce.cu (its arguments and the host signals in
// kernels/parallel/peer_allreduce.h). Built only with a GPU backend; no CUDA types in this
// header (streams are void*).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/parallel/peer_allreduce.h"
#include "kernels/parallel/tp_push.h"
#include "src/parallel/communicator.h"

namespace kvfuse {

struct PeerAllReduceOptions {
  int64_t staging_bytes = int64_t(2) << 20;  // per staging buffer: the largest call served
  double timeout_s = 10.0;                   // how long a block waits for a peer
  // Ranks may share a GPU. For tests on a machine of one GPU: the protocol, the kernels,
  // graphs, abort and the timeout run, the links between GPUs do not, and there is no
  // speed-up; never for serving (see "Ranks sharing a GPU" above).
  bool share_devices = false;
  // Launch each call as a programmatic dependent of the kernel before it (sm_90+, every
  // rank's GPU; otherwise ignored): its launch overlaps that kernel's tail, it waits for
  // it in-kernel before touching memory, and it lets the kernel after it launch once its
  // peers' flags are in.
  bool pdl = false;
  // Serve pushed calls (push_fits and the rest; "Pushed partial sums" above): allocates
  // every rank's inboxes, kPushSlots x ranks x staging_bytes. Off: push_fits is false.
  bool push = false;
};

class PeerAllReduceGroup {
 public:
  static constexpr int kMaxRanks = kPeerMaxRanks;
  static constexpr int kMaxBlocks = kPeerMaxBlocks;
  static constexpr int kBlockThreads = kPeerBlockThreads;
  static constexpr int kPushSlots = 3;

  // OK when ranks on `devices` (GPU ordinals, rank order) can use the group; otherwise
  // FAILED_PRECONDITION saying why (count, a repeated GPU, no peer access between a pair).
  // With `share_devices` (tests only: PeerAllReduceOptions) a GPU may repeat; peer access
  // is then needed between distinct GPUs only, and every GPU of several ranks must hold
  // all their blocks at once (FAILED_PRECONDITION naming the numbers if not).
  static absl::Status check(const std::vector<int>& devices, bool share_devices = false);
  // check(devices, options.share_devices), then enables peer access between every pair of
  // distinct GPUs and allocates every rank's buffers. Any thread; its current device is
  // left as it was.
  static absl::StatusOr<std::shared_ptr<PeerAllReduceGroup>> create(const std::vector<int>& devices,
                                                                    PeerAllReduceOptions options = {});
  ~PeerAllReduceGroup();
  PeerAllReduceGroup(const PeerAllReduceGroup&) = delete;
  PeerAllReduceGroup& operator=(const PeerAllReduceGroup&) = delete;

  int size() const { return int(ranks_.size()); }
  int device(int rank) const { return ranks_[size_t(rank)].device; }
  int64_t staging_bytes() const { return options_.staging_bytes; }
  // Whether a call of `count` elements is served (count * element size <= staging_bytes).
  bool fits(int64_t count, DType dtype) const;
  // The grid of a call of `bytes` (the same on every rank).
  static int blocks_for(int64_t bytes);

  // buf (`count` elements on rank's GPU) = the rank-ordered sum over ranks, enqueued on
  // `stream` (a cudaStream_t/hipStream_t of device(rank); the calling thread's current
  // device must be device(rank)). Returns at once, like a kernel launch; capturable.
  // Every rank must make the same calls in the same order with the same counts, and each
  // rank all its calls on one stream (the double buffering relies on their order).
  absl::Status all_reduce_sum(int rank, void* buf, int64_t count, DType dtype, void* stream);
  // Whether a pushed call of rows x cols bf16 is served (push_targets, push_add_rmsnorm):
  // a group made with options.push, the norm's 16-byte path (cols a multiple of 8, at most
  // 8192) and rows * cols * 2 <= staging_bytes. The same answer on every rank.
  bool push_fits(int64_t rows, int64_t cols) const;
  // Where rank `rank`'s projection of pushed call `call` stores its partial sums: the slot
  // of `call` in every other rank's inbox, in rank order (count size() - 1).
  PushTargets push_targets(int rank, int call) const;
  // The norm of pushed call `call` on rank `rank`, enqueued on `stream`: sum = the rank-
  // ordered fp32 sum of every rank's partial (this rank's in `partial`, the others' from its
  // inbox as they arrive), rounded once to bf16; then x = bf16(x + sum) and out =
  // rmsnorm(x) * w, the backend's add_rmsnorm. rows x cols bf16, every pointer 16-byte
  // aligned (InvalidArgument otherwise, as when !push_fits); out may be partial. Every rank
  // makes the same pushed calls in the same order, after the projection that pushed into
  // the peers (push_targets(rank, call)).
  absl::Status push_add_rmsnorm(int rank, int call, const void* partial, void* x, const void* w, int64_t rows,
                                int64_t cols, float eps, void* out, void* stream);

  // Ends the group: kernels waiting for a peer, now or later, end without a result, and
  // later calls return ABORTED. Any thread; idempotent.
  void abort();
  // OK; ABORTED after abort(); DEADLINE_EXCEEDED naming the ranks after a kernel timed
  // out. A read of host memory: cheap enough for every step.
  absl::Status status() const;
  // Calls rank `rank` has run so far (its block 0's counter; synchronises that GPU). For tests.
  absl::StatusOr<uint64_t> calls_completed(int rank) const;

 private:
  struct Rank {
    int device = -1;
    void* staging = nullptr;    // 2 * staging_bytes: parity 0, then parity 1
    uint64_t* flags = nullptr;  // [kMaxBlocks][kMaxRanks], stored into by every rank
    uint64_t* calls = nullptr;  // [kMaxBlocks]: the rank's call count, a copy per block index
    uint16_t* inbox = nullptr;  // [kPushSlots][ranks][staging_bytes / 2]: pushed partial sums
  };
  PeerAllReduceGroup(std::vector<int> devices, PeerAllReduceOptions options);
  absl::Status allocate();
  // Rank `owner`'s inbox for pushed call `call` from rank `source` (options_.push): the
  // call's slot (0 for call 0, then 1 + (call - 1) % 2), [slot][source].
  uint16_t* inbox(int owner, int call, int source) const;

  std::vector<Rank> ranks_;
  const PeerAllReduceOptions options_;
  PeerHostSignals* host_ = nullptr;  // mapped host memory every rank's kernel reads and writes
  int64_t timeout_ticks_ = 0;
  bool pdl_ = false;  // options_.pdl, where every rank's GPU has programmatic launch
};

// True when KVFUSE_PEER_ALLREDUCE is set to "0", "off" or "false" (read once per process):
// every all-reduce then goes through NCCL, for A/B runs against it.
bool peer_allreduce_disabled_by_env();

// False when KVFUSE_PEER_PDL (or KVFUSE_PDL_OPS, the step's kernels' switch) is "0", "off"
// or "false" (read once per process): the engine's groups then launch their calls as
// plain kernels (PeerAllReduceOptions::pdl), for A/B runs.
bool peer_allreduce_pdl_by_env();

// A GPU rank's communicator: all_reduce_sum over the peer group when the call fits,
// everything else (larger all-reduces, all_gather, broadcast, barrier) through `fallback`,
// the rank's NcclCommunicator, on the same stream, so the order of collectives is the same
// on every rank whichever path each takes. abort() ends both.
class PeerAllReduceCommunicator final : public Communicator {
 public:
  // Rank `rank` of `group`, enqueuing on `stream`, the stream `fallback` was made with.
  static absl::StatusOr<std::unique_ptr<PeerAllReduceCommunicator>> create(
      std::shared_ptr<PeerAllReduceGroup> group, int rank, void* stream,
      std::unique_ptr<Communicator> fallback);

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  // "peer+nccl" or "peer+rccl".
  const char* name() const override { return name_.c_str(); }
  absl::Status all_reduce_sum(void* buf, int64_t count, DType dtype) override;
  absl::Status all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) override;
  absl::Status broadcast(void* buf, int64_t bytes, int root) override;
  absl::Status barrier() override;
  // The group's pushed calls (PeerAllReduceGroup::push_fits ...): the same answer on
  // every rank.
  bool push_fits(int64_t rows, int64_t cols) const override;
  PushTargets push_targets(int call) const override;
  absl::Status push_add_rmsnorm(int call, const void* partial, void* x, const void* w, int64_t rows,
                                int64_t cols, float eps, void* out) override;
  void abort() override;
  // The group's status(), then the fallback's.
  absl::Status async_error() const override;
  const PeerAllReduceGroup& group() const { return *group_; }

 private:
  PeerAllReduceCommunicator(std::shared_ptr<PeerAllReduceGroup> group, int rank, void* stream,
                            std::unique_ptr<Communicator> fallback);

  std::shared_ptr<PeerAllReduceGroup> group_;
  const int rank_;
  void* const stream_;
  std::unique_ptr<Communicator> fallback_;
  const std::string name_;
  std::atomic<bool> aborted_{false};
};

// The communicator of ranks sharing a GPU (PeerAllReduceOptions::share_devices; tests only,
// Config::tp_share_gpu), where NCCL refuses to run: every collective through the group, on
// the rank's stream, capturable. all_reduce_sum in pieces of the group's staging_bytes;
// all_gather as an all-reduce of recv with every other rank's slice zeroed (x + 0 is x,
// except that -0 arrives as +0); the pushed calls as PeerAllReduceCommunicator's; barrier
// waits for the stream, then for the other ranks; broadcast is UNIMPLEMENTED (the engine's
// steps make none). abort() ends the group and `host`.
//
// Each collective first waits on the host for every rank to reach it (`host`, a
// CpuCommunicator of the same ranks): a rank enqueues a kernel that spins for its peers only
// once they are all past what they do before the collective, such as the GEMM tuner's
// allocations, which may wait for the GPU's running kernels ("Ranks sharing a GPU" above).
class SharedGpuCommunicator final : public Communicator {
 public:
  static absl::StatusOr<std::unique_ptr<SharedGpuCommunicator>> create(
      std::shared_ptr<PeerAllReduceGroup> group, int rank, void* stream, std::unique_ptr<Communicator> host);

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  const char* name() const override { return "shared-gpu"; }
  absl::Status all_reduce_sum(void* buf, int64_t count, DType dtype) override;
  absl::Status all_gather(const void* send, void* recv, int64_t count_per_rank, DType dtype) override;
  absl::Status broadcast(void* buf, int64_t bytes, int root) override;
  absl::Status barrier() override;
  bool push_fits(int64_t rows, int64_t cols) const override { return group_->push_fits(rows, cols); }
  PushTargets push_targets(int call) const override { return group_->push_targets(rank_, call); }
  absl::Status push_add_rmsnorm(int call, const void* partial, void* x, const void* w, int64_t rows,
                                int64_t cols, float eps, void* out) override;
  void abort() override;
  absl::Status async_error() const override { return group_->status(); }

 private:
  SharedGpuCommunicator(std::shared_ptr<PeerAllReduceGroup> group, int rank, void* stream,
                        std::unique_ptr<Communicator> host)
      : group_(std::move(group)), rank_(rank), stream_(stream), host_(std::move(host)) {}
  // The group's all-reduce of buf in pieces, no host wait.
  absl::Status reduce_pieces(void* buf, int64_t count, DType dtype);

  std::shared_ptr<PeerAllReduceGroup> group_;
  const int rank_;
  void* const stream_;
  std::unique_ptr<Communicator> host_;
};

}  // namespace kvfuse
