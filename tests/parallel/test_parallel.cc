// Tensor-parallel foundation: the CPU communicator (ranks as threads; a deterministic
// rank-ordered all-reduce), the run-time NCCL loader (the names it tries, its errors), the
// shard shapes, and the engine's checks of tensor-parallel shapes (the sharded engine:
// test_tensor_parallel.cc).
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/socket.h>
#include <unistd.h>
#include "tests/util/catch.h"

#include "kernels/common/bf16.h"
#include "src/loading/model_spec.h"
#include "src/parallel/cpu_communicator.h"
#include "src/parallel/init_watch.h"
#include "src/parallel/nccl_api.h"
#include "src/parallel/socket_io.h"
#include "src/runtime/engine.h"

using namespace kvfuse;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::EndsWith;
using Catch::Matchers::StartsWith;

namespace {

// Runs fn(rank, comm) on `n` threads over one group; returns each rank's status.
std::vector<absl::Status> run_ranks(int n, const std::function<absl::Status(int, Communicator&)>& fn,
                                    std::chrono::milliseconds timeout = std::chrono::milliseconds::zero(),
                                    std::shared_ptr<CpuCommGroup>* group_out = nullptr) {
  auto group = CpuCommGroup::create(n, timeout);
  REQUIRE(group.ok());
  if (group_out != nullptr) *group_out = *group;
  std::vector<std::unique_ptr<CpuCommunicator>> comms;
  for (int r = 0; r < n; ++r) {
    auto c = CpuCommunicator::create(*group, r);
    REQUIRE(c.ok());
    comms.push_back(std::move(*c));
  }
  std::vector<absl::Status> status(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] { status[size_t(r)] = fn(r, *comms[size_t(r)]); });
  }
  for (auto& t : threads) t.join();
  return status;
}

void require_all_ok(const std::vector<absl::Status>& status) {
  for (size_t r = 0; r < status.size(); ++r) {
    INFO("rank " << r << ": " << status[r].ToString());
    REQUIRE(status[r].ok());
  }
}

// Values whose sum depends on the order: large and small magnitudes of both signs.
std::vector<float> values(int rank, int64_t n) {
  std::mt19937 rng(uint32_t(1234 + rank));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[size_t(i)] = dist(rng) * (i % 7 == 0 ? 3.0e4f : i % 5 == 0 ? 1.0e-3f : 1.0f);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

}  // namespace

TEST_CASE("cpu communicator: all_reduce_sum is the rank-ordered fp32 sum, identical on every rank",
          "[parallel][cpu_comm]") {
  for (int n : {1, 2, 3, 4}) {
    for (int64_t count : {int64_t(0), int64_t(1), int64_t(5), int64_t(1000), int64_t(4099)}) {
      CAPTURE(n, count);
      std::vector<std::vector<float>> f32(static_cast<size_t>(n));
      std::vector<std::vector<uint16_t>> bf16(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) {
        f32[size_t(r)] = values(r, count);
        bf16[size_t(r)] = to_bf16(values(r + 100, count));
      }
      std::vector<const float*> fin;
      std::vector<const uint16_t*> bin;
      for (int r = 0; r < n; ++r) {
        fin.push_back(f32[size_t(r)].data());
        bin.push_back(bf16[size_t(r)].data());
      }
      std::vector<float> want_f32(static_cast<size_t>(count));
      std::vector<uint16_t> want_bf16(static_cast<size_t>(count));
      reference_sum_f32(fin, count, want_f32.data());
      reference_sum_bf16(bin, count, want_bf16.data());
      // The reference really is rank order, fp32, one rounding (spot check).
      if (count > 0 && n > 1) {
        float acc = bf16_to_f32(bf16[0][0]);
        for (int r = 1; r < n; ++r) acc += bf16_to_f32(bf16[size_t(r)][0]);
        CHECK(want_bf16[0] == f32_to_bf16(acc));
      }
      auto got_f32 = f32;
      auto got_bf16 = bf16;
      require_all_ok(run_ranks(n, [&](int r, Communicator& c) {
        absl::Status st = c.all_reduce_sum(got_f32[size_t(r)].data(), count, DType::f32);
        if (!st.ok()) return st;
        // Twice on the same group: the scratch and the barriers are reused.
        return c.all_reduce_sum(got_bf16[size_t(r)].data(), count, DType::bf16);
      }));
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CHECK(std::memcmp(got_f32[size_t(r)].data(), want_f32.data(), size_t(count) * 4) == 0);
        CHECK(got_bf16[size_t(r)] == want_bf16);
      }
    }
  }
}

