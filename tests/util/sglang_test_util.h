// Helpers for the tests of smg's SGLang service (server/sglang_service.h): a client stub
// on a TestServer's channel, requests built as smg builds them, and one Generate call's
// messages collected.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "smg/sglang_scheduler.grpc.pb.h"
#include "tests/util/test_server_util.h"

namespace kvfuse::testing {

namespace sgl = ::sglang::grpc::scheduler;
namespace smgc = ::smg::grpc::common;

inline std::unique_ptr<sgl::SglangScheduler::Stub> sglang_stub(const TestServer& t) {
  return sgl::SglangScheduler::NewStub(t.channel);
}

// Sampling parameters as smg sends them when the client sets none
// (crates/grpc_client/src/sglang_scheduler.rs, build_sampling_params_from_plain).
inline sgl::SamplingParams smg_default_sampling() {
  sgl::SamplingParams p;
  p.set_temperature(1.0f);
  p.set_top_p(1.0f);
  p.set_top_k(-1);
  p.set_repetition_penalty(1.0f);
  p.set_n(1);
  p.set_skip_special_tokens(true);
  p.set_spaces_between_special_tokens(true);
  return p;
}

// A greedy request of `max_new_tokens` for `prompt`.
inline sgl::GenerateRequest sglang_request(const std::string& request_id, const std::vector<int32_t>& prompt,
                                           uint32_t max_new_tokens, bool stream = true) {
  sgl::GenerateRequest req;
  req.set_request_id(request_id);
  for (int32_t t : prompt) req.mutable_tokenized()->add_input_ids(uint32_t(t));
  *req.mutable_sampling_params() = smg_default_sampling();
  req.mutable_sampling_params()->set_temperature(0.0f);
  req.mutable_sampling_params()->set_max_new_tokens(max_new_tokens);
  req.set_logprob_start_len(-1);
  req.set_stream(stream);
  return req;
}

inline void set_seed(sgl::GenerateRequest& req, double seed) {
  (*req.mutable_sampling_params()->mutable_custom_params()->mutable_fields())["seed"].set_number_value(seed);
}

// Everything one SGLang Generate call returned.
struct SglangResult {
  grpc::Status status;
  std::vector<sgl::GenerateStreamChunk> chunks;
  std::vector<sgl::GenerateComplete> completes;
  std::vector<std::string> request_ids;  // of every message
  std::vector<uint32_t> chunk_tokens;    // the chunks' tokens, in order
  const sgl::GenerateComplete& complete() const {
    REQUIRE(completes.size() == 1);
    return completes.front();
  }
  std::vector<int32_t> output_ids() const {
    const auto& ids = complete().output_ids();
    return std::vector<int32_t>(ids.begin(), ids.end());
  }
};

// `after_read(n)` runs after the n-th message (from 1).
inline SglangResult sglang_generate(sgl::SglangScheduler::Stub& stub, const sgl::GenerateRequest& req,
                                    double timeout_s = 60, const std::function<void(int)>& after_read = {}) {
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(timeout_s));
  SglangResult r;
  auto reader = stub.Generate(&ctx, req);
  sgl::GenerateResponse msg;
  int n = 0;
  while (reader->Read(&msg)) {
    r.request_ids.push_back(msg.request_id());
    if (msg.has_chunk()) {
      r.chunks.push_back(msg.chunk());
      r.chunk_tokens.insert(r.chunk_tokens.end(), msg.chunk().token_ids().begin(), msg.chunk().token_ids().end());
    }
    if (msg.has_complete()) r.completes.push_back(msg.complete());
    if (after_read) after_read(++n);
  }
  r.status = reader->Finish();
  return r;
}

// Holds the engine loop inside a step while closed (install hook() as
// ServerOptions::loop.result_hook): a request stays live, and calls posted meanwhile run
// at the next turn, in the order they came. Never holds longer than a minute.
struct StepGate {
  std::atomic<bool> closed{false};
  std::function<void(std::vector<StepResult>&)> hook() {
    return [this](std::vector<StepResult>&) {
      const auto end = Clock::now() + std::chrono::seconds(60);
      while (closed.load() && Clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
  }
};

}  // namespace kvfuse::testing
