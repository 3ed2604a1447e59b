// kvfuse-bench-allreduce: the tensor-parallel all-reduce of a decode step, bf16, through
// NcclCommunicator (src/parallel) and, where every pair of GPUs has peer access, through
// the one-shot kernel over peer memory (src/parallel/peer_allreduce.h; --no-peer leaves
// it out), one process and one thread per GPU. For each message size it times one
// all-reduce per call two ways on every rank's own stream:
//   eager: back-to-back calls after a warm-up;
//   graph: --calls calls captured in one CUDA/HIP graph, replayed after two warm-up
//          replays (what a decode step captured with its all-reduces costs per call).
// Each figure is the median over --rounds rounds, the slowest rank's. Bus bandwidth is
// nccl-tests' busbw: bytes / time * 2 (n - 1) / n, what each link carries in a ring.
//
// --share-gpu puts the ranks (--gpus of them, default 2) on GPU 0 and times the peer
// all-reduce alone (NCCL refuses two ranks on one GPU; PeerAllReduceOptions::share_devices,
// a test mode): the kernel's own cost per call, its flags and every rank's staging in one
// GPU's memory. A floor for the same call across GPUs, where each rank reads the others'
// staging over the links; no figure for the links themselves.
//
// --pdl launches the peer all-reduce's calls as programmatic dependents
// (PeerAllReduceOptions::pdl, sm_90+): each call's launch overlaps the call before.
//
// --layers times the reduction as a decoder layer runs it, over the peer group only (on
// --share-gpu's ranks or on GPUs of their own), per layer in a graph of --calls layers:
// rows x 4096 partial sums from a GEMV (k 2048, the o projection of llama3-8b at tp 2) for
// 1, 2 and 8 rows, none for 64 rows (where the library's GEMM would make them), then
//   none:       add_rmsnorm alone (no collective: the floor);
//   all-reduce: all_reduce_sum, then add_rmsnorm;
//   pushed:     the GEMV pushing from its epilogue (64 rows: the copy kernel), then
//               push_add_rmsnorm (src/parallel/peer_allreduce.h, "Pushed partial sums").
// Every kernel as a programmatic dependent where --pdl says so. KVFUSE_GEMV_PUSH_STAGED=0
// has the GEMV store its pushed results one at a time, as the engine's backend does then.
//
// NCCL_NVLS_ENABLE=0 is set unless the environment sets it: NVLink multicast (NVLS) can
// take a shared machine's GPUs out of service, and the decode-sized messages measured
// here do not need it.
#include <algorithm>
#include <array>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/gpu_bench.cuh"
#include "bench/common/json_writer.h"
#include "kernels/gemm/gemv.cuh"
#include "kernels/ops/model_ops.cuh"
#include "kernels/parallel/tp_push.cuh"
#include "src/loading/env_switches.h"
#include "src/parallel/nccl_communicator.h"
#include "src/parallel/peer_allreduce.h"

namespace {

using namespace kvfuse;
using namespace kvfuse::bench;

constexpr const char* kProgram = "kvfuse-bench-allreduce";
constexpr int64_t kSizes[] = {8 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20};

struct Args {
  int gpus = 0;  // 0: every visible GPU
  int calls = 100;
  int rounds = 7;
  double link_gbs = 0;  // 0: from the device name (NVLink 4 on H100/H200), else not shown
  bool peer = true;
  bool share_gpu = false;
  bool pdl = false;  // the peer all-reduce's calls as programmatic dependents (PeerAllReduceOptions::pdl)
  bool layers = false;
  std::string json_path;
};

int usage(FILE* to) {
  std::fprintf(to,
               "usage: %s [--gpus N] [--calls N] [--rounds N] [--link-gbs GBS] [--no-peer] [--share-gpu] "
               "[--pdl] [--layers] [--json PATH]\n",
               kProgram);
  return to == stdout ? 0 : 2;
}

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", kProgram, what.c_str());
  std::exit(2);
}

void check(const absl::Status& st) {
  if (!st.ok()) fail(st.ToString());
}

struct Figures {
  double eager_us = 0, graph_us = 0;
  double peer_eager_us = 0, peer_graph_us = 0;  // the peer all-reduce, when it runs
};

