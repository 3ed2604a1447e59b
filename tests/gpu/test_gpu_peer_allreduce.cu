// The all-reduce over peer memory (src/parallel/peer_allreduce.h) on the visible GPUs (2 to
// 8 of them), one thread per rank as the engine runs them:
//   - bf16 and f32 sums equal the CPU communicator's rank-ordered fp32 sum rounded once,
//     bit for bit and the same bits on every rank, for counts from 1 element to the whole
//     staging buffer (odd counts, counts that are not a multiple of a block's chunk), with
//     16-byte aligned and unaligned buffers, every call enqueued back to back;
//   - calls captured in a CUDA/HIP graph per rank and replayed many times, concurrently on
//     every GPU (the call counters advance on the device);
//   - both of these with plain launches and with the calls as programmatic dependents
//     (PeerAllReduceOptions::pdl);
//   - PeerAllReduceCommunicator: small all-reduces over peer memory, larger ones through
//     NCCL, which agrees within bf16/f32 rounding;
//   - pushed partial sums (push_targets, push_add_rmsnorm): the GEMV pushing from its
//     epilogue (staged a token row at a time, and one result at a time) and the copy kernel
//     pushing after it, then the norm that sums them, against
//     the GEMV, all_reduce_sum and the backend's add_rmsnorm, bit for bit on every rank,
//     in two forward passes of numbered calls back to back and in graphs replayed 40 times;
//   - abort() and the timeout end a kernel (the all-reduce's or the pushed norm's) whose
//     peer never comes.
// With one GPU visible, two ranks share it (PeerAllReduceOptions::share_devices, for tests
// only): the protocol, the kernels, graphs, abort and the timeout run, the links between
// GPUs are not exercised, and the NCCL part is skipped (NCCL refuses two ranks on one GPU).
// Skips, saying why, without a GPU, without peer access between the GPUs, or when one GPU
// cannot hold both ranks' blocks at once (and the NCCL part without NCCL/RCCL). Built with
// the GPU backend only.
#include <algorithm>
#include <array>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include "tests/util/catch.h"

#include "kernels/common/gpu.h"  // first: the HIP runtime before kernels/common/bf16.h

#include "absl/strings/str_cat.h"
#include "kernels/common/bf16.h"
#include "kernels/gemm/gemv.cuh"
#include "kernels/ops/model_ops.cuh"
#include "kernels/parallel/tp_push.cuh"
#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"
#include "src/parallel/cpu_communicator.h"
#include "src/parallel/nccl_communicator.h"
#include "src/parallel/peer_allreduce.h"

using namespace kvfuse;

namespace {

// The GPUs of the group's ranks, in rank order, and whether ranks share a GPU.
struct Devices {
  std::vector<int> gpus;  // empty: the test is skipped
  bool shared = false;    // two ranks on GPU 0 (PeerAllReduceOptions::share_devices)

  bool empty() const { return gpus.empty(); }
  // The group's options: `base` with share_devices set to match.
  PeerAllReduceOptions options(PeerAllReduceOptions base = {}) const {
    base.share_devices = shared;
    return base;
  }
};

// The GPUs of the group (0 .. n-1, n <= 8; with one GPU visible, {0, 0}: two ranks share
// it), or none after saying why the test is skipped.
Devices devices_or_skip() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    WARN("peer all-reduce tests skipped: no GPU is visible");
    return {};
  }
  Devices d;
  if (n < 2) {
    d.gpus = {0, 0};
    d.shared = true;
  } else {
    d.gpus.resize(size_t(std::min(n, PeerAllReduceGroup::kMaxRanks)));
    for (size_t i = 0; i < d.gpus.size(); ++i) d.gpus[i] = int(i);
  }
  // Refused also when one GPU cannot hold both ranks' blocks at once: a skip, not a failure.
  if (const absl::Status st = PeerAllReduceGroup::check(d.gpus, d.shared); !st.ok()) {
    WARN("peer all-reduce tests skipped: " << st.message());
    return {};
  }
  if (d.shared) {
    WARN("peer all-reduce: one GPU visible: 2 ranks share GPU 0 (the protocol, kernels, graphs and abort run; "
         "the links are not exercised)");
  }
  return d;
}

