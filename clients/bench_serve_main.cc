// kvfuse-bench-serve: a load generator for a running kvfuse-server. N concurrent
// Generate streams for a duration (each stream sends its next request as soon as the
// previous one ends), a progress line every second, then output throughput and
// TTFT / ITL / end-to-end percentiles, measured on the client, and the prefix cache's hit
// rate (the prompt tokens the server reports as cached).
//
// Prompts are random token ids, optionally after a prefix every request shares
// (--shared-prefix-len: a system prompt), and optionally as conversations of --turns turns:
// each turn's prompt is the previous turn's prompt, its output and --prompt-len new tokens
// (a chat's history), so that a server with a prefix cache computes only the new part.
//
// --protocol picks the service the load goes through: kvfuse.v1 Generate (kvfuse) or smg's
// SGLang Generate on the same port (sglang, server/sglang_service.h), with the same
// prompts, parameters and seeds, so that the two can be compared on one server.
#include <CLI/CLI.hpp>

#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "kvfuse/v1/decode.grpc.pb.h"
#include "clients/client_util.h"
#include "smg/sglang_scheduler.grpc.pb.h"

using namespace kvfuse;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string addr = "127.0.0.1:50051";
  int concurrency = 64;
  double duration_s = 10;
  int prompt_len = 32;
  int max_tokens = 64;
  float temperature = 0;
  uint64_t seed = 1;
  int64_t max_requests = 0;  // 0: no limit
  int shared_prefix_len = 0;  // tokens every prompt begins with
  int turns = 1;              // requests per conversation
  std::string protocol = "kvfuse";  // kvfuse | sglang
};

// The stubs of both services on the server's one channel.
struct Stubs {
  v1::DecodeService::Stub& kvfuse;
  sglang::grpc::scheduler::SglangScheduler::Stub& sglang;
};

// One request's outcome: the stream's status and the usage its last message reports.
struct Reply {
  grpc::Status status;
  int64_t prompt_tokens = 0, cached_tokens = 0;
};
using OnTokens = std::function<void(const google::protobuf::RepeatedField<int32_t>&)>;

// kvfuse.v1 Generate: `on_tokens` gets each message's new tokens.
Reply generate_kvfuse(v1::DecodeService::Stub& stub, grpc::ClientContext& ctx, const std::vector<int32_t>& prompt,
                      const Options& o, uint64_t seed, const OnTokens& on_tokens) {
  v1::GenerateRequest req;
  for (int32_t t : prompt) req.add_prompt_ids(t);
  req.set_max_tokens(uint32_t(o.max_tokens));
  req.set_ignore_eos(true);  // every request generates max_tokens
  req.mutable_sampling()->set_temperature(o.temperature);
  req.mutable_sampling()->set_seed(seed);
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse msg;
  Reply r;
  while (reader->Read(&msg)) {
    if (msg.has_usage()) {
      r.prompt_tokens = msg.usage().prompt_tokens();
      r.cached_tokens = msg.usage().cached_tokens();
    }
    if (msg.token_ids_size() > 0) on_tokens(msg.token_ids());
  }
  r.status = reader->Finish();
  return r;
}

// smg's SGLang Generate, as smg sends it (explicit defaults, the seed in custom_params):
// `on_tokens` gets each chunk's tokens; the complete repeats them all and is not counted.
Reply generate_sglang(sglang::grpc::scheduler::SglangScheduler::Stub& stub, grpc::ClientContext& ctx,
                      const std::vector<int32_t>& prompt, const Options& o, uint64_t seed, const std::string& id,
                      const OnTokens& on_tokens) {
  namespace sgl = sglang::grpc::scheduler;
  sgl::GenerateRequest req;
  req.set_request_id(id);
  for (int32_t t : prompt) req.mutable_tokenized()->add_input_ids(uint32_t(t));
  sgl::SamplingParams* p = req.mutable_sampling_params();
  p->set_temperature(o.temperature);
  p->set_top_p(1.0f);
  p->set_top_k(-1);
  p->set_repetition_penalty(1.0f);
  p->set_n(1);
  p->set_max_new_tokens(uint32_t(o.max_tokens));
  p->set_ignore_eos(true);
  (*p->mutable_custom_params()->mutable_fields())["seed"].set_number_value(double(seed));
  req.set_logprob_start_len(-1);
  req.set_stream(true);
  auto reader = stub.Generate(&ctx, req);
  sgl::GenerateResponse msg;
  google::protobuf::RepeatedField<int32_t> ids;
  Reply r;
  while (reader->Read(&msg)) {
    if (msg.has_complete()) {
      r.prompt_tokens = msg.complete().prompt_tokens();
      r.cached_tokens = msg.complete().cached_tokens();
    }
    if (msg.has_chunk() && msg.chunk().token_ids_size() > 0) {
      ids.Clear();
      for (uint32_t t : msg.chunk().token_ids()) ids.Add(int32_t(t));
      on_tokens(ids);
    }
  }
  r.status = reader->Finish();
  return r;
}

