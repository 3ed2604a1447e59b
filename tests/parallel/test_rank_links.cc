// The control connections of a group across processes (src/runtime/rank_links.h) over a
// socket pair: what rank 0 records when a follower reports, dies, or sends what is not a
// report, and what a follower says once rank 0's connection closes.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include "tests/util/catch.h"

#include "src/runtime/rank_links.h"

using namespace kvfuse;
using Catch::Matchers::ContainsSubstring;
using std::chrono::milliseconds;

namespace {

// Rank 0's links to one follower (rank 1); `follower` is the follower's end.
struct Links {
  net::UniqueFd follower;
  std::atomic<int> failures{0};
  std::unique_ptr<FollowerLinks> links;

  Links() {
    int sv[2] = {-1, -1};
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    follower.reset(sv[1]);
    std::vector<net::UniqueFd> fds(2);
    fds[1].reset(sv[0]);
    links = std::make_unique<FollowerLinks>(std::move(fds), milliseconds(2000), [this] { ++failures; });
  }
  void send(const std::vector<uint8_t>& bytes) const {
    REQUIRE(
        net::send_all(follower.get(), bytes.data(), bytes.size(), net::Clock::now() + milliseconds(2000)));
  }
};

// A count that a callback bumps once, read after it had time to: up to 5 s for the first
// call, then 100 ms more for a second one that should not come.
int settled(const std::atomic<int>& count) {
  const auto end = std::chrono::steady_clock::now() + milliseconds(5000);
  while (count.load() == 0 && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(milliseconds(1));
  std::this_thread::sleep_for(milliseconds(100));
  return count.load();
}

// A frame header ("KVFUSECM", version 1, command, length) without its payload.
std::vector<uint8_t> header(RankCommand command, uint64_t length) {
  auto frame = rank_frame(command, {});
  net::put_u64(frame.data() + 16, length);
  return frame;
}

}  // namespace

TEST_CASE("rank links: a follower's error report reaches rank 0, its text cut short and quoted safely",
          "[parallel][rank_links]") {
  Links l;
  std::vector<uint8_t> payload(4);
  net::put_u32(payload.data(), uint32_t(absl::StatusCode::kResourceExhausted));
  const std::string text = "out of memory \x1b[31m\"red\"\n" + std::string(10000, 'x');
  payload.insert(payload.end(), text.begin(), text.end());
  l.send(rank_frame(RankCommand::error, payload));
  const absl::Status st = l.links->wait_failure(milliseconds(5000));
  CHECK(st.code() == absl::StatusCode::kResourceExhausted);
  const std::string msg(st.message());
  CHECK_THAT(msg, ContainsSubstring("rank 1: out of memory \\x1b[31m\\x22red\\x22\\x0axxx"));
  CHECK_THAT(msg, ContainsSubstring("... (10025 bytes)"));
  CHECK(msg.size() < 4200);
  // on_failure runs once, just after the failure is recorded (so a moment after the wait).
  CHECK(settled(l.failures) == 1);
}

TEST_CASE("rank links: a frame too large for a report is refused before its payload is read",
          "[parallel][rank_links]") {
  // 2 GiB announced: rank 0 neither allocates it nor waits for it.
  Links l;
  const auto t0 = std::chrono::steady_clock::now();
  l.send(header(RankCommand::error, uint64_t(1) << 31));
  const absl::Status st = l.links->wait_failure(milliseconds(5000));
  CHECK(std::chrono::steady_clock::now() - t0 < milliseconds(2000));
  INFO(st.ToString());
  CHECK(st.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(st.message()),
             ContainsSubstring("rank 1's control connection to rank 0 carried no valid report"));
  CHECK_THAT(std::string(st.message()),
             ContainsSubstring("a error command of 2147483648 bytes, over the 65536"));
}

TEST_CASE("rank links: bytes that are not a report are DATA_LOSS, not a follower that died",
          "[parallel][rank_links]") {
  SECTION("garbage") {
    Links l;
    l.send(std::vector<uint8_t>(32, 'G'));
    const absl::Status st = l.links->wait_failure(milliseconds(5000));
    CHECK(st.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(std::string(st.message()), ContainsSubstring("not a kvfuse rank command"));
    CHECK_THAT(std::string(st.message()), !ContainsSubstring("exited or was killed"));
  }
  SECTION("half a header, then nothing (the connection stays open)") {
    Links l;
    auto h = header(RankCommand::error, 8);
    h.resize(10);
    l.send(h);
    const absl::Status st = l.links->wait_failure(milliseconds(8000));
    CHECK(st.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(std::string(st.message()), ContainsSubstring("no message before the deadline"));
  }
  SECTION("a follower that goes away") {
    Links l;
    l.follower.reset();
    const absl::Status st = l.links->wait_failure(milliseconds(5000));
    CHECK(st.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(st.message()),
               ContainsSubstring(
                   "rank 1 closed its control connection to rank 0 (its process exited or was killed)"));
  }
}

TEST_CASE("rank links: a follower learns that rank 0's connection closed", "[parallel][rank_links]") {
  int sv[2] = {-1, -1};
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  net::UniqueFd leader(sv[0]);
  std::atomic<int> hangups{0};
  LeaderLink link(net::UniqueFd(sv[1]), "node0:29500", [&] { ++hangups; });
  CHECK(link.hangup(milliseconds(50)).ok());
  leader.reset();
  const absl::Status st = link.hangup(milliseconds(5000));
  CHECK(st.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(st.message()),
             ContainsSubstring("rank 0 at node0:29500 closed the control connection"));
  CHECK(settled(hangups) == 1);  // on_hangup runs just after the hang-up is recorded
  auto next = link.next();
  CHECK(next.status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("rank links: a follower already waiting for the hang-up wakes when rank 0's connection closes",
          "[parallel][rank_links]") {
  int sv[2] = {-1, -1};
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  net::UniqueFd leader(sv[0]);
  LeaderLink link(net::UniqueFd(sv[1]), "node0:29500", {});
  absl::Status st;
  const auto start = std::chrono::steady_clock::now();
  std::thread waiter([&] { st = link.hangup(milliseconds(60000)); });
  std::this_thread::sleep_for(milliseconds(20));
  leader.reset();
  waiter.join();
  // Woken by the watcher, not by the wait running out.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
  CHECK(st.code() == absl::StatusCode::kUnavailable);
}