// Runs f(rank, stream) on one thread per rank, rank r on GPU devices[r] (made current),
// each with its own non-blocking stream; the first error. The streams are created here,
// one after another, and each runs a first piece of work (a memset) before f, for ranks
// that share a GPU (src/parallel/peer_allreduce.h, "Ranks sharing a GPU"): so they get
// different hardware queues of it, and no call is the first work of a fresh stream (two
// ranks sharing an H200 then hung until the timeout in a few groups in a hundred, never
// with the memset, as if that first submission waited behind the peer's spinning kernel).
absl::Status run_ranks(const std::vector<int>& devices, const std::function<absl::Status(int, cudaStream_t)>& f) {
  const int n = int(devices.size());
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) return absl::InternalError("cudaGetDevice");
  std::vector<cudaStream_t> streams;
  absl::Status made;
  for (int r = 0; r < n && made.ok(); ++r) {
    cudaStream_t stream{};
    void* scratch = nullptr;
    if (cudaSetDevice(devices[size_t(r)]) != cudaSuccess) {
      made.Update(absl::InternalError(absl::StrCat("rank ", r, ": cudaSetDevice")));
    } else if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
      made.Update(absl::InternalError(absl::StrCat("rank ", r, ": cudaStreamCreateWithFlags")));
    } else {
      streams.push_back(stream);
      const bool ran = cudaMalloc(&scratch, 16) == cudaSuccess &&
                       cudaMemsetAsync(scratch, 0, 16, stream) == cudaSuccess &&
                       cudaStreamSynchronize(stream) == cudaSuccess;
      if ((scratch != nullptr && cudaFree(scratch) != cudaSuccess) || !ran) {
        made.Update(absl::InternalError(absl::StrCat("rank ", r, ": the stream's first memset")));
      }
    }
  }
  std::mutex mu;
  absl::Status first = made;
  std::vector<std::thread> threads;
  for (int r = 0; r < n && made.ok(); ++r) {
    threads.emplace_back([&, r] {
      absl::Status st = [&]() -> absl::Status {
        if (cudaSetDevice(devices[size_t(r)]) != cudaSuccess) return absl::InternalError("cudaSetDevice");
        return f(r, streams[size_t(r)]);
      }();
      std::lock_guard<std::mutex> lock(mu);
      if (!st.ok()) first.Update(absl::Status(st.code(), absl::StrCat("rank ", r, ": ", st.message())));
    });
  }
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < streams.size(); ++r) {
    if (cudaSetDevice(devices[r]) != cudaSuccess || cudaStreamDestroy(streams[r]) != cudaSuccess) {
      first.Update(absl::InternalError(absl::StrCat("rank ", r, ": cudaStreamDestroy")));
    }
  }
  (void)cudaSetDevice(current);
  return first;
}

// The GPUs of `g`'s ranks, in rank order.
std::vector<int> devices_of(const PeerAllReduceGroup& g) {
  std::vector<int> devices;
  for (int r = 0; r < g.size(); ++r) devices.push_back(g.device(r));
  return devices;
}

// The point where every rank has allocated its buffers, before any rank's first call: a
// device memory allocation may wait for the kernels running on its GPU (CUDA's implicit
// synchronisation), and where ranks share a GPU those include a peer's first call, which
// spins until this rank's comes. Each rank arrives once: at arrive(), or on its way out
// after an early return (then it drops out, so that the others do not wait for it).
class Allocated {
 public:
  explicit Allocated(std::barrier<>& all) : all_(all) {}
  ~Allocated() {
    if (!arrived_) all_.arrive_and_drop();
  }
  Allocated(const Allocated&) = delete;
  Allocated& operator=(const Allocated&) = delete;
  void arrive() {
    arrived_ = true;
    all_.arrive_and_wait();
  }

 private:
  std::barrier<>& all_;
  bool arrived_ = false;
};

#define GPU_OK(expr) KVFUSE_RETURN_IF_ERROR(gpu_status((expr), #expr))

// One all-reduce of the test: `count` elements of `dtype` at byte offset `offset` of the
// rank's allocation (0: 16-byte aligned; one element: not), the inputs of every rank.
struct Case {
  DType dtype;
  int64_t count;
  int64_t offset;
  std::vector<std::vector<uint8_t>> in;  // [rank] bytes
  std::vector<uint8_t> want;             // the rank-ordered sum
  std::vector<std::vector<uint8_t>> out;  // [rank] what the rank got
};

// Values of every magnitude the step sees, some exact zeros and negative zeros (on every
// rank at once, so the sum keeps the sign: the kernel starts from rank 0's value, not 0).
Case make_case(DType dtype, int64_t count, bool aligned, int ranks, uint32_t seed) {
  Case c{dtype, count, aligned ? 0 : int64_t(dtype_size(dtype)), {}, {}, {}};
  const size_t bytes = size_t(count) * dtype_size(dtype);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<const uint16_t*> b16;
  std::vector<const float*> f32;
  for (int r = 0; r < ranks; ++r) {
    std::vector<uint8_t> v(bytes);
    for (int64_t i = 0; i < count; ++i) {
      const float scale = i % 11 == 0 ? 1.0e4f : i % 3 == 0 ? 1.0e-3f : 1.0f;
      float x = dist(rng) * scale;
      if (i % 97 == 5) x = -0.0f;
      if (i % 89 == 7) x = 0.0f;
      if (dtype == DType::bf16) {
        const uint16_t h = f32_to_bf16(x);
        std::memcpy(v.data() + 2 * i, &h, 2);
      } else {
        std::memcpy(v.data() + 4 * i, &x, 4);
      }
    }
    c.in.push_back(std::move(v));
  }
  for (int r = 0; r < ranks; ++r) {
    b16.push_back(reinterpret_cast<const uint16_t*>(c.in[size_t(r)].data()));
    f32.push_back(reinterpret_cast<const float*>(c.in[size_t(r)].data()));
  }
  c.want.resize(bytes);
  if (dtype == DType::bf16) {
    reference_sum_bf16(b16, count, reinterpret_cast<uint16_t*>(c.want.data()));
  } else {
    reference_sum_f32(f32, count, reinterpret_cast<float*>(c.want.data()));
  }
  c.out.resize(size_t(ranks));
  return c;
}