// --share-gpu: `n` ranks on GPU 0, the peer all-reduce only.
int run_shared(const Args& args) {
  const int n = args.gpus > 0 ? args.gpus : 2;
  constexpr size_t kSizeCount = sizeof(kSizes) / sizeof(kSizes[0]);
  PeerAllReduceOptions opts;
  opts.staging_bytes = kSizes[kSizeCount - 1];
  opts.share_devices = true;
  opts.pdl = args.pdl;
  auto g = PeerAllReduceGroup::create(std::vector<int>(size_t(n), 0), opts);
  if (!g.ok()) {
    std::printf("SKIP %s --share-gpu: %s\n", kProgram, std::string(g.status().message()).c_str());
    return 0;
  }
  const std::optional<DeviceInfo> dev = query_device(0);
  if (!dev) fail("cannot query GPU 0");
  std::printf("%s --share-gpu: %d ranks on one %s, the peer all-reduce only (no links between GPUs)%s\n",
              kProgram, n, device_label(*dev).c_str(), args.pdl ? ", calls as programmatic dependents" : "");
  std::printf("bf16 all_reduce_sum, one thread per rank; %d calls per graph, median of %d rounds, slowest rank\n",
              args.calls, args.rounds);
  // The ranks' streams made one after another, each with a first piece of work, and their
  // buffers allocated before any call (src/parallel/peer_allreduce.h, "Ranks sharing a GPU").
  BENCH_GPU(cudaSetDevice(0));
  std::vector<std::unique_ptr<GpuTimer>> timers;
  std::vector<void*> bufs(size_t(n), nullptr);
  for (int r = 0; r < n; ++r) {
    timers.push_back(std::make_unique<GpuTimer>());
    BENCH_GPU(cudaMalloc(&bufs[size_t(r)], size_t(kSizes[kSizeCount - 1])));
    BENCH_GPU(cudaMemsetAsync(bufs[size_t(r)], 0, size_t(kSizes[kSizeCount - 1]), timers.back()->stream()));
    BENCH_GPU(cudaStreamSynchronize(timers.back()->stream()));
  }
  std::vector<std::vector<Figures>> figures(static_cast<size_t>(n), std::vector<Figures>(kSizeCount, Figures{}));
  std::barrier sync(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      BENCH_GPU(cudaSetDevice(0));
      for (size_t s = 0; s < kSizeCount; ++s) {
        const int64_t count = kSizes[s] / 2;
        auto call = [&](cudaStream_t st) { check((*g)->all_reduce_sum(r, bufs[size_t(r)], count, DType::bf16, st)); };
        sync.arrive_and_wait();
        figures[size_t(r)][s].peer_eager_us = timers[size_t(r)]->eager_us(call, args.calls, /*warmup=*/20, args.rounds);
        sync.arrive_and_wait();
        figures[size_t(r)][s].peer_graph_us =
            timers[size_t(r)]->graph_us(call, args.calls, args.rounds, [&] { sync.arrive_and_wait(); });
      }
    });
  }
  for (auto& t : ranks) t.join();
  check((*g)->status());
  for (void* b : bufs) BENCH_GPU(cudaFree(b));
  std::printf("\n%10s %15s %15s\n", "bytes", "peer eager us", "peer graph us");
  std::vector<std::string> rows;
  for (size_t s = 0; s < kSizeCount; ++s) {
    Figures worst;
    for (int r = 0; r < n; ++r) {
      worst.peer_eager_us = std::max(worst.peer_eager_us, figures[size_t(r)][s].peer_eager_us);
      worst.peer_graph_us = std::max(worst.peer_graph_us, figures[size_t(r)][s].peer_graph_us);
    }
    std::printf("%10lld %15.2f %15.2f\n", (long long)kSizes[s], worst.peer_eager_us, worst.peer_graph_us);
    rows.push_back(json_object({{"bytes", kSizes[s]},
                                {"peer_eager_us", Fixed{worst.peer_eager_us, 2}},
                                {"peer_graph_us", Fixed{worst.peer_graph_us, 2}}}));
  }
  if (!args.json_path.empty()) {
    JsonResultsFile f;
    f.str("device", device_label(*dev));
    f.raw("ranks_on_one_gpu", std::to_string(n));
    f.raw("calls_per_graph", std::to_string(args.calls));
    f.rows("allreduce_bf16", rows);
    if (!f.write(args.json_path, kProgram)) return 2;
  }
  return 0;
}

