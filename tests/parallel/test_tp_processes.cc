// A tensor-parallel group across processes on the CPU backend: rank 0 is an engine in this
// test, rank 1 a real kvfuse-run process that follows it (tp_rendezvous on localhost), or,
// where a test needs to break rank 1 from the inside, an engine on a thread of this
// process that follows over the same TCP connections.
//
// The TCP communicator sums in rank order exactly as the threads' CPU communicator does,
// so a group of two processes computes the same bits as tp 2 in one process: logits are
// compared with memcmp, not a tolerance.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include "tests/util/catch.h"

#include "src/loading/calibration.h"
#include "tests/util/engine_test_util.h"
#include "tests/util/forwarding_backend.h"
#include "tests/util/free_port.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using Catch::Matchers::ContainsSubstring;
using Clock = std::chrono::steady_clock;

namespace {

const char* tmp_dir() {
  const char* t = std::getenv("TMPDIR");
  return t != nullptr && *t != '\0' ? t : "/tmp";
}

const nlohmann::json kBase = {{"model", "tiny"},     {"device", "cpu"},      {"num_pages", 512},
                              {"max_seq_len", 1024}, {"tensor_parallel", 2}, {"tp_rendezvous_timeout_s", 30}};

nlohmann::json with(nlohmann::json j, const nlohmann::json& more) {
  for (const auto& [k, v] : more.items()) j[k] = v;
  return j;
}

Config config_of(const nlohmann::json& j) {
  auto cfg = config_from_json(j);
  INFO(cfg.status().ToString());
  REQUIRE(cfg.ok());
  return *cfg;
}

// `keys` for rank `rank` of a group whose rank 0 is at 127.0.0.1:port.
nlohmann::json group_keys(const nlohmann::json& keys, int port, int rank) {
  return with(keys, {{"tp_rendezvous", "127.0.0.1:" + std::to_string(port)}, {"tp_rank", rank}});
}

// A kvfuse-run process following rank 0; what it prints goes to a file.
class FollowerProcess {
 public:
  FollowerProcess(const nlohmann::json& keys, int port, int rank) {
    log_ = std::string(tmp_dir()) + "/kvfuse-follower-" + std::to_string(::getpid()) + "-" +
           std::to_string(port) + ".log";
    std::vector<std::string> args = {KVFUSE_RUN_BIN};
    const nlohmann::json all = group_keys(keys, port, rank);
    for (const auto& [k, v] : all.items()) {
      args.push_back("--set");
      args.push_back(k + "=" + (v.is_string() ? v.get<std::string>() : v.dump()));
    }
    // Everything the child needs is made before the fork: it only redirects and execs.
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int out = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    REQUIRE(out >= 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      if (::dup2(out, 1) < 0 || ::dup2(out, 2) < 0) ::_exit(127);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out);
  }
  ~FollowerProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::remove(log_.c_str());
  }
  pid_t pid() const { return pid_; }
  // The exit status once it has exited (within `timeout`), -1 if it did not exit (killed
  // then), 128 + signal if a signal ended it.
  int wait(std::chrono::seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    int status = 0;
    while (Clock::now() < deadline) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  std::string output() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

// A follower engine on a thread of this process (its own backend, e.g. one that fails).
class FollowerThread {
 public:
  FollowerThread(const nlohmann::json& keys, int port, int rank, std::unique_ptr<Backend> backend = nullptr) {
    const Config cfg = config_of(group_keys(keys, port, rank));
    thread_ = std::thread([this, cfg, b = std::move(backend)]() mutable {
      engine = b ? Engine::create(cfg, std::move(b)) : Engine::create(cfg);
      if (engine.ok()) followed = (*engine)->follow();
    });
  }
  ~FollowerThread() { join(); }
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  absl::StatusOr<std::unique_ptr<Engine>> engine = absl::UnknownError("not created");
  absl::Status followed = absl::UnknownError("did not follow");

 private:
  std::thread thread_;
};

std::unique_ptr<Engine> make_leader(const nlohmann::json& keys, int port) {
  auto e = Engine::create(config_of(group_keys(keys, port, 0)));
  INFO(e.status().ToString());
  REQUIRE(e.ok());
  return std::move(*e);
}

}  // namespace

TEST_CASE("tensor parallel across processes (cpu): a follower process computes one process's bits",
          "[tp][processes][engine]") {
  // tp 2 of one rank per process, tiny and hybrid; and tp 4 of two processes that hold two
  // ranks each (devices "0,1": rank 0's process ranks 0 and 1, kvfuse-run's 2 and 3).
  const nlohmann::json fp8 = with(kBase, {{"kv_cache_dtype", "fp8_e4m3"}});
  const nlohmann::json swa = {{"sliding_window", 24}, {"swa_layers", "alternate"}};
  struct Case {
    const char* name;
    nlohmann::json keys;
    int local;  // ranks per process
    const char* follows;
  };
  const std::vector<Case> cases = {
      {"tiny fp8 KV", fp8, 1, "rank 1 of 2 follows rank 0 at 127.0.0.1:"},
      {"hybrid fp8 KV", with(fp8, swa), 1, "rank 1 of 2 follows rank 0 at 127.0.0.1:"},
      {"hybrid fp8 KV, tp 4 in two processes of two ranks", with(with(fp8, swa), {{"tensor_parallel", 4}}), 2,
       "ranks 2-3 of 4 follow rank 0 at 127.0.0.1:"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      const Run ref = run_model(*make_engine(c.keys));
      const nlohmann::json keys = c.local == 1 ? c.keys : with(c.keys, {{"devices", "0,1"}});
      const int port = free_loopback_port();
      FollowerProcess follower(keys, port, c.local);
      auto leader = make_leader(keys, port);
      CHECK(leader->num_ranks() == c.keys["tensor_parallel"].get<int>());
      CHECK(leader->num_local_ranks() == c.local);
      CHECK_FALSE(leader->is_follower());
      // As a server does after its warm-up: the followers take the command (a no-op on
      // the CPU backend) and go on computing the same bits.
      auto ended = leader->end_gemm_tuning();
      REQUIRE(ended.ok());
      CHECK_FALSE(*ended);  // the CPU backend tunes nothing
      const Run got = run_model(*leader);
      CHECK(got.greedy == ref.greedy);
      REQUIRE(got.logits.size() == ref.logits.size());
      size_t differ = 0;
      for (size_t i = 0; i < ref.logits.size(); ++i) {
        REQUIRE(got.logits[i].size() == ref.logits[i].size());
        differ += std::memcmp(got.logits[i].data(), ref.logits[i].data(),
                              ref.logits[i].size() * sizeof(float)) != 0;
      }
      INFO(differ << " of " << ref.logits.size() << " logits rows differ");
      CHECK(differ == 0);
      CHECK(leader->pool().usage(PoolKind::full).used_pages == 0);
      // Rank 0's engine goes away cleanly: the follower exits 0.
      leader.reset();
      const int rc = follower.wait(std::chrono::seconds(30));
      INFO(follower.output());
      CHECK(rc == 0);
      CHECK_THAT(follower.output(), ContainsSubstring(c.follows));
    }
  }
}

TEST_CASE("tensor parallel across processes (cpu): a killed follower fails rank 0's step in bounded time",
          "[tp][processes][errors]") {
  const int port = free_loopback_port();
  FollowerProcess follower(kBase, port, 1);
  auto leader = make_leader(kBase, port);
  const int32_t vocab = leader->spec().vocab;
  REQUIRE(leader->add_sequence(1, prompt_of(300, 1, vocab), SamplingParams{}).ok());
  REQUIRE(leader->add_sequence(2, prompt_of(20, 2, vocab), SamplingParams{}).ok());
  REQUIRE(leader->step({StepItem{2, 20, true}}).ok());
  // Killed while rank 0 runs steps (in one of them, or between two): a step fails.
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    ::kill(follower.pid(), SIGKILL);
  });
  const auto t0 = Clock::now();
  absl::Status failed;
  int32_t done = 0;
  for (int i = 0; i < 2000 && failed.ok(); ++i) {
    std::vector<StepItem> items = {StepItem{2, 1, true}};
    if (done < 300) items.push_back(StepItem{1, std::min<int32_t>(64, 300 - done), done + 64 >= 300});
    auto r = leader->step(items);
    if (!r.ok()) {
      failed = r.status();
    } else if (done < 300) {
      done += std::min<int32_t>(64, 300 - done);
    }
  }
  killer.join();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  CHECK(s < 30);
  REQUIRE_FALSE(failed.ok());
  INFO(failed.ToString());
  CHECK_THAT(std::string(failed.message()), ContainsSubstring("rank 1"));
  CHECK(follower.wait(std::chrono::seconds(10)) == 128 + SIGKILL);
  // Rank 0 goes on answering, with errors, and at once.
  const auto t1 = Clock::now();
  auto later = leader->step({StepItem{2, 1, true}});
  CHECK(std::chrono::duration<double>(Clock::now() - t1).count() < 5);
  REQUIRE_FALSE(later.ok());
  CHECK(later.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(later.status().message()), ContainsSubstring("aborted"));
  CHECK(leader->add_sequence(3, prompt_of(5, 3, vocab), SamplingParams{}).ok());
  for (SeqId id : {SeqId(1), SeqId(2), SeqId(3)}) REQUIRE(leader->release(id).ok());
  CHECK(leader->pool().usage(PoolKind::full).used_pages == 0);
  REQUIRE(leader->pool().check_invariants().ok());
}

