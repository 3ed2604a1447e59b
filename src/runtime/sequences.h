// The sequences a step may run, one table for the whole engine: each Sequence owns its
// token list (prompt, then sampled or appended tokens) and its sampler stream, whoever
// drives it (a Generate request the scheduler owns, or a router). A sequence holds KV
// pages only while admitted: preemption gives its pages back and keeps its tokens, so
// that readmitting it recomputes them, less the pages the prefix cache still holds
// (docs/design.md#prefix-cache).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "src/loading/config.h"
#include "src/runtime/kv_pool.h"
#include "src/runtime/logit_processors.h"
#include "src/runtime/sampler.h"

namespace kvfuse {

enum class SequenceOwner { generate, router };

struct Sequence {
  SeqId id = 0;
  SequenceOwner owner = SequenceOwner::router;
  std::vector<int32_t> tokens;  // prompt, then generated or appended tokens
  int32_t num_computed = 0;     // tokens whose K/V are in the cache (0 while not admitted)
  int32_t num_cached = 0;       // of those, the prefix taken from the prefix cache's pages
  bool admitted = false;        // holds pages in the pool
  SamplingParams sampling;
  Rng rng;
  LogitProcessors processors;  // inactive unless `sampling` sets one

  int32_t num_pending() const { return int32_t(tokens.size()) - num_computed; }
};

class SequenceTable {
 public:
  // `vocab`: the model's; token ids are checked against it.
  SequenceTable(const Config& cfg, KvPool& pool, int32_t vocab) : cfg_(cfg), pool_(pool), vocab_(vocab) {}

  // A new sequence from its prompt, not admitted. ALREADY_EXISTS if the id is in the
  // table; INVALID_ARGUMENT for an empty or over-long prompt (it must leave room for a
  // token under max_seq_len), bad token ids or sampling parameters.
  absl::Status add(SeqId id, std::vector<int32_t> prompt, const SamplingParams& sampling, SequenceOwner owner);
  // Gives the sequence its pages: an empty page table, or, with the prefix cache on and
  // `reuse_prefix`, the cached pages of the longest page-aligned prefix of its tokens (at
  // most all but its last token), which then count as computed (num_cached).
  // FAILED_PRECONDITION if already admitted.
  absl::Status admit(SeqId id, bool reuse_prefix);
  // Preemption: the pages go back to the pool; tokens and sampler stream stay, and the
  // sequence computes them all again once admitted.
  void evict(SeqId id);
  // Appends tokens (a further prompt chunk, or a forced token). INVALID_ARGUMENT past
  // max_seq_len or for bad ids.
  absl::Status append(SeqId id, const std::vector<int32_t>& tokens);
  // Removes the sequence and frees its pages. NOT_FOUND if unknown.
  absl::Status release(SeqId id);
  // Reserves the pages the sequence's next `num_tokens` tokens need (KvPool::reserve).
  absl::Status reserve(SeqId id, int32_t num_tokens);
  // Whether those pages are reserved already.
  bool reserved(SeqId id, int32_t num_tokens) const;
  // A step computed `num_tokens` more of the sequence's tokens (and, if it sampled, appends
  // the token): the window of a sliding-window layer moves on, and the pages now full join
  // the prefix cache.
  void computed(Sequence& s, int32_t num_tokens);

  const Sequence* get(SeqId id) const;
  Sequence* get(SeqId id);
  size_t size() const { return seqs_.size(); }

 private:
  absl::Status check_tokens(const std::vector<int32_t>& tokens) const;

  const Config& cfg_;
  KvPool& pool_;
  int32_t vocab_;
  std::unordered_map<SeqId, Sequence> seqs_;
};

}  // namespace kvfuse
