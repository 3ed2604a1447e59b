#include "server/sglang_request.h"

#include <cmath>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvfuse::server {

namespace {

absl::Status invalid(auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); }

// What kvfuse does not have, refused by name: the field, and why.
absl::Status refuse_unsupported(const sgl::GenerateRequest& req) {
  if (req.has_mm_inputs()) return invalid("mm_inputs: kvfuse serves text-only models");
  if (!req.input_embeds().empty()) return invalid("input_embeds: kvfuse takes token ids only (tokenized.input_ids)");
  if (!req.lora_id().empty()) return invalid("lora_id \"", req.lora_id(), "\": kvfuse serves no LoRA adapters");
  if (req.return_hidden_states()) return invalid("return_hidden_states: kvfuse does not return hidden states");
  if (req.has_disaggregated_params()) {
    return invalid("disaggregated_params: kvfuse does not serve prefill/decode disaggregation");
  }
  if (!req.custom_logit_processor().empty()) {
    return invalid("custom_logit_processor: kvfuse runs no serialized logit processors");
  }
  if (req.data_parallel_rank() != 0) {
    return invalid("data_parallel_rank ", req.data_parallel_rank(), ": kvfuse has one data-parallel rank, 0");
  }
  if (!req.token_ids_logprob().empty()) {
    return invalid("token_ids_logprob: kvfuse gives the logprobs of the sampled and the top tokens only");
  }
  const sgl::SamplingParams& p = req.sampling_params();
  if (!p.stop().empty()) {
    return invalid("sampling_params.stop: string stops are the router's to match; send stop_token_ids");
  }
  switch (p.constraint_case()) {
    case sgl::SamplingParams::kRegex:
      return invalid("sampling_params.regex: kvfuse has no constrained decoding");
    case sgl::SamplingParams::kJsonSchema:
      return invalid("sampling_params.json_schema: kvfuse has no constrained decoding");
    case sgl::SamplingParams::kEbnfGrammar:
      return invalid("sampling_params.ebnf_grammar: kvfuse has no constrained decoding");
    case sgl::SamplingParams::kStructuralTag:
      return invalid("sampling_params.structural_tag: kvfuse has no constrained decoding");
    case sgl::SamplingParams::CONSTRAINT_NOT_SET:
      break;
  }
  if (p.n() > 1) return invalid("sampling_params.n ", p.n(), ": kvfuse answers one sample per request (n 1)");
  return absl::OkStatus();
}

// custom_params: "seed" (a whole number in [0, 2^53], the sampler's seed); any other key
// is refused by name.
absl::Status read_custom_params(const sgl::SamplingParams& p, v1::SamplingParams* out) {
  for (const auto& [key, value] : p.custom_params().fields()) {
    if (key != kSglangSeedParam) {
      return invalid("sampling_params.custom_params[\"", key, "\"]: unknown key (kvfuse reads \"",
                     kSglangSeedParam, "\" only)");
    }
    const double v = value.number_value();
    if (value.kind_case() != google::protobuf::Value::kNumberValue || !std::isfinite(v) || v < 0 ||
        v > 9007199254740992.0 || v != std::floor(v)) {
      return invalid("sampling_params.custom_params[\"seed\"] must be a whole number in [0, 2^53]");
    }
    out->set_seed(uint64_t(v));
  }
  return absl::OkStatus();
}

// SGLang's sampling parameters as kvfuse.v1's, proto3 zeros read as smg's conversion
// means them (docs/sglang.md#sampling-parameters).
absl::Status to_v1_sampling(const sgl::SamplingParams& p, const ServiceLimits& lim, v1::SamplingParams* out) {
  out->set_temperature(p.temperature());
  out->set_top_k(p.top_k() <= 0 ? 0 : p.top_k());
  out->set_top_p(p.top_p() == 0.0f ? 1.0f : p.top_p());
  out->set_min_p(p.min_p());
  out->set_repetition_penalty(p.repetition_penalty() == 0.0f ? 1.0f : p.repetition_penalty());
  out->set_frequency_penalty(p.frequency_penalty());
  out->set_presence_penalty(p.presence_penalty());
  for (const auto& [key, bias] : p.logit_bias()) {
    int32_t token = 0;
    if (!absl::SimpleAtoi(key, &token)) {
      return invalid("sampling_params.logit_bias[\"", key, "\"]: the key must be a token id");
    }
    (*out->mutable_logit_bias())[token] = bias;
  }
  if (auto st = read_custom_params(p, out); !st.ok()) return st;
  // The ranges, named as SGLang names them ("sampling_params.top_p 2 must be in (0, 1]").
  if (auto s = to_sampling(*out, lim.vocab); !s.ok()) return invalid("sampling_params.", s.status().message());
  return absl::OkStatus();
}

absl::Status check_tokens(const google::protobuf::RepeatedField<uint32_t>& ids, int32_t vocab,
                          const char* what) {
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] >= uint32_t(vocab)) {
      return invalid(what, "[", i, "] = ", ids[i], " is outside the vocabulary [0, ", vocab, ")");
    }
  }
  return absl::OkStatus();
}

