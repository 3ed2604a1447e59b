// kvfuse-cli: calls a running kvfuse-server. Prints responses as JSON (one line);
// `generate` streams tokens as they arrive. Exit codes (kExit* below, and --help):
//   0       the call succeeded: every sequence's result is OK; health is SERVING
//   1 .. 16 the gRPC status code of the failed call, or of the first sequence result
//           (in request order) that is not OK
//   20      health answered, and not SERVING
//   64      the command line is wrong
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

#include "grpc/health/v1/health.grpc.pb.h"
#include "kvfuse/v1/decode.grpc.pb.h"
#include "clients/client_util.h"
#include "src/loading/int_list.h"

using namespace kvfuse;

namespace {

struct Common {
  std::string addr = "127.0.0.1:50051";
  double timeout_s = 60;
};

void set_deadline(grpc::ClientContext& ctx, const Common& c) {
  if (c.timeout_s > 0) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(
                         std::chrono::duration<double>(c.timeout_s)));
  }
}

constexpr int kExitNotServing = 20;
constexpr int kExitUsage = 64;

// 0, or the code of the first result that is not OK.
template <class Results>
int first_failure(const Results& results) {
  for (const auto& r : results) {
    if (r.status().code() != v1::SequenceStatus::OK) return int(r.status().code());
  }
  return 0;
}
int exit_code(const google::protobuf::Message&) { return 0; }
int exit_code(const v1::PrefillResponse& r) { return first_failure(r.results()); }
int exit_code(const v1::DecodeResponse& r) { return first_failure(r.results()); }
int exit_code(const grpc::health::v1::HealthCheckResponse& r) {
  return r.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : kExitNotServing;
}

// Prints the response (or the call's error) and returns the exit code.
template <class Response>
int report(const grpc::Status& st, const Response* resp) {
  if (!st.ok()) {
    std::fprintf(stderr, "kvfuse-cli: %s\n", client::describe(st).c_str());
    return int(st.error_code());
  }
  if (!resp) return 0;
  std::printf("%s\n", client::to_json(*resp).c_str());
  return exit_code(*resp);
}

struct SamplingFlags {
  float temperature = 0;
  int top_k = 0;
  float top_p = 1;
  uint64_t seed = 0;
  float min_p = 0;
  float repetition_penalty = 1;
  float frequency_penalty = 0;
  float presence_penalty = 0;
  std::vector<std::string> logit_bias;  // TOKEN:BIAS
  void add(CLI::App* cmd) {
    cmd->add_option("--temperature", temperature, "0: greedy");
    cmd->add_option("--top-k", top_k, "0: no limit");
    cmd->add_option("--top-p", top_p, "(0, 1]");
    cmd->add_option("--seed", seed, "sampler seed");
    cmd->add_option("--min-p", min_p, "[0, 1]; 0: off");
    cmd->add_option("--repetition-penalty", repetition_penalty, "(0, 2]; 1: off");
    cmd->add_option("--frequency-penalty", frequency_penalty, "[-2, 2]; 0: off");
    cmd->add_option("--presence-penalty", presence_penalty, "[-2, 2]; 0: off");
    cmd->add_option("--logit-bias", logit_bias, "TOKEN:BIAS (bias in [-100, 100]); repeatable")
        ->check([](const std::string& v) -> std::string {
          int32_t t;
          float b;
          const std::vector<std::string> kv = absl::StrSplit(v, ':');
          return kv.size() == 2 && absl::SimpleAtoi(kv[0], &t) && absl::SimpleAtof(kv[1], &b)
                     ? ""
                     : "--logit-bias takes TOKEN:BIAS, e.g. 42:-5.5";
        });
  }
  void fill(v1::SamplingParams* p) const {
    p->set_temperature(temperature);
    p->set_top_k(top_k);
    p->set_top_p(top_p);
    p->set_seed(seed);
    p->set_min_p(min_p);
    if (repetition_penalty != 1.0f) p->set_repetition_penalty(repetition_penalty);
    p->set_frequency_penalty(frequency_penalty);
    p->set_presence_penalty(presence_penalty);
    for (const std::string& v : logit_bias) {
      const std::vector<std::string> kv = absl::StrSplit(v, ':');
      int32_t t = 0;
      float b = 0;
      (void)absl::SimpleAtoi(kv[0], &t);  // checked when parsed
      (void)absl::SimpleAtof(kv[1], &b);
      (*p->mutable_logit_bias())[t] = b;
    }
  }
};

