// NcclCommunicator on two GPUs, one thread per rank: bf16 and f32 all-reduce against the
// CPU communicator's rank-ordered sum (exact: with two ranks NCCL's fp32 sum of the pair,
// rounded once to bf16, is the same arithmetic), all_gather, broadcast, and an all-reduce
// captured in a CUDA/HIP graph and replayed. On one GPU: the same with a group of one rank
// (the bounded set-up, non-blocking init then split, on the real library), and a rank
// whose peer never joins, which must fail in bounded time and leave the GPU usable.
// Skips, saying why, without a GPU (the two-rank case with fewer than two), or when
// NCCL/RCCL cannot be loaded. Built with the GPU backend only.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include "tests/util/catch.h"

#include "kernels/common/bf16.h"
#include "kernels/common/gpu.h"
#include "src/parallel/cpu_communicator.h"
#include "src/parallel/nccl_communicator.h"

using namespace kvfuse;

namespace {

// The library, or null after saying why the test is skipped.
const nccl::NcclLibrary* nccl_or_skip(int gpus_needed) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    WARN("NCCL tests skipped: no GPU is visible");
    return nullptr;
  }
  if (n < gpus_needed) {
    WARN("NCCL test skipped: it needs " << gpus_needed << " GPUs, " << n << " visible");
    return nullptr;
  }
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // no NVLink multicast (docs/tensor-parallel.md#benchmarking-a-sharded-step)
  auto lib = nccl::NcclLibrary::load();
  if (!lib.ok()) {
    WARN("NCCL tests skipped: " << lib.status().message());
    return nullptr;
  }
  return *lib;
}

std::string run_error;  // the first failure of a rank thread

#define RANK_CHECK(expr)                                                                      \
  do {                                                                                        \
    const absl::Status st_ = (expr);                                                          \
    if (!st_.ok()) {                                                                          \
      if (run_error.empty()) run_error = std::string(#expr) + ": " + st_.ToString();          \
      return;                                                                                 \
    }                                                                                         \
  } while (0)
#define RANK_GPU(expr) RANK_CHECK((expr) == cudaSuccess ? absl::OkStatus() : absl::InternalError(#expr " failed"))

constexpr int kRanks = 2;
constexpr int64_t kCount = 3 * 1024 + 7;  // not a multiple of anything NCCL chunks by

struct RankData {
  std::vector<uint16_t> bf16_in, bf16_out;
  std::vector<float> f32_in, f32_out;
  std::vector<float> gathered;
  std::vector<uint8_t> broadcast;
  std::vector<float> replayed;  // f32_out all-reduced twice more from a graph
};

void run_rank(const nccl::NcclLibrary& lib, const nccl::ncclUniqueId& id, int r, int ranks, RankData& d) {
  RANK_GPU(cudaSetDevice(r));
  cudaStream_t stream{};
  RANK_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto comm = NcclCommunicator::create(lib, id, r, ranks, r, stream);
  RANK_CHECK(comm.status());
  Communicator& c = **comm;
  void *b = nullptr, *f = nullptr, *g = nullptr, *bc = nullptr;
  RANK_GPU(cudaMalloc(&b, kCount * 2));
  RANK_GPU(cudaMalloc(&f, kCount * 4));
  RANK_GPU(cudaMalloc(&g, kCount * 4 * ranks));
  RANK_GPU(cudaMalloc(&bc, 256));
  RANK_GPU(cudaMemcpy(b, d.bf16_in.data(), kCount * 2, cudaMemcpyHostToDevice));
  RANK_GPU(cudaMemcpy(f, d.f32_in.data(), kCount * 4, cudaMemcpyHostToDevice));
  RANK_GPU(cudaMemcpy(bc, d.broadcast.data(), 256, cudaMemcpyHostToDevice));

  RANK_CHECK(c.all_reduce_sum(b, kCount, DType::bf16));
  RANK_CHECK(c.all_gather(f, g, kCount, DType::f32));  // before f is reduced in place
  RANK_CHECK(c.all_reduce_sum(f, kCount, DType::f32));
  RANK_CHECK(c.broadcast(bc, 256, ranks - 1));
  RANK_CHECK(c.barrier());
  d.bf16_out.resize(kCount);
  d.f32_out.resize(kCount);
  d.gathered.resize(kCount * ranks);
  RANK_GPU(cudaMemcpy(d.bf16_out.data(), b, kCount * 2, cudaMemcpyDeviceToHost));
  RANK_GPU(cudaMemcpy(d.f32_out.data(), f, kCount * 4, cudaMemcpyDeviceToHost));
  RANK_GPU(cudaMemcpy(d.gathered.data(), g, kCount * 4 * ranks, cudaMemcpyDeviceToHost));
  RANK_GPU(cudaMemcpy(d.broadcast.data(), bc, 256, cudaMemcpyDeviceToHost));

  // Captured: the all-reduce enqueues on the stream and returns, so it goes into the graph.
  cudaGraph_t graph{};
  cudaGraphExec_t exec{};
  RANK_GPU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status captured = c.all_reduce_sum(f, kCount, DType::f32);
  RANK_GPU(cudaStreamEndCapture(stream, &graph));
  RANK_CHECK(captured);
  RANK_CHECK(c.barrier().code() == absl::StatusCode::kOk ? absl::OkStatus() : absl::InternalError("barrier"));
  RANK_GPU(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 2; ++i) RANK_GPU(cudaGraphLaunch(exec, stream));
  RANK_GPU(cudaStreamSynchronize(stream));
  d.replayed.resize(kCount);
  RANK_GPU(cudaMemcpy(d.replayed.data(), f, kCount * 4, cudaMemcpyDeviceToHost));
  RANK_GPU(cudaGraphExecDestroy(exec));
  RANK_GPU(cudaGraphDestroy(graph));
  comm->reset();
  for (void* p : {b, f, g, bc}) RANK_GPU(cudaFree(p));
  RANK_GPU(cudaStreamDestroy(stream));
}

}  // namespace

