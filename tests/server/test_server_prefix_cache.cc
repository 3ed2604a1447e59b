// The prefix cache through the server: a finished request's prefix serves the next one
// (cached_tokens, GetLoad, /metrics), FlushCache, and SubscribeKvEvents (the events in
// order, a reconnect from a sequence number sees every later batch exactly once, bad
// subscriber input is refused and leaves the server serving, nothing leaked).
#include <string>
#include <thread>
#include <vector>

#include "tests/util/catch.h"
#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

// Every batch the subscription sends within `seconds` (then the deadline ends it).
struct Subscription {
  std::vector<v1::KvEventBatch> batches;
  grpc::Status status;
};
Subscription subscribe(const TestServer& t, std::optional<uint64_t> start, double seconds = 1.0) {
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(seconds));
  v1::SubscribeKvEventsRequest req;
  if (start) req.set_start_sequence_number(*start);
  auto reader = t.stub->SubscribeKvEvents(&ctx, req);
  Subscription s;
  v1::KvEventBatch b;
  while (reader->Read(&b)) s.batches.push_back(b);
  s.status = reader->Finish();
  return s;
}

v1::FlushCacheResponse flush(const TestServer& t) {
  grpc::ClientContext ctx;
  ctx.set_deadline(in_seconds(10));
  v1::FlushCacheResponse resp;
  REQUIRE(t.stub->FlushCache(&ctx, {}, &resp).ok());
  return resp;
}

}  // namespace