// Token counts, stop rules and stream shape.
absl::Status to_v1_limits(const sgl::GenerateRequest& req, const ServiceLimits& lim, SglangGenerate* out) {
  const sgl::SamplingParams& p = req.sampling_params();
  v1::GenerateRequest& g = out->request;
  if (p.has_max_new_tokens()) {
    if (p.max_new_tokens() == 0) return invalid("sampling_params.max_new_tokens 0: kvfuse generates at least one token");
    if (p.max_new_tokens() > uint32_t(lim.max_seq_len)) {
      return invalid("sampling_params.max_new_tokens ", p.max_new_tokens(), " exceeds max_seq_len ", lim.max_seq_len);
    }
    g.set_max_tokens(p.max_new_tokens());
  } else {
    g.set_max_tokens(uint32_t(std::min(kSglangDefaultMaxNewTokens, lim.max_seq_len)));
  }
  if (p.min_new_tokens() > g.max_tokens()) {
    return invalid("sampling_params.min_new_tokens ", p.min_new_tokens(), " exceeds max_new_tokens ", g.max_tokens());
  }
  g.set_min_tokens(p.min_new_tokens());
  if (p.stop_token_ids_size() > lim.max_stop_tokens) {
    return invalid("sampling_params.stop_token_ids: ", p.stop_token_ids_size(), " tokens exceed the limit of ",
                   lim.max_stop_tokens);
  }
  if (auto st = check_tokens(p.stop_token_ids(), lim.vocab, "sampling_params.stop_token_ids"); !st.ok()) return st;
  for (uint32_t t : p.stop_token_ids()) g.add_stop_token_ids(int32_t(t));
  g.set_ignore_eos(p.ignore_eos());
  if (p.has_stream_interval() && p.stream_interval() < 1) {
    return invalid("sampling_params.stream_interval ", p.stream_interval(), " must be at least 1");
  }
  out->reply.stream = req.stream();
  out->reply.stream_interval = p.has_stream_interval() ? p.stream_interval() : 1;
  return absl::OkStatus();
}

// return_logprob, top_logprobs_num and logprob_start_len as kvfuse.v1's LogprobsParams.
absl::Status to_v1_logprobs(const sgl::GenerateRequest& req, SglangGenerate* out) {
  if (req.top_logprobs_num() < 0 || req.top_logprobs_num() > kMaxTopLogprobs) {
    return invalid("top_logprobs_num ", req.top_logprobs_num(), " must be in [0, ", kMaxTopLogprobs, "]");
  }
  if (req.logprob_start_len() < -1) {
    return invalid("logprob_start_len ", req.logprob_start_len(), " must be -1 (no input logprobs) or at least 0");
  }
  const int32_t prompt_len = req.tokenized().input_ids_size();
  if (req.logprob_start_len() >= prompt_len) {
    return invalid("logprob_start_len ", req.logprob_start_len(), " must be below the prompt's length ", prompt_len);
  }
  SglangReplyOptions& r = out->reply;
  r.return_logprob = req.return_logprob();
  if (!r.return_logprob) return absl::OkStatus();  // SGLang: the other two need it
  r.top_logprobs_num = req.top_logprobs_num();
  r.logprob_start_len = req.logprob_start_len();
  v1::LogprobsParams* lp = out->request.mutable_logprobs();
  lp->set_enabled(true);
  lp->set_top_n(uint32_t(r.top_logprobs_num));
  lp->set_prompt(r.logprob_start_len >= 0);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SglangGenerate> from_sglang(const sgl::GenerateRequest& req, const std::string& request_id,
                                           const ServiceLimits& lim) {
  if (auto st = refuse_unsupported(req); !st.ok()) return st;
  SglangGenerate out;
  out.reply.request_id = request_id;
  const auto& ids = req.tokenized().input_ids();
  if (ids.empty()) return invalid("tokenized.input_ids is empty (kvfuse takes token ids, not text)");
  if (ids.size() >= lim.max_seq_len) {
    return invalid("tokenized.input_ids: ", ids.size(), " tokens leave no room under max_seq_len ", lim.max_seq_len);
  }
  if (auto st = check_tokens(ids, lim.vocab, "tokenized.input_ids"); !st.ok()) return st;
  out.reply.input_ids.assign(ids.begin(), ids.end());
  for (uint32_t t : ids) out.request.add_prompt_ids(int32_t(t));
  if (auto st = to_v1_sampling(req.sampling_params(), lim, out.request.mutable_sampling()); !st.ok()) return st;
  if (auto st = to_v1_limits(req, lim, &out); !st.ok()) return st;
  if (auto st = to_v1_logprobs(req, &out); !st.ok()) return st;
  // kvfuse.v1's own checks, which the mapping above has already made pass.
  if (auto st = validate(out.request, lim); !st.ok()) return st;
  return out;
}

}  // namespace kvfuse::server
