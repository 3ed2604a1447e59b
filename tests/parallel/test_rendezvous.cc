// The TCP rendezvous of a tensor-parallel group across processes, on localhost with one
// thread per rank: the id reaches every rank, and a timeout, a duplicate rank, a wrong
// world size or a stray client each end with a clear error instead of a hang.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include "tests/util/catch.h"

#include "src/parallel/rendezvous.h"
#include "tests/util/free_port.h"

using namespace kvfuse;
using Catch::Matchers::ContainsSubstring;
using std::chrono::milliseconds;

namespace {

RendezvousId make_id(uint8_t seed) {
  RendezvousId id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = uint8_t(seed + i * 7);
  return id;
}

RendezvousOptions opts(int world, int rank, int port, milliseconds timeout = milliseconds(5000)) {
  RendezvousOptions o;
  o.address = "127.0.0.1:" + std::to_string(port);
  o.world_size = world;
  o.rank = rank;
  o.timeout = timeout;
  return o;
}

std::unique_ptr<RendezvousServer> listen_or_fail(int world, milliseconds timeout = milliseconds(5000)) {
  auto s = RendezvousServer::listen(opts(world, 0, 0, timeout));
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  REQUIRE((*s)->port() > 0);
  return std::move(*s);
}

// Rank 0 listening on a free port with a config fingerprint.
std::unique_ptr<RendezvousServer> listen_with_fingerprint(int world, const std::string& fingerprint) {
  RendezvousOptions o = opts(world, 0, 0);
  o.fingerprint = fingerprint;
  auto s = RendezvousServer::listen(o);
  REQUIRE(s.ok());
  return std::move(*s);
}

// A raw client that sends `bytes` and waits for the server to close.
void stray_client(int port, const std::string& bytes) {
  const int fd = testing::connect_loopback(port, bytes);
  if (fd < 0) return;
  char buf[64];
  while (::recv(fd, buf, sizeof buf, 0) > 0) {
  }
  ::close(fd);
}

// serve_group's connections (`fds`, rank 0's end) against what each rank's
// rendezvous_join_group got: every rank has `id`, and a byte rank 0 writes to rank r's
// connection is what rank r reads on its own.
void check_group_links(const absl::StatusOr<std::vector<net::UniqueFd>>& fds,
                       const std::vector<absl::StatusOr<RendezvousMember>>& got, const RendezvousId& id) {
  INFO(fds.status().ToString());
  REQUIRE(fds.ok());
  REQUIRE(fds->size() == got.size() + 1);
  CHECK_FALSE((*fds)[0].valid());
  for (size_t r = 1; r < fds->size(); ++r) {
    INFO("rank " << r << ": " << got[r - 1].status().ToString());
    REQUIRE(got[r - 1].ok());
    CHECK(got[r - 1]->id == id);
    const uint8_t byte = uint8_t(40 + r);
    REQUIRE(::send((*fds)[r].get(), &byte, 1, MSG_NOSIGNAL) == 1);
    uint8_t in = 0;
    CHECK(net::recv_all(got[r - 1]->leader.get(), &in, 1, net::Clock::now() + std::chrono::seconds(5)) ==
          net::RecvResult::ok);
    CHECK(in == byte);
  }
}

}  // namespace

TEST_CASE("rendezvous: every rank gets rank 0's id (2 and 4 ranks)", "[parallel][rendezvous]") {
  for (int world : {2, 4}) {
    CAPTURE(world);
    auto server = listen_or_fail(world);
    const int port = server->port();
    const RendezvousId id = make_id(uint8_t(world));
    std::vector<absl::StatusOr<RendezvousId>> got(size_t(world), absl::UnknownError("not run"));
    std::vector<std::thread> peers;
    // Peers start in reverse order: arrival order does not matter.
    for (int r = world - 1; r >= 1; --r) {
      peers.emplace_back([&, r] { got[size_t(r)] = rendezvous_join(opts(world, r, port)); });
    }
    const absl::Status served = server->serve(id);
    for (auto& t : peers) t.join();
    INFO(served.ToString());
    CHECK(served.ok());
    for (int r = 1; r < world; ++r) {
      INFO("rank " << r << ": " << got[size_t(r)].status().ToString());
      REQUIRE(got[size_t(r)].ok());
      CHECK(*got[size_t(r)] == id);
    }
  }
}

