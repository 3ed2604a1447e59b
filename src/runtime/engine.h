// The engine runs steps: it owns the backend, the KV pool, the sequences (their tokens
// and sampler streams, SequenceTable), the model and its runner (this process's first
// rank's), and a RankGroup (src/runtime/rank_group.h) holding the tensor-parallel ranks,
// their communicators and the links to other processes, which it asks to run a step's pass
// on every rank. A step is data: a StepPlan whose items have their pages reserved goes in
// (StepRunner::begin), a StepOutput comes back (end); what to run in a step is the
// scheduler's choice (src/runtime/scheduler.h), which sees the engine only as the
// runner of its plans and the owner of the sequences and the pool.
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
#include "src/runtime/kv_pool.h"
#include "src/runtime/memory_plan.h"
#include "src/runtime/model.h"
#include "src/runtime/model_runner.h"
#include "src/runtime/sampler.h"
#include "src/runtime/sequences.h"
#include "src/runtime/step_plan.h"

namespace kvfuse {

class RankGroup;

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

class Engine : public StepRunner {
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
  int32_t num_local_ranks() const;
  Backend& rank_backend(int32_t local_rank);

  // A group across processes (tp_rendezvous; docs/tensor-parallel.md#spanning-processes-and-nodes): the process
  // of rank 0 (the leader) is an ordinary engine whose steps also run on the other
  // processes' ranks. A process whose tp_rank is not 0 is a follower: Engine::create
  // joins the group, and follow() then runs the leader's commands; a follower's own
  // step(), warm_up_decode_graphs() and collectives_ms() are FAILED_PRECONDITION.
  bool is_follower() const;
  // Runs until the leader shuts the group down (OK) or the group fails: the leader's
  // process went away, or a command failed here (the error, also sent to the leader;
  // this rank's communicator is aborted so that no rank waits on it).
  absl::Status follow();
  // OK, or why the tensor-parallel group was aborted (a rank failed mid-step): every later
  // step is refused with it (FAILED_PRECONDITION) until the engine is restarted.
  const absl::Status& group_failure() const;
  KvPool& pool() { return *pool_; }
  const KvPool& pool() const { return *pool_; }
  KvFormat kv_format() const { return pool_->config().format; }

  // The sequences, their tokens and pages. Changing them while a step is in flight is
  // the caller's mistake (the engine's own methods below refuse it).
  SequenceTable& sequences() { return *seqs_; }
  const SequenceTable& sequences() const { return *seqs_; }
  // Starts a sequence from its prompt and admits it (SequenceTable::add and admit: a
  // caller-driven sequence). ALREADY_EXISTS if the id is live; INVALID_ARGUMENT for an
  // empty or over-long prompt, bad token ids or parameters. `rng` resumes a sampler
  // stream. With the prefix cache on and `reuse_prefix`, the cached pages the prompt
  // begins with are taken (Sequence::num_cached: fewer tokens pending); without it the
  // whole prompt is computed (tools, warm-up, calibration: they need every position).
  absl::Status add_sequence(SeqId id, std::vector<int32_t> prompt, const SamplingParams& sampling,
                            const Rng* rng = nullptr, bool reuse_prefix = false);
  // Appends tokens to a live sequence (a further prompt chunk, or a forced token).
  absl::Status append_tokens(SeqId id, const std::vector<int32_t>& tokens);
  // Frees the sequence's pages. NOT_FOUND if unknown.
  absl::Status release(SeqId id);
  const Sequence* sequence(SeqId id) const { return seqs_->get(id); }
  size_t num_sequences() const { return seqs_->size(); }

  // StepRunner. begin() checks the plan (known, distinct, admitted ids, 1 <= num_tokens <=
  // pending, the step's token and sequence limits, every item's pages reserved) and
  // launches it; end() waits for it, applies the tokens and returns the output. An error
  // from begin() leaves nothing in flight. While a step is in flight, end() is the only
  // call allowed on the engine (the others may read or change what the device is using);
  // end() without one is FAILED_PRECONDITION. With tensor parallelism the pass completes
  // inside begin().
  absl::Status begin(const StepPlan& plan) override;
  absl::StatusOr<StepOutput> end() override;
  bool step_in_flight() const { return in_flight_.active; }

