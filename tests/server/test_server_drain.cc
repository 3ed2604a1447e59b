// The kvfuse-server binary as a subprocess on a loopback port: SIGTERM and SIGINT
// drain gracefully (new work UNAVAILABLE, health NOT_SERVING, in-flight streams finish
// or end UNAVAILABLE once the grace period is over) and the process exits 0.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <sstream>

#include "tests/util/free_port.h"
#include "tests/util/test_server_util.h"

extern char** environ;

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

class ServerProcess {
 public:
  // `serves`: wait until it listens and serves (a tensor-parallel follower does neither).
  explicit ServerProcess(const std::vector<std::string>& extra, bool serves = true) {
    char tmpl[] = "/tmp/kvfuse-server-test-XXXXXX";
    const int fd = mkstemp(tmpl);
    REQUIRE(fd >= 0);
    close(fd);
    log_path_ = tmpl;
    std::vector<std::string> args = {KVFUSE_SERVER_BIN,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--metrics-port",
                                     "-1",
                                     "--device",
                                     "cpu",
                                     "--model",
                                     "tiny",
                                     "--num_pages",
                                     "512"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_path_.c_str(), O_WRONLY | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    // The child starts with no signals blocked and default actions, whatever the
    // test's threads have set.
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGTERM);
    sigaddset(&defaults, SIGINT);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    REQUIRE(posix_spawn(&pid_, argv[0], &fa, &attr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    if (!serves) return;

    // Wait for "event=listening ... port=N" and the engine to be warm.
    const auto end = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < end) {
      const std::string text = log();
      if (const auto at = text.find("event=listening"); port_ == 0 && at != std::string::npos) {
        const auto port_at = text.find(" port=", at);
        if (port_at != std::string::npos) port_ = std::atoi(text.c_str() + port_at + 6);
      }
      if (port_ != 0 && text.find("status=SERVING") != std::string::npos) break;
      REQUIRE(waitpid(pid_, nullptr, WNOHANG) == 0);  // still running
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(port_ != 0);
    channel_ = client::make_channel("127.0.0.1:" + std::to_string(port_));
    stub_ = v1::DecodeService::NewStub(channel_);
  }
  ~ServerProcess() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    unlink(log_path_.c_str());
  }

  std::string log() const {
    std::ifstream in(log_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  void signal(int sig) const { REQUIRE(kill(pid_, sig) == 0); }
  // Waits until the log holds `needle`; false after timeout_s or if the process exited.
  bool wait_log(const std::string& needle, double timeout_s) const {
    const auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (Clock::now() < end) {
      if (log().find(needle) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return log().find(needle) != std::string::npos;
  }
  // The exit status, or -1 if it is still running after timeout_s.
  int wait_exit(double timeout_s) {
    const auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (Clock::now() < end) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  bool serving() const {
    auto hs = grpc::health::v1::Health::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(in_seconds(2));
    grpc::health::v1::HealthCheckResponse resp;
    const grpc::Status st = hs->Check(&ctx, {}, &resp);
    return st.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  }
  v1::DecodeService::Stub& stub() { return *stub_; }

 private:
  std::string log_path_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
};

// A tp 2 group across two processes on the CPU, its rendezvous at 127.0.0.1:port: the
// arguments of the process of `rank` (1: the follower), then `extra`.
std::vector<std::string> tp2_args(int port, int rank, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> a = {"--set", "tensor_parallel=2", "--set",
                                "tp_rendezvous=127.0.0.1:" + std::to_string(port)};
  if (rank > 0) a.insert(a.end(), {"--set", "tp_rank=" + std::to_string(rank)});
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Starts `n` streams and returns once each has received a token.
std::vector<std::future<StreamResult>> start_streams(ServerProcess& p, int n, uint32_t max_tokens) {
  std::vector<std::future<StreamResult>> streams;
  std::vector<std::shared_ptr<std::promise<void>>> started;
  for (int i = 0; i < n; ++i) {
    auto first = std::make_shared<std::promise<void>>();
    started.push_back(first);
    streams.push_back(std::async(std::launch::async, [&p, i, max_tokens, first] {
      bool once = false;
      return generate(p.stub(), generate_request(test_prompt(i, 12), max_tokens), 60, [&](int) {
        if (!once) first->set_value(), once = true;
      });
    }));
  }
  for (auto& s : started) s->get_future().wait();
  return streams;
}

}  // namespace

TEST_CASE("kvfuse-server: SIGTERM refuses new work and lets in-flight streams finish, exit 0",
          "[server][drain]") {
  ServerProcess p({"--drain-grace-s", "30"});
  auto streams = start_streams(p, 6, 150);
  p.signal(SIGTERM);
  const auto end = Clock::now() + std::chrono::seconds(5);
  while (p.serving() && Clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  CHECK(!p.serving());
  const StreamResult late = generate(p.stub(), generate_request({1, 2, 3}, 3), 5);
  CHECK((late.status.error_code() == grpc::StatusCode::UNAVAILABLE));
  for (auto& s : streams) {
    const StreamResult r = s.get();
    CHECK(r.status.ok());
    CHECK(r.tokens.size() == 150);
    CHECK(r.finish == v1::FINISH_REASON_LENGTH);
  }
  CHECK(p.wait_exit(20) == 0);
  const std::string log = p.log();
  CHECK(log.find("event=signal signal=SIGTERM action=drain") != std::string::npos);
  CHECK(log.find("event=drain_done in_flight_left=0") != std::string::npos);
}

TEST_CASE("kvfuse-server: SIGINT past the grace period ends streams UNAVAILABLE, exit 0", "[server][drain]") {
  ServerProcess p({"--drain-grace-s", "0.3"});
  auto streams = start_streams(p, 4, 4000);
  p.signal(SIGINT);
  for (auto& s : streams) {
    const StreamResult r = s.get();
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
    CHECK(!r.tokens.empty());
  }
  CHECK(p.wait_exit(20) == 0);
}

TEST_CASE("kvfuse-server: a second signal cuts the drain short, exit 0", "[server][drain]") {
  ServerProcess p({"--drain-grace-s", "120"});
  auto streams = start_streams(p, 2, 4000);
  p.signal(SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = Clock::now();
  p.signal(SIGTERM);
  CHECK(p.wait_exit(20) == 0);
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 10);
  for (auto& s : streams) CHECK(s.get().status.error_code() == grpc::StatusCode::UNAVAILABLE);
  // The log counts the two streams the second signal cut, not the empty loop after.
  const std::string log = p.log();
  INFO(log);
  CHECK(log.find("event=drain_done in_flight_left=2 cut_short=true") != std::string::npos);
}

TEST_CASE(
    "kvfuse-server across processes: a follower process holds rank 1, and SIGTERM on rank 0 ends both with "
    "exit 0",
    "[server][drain][tp]") {
  const int port = free_loopback_port();
  ServerProcess follower(tp2_args(port, 1), /*serves=*/false);
  ServerProcess leader(tp2_args(port, 0));
  {
    grpc::ClientContext ctx;
    v1::GetInfoResponse info;
    REQUIRE(leader.stub().GetInfo(&ctx, {}, &info).ok());
    CHECK(info.tensor_parallel() == 2);
  }
  const StreamResult r = generate(leader.stub(), generate_request(test_prompt(0, 12), 16), 30);
  CHECK(r.status.ok());
  CHECK(r.tokens.size() == 16);
  leader.signal(SIGTERM);
  CHECK(leader.wait_exit(20) == 0);
  CHECK(follower.wait_exit(20) == 0);
  // A GPU list on the CPU backend is said to be unused (none is set here).
  CHECK(leader.log().find("event=config_unused key=devices") == std::string::npos);
  // Rank 0 says how the group reduces: the CPU ranks of two processes over TCP, no NCCL.
  CHECK(leader.log().find("event=collectives path=\"tcp\" library=\"none\"") != std::string::npos);
  // Both say when loading the weights begins and ends, rank 0 before it is ready.
  const std::string lead_log = leader.log();
  const size_t began = lead_log.find("event=loading_weights layers_done=0 layers=");
  const size_t loaded = lead_log.find("event=weights_loaded layers=");
  CHECK(began != std::string::npos);
  CHECK(loaded != std::string::npos);
  CHECK(began < loaded);
  CHECK(loaded < lead_log.find("event=engine_ready"));
  const std::string log = follower.log();
  INFO(log);
  CHECK(log.find("event=following rank=1 tensor_parallel=2") != std::string::npos);
  CHECK(log.find("event=weights_loaded layers=") != std::string::npos);
  CHECK(log.find("rank 0 shut the group down") != std::string::npos);
  CHECK(log.find("event=listening") == std::string::npos);
}

namespace {

// The process of `rank` in a tp 2 group whose other process never comes: once its log
// says `started`, SIGTERM ends it within 5 s with `exit_code`, though the rendezvous would
// wait 60 s, and the log says so.
void check_sigterm_while_the_group_forms(int rank, const std::string& started, int exit_code) {
  const int port = free_loopback_port();
  ServerProcess p(tp2_args(port, rank, {"--set", "tp_rendezvous_timeout_s=60"}), /*serves=*/false);
  REQUIRE(p.wait_log(started, 30));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto t0 = Clock::now();
  p.signal(SIGTERM);
  CHECK(p.wait_exit(10) == exit_code);
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 5);
  const std::string log = p.log();
  INFO(log);
  CHECK(log.find("event=signal signal=SIGTERM action=exit") != std::string::npos);
}

}  // namespace

TEST_CASE("kvfuse-server: SIGTERM while rank 0 waits for its tensor-parallel group exits at once, exit 0",
          "[server][drain][tp]") {
  // Nothing is admitted while the engine starts, so there is nothing to drain.
  check_sigterm_while_the_group_forms(0, "event=listening", 0);
}

TEST_CASE("kvfuse-server: SIGTERM while a follower waits for rank 0 ends it at once", "[server][drain][tp]") {
  check_sigterm_while_the_group_forms(1, "event=following", 128 + SIGTERM);
}

TEST_CASE(
    "kvfuse-server across processes: after a follower dies, calls fail FAILED_PRECONDITION and health is "
    "NOT_SERVING",
    "[server][drain][tp]") {
  const int port = free_loopback_port();
  ServerProcess follower(tp2_args(port, 1), /*serves=*/false);
  ServerProcess leader(tp2_args(port, 0));
  REQUIRE(generate(leader.stub(), generate_request(test_prompt(0, 12), 4), 30).status.ok());
  follower.signal(SIGKILL);
  CHECK(follower.wait_exit(10) == 128 + SIGKILL);
  // The group is gone for good: not a fault a retry on this server gets past.
  for (int i = 0; i < 2; ++i) {
    const StreamResult r = generate(leader.stub(), generate_request(test_prompt(i, 12), 4), 30);
    INFO(r.status.error_message());
    CHECK(r.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(r.status.error_message().find("rank 1") != std::string::npos);
  }
  CHECK_FALSE(leader.serving());
  leader.signal(SIGTERM);
  CHECK(leader.wait_exit(20) == 0);
}

TEST_CASE(
    "kvfuse-server across processes: a follower whose rank 0 dies mid-step says rank 0 went away, exit 1",
    "[server][drain][tp]") {
  const int port = free_loopback_port();
  ServerProcess follower(tp2_args(port, 1), /*serves=*/false);
  ServerProcess leader(tp2_args(port, 0));
  auto streams = start_streams(leader, 2, 4000);  // steps run back to back from here
  leader.signal(SIGKILL);
  CHECK(leader.wait_exit(10) == 128 + SIGKILL);
  CHECK(follower.wait_exit(20) == 1);
  for (auto& s : streams) CHECK_FALSE(s.get().status.ok());
  const std::string log = follower.log();
  INFO(log);
  CHECK(log.find("rank 0 at 127.0.0.1:" + std::to_string(port) + " closed the control connection") !=
        std::string::npos);
}

TEST_CASE("kvfuse-server: devices on the CPU backend is logged as unused", "[server][drain][tp]") {
  ServerProcess p({"--set", "tensor_parallel=2", "--set", "devices=5,7"});
  CHECK(p.serving());
  const std::string log = p.log();
  INFO(log);
  CHECK(log.find("event=config_unused key=devices") != std::string::npos);
  p.signal(SIGTERM);
  CHECK(p.wait_exit(20) == 0);
}
