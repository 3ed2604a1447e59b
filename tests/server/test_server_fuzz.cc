// A thousand randomized malformed (and a few valid) requests against a real server,
// including raw bytes that are not protobuf at all. Afterwards the server must still
// serve the engine's tokens and GetLoad must show every page free.
#include <grpcpp/generic/generic_stub.h>

#include <future>
#include <random>
#include <set>

#include "tests/util/test_server_util.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  uint64_t id() {
    static constexpr uint64_t kSpecial[] = {0, 1, 2, 3, 4, 5, UINT64_MAX, uint64_t(1) << 63};
    return pick(4) == 0 ? kSpecial[pick(8)] : 1 + pick(40);
  }
  int32_t token() {
    static constexpr int32_t kSpecial[] = {-1, 1024, 1025, INT32_MAX, INT32_MIN, 0, 1023};
    return pick(5) == 0 ? kSpecial[pick(7)] : int32_t(pick(1024));
  }
  float number() {
    static constexpr float kSpecial[] = {NAN, INFINITY, -INFINITY, -1.0f, 0.0f, 1.0f, 1e30f, 0.5f, 101.0f};
    return kSpecial[pick(9)];
  }
  void sampling(v1::SamplingParams* s) {
    if (pick(2)) s->set_temperature(number());
    if (pick(2)) s->set_top_k(int32_t(rng_()));
    if (pick(2)) s->set_top_p(number());
    s->set_seed(rng_());
  }
  void tokens(google::protobuf::RepeatedField<int32_t>* out) {
    const int n = int(pick(5) == 0 ? 100 + pick(100) : pick(12));
    for (int i = 0; i < n; ++i) out->Add(token());
  }
  std::string bytes() {
    std::string b(pick(64), '\0');
    for (auto& c : b) c = char(rng_());
    return b;
  }
  uint64_t pick(uint64_t n) { return rng_() % n; }

  v1::PrefillRequest prefill() {
    v1::PrefillRequest r;
    const int n = int(pick(5));
    for (int i = 0; i < n; ++i) {
      auto* s = r.add_sequences();
      s->set_id(id());
      tokens(s->mutable_token_ids());
      s->set_extend(pick(3) == 0);
      s->set_no_sample(pick(4) == 0);
      if (pick(2)) sampling(s->mutable_sampling());
    }
    return r;
  }
  v1::DecodeRequest decode() {
    static constexpr uint32_t kSteps[] = {0, 1, 2, 3, 257, 1000, UINT32_MAX};
    v1::DecodeRequest r;
    r.set_steps(kSteps[pick(7)]);
    const int n = int(pick(5));
    for (int i = 0; i < n; ++i) {
      auto* s = r.add_sequences();
      s->set_id(id());
      if (pick(2)) s->set_expected_len(uint32_t(pick(3) == 0 ? rng_() : pick(40)));
    }
    return r;
  }
  v1::GenerateRequest generate() {
    static constexpr uint32_t kMax[] = {0, 1, 3, 129, UINT32_MAX};
    v1::GenerateRequest r;
    if (pick(2)) r.set_id(id());
    tokens(r.mutable_prompt_ids());
    r.set_max_tokens(kMax[pick(5)]);
    if (pick(3) == 0) r.add_stop_token_ids(token());
    if (pick(2)) sampling(r.mutable_sampling());
    return r;
  }

 private:
  std::mt19937_64 rng_;
};

const std::set<grpc::StatusCode> kExpected = {grpc::StatusCode::OK,
                                              grpc::StatusCode::INVALID_ARGUMENT,
                                              grpc::StatusCode::NOT_FOUND,
                                              grpc::StatusCode::ALREADY_EXISTS,
                                              grpc::StatusCode::RESOURCE_EXHAUSTED,
                                              grpc::StatusCode::FAILED_PRECONDITION,
                                              grpc::StatusCode::ABORTED,
                                              grpc::StatusCode::OUT_OF_RANGE,
                                              grpc::StatusCode::DEADLINE_EXCEEDED};

}  // namespace

TEST_CASE("server: a thousand randomized malformed requests leave it serving with every page free",
          "[server][fuzz]") {
  auto t = TestServer::start({"num_pages=64", "max_seq_len=128"});
  Fuzzer f(20260101);
  grpc::GenericStub generic(t.channel);
  const char* methods[] = {"Prefill", "Decode", "Release", "Generate", "Abort", "GetInfo", "GetLoad"};
  std::map<int, int> codes;
  // Budgets far above what a call takes (about a millisecond), so that a slow or busy
  // machine cannot turn a deadline into a failure.
  const auto end = Clock::now() + std::chrono::seconds(300);
  int calls = 0;
  for (; calls < 1000 && Clock::now() < end; ++calls) {
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(20));
    grpc::Status st;
    const uint64_t kind = f.pick(10);
    if (kind <= 2) {
      v1::PrefillResponse resp;
      st = t.stub->Prefill(&ctx, f.prefill(), &resp);
    } else if (kind <= 4) {
      v1::DecodeResponse resp;
      st = t.stub->Decode(&ctx, f.decode(), &resp);
    } else if (kind == 5) {
      v1::ReleaseRequest req;
      for (int i = 0, n = int(f.pick(4)); i < n; ++i) req.add_ids(f.id());
      v1::ReleaseResponse resp;
      st = t.stub->Release(&ctx, req, &resp);
    } else if (kind == 6) {
      v1::AbortRequest req;
      req.set_id(f.id());
      v1::AbortResponse resp;
      st = t.stub->Abort(&ctx, req, &resp);
    } else if (kind == 7) {
      auto reader = t.stub->Generate(&ctx, f.generate());
      v1::GenerateResponse msg;
      while (reader->Read(&msg)) {
      }
      st = reader->Finish();
    } else {
      // Not protobuf, or a valid message cut short: parsed (or refused) by gRPC itself.
      std::string body = f.bytes();
      if (kind == 9) {
        const std::string full = f.prefill().SerializeAsString();
        body = full.substr(0, full.size() / 2);
      }
      grpc::Slice slice(body);
      grpc::ByteBuffer req(&slice, 1), resp;
      std::promise<grpc::Status> done;
      generic.UnaryCall(&ctx, std::string("/kvfuse.v1.DecodeService/") + methods[f.pick(7)],
                        grpc::StubOptions(), &req, &resp,
                        [&done](grpc::Status s) { done.set_value(std::move(s)); });
      done.get_future().wait();
      continue;  // any status will do; the server must survive it
    }
    ++codes[int(st.error_code())];
    INFO("call " << calls << ": " << client::describe(st));
    CHECK(kExpected.count(st.error_code()) == 1);
  }
  CHECK(calls == 1000);
  CHECK(codes[int(grpc::StatusCode::INVALID_ARGUMENT)] > 300);

  // Whatever the valid ones created is released; then nothing may be left.
  std::vector<uint64_t> all;
  for (uint64_t id = 1; id <= 41; ++id) all.push_back(id);
  for (uint64_t id : {UINT64_MAX, uint64_t(1) << 63}) all.push_back(id);
  REQUIRE(t.release(all).ok());
  CHECK(t.wait_all_pages_free(10));
  const auto load = t.load();
  CHECK(load.pools(0).free_pages() == load.pools(0).total_pages());
  CHECK(load.serving());
  const auto prompt = test_prompt(3, 9);
  const auto expected = expected_tokens(test_config({"num_pages=64", "max_seq_len=128"}), {prompt}, 6);
  const StreamResult r = generate(*t.stub, generate_request(prompt, 6));
  REQUIRE(r.status.ok());
  CHECK(r.tokens == expected[0]);
}