TEST_CASE("rendezvous: a peer that starts before rank 0 listens retries until it can connect",
          "[parallel][rendezvous]") {
  // A free port: bind one, note it, close it, then let rank 0 listen on it a little later.
  int port = 0;
  {
    auto probe = listen_or_fail(2);
    port = probe->port();
  }
  absl::StatusOr<RendezvousId> got = absl::UnknownError("not run");
  std::thread peer([&] { got = rendezvous_join(opts(2, 1, port)); });
  std::this_thread::sleep_for(milliseconds(200));
  auto id = rendezvous(opts(2, 0, port), [] { return absl::StatusOr<RendezvousId>(make_id(9)); });
  peer.join();
  INFO(id.status().ToString() << " / " << got.status().ToString());
  REQUIRE(id.ok());
  REQUIRE(got.ok());
  CHECK(*got == make_id(9));
}

TEST_CASE("rendezvous: a missing rank is DEADLINE_EXCEEDED naming the address and who arrived",
          "[parallel][rendezvous]") {
  auto server = listen_or_fail(4, milliseconds(300));
  const int port = server->port();
  absl::StatusOr<RendezvousId> got = absl::UnknownError("not run");
  std::thread peer([&] { got = rendezvous_join(opts(4, 2, port)); });
  const absl::Status st = server->serve(make_id(1));
  peer.join();
  CHECK(st.code() == absl::StatusCode::kDeadlineExceeded);
  const std::string msg(st.message());
  CHECK_THAT(msg, ContainsSubstring("127.0.0.1:0"));
  CHECK_THAT(msg, ContainsSubstring("port " + std::to_string(port)));
  CHECK_THAT(msg, ContainsSubstring("2 of 4 ranks arrived (0, 2)"));
  CHECK_THAT(msg, ContainsSubstring("missing rank(s) 1, 3"));
  // The rank that did come hears why instead of waiting for its own timeout.
  CHECK(got.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(got.status().message()), ContainsSubstring("rank 0 refused the group"));

  // Nobody listening at all: the peer's own timeout, naming the address.
  server.reset();
  auto alone = rendezvous_join(opts(2, 1, port, milliseconds(200)));
  CHECK(alone.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(alone.status().message()),
             ContainsSubstring("tp rendezvous at 127.0.0.1:" + std::to_string(port) + ": rank 1 of 2"));
}