TEST_CASE("server: a finished request's prefix serves the next one: cached_tokens, GetLoad, metrics",
          "[server][prefix]") {
  auto t = TestServer::start();
  const std::vector<int32_t> prompt = test_prompt(21, 48);
  const StreamResult a = generate(*t.stub, generate_request(prompt, 3));
  REQUIRE(a.status.ok());
  CHECK(a.usage.cached_tokens() == 0);
  REQUIRE(t.wait_all_pages_free());
  CHECK(t.load().pools(0).cached_pages() == 3);  // 50 tokens computed: 3 whole pages of 16
  CHECK(t.load().pools(0).evictable_pages() == 3);
  const StreamResult b = generate(*t.stub, generate_request(prompt, 3));
  REQUIRE(b.status.ok());
  CHECK(b.usage.cached_tokens() == 32);  // whole pages of the 47 tokens before the last
  CHECK(b.tokens == a.tokens);
  const std::string m = t.server->metrics().render();
  CHECK(m.find("kvfuse:prefix_cache_queries_total{") != std::string::npos);
  CHECK(m.find("kvfuse:prefix_cache_hits_total{") != std::string::npos);
  CHECK(m.find("kvfuse:prefix_cache_pages{") != std::string::npos);
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: KV events in order, replayed exactly once from a sequence number, FlushCache",
          "[server][prefix]") {
  auto t = TestServer::start();
  // A subscriber waiting from the first batch sees the events of a request that runs
  // meanwhile (woken by the publish, or reading the history if it subscribed late).
  Subscription live;
  std::thread sub([&] { live = subscribe(t, 1, 2.0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  REQUIRE(generate(*t.stub, generate_request(test_prompt(3, 40), 2)).status.ok());
  sub.join();
  CHECK(live.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
  REQUIRE_FALSE(live.batches.empty());
  CHECK(live.batches[0].events(0).has_block_stored());
  CHECK(live.batches[0].events(0).block_stored().block_size() == 16);
  // From now (no start): nothing old is replayed.
  const Subscription now = subscribe(t, std::nullopt, 0.3);
  CHECK(now.batches.empty());
  CHECK(now.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);

  // Everything from batch 1: numbered 1, 2, ... without gaps; the stored blocks are the
  // two whole pages of the 41 tokens computed.
  REQUIRE(t.wait_all_pages_free());
  Subscription all = subscribe(t, 1);
  REQUIRE_FALSE(all.batches.empty());
  int stored = 0;
  for (size_t i = 0; i < all.batches.size(); ++i) {
    CHECK(all.batches[i].sequence_number() == i + 1);
    for (const auto& e : all.batches[i].events()) {
      if (e.has_block_stored()) stored += e.block_stored().block_hashes_size();
    }
  }
  CHECK(stored == 2);
  const uint64_t last = all.batches.back().sequence_number();
  // A retried subscription from the same batch gets the same batches.
  const Subscription again = subscribe(t, 1);
  REQUIRE(again.batches.size() == all.batches.size());
  for (size_t i = 0; i < all.batches.size(); ++i) {
    CHECK(again.batches[i].SerializeAsString() == all.batches[i].SerializeAsString());
  }

  // FlushCache: the two pages go, then the cache is empty.
  const v1::FlushCacheResponse f = flush(t);
  CHECK(f.pages_flushed() == 2);
  CHECK(f.pages_cached() == 0);
  CHECK(t.load().pools(0).cached_pages() == 0);
  // A retried FlushCache is idempotent, as Release is: it drops nothing more, and says so.
  const v1::FlushCacheResponse retried = flush(t);
  CHECK(retried.pages_flushed() == 0);
  CHECK(retried.pages_cached() == 0);
  // A reconnect from last + 1 sees the flush's batch and nothing before it.
  Subscription after = subscribe(t, last + 1);
  REQUIRE(after.batches.size() == 1);
  CHECK(after.batches[0].sequence_number() == last + 1);
  const auto& ev = after.batches[0].events();
  REQUIRE(ev.size() == 2);
  CHECK(ev[0].block_removed().block_hashes_size() == 2);
  CHECK(ev[1].has_all_blocks_cleared());
  // Past the next batch: refused, naming the field.
  Subscription future = subscribe(t, last + 10);
  CHECK(future.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(future.status.error_message().find("start_sequence_number") != std::string::npos);
  // The server serves on, nothing held.
  REQUIRE(generate(*t.stub, generate_request(test_prompt(4, 20), 2)).status.ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: a reconnect older than kv_events_history is OUT_OF_RANGE, naming the oldest kept",
          "[server][prefix]") {
  auto t = TestServer::start({"kv_events_history=2"});
  for (int i = 0; i < 4; ++i) REQUIRE(generate(*t.stub, generate_request(test_prompt(30 + i, 40), 2)).status.ok());
  REQUIRE(t.wait_all_pages_free());
  const Subscription old = subscribe(t, 1);
  CHECK(old.status.error_code() == grpc::StatusCode::OUT_OF_RANGE);
  CHECK(old.status.error_message().find("oldest batch kept") != std::string::npos);
  CHECK(old.batches.empty());
  REQUIRE(generate(*t.stub, generate_request(test_prompt(40, 20), 2)).status.ok());
  CHECK(t.wait_all_pages_free());
}

TEST_CASE("server: FlushCache keeps the pages live sequences hold", "[server][prefix]") {
  auto t = TestServer::start();
  v1::PrefillRequest pre;
  add_prefill(pre, 900, test_prompt(7, 40));
  v1::PrefillResponse pr;
  REQUIRE(t.prefill(pre, &pr).ok());
  REQUIRE(pr.results(0).status().code() == v1::SequenceStatus::OK);
  const v1::FlushCacheResponse f = flush(t);
  CHECK(f.pages_flushed() == 0);
  CHECK(f.pages_cached() == 2);  // 40 tokens computed: 2 whole pages, held by sequence 900
  REQUIRE(t.release({900}).ok());
  CHECK(t.wait_all_pages_free());
  CHECK(flush(t).pages_flushed() == 2);
}

TEST_CASE("server: a KV event subscription ends UNAVAILABLE when the server stops", "[server][prefix]") {
  auto t = TestServer::start();
  Subscription s;
  std::thread sub([&] { s = subscribe(t, std::nullopt, 20.0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  t.server->drain(1.0);
  sub.join();
  CHECK(s.status.error_code() == grpc::StatusCode::UNAVAILABLE);
}
