// The boundary between planning a step and running it. The scheduler plans a StepPlan
// from the sequences and the pool — which sequences run, how many of their pending tokens,
// whether each samples — with every item's KV pages already reserved; a StepRunner (the
// engine) runs it and returns a StepOutput, one StepResult per item in plan order. Pages
// are reserved once, by the planner: the runner refuses an item whose pages are missing.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "src/runtime/model_runner.h"

namespace kvfuse {

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
  int32_t logits_row = -1;       // row of the engine's last_logits() for this item, if it has one
  std::optional<TokenLogprob> logprob;        // the sampled token's, with StepItem::logprobs
  std::vector<TokenLogprob> prompt_logprobs;  // with StepItem::prompt_logprobs, in position order
};

struct StepTimings {
  double prepare_ms = 0;  // batch metadata (and, through Engine::step, the KV reservation)
  double forward_ms = 0;  // model forward, logits on the host
  double sample_ms = 0;
  double total_ms = 0;
  int64_t num_tokens = 0;
  int32_t num_seqs = 0;
  bool graph = false;  // the forward pass ran as a graph
};

// A step to run: its items (distinct sequences, each with the KV pages for its tokens
// reserved) and the write path, attention path and graph use to run them with.
struct StepPlan {
  std::vector<StepItem> items;
  ForwardOptions options;
};

// What a step produced: one result per item of its plan, in plan order.
struct StepOutput {
  std::vector<StepResult> results;
  StepTimings timings;
};

// Runs plans, one at a time, in two halves: begin() checks the plan and launches it (an
// error rejects the whole plan and leaves nothing in flight); end() waits for it and
// returns its output. Between the two the caller may do host work of its own, and must
// not change the sequences or the pool.
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  virtual absl::Status begin(const StepPlan& plan) = 0;
  virtual absl::StatusOr<StepOutput> end() = 0;
};

}  // namespace kvfuse
