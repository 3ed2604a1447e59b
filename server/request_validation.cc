#include "server/request_validation.h"

#include <algorithm>
#include <iterator>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace kvfuse::server {

namespace {

absl::Status invalid(auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); }

absl::Status check_tokens(const google::protobuf::RepeatedField<int32_t>& ids, int32_t vocab,
                          const char* what) {
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return invalid(what, "[", i, "] = ", ids[i], " is outside the vocabulary [0, ", vocab, ")");
    }
  }
  return absl::OkStatus();
}

// Batch calls name each sequence once: a duplicate is a router bug, and running it
// twice in one step is impossible anyway.
template <class Seqs, class GetId>
absl::Status check_ids(const Seqs& seqs, GetId get_id, const ServiceLimits& lim) {
  if (seqs.empty()) return invalid("no sequences");
  if (seqs.size() > lim.max_batch_sequences) {
    return invalid(seqs.size(), " sequences exceed the limit of ", lim.max_batch_sequences, " per call");
  }
  std::unordered_set<uint64_t> seen;
  for (int i = 0; i < seqs.size(); ++i) {
    const uint64_t id = get_id(seqs[i]);
    if (id == 0) return invalid("sequences[", i, "]: id 0 is reserved");
    if (!seen.insert(id).second) return invalid("sequences[", i, "]: duplicate id ", id);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SamplingParams> to_sampling(const v1::SamplingParams& p, int32_t vocab) {
  SamplingParams s;
  s.temperature = p.temperature();
  s.top_k = p.top_k();
  s.top_p = p.has_top_p() ? p.top_p() : 1.0f;
  s.seed = p.seed();
  s.min_p = p.min_p();
  s.repetition_penalty = p.has_repetition_penalty() ? p.repetition_penalty() : 1.0f;
  s.frequency_penalty = p.frequency_penalty();
  s.presence_penalty = p.presence_penalty();
  s.logit_bias.assign(p.logit_bias().begin(), p.logit_bias().end());
  std::sort(s.logit_bias.begin(), s.logit_bias.end());  // the map's order is unspecified
  KVFUSE_RETURN_IF_ERROR(validate_sampling(s, vocab));
  return s;
}

absl::StatusOr<StopRules> to_stop_rules(const v1::StopRules& p, const ServiceLimits& lim) {
  if (p.stop_token_ids_size() > lim.max_stop_tokens) {
    return invalid("stop.stop_token_ids: ", p.stop_token_ids_size(), " tokens exceed the limit of ",
                   lim.max_stop_tokens);
  }
  KVFUSE_RETURN_IF_ERROR(check_tokens(p.stop_token_ids(), lim.vocab, "stop.stop_token_ids"));
  const uint32_t max_new = p.has_max_new_tokens() ? p.max_new_tokens() : 0;
  if (max_new > uint32_t(lim.max_seq_len)) {
    return invalid("stop.max_new_tokens ", max_new, " exceeds max_seq_len ", lim.max_seq_len);
  }
  if (p.min_new_tokens() > uint32_t(lim.max_seq_len) || (max_new > 0 && p.min_new_tokens() > max_new)) {
    return invalid("stop.min_new_tokens ", p.min_new_tokens(), " exceeds ",
                   max_new > 0 ? "stop.max_new_tokens " : "max_seq_len ",
                   max_new > 0 ? max_new : uint32_t(lim.max_seq_len));
  }
  return stop_rules(p);
}

StopRules stop_rules(const v1::StopRules& p) {
  StopRules r;
  r.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  r.ignore_eos = p.ignore_eos();
  r.max_new_tokens = p.has_max_new_tokens() ? int32_t(p.max_new_tokens()) : 0;
  r.min_new_tokens = int32_t(p.min_new_tokens());
  return r;
}

v1::FinishReason to_proto(FinishReason r) {
  // In FinishReason's order: none, length, stop, abort, error.
  static constexpr v1::FinishReason kProto[] = {v1::FINISH_REASON_UNSPECIFIED, v1::FINISH_REASON_LENGTH,
                                                v1::FINISH_REASON_STOP, v1::FINISH_REASON_ABORT,
                                                v1::FINISH_REASON_UNSPECIFIED};
  const size_t i = size_t(r);
  return i < std::size(kProto) ? kProto[i] : v1::FINISH_REASON_UNSPECIFIED;
}

absl::StatusOr<LogprobsOptions> to_logprobs(const v1::LogprobsParams& p) {
  if (p.top_n() > uint32_t(kMaxTopLogprobs)) {
    return invalid("logprobs.top_n ", p.top_n(), " exceeds the limit of ", kMaxTopLogprobs);
  }
  LogprobsOptions o;
  o.enabled = p.enabled();
  o.top_n = int32_t(p.top_n());
  o.prompt = p.prompt();
  return o;
}

void to_proto(const TokenLogprob& t, v1::TokenLogprob* out) {
  out->set_token_id(t.token);
  out->set_logprob(t.logprob);
  for (const auto& [id, lp] : t.top) {
    v1::TopLogprob* e = out->add_top();
    e->set_token_id(id);
    e->set_logprob(lp);
  }
}

int32_t generate_max_tokens(const v1::GenerateRequest& req, const ServiceLimits& lim) {
  return req.max_tokens() != 0 ? int32_t(req.max_tokens()) : std::min(lim.default_max_tokens, lim.max_seq_len);
}

int32_t decode_steps(const v1::DecodeRequest& req) { return req.steps() == 0 ? 1 : int32_t(req.steps()); }

absl::Status validate(const v1::PrefillRequest& req, const ServiceLimits& lim) {
  if (auto st = check_ids(
          req.sequences(), [](const auto& s) { return s.id(); }, lim);
      !st.ok())
    return st;
  for (int i = 0; i < req.sequences_size(); ++i) {
    const v1::PrefillSequence& s = req.sequences(i);
    const std::string where = absl::StrCat("sequences[", i, "] (id ", s.id(), "): ");
    if (s.token_ids().empty()) return invalid(where, s.extend() ? "no tokens to append" : "empty prompt");
    if (s.token_ids_size() >= lim.max_seq_len) {
      return invalid(where, s.token_ids_size(), " tokens leave no room under max_seq_len ", lim.max_seq_len);
    }
    if (auto st = check_tokens(s.token_ids(), lim.vocab, "token_ids"); !st.ok()) {
      return invalid(where, st.message());
    }
    if (s.extend() && s.has_sampling()) {
      return invalid(where, "sampling is set when the sequence is created, not when it is extended");
    }
    if (s.has_expected_len() && !s.extend() && s.expected_len() != 0) {
      return invalid(where, "expected_len ", s.expected_len(), " of a new sequence must be 0 (its length before this call)");
    }
    if (s.has_expected_len() && int64_t(s.expected_len()) + s.token_ids_size() > int64_t(lim.max_seq_len)) {
      return invalid(where, "expected_len ", s.expected_len(), " plus ", s.token_ids_size(),
                     " tokens exceed max_seq_len ", lim.max_seq_len);
    }
    if (auto sp = to_sampling(s.sampling(), lim.vocab); !sp.ok())
      return invalid(where, sp.status().message());
    if (s.has_stop()) {
      if (auto r = to_stop_rules(s.stop(), lim); !r.ok()) return invalid(where, r.status().message());
    }
    if (s.has_logprobs()) {
      if (auto r = to_logprobs(s.logprobs()); !r.ok()) return invalid(where, r.status().message());
    }
  }
  return absl::OkStatus();
}

absl::Status validate(const v1::DecodeRequest& req, const ServiceLimits& lim) {
  if (auto st = check_ids(
          req.sequences(), [](const auto& s) { return s.id(); }, lim);
      !st.ok())
    return st;
  if (req.steps() > uint32_t(lim.max_decode_steps)) {
    return invalid("steps ", req.steps(), " exceeds the limit of ", lim.max_decode_steps, " per call");
  }
  for (int i = 0; i < req.sequences_size(); ++i) {
    const auto& s = req.sequences(i);
    if (s.has_expected_len() && (s.expected_len() < 1 || s.expected_len() > uint32_t(lim.max_seq_len))) {
      return invalid("sequences[", i, "] (id ", s.id(), "): expected_len ", s.expected_len(),
                     " is outside [1, max_seq_len ", lim.max_seq_len, "]");
    }
    if (s.has_stop()) {
      if (auto r = to_stop_rules(s.stop(), lim); !r.ok()) {
        return invalid("sequences[", i, "] (id ", s.id(), "): ", r.status().message());
      }
    }
    if (s.has_logprobs()) {
      if (auto r = to_logprobs(s.logprobs()); !r.ok()) {
        return invalid("sequences[", i, "] (id ", s.id(), "): ", r.status().message());
      }
    }
  }
  return absl::OkStatus();
}

absl::Status validate(const v1::ReleaseRequest& req, const ServiceLimits& lim) {
  return check_ids(
      req.ids(), [](uint64_t id) { return id; }, lim);
}

absl::Status validate(const v1::AbortRequest& req) {
  if (req.id() == 0) return invalid("id 0 is reserved");
  return absl::OkStatus();
}

absl::Status validate(const v1::GenerateRequest& req, const ServiceLimits& lim) {
  if (req.prompt_ids().empty()) return invalid("empty prompt");
  if (req.prompt_ids_size() >= lim.max_seq_len) {
    return invalid("prompt of ", req.prompt_ids_size(), " tokens leaves no room under max_seq_len ",
                   lim.max_seq_len);
  }
  KVFUSE_RETURN_IF_ERROR(check_tokens(req.prompt_ids(), lim.vocab, "prompt_ids"));
  if (req.max_tokens() > uint32_t(lim.max_seq_len)) {
    return invalid("max_tokens ", req.max_tokens(), " exceeds max_seq_len ", lim.max_seq_len);
  }
  if (req.stop_token_ids_size() > lim.max_stop_tokens) {
    return invalid(req.stop_token_ids_size(), " stop tokens exceed the limit of ", lim.max_stop_tokens);
  }
  KVFUSE_RETURN_IF_ERROR(check_tokens(req.stop_token_ids(), lim.vocab, "stop_token_ids"));
  if (const int32_t max_tokens = generate_max_tokens(req, lim); req.min_tokens() > uint32_t(max_tokens)) {
    return invalid("min_tokens ", req.min_tokens(), " exceeds ",
                   req.max_tokens() != 0 ? "max_tokens " : "the default max_tokens ", max_tokens);
  }
  if (auto sp = to_sampling(req.sampling(), lim.vocab); !sp.ok()) return sp.status();
  if (auto lp = to_logprobs(req.logprobs()); !lp.ok()) return lp.status();
  return absl::OkStatus();
}

}  // namespace kvfuse::server