TEST_CASE(
    "nccl communicator: 2-rank bf16 and f32 all-reduce equal the CPU sum exactly - gather, broadcast, graph",
    "[gpu][nccl]") {
  const nccl::NcclLibrary* lib = nccl_or_skip(2);
  if (lib == nullptr) return;
  INFO(lib->path << " " << lib->version_string());
  std::vector<RankData> d(kRanks);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int r = 0; r < kRanks; ++r) {
    for (int64_t i = 0; i < kCount; ++i) {
      const float scale = i % 11 == 0 ? 1.0e4f : i % 3 == 0 ? 1.0e-3f : 1.0f;
      d[r].bf16_in.push_back(f32_to_bf16(dist(rng) * scale));
      d[r].f32_in.push_back(dist(rng) * scale);
    }
    d[r].broadcast.assign(256, uint8_t(r + 1));
  }
  auto id = NcclCommunicator::unique_id(*lib);
  REQUIRE(id.ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { run_rank(*lib, *id, r, kRanks, d[r]); });
  for (auto& t : threads) t.join();
  INFO(run_error);
  REQUIRE(run_error.empty());

  std::vector<uint16_t> want_bf16(kCount);
  std::vector<float> want_f32(kCount);
  reference_sum_bf16({d[0].bf16_in.data(), d[1].bf16_in.data()}, kCount, want_bf16.data());
  reference_sum_f32({d[0].f32_in.data(), d[1].f32_in.data()}, kCount, want_f32.data());
  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(r);
    CHECK(d[r].bf16_out == want_bf16);
    CHECK(std::memcmp(d[r].f32_out.data(), want_f32.data(), kCount * 4) == 0);
    for (int q = 0; q < kRanks; ++q) {
      CHECK(std::memcmp(d[r].gathered.data() + q * kCount, d[q].f32_in.data(), kCount * 4) == 0);
    }
    CHECK(d[r].broadcast == std::vector<uint8_t>(256, 2));
    // Two replays of the captured all-reduce: s -> 2s -> 4s on both ranks (exact).
    bool all = true;
    for (int64_t i = 0; i < kCount; ++i) all = all && d[r].replayed[i] == 4.0f * want_f32[i];
    CHECK(all);
  }
}