struct Samples {
  std::vector<double> ttft, itl, e2e;
  std::map<std::string, int64_t> errors;
  int64_t prompt_tokens = 0, cached_tokens = 0;  // as the final messages' usage reports
};

struct Progress {
  std::atomic<int64_t> done{0}, failed{0}, tokens{0}, started{0};
};

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The prefix every prompt begins with: the same ids in every worker (the seed's).
std::vector<int32_t> shared_prefix(const Options& o, int32_t vocab) {
  std::mt19937_64 rng(o.seed * 104729 + 17);
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  std::vector<int32_t> p(static_cast<size_t>(o.shared_prefix_len));
  for (int32_t& t : p) t = tok(rng);
  return p;
}

void worker(int index, const Options& o, int32_t vocab, int64_t max_seq_len, const std::vector<int32_t>& prefix,
            Stubs stubs, Clock::time_point end, Progress& progress, Samples& out) {
  std::mt19937_64 rng(o.seed * 7919 + uint64_t(index));
  std::uniform_int_distribution<int32_t> tok(0, vocab - 1);
  std::vector<int32_t> history;  // the conversation so far (prompt and output of its turns)
  int turn = 0;
  int64_t sent = 0;
  while (Clock::now() < end) {
    if (o.max_requests > 0 && progress.started.fetch_add(1) >= o.max_requests) return;
    // A new conversation after its last turn, or when the next turn would not fit.
    if (turn == o.turns || int64_t(history.size()) + o.prompt_len + o.max_tokens >= max_seq_len) {
      history.clear();
      turn = 0;
    }
    if (turn == 0) history = prefix;
    for (int i = 0; i < o.prompt_len; ++i) history.push_back(tok(rng));
    ++turn;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(int64_t(o.duration_s) + 120));
    const auto t0 = Clock::now();
    auto last = t0;
    bool first = true;
    const std::vector<int32_t> prompt = history;
    auto on_tokens = [&](const google::protobuf::RepeatedField<int32_t>& ids) {
      const int n = ids.size();
      history.insert(history.end(), ids.begin(), ids.end());
      const auto now = Clock::now();
      const double gap = std::chrono::duration<double>(now - last).count();
      if (first) {
        out.ttft.push_back(gap);
        // The first message's other tokens came with the first: no gap between them.
        for (int i = 1; i < n; ++i) out.itl.push_back(0.0);
        first = false;
      } else {
        // A coalesced chunk (the reader fell behind): spread the gap over its tokens.
        for (int i = 0; i < n; ++i) out.itl.push_back(gap / n);
      }
      last = now;
      progress.tokens += n;
    };
    // 53 bits: a seed SGLang's custom_params carries exactly (a JSON number), the same on both.
    const uint64_t seed = rng() >> 11;
    const std::string id = "bench-" + std::to_string(index) + "-" + std::to_string(sent++);
    const Reply reply = o.protocol == "sglang" ? generate_sglang(stubs.sglang, ctx, prompt, o, seed, id, on_tokens)
                                               : generate_kvfuse(stubs.kvfuse, ctx, prompt, o, seed, on_tokens);
    out.prompt_tokens += reply.prompt_tokens;
    out.cached_tokens += reply.cached_tokens;
    const grpc::Status& st = reply.status;
    if (!st.ok()) turn = o.turns;  // the conversation ends with a failed turn
    if (st.ok()) {
      out.e2e.push_back(since(t0));
      ++progress.done;
    } else {
      ++out.errors[client::describe(st).substr(0, client::describe(st).find(':'))];
      ++progress.failed;
      if (st.error_code() == grpc::StatusCode::UNAVAILABLE)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
}

void print_pcts(const char* name, std::vector<double> v) {
  std::printf("%-5s ms   p50 %8.2f   p90 %8.2f   p99 %8.2f   max %8.2f   (n=%zu)\n", name,
              client::percentile(v, 50) * 1e3, client::percentile(v, 90) * 1e3,
              client::percentile(v, 99) * 1e3, client::percentile(v, 100) * 1e3, v.size());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvfuse-bench-serve: concurrent Generate streams against a kvfuse-server"};
  Options o;
  app.add_option("-a,--addr", o.addr, "server address")->capture_default_str();
  app.add_option("-c,--concurrency", o.concurrency, "concurrent streams")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("-d,--duration-s", o.duration_s, "seconds to send requests for")
      ->check(CLI::Range(0.1, 86400.0))
      ->capture_default_str();
  app.add_option("--prompt-len", o.prompt_len, "prompt tokens (random ids)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("-m,--max-tokens", o.max_tokens, "tokens per request")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("-t,--temperature", o.temperature, "0: greedy")->capture_default_str();
  app.add_option("--seed", o.seed, "prompt and sampler seed")->capture_default_str();
  app.add_option("-n,--max-requests", o.max_requests, "stop after this many requests (0: no limit)");
  app.add_option("--shared-prefix-len", o.shared_prefix_len, "tokens every prompt begins with (a system prompt)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--turns", o.turns,
                 "requests per conversation: each turn's prompt is the last one's prompt and output plus "
                 "--prompt-len new tokens")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--protocol", o.protocol,
                 "the service the load goes through: kvfuse (kvfuse.v1 Generate) or sglang (smg's SGLang Generate "
                 "on the same port; the seed goes in custom_params)")
      ->check(CLI::IsMember({"kvfuse", "sglang"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto channel = client::make_channel(o.addr);
  v1::DecodeService::Stub stub(channel);
  sglang::grpc::scheduler::SglangScheduler::Stub sglang_stub(channel);
  v1::GetInfoResponse info;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status st = stub.GetInfo(&ctx, {}, &info);
    if (!st.ok()) {
      std::fprintf(stderr, "kvfuse-bench-serve: GetInfo: %s\n", client::describe(st).c_str());
      return 1;
    }
  }
  std::printf(
      "kvfuse-bench-serve: %s on %s, kv %s (%s write), %s attention; %s protocol, %d streams for %.1f s, "
      "prompt %d, max_tokens %d, shared prefix %d, %d turn%s\n",
      info.model().c_str(), info.device().c_str(), info.kv_format().c_str(), info.kv_write().c_str(),
      info.attention().c_str(), o.protocol.c_str(), o.concurrency, o.duration_s, o.prompt_len, o.max_tokens, o.shared_prefix_len,
      o.turns, o.turns == 1 ? "" : "s");
  if (int64_t(o.shared_prefix_len) + o.prompt_len + o.max_tokens > int64_t(info.max_seq_len())) {
    std::fprintf(stderr, "kvfuse-bench-serve: --shared-prefix-len + --prompt-len + --max-tokens (%d) exceed the "
                 "server's max_seq_len %u\n", o.shared_prefix_len + o.prompt_len + o.max_tokens, info.max_seq_len());
    return 2;
  }
  const std::vector<int32_t> prefix = shared_prefix(o, int32_t(info.vocab_size()));

  Progress progress;
  std::vector<Samples> samples(size_t(o.concurrency));
  const auto t0 = Clock::now();
  const auto end =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration_s));
  std::vector<std::thread> threads;
  for (int i = 0; i < o.concurrency; ++i) {
    threads.emplace_back(worker, i, std::cref(o), int32_t(info.vocab_size()), int64_t(info.max_seq_len()),
                         std::cref(prefix), Stubs{stub, sglang_stub}, end, std::ref(progress), std::ref(samples[size_t(i)]));
  }
  std::atomic<bool> finished{false};
  std::thread reporter([&] {
    const bool tty = isatty(fileno(stderr));
    while (!finished.load()) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      if (finished.load()) break;
      const double t = since(t0);
      std::fprintf(stderr, "%s[%6.1fs] done %lld  failed %lld  tokens %lld  %.0f tok/s%s", tty ? "\r" : "", t,
                   (long long)progress.done.load(), (long long)progress.failed.load(),
                   (long long)progress.tokens.load(), double(progress.tokens.load()) / t, tty ? "   " : "\n");
    }
  });
  for (auto& t : threads) t.join();
  finished = true;
  reporter.join();
  const double elapsed = since(t0);
  std::fprintf(stderr, "\n");

  Samples all;
  for (auto& s : samples) {
    all.ttft.insert(all.ttft.end(), s.ttft.begin(), s.ttft.end());
    all.itl.insert(all.itl.end(), s.itl.begin(), s.itl.end());
    all.e2e.insert(all.e2e.end(), s.e2e.begin(), s.e2e.end());
    for (const auto& [k, v] : s.errors) all.errors[k] += v;
    all.prompt_tokens += s.prompt_tokens;
    all.cached_tokens += s.cached_tokens;
  }
  const double tokens = double(progress.tokens.load());
  std::printf("requests  %lld ok, %lld failed in %.2f s: %.2f req/s\n", (long long)progress.done.load(),
              (long long)progress.failed.load(), elapsed, double(progress.done.load()) / elapsed);
  std::printf("output    %.0f tokens: %.1f tok/s\n", tokens, tokens / elapsed);
  print_pcts("TTFT", all.ttft);
  print_pcts("ITL", all.itl);
  print_pcts("E2E", all.e2e);
  std::printf("prefix cache  %lld of %lld prompt tokens cached: hit rate %.1f%%\n", (long long)all.cached_tokens,
              (long long)all.prompt_tokens,
              all.prompt_tokens > 0 ? 100.0 * double(all.cached_tokens) / double(all.prompt_tokens) : 0.0);
  for (const auto& [code, n] : all.errors) std::printf("error     %s x %lld\n", code.c_str(), (long long)n);
  return progress.failed.load() > 0 && progress.done.load() == 0 ? 1 : 0;
}