// The router path's stop rules (StopRules in the proto); sent only when a flag is given.
struct StopFlags {
  std::string stop_ids;
  bool ignore_eos = false;
  int64_t max_new_tokens = -1;
  int64_t min_new_tokens = -1;
  void add(CLI::App* cmd) {
    cmd->add_option("--stop-ids", stop_ids, "comma-separated stop token ids (sets the stop rules)");
    cmd->add_flag("--ignore-eos", ignore_eos, "the model's EOS tokens do not stop the sequence");
    cmd->add_option("--max-new-tokens", max_new_tokens, "finish after this many sampled tokens (0: no limit)");
    cmd->add_option("--min-new-tokens", min_new_tokens, "stop and EOS tokens do not stop before this many");
  }
  bool given() const { return !stop_ids.empty() || ignore_eos || max_new_tokens >= 0 || min_new_tokens >= 0; }
  // False (with a message) when --stop-ids is not a list of ints.
  bool fill(v1::StopRules* r) const {
    auto ids = parse_int_list(stop_ids);
    if (!ids.ok()) {
      std::fprintf(stderr, "kvfuse-cli: --stop-ids: %s\n", std::string(ids.status().message()).c_str());
      return false;
    }
    for (int32_t t : *ids) r->add_stop_token_ids(t);
    r->set_ignore_eos(ignore_eos);
    if (max_new_tokens >= 0) r->set_max_new_tokens(uint32_t(max_new_tokens));
    if (min_new_tokens >= 0) r->set_min_new_tokens(uint32_t(min_new_tokens));
    return true;
  }
};

// Logprobs (LogprobsParams in the proto); sent only when a flag is given.
struct LogprobFlags {
  bool logprobs = false;
  int64_t top_n = -1;
  bool prompt = false;
  void add(CLI::App* cmd, bool with_prompt) {
    cmd->add_flag("--logprobs", logprobs, "each sampled token's logprob (log-softmax of the raw logits)");
    cmd->add_option("--top-logprobs", top_n, "also the N most likely tokens at each position (0..20; implies --logprobs)");
    if (with_prompt) cmd->add_flag("--prompt-logprobs", prompt, "also the prompt tokens' logprobs");
  }
  bool given() const { return logprobs || top_n >= 0 || prompt; }
  void fill(v1::LogprobsParams* p) const {
    p->set_enabled(logprobs || top_n >= 0);
    if (top_n >= 0) p->set_top_n(uint32_t(top_n));
    p->set_prompt(prompt);
  }
};

void print_logprob(const char* what, const v1::TokenLogprob& t) {
  std::printf("%s %d logprob %.6f", what, t.token_id(), double(t.logprob()));
  if (t.top_size() > 0) std::printf(" top");
  for (const auto& e : t.top()) std::printf(" %d:%.6f", e.token_id(), double(e.logprob()));
  std::printf("\n");
}

