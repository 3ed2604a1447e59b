#include "src/runtime/sequences.h"

#include <algorithm>

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
  return absl::OkStatus();
}

absl::Status SequenceTable::admit(SeqId id, bool reuse_prefix) {
  Sequence* s = get(id);
  if (!s) return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
  if (s->admitted) return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " is admitted already"));
  // Prefix reuse: the live sequence whose computed tokens match the longest prefix.
  SeqId donor = 0;
  int32_t shared = 0;
  if (cfg_.prefix_reuse && reuse_prefix && !pool_.has_swa()) {
    const int32_t ps = cfg_.page_size;
    const size_t limit = s->tokens.size() - 1;  // the last token is computed: its logits
    for (const auto& [sid, st] : seqs_) {
      if (!st.admitted) continue;
      const size_t n = std::min(limit, size_t(st.num_computed));
      const size_t common = size_t(
          std::mismatch(s->tokens.begin(), s->tokens.begin() + ptrdiff_t(n), st.tokens.begin()).first -
          s->tokens.begin());
      const int32_t pages = int32_t(common) / ps * ps;
      if (pages > shared) {
        shared = pages;
        donor = sid;
      }
    }
  }
  KVFUSE_RETURN_IF_ERROR(pool_.add_sequence(id));
  if (shared > 0) {
    if (absl::Status st = pool_.share_prefix(id, donor, shared); !st.ok()) {
      (void)pool_.release(id);
      return st;
    }
  }
  s->admitted = true;
  s->num_computed = shared;
  s->num_cached = shared;
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
