// Continuous batching: admission by KV capacity, chunked prefill under the per-step
// token budget, decode of every running sequence each step, and the pages of each step
// reserved before it runs, preempting by recomputation when the pool runs dry. Each step
// the scheduler plans a StepPlan (src/runtime/step_plan.h) from the sequences and the
// pool, a StepRunner (the engine) runs it, and the scheduler applies its StepOutput: it
// sees the engine only through those, the SequenceTable and the KvPool. Single-threaded:
// the caller (the server's engine loop, a benchmark, a test) drives step().
//
// Two kinds of work share every step:
//   - generate requests (submit/abort): the scheduler owns them from admission to
//     their last token, and may preempt and recompute them;
//   - router-driven sequences (router_*): created and extended by a router, stepped
//     only when a task asks (compute pending tokens, sample n tokens), kept until
//     released. They are never preempted (the router holds their state), so when the
//     pool runs dry they take pages from generate requests, or fail alone with
//     RESOURCE_EXHAUSTED.
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "src/runtime/engine.h"
#include "src/runtime/sequences.h"
#include "src/runtime/step_plan.h"

namespace kvfuse {

enum class FinishReason { none, length, stop, abort, error };
const char* to_string(FinishReason r);

// Logprobs a request asks for (kernels/ops/sampling.h: log-softmax of the raw logits):
// each sampled token's (`enabled`), the prompt tokens' (`prompt`: every token whose
// predecessor is computed by the request's prefill), each with its `top_n` (0 .. 20)
// most likely tokens.
struct LogprobsOptions {
  bool enabled = false;
  int32_t top_n = 0;
  bool prompt = false;
};
absl::Status validate_logprobs(const LogprobsOptions& o);

struct GenerateRequest {
  SeqId id = 0;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int32_t max_new_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;     // false: the model's EOS tokens stop the request too
  int32_t min_new_tokens = 0;  // stop and EOS tokens do not stop it before this many
  LogprobsOptions logprobs;
};

// When a router-driven sequence finishes: a sampled stop token (or, unless ignore_eos,
// one of the model's EOS tokens) once min_new_tokens are sampled, or max_new_tokens
// sampled (0: no limit but max_seq_len). Tokens count from when the rules were set.
struct StopRules {
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t max_new_tokens = 0;
  int32_t min_new_tokens = 0;
};

// Whether `token`, the `generated`-th sampled under `rules`, ends the sequence, and why.
FinishReason stop_reason(const StopRules& rules, const std::vector<int32_t>& eos_token_ids, int32_t token,
                         int32_t generated);

// What one step did for one request: at most one new token, and whether it finished.
struct TokenEvent {
  SeqId id = 0;
  std::optional<int32_t> token;
  FinishReason finish = FinishReason::none;
  absl::Status status;  // set when finish == error
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  std::optional<TokenLogprob> logprob;        // the token's, when asked for
  std::vector<TokenLogprob> prompt_logprobs;  // with the first token, when asked for
  int32_t cached_tokens = 0;  // with the first token: prompt tokens shared, not computed (prefix reuse)
};

// A finished router task: the tokens it sampled (all of them, or those before a
// failure) and the sequence's length afterwards.
struct RouterResult {
  SeqId id = 0;
  absl::Status status;
  FinishReason finish = FinishReason::none;  // stop or length when the stop rules ended it
  std::vector<int32_t> tokens;
  int32_t seq_len = 0;
  std::vector<TokenLogprob> logprobs;         // per token, when the sequence's options ask
  std::vector<TokenLogprob> prompt_logprobs;  // the tokens this task computed, when asked
};

struct SchedulerLimits {
  size_t max_waiting = 4096;
  // Logprobs of a router-driven sequence's last sampled tokens kept for replayed calls
  // (router_logprobs): one Decode call's worth at the server's step limit.
  size_t replay_logprobs = 256;
};

class Scheduler {
 public:
  // Plans over `engine`'s sequences and pool and runs its plans on it.
  explicit Scheduler(Engine& engine, SchedulerLimits limits = {});

  // ---- Generate requests ----
  // INVALID_ARGUMENT (bad prompt or parameters), ALREADY_EXISTS (live id),
  // RESOURCE_EXHAUSTED (queue full, or a request larger than the whole pool).
  absl::Status submit(GenerateRequest req);
  // Ends a request, waiting or running, or a router-driven sequence (its running task
  // ends CANCELLED), and frees its pages now. NOT_FOUND if unknown.
  absl::Status abort(SeqId id);
  // Runs one engine step if any request or router task can make progress and returns
  // the generate requests' events (router results: take_router_results()).
  absl::StatusOr<std::vector<TokenEvent>> step();
  // step() in two halves (Engine::begin_step / end_step): begin_step() plans the step,
  // launches it and returns the events of planning (admission and preemption failures);
  // end_step() waits for the step and returns its events. While step_in_flight(), call
  // nothing else on the scheduler (or the engine): the host may only do work of its own.
  // A begin_step() error is step()'s error and leaves nothing in flight.
  absl::StatusOr<std::vector<TokenEvent>> begin_step();
  absl::StatusOr<std::vector<TokenEvent>> end_step();
  bool step_in_flight() const { return in_flight_.has_value(); }