namespace {

RankData random_rank_data(uint32_t seed) {
  RankData d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < kCount; ++i) {
    d.bf16_in.push_back(f32_to_bf16(dist(rng)));
    d.f32_in.push_back(dist(rng));
  }
  d.broadcast.assign(256, uint8_t(9));
  return d;
}

// run_rank() as the one rank of a new group on this thread, with random_rank_data(seed);
// the test case stops if a step of it failed.
RankData run_group_of_one(const nccl::NcclLibrary& lib, uint32_t seed) {
  RankData d = random_rank_data(seed);
  auto id = NcclCommunicator::unique_id(lib);
  REQUIRE(id.ok());
  run_rank(lib, *id, 0, 1, d);
  INFO(run_error);
  REQUIRE(run_error.empty());
  return d;
}

}  // namespace

TEST_CASE("nccl communicator: a group of one rank - the bounded set-up on the real library, collectives, graph",
          "[gpu][nccl]") {
  const nccl::NcclLibrary* lib = nccl_or_skip(1);
  if (lib == nullptr) return;
  INFO(lib->path << " " << lib->version_string());
  // NCCL and RCCL from 2.18 have ncclCommInitRankConfig and ncclCommSplit: the set-up runs
  // non-blocking, then the communicator of the collectives is its blocking split.
  CHECK(lib->bounded_init() == (lib->version >= 21800));
  const RankData d = run_group_of_one(*lib, 11);
  // One rank: each collective is the identity, the graph's replays too (bitwise).
  CHECK(d.bf16_out == d.bf16_in);
  CHECK(std::memcmp(d.f32_out.data(), d.f32_in.data(), kCount * 4) == 0);
  CHECK(std::memcmp(d.gathered.data(), d.f32_in.data(), kCount * 4) == 0);
  CHECK(d.broadcast == std::vector<uint8_t>(256, 9));
  CHECK(std::memcmp(d.replayed.data(), d.f32_in.data(), kCount * 4) == 0);
}

TEST_CASE("nccl communicator: a rank whose peer never joins fails in bounded time, and the GPU serves on",
          "[gpu][nccl]") {
  const nccl::NcclLibrary* lib = nccl_or_skip(1);
  if (lib == nullptr) return;
  if (!lib->bounded_init()) {
    WARN("skipped: " << lib->description() << " lacks ncclCommInitRankConfig or ncclCommSplit (NCCL < 2.18): "
                     << "its set-up cannot be bounded");
    return;
  }
  auto id = NcclCommunicator::unique_id(*lib);
  REQUIRE(id.ok());
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cudaStream_t stream{};
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  // Rank 0 of 2; rank 1 never comes. First the deadline, then a peer reported failed.
  nccl::InitWatch watch;
  watch.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  auto t0 = std::chrono::steady_clock::now();
  auto c = NcclCommunicator::create(*lib, *id, 0, 2, 0, stream, watch);
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE_FALSE(c.ok());
  INFO(c.status().message());
  CHECK(c.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(c.status().message()), Catch::Matchers::ContainsSubstring("of rank 0 of 2 did not finish"));
  CHECK(waited >= 2.9);
  CHECK(waited < 60);  // the abort of the set-up under way returned
  WARN("rank 0 of 2 without its peer: DEADLINE_EXCEEDED after " << waited << " s (deadline 3 s)");

  auto id2 = NcclCommunicator::unique_id(*lib);
  REQUIRE(id2.ok());
  nccl::InitWatch failing;
  failing.peers = [asked = 0]() mutable -> absl::Status {
    return ++asked < 20 ? absl::OkStatus() : absl::UnavailableError("rank 1's process closed its connection");
  };
  t0 = std::chrono::steady_clock::now();
  auto stopped = NcclCommunicator::create(*lib, *id2, 0, 2, 0, stream, failing);
  waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE_FALSE(stopped.ok());
  INFO(stopped.status().message());
  CHECK(stopped.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(stopped.status().message()),
             Catch::Matchers::ContainsSubstring("stopped: rank 1's process closed its connection"));
  CHECK(waited < 60);

  // The GPU and the library serve a new group afterwards.
  const RankData d = run_group_of_one(*lib, 12);
  CHECK(std::memcmp(d.replayed.data(), d.f32_in.data(), kCount * 4) == 0);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}