TEST_CASE("cpu communicator: the sum order is rank order (fp32 rounding shows it)", "[parallel][cpu_comm]") {
  // 1e8 + 1 - 1e8 is 0 in fp32 rank order, 1 in another order.
  std::vector<std::vector<float>> buf = {{1.0e8f}, {1.0f}, {-1.0e8f}};
  require_all_ok(run_ranks(
      3, [&](int r, Communicator& c) { return c.all_reduce_sum(buf[size_t(r)].data(), 1, DType::f32); }));
  for (const auto& b : buf) CHECK(b[0] == 0.0f);
  // -0 + -0 stays -0 (the sum starts from rank 0's value, not from +0).
  std::vector<std::vector<uint16_t>> z = {{0x8000}, {0x8000}};
  require_all_ok(run_ranks(
      2, [&](int r, Communicator& c) { return c.all_reduce_sum(z[size_t(r)].data(), 1, DType::bf16); }));
  CHECK(z[0][0] == 0x8000);
  CHECK(z[1][0] == 0x8000);
}

TEST_CASE("cpu communicator: all_gather and broadcast", "[parallel][cpu_comm]") {
  for (int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    const int64_t per = 37;
    std::vector<std::vector<float>> send(static_cast<size_t>(n)),
        recv(size_t(n), std::vector<float>(size_t(n * per), -1.0f));
    std::vector<std::vector<uint16_t>> inplace(size_t(n), std::vector<uint16_t>(size_t(n * per), 0));
    for (int r = 0; r < n; ++r) {
      send[size_t(r)] = values(r, per);
      for (int64_t i = 0; i < per; ++i) inplace[size_t(r)][size_t(r * per + i)] = uint16_t(r * 1000 + i);
    }
    std::vector<std::vector<uint8_t>> bc(size_t(n), std::vector<uint8_t>(100));
    for (int r = 0; r < n; ++r) std::fill(bc[size_t(r)].begin(), bc[size_t(r)].end(), uint8_t(r + 1));
    const int root = n - 1;
    require_all_ok(run_ranks(n, [&](int r, Communicator& c) {
      absl::Status st = c.all_gather(send[size_t(r)].data(), recv[size_t(r)].data(), per, DType::f32);
      if (st.ok()) {
        uint16_t* base = inplace[size_t(r)].data();
        st = c.all_gather(base + r * per, base, per, DType::bf16);
      }
      if (st.ok()) st = c.broadcast(bc[size_t(r)].data(), 100, root);
      if (st.ok()) st = c.barrier();
      return st;
    }));
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      for (int q = 0; q < n; ++q) {
        CHECK(std::memcmp(recv[size_t(r)].data() + q * per, send[size_t(q)].data(), size_t(per) * 4) == 0);
        for (int64_t i = 0; i < per; ++i)
          CHECK(inplace[size_t(r)][size_t(q * per + i)] == uint16_t(q * 1000 + i));
      }
      CHECK(bc[size_t(r)] == std::vector<uint8_t>(100, uint8_t(root + 1)));
    }
  }
}