TEST_CASE("rendezvous: a duplicate rank or a wrong world size fails every rank", "[parallel][rendezvous]") {
  SECTION("duplicate rank") {
    auto server = listen_or_fail(3);
    const int port = server->port();
    std::vector<absl::StatusOr<RendezvousId>> got(2, absl::UnknownError("not run"));
    std::vector<std::thread> peers;
    for (int i = 0; i < 2; ++i)
      peers.emplace_back([&, i] { got[size_t(i)] = rendezvous_join(opts(3, 1, port)); });
    const absl::Status st = server->serve(make_id(2));
    for (auto& t : peers) t.join();
    CHECK(st.code() == absl::StatusCode::kAlreadyExists);
    CHECK_THAT(std::string(st.message()), ContainsSubstring("rank 1 arrived twice"));
    for (const auto& g : got) {
      CHECK(g.status().code() == absl::StatusCode::kAlreadyExists);
      CHECK_THAT(std::string(g.status().message()), ContainsSubstring("rank 1 arrived twice"));
    }
  }
  SECTION("wrong world size") {
    auto server = listen_or_fail(3);
    const int port = server->port();
    absl::StatusOr<RendezvousId> ok_peer = absl::UnknownError("not run"),
                                 bad_peer = absl::UnknownError("not run");
    std::thread a([&] { ok_peer = rendezvous_join(opts(3, 1, port)); });
    std::this_thread::sleep_for(milliseconds(50));
    std::thread b([&] { bad_peer = rendezvous_join(opts(4, 2, port)); });
    const absl::Status st = server->serve(make_id(3));
    a.join();
    b.join();
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(st.message()), ContainsSubstring("rank 2 (a peer at 127.0.0.1:"));
    CHECK_THAT(std::string(st.message()), ContainsSubstring("has world size 4, rank 0 has 3"));
    CHECK(ok_peer.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(bad_peer.status().code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("rendezvous: a stray client without the magic is dropped and the group still forms",
          "[parallel][rendezvous]") {
  auto server = listen_or_fail(2);
  const int port = server->port();
  std::thread stray([&] { stray_client(port, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); });
  std::thread silent([&] { stray_client(port, ""); });  // connects and says nothing
  absl::StatusOr<RendezvousId> got = absl::UnknownError("not run");
  std::thread peer([&] {
    std::this_thread::sleep_for(milliseconds(100));
    got = rendezvous_join(opts(2, 1, port));
  });
  const absl::Status st = server->serve(make_id(4));
  peer.join();
  stray.join();
  silent.join();
  INFO(st.ToString() << " / " << got.status().ToString());
  CHECK(st.ok());
  REQUIRE(got.ok());
  CHECK(*got == make_id(4));
}

TEST_CASE("rendezvous: a process that leaves after its hello gives its ranks back, and may come again",
          "[parallel][rendezvous]") {
  // Rank 1's first process announces itself and goes away (its own wait ends first); a
  // restarted rank 1 then arrives with rank 2, and the group forms.
  auto server = listen_or_fail(3, milliseconds(15000));
  const int port = server->port();
  absl::StatusOr<RendezvousId> first = absl::UnknownError("not run"), again = first, two = first;
  std::thread t1([&] { first = rendezvous_join(opts(3, 1, port, milliseconds(500))); });
  std::thread rest([&] {
    t1.join();
    std::this_thread::sleep_for(milliseconds(200));
    std::thread t2([&] { two = rendezvous_join(opts(3, 2, port)); });
    again = rendezvous_join(opts(3, 1, port));
    t2.join();
  });
  const absl::Status st = server->serve(make_id(6));
  rest.join();
  INFO(st.ToString() << " / " << first.status().ToString() << " / " << again.status().ToString());
  CHECK(first.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(st.ok());
  REQUIRE(again.ok());
  REQUIRE(two.ok());
  CHECK(*again == make_id(6));
  CHECK(*two == make_id(6));
}

TEST_CASE("rendezvous: a flood of silent clients does not keep a rank out", "[parallel][rendezvous]") {
  // 200 clients connect while rank 0 waits and say nothing; past 64 owing their hello,
  // rank 0 drops the oldest. The real rank then arrives and the group forms.
  auto server = listen_or_fail(2);
  const int port = server->port();
  absl::Status st = absl::UnknownError("not run");
  std::thread serve([&] { st = server->serve(make_id(7)); });
  std::vector<int> fds;
  for (int i = 0; i < 200; ++i) {
    if (const int fd = testing::connect_loopback(port); fd >= 0) fds.push_back(fd);
  }
  CHECK(fds.size() > 100);
  const absl::StatusOr<RendezvousId> got = rendezvous_join(opts(2, 1, port));
  serve.join();
  for (int fd : fds) ::close(fd);
  INFO(st.ToString() << " / " << got.status().ToString());
  CHECK(st.ok());
  REQUIRE(got.ok());
  CHECK(*got == make_id(7));
}

TEST_CASE("rendezvous: a peer's fingerprint is quoted safely in the error", "[parallel][rendezvous]") {
  auto server = listen_with_fingerprint(2, "model=tiny");
  RendezvousOptions peer = opts(2, 1, server->port());
  peer.fingerprint = std::string("model=\x1b[2J\"quoted\"\n") + std::string(1000, 'x');
  std::thread t([&] { (void)rendezvous_join(peer); });
  const absl::Status st = server->serve(make_id(8));
  t.join();
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  const std::string msg(st.message());
  CHECK_THAT(msg, ContainsSubstring("rank 1 has model=\\x1b[2J\\x22quoted\\x22, rank 0 has model=tiny"));
  CHECK(msg.find('\x1b') == std::string::npos);
  CHECK_THAT(msg, ContainsSubstring("... (1001 bytes)"));
}

TEST_CASE("rendezvous: addresses and options are checked", "[parallel][rendezvous]") {
  CHECK(parse_host_port("node1:29500").ok());
  CHECK(parse_host_port("node1:29500")->first == "node1");
  CHECK(parse_host_port("[::1]:29500")->first == "::1");
  for (const char* bad : {"node1", "node1:", ":29500", "node1:70000", "node1:x", "::1:29500", "[::1]29500"}) {
    CAPTURE(bad);
    CHECK(parse_host_port(bad).status().code() == absl::StatusCode::kInvalidArgument);
  }
  CHECK(rendezvous_join(opts(2, 0, 1234)).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(rendezvous_join(opts(2, 2, 1234)).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(rendezvous_join(opts(2, 1, 0)).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(RendezvousServer::listen(opts(0, 0, 0)).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("rendezvous: a peer with another config fingerprint is refused, naming each key and both values",
          "[parallel][rendezvous]") {
  auto server = listen_with_fingerprint(2, "model=tiny\nnum_pages=64\npage_size=16");
  RendezvousOptions peer = opts(2, 1, server->port());
  peer.fingerprint = "model=llama3-8b\nnum_pages=64\npage_size=32";
  absl::StatusOr<RendezvousId> got = absl::UnknownError("not run");
  std::thread t([&] { got = rendezvous_join(peer); });
  const absl::Status st = server->serve(make_id(5));
  t.join();
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  const std::string msg(st.message());
  CHECK_THAT(msg, ContainsSubstring("rank 1 has model=llama3-8b, rank 0 has model=tiny"));
  CHECK_THAT(msg, ContainsSubstring("rank 1 has page_size=32, rank 0 has page_size=16"));
  CHECK_THAT(msg, !ContainsSubstring("num_pages"));
  CHECK_THAT(std::string(got.status().message()), ContainsSubstring("rank 1 has model=llama3-8b"));
}

TEST_CASE("rendezvous: serve_group and rendezvous_join_group keep each peer's connection open",
          "[parallel][rendezvous]") {
  auto server = listen_with_fingerprint(3, "model=tiny");
  std::vector<absl::StatusOr<RendezvousMember>> got;
  for (int i = 0; i < 2; ++i) got.emplace_back(absl::UnknownError("not run"));
  std::vector<std::thread> peers;
  for (int r = 1; r < 3; ++r) {
    peers.emplace_back([&, r] {
      RendezvousOptions o = opts(3, r, server->port());
      o.fingerprint = "model=tiny";
      got[size_t(r - 1)] = rendezvous_join_group(o);
    });
  }
  auto fds = server->serve_group(make_id(6));
  for (auto& t : peers) t.join();
  check_group_links(fds, got, make_id(6));
}

TEST_CASE("rendezvous: a storm of connections that come and go while ranks wait keeps each rank's link",
          "[parallel][rendezvous]") {
  // Ranks 1 and 2 arrive, 400 clients connect and close, then rank 3 arrives: rank 0 drops
  // the closed connections' records on the way and must still hand each arrived rank its
  // own connection.
  auto server = listen_with_fingerprint(4, "model=tiny");
  const int port = server->port();
  std::vector<absl::StatusOr<RendezvousMember>> got;
  for (int i = 0; i < 3; ++i) got.emplace_back(absl::UnknownError("not run"));
  auto join = [&](int r) {
    RendezvousOptions o = opts(4, r, port);
    o.fingerprint = "model=tiny";
    got[size_t(r - 1)] = rendezvous_join_group(o);
  };
  absl::StatusOr<std::vector<net::UniqueFd>> fds = absl::UnknownError("not run");
  std::thread serve([&] { fds = server->serve_group(make_id(9)); });
  std::vector<std::thread> peers;
  for (int r = 1; r < 3; ++r) peers.emplace_back(join, r);
  std::this_thread::sleep_for(milliseconds(200));
  for (int i = 0; i < 400; ++i) {
    if (const int fd = testing::connect_loopback(port, i % 2 == 0 ? "" : "GET / HTTP/1.0\r\n\r\n"); fd >= 0) {
      ::close(fd);
    }
  }
  peers.emplace_back(join, 3);
  serve.join();
  for (auto& t : peers) t.join();
  check_group_links(fds, got, make_id(9));
}

TEST_CASE("rendezvous: processes that hold several ranks form one world, every rank held once",
          "[parallel][rendezvous]") {
  // World 6: rank 0's process holds ranks 0 and 1, one peer 2..4, another 5.
  RendezvousOptions lo = opts(6, 0, 0);
  lo.ranks = 2;
  auto listened = RendezvousServer::listen(lo);
  REQUIRE(listened.ok());
  auto& server = *listened;
  const auto join = [&](int rank, int ranks) {
    RendezvousOptions o = opts(6, rank, server->port());
    o.ranks = ranks;
    return rendezvous_join_group(o);
  };
  SECTION("the group forms; one connection per process, at its first rank") {
    absl::StatusOr<RendezvousMember> a = absl::UnknownError("not run"), b = absl::UnknownError("not run");
    std::thread ta([&] { a = join(2, 3); });
    std::thread tb([&] { b = join(5, 1); });
    auto fds = server->serve_group(make_id(9));
    ta.join();
    tb.join();
    INFO(fds.status().ToString());
    REQUIRE(fds.ok());
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    CHECK(a->id == make_id(9));
    CHECK(b->id == make_id(9));
    REQUIRE(fds->size() == 6);
    for (int r = 0; r < 6; ++r) CHECK((*fds)[size_t(r)].valid() == (r == 2 || r == 5));
  }
  SECTION("a rank that rank 0's process holds is refused on every process") {
    absl::StatusOr<RendezvousMember> a = absl::UnknownError("not run");
    std::thread ta([&] { a = join(1, 2); });
    const absl::Status st = server->serve(make_id(9));
    ta.join();
    CHECK(st.code() == absl::StatusCode::kAlreadyExists);
    CHECK_THAT(std::string(st.message()), ContainsSubstring("rank 1 arrived twice (from rank 0's process and"));
    CHECK(a.status().code() == absl::StatusCode::kAlreadyExists);
  }
  SECTION("overlapping peers, and ranks past the world") {
    absl::StatusOr<RendezvousMember> a = absl::UnknownError("not run"), b = absl::UnknownError("not run");
    std::thread ta([&] { a = join(2, 3); });
    std::this_thread::sleep_for(milliseconds(50));
    std::thread tb([&] { b = join(4, 2); });
    const absl::Status st = server->serve(make_id(9));
    ta.join();
    tb.join();
    CHECK(st.code() == absl::StatusCode::kAlreadyExists);
    CHECK_THAT(std::string(st.message()), ContainsSubstring("rank 4 arrived twice"));
    CHECK(b.status().code() == absl::StatusCode::kAlreadyExists);
    // Ranks 5 and 6 of a world of 6: refused before anything is sent.
    RendezvousOptions o = opts(6, 5, server->port());
    o.ranks = 2;
    auto past = rendezvous_join_group(o);
    CHECK(past.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(past.status().message()), ContainsSubstring("2 rank(s) from rank 5 do not fit"));
  }
  SECTION("a missing process: the timeout names the ranks nobody holds") {
    RendezvousOptions so = opts(6, 0, 0, milliseconds(300));
    so.ranks = 2;
    auto short_server = RendezvousServer::listen(so);
    REQUIRE(short_server.ok());
    absl::StatusOr<RendezvousMember> a = absl::UnknownError("not run");
    std::thread ta([&] {
      RendezvousOptions o = opts(6, 2, (*short_server)->port(), milliseconds(2000));
      o.ranks = 3;
      a = rendezvous_join_group(o);
    });
    const absl::Status st = (*short_server)->serve(make_id(9));
    ta.join();
    CHECK(st.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK_THAT(std::string(st.message()), ContainsSubstring("5 of 6 ranks arrived (0, 1, 2, 3, 4)"));
    CHECK_THAT(std::string(st.message()), ContainsSubstring("missing rank(s) 5"));
  }
}
