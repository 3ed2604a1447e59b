// The engine runs one step at a time: check the items -> reserve their pages -> build
// the batch -> run it (ModelRunner) -> apply the tokens. It owns the backend, the KV
// pool, the model, its runner and the per-sequence token state; what to run in a step
// (which sequences, how many tokens each, whose pages to free first) is the
// scheduler's choice.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backends/backend.h"
#include "src/loading/config.h"
#include "src/parallel/communicator.h"
#include "src/runtime/kv_pool.h"
#include "src/runtime/model.h"
#include "src/runtime/model_runner.h"
#include "src/runtime/sampler.h"

namespace kvfuse {

class FollowerLinks;
class LeaderLink;
enum class RankCommand : uint32_t;

struct SequenceState {
  SeqId id = 0;
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int32_t num_prompt = 0;
  int32_t num_computed = 0;  // tokens whose K/V are in the cache
  int32_t num_cached = 0;    // of those, the prompt prefix taken from another sequence's pages
  SamplingParams sampling;
  Rng rng;

  int32_t num_pending() const { return int32_t(tokens.size()) - num_computed; }
  int32_t num_generated() const { return int32_t(tokens.size()) - num_prompt; }
};

// One sequence's share of a step: its next `num_tokens` pending tokens. `sample` asks
// for a new token, which requires the step to cover all of the pending tokens.
// `logits` returns the logits of the item's last token (teacher-forced evaluation in
// tests and tools), with or without sampling.
//
// Logprobs (kernels/ops/sampling.h: log-softmax of the raw logits): `logprobs` asks for the
// sampled token's (needs `sample`), `prompt_logprobs` for each token of the item whose
// predecessor the item computes — every computed position whose next token is already
// known gives the logprob of that token — each with its `top_logprobs` most likely
// tokens (0 .. kMaxTopLogprobs).
struct StepItem {
  SeqId id = 0;
  int32_t num_tokens = 0;
  bool sample = true;
  bool logits = false;
  bool logprobs = false;
  bool prompt_logprobs = false;
  int32_t top_logprobs = 0;
};

// A token's log-probability and the most likely tokens at its position, highest first.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;
};

struct StepResult {
  SeqId id = 0;
  absl::Status status;           // per sequence: one failing does not fail the others
  std::optional<int32_t> token;  // the sampled token, if asked for and the step ran
  int32_t logits_row = -1;       // row of last_logits() for this item, if it has one
  std::optional<TokenLogprob> logprob;        // the sampled token's, with StepItem::logprobs
  std::vector<TokenLogprob> prompt_logprobs;  // with StepItem::prompt_logprobs, in position order
};

struct StepTimings {
  double prepare_ms = 0;  // KV reservation and batch metadata
  double forward_ms = 0;  // model forward, logits on the host
  double sample_ms = 0;
  double total_ms = 0;
  int64_t num_tokens = 0;
  int32_t num_seqs = 0;
  bool graph = false;  // the forward pass ran as a graph
};

// RESOURCE_EXHAUSTED naming the sizes when the model's bf16 weights would take more than
// 80% of `available_gib` (the CPU backend's check at engine creation; <= 0: unknown, ok).
absl::Status check_cpu_weight_memory(const ModelSpec& spec, double available_gib);