TEST_CASE(
    "tensor parallel across processes (cpu): a follower that fails mid-step says why and stops the group",
    "[tp][processes][errors]") {
  // tp 2 of one rank per process; tp 4 of two processes of two ranks, where the follower's
  // first rank (2) fails and its second must not hold the group up.
  for (const int local : {1, 2}) {
    DYNAMIC_SECTION(local << " rank(s) per process") {
      const int tp = 2 * local;
      const nlohmann::json keys =
          local == 1 ? kBase : with(kBase, {{"tensor_parallel", tp}, {"devices", "0,1"}});
      const int port = free_loopback_port();
      auto owned = std::make_unique<FailingAttentionBackend>();
      FailingAttentionBackend* failing = owned.get();
      FollowerThread follower(keys, port, local, std::move(owned));
      auto leader = make_leader(keys, port);
      REQUIRE(leader->add_sequence(1, prompt_of(20, 1, 1024), SamplingParams{}).ok());
      REQUIRE(leader->step({StepItem{1, 20, true}}).ok());
      // The collectives of another process, and a rank that is not 0 in calibration: refused.
      auto ms = leader->collectives_ms(2, 2);
      INFO(ms.status().ToString());
      CHECK(ms.ok());
      CHECK(measure_kv_amax(*leader, {prompt_of(8, 1, 1024)}).status().code() ==
            absl::StatusCode::kFailedPrecondition);

      failing->fail = true;
      const auto t0 = Clock::now();
      auto failed = leader->step({StepItem{1, 1, true}});
      CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 30);
      REQUIRE_FALSE(failed.ok());
      INFO(failed.status().ToString());
      CHECK(failed.status().code() == absl::StatusCode::kInternal);
      CHECK_THAT(std::string(failed.status().message()),
                 ContainsSubstring("rank " + std::to_string(local) + ": forward failed: injected device failure"));
      follower.join();
      CHECK_THAT(std::string(follower.followed.message()), ContainsSubstring("injected device failure"));
      auto later = leader->step({StepItem{1, 1, true}});
      CHECK(later.status().code() == absl::StatusCode::kFailedPrecondition);
      REQUIRE(leader->release(1).ok());
      CHECK(leader->pool().usage(PoolKind::full).used_pages == 0);
    }
  }
}