// Counts that cover the grid's cases: below one vector, around a block's pass (8 KiB) and
// the chunk boundaries, odd counts, up to the whole staging buffer.
std::vector<int64_t> counts_for(DType dtype, int64_t staging_bytes) {
  const int64_t per_vec = 16 / int64_t(dtype_size(dtype));
  const int64_t pass = 8192 / int64_t(dtype_size(dtype));
  const int64_t max = staging_bytes / int64_t(dtype_size(dtype));
  return {1, 3, per_vec - 1, per_vec, per_vec + 1, 255, 1000, pass - 1, pass, pass + 1, 3 * pass + 7,
          64 * pass - 1, 64 * pass + 9, 100003, max - per_vec - 1, max};
}

// Every case on every rank, all enqueued back to back on the rank's stream before one wait.
absl::Status run_cases(PeerAllReduceGroup& g, std::vector<Case>& cases) {
  std::barrier<> allocated(g.size());
  return run_ranks(devices_of(g), [&](int r, cudaStream_t stream) -> absl::Status {
    Allocated ready(allocated);
    std::vector<void*> mem(cases.size(), nullptr);
    auto buf = [&](size_t i) { return static_cast<char*>(mem[i]) + cases[i].offset; };
    for (size_t i = 0; i < cases.size(); ++i) {
      const size_t bytes = cases[i].in[size_t(r)].size();
      GPU_OK(cudaMalloc(&mem[i], bytes + 16));
      GPU_OK(cudaMemcpy(buf(i), cases[i].in[size_t(r)].data(), bytes, cudaMemcpyHostToDevice));
    }
    ready.arrive();
    for (size_t i = 0; i < cases.size(); ++i) {
      KVFUSE_RETURN_IF_ERROR(g.all_reduce_sum(r, buf(i), cases[i].count, cases[i].dtype, stream));
    }
    GPU_OK(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < cases.size(); ++i) {
      std::vector<uint8_t>& out = cases[i].out[size_t(r)];
      out.resize(cases[i].in[size_t(r)].size());
      GPU_OK(cudaMemcpy(out.data(), buf(i), out.size(), cudaMemcpyDeviceToHost));
      GPU_OK(cudaFree(mem[i]));
    }
    return g.status();
  });
}

}  // namespace

TEST_CASE("peer all-reduce: check() refuses two ranks on one GPU unless they may share it", "[gpu][peer]") {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    WARN("peer all-reduce tests skipped: no GPU is visible");
    return;
  }
  const absl::Status st = PeerAllReduceGroup::check({0, 0});
  INFO(st.ToString());
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(st.message()), Catch::Matchers::ContainsSubstring("both on GPU 0"));
  CHECK(PeerAllReduceGroup::create({0, 0}).status().code() == absl::StatusCode::kFailedPrecondition);
  // With share_devices: OK, or refused only because GPU 0 cannot hold both ranks' blocks.
  const absl::Status shared = PeerAllReduceGroup::check({0, 0}, /*share_devices=*/true);
  INFO(shared.ToString());
  if (!shared.ok()) {
    CHECK(shared.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(shared.message()), Catch::Matchers::ContainsSubstring("sharing GPU 0"));
  }
}