int run_generate(v1::DecodeService::Stub& stub, const Common& c, v1::GenerateRequest req) {
  grpc::ClientContext ctx;
  set_deadline(ctx, c);
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse msg;
  bool first = true;
  std::vector<v1::TokenLogprob> logprobs, prompt_logprobs;
  while (reader->Read(&msg)) {
    logprobs.insert(logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
    prompt_logprobs.insert(prompt_logprobs.end(), msg.prompt_logprobs().begin(), msg.prompt_logprobs().end());
    if (first) {
      std::printf("id %llu:", (unsigned long long)msg.id());
      first = false;
    }
    for (int32_t t : msg.token_ids()) std::printf(" %d", t);
    std::fflush(stdout);
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      const v1::Usage& u = msg.usage();
      std::printf(
          "\nfinish_reason=%s prompt_tokens=%u completion_tokens=%u ttft_ms=%.2f e2e_ms=%.2f cached_tokens=%u\n",
          v1::FinishReason_Name(msg.finish_reason()).c_str(), u.prompt_tokens(), u.completion_tokens(),
          u.time_to_first_token_s() * 1e3, u.e2e_latency_s() * 1e3, u.cached_tokens());
      for (const auto& t : prompt_logprobs) print_logprob("prompt token", t);
      for (const auto& t : logprobs) print_logprob("token", t);
    }
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok() && !first) {
    // End the token line before the error goes to stderr: with both streams on one
    // pipe, a buffered newline would land after the message.
    std::printf("\n");
    std::fflush(stdout);
  }
  return report<google::protobuf::Message>(st, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvfuse-cli: call a kvfuse-server"};
  Common c;
  app.add_option("-a,--addr", c.addr, "server address host:port")->capture_default_str();
  app.add_option("--timeout-s", c.timeout_s, "call deadline in seconds (0: none)")->capture_default_str();
  app.require_subcommand(1);

  auto* info = app.add_subcommand("info", "model, KV cache dtype and format, paths, pool size");
  auto* load = app.add_subcommand("load", "running and waiting requests, pages per pool");
  auto* flush = app.add_subcommand("flush-cache", "drop the prefix cache's pages no sequence holds");
  auto* events = app.add_subcommand("kv-events", "print the prefix cache's event batches as they come (JSON lines)");
  uint64_t events_from = 0;
  events->add_option("--from", events_from, "the first batch (0: the next one)");
  auto* health = app.add_subcommand("health", "grpc.health.v1 Check");
  std::string health_service;
  health->add_option("--service", health_service, "service name ('' = the server)");

  auto* gen = app.add_subcommand("generate", "stream the tokens of one request");
  std::string prompt_ids;
  uint32_t max_tokens = 16;
  uint64_t gen_id = 0;
  std::string stop_ids;
  SamplingFlags gen_sampling;
  gen->add_option("--prompt-ids", prompt_ids, "comma-separated prompt token ids")->required();
  gen->add_option(
         "-m,--max-tokens", max_tokens,
         "tokens to generate; 0 asks for the server's default (16), at most the server's max_seq_len")
      ->capture_default_str();
  gen->add_option("--id", gen_id, "request id (0: the server picks)");
  gen->add_option("--stop-ids", stop_ids, "comma-separated stop token ids");
  bool gen_ignore_eos = false;
  uint32_t min_tokens = 0;
  gen->add_flag("--ignore-eos", gen_ignore_eos, "the model's EOS tokens do not stop the request");
  gen->add_option("--min-tokens", min_tokens, "stop and EOS tokens do not stop before this many tokens");
  gen_sampling.add(gen);
  LogprobFlags gen_logprobs;
  gen_logprobs.add(gen, true);

  auto* prefill = app.add_subcommand("prefill", "create (or --extend) a router-driven sequence");
  uint64_t pf_id = 0;
  std::string pf_ids;
  bool extend = false, no_sample = false;
  SamplingFlags pf_sampling;
  prefill->add_option("--id", pf_id, "sequence id")->required();
  prefill->add_option("--prompt-ids", pf_ids, "comma-separated token ids")->required();
  prefill->add_flag("--extend", extend, "append to a live sequence");
  prefill->add_flag("--no-sample", no_sample, "compute the KV only (a middle chunk)");
  int64_t pf_expected_len = -1;
  prefill->add_option("--expected-len", pf_expected_len,
                      "the length before this call (0 for a new sequence): a retry returns the first answer");
  pf_sampling.add(prefill);
  StopFlags pf_stop;
  pf_stop.add(prefill);
  LogprobFlags pf_logprobs;
  pf_logprobs.add(prefill, true);

  auto* decode = app.add_subcommand("decode", "run decode steps for router-driven sequences");
  std::vector<uint64_t> dec_ids;
  uint32_t steps = 1;
  int64_t expected_len = -1;
  decode->add_option("--id", dec_ids, "sequence id (repeatable)")->required();
  decode->add_option("-n,--steps", steps, "steps")->capture_default_str();
  decode->add_option("--expected-len", expected_len, "the length the caller knows: a retry returns the first answer");
  StopFlags dec_stop;
  dec_stop.add(decode);
  LogprobFlags dec_logprobs;
  dec_logprobs.add(decode, false);

  auto* release = app.add_subcommand("release", "free router-driven sequences (idempotent)");
  std::vector<uint64_t> rel_ids;
  release->add_option("--id", rel_ids, "sequence id (repeatable)")->required();

  auto* abort = app.add_subcommand("abort", "end a Generate request or a sequence now");
  uint64_t abort_id = 0;
  abort->add_option("--id", abort_id, "id")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitUsage;  // --help is not an error
  }

  auto channel = client::make_channel(c.addr);
  v1::DecodeService::Stub stub(channel);
  grpc::ClientContext ctx;
  set_deadline(ctx, c);

  if (*info) {
    v1::GetInfoResponse resp;
    return report(stub.GetInfo(&ctx, {}, &resp), &resp);
  }
  if (*load) {
    v1::GetLoadResponse resp;
    return report(stub.GetLoad(&ctx, {}, &resp), &resp);
  }
  if (*flush) {
    v1::FlushCacheResponse resp;
    return report(stub.FlushCache(&ctx, {}, &resp), &resp);
  }
  if (*events) {  // until --timeout-s or the server ends the stream
    v1::SubscribeKvEventsRequest req;
    if (events_from > 0) req.set_start_sequence_number(events_from);
    auto reader = stub.SubscribeKvEvents(&ctx, req);
    v1::KvEventBatch batch;
    while (reader->Read(&batch)) {
      std::printf("%s\n", client::to_json(batch).c_str());
      std::fflush(stdout);
    }
    const grpc::Status st = reader->Finish();
    if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) return 0;  // --timeout-s ended it
    return report(st, static_cast<const v1::KvEventBatch*>(nullptr));
  }
  if (*health) {
    grpc::health::v1::Health::Stub hs(channel);
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(health_service);
    grpc::health::v1::HealthCheckResponse resp;
    return report(hs.Check(&ctx, req, &resp), &resp);
  }
  if (*gen) {
    auto ids = parse_int_list(prompt_ids);
    auto stops = parse_int_list(stop_ids);
    if (!ids.ok() || !stops.ok()) {
      std::fprintf(stderr, "kvfuse-cli: %s\n",
                   std::string((ids.ok() ? stops : ids).status().message()).c_str());
      return kExitUsage;
    }
    v1::GenerateRequest req;
    req.set_id(gen_id);
    for (int32_t t : *ids) req.add_prompt_ids(t);
    for (int32_t t : *stops) req.add_stop_token_ids(t);
    req.set_max_tokens(max_tokens);
    req.set_ignore_eos(gen_ignore_eos);
    req.set_min_tokens(min_tokens);
    gen_sampling.fill(req.mutable_sampling());
    if (gen_logprobs.given()) gen_logprobs.fill(req.mutable_logprobs());
    return run_generate(stub, c, std::move(req));
  }
  if (*prefill) {
    auto ids = parse_int_list(pf_ids);
    if (!ids.ok()) {
      std::fprintf(stderr, "kvfuse-cli: %s\n", std::string(ids.status().message()).c_str());
      return kExitUsage;
    }
    v1::PrefillRequest req;
    v1::PrefillSequence* s = req.add_sequences();
    s->set_id(pf_id);
    for (int32_t t : *ids) s->add_token_ids(t);
    s->set_extend(extend);
    s->set_no_sample(no_sample);
    if (pf_expected_len >= 0) s->set_expected_len(uint32_t(pf_expected_len));
    if (!extend) pf_sampling.fill(s->mutable_sampling());
    if (pf_stop.given() && !pf_stop.fill(s->mutable_stop())) return kExitUsage;
    if (pf_logprobs.given()) pf_logprobs.fill(s->mutable_logprobs());
    v1::PrefillResponse resp;
    return report(stub.Prefill(&ctx, req, &resp), &resp);
  }
  if (*decode) {
    v1::DecodeRequest req;
    for (uint64_t id : dec_ids) {
      v1::DecodeSequence* s = req.add_sequences();
      s->set_id(id);
      if (expected_len >= 0) s->set_expected_len(uint32_t(expected_len));
      if (dec_stop.given() && !dec_stop.fill(s->mutable_stop())) return kExitUsage;
      if (dec_logprobs.given()) dec_logprobs.fill(s->mutable_logprobs());
    }
    req.set_steps(steps);
    v1::DecodeResponse resp;
    return report(stub.Decode(&ctx, req, &resp), &resp);
  }
  if (*release) {
    v1::ReleaseRequest req;
    for (uint64_t id : rel_ids) req.add_ids(id);
    v1::ReleaseResponse resp;
    return report(stub.Release(&ctx, req, &resp), &resp);
  }
  if (*abort) {
    v1::AbortRequest req;
    req.set_id(abort_id);
    v1::AbortResponse resp;
    return report(stub.Abort(&ctx, req, &resp), &resp);
  }
  return 0;
}