TEST_CASE(
    "tensor parallel across processes (cpu): a follower with another config is refused, naming both values",
    "[tp][processes][config]") {
  SECTION("weights and pool") {
    const int port = free_loopback_port();
    FollowerThread follower(with(kBase, {{"seed", 3}, {"kv_cache_dtype", "bf16"}}), port, 1);
    auto leader = Engine::create(config_of(group_keys(kBase, port, 0)));
    follower.join();
    REQUIRE_FALSE(leader.ok());
    const std::string msg(leader.status().message());
    CHECK(leader.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(
        msg, ContainsSubstring("rank 1 has weights=synthetic, seed 3, rank 0 has weights=synthetic, seed 0"));
    CHECK_THAT(msg,
               ContainsSubstring("rank 1 has kv_cache_dtype=bf16, rank 0 has kv_cache_dtype=fp8_e4m3fn"));
    REQUIRE_FALSE(follower.engine.ok());
    CHECK_THAT(std::string(follower.engine.status().message()),
               ContainsSubstring("rank 0 refused the group"));
  }
  SECTION("tensor_parallel") {
    const int port = free_loopback_port();
    FollowerThread follower(with(kBase, {{"tensor_parallel", 4}}), port, 1);
    auto leader = Engine::create(config_of(group_keys(kBase, port, 0)));
    follower.join();
    REQUIRE_FALSE(leader.ok());
    CHECK_THAT(std::string(leader.status().message()), ContainsSubstring("has world size 4, rank 0 has 2"));
    REQUIRE_FALSE(follower.engine.ok());
  }
  SECTION("ranks past the world") {
    // tp_rank 1 with two devices: ranks 1 and 2 of a group of 2.
    auto cfg = config_from_json(with(group_keys(kBase, free_loopback_port(), 1), {{"devices", "0,1"}}));
    REQUIRE_FALSE(cfg.ok());
    CHECK_THAT(std::string(cfg.status().message()), ContainsSubstring("go past tensor_parallel 2"));
  }
  SECTION("a follower does not run steps itself") {
    const int port = free_loopback_port();
    FollowerThread follower(kBase, port, 1);
    auto leader = make_leader(kBase, port);
    // The follower is in follow() now; its engine refuses steps of its own.
    leader.reset();
    follower.join();
    CHECK(follower.followed.ok());
    REQUIRE(follower.engine.ok());
    Engine& f = **follower.engine;
    CHECK(f.is_follower());
    REQUIRE(f.add_sequence(1, {1, 2, 3}, SamplingParams{}).ok());
    CHECK(f.step({StepItem{1, 3, true}}).status().code() == absl::StatusCode::kFailedPrecondition);
  }
}