// --layers: the reduction inside a layer, three ways (see the top of the file).
int run_layers(const Args& args, int visible) {
  const bool shared = args.share_gpu;
  const bool staged = env_flag("KVFUSE_GEMV_PUSH_STAGED");
  const int n = args.gpus > 0 ? args.gpus : (shared ? 2 : visible);
  if (!shared && (n < 2 || n > visible)) {
    std::printf("SKIP %s --layers: needs %d GPUs (at least 2), %d visible\n", kProgram, std::max(n, 2),
                visible);
    return 0;
  }
  std::vector<int> devices;
  for (int r = 0; r < n; ++r) devices.push_back(shared ? 0 : r);
  constexpr int64_t kCols = 4096, kK = 2048;
  const int64_t kRows[] = {1, 2, 8, 64};
  constexpr size_t kRowCounts = sizeof(kRows) / sizeof(kRows[0]);
  PeerAllReduceOptions opts;
  opts.share_devices = shared;
  opts.pdl = args.pdl;
  opts.push = true;
  auto g = PeerAllReduceGroup::create(devices, opts);
  if (!g.ok()) {
    std::printf("SKIP %s --layers: %s\n", kProgram, std::string(g.status().message()).c_str());
    return 0;
  }
  PeerAllReduceGroup& group = **g;
  const std::optional<DeviceInfo> dev = query_device(0);
  if (!dev) fail("cannot query GPU 0");
  std::printf("%s --layers: %d ranks on %s%s%s%s\n", kProgram, n, shared ? "one " : "their own ",
              device_label(*dev).c_str(), shared ? " (sharing it: no links between GPUs)" : "",
              args.pdl ? ", programmatic dependents" : "");
  std::printf(
      "per layer: rows x %lld bf16 partial sums (GEMV of k %lld for <= 8 rows), reduced, + residual, "
      "RMSNorm; %d layers per graph, median of %d rounds, slowest rank\n",
      (long long)kCols, (long long)kK, args.calls, args.rounds);
  // us[rank][rows][mode]
  std::vector<std::vector<std::array<double, 3>>> us(static_cast<size_t>(n),
                                                     std::vector<std::array<double, 3>>(kRowCounts));
  std::barrier sync(n);
  std::vector<std::thread> ranks;
  // Buffers and streams made one rank after another, each stream with a first piece of
  // work, before any rank calls (src/parallel/peer_allreduce.h, "Ranks sharing a GPU").
  struct Mem {
    uint16_t *a, *w, *h, *x, *nw;
  };
  std::vector<std::unique_ptr<GpuTimer>> timers;
  std::vector<Mem> mem(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    BENCH_GPU(cudaSetDevice(devices[size_t(r)]));
    timers.push_back(std::make_unique<GpuTimer>());
    const int64_t rows = kRows[kRowCounts - 1];
    const size_t sizes[5] = {size_t(rows * kK), size_t(kCols * kK), size_t(rows * kCols),
                             size_t(rows * kCols), size_t(kCols)};
    uint16_t** ptrs[5] = {&mem[size_t(r)].a, &mem[size_t(r)].w, &mem[size_t(r)].h, &mem[size_t(r)].x,
                          &mem[size_t(r)].nw};
    for (int k = 0; k < 5; ++k) {
      void* p = nullptr;
      BENCH_GPU(cudaMalloc(&p, sizes[k] * 2));
      // Small values (bf16 0x3c00 = 0.0078): sums and norms stay finite over every replay.
      BENCH_GPU(cudaMemsetAsync(p, 0x3c, sizes[k] * 2, timers.back()->stream()));
      *ptrs[k] = static_cast<uint16_t*>(p);
    }
    // Kernels loaded before any rank calls: the GEMV instances and add_rmsnorm.
    for (size_t ri = 0; ri + 1 < kRowCounts; ++ri) {
      const gpu::LaunchStatus ls =
          gpu::launch_gemv_push_bf16(mem[size_t(r)].a, kRows[ri], mem[size_t(r)].w, kCols, kK,
                                     mem[size_t(r)].h, PushTargets{}, timers.back()->stream(), args.pdl);
      if (!ls.ok()) fail("gemv: " + ls.message());
    }
    BENCH_GPU(gpu::launch_add_rmsnorm(mem[size_t(r)].x, mem[size_t(r)].h, mem[size_t(r)].nw, 1, kCols, 1e-5f,
                                      mem[size_t(r)].h, timers.back()->stream(), args.pdl));
    BENCH_GPU(cudaStreamSynchronize(timers.back()->stream()));
  }
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      BENCH_GPU(cudaSetDevice(devices[size_t(r)]));
      const Mem& m = mem[size_t(r)];
      for (size_t ri = 0; ri < kRowCounts; ++ri) {
        const int64_t rows = kRows[ri];
        const bool gemv = rows <= gpu::kGemvMaxRows;
        for (int mode = 0; mode < 3; ++mode) {
          int call = 0;  // the pushed calls of a graph: 0, 1, ... (the model's numbering)
          auto layer = [&](cudaStream_t st) {
            const PushTargets t = mode == 2 ? group.push_targets(r, call) : PushTargets{};
            if (gemv) {
              const gpu::LaunchStatus ls =
                  gpu::launch_gemv_push_bf16(m.a, rows, m.w, kCols, kK, m.h, t, st, args.pdl, 0, true, staged);
              if (!ls.ok()) fail("gemv: " + ls.message());
            } else if (mode == 2) {
              BENCH_GPU(gpu::launch_push_copy(m.h, rows * kCols, t, st, args.pdl));
            }
            if (mode == 2) {
              check(group.push_add_rmsnorm(r, call++, m.h, m.x, m.nw, rows, kCols, 1e-5f, m.h, st));
              return;
            }
            if (mode == 1) check(group.all_reduce_sum(r, m.h, rows * kCols, DType::bf16, st));
            BENCH_GPU(gpu::launch_add_rmsnorm(m.x, m.h, m.nw, rows, kCols, 1e-5f, m.h, st, args.pdl));
          };
          sync.arrive_and_wait();
          us[size_t(r)][ri][size_t(mode)] =
              timers[size_t(r)]->graph_us(layer, args.calls, args.rounds, [&] { sync.arrive_and_wait(); });
        }
      }
    });
  }
  for (auto& t : ranks) t.join();
  check(group.status());
  std::printf("\n%6s %12s %14s %12s %16s %16s\n", "rows", "none us", "all-reduce us", "pushed us",
              "pushed/all-red.", "pushed - none");
  std::vector<std::string> rows_json;
  for (size_t ri = 0; ri < kRowCounts; ++ri) {
    std::array<double, 3> worst{0, 0, 0};
    for (int r = 0; r < n; ++r)
      for (int mode = 0; mode < 3; ++mode)
        worst[size_t(mode)] = std::max(worst[size_t(mode)], us[size_t(r)][ri][size_t(mode)]);
    std::printf("%6lld %12.2f %14.2f %12.2f %16.3f %16.2f\n", (long long)kRows[ri], worst[0], worst[1],
                worst[2], worst[2] / worst[1], worst[2] - worst[0]);
    rows_json.push_back(json_object({{"rows", kRows[ri]},
                                     {"gemv", kRows[ri] <= gpu::kGemvMaxRows},
                                     {"none_us", Fixed{worst[0], 2}},
                                     {"allreduce_us", Fixed{worst[1], 2}},
                                     {"pushed_us", Fixed{worst[2], 2}}}));
  }
  for (const Mem& m : mem)
    for (uint16_t* p : {m.a, m.w, m.h, m.x, m.nw}) BENCH_GPU(cudaFree(p));
  if (!args.json_path.empty()) {
    JsonResultsFile f;
    f.str("device", device_label(*dev));
    f.raw("ranks", std::to_string(n));
    f.raw("shared_gpu", shared ? "true" : "false");
    f.raw("layers_per_graph", std::to_string(args.calls));
    f.rows("layer_reduction_bf16", rows_json);
    if (!f.write(args.json_path, kProgram)) return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const bool v = i + 1 < argc;
    if (!std::strcmp(argv[i], "--gpus") && v) {
      args.gpus = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--calls") && v) {
      args.calls = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--rounds") && v) {
      args.rounds = std::max(3, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--link-gbs") && v) {
      args.link_gbs = std::atof(argv[++i]);
    } else if (!std::strcmp(argv[i], "--no-peer")) {
      args.peer = false;
    } else if (!std::strcmp(argv[i], "--share-gpu")) {
      args.share_gpu = true;
    } else if (!std::strcmp(argv[i], "--pdl")) {
      args.pdl = true;
    } else if (!std::strcmp(argv[i], "--layers")) {
      args.layers = true;
    } else if (!std::strcmp(argv[i], "--json") && v) {
      args.json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      return usage(stdout);
    } else {
      return usage(stderr);
    }
  }
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);

  int visible = 0;
  if (cudaGetDeviceCount(&visible) != cudaSuccess || visible == 0) {
    std::printf("SKIP %s: no GPU\n", kProgram);
    return 0;
  }
  if (args.layers) return run_layers(args, visible);
  if (args.share_gpu) return run_shared(args);
  const int n = args.gpus > 0 ? args.gpus : visible;
  if (n < 2 || n > visible) {
    std::printf("SKIP %s: needs %d GPUs (at least 2), %d visible\n", kProgram, std::max(n, 2), visible);
    return 0;
  }
  auto lib = nccl::NcclLibrary::load();
  if (!lib.ok()) {
    std::printf("SKIP %s: %s\n", kProgram, std::string(lib.status().message()).c_str());
    return 0;
  }
  const std::optional<DeviceInfo> dev = query_device(0);
  if (!dev) fail("cannot query GPU 0");
  if (args.link_gbs == 0 && (dev->name.find("H100") != std::string::npos || dev->name.find("H200") != std::string::npos)) {
    args.link_gbs = 450;  // NVLink 4: 18 links x 25 GB/s per direction
  }
  std::printf("%s on %d x %s, %s %s (%s), NCCL_NVLS_ENABLE=%s\n", kProgram, n, device_label(*dev).c_str(),
              (*lib)->flavour(), (*lib)->version_string().c_str(), (*lib)->path.c_str(), std::getenv("NCCL_NVLS_ENABLE"));
  std::printf("bf16 all_reduce_sum, one thread per GPU; %d calls per graph, median of %d rounds, slowest rank\n",
              args.calls, args.rounds);

  constexpr size_t kSizeCount = sizeof(kSizes) / sizeof(kSizes[0]);
  std::shared_ptr<PeerAllReduceGroup> peer;
  if (args.peer) {
    std::vector<int> devices;
    for (int r = 0; r < n; ++r) devices.push_back(r);
    PeerAllReduceOptions opts;
    opts.staging_bytes = kSizes[kSizeCount - 1];
    opts.pdl = args.pdl;
    auto g = PeerAllReduceGroup::create(devices, opts);
    if (g.ok()) {
      peer = *g;
    } else {
      std::printf("peer all-reduce not timed: %s\n", std::string(g.status().message()).c_str());
    }
  }
  auto id = NcclCommunicator::unique_id(**lib);
  check(id.status());
  std::vector<std::vector<Figures>> figures(static_cast<size_t>(n), std::vector<Figures>(kSizeCount, Figures{}));
  std::barrier sync(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      BENCH_GPU(cudaSetDevice(r));
      GpuTimer timer;  // this rank's stream and events
      void* buf = nullptr;
      BENCH_GPU(cudaMalloc(&buf, size_t(kSizes[kSizeCount - 1])));
      BENCH_GPU(cudaMemset(buf, 0, size_t(kSizes[kSizeCount - 1])));
      auto comm = NcclCommunicator::create(**lib, *id, r, n, r, timer.stream());
      check(comm.status());
      for (size_t s = 0; s < kSizeCount; ++s) {
        const int64_t count = kSizes[s] / 2;
        auto call = [&](cudaStream_t) { check((*comm)->all_reduce_sum(buf, count, DType::bf16)); };
        sync.arrive_and_wait();
        figures[size_t(r)][s].eager_us = timer.eager_us(call, args.calls, /*warmup=*/20, args.rounds);
        sync.arrive_and_wait();
        figures[size_t(r)][s].graph_us = timer.graph_us(call, args.calls, args.rounds);
        if (!peer) continue;
        auto peer_call = [&](cudaStream_t st) { check(peer->all_reduce_sum(r, buf, count, DType::bf16, st)); };
        sync.arrive_and_wait();
        figures[size_t(r)][s].peer_eager_us = timer.eager_us(peer_call, args.calls, /*warmup=*/20, args.rounds);
        sync.arrive_and_wait();
        figures[size_t(r)][s].peer_graph_us = timer.graph_us(peer_call, args.calls, args.rounds);
      }
      if (peer) check(peer->status());
      check((*comm)->barrier());
      comm->reset();
      BENCH_GPU(cudaFree(buf));
    });
  }
  for (auto& t : ranks) t.join();

  const double ring = 2.0 * (n - 1) / n;
  std::printf("\n%10s %10s %10s %12s %12s %8s", "bytes", "eager us", "graph us", "eager GB/s", "graph GB/s",
              args.link_gbs > 0 ? "%link" : "");
  if (peer) std::printf(" %15s %15s %10s", "peer eager us", "peer graph us", "nccl/peer");
  std::printf("\n");
  std::vector<std::string> rows;
  for (size_t s = 0; s < kSizeCount; ++s) {
    Figures worst;
    for (int r = 0; r < n; ++r) {
      const Figures& f = figures[size_t(r)][s];
      worst.eager_us = std::max(worst.eager_us, f.eager_us);
      worst.graph_us = std::max(worst.graph_us, f.graph_us);
      worst.peer_eager_us = std::max(worst.peer_eager_us, f.peer_eager_us);
      worst.peer_graph_us = std::max(worst.peer_graph_us, f.peer_graph_us);
    }
    const double bytes = double(kSizes[s]);
    const double eager_gbs = bytes / (worst.eager_us * 1e3) * ring;
    const double graph_gbs = bytes / (worst.graph_us * 1e3) * ring;
    char pct[32] = "";
    if (args.link_gbs > 0) std::snprintf(pct, sizeof pct, "%.1f%%", 100.0 * graph_gbs / args.link_gbs);
    std::printf("%10lld %10.2f %10.2f %12.1f %12.1f %8s", (long long)kSizes[s], worst.eager_us, worst.graph_us,
                eager_gbs, graph_gbs, pct);
    if (peer) {
      std::printf(" %15.2f %15.2f %10.2f", worst.peer_eager_us, worst.peer_graph_us,
                  worst.graph_us / worst.peer_graph_us);
    }
    std::printf("\n");
    std::vector<JsonField> row = {{"bytes", kSizes[s]},
                                  {"eager_us", Fixed{worst.eager_us, 2}},
                                  {"graph_us", Fixed{worst.graph_us, 2}},
                                  {"eager_busbw_gbs", Fixed{eager_gbs, 1}},
                                  {"graph_busbw_gbs", Fixed{graph_gbs, 1}}};
    if (peer) {
      row.emplace_back("peer_eager_us", Fixed{worst.peer_eager_us, 2});
      row.emplace_back("peer_graph_us", Fixed{worst.peer_graph_us, 2});
    }
    rows.push_back(json_object(row));
  }
  if (args.link_gbs > 0) std::printf("%%link: graph busbw / %.0f GB/s per direction per GPU\n", args.link_gbs);
  if (!args.json_path.empty()) {
    JsonResultsFile f;
    f.str("device", device_label(*dev));
    f.raw("gpus", std::to_string(n));
    f.str("library", std::string((*lib)->flavour()) + " " + (*lib)->version_string());
    f.raw("calls_per_graph", std::to_string(args.calls));
    f.number("link_gbs", Fixed{args.link_gbs, 0});
    f.rows("allreduce_bf16", rows);
    if (!f.write(args.json_path, kProgram)) return 2;
  }
  return 0;
}