TEST_CASE("cpu communicator: misuse is INVALID_ARGUMENT and the other ranks do not hang",
          "[parallel][cpu_comm]") {
  SECTION("a negative count on one rank") {
    std::vector<float> buf(8, 1.0f);
    auto st = run_ranks(
        3, [&](int r, Communicator& c) { return c.all_reduce_sum(buf.data(), r == 1 ? -1 : 8, DType::f32); });
    CHECK(st[1].code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(st[1].message()), ContainsSubstring("count -1 is negative"));
    // The others were waiting for rank 1: they get its error instead of hanging.
    for (int r : {0, 2}) {
      CHECK(st[size_t(r)].code() == absl::StatusCode::kInvalidArgument);
      CHECK_THAT(std::string(st[size_t(r)].message()), ContainsSubstring("aborted"));
    }
  }
  SECTION("a null buffer") {
    auto st = run_ranks(2, [&](int, Communicator& c) { return c.all_reduce_sum(nullptr, 4, DType::bf16); });
    for (const auto& s : st) CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(st[0].message()), ContainsSubstring("null buffer"));
  }
  SECTION("ranks that disagree on the count or the collective, then every later call fails") {
    std::vector<std::vector<float>> buf(2, std::vector<float>(16, 1.0f));
    std::vector<absl::Status> later(2);
    auto st = run_ranks(2, [&](int r, Communicator& c) {
      absl::Status s = c.all_reduce_sum(buf[size_t(r)].data(), r == 0 ? 16 : 8, DType::f32);
      later[size_t(r)] = c.barrier();
      return s;
    });
    for (int r = 0; r < 2; ++r) {
      CHECK(st[size_t(r)].code() == absl::StatusCode::kInvalidArgument);
      CHECK_THAT(std::string(st[size_t(r)].message()),
                 ContainsSubstring("rank 0 all_reduce_sum(count 16, f32)"));
      CHECK_THAT(std::string(st[size_t(r)].message()),
                 ContainsSubstring("rank 1 all_reduce_sum(count 8, f32)"));
      CHECK(later[size_t(r)].code() == absl::StatusCode::kInvalidArgument);
    }
    // Nothing was written.
    CHECK(buf[0] == std::vector<float>(16, 1.0f));
    auto st2 = run_ranks(2, [&](int r, Communicator& c) {
      return r == 0 ? c.broadcast(buf[0].data(), 4, 0) : c.all_reduce_sum(buf[1].data(), 1, DType::f32);
    });
    CHECK_THAT(std::string(st2[1].message()), ContainsSubstring("rank 0 broadcast(4 bytes, root 0)"));
  }
  SECTION("a broadcast root outside the group") {
    std::vector<uint8_t> b(4);
    auto st = run_ranks(2, [&](int, Communicator& c) { return c.broadcast(b.data(), 4, 2); });
    CHECK(st[0].code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(st[0].message()), ContainsSubstring("root 2 is outside [0, 2)"));
  }
  SECTION("groups and ranks that cannot exist") {
    CHECK(CpuCommGroup::create(0).status().code() == absl::StatusCode::kInvalidArgument);
    auto g = CpuCommGroup::create(2);
    REQUIRE(g.ok());
    CHECK(CpuCommunicator::create(*g, 2).status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(CpuCommunicator::create(nullptr, 0).status().code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("cpu communicator: abort unblocks ranks waiting for a rank that failed", "[parallel][cpu_comm]") {
  SECTION("the failing rank aborts its communicator") {
    std::vector<float> buf(4, 1.0f);
    auto st = run_ranks(4, [&](int r, Communicator& c) {
      if (r == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others are waiting by now
        c.abort();
        return absl::InternalError("rank 2 failed");
      }
      return c.all_reduce_sum(buf.data(), 4, DType::f32);
    });
    for (int r : {0, 1, 3}) {
      CHECK(st[size_t(r)].code() == absl::StatusCode::kAborted);
      CHECK_THAT(std::string(st[size_t(r)].message()), ContainsSubstring("aborted by rank 2"));
    }
  }
  SECTION("the group is aborted from outside, with a reason") {
    std::shared_ptr<CpuCommGroup> group;
    std::atomic<int> waiting{0};
    std::thread killer;
    auto st = run_ranks(
        3,
        [&](int r, Communicator& c) {
          if (r == 0) {
            killer = std::thread([&] {
              while (waiting.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
              group->abort(absl::CancelledError("server shutting down"));
            });
            return absl::OkStatus();  // rank 0 never joins
          }
          ++waiting;
          return c.barrier();
        },
        std::chrono::milliseconds::zero(), &group);
    killer.join();
    CHECK(st[1].code() == absl::StatusCode::kCancelled);
    CHECK(st[2].code() == absl::StatusCode::kCancelled);
    CHECK(group->poisoned().code() == absl::StatusCode::kCancelled);
  }
  SECTION("a rank that never comes: the timeout names it") {
    auto st = run_ranks(
        3, [&](int r, Communicator& c) { return r == 1 ? absl::OkStatus() : c.barrier(); },
        std::chrono::milliseconds(100));
    for (int r : {0, 2}) {
      CHECK(st[size_t(r)].code() == absl::StatusCode::kDeadlineExceeded);
      CHECK_THAT(std::string(st[size_t(r)].message()), ContainsSubstring("for rank(s) 1 of 3"));
    }
  }
}

TEST_CASE("nccl loader: a library that is not there is FAILED_PRECONDITION naming it and dlerror",
          "[parallel][nccl]") {
  const char* old = std::getenv("KVFUSE_NCCL_LIBRARY");
  const std::string saved = old != nullptr ? old : "";
  setenv("KVFUSE_NCCL_LIBRARY", "/nonexistent/libkvfuse-no-nccl.so.2", 1);
  CHECK(nccl::NcclLibrary::candidates() == std::vector<std::string>{"/nonexistent/libkvfuse-no-nccl.so.2"});
  auto lib = nccl::NcclLibrary::load();
  if (old != nullptr) {
    setenv("KVFUSE_NCCL_LIBRARY", saved.c_str(), 1);
  } else {
    unsetenv("KVFUSE_NCCL_LIBRARY");
  }
  REQUIRE_FALSE(lib.ok());
  CHECK(lib.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string msg(lib.status().message());
  CHECK_THAT(msg, ContainsSubstring("'/nonexistent/libkvfuse-no-nccl.so.2' cannot be loaded"));
  CHECK_THAT(msg, ContainsSubstring("No such file or directory"));  // dlerror's words
  CHECK_THAT(msg, ContainsSubstring("KVFUSE_NCCL_LIBRARY"));

  // A library that loads but is not NCCL: the missing symbol is named.
  auto not_nccl = nccl::NcclLibrary::load("libm.so.6");
  REQUIRE_FALSE(not_nccl.ok());
  CHECK(not_nccl.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(not_nccl.status().message()), ContainsSubstring("lacks ncclGetVersion"));

  CHECK(std::string(nccl::default_nccl_library()) == std::string(
#if defined(KVFUSE_HIP)
                                                         "librccl.so.1"
#else
                                                         "libnccl.so.2"
#endif
                                                         ));
}

TEST_CASE("nccl loader: the names tried, RCCL in ROCm's folders after the loader's path",
          "[parallel][nccl]") {
  using V = std::vector<std::string>;
  CHECK(nccl::library_candidates(nullptr, nullptr, false) == V{"libnccl.so.2"});
  CHECK(nccl::library_candidates("", "/opt/rocm-7.0.0", false) == V{"libnccl.so.2"});
  CHECK(nccl::library_candidates(nullptr, nullptr, true) == V{"librccl.so.1", "/opt/rocm/lib/librccl.so.1"});
  CHECK(nccl::library_candidates(nullptr, "/opt/rocm-7.0.0/", true) ==
        V{"librccl.so.1", "/opt/rocm-7.0.0/lib/librccl.so.1", "/opt/rocm/lib/librccl.so.1"});
  CHECK(nccl::library_candidates(nullptr, "/opt/rocm", true) ==
        V{"librccl.so.1", "/opt/rocm/lib/librccl.so.1"});
  // KVFUSE_NCCL_LIBRARY is the only name tried when set.
  CHECK(nccl::library_candidates("/x/librccl.so.1", "/opt/rocm-7.0.0", true) == V{"/x/librccl.so.1"});
}

TEST_CASE("nccl loader: the first name that loads wins - when none does, each is named", "[parallel][nccl]") {
  // A stand-in library (tests/util/fake_nccl.cc) at ROCm's layout under a fresh folder, as
  // ROCM_PATH would name it.
  const std::filesystem::path rocm =
      std::filesystem::temp_directory_path() / ("kvfuse-fake-rocm-" + std::to_string(::getpid()));
  std::filesystem::create_directories(rocm / "lib");
  const std::filesystem::path fake = rocm / "lib" / "librccl.so.1";
  std::filesystem::copy_file(KVFUSE_FAKE_NCCL_PATH, fake, std::filesystem::copy_options::overwrite_existing);
  struct Cleanup {
    std::filesystem::path dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{rocm};

  auto names = nccl::library_candidates(nullptr, rocm.c_str(), true);
  REQUIRE(names.size() == 3);
  CHECK(names[1] == fake.string());
  // The loader's path may hold a real RCCL; a name that cannot load takes the soname's place.
  names[0] = "/nonexistent/librccl.so.1";
  auto lib = nccl::NcclLibrary::load_first(names);
  REQUIRE(lib.ok());
  CHECK((*lib)->path == fake.string());
  CHECK((*lib)->version == 22809);
  CHECK((*lib)->version_string() == "2.28.9");
  CHECK(std::string((*lib)->flavour()) == "rccl");
  CHECK((*lib)->description() == "rccl 2.28.9 (" + fake.string() + ")");
  CHECK((*lib)->comm_init_all == nullptr);  // optional, and the stand-in lacks it
  CHECK((*lib)->bounded_init());            // it has ncclCommInitRankConfig and ncclCommSplit
  nccl::ncclUniqueId id{};
  const absl::Status st = (*lib)->check((*lib)->get_unique_id(&id), "ncclGetUniqueId");
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(st.message()), ContainsSubstring("rccl error in ncclGetUniqueId: 5"));
  CHECK_THAT(std::string(st.message()), ContainsSubstring("not a real library"));
  // The library's last warning follows the code's text, its newline gone.
  REQUIRE((*lib)->get_last_error != nullptr);
  CHECK_THAT(std::string(st.message()),
             EndsWith("; rccl's last warning: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device "
                      "1b000 (kvfuse fake NCCL)"));
  // Loaded once: the same entry for the same name.
  auto again = nccl::NcclLibrary::load(fake.string());
  REQUIRE(again.ok());
  CHECK(*again == *lib);

  auto none = nccl::NcclLibrary::load_first({"/nonexistent/a/librccl.so.1", "/nonexistent/b/librccl.so.1"});
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string msg(none.status().message());
  CHECK_THAT(msg, ContainsSubstring("'/nonexistent/a/librccl.so.1' cannot be loaded"));
  CHECK_THAT(msg, ContainsSubstring("'/nonexistent/b/librccl.so.1' cannot be loaded"));
  CHECK_THAT(msg, ContainsSubstring("KVFUSE_NCCL_LIBRARY"));
  CHECK_FALSE(nccl::NcclLibrary::load_first({}).ok());
}

TEST_CASE("nccl api: our declarations carry nccl.h's values", "[parallel][nccl]") {
  CHECK(sizeof(nccl::ncclUniqueId) == 128);
  CHECK(int(nccl::ncclFloat32) == 7);
  CHECK(int(nccl::ncclBfloat16) == 9);
  CHECK(int(nccl::ncclSum) == 0);
  nccl::NcclLibrary lib;
  lib.version = 21903;
  CHECK(lib.version_string() == "2.19.3");
  lib.version = 2708;  // before 2.9: X*1000 + Y*100 + Z
  CHECK(lib.version_string() == "2.7.8");

  // check(): the code's text, then the last warning where the library has ncclGetLastError
  // (NCCL >= 2.13), cut and escaped; an empty one adds nothing.
  lib.path = "libnccl.so.2";
  lib.get_error_string = [](nccl::ncclResult_t) {
    return "invalid usage (run with NCCL_DEBUG=WARN for details)";
  };
  CHECK(lib.check(nccl::ncclSuccess, "ncclAllReduce").ok());
  absl::Status st = lib.check(nccl::ncclInvalidUsage, "ncclCommInitRank");
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK(st.message() ==
        "nccl error in ncclCommInitRank: 5 (invalid usage (run with NCCL_DEBUG=WARN for details))");
  static std::string warning;
  lib.get_last_error = [](nccl::ncclComm_t) { return warning.c_str(); };
  warning = "  \n";
  CHECK(lib.check(nccl::ncclInvalidUsage, "ncclCommInitRank").message() ==
        "nccl error in ncclCommInitRank: 5 (invalid usage (run with NCCL_DEBUG=WARN for details))");
  warning = "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000\n";
  CHECK(
      lib.check(nccl::ncclInvalidUsage, "ncclCommInitRank").message() ==
      "nccl error in ncclCommInitRank: 5 (invalid usage (run with NCCL_DEBUG=WARN for details)); nccl's last "
      "warning: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000");
  warning = std::string(3000, 'w') + "\x01";
  st = lib.check(nccl::ncclSystemError, "ncclAllReduce");
  CHECK(st.code() == absl::StatusCode::kUnavailable);
  CHECK(st.message().size() < 1300);
  CHECK_THAT(std::string(st.message()), ContainsSubstring("(3001 bytes)"));
}

namespace {

// A scripted NCCL for init_rank(): the set-up of a non-blocking communicator is "in
// progress" for `polls` calls of ncclCommGetAsyncError (for ever when negative), then
// ends in `final_state`; every call is counted. Plain functions over one global state, as
// NcclLibrary holds function pointers.
struct ScriptedNccl {
  int polls = 0;
  nccl::ncclResult_t final_state = nccl::ncclSuccess;
  int left = 0;                               // polls left of the set-up under way
  nccl::ncclComm_t* pending_child = nullptr;  // ncclCommSplit's out-parameter, written when done
  int init_config = 0, split = 0, destroy = 0, abort = 0, get_async = 0, plain_init = 0;
  bool bad_config = false;
};
ScriptedNccl g_script;
nccl::ncclComm_t fake_comm(uintptr_t n) { return reinterpret_cast<nccl::ncclComm_t>(n); }

nccl::NcclLibrary scripted_library(int polls, nccl::ncclResult_t final_state) {
  g_script = ScriptedNccl{};
  g_script.polls = polls;
  g_script.final_state = final_state;
  nccl::NcclLibrary lib;
  lib.path = "libnccl.so.2";
  lib.version = 22809;
  lib.get_error_string = [](nccl::ncclResult_t) { return "scripted"; };
  lib.comm_init_rank = [](nccl::ncclComm_t* c, int, nccl::ncclUniqueId, int) {
    ++g_script.plain_init;
    *c = fake_comm(0x30);
    return nccl::ncclSuccess;
  };
  lib.comm_init_rank_config = [](nccl::ncclComm_t* c, int, nccl::ncclUniqueId, int, nccl::ncclConfig* cfg) {
    ++g_script.init_config;
    // NCCL refuses a config not made by NCCL_CONFIG_INITIALIZER (its magic and version).
    if (cfg == nullptr || cfg->magic != 0xcafebeef || cfg->version != 21400 ||
        cfg->size != sizeof(nccl::ncclConfig) || cfg->blocking != 0) {
      g_script.bad_config = true;
      return nccl::ncclInvalidArgument;
    }
    *c = fake_comm(0x10);
    g_script.left = g_script.polls;
    return nccl::ncclInProgress;
  };
  lib.comm_split = [](nccl::ncclComm_t parent, int color, int, nccl::ncclComm_t* child,
                      nccl::ncclConfig* cfg) {
    ++g_script.split;
    if (parent != fake_comm(0x10) || color != 0 || cfg == nullptr || cfg->magic != 0xcafebeef ||
        cfg->blocking != 1) {
      g_script.bad_config = true;
      return nccl::ncclInvalidArgument;
    }
    *child = nullptr;  // as NCCL: written when the split is done
    g_script.pending_child = child;
    g_script.left = g_script.polls;
    return nccl::ncclInProgress;
  };
  lib.comm_get_async_error = [](nccl::ncclComm_t, nccl::ncclResult_t* state) {
    ++g_script.get_async;
    if (g_script.left != 0) {
      if (g_script.left > 0) --g_script.left;
      *state = nccl::ncclInProgress;
      return nccl::ncclSuccess;
    }
    *state = g_script.final_state;
    if (*state == nccl::ncclSuccess && g_script.pending_child != nullptr) {
      *g_script.pending_child = fake_comm(0x20);
      g_script.pending_child = nullptr;
    }
    return nccl::ncclSuccess;
  };
  lib.comm_destroy = [](nccl::ncclComm_t) {
    ++g_script.destroy;
    return nccl::ncclSuccess;
  };
  lib.comm_abort = [](nccl::ncclComm_t) {
    ++g_script.abort;
    return nccl::ncclSuccess;
  };
  return lib;
}

nccl::InitWatch watch_for(std::chrono::milliseconds timeout) {
  nccl::InitWatch w;
  w.deadline = std::chrono::steady_clock::now() + timeout;
  return w;
}

}  // namespace

TEST_CASE("nccl set-up: non-blocking init polled to the end, then split into a blocking communicator",
          "[parallel][nccl]") {
  const nccl::NcclLibrary lib = scripted_library(/*polls=*/5, nccl::ncclSuccess);
  REQUIRE(lib.bounded_init());
  auto comms = lib.init_rank(nccl::ncclUniqueId{}, 1, 2, watch_for(std::chrono::seconds(30)));
  REQUIRE(comms.ok());
  CHECK_FALSE(g_script.bad_config);
  CHECK(comms->parent == fake_comm(0x10));
  CHECK(comms->comm == fake_comm(0x20));  // the split's child, not the non-blocking parent
  CHECK(g_script.init_config == 1);
  CHECK(g_script.split == 1);
  CHECK(g_script.get_async == 12);  // 5 in progress + 1 done, twice
  CHECK(g_script.abort == 0);
  // Release: the child destroyed, the parent (never used for a collective) aborted.
  lib.release(*comms, /*comm_aborted=*/false);
  CHECK(g_script.destroy == 1);
  CHECK(g_script.abort == 1);
  CHECK(comms->comm == nullptr);
  CHECK(comms->parent == nullptr);
  // A child already aborted is not destroyed again.
  nccl::RankComms aborted{fake_comm(0x20), fake_comm(0x10)};
  lib.release(aborted, /*comm_aborted=*/true);
  CHECK(g_script.destroy == 1);
  CHECK(g_script.abort == 2);
}

TEST_CASE("nccl set-up: a rank that never joins is DEADLINE_EXCEEDED in bounded time, the set-up aborted",
          "[parallel][nccl]") {
  const nccl::NcclLibrary lib = scripted_library(/*polls=*/-1, nccl::ncclSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  auto comms = lib.init_rank(nccl::ncclUniqueId{}, 0, 2, watch_for(std::chrono::milliseconds(300)));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE_FALSE(comms.ok());
  CHECK(comms.status().code() == absl::StatusCode::kDeadlineExceeded);
  const std::string msg(comms.status().message());
  CHECK_THAT(msg, ContainsSubstring("nccl set-up (ncclCommInitRankConfig) of rank 0 of 2 did not finish"));
  CHECK_THAT(msg, ContainsSubstring("never joined"));
  CHECK(waited >= 0.29);
  CHECK(waited < 10);
  CHECK(g_script.abort == 1);  // the set-up under way stopped
  CHECK(g_script.split == 0);
}

TEST_CASE("nccl set-up: a failed peer stops the wait with its reason, and NCCL's own error is named",
          "[parallel][nccl]") {
  SECTION("the peers check fails during the init") {
    const nccl::NcclLibrary lib = scripted_library(-1, nccl::ncclSuccess);
    nccl::InitWatch w = watch_for(std::chrono::seconds(60));
    int asked = 0;
    w.peers = [&asked]() -> absl::Status {
      if (++asked < 3) return absl::OkStatus();
      return absl::UnavailableError("rank 1's process closed its connection");
    };
    const auto t0 = std::chrono::steady_clock::now();
    auto comms = lib.init_rank(nccl::ncclUniqueId{}, 0, 2, w);
    REQUIRE_FALSE(comms.ok());
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
    CHECK(comms.status().code() == absl::StatusCode::kUnavailable);
    CHECK(comms.status().message() ==
          "nccl set-up (ncclCommInitRankConfig) of rank 0 of 2 stopped: rank 1's process closed its "
          "connection");
    CHECK(asked == 3);
    CHECK(g_script.abort == 1);
  }
  SECTION("the peers check fails during the split") {
    const nccl::NcclLibrary lib = scripted_library(2, nccl::ncclSuccess);
    nccl::InitWatch w = watch_for(std::chrono::seconds(60));
    w.peers = []() -> absl::Status {
      if (g_script.split == 0) return absl::OkStatus();
      return absl::UnavailableError("rank 1 failed: out of memory");
    };
    auto comms = lib.init_rank(nccl::ncclUniqueId{}, 0, 2, w);
    REQUIRE_FALSE(comms.ok());
    CHECK_THAT(std::string(comms.status().message()),
               ContainsSubstring("(ncclCommSplit) of rank 0 of 2 stopped"));
    CHECK(g_script.abort == 1);  // the parent, which stops the split
  }
  SECTION("NCCL reports an error of the set-up") {
    const nccl::NcclLibrary lib = scripted_library(1, nccl::ncclRemoteError);
    auto comms = lib.init_rank(nccl::ncclUniqueId{}, 1, 4, watch_for(std::chrono::seconds(60)));
    REQUIRE_FALSE(comms.ok());
    CHECK(comms.status().code() == absl::StatusCode::kUnavailable);
    CHECK(comms.status().message() == "nccl error in ncclCommInitRankConfig: 6 (scripted) (rank 1 of 4)");
    CHECK(g_script.abort == 1);
  }
  SECTION("a library without ncclCommInitRankConfig or ncclCommSplit: ncclCommInitRank, unbounded") {
    nccl::NcclLibrary lib = scripted_library(-1, nccl::ncclSuccess);
    lib.comm_split = nullptr;
    CHECK_FALSE(lib.bounded_init());
    auto comms = lib.init_rank(nccl::ncclUniqueId{}, 0, 1, watch_for(std::chrono::seconds(60)));
    REQUIRE(comms.ok());
    CHECK(comms->comm == fake_comm(0x30));
    CHECK(comms->parent == nullptr);
    CHECK(g_script.plain_init == 1);
    CHECK(g_script.init_config == 0);
  }
}

TEST_CASE("group init watch: a local rank's failure and a closed connection stop the other ranks' wait",
          "[parallel][nccl]") {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  net::UniqueFd mine(sv[0]), theirs(sv[1]);
  GroupInitWatch watch(std::chrono::seconds(60), {{mine.get(), "rank 1's process"}});
  CHECK(watch.check(0).ok());
  // Data waiting on the connection is not a close, and is left unread.
  const char byte = 'x';
  REQUIRE(::send(theirs.get(), &byte, 1, 0) == 1);
  CHECK_FALSE(net::peer_closed(mine.get()));
  CHECK(watch.for_rank(0).peers().ok());
  // A failure of this process's rank 1 is seen by rank 0, not by rank 1 itself.
  // failed() returns the status as given; only the first failure is kept.
  CHECK(watch.failed(1, absl::InternalError("cudaMalloc: out of memory")).message() ==
        "cudaMalloc: out of memory");
  CHECK(watch.failed(0, absl::UnavailableError("an echo")).code() == absl::StatusCode::kUnavailable);
  CHECK(watch.failed(0, absl::OkStatus()).ok());
  CHECK(watch.check(1).ok());
  const absl::Status st = watch.check(0);
  CHECK(st.code() == absl::StatusCode::kInternal);
  CHECK(st.message() == "rank 1 failed: cudaMalloc: out of memory");
  // A closed connection.
  GroupInitWatch peers_only(std::chrono::seconds(60), {{mine.get(), "rank 1's process"}});
  CHECK(peers_only.check(0).ok());
  theirs.reset();
  CHECK(net::peer_closed(mine.get()));
  const absl::Status closed = peers_only.for_rank(0).peers();
  CHECK(closed.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(closed.message()), StartsWith("rank 1's process closed its connection"));
  char got = 0;
  CHECK(::recv(mine.get(), &got, 1, 0) == 1);  // the byte sent before the close is still there
  CHECK(got == 'x');
}

TEST_CASE("tensor parallel shapes: heads and the MLP must divide, the vocabulary is padded",
          "[parallel][tp]") {
  auto llama = model_preset("llama3-8b");
  REQUIRE(llama.ok());
  for (int tp : {1, 2, 4, 8}) CHECK(check_tensor_parallel(*llama, tp).ok());
  auto shard = tensor_parallel_shard(*llama, 8);
  REQUIRE(shard.ok());
  CHECK(shard->num_q_heads == 4);
  CHECK(shard->num_kv_heads == 1);
  CHECK(shard->intermediate == 1792);
  CHECK(shard->padded_vocab == 128256);
  CHECK(shard->vocab == 16032);

  // 16 ranks over llama3-8b's 8 KV heads: each KV head on two ranks, one per rank.
  shard = tensor_parallel_shard(*llama, 16);
  REQUIRE(shard.ok());
  CHECK(shard->num_q_heads == 2);
  CHECK(shard->num_kv_heads == 1);
  CHECK(shard->kv_replicas == 2);
  for (int32_t r = 0; r < 16; ++r) {
    // Rank r's query heads 2r, 2r + 1 read KV head (2r) / 4 (GQA 32:8).
    CHECK(shard->kv_head_begin(r) == shard->q_head_begin(r) / 4);
  }
  // 12 neither divides the 8 KV heads nor is a multiple of them; 32 query heads do not divide.
  absl::Status st = check_tensor_parallel(*llama, 12);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(st.message()),
             ContainsSubstring("num_q_heads 32, num_kv_heads 8, intermediate 14336"));

  auto tiny = model_preset("tiny");  // 4 q heads, 2 KV heads, intermediate 768, vocab 1024
  REQUIRE(tiny.ok());
  st = check_tensor_parallel(*tiny, 3);
  CHECK_THAT(std::string(st.message()), ContainsSubstring("num_q_heads 4, num_kv_heads 2"));
  CHECK_THAT(std::string(st.message()), !ContainsSubstring("intermediate"));
  CHECK_THAT(std::string(st.message()), !ContainsSubstring("vocab 1024"));
  ModelSpec odd = *tiny;
  odd.intermediate = 770;
  odd.vocab = 1001;
  st = check_tensor_parallel(odd, 4);
  CHECK_THAT(std::string(st.message()), ContainsSubstring("intermediate 770"));
  CHECK_THAT(std::string(st.message()), !ContainsSubstring("num_kv_heads"));  // 4 ranks over 2: replicated
  odd.num_kv_heads = 4;
  odd.intermediate = 768;
  shard = tensor_parallel_shard(odd, 4);
  REQUIRE(shard.ok());
  CHECK(shard->padded_vocab == 1004);
  CHECK(shard->vocab == 251);
  CHECK(check_tensor_parallel(*tiny, 0).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("engine: tensor_parallel shapes are checked at start, with the whole shape in the message",
          "[parallel][engine]") {
  nlohmann::json j = {{"model", "tiny"}, {"device", "cpu"}, {"num_pages", 64}, {"tensor_parallel", 3}};
  auto cfg = config_from_json(j);
  REQUIRE(cfg.ok());
  auto e = Engine::create(*cfg);
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(e.status().message()), ContainsSubstring("num_q_heads 4, num_kv_heads 2"));
  // Across processes (tests/parallel/test_tp_processes.cc): a rank whose rank 0 never comes says
  // where it looked, once its rendezvous timeout has passed.
  j["tensor_parallel"] = 2;
  j["tp_rendezvous"] = "127.0.0.1:1";
  j["tp_rank"] = 1;
  j["tp_rendezvous_timeout_s"] = 1;
  cfg = config_from_json(j);
  REQUIRE(cfg.ok());
  e = Engine::create(*cfg);
  CHECK(e.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(e.status().message()),
             ContainsSubstring("tp rendezvous at 127.0.0.1:1: rank 1 of 2"));
  j.erase("tp_rank");
  j.erase("tp_rendezvous_timeout_s");
  // tensor_parallel 1 is the engine as before.
  j.erase("tp_rendezvous");
  j["tensor_parallel"] = 1;
  cfg = config_from_json(j);
  REQUIRE(cfg.ok());
  CHECK(Engine::create(*cfg).ok());
}

TEST_CASE("cpu communicator: no pushed all-reduce (a GPU peer-memory path) - clear errors",
          "[parallel][cpu_comm]") {
  auto group = CpuCommGroup::create(2);
  REQUIRE(group.ok());
  auto c = CpuCommunicator::create(*group, 0);
  REQUIRE(c.ok());
  CHECK_FALSE((*c)->push_fits(1, 4096));
  CHECK((*c)->push_targets(0).count == 0);
  std::vector<uint16_t> buf(4096);
  const absl::Status st =
      (*c)->push_add_rmsnorm(0, buf.data(), buf.data(), buf.data(), 1, 4096, 1e-5f, buf.data());
  CHECK(st.code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(st.message()), ContainsSubstring("no pushed all-reduce"));
}
