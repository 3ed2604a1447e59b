// The TCP communicator (ranks of a group across processes on the CPU backend), on
// localhost with one thread per rank: its all-reduce has the CPU communicator's bits, the
// other collectives move the right bytes, and a disagreement, an abort or a rank that
// leaves ends every rank's wait with an error.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>
#include "tests/util/catch.h"

#include "kernels/common/bf16.h"
#include "src/parallel/cpu_communicator.h"
#include "src/parallel/tcp_communicator.h"
#include "tests/util/free_port.h"

using namespace kvfuse;
using Catch::Matchers::ContainsSubstring;
using std::chrono::milliseconds;

namespace {

// `n` connected ranks (rank 0 accepts while the others connect).
std::vector<std::unique_ptr<TcpCommunicator>> make_group(int n, milliseconds timeout = milliseconds(10000)) {
  auto listener = TcpCommListener::open("127.0.0.1");
  REQUIRE(listener.ok());
  const RendezvousId id = (*listener)->id();
  std::vector<std::unique_ptr<TcpCommunicator>> comms(static_cast<size_t>(n));
  std::vector<std::thread> peers;
  for (int r = 1; r < n; ++r) {
    peers.emplace_back([&, r] {
      auto c = TcpCommunicator::connect("127.0.0.1", id, r, n, timeout);
      if (c.ok()) comms[size_t(r)] = std::move(*c);
    });
  }
  auto root = TcpCommunicator::accept(std::move(*listener), n, timeout);
  for (auto& t : peers) t.join();
  INFO(root.status().ToString());
  REQUIRE(root.ok());
  comms[0] = std::move(*root);
  for (const auto& c : comms) REQUIRE(c != nullptr);
  return comms;
}

// Runs f(rank) on one thread per rank; the statuses.
std::vector<absl::Status> on_every_rank(int n, const std::function<absl::Status(int)>& f) {
  std::vector<absl::Status> st(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { st[size_t(r)] = f(r); });
  for (auto& t : threads) t.join();
  return st;
}

}  // namespace

TEST_CASE("tcp communicator: all-reduce has the CPU communicator's bits, and gather, broadcast, barrier work",
          "[parallel][tcp]") {
  for (const int n : {2, 3}) {
    CAPTURE(n);
    auto comms = make_group(n);
    const int64_t count = 1000;
    std::mt19937 rng{static_cast<uint32_t>(n)};
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<std::vector<uint16_t>> bf(static_cast<size_t>(n), std::vector<uint16_t>(count));
    std::vector<std::vector<float>> f32(static_cast<size_t>(n), std::vector<float>(count));
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < count; ++i) {
        bf[size_t(r)][size_t(i)] = f32_to_bf16(dist(rng));
        f32[size_t(r)][size_t(i)] = dist(rng);
      }
    }
    std::vector<uint16_t> want_bf(count);
    std::vector<float> want_f32(count);
    std::vector<const uint16_t*> in_bf;
    std::vector<const float*> in_f32;
    for (int r = 0; r < n; ++r) {
      in_bf.push_back(bf[size_t(r)].data());
      in_f32.push_back(f32[size_t(r)].data());
    }
    reference_sum_bf16(in_bf, count, want_bf.data());
    reference_sum_f32(in_f32, count, want_f32.data());

    std::vector<std::vector<float>> gathered(static_cast<size_t>(n), std::vector<float>(size_t(n) * 4));
    std::vector<std::vector<uint8_t>> bcast(static_cast<size_t>(n), std::vector<uint8_t>(33));
    const auto st = on_every_rank(n, [&](int r) -> absl::Status {
      TcpCommunicator& c = *comms[size_t(r)];
      if (auto s = c.all_reduce_sum(bf[size_t(r)].data(), count, DType::bf16); !s.ok()) return s;
      if (auto s = c.all_reduce_sum(f32[size_t(r)].data(), count, DType::f32); !s.ok()) return s;
      float mine[4] = {float(r), float(r) + 0.5f, -float(r), 7.0f};
      if (auto s = c.all_gather(mine, gathered[size_t(r)].data(), 4, DType::f32); !s.ok()) return s;
      for (size_t i = 0; i < 33; ++i) bcast[size_t(r)][i] = uint8_t(r == n - 1 ? i * 3 : 0);
      if (auto s = c.broadcast(bcast[size_t(r)].data(), 33, n - 1); !s.ok()) return s;
      return c.barrier();
    });
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r << ": " << st[size_t(r)].ToString());
      REQUIRE(st[size_t(r)].ok());
      CHECK(std::memcmp(bf[size_t(r)].data(), want_bf.data(), count * 2) == 0);
      CHECK(std::memcmp(f32[size_t(r)].data(), want_f32.data(), count * 4) == 0);
      for (int k = 0; k < n; ++k) {
        CHECK(gathered[size_t(r)][size_t(k) * 4] == float(k));
        CHECK(gathered[size_t(r)][size_t(k) * 4 + 1] == float(k) + 0.5f);
      }
      for (size_t i = 0; i < 33; ++i) CHECK(bcast[size_t(r)][i] == uint8_t(i * 3));
    }
  }
}