  bool has_work() const { return !running_.empty() || !waiting_.empty() || !router_active_.empty(); }
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }
  // Any live id: waiting, running, or router-driven.
  bool contains(SeqId id) const;
  int64_t num_preemptions() const { return preemptions_; }
  // Engine steps run so far.
  uint64_t num_steps() const { return step_count_; }

  // ---- Router-driven sequences ----
  // Creates a sequence from `tokens` (extend = false; ALREADY_EXISTS if live) or
  // appends them to a live one (extend = true; NOT_FOUND if unknown), and starts a
  // task that computes every pending token and, if `sample`, samples one. The task's
  // RouterResult comes from take_router_results() after the step that ends it.
  // All or nothing: on an error the sequence is as it was. Also INVALID_ARGUMENT (as
  // Engine::add_sequence / append_tokens), ABORTED while another task runs on the
  // sequence, RESOURCE_EXHAUSTED when the pages it needs cannot be freed for it.
  // `stop` sets the sequence's stop rules (a new sequence without it: none); an extend
  // makes a finished sequence live again.
  // `logprobs` sets the sequence's logprobs options likewise (a new sequence without it:
  // none).
  absl::Status router_prefill(SeqId id, std::vector<int32_t> tokens, const SamplingParams& sampling,
                              bool extend, bool sample, std::optional<StopRules> stop = std::nullopt,
                              std::optional<LogprobsOptions> logprobs = std::nullopt);
  // Starts a task that samples `steps` tokens, one per step. NOT_FOUND, ABORTED,
  // RESOURCE_EXHAUSTED as above; FAILED_PRECONDITION when the last prefill sampled
  // nothing (there is no token to decode from).
  // The task ends early when the stop rules finish the sequence (RouterResult::finish).
  // FAILED_PRECONDITION on a finished sequence, unless `stop` replaces its rules.
  // `logprobs`, when set, replaces the sequence's logprobs options from this task on.
  // `counted`: the sequence's last `counted` tokens were sampled by an earlier attempt
  // of the same call (a replay), and `stop` counts them as its own: its max_new_tokens
  // and min_new_tokens include them. If the rules finish the sequence at the last of
  // them, the sequence finishes with no task started (router_busy is false after an OK
  // return); at an earlier one, FAILED_PRECONDITION (the tokens after it cannot be
  // this call's). All or nothing: on an error the sequence is as it was.
  absl::Status router_decode(SeqId id, int32_t steps, std::optional<StopRules> stop = std::nullopt,
                             std::optional<LogprobsOptions> logprobs = std::nullopt, int32_t counted = 0);
  // The logprobs of the sequence's sampled tokens from position `from` to its end, when
  // every one of them was sampled with logprobs and is still kept
  // (SchedulerLimits::replay_logprobs); otherwise none.
  std::vector<TokenLogprob> router_logprobs(SeqId id, int64_t from) const;
  // Why a router-driven sequence finished (none: it is live or unknown).
  FinishReason router_finish(SeqId id) const;
  // Ends the running task of a sequence with `why` (its result is queued); the
  // sequence stays. No-op without a task.
  void router_stop(SeqId id, const absl::Status& why);
  // Starts a task that computes a live sequence's pending tokens and, if `sample`,
  // samples one: the rest of a prefill whose task was stopped. NOT_FOUND, ABORTED,
  // RESOURCE_EXHAUSTED as above; FAILED_PRECONDITION with nothing pending.
  absl::Status router_resume(SeqId id, bool sample);
  // Frees a router-driven sequence; a running task ends CANCELLED. NOT_FOUND if unknown.
  absl::Status router_release(SeqId id);
  bool is_router_sequence(SeqId id) const { return router_.count(id) != 0; }
  // Which incarnation of an id is live: a number that differs for every sequence
  // router_prefill creates, so that a call can tell its own sequence from a later
  // one under the same id. 0 if the id is not a live router-driven sequence.
  uint64_t router_generation(SeqId id) const;
  bool router_busy(SeqId id) const;
  size_t num_router_sequences() const { return router_.size(); }
  size_t num_router_tasks() const { return router_active_.size(); }
  std::vector<SeqId> router_sequence_ids() const;
  std::vector<RouterResult> take_router_results();

