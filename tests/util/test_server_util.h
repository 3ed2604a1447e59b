// Helpers for the server tests: an in-process kvfuse server on a loopback port (the
// port picked by the OS), a client for it, and the engine's own in-process output to
// compare the served tokens against.
#pragma once

#include <mutex>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include "tests/util/catch.h"

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "kvfuse/v1/decode.grpc.pb.h"
#include "clients/client_util.h"
#include "server/server.h"
#include "src/loading/config.h"
#include "src/runtime/engine.h"
#include "src/runtime/scheduler.h"

namespace kvfuse::testing {

namespace v1 = kvfuse::v1;
using Clock = std::chrono::steady_clock;

// The tiny model on the CPU with `overrides` ("key=value").
inline Config test_config(const std::vector<std::string>& overrides = {}) {
  nlohmann::json j = {{"model", "tiny"}, {"device", "cpu"}, {"num_pages", 512}};
  for (const auto& o : overrides) REQUIRE(apply_config_override(j, o).ok());
  auto cfg = config_from_json(j);
  REQUIRE(cfg.ok());
  return *cfg;
}

inline std::chrono::system_clock::time_point in_seconds(double s) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(s));
}

struct TestServer {
  std::unique_ptr<server::KvfuseServer> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::DecodeService::Stub> stub;

  // Starts on 127.0.0.1 (a free port) and waits until the engine is warm, unless
  // `wait` is false.
  static TestServer start(const std::vector<std::string>& overrides = {},
                          const std::function<void(server::ServerOptions&)>& customize = {},
                          bool wait = true) {
    spdlog::set_level(spdlog::level::warn);
    server::ServerOptions opts;
    opts.loop.config = test_config(overrides);
    opts.listen = "127.0.0.1:0";
    opts.metrics_port = -1;
    if (customize) customize(opts);
    auto s = server::KvfuseServer::start(std::move(opts));
    REQUIRE(s.ok());
    TestServer t;
    t.server = std::move(*s);
    if (wait) REQUIRE(t.server->wait_until_serving(30).ok());
    t.channel = client::make_channel(t.server->address());
    t.stub = v1::DecodeService::NewStub(t.channel);
    return t;
  }

  v1::GetLoadResponse load() const {
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(10));
    v1::GetLoadResponse resp;
    const grpc::Status st = stub->GetLoad(&ctx, {}, &resp);
    REQUIRE(st.ok());
    return resp;
  }
  int64_t used_pages() const { return int64_t(load().pools(0).used_pages()); }

  // Polls GetLoad until no page is used (pages are freed at a step boundary).
  bool wait_all_pages_free(double timeout_s = 10) const {
    const auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (Clock::now() < end) {
      const auto l = load();
      if (l.pools(0).used_pages() == 0 && l.num_streams() == 0 && l.num_running() == 0 &&
          l.num_waiting() == 0) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  grpc::Status prefill(const v1::PrefillRequest& req, v1::PrefillResponse* resp,
                       double timeout_s = 30) const {
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(timeout_s));
    return stub->Prefill(&ctx, req, resp);
  }
  grpc::Status decode(const v1::DecodeRequest& req, v1::DecodeResponse* resp, double timeout_s = 30) const {
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(timeout_s));
    return stub->Decode(&ctx, req, resp);
  }
  grpc::Status release(const std::vector<uint64_t>& ids, v1::ReleaseResponse* resp = nullptr) const {
    v1::ReleaseRequest req;
    for (uint64_t id : ids) req.add_ids(id);
    v1::ReleaseResponse r;
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(10));
    return stub->Release(&ctx, req, resp ? resp : &r);
  }
};

// Everything one Generate call returned.
struct StreamResult {
  grpc::Status status;
  std::vector<int32_t> tokens;
  int messages = 0;
  uint64_t id = 0;
  std::string request_id_header;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  int final_messages = 0;
  std::vector<v1::TokenLogprob> logprobs;
  std::vector<v1::TokenLogprob> prompt_logprobs;
  int prompt_logprobs_message = -1;  // the message (from 0) that carried them
};