TEST_CASE("tcp communicator: disagreement, abort and a departed rank end every wait with an error",
          "[parallel][tcp][errors]") {
  SECTION("ranks disagree") {
    auto comms = make_group(3);
    const auto st = on_every_rank(3, [&](int r) {
      std::vector<float> buf(16, 1.0f);
      return comms[size_t(r)]->all_reduce_sum(buf.data(), r == 2 ? 8 : 16, DType::f32);
    });
    for (const auto& s : st) {
      CHECK_FALSE(s.ok());
      CHECK_THAT(std::string(s.message()), ContainsSubstring("disagree"));
    }
    CHECK_THAT(std::string(st[0].message()), ContainsSubstring("rank 2 all_reduce_sum #0(count 8, f32)"));
  }
  SECTION("a rank aborts while the others wait") {
    auto comms = make_group(3, milliseconds(600000));
    const auto t0 = std::chrono::steady_clock::now();
    const auto st = on_every_rank(3, [&](int r) -> absl::Status {
      if (r == 1) {
        std::this_thread::sleep_for(milliseconds(100));
        comms[1]->abort();
        return absl::AbortedError("rank 1 aborted");
      }
      return comms[size_t(r)]->barrier();
    });
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 30);
    CHECK_FALSE(st[0].ok());
    CHECK_FALSE(st[2].ok());
    // Later calls fail at once.
    CHECK_FALSE(comms[0]->barrier().ok());
  }
  SECTION("a rank that leaves") {
    auto comms = make_group(2, milliseconds(600000));
    comms[1].reset();  // its connection closes, as when its process exits
    float x = 1.0f;
    const absl::Status s = comms[0]->all_reduce_sum(&x, 1, DType::f32);
    CHECK(s.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(s.message()), ContainsSubstring("rank 1 closed its connection"));
  }
  SECTION("a peer that waits longer than the timeout") {
    auto comms = make_group(2, milliseconds(200));
    float x = 1.0f;
    const absl::Status s = comms[1]->all_reduce_sum(&x, 1, DType::f32);  // rank 0 never comes
    CHECK(s.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK_THAT(std::string(s.message()), ContainsSubstring("waited 200 ms for rank 0"));
  }
}

TEST_CASE("tcp communicator: clients that connect and say nothing do not keep the group from forming",
          "[parallel][tcp][errors]") {
  // A port scanner, a stalled peer, or a flood of them, on rank 0's port while it waits for
  // the ranks: rank 0 reads the hellos together, so none of them delays a real rank, and
  // past 64 owing their hello the oldest is dropped.
  for (const int silent : {5, 200}) {
    CAPTURE(silent);
    auto listener = TcpCommListener::open("127.0.0.1");
    REQUIRE(listener.ok());
    const RendezvousId id = (*listener)->id();
    const int port = (*listener)->port();
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> root = absl::UnknownError("not run");
    std::thread accept([&] { root = TcpCommunicator::accept(std::move(*listener), 3, milliseconds(4000)); });
    std::vector<int> fds;
    for (int i = 0; i < silent; ++i) {
      // Some say a little of a hello (the magic, no token) and stop there.
      const int fd = testing::connect_loopback(port, i % 3 == 0 ? std::string("KVFUSETC") : std::string());
      if (fd >= 0) fds.push_back(fd);
    }
    CHECK(fds.size() > size_t(silent / 2));
    std::vector<std::unique_ptr<TcpCommunicator>> comms(3);
    std::vector<absl::Status> peer_st(3);
    std::vector<std::thread> peers;
    for (int r = 1; r < 3; ++r) {
      peers.emplace_back([&, r] {
        auto c = TcpCommunicator::connect("127.0.0.1", id, r, 3, milliseconds(4000));
        peer_st[size_t(r)] = c.status();
        if (c.ok()) comms[size_t(r)] = std::move(*c);
      });
    }
    for (auto& t : peers) t.join();
    accept.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    INFO(root.status().ToString() << " / " << peer_st[1].ToString() << " / " << peer_st[2].ToString());
    REQUIRE(root.ok());
    CHECK(peer_st[1].ok());
    CHECK(peer_st[2].ok());
    CHECK(s < 3.0);
    comms[0] = std::move(*root);
    const auto st = on_every_rank(3, [&](int r) { return comms[size_t(r)]->barrier(); });
    for (const auto& x : st) CHECK(x.ok());
    for (int fd : fds) ::close(fd);
  }
}

TEST_CASE("tcp communicator: an error report sent to rank 0 names the rank that sent it, quoted safely",
          "[parallel][tcp][errors]") {
  // Only rank 0 reports errors to the others: a peer that sends one to rank 0 is broken or
  // foreign, and its text is not trusted into logs as it is.
  auto listener = TcpCommListener::open("127.0.0.1");
  REQUIRE(listener.ok());
  const RendezvousId id = (*listener)->id();
  const int port = (*listener)->port();
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> root = absl::UnknownError("not run");
  std::thread accept([&] { root = TcpCommunicator::accept(std::move(*listener), 2, milliseconds(4000)); });
  // Rank 1's hello by hand: magic, the id's token, rank, size.
  std::vector<uint8_t> hello(24);
  std::memcpy(hello.data(), id.data(), 8);
  std::memcpy(hello.data() + 8, id.data() + 12, 8);
  net::put_u32(hello.data() + 16, 1);
  net::put_u32(hello.data() + 20, 2);
  const int fd = testing::connect_loopback(port, std::string(hello.begin(), hello.end()));
  REQUIRE(fd >= 0);
  accept.join();
  REQUIRE(root.ok());
  const std::string text = "disk on fire \x1b[2J";
  std::vector<uint8_t> head(32, 0);
  net::put_u32(head.data(), 5);  // the error op
  net::put_u64(head.data() + 8, text.size());
  head.insert(head.end(), text.begin(), text.end());
  REQUIRE(::send(fd, head.data(), head.size(), MSG_NOSIGNAL) == ssize_t(head.size()));
  const absl::Status st = (*root)->barrier();
  ::close(fd);
  CHECK(st.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(
      std::string(st.message()),
      ContainsSubstring("rank 1 sent an error report, which only rank 0 sends: disk on fire \\x1b[2J"));
}