  // After a failed step (the device state is unknown): ends every generate request
  // with `why` (their events are returned) and every router task (results queued).
  // Router-driven sequences stay until released.
  std::vector<TokenEvent> fail_all(const absl::Status& why);

  // For fault-injection tests: sees (and may change) every step's results before the
  // scheduler does, e.g. to turn a token into an INTERNAL status.
  void set_result_hook(std::function<void(std::vector<StepResult>&)> hook) { result_hook_ = std::move(hook); }

 private:
  // A generate request; its tokens and sampler stream are its Sequence's, which stays
  // in the table from submit to finish (preemption only takes its pages).
  struct Entry {
    GenerateRequest req;  // its prompt is moved into the Sequence, its stop fields into `stop`
    int32_t prompt_len = 0;
    StopRules stop;
    int32_t generated = 0;
    std::vector<TokenLogprob> prompt_logprobs;  // gathered over the prefill's chunks
  };
  struct RouterTask {
    int32_t samples_left = 0;
    int64_t target_len = 0;  // tokens in the cache when the task is done
    RouterResult result;
  };
  struct RouterSeq {
    std::optional<RouterTask> task;
    uint64_t generation = 0;
    StopRules stop;
    LogprobsOptions logprobs;
    int32_t generated = 0;  // tokens sampled since the rules were set
    FinishReason finished = FinishReason::none;
    // Logprobs of the sequence's last sampled tokens, those before position recent_end
    // (router_logprobs).
    std::deque<TokenLogprob> recent_logprobs;
    int64_t recent_end = 0;
  };
  // Who a step item belongs to.
  struct Owner {
    bool router = false;
    SeqId id = 0;
  };
  // A planned step: items whose pages are reserved, and whose they are.
  struct Plan {
    std::vector<StepItem> items;
    std::vector<Owner> owners;
  };

  // Admits waiting requests, plans the step and reserves its pages, preempting or
  // failing what cannot fit (their events go to `events`).
  Plan schedule(std::vector<TokenEvent>& events);

  PagesNeeded pages_to_finish_prefill(const Entry& e) const;
  bool can_admit(const Entry& e) const;
  absl::Status admit(Entry& e);
  void preempt(size_t running_index);
  TokenEvent finish(Entry& e, FinishReason reason, absl::Status status = absl::OkStatus());
  void admit_waiting(std::vector<TokenEvent>& events);
  // Every running generate request and router task may add an item: decodes first (one
  // token each), then prefill chunks; generate requests and router tasks take turns going
  // first, so that neither can keep the other out of a full step.
  void plan_step(Plan& plan);
  // The item `owner` (with `entry`, its generate request, or null for a router task) adds
  // in this pass of the plan, if any; a router task that cannot run is finished here.
  std::optional<StepItem> plan_item(const Owner& owner, const Entry* entry, bool decode_pass, int64_t budget);
  // Reserves the planned items' pages, preempting (or failing) what cannot fit; items
  // that will not run leave the plan.
  void reserve_pages(std::vector<StepItem>& items, std::vector<Owner>& owners,
                     std::vector<TokenEvent>& events);
  bool reserve(const StepItem& item);
  void apply_results(const std::vector<StepResult>& results, const std::vector<Owner>& owners,
                     std::vector<TokenEvent>& events);
  void apply_router_result(SeqId id, const StepResult& res);
  // Refuses a task whose pages could never be found: more than are free plus those the
  // generate requests hold (which a router task may take by preempting them).
  absl::Status check_router_capacity(SeqId id, int64_t new_len) const;
  void start_router_task(SeqId id, int32_t samples);
  void finish_router_task(SeqId id, absl::Status status);
  // Pages the running router tasks still need.
  PagesNeeded router_pages_promised() const;
  // Pages still to reserve for a sequence to reach new_len tokens in the cache.
  PagesNeeded pages_to_reach(SeqId id, int64_t new_len) const;

  StepRunner& runner_;
  SequenceTable& seqs_;
  KvPool& pool_;
  const Config& cfg_;
  const ModelSpec& spec_;
  ForwardOptions options_;  // how the runner runs every plan
  SchedulerLimits limits_;
  std::deque<Entry> waiting_;
  std::vector<Entry> running_;
  int64_t preemptions_ = 0;

  std::unordered_map<SeqId, RouterSeq> router_;
  std::vector<SeqId> router_active_;  // sequences with a task, oldest task first
  std::vector<RouterResult> router_results_;
  uint64_t next_router_generation_ = 1;
  uint64_t step_count_ = 0;
  std::optional<Plan> in_flight_;  // the plan of the step between begin_step and end_step
  std::function<void(std::vector<StepResult>&)> result_hook_;
};

}  // namespace kvfuse