  // A whole step for callers that plan their own (tests, tools, benchmarks): reserves the
  // items' pages — a sequence that cannot get them fails alone with RESOURCE_EXHAUSTED,
  // the others run — then begin() and end(). An error status means the step as a whole
  // was rejected (bad items) or failed on the device.
  absl::StatusOr<std::vector<StepResult>> step(const std::vector<StepItem>& items);
  // Same, with the write and attention paths given instead of taken from the config
  // (A/B tests and benchmarks on one engine).
  absl::StatusOr<std::vector<StepResult>> step(const std::vector<StepItem>& items,
                                               const ForwardOptions& opts);

  // On a backend with graphs and with `graphs: on`: runs one decode-shaped step for every
  // batch bucket up to max_running_seqs (throw-away one-token sequences), so that each
  // bucket's graph (context bucket 512, the configured paths) is captured and its GEMM
  // shapes are tuned before the first request (every bucket's step runs eagerly first,
  // so the scratch buffers have their final size before the first capture). Returns the
  // number of buckets warmed; 0 and nothing done elsewhere. Needs no live sequences' pages beyond one per bucket
  // slot; RESOURCE_EXHAUSTED stops at the largest bucket that fits.
  absl::StatusOr<int> warm_up_decode_graphs();
  // How the device's memory is split (src/runtime/memory_plan.h): set by create() at
  // tensor_parallel 1 (zeros otherwise); warm_up_decode_graphs() adds what the steps since
  // loading took (their scratch as workspace, the rest as graphs).
  const MemorySplit& memory() const { return memory_; }
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
  const std::string& collectives_path() const;
  // The NCCL (RCCL) library a GPU group loaded, NcclLibrary::description(); "" when none
  // was (tensor_parallel 1, the CPU, tp_share_gpu, tp_rank_alone).
  const std::string& collectives_library() const;

  // Logits of the last step, [rows, vocab]: one row per item that asked for logits
  // (StepItem::logits) or sampled with temperature > 0; StepResult::logits_row indexes it.
  // Greedy tokens are chosen on the device and bring no logits to the host.
  const std::vector<float>& last_logits() const { return fwd_.logits; }
  const GraphStats& graph_stats() const { return runner_->graph_stats(); }
  const StepTimings& last_timings() const { return timings_; }

 private:
  Engine(Config cfg, std::unique_ptr<Backend> backend);
  absl::Status init();
  // Tensor parallelism (tensor_parallel > 1): the group formed, the pool with a storage per
  // local rank, every local rank's model and weights; rank 0's model and runner here.
  absl::Status init_ranks(const ModelSpec& spec, KvPoolConfig& pc, HostWeightSource& weights,
                          const std::function<void(int32_t)>& after_layer);
  // One rank, in this process alone: a step's pass is launched, then finished in end().
  // Otherwise every rank's thread (and every follower) runs it to the end in begin().
  bool single_rank() const;
  // FAILED_PRECONDITION while a step is in flight: what would change what the device uses.
  absl::Status check_no_step_in_flight() const;
  // The phases of a step: a bad plan is rejected (with `require_reserved`, also one whose
  // items lack their pages); its batch is built into batch_, run, and its tokens applied.
  absl::Status check_plan(const StepPlan& plan, bool require_reserved) const;
  void build_batch(const std::vector<StepItem>& items);
  void apply_results(const std::vector<StepItem>& items, std::vector<StepResult>& results);
  // warm_up_decode_graphs()'s steps, and the device's free and total memory into memory_.
  absl::StatusOr<int> warm_up_buckets();
  void note_device_memory();

  Config cfg_;
  LoadProgressFn load_progress_;  // Engine::create's, for init()
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<RankGroup> group_;  // the tensor-parallel ranks (at tensor_parallel 1, none but this one)
  std::unique_ptr<SequenceTable> seqs_;
  ForwardResult fwd_;
  StepTimings timings_;
  MemorySplit memory_;
  // At the end of loading (tensor_parallel 1): the backend's allocated bytes, the device's
  // free bytes and the workspaces, from which warm_up_decode_graphs() tells what came after.
  struct {
    int64_t allocated = 0, free = 0, workspace = 0;
  } loaded_;
  ForwardBatch batch_;  // reused between steps
  // The step between begin() and end().
  struct InFlight {
    bool active = false;
    std::vector<StepItem> items;
    std::chrono::steady_clock::time_point t0, t1;
  } in_flight_;
  std::vector<size_t> extra_count_;  // per item: its rows in batch_.extra_rows
};

}  // namespace kvfuse