TEST_CASE("peer all-reduce: bf16 and f32 equal the rank-ordered sum bit for bit on every rank, all sizes",
          "[gpu][peer]") {
  const Devices devices = devices_or_skip();
  if (devices.empty()) return;
  const int n = int(devices.gpus.size());
  // Plain launches, and calls as programmatic dependents (PeerAllReduceOptions::pdl).
  const bool pdl = GENERATE(false, true);
  CAPTURE(pdl);
  PeerAllReduceOptions base;
  base.pdl = pdl;
  auto g = PeerAllReduceGroup::create(devices.gpus, devices.options(base));
  REQUIRE(g.ok());
  std::vector<Case> cases;
  uint32_t seed = 1;
  for (DType dtype : {DType::bf16, DType::f32}) {
    for (int64_t count : counts_for(dtype, (*g)->staging_bytes())) {
      for (bool aligned : {true, false}) {
        if (!aligned && count > 100003) continue;  // the element-wise path, on fewer elements
        cases.push_back(make_case(dtype, count, aligned, n, seed++));
      }
    }
  }
  const absl::Status st = run_cases(**g, cases);
  INFO(st.ToString());
  REQUIRE(st.ok());
  for (const Case& c : cases) {
    CAPTURE(to_string(c.dtype), c.count, c.offset);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(c.out[size_t(r)] == c.want);
    }
  }
  for (int r = 0; r < n; ++r) {
    auto calls = (*g)->calls_completed(r);
    REQUIRE(calls.ok());
    CHECK(*calls == cases.size());  // every call has a block 0
  }
  CHECK((*g)->fits((*g)->staging_bytes() / 2, DType::bf16));
  CHECK_FALSE((*g)->fits((*g)->staging_bytes() / 2 + 1, DType::bf16));
  CHECK((*g)->all_reduce_sum(0, nullptr, (*g)->staging_bytes(), DType::bf16, nullptr).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("peer all-reduce: calls captured in a graph per rank, replayed 300 times on every GPU at once",
          "[gpu][peer][graphs]") {
  const Devices devices = devices_or_skip();
  if (devices.empty()) return;
  const int n = int(devices.gpus.size());
  const bool pdl =
      GENERATE(false, true);  // the calls as programmatic dependents of the copies and each other
  CAPTURE(pdl);
  PeerAllReduceOptions base;
  base.pdl = pdl;
  auto g = PeerAllReduceGroup::create(devices.gpus, devices.options(base));
  REQUIRE(g.ok());
  // A decode step's shapes: batch 1 and 64 of a 4096-wide hidden state, and an odd f32 one.
  std::vector<Case> cases = {make_case(DType::bf16, 4096, true, n, 11), make_case(DType::bf16, 64 * 4096, true, n, 12),
                             make_case(DType::f32, 12345, true, n, 13), make_case(DType::bf16, 4097, false, n, 14)};
  constexpr int kReplays = 300, kCheckEvery = 60;
  std::mutex mu;
  std::vector<std::string> mismatches;
  std::barrier<> allocated(n);
  const absl::Status st = run_ranks(devices.gpus, [&](int r, cudaStream_t stream) -> absl::Status {
    Allocated ready(allocated);
    std::vector<void*> src(cases.size()), mem(cases.size());
    auto buf = [&](size_t i) { return static_cast<char*>(mem[i]) + cases[i].offset; };
    for (size_t i = 0; i < cases.size(); ++i) {
      const size_t bytes = cases[i].in[size_t(r)].size();
      GPU_OK(cudaMalloc(&src[i], bytes));
      GPU_OK(cudaMalloc(&mem[i], bytes + 16));
      GPU_OK(cudaMemcpy(src[i], cases[i].in[size_t(r)].data(), bytes, cudaMemcpyHostToDevice));
    }
    // The graph resets each buffer from its input, then all-reduces it in place.
    cudaGraph_t graph{};
    cudaGraphExec_t exec{};
    GPU_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    absl::Status recorded;
    for (size_t i = 0; i < cases.size() && recorded.ok(); ++i) {
      const size_t bytes = cases[i].in[size_t(r)].size();
      if (cudaMemcpyAsync(buf(i), src[i], bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
        recorded.Update(absl::InternalError("cudaMemcpyAsync in the capture"));
      } else {
        recorded.Update((*g)->all_reduce_sum(r, buf(i), cases[i].count, cases[i].dtype, stream));
      }
    }
    GPU_OK(cudaStreamEndCapture(stream, &graph));
    KVFUSE_RETURN_IF_ERROR(recorded);
    GPU_OK(cudaGraphInstantiate(&exec, graph, 0));
    ready.arrive();
    for (int k = 1; k <= kReplays; ++k) {
      GPU_OK(cudaGraphLaunch(exec, stream));
      if (k % kCheckEvery != 0) continue;
      GPU_OK(cudaStreamSynchronize(stream));
      for (size_t i = 0; i < cases.size(); ++i) {
        std::vector<uint8_t> out(cases[i].want.size());
        GPU_OK(cudaMemcpy(out.data(), buf(i), out.size(), cudaMemcpyDeviceToHost));
        if (out != cases[i].want) {
          std::lock_guard<std::mutex> lock(mu);
          mismatches.push_back(absl::StrCat("rank ", r, " case ", i, " after replay ", k));
        }
      }
    }
    GPU_OK(cudaGraphExecDestroy(exec));
    GPU_OK(cudaGraphDestroy(graph));
    for (size_t i = 0; i < cases.size(); ++i) {
      GPU_OK(cudaFree(src[i]));
      GPU_OK(cudaFree(mem[i]));
    }
    return (*g)->status();
  });
  INFO(st.ToString());
  REQUIRE(st.ok());
  INFO((mismatches.empty() ? std::string() : mismatches.front()));
  CHECK(mismatches.empty());
  for (int r = 0; r < n; ++r) {
    auto calls = (*g)->calls_completed(r);
    REQUIRE(calls.ok());
    CHECK(*calls == uint64_t(kReplays) * cases.size());
  }
}

// Pushed partial sums (src/parallel/peer_allreduce.h): per call, each rank's projection
// (kvfuse's GEMV for rows <= 8, pushing from its epilogue; a copy kernel after it for more
// rows, as after the library's GEMMs) stores its partial sums into the peers' inboxes, and
// push_add_rmsnorm sums them into the residual stream and norms it. Against the same
// projection, all_reduce_sum and the backend's add_rmsnorm kernel, on the same group: x and
// out bit for bit, and the same on every rank. Each rank's projection input and weights
// differ (its shard); x and the norm weight are the same on every rank. The calls run as
// two forward passes (call numbers 0..n-1 twice, so the slot sequence restarts), then as a
// graph per rank replayed 40 times, each replay adding into x again.
TEST_CASE("pushed partial sums: the bits of the projection, all-reduce and add_rmsnorm, every rank",
          "[gpu][peer][push]") {
  const Devices devices = devices_or_skip();
  if (devices.empty()) return;
  const int n = int(devices.gpus.size());
  const bool pdl = GENERATE(false, true);
  // The GEMV's pushed stores a token row at a time through shared memory, or one at a time.
  const bool staged = GENERATE(true, false);
  CAPTURE(pdl, staged);
  PeerAllReduceOptions base;
  base.pdl = pdl;
  base.push = true;
  auto g = PeerAllReduceGroup::create(devices.gpus, devices.options(base));
  REQUIRE(g.ok());
  PeerAllReduceGroup& group = **g;
  struct Shape {
    int64_t rows, cols, k;
    int variant;  // the GEMV's (rows <= 8), else the copy kernel pushes
  };
  const std::vector<Shape> shapes = {{1, 4096, 2048, 0}, {1, 4096, 7168, gpu::gemv_variants(1) - 1},
                                     {2, 8192, 512, 1},  {5, 4096, 1024, 0},
                                     {8, 2048, 256, 2},  {2, 4104, 256, 2},
                                     {9, 4096, 64, -1},  {64, 4096, 64, -1},
                                     {100, 8192, 64, -1}};
  const float eps = 1e-5f;
  const int kReplays = 40;
  struct Data {
    std::vector<std::vector<uint16_t>> a, wt;  // [rank]: the projection's input and weights
    std::vector<uint16_t> x, w;
  };
  std::vector<Data> data(shapes.size());
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto bf16_vector = [&](int64_t count, float scale) {
    std::vector<uint16_t> v(static_cast<size_t>(count));
    for (auto& e : v) e = f32_to_bf16(dist(rng) * scale);
    return v;
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& sh = shapes[i];
    for (int r = 0; r < n; ++r) {
      data[i].a.push_back(bf16_vector(sh.rows * sh.k, 1.0f));
      data[i].wt.push_back(bf16_vector(sh.cols * sh.k, 1.0f / std::sqrt(float(sh.k))));
    }
    data[i].x = bf16_vector(sh.rows * sh.cols, 2.0f);
    data[i].w = bf16_vector(sh.cols, 1.0f);
  }
  // [phase: 0 eager, 1 graph][shape][rank][x, out of the pushed chain, x, out of the reference]
  std::vector<std::vector<std::vector<std::array<std::vector<uint16_t>, 4>>>> got(
      2, std::vector<std::vector<std::array<std::vector<uint16_t>, 4>>>(
             shapes.size(), std::vector<std::array<std::vector<uint16_t>, 4>>(size_t(n))));
  std::barrier<> allocated(n);
  const absl::Status st = run_ranks(devices.gpus, [&](int r, cudaStream_t stream) -> absl::Status {
    Allocated ready(allocated);
    // Per shape: a, wt, w, then x and h of the pushed chain, x and h of the reference.
    std::vector<std::array<uint16_t*, 7>> mem(shapes.size());
    auto upload = [&](uint16_t* dst, const std::vector<uint16_t>& v) {
      return gpu_status(cudaMemcpy(dst, v.data(), v.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
    };
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Shape& sh = shapes[i];
      const int64_t sizes[7] = {sh.rows * sh.k,    sh.cols * sh.k,    sh.cols,          sh.rows * sh.cols,
                                sh.rows * sh.cols, sh.rows * sh.cols, sh.rows * sh.cols};
      for (int k = 0; k < 7; ++k) {
        void* p = nullptr;
        GPU_OK(cudaMalloc(&p, size_t(sizes[k]) * 2));
        mem[i][size_t(k)] = static_cast<uint16_t*>(p);
      }
      KVFUSE_RETURN_IF_ERROR(upload(mem[i][0], data[i].a[size_t(r)]));
      KVFUSE_RETURN_IF_ERROR(upload(mem[i][1], data[i].wt[size_t(r)]));
      KVFUSE_RETURN_IF_ERROR(upload(mem[i][2], data[i].w));
      KVFUSE_RETURN_IF_ERROR(upload(mem[i][3], data[i].x));
      KVFUSE_RETURN_IF_ERROR(upload(mem[i][5], data[i].x));
    }
    // Every kernel this rank launches loaded before any rank calls (with lazy loading a first
    // launch may wait for the GPU's running kernels, among them a peer's waiting norm where
    // ranks share the GPU): each shape's GEMV instance, with no targets, and add_rmsnorm,
    // into scratch (the group loaded its own kernels and the copy kernel).
    uint16_t* scratch = nullptr;
    GPU_OK(cudaMalloc(&scratch, 3 * 16));
    GPU_OK(cudaMemsetAsync(scratch, 0, 3 * 16, stream));
    GPU_OK(gpu::launch_add_rmsnorm(scratch, scratch + 8, scratch + 16, 1, 8, eps, scratch + 8, stream));
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Shape& sh = shapes[i];
      if (sh.variant < 0) continue;
      void* warm = nullptr;
      GPU_OK(cudaMalloc(&warm, size_t(sh.rows * sh.cols) * 2));
      const gpu::LaunchStatus ls =
          gpu::launch_gemv_push_bf16(mem[i][0], sh.rows, mem[i][1], sh.cols, sh.k,
                                     static_cast<uint16_t*>(warm), PushTargets{}, stream, pdl, sh.variant);
      if (!ls.ok()) return absl::InternalError(absl::StrCat("gemv warm-up: ", ls.message()));
      GPU_OK(cudaStreamSynchronize(stream));
      GPU_OK(cudaFree(warm));
    }
    GPU_OK(cudaStreamSynchronize(stream));
    GPU_OK(cudaFree(scratch));
    ready.arrive();
    // One forward pass: per shape, the pushed chain (call number i), then the reference.
    auto pass = [&]() -> absl::Status {
      for (size_t i = 0; i < shapes.size(); ++i) {
        const Shape& sh = shapes[i];
        uint16_t* const* m = mem[i].data();
        const PushTargets t = group.push_targets(r, int(i));
        for (int ref = 0; ref < 2; ++ref) {
          uint16_t* h = m[ref ? 6 : 4];
          if (sh.variant >= 0) {
            const gpu::LaunchStatus ls = ref ? gpu::launch_gemv_bf16(m[0], sh.rows, m[1], sh.cols, sh.k, h,
                                                                     false, stream, pdl, sh.variant)
                                             : gpu::launch_gemv_push_bf16(m[0], sh.rows, m[1], sh.cols, sh.k,
                                                                          h, t, stream, pdl, sh.variant, true,
                                                                          staged);
            if (!ls.ok()) return absl::InternalError(absl::StrCat("gemv: ", ls.message()));
          } else {
            // The projection's result for many rows: the rank's input rows, as a library GEMM
            // would have left them (the copy kernel is what is tested here).
            GPU_OK(cudaMemcpyAsync(h, m[0], size_t(sh.rows * sh.k) * 2, cudaMemcpyDeviceToDevice, stream));
            if (sh.k < sh.cols) {
              GPU_OK(cudaMemsetAsync(h + sh.rows * sh.k, 0, size_t(sh.rows * (sh.cols - sh.k)) * 2, stream));
            }
            if (!ref) GPU_OK(gpu::launch_push_copy(h, sh.rows * sh.cols, t, stream, pdl));
          }
          if (ref) {
            KVFUSE_RETURN_IF_ERROR(group.all_reduce_sum(r, h, sh.rows * sh.cols, DType::bf16, stream));
            GPU_OK(gpu::launch_add_rmsnorm(m[5], h, m[2], sh.rows, sh.cols, eps, h, stream, pdl));
          } else {
            KVFUSE_RETURN_IF_ERROR(
                group.push_add_rmsnorm(r, int(i), h, m[3], m[2], sh.rows, sh.cols, eps, h, stream));
          }
        }
      }
      return absl::OkStatus();
    };
    auto download = [&](int phase) -> absl::Status {
      GPU_OK(cudaStreamSynchronize(stream));
      for (size_t i = 0; i < shapes.size(); ++i) {
        const size_t count = size_t(shapes[i].rows * shapes[i].cols);
        for (int k = 0; k < 4; ++k) {
          std::vector<uint16_t>& out = got[size_t(phase)][i][size_t(r)][size_t(k)];
          out.resize(count);
          GPU_OK(cudaMemcpy(out.data(), mem[i][size_t(3 + k)], count * 2, cudaMemcpyDeviceToHost));
        }
      }
      return absl::OkStatus();
    };
    KVFUSE_RETURN_IF_ERROR(pass());
    KVFUSE_RETURN_IF_ERROR(pass());
    KVFUSE_RETURN_IF_ERROR(download(0));
    cudaGraph_t graph{};
    cudaGraphExec_t exec{};
    GPU_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const absl::Status recorded = pass();
    GPU_OK(cudaStreamEndCapture(stream, &graph));
    KVFUSE_RETURN_IF_ERROR(recorded);
    GPU_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < kReplays; ++i) GPU_OK(cudaGraphLaunch(exec, stream));
    KVFUSE_RETURN_IF_ERROR(download(1));
    GPU_OK(cudaGraphExecDestroy(exec));
    GPU_OK(cudaGraphDestroy(graph));
    for (auto& ptrs : mem)
      for (uint16_t* p : ptrs) GPU_OK(cudaFree(p));
    return group.status();
  });
  INFO(st.ToString());
  REQUIRE(st.ok());
  for (int phase = 0; phase < 2; ++phase) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      CAPTURE(phase, shapes[i].rows, shapes[i].cols, shapes[i].k, shapes[i].variant);
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        const auto& v = got[size_t(phase)][i][size_t(r)];
        CHECK(v[0] == v[2]);  // x
        CHECK(v[1] == v[3]);  // out
        CHECK(v[0] == got[size_t(phase)][i][0][0]);
        CHECK(v[1] == got[size_t(phase)][i][0][1]);
      }
      CHECK(got[size_t(phase)][i][0][0] != data[i].x);  // the residual add happened
    }
  }
  // What it serves, where the targets are, and bad calls.
  CHECK(group.push_fits(1, 4096));
  CHECK(group.push_fits(64, 8192));
  CHECK_FALSE(group.push_fits(1, 4100));
  CHECK_FALSE(group.push_fits(1, 16384));
  CHECK_FALSE(group.push_fits(group.staging_bytes() / 2 / 4096 + 1, 4096));
  CHECK_FALSE(group.push_fits(0, 4096));
  for (int r = 0; r < n; ++r) {
    for (int call : {0, 1, 2, 3}) {
      const PushTargets t = group.push_targets(r, call);
      CHECK(t.count == n - 1);
      for (int p = 0; p < t.count; ++p) CHECK(t.dst[p] != nullptr);
    }
    // Calls in a row never share a slot; calls two apart do.
    CHECK(group.push_targets(r, 1).dst[0] != group.push_targets(r, 2).dst[0]);
    CHECK(group.push_targets(r, 1).dst[0] == group.push_targets(r, 3).dst[0]);
    CHECK(group.push_targets(r, 0).dst[0] != group.push_targets(r, 1).dst[0]);
  }
  CHECK(group.push_targets(n, 0).count == 0);
  uint16_t* p = reinterpret_cast<uint16_t*>(uintptr_t(256));
  CHECK(group.push_add_rmsnorm(0, 0, p, p, p, 1, 4100, eps, p, nullptr).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(group.push_add_rmsnorm(0, 0, p + 1, p, p, 1, 4096, eps, p, nullptr).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(group.push_add_rmsnorm(0, -1, p, p, p, 1, 4096, eps, p, nullptr).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(group.push_add_rmsnorm(n, 0, p, p, p, 1, 4096, eps, p, nullptr).code() ==
        absl::StatusCode::kInvalidArgument);
  // A group made without options.push has no inboxes and serves no pushed call.
  auto plain = PeerAllReduceGroup::create(devices.gpus, devices.options());
  REQUIRE(plain.ok());
  CHECK_FALSE((*plain)->push_fits(1, 4096));
  CHECK((*plain)->push_targets(0, 0).count == 0);
  CHECK((*plain)->push_add_rmsnorm(0, 0, p, p, p, 1, 4096, eps, p, nullptr).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("peer all-reduce communicator: small all-reduces over peer memory, larger through NCCL - abort",
          "[gpu][peer][nccl]") {
  const Devices devices = devices_or_skip();
  if (devices.empty()) return;
  if (devices.shared) {
    WARN("the NCCL part is skipped: its 2 ranks share GPU 0, and NCCL refuses two ranks on one GPU");
    return;
  }
  const int n = int(devices.gpus.size());
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // no NVLink multicast (docs/tensor-parallel.md#benchmarking-a-sharded-step)
  auto lib = nccl::NcclLibrary::load();
  if (!lib.ok()) {
    WARN("the NCCL part is skipped: " << lib.status().message());
    return;
  }
  PeerAllReduceOptions opts;
  opts.staging_bytes = 64 << 10;
  auto g = PeerAllReduceGroup::create(devices.gpus, devices.options(opts));
  REQUIRE(g.ok());
  auto id = NcclCommunicator::unique_id(**lib);
  REQUIRE(id.ok());
  // Each of these through the communicator (peer for the first two, NCCL for the last), and
  // through NCCL alone for comparison.
  std::vector<Case> cases = {make_case(DType::bf16, 4096 + 5, true, n, 21), make_case(DType::f32, 999, true, n, 22),
                             make_case(DType::bf16, 96 * 1024 + 1, true, n, 23)};
  std::vector<Case> nccl_cases = cases;
  std::barrier sync(n);
  std::vector<std::string> names(static_cast<size_t>(n));
  std::vector<absl::StatusCode> after_abort(static_cast<size_t>(n));
  const absl::Status st = run_ranks(devices.gpus, [&](int r, cudaStream_t stream) -> absl::Status {
    auto nccl = NcclCommunicator::create(**lib, *id, r, n, devices.gpus[size_t(r)], stream);
    KVFUSE_RETURN_IF_ERROR(nccl.status());
    NcclCommunicator* plain = nccl->get();
    auto c = PeerAllReduceCommunicator::create(*g, r, stream, std::move(*nccl));
    KVFUSE_RETURN_IF_ERROR(c.status());
    names[size_t(r)] = (*c)->name();
    for (std::vector<Case>* set : {&cases, &nccl_cases}) {
      for (Case& k : *set) {
        void* mem = nullptr;
        const size_t bytes = k.in[size_t(r)].size();
        GPU_OK(cudaMalloc(&mem, bytes));
        GPU_OK(cudaMemcpy(mem, k.in[size_t(r)].data(), bytes, cudaMemcpyHostToDevice));
        Communicator& via = set == &cases ? static_cast<Communicator&>(**c) : *plain;
        KVFUSE_RETURN_IF_ERROR(via.all_reduce_sum(mem, k.count, k.dtype));
        KVFUSE_RETURN_IF_ERROR((*c)->barrier());
        k.out[size_t(r)].resize(bytes);
        GPU_OK(cudaMemcpy(k.out[size_t(r)].data(), mem, bytes, cudaMemcpyDeviceToHost));
        GPU_OK(cudaFree(mem));
      }
    }
    KVFUSE_RETURN_IF_ERROR((*c)->async_error());
    sync.arrive_and_wait();
    (*c)->abort();
    float* one = nullptr;
    GPU_OK(cudaMalloc(&one, sizeof(float)));
    after_abort[size_t(r)] = (*c)->all_reduce_sum(one, 1, DType::f32).code();
    GPU_OK(cudaFree(one));
    c->reset();
    return absl::OkStatus();
  });
  INFO(st.ToString());
  REQUIRE(st.ok());
  for (int r = 0; r < n; ++r) {
    CHECK(names[size_t(r)].rfind("peer+", 0) == 0);
    CHECK(after_abort[size_t(r)] == absl::StatusCode::kFailedPrecondition);
  }
  // The peer calls are bit for bit; NCCL's order of summation is its own, so it agrees
  // within a rounding per rank (bf16 rounds after each step of NCCL's ring).
  for (int r = 0; r < n; ++r) {
    CHECK(cases[0].out[size_t(r)] == cases[0].want);
    CHECK(cases[1].out[size_t(r)] == cases[1].want);
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& k = nccl_cases[i];
    const bool bf16 = k.dtype == DType::bf16;
    const double ulp = bf16 ? 1.0 / 256 : 1.0 / 8388608;
    int64_t bad = 0;
    for (int r = 0; r < n; ++r) {
      for (int64_t e = 0; e < k.count; ++e) {
        auto value = [&](const std::vector<uint8_t>& v) -> double {
          if (!bf16) {
            float x;
            std::memcpy(&x, v.data() + 4 * e, 4);
            return x;
          }
          uint16_t h;
          std::memcpy(&h, v.data() + 2 * e, 2);
          return bf16_to_f32(h);
        };
        double magnitude = 0;
        for (int q = 0; q < n; ++q) magnitude += std::fabs(value(k.in[size_t(q)]));
        const double got_peer = value(cases[i].out[size_t(r)]), got_nccl = value(k.out[size_t(r)]);
        bad += std::fabs(got_peer - got_nccl) > n * ulp * magnitude;
      }
    }
    CAPTURE(i, to_string(k.dtype), k.count);
    CHECK(bad == 0);
  }
  // The group counted only the calls that fit its 64 KiB.
  auto calls = (*g)->calls_completed(0);
  REQUIRE(calls.ok());
  CHECK(*calls == 2);
  CHECK((*g)->status().code() == absl::StatusCode::kAborted);
}

TEST_CASE("peer all-reduce: abort() and the timeout end a kernel whose peers never come", "[gpu][peer][abort]") {
  const Devices devices = devices_or_skip();
  if (devices.empty()) return;
  using Clock = std::chrono::steady_clock;
  for (const bool pushed : {false, true})
    for (const bool by_abort : {true, false}) {
      CAPTURE(pushed, by_abort);
      PeerAllReduceOptions opts;
      opts.timeout_s = by_abort ? 60.0 : 0.25;
      opts.push = pushed;
      auto g = PeerAllReduceGroup::create(devices.gpus, devices.options(opts));
      REQUIRE(g.ok());
      double waited_s = -1;
      // Rank 0 alone calls; the others never do.
      const absl::Status st = run_ranks({devices.gpus[0]}, [&](int r, cudaStream_t stream) -> absl::Status {
        void* mem = nullptr;
        GPU_OK(cudaMalloc(&mem, 4096 * 2));
        GPU_OK(cudaMemset(mem, 0, 4096 * 2));
        const auto t0 = Clock::now();
        if (pushed) {
          // The norm of pushed call 0, whose peers never push (x, w, out: the same zeros).
          KVFUSE_RETURN_IF_ERROR((*g)->push_add_rmsnorm(r, 0, mem, mem, mem, 1, 4096, 1e-5f, mem, stream));
        } else {
          KVFUSE_RETURN_IF_ERROR((*g)->all_reduce_sum(r, mem, 4096, DType::bf16, stream));
        }
        std::thread stopper;
        if (by_abort) {
          stopper = std::thread([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            (*g)->abort();
          });
        }
        const cudaError_t waited = cudaStreamSynchronize(stream);
        waited_s = std::chrono::duration<double>(Clock::now() - t0).count();
        if (stopper.joinable()) stopper.join();
        GPU_OK(waited);
        GPU_OK(cudaFree(mem));
        return absl::OkStatus();
      });
      INFO(st.ToString());
      REQUIRE(st.ok());
      CHECK(waited_s < 20.0);
      const absl::Status why = (*g)->status();
      INFO(why.ToString());
      if (by_abort) {
        CHECK(why.code() == absl::StatusCode::kAborted);
        CHECK(waited_s >= 0.15);
      } else {
        CHECK(why.code() == absl::StatusCode::kDeadlineExceeded);
        CHECK_THAT(std::string(why.message()), Catch::Matchers::ContainsSubstring("rank 0"));
        CHECK(waited_s >= 0.2);
      }
      // A stopped group refuses later calls.
      CHECK((*g)->all_reduce_sum(0, reinterpret_cast<void*>(16), 8, DType::bf16, nullptr).code() ==
            why.code());
    }
}