inline StreamResult generate(v1::DecodeService::Stub& stub, const v1::GenerateRequest& req,
                             double timeout_s = 60, const std::function<void(int)>& after_read = {}) {
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(timeout_s));
  StreamResult r;
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (r.messages == 0) {
      const auto& md = ctx.GetServerInitialMetadata();
      if (auto it = md.find("kvfuse-request-id"); it != md.end()) {
        r.request_id_header = std::string(it->second.data(), it->second.size());
      }
    }
    ++r.messages;
    r.id = msg.id();
    r.tokens.insert(r.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    r.logprobs.insert(r.logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
    if (msg.prompt_logprobs_size() > 0) {
      r.prompt_logprobs.insert(r.prompt_logprobs.end(), msg.prompt_logprobs().begin(), msg.prompt_logprobs().end());
      r.prompt_logprobs_message = r.messages - 1;
    }
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      ++r.final_messages;
      r.finish = msg.finish_reason();
      r.usage = msg.usage();
    }
    if (after_read) after_read(r.messages);
  }
  r.status = reader->Finish();
  return r;
}

inline v1::GenerateRequest generate_request(const std::vector<int32_t>& prompt, uint32_t max_tokens,
                                            uint64_t id = 0) {
  v1::GenerateRequest req;
  req.set_id(id);
  for (int32_t t : prompt) req.add_prompt_ids(t);
  req.set_max_tokens(max_tokens);
  return req;
}

// A distinct prompt per index, inside the tiny model's vocabulary.
inline std::vector<int32_t> test_prompt(int index, int len) {
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (int i = 0; i < len; ++i) p[size_t(i)] = int32_t((index * 131 + i * 17 + 1) % 1024);
  return p;
}

// The engine's greedy output for each prompt, run in-process through a Scheduler of
// its own: what the server must stream.
// Every token the server's engine produces, per sequence, in step order (install
// hook() as ServerOptions::loop.result_hook).
struct TokenRecord {
  std::mutex mu;
  std::map<SeqId, std::vector<int32_t>> tokens;
  std::function<void(std::vector<StepResult>&)> hook() {
    return [this](std::vector<StepResult>& results) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& r : results) {
        if (r.token) tokens[r.id].push_back(*r.token);
      }
    };
  }
  std::vector<int32_t> get(SeqId id) {
    std::lock_guard<std::mutex> lock(mu);
    return tokens[id];
  }
};

inline std::vector<std::vector<int32_t>> expected_tokens(const Config& cfg,
                                                         const std::vector<std::vector<int32_t>>& prompts,
                                                         int max_tokens) {
  auto engine = Engine::create(cfg);
  REQUIRE(engine.ok());
  Scheduler sched(**engine);
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest r;
    r.id = SeqId(i + 1);
    r.prompt = prompts[i];
    r.max_new_tokens = max_tokens;
    REQUIRE(sched.submit(std::move(r)).ok());
  }
  std::vector<std::vector<int32_t>> out(prompts.size());
  for (int guard = 0; sched.has_work() && guard < 100000; ++guard) {
    auto events = sched.step();
    REQUIRE(events.ok());
    for (const auto& ev : *events) {
      REQUIRE(ev.finish != FinishReason::error);
      if (ev.token) out[size_t(ev.id - 1)].push_back(*ev.token);
    }
  }
  return out;
}

inline v1::PrefillSequence* add_prefill(v1::PrefillRequest& req, uint64_t id,
                                        const std::vector<int32_t>& tokens, bool extend = false,
                                        bool no_sample = false) {
  v1::PrefillSequence* s = req.add_sequences();
  s->set_id(id);
  for (int32_t t : tokens) s->add_token_ids(t);
  s->set_extend(extend);
  s->set_no_sample(no_sample);
  return s;
}

inline grpc::StatusCode code_of(const v1::SequenceStatus& s) { return grpc::StatusCode(int(s.code())); }

}  // namespace kvfuse::testing