// How far Engine::create is in loading the weights, for callers that report a long
// start-up (a 70B model's weights take minutes): `layers_done` of the model's `layers`
// decoder layers are on the device(s), `elapsed_s` seconds after loading began.
struct LoadProgress {
  int32_t layers_done = 0;
  int32_t layers = 0;
  double elapsed_s = 0;
};
// Called on the thread that creates the engine: with 0 layers as loading begins, then after
// each layer.
using LoadProgressFn = std::function<void(const LoadProgress&)>;
// Passes on to `sink` the first call, the last (every layer done) and any other that comes
// at least `every_s` seconds after the last one passed on: a report every so often
// however fast the layers load.
LoadProgressFn load_progress_every(double every_s, LoadProgressFn sink);

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> create(const Config& cfg, LoadProgressFn progress = {});
  // On a given backend (the server's, tests').
  static absl::StatusOr<std::unique_ptr<Engine>> create(const Config& cfg, std::unique_ptr<Backend> backend,
                                                        LoadProgressFn progress = {});
  ~Engine();

  const Config& config() const { return cfg_; }
  // The write path, attention path and graphs the config asks for: what step(items) runs.
  ForwardOptions forward_options() const {
    return ForwardOptions{cfg_.kv_write, cfg_.attention, cfg_.graphs == GraphsMode::on};
  }
  const ModelSpec& spec() const { return model_->spec(); }
  // This process's first rank's backend (the only one at tensor_parallel 1).
  Backend& backend() { return *backend_; }
  // Tensor parallelism: the ranks of the group (tensor_parallel), and those this process
  // runs (all of them, or one when the group spans processes), each local rank with its
  // backend and its storage in the pool (KvPool::layer_view(layer, local rank)).
  int32_t num_ranks() const { return cfg_.tensor_parallel; }
  int32_t num_local_ranks() const { return 1 + int32_t(ranks_.size()); }
  Backend& rank_backend(int32_t local_rank);

  // A group across processes (tp_rendezvous; docs/tensor-parallel.md#spanning-processes-and-nodes): the process
  // of rank 0 (the leader) is an ordinary engine whose steps also run on the other
  // processes' ranks. A process whose tp_rank is not 0 is a follower: Engine::create
  // joins the group, and follow() then runs the leader's commands; a follower's own
  // step(), warm_up_decode_graphs() and collectives_ms() are FAILED_PRECONDITION.
  bool is_follower() const { return leader_link_ != nullptr; }
  // Runs until the leader shuts the group down (OK) or the group fails: the leader's
  // process went away, or a command failed here (the error, also sent to the leader;
  // this rank's communicator is aborted so that no rank waits on it).
  absl::Status follow();
  // OK, or why the tensor-parallel group was aborted (a rank failed mid-step): every later
  // step is refused with it (FAILED_PRECONDITION) until the engine is restarted.
  const absl::Status& group_failure() const { return group_failed_; }
  KvPool& pool() { return *pool_; }
  const KvPool& pool() const { return *pool_; }
  KvFormat kv_format() const { return pool_->config().format; }

  // Starts a sequence from its prompt. ALREADY_EXISTS if the id is live;
  // INVALID_ARGUMENT for an empty or over-long prompt, bad token ids or parameters.
  // `rng` resumes a sampler stream (a sequence recomputed after preemption).
  // With prefix_reuse on and `reuse_prefix`, the longest page-aligned prefix of the prompt
  // that a live sequence has computed (at most the prompt less its last token) is shared
  // from that sequence's pages instead of computed (SequenceState::num_cached).
  absl::Status add_sequence(SeqId id, std::vector<int32_t> prompt, const SamplingParams& sampling,
                            const Rng* rng = nullptr, bool reuse_prefix = true);
  // Appends tokens to a live sequence (a further prompt chunk, or a forced token).
  absl::Status append_tokens(SeqId id, const std::vector<int32_t>& tokens);
  // Frees the sequence's pages. NOT_FOUND if unknown.
  absl::Status release(SeqId id);
  const SequenceState* sequence(SeqId id) const;
  size_t num_sequences() const { return seqs_.size(); }

  // Checks the items (known, distinct ids, 1 <= num_tokens <= pending, the step's
  // token and sequence limits), reserves their KV pages, runs the forward pass and
  // samples. A sequence whose pages cannot be reserved fails alone with
  // RESOURCE_EXHAUSTED; the others run. An error status means the step as a whole
  // was rejected (bad items) or failed on the device.
  absl::StatusOr<std::vector<StepResult>> step(const std::vector<StepItem>& items);
  // Same, with the write and attention paths given instead of taken from the config
  // (A/B tests and benchmarks on one engine).
  absl::StatusOr<std::vector<StepResult>> step(const std::vector<StepItem>& items,
                                               const ForwardOptions& opts);
  // step() in two halves, so that a caller can do its own host work while the device
  // runs the step (the server's loop fans the previous step's tokens out to its streams
  // there): begin_step() checks the items, reserves their pages and launches the pass;
  // end_step() waits for it, applies the tokens and returns what step() returns. An error
  // from begin_step() is step()'s error and leaves nothing in flight. While a step is in
  // flight, end_step() is the only call allowed on the engine (the others may read or
  // change what the device is using); end_step() without one is FAILED_PRECONDITION.
  // With tensor parallelism the pass completes inside begin_step().
  absl::Status begin_step(const std::vector<StepItem>& items, const ForwardOptions& opts);
  absl::StatusOr<std::vector<StepResult>> end_step();
  bool step_in_flight() const { return in_flight_.active; }

  // On a backend with graphs and with `graphs: on`: runs one decode-shaped step for every
  // batch bucket up to max_running_seqs (throw-away one-token sequences), so that each
  // bucket's graph (context bucket 512, the configured paths) is captured and its GEMM
  // shapes are tuned before the first request (every bucket's step runs eagerly first,
  // so the scratch buffers have their final size before the first capture). Returns the
  // number of buckets warmed; 0 and nothing done elsewhere. Needs no live sequences' pages beyond one per bucket
  // slot; RESOURCE_EXHAUSTED stops at the largest bucket that fits.
  absl::StatusOr<int> warm_up_decode_graphs();
  // Ends GEMM tuning on every rank's backend, in this process and in the followers
  // (Backend::end_gemm_tuning): shapes first seen afterwards run untimed choices. A
  // server calls it after warm_up_decode_graphs(), before its first request. Returns
  // rank 0's backend's answer: whether tuning has ended there.
  absl::StatusOr<bool> end_gemm_tuning();
  // GEMM shapes rank 0's backend has timed so far (Backend::gemm_shapes_timed).
  int64_t gemm_shapes_timed() const;

  // For decode benchmarks: treats the first `n` pending tokens of a sequence as computed
  // without running them. Their pages are reserved; the cache keeps whatever bytes the
  // pages hold, so the decode steps that follow read a synthetic context of the right
  // size (their timing is what is measured, not their tokens).
  absl::Status assume_computed(SeqId id, int32_t n);

  // Tensor parallelism, for benchmarks: the milliseconds of one decode step's collectives
  // alone — two all-reduces per layer of `tokens` rows of the hidden size (bf16) and the
  // logits gather of `tokens` rows — replayed `reps` times back to back after one warm-up
  // (captured in a graph per rank where the backend has graphs, as a step's are), on this
  // engine's communicators. FAILED_PRECONDITION at tensor_parallel 1 and for a rank alone.
  absl::StatusOr<double> collectives_ms(int32_t tokens, int reps);
  // Config::tp_rank_alone: rank 0 of the group runs without its peers or collectives.
  bool rank_alone() const { return cfg_.tp_rank_alone; }
  // Which communicator carries the collectives at tensor_parallel > 1 and, for GPU ranks,
  // whether all-reduces go over peer memory (and why not, when they do not); "" at 1.
  const std::string& collectives_path() const { return collectives_path_; }
  // The NCCL (RCCL) library a GPU group loaded, NcclLibrary::description(); "" when none
  // was (tensor_parallel 1, the CPU, tp_share_gpu, tp_rank_alone).
  const std::string& collectives_library() const { return collectives_library_; }

  // Logits of the last step, [rows, vocab]: one row per item that asked for logits
  // (StepItem::logits) or sampled with temperature > 0; StepResult::logits_row indexes it.
  // Greedy tokens are chosen on the device and bring no logits to the host.
  const std::vector<float>& last_logits() const { return fwd_.logits; }
  const GraphStats& graph_stats() const { return runner_->graph_stats(); }
  const StepTimings& last_timings() const { return timings_; }

 private:
  Engine(Config cfg, std::unique_ptr<Backend> backend);
  absl::Status init();
  // Tensor parallelism: ranks 1.. (their backends, communicators, models, runners), set up
  // by init_ranks; rank 0's are the members below. model_weights loads every rank's slices.
  absl::Status init_ranks(const ModelSpec& spec, KvPoolConfig& pc);
  // Config::tp_rank_alone: rank 0's shard, pool storage and model on this backend, with a
  // communicator whose collectives are left out (engine_ranks.cc); no other rank exists.
  absl::Status init_rank_alone(const ModelSpec& spec, KvPoolConfig& pc);
  // Both ways of a group: this process's ranks other than its first (threads, backends:
  // cfg_.tp_local_ranks() in all), then, once their communicators exist (element r is
  // local rank r's), the pool with each local rank's storage and every local rank's model.
  absl::Status start_local_ranks();
  absl::Status init_rank_models(const ModelSpec& spec, KvPoolConfig& pc, const TensorParallelShard& shard,
                                std::vector<std::unique_ptr<Communicator>> comms);
  // The shard of a rank, once its shapes are known to run on the backend.
  absl::StatusOr<TensorParallelShard> rank_shard(const ModelSpec& spec, KvFormat format) const;
  // A group across processes (engine_group.cc): this process's ranks, the rendezvous
  // (rank 0 keeps a connection to each other process), the communicators, the pool.
  absl::Status init_process_group(const ModelSpec& spec, KvPoolConfig& pc);
  // Leader: sends a command to every follower before this rank runs its part. A follower
  // that already failed, or cannot be reached, fails the group.
  absl::Status post_to_followers(RankCommand command, const std::vector<uint8_t>& payload);
  // Aborts every local rank's communicator: no rank waits on another any more.
  void abort_communicators();
  // Marks the group failed (later steps are refused naming `cause`), aborting every
  // local communicator; returns `cause`.
  absl::Status fail_group(absl::Status cause);
  // One rank's part of collectives_ms.
  absl::Status run_collectives(int32_t local_rank, int32_t tokens, int reps, double& ms);
  // Every rank's weights; `after_layer(n)` once n layers are on every rank.
  absl::Status load_weights(HostWeightSource& weights, const std::function<void(int32_t)>& after_layer);
  // comms.size() CPU communicators of one new group, rank order (the CPU ranks, or
  // tp_share_gpu's host meetings); the group in comm_group_.
  absl::Status cpu_communicators(std::vector<std::unique_ptr<Communicator>>& comms);
  // GPU ranks: puts the peer all-reduce (src/parallel/peer_allreduce.h) in front of each
  // rank's NCCL communicator where it applies; sets collectives_path_.
  absl::Status use_peer_allreduce(std::vector<std::unique_ptr<Communicator>>& comms);
  // Config::tp_share_gpu: every rank's communicator over one peer group whose ranks share
  // the GPU (SharedGpuCommunicator); sets collectives_path_.
  absl::Status share_gpu_communicators(std::vector<std::unique_ptr<Communicator>>& comms);
  // Runs f(rank) for every rank at once, rank 0 on the calling thread, the others on their
  // threads; the first error. With abort_on_error, a failing rank aborts the group so that
  // no rank waits on it in a collective, and the engine refuses later steps.
  absl::Status for_each_rank(const std::function<absl::Status(int32_t)>& f, bool abort_on_error);
  absl::Status forward(const ForwardOptions& opts);
  // The communicator of a rank this process holds.
  Communicator& rank_comm(int32_t local_rank);
  // One local rank's pass over batch_, then its communicator's asynchronous error (a
  // collective that failed on the device after its launch fails the pass).
  absl::Status run_rank_pass(int32_t local_rank, const ForwardOptions& opts);
  // One rank, in this process alone: a step's pass is launched, then finished in end_step.
  // Otherwise every rank's thread (and every follower) runs it to the end in begin_step.
  bool single_rank() const { return ranks_.empty() && !follower_links_; }
  // FAILED_PRECONDITION while a step is in flight: what would change what the device uses.
  absl::Status check_no_step_in_flight() const;
  absl::Status check_tokens(const std::vector<int32_t>& tokens) const;
  // The phases of a step: bad items reject it; a sequence whose pages cannot be
  // reserved drops out alone (the indices of the items that run are returned); the
  // batch of those is built into batch_, run, and its tokens applied.
  absl::Status check_items(const std::vector<StepItem>& items) const;
  std::vector<size_t> reserve_pages(const std::vector<StepItem>& items, std::vector<StepResult>& results);
  void build_batch(const std::vector<StepItem>& items, const std::vector<size_t>& run);
  void apply_results(const std::vector<StepItem>& items, const std::vector<size_t>& run,
                     std::vector<StepResult>& results);

  Config cfg_;
  LoadProgressFn load_progress_;  // Engine::create's, for init()
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<ModelRunner> runner_;
  struct Rank;  // ranks 1 .. tensor_parallel - 1 (engine.cc)
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<Communicator> comm_;  // rank 0's, at tensor_parallel > 1
  std::shared_ptr<void> comm_group_;    // the CPU ranks' group (or tp_share_gpu's host meeting)
  std::string collectives_path_;        // collectives_path()
  std::string collectives_library_;     // collectives_library()
  absl::Status group_failed_;           // a rank failed mid-step: the group is aborted
  std::unique_ptr<FollowerLinks> follower_links_;  // a leader's connections to the other processes
  std::unique_ptr<LeaderLink> leader_link_;        // a follower's connection to the leader
  std::unordered_map<SeqId, SequenceState> seqs_;
  ForwardResult fwd_;
  StepTimings timings_;
  ForwardBatch batch_;  // reused between steps
  // The step between begin_step() and end_step().
  struct InFlight {
    bool active = false;
    bool launched = false;  // a pass was launched (not every item failed its reservation)
    std::vector<StepItem> items;
    std::vector<size_t> run;
    std::vector<StepResult> results;
    std::chrono::steady_clock::time_point t0, t1;
  } in_flight_;
  std::vector<size_t> extra_count_;  // per item that ran: its rows in batch_.extra_rows
};

}  // namespace kvfuse
