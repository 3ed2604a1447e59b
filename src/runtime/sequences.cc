#include "src/runtime/sequences.h"

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace kvfuse {

absl::Status SequenceTable::check_tokens(const std::vector<int32_t>& tokens) const {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", tokens[i], " at index ", i,
                                                     " is outside the vocabulary [0, ", vocab_, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status SequenceTable::add(SeqId id, std::vector<int32_t> prompt, const SamplingParams& sampling,
                                SequenceOwner owner) {
  if (seqs_.count(id)) return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " already exists"));
  if (prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  if (int64_t(prompt.size()) >= cfg_.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt of ", prompt.size(), " tokens leaves no room under max_seq_len ", cfg_.max_seq_len));
  }
  KVFUSE_RETURN_IF_ERROR(check_tokens(prompt));
  KVFUSE_RETURN_IF_ERROR(validate_sampling(sampling, vocab_));
  Sequence& s = seqs_[id];
  s.id = id;
  s.owner = owner;
  s.tokens = std::move(prompt);
  s.sampling = sampling;
  s.rng = Rng(sampling.seed);
  s.processors = LogitProcessors(sampling, s.tokens);
  return absl::OkStatus();
}

absl::Status SequenceTable::admit(SeqId id, bool reuse_prefix) {
  Sequence* s = get(id);
  if (!s) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  if (s->admitted) return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " is admitted already"));
  KVFUSE_RETURN_IF_ERROR(pool_.add_sequence(id));
  // The prefix cache: the pages of the longest cached prefix, short of the last token (it is
  // computed: its logits).
  int32_t cached = 0;
  if (reuse_prefix) {
    absl::StatusOr<int32_t> hit = pool_.take_cached_prefix(id, s->tokens, int64_t(s->tokens.size()) - 1);
    if (!hit.ok()) {
      (void)pool_.release(id);
      return hit.status();
    }
    cached = *hit;
  }
  s->admitted = true;
  s->num_computed = cached;
  s->num_cached = cached;
  return absl::OkStatus();
}

void SequenceTable::evict(SeqId id) {
  Sequence* s = get(id);
  if (!s || !s->admitted) return;
  (void)pool_.release(id);
  s->admitted = false;
  s->num_computed = 0;
  s->num_cached = 0;
}

absl::Status SequenceTable::append(SeqId id, const std::vector<int32_t>& tokens) {
  Sequence* s = get(id);
  if (!s) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  if (tokens.empty()) return absl::InvalidArgumentError("no tokens to append");
  if (int64_t(s->tokens.size() + tokens.size()) > cfg_.max_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", id, " would exceed max_seq_len ", cfg_.max_seq_len));
  }
  KVFUSE_RETURN_IF_ERROR(check_tokens(tokens));
  s->tokens.insert(s->tokens.end(), tokens.begin(), tokens.end());
  s->processors.add_prompt_tokens(tokens.data(), tokens.size());
  return absl::OkStatus();
}

absl::Status SequenceTable::release(SeqId id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  const bool admitted = it->second.admitted;
  seqs_.erase(it);
  return admitted ? pool_.release(id) : absl::OkStatus();
}

absl::Status SequenceTable::reserve(SeqId id, int32_t num_tokens) {
  const Sequence* s = get(id);
  if (!s) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  return pool_.reserve(id, s->num_computed + num_tokens);
}

bool SequenceTable::reserved(SeqId id, int32_t num_tokens) const {
  const Sequence* s = get(id);
  if (!s || !s->admitted) return false;
  return pool_.reserved_len(id) >= s->num_computed + num_tokens;
}

void SequenceTable::computed(Sequence& s, int32_t num_tokens) {
  s.num_computed += num_tokens;
  pool_.trim_window(s.id);
  pool_.cache_computed(s.id, s.tokens, s.num_computed);
}

const Sequence* SequenceTable::get(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

Sequence* SequenceTable::get(SeqId id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

}  // namespace kvfuse
