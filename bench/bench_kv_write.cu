// KV write kernel benchmark (issue 3): the fused FP8 write, our unfused 5-launch path
// and the bf16 store, for T in {1 .. 65536} new tokens of 8 KV heads x 128 (bf16
// source, page 16, random distinct slots over a 131072-slot cache, k_scale 0.37,
// v_scale 2.9), in CUDA-graph replay (100 calls captured in one graph, time / 100) and
// in eager launches (back-to-back calls between two events, time / calls). Each figure
// is the median of several timed rounds after warm-up. Bandwidth counts the bytes a
// write must move (source K and V read, slot mapping read, cache rows written); for the
// unfused path the bytes it really moves (fp32 scratch round trips) are listed too.
// Caveat printed with the table: up to T = 4096 everything fits in the 50 MB L2 of an
// H200 and stays there across replays, so small-T bandwidth can exceed HBM peak; those
// rows measure launch cost and latency, the large-T rows measure HBM.
//
//   bench_kv_write [--json PATH] [--rounds N]
#include "kernels/gpu.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/kv_write.cuh"

namespace {

using namespace kvfuse;

constexpr double kHbmPeakGBs = 4800.0;  // H200 HBM3e
constexpr int kHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kRow = kHeads * kHeadDim;
constexpr int kPage = 16;
constexpr int64_t kMaxTokens = 65536;
constexpr int64_t kCacheSlots = 2 * kMaxTokens;
constexpr int kGraphCalls = 100;

#define BENCH_GPU(call)                                                                                  \
  do {                                                                                                   \
    const cudaError_t err_ = (call);                                                                     \
    if (err_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "bench_kv_write: %s failed: %s (line %d)\n", #call, cudaGetErrorString(err_), \
                   __LINE__);                                                                            \
      std::exit(2);                                                                                      \
    }                                                                                                    \
  } while (0)

// The launch floor: a kernel that only does the PDL handshake of the real ones.
__global__ void empty_kernel() {
  gpu::grid_dependency_wait();
  gpu::launch_dependents();
}

enum class Kernel { fused, unfused, bf16_store, empty };
const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::fused:
      return "fused fp8";
    case Kernel::unfused:
      return "unfused fp8 (5 launches)";
    case Kernel::bf16_store:
      return "bf16 store";
    case Kernel::empty:
      return "empty kernel";
  }
  return "?";
}

struct Buffers {
  void* k = nullptr;
  void* v = nullptr;
  int64_t* slots = nullptr;
  void* fp8_k = nullptr;
  void* fp8_v = nullptr;
  void* bf16_k = nullptr;
  void* bf16_v = nullptr;
  float* scales = nullptr;
  void* scratch = nullptr;
};

KvWriteArgs make_args(const Buffers& b, int64_t T, bool bf16_cache) {
  KvWriteArgs a;
  a.k = b.k;
  a.v = b.v;
  a.k_token_stride = a.v_token_stride = kRow;
  a.num_tokens = T;
  a.slot_mapping = b.slots;
  a.cache.k = bf16_cache ? b.bf16_k : b.fp8_k;
  a.cache.v = bf16_cache ? b.bf16_v : b.fp8_v;
  a.cache.num_pages = kCacheSlots / kPage;
  a.cache.page_size = kPage;
  a.cache.num_kv_heads = kHeads;
  a.cache.head_dim = kHeadDim;
  a.cache.format = bf16_cache ? KvFormat::bf16 : KvFormat::fp8_e4m3fn;
  a.cache.k_scale = b.scales;
  a.cache.v_scale = b.scales + 1;
  return a;
}

// One call of the kernel under test.
void call(Kernel k, const Buffers& b, int64_t T, cudaStream_t s, const gpu::KvWriteLaunch& l) {
  switch (k) {
    case Kernel::fused:
      BENCH_GPU(gpu::launch_kv_write_fused(make_args(b, T, false), s, l));
      break;
    case Kernel::unfused:
      BENCH_GPU(gpu::launch_kv_write_unfused(make_args(b, T, false), b.scratch, s, l));
      break;
    case Kernel::bf16_store:
      BENCH_GPU(gpu::launch_kv_store_bf16(make_args(b, T, true), s, l));
      break;
    case Kernel::empty:
      BENCH_GPU(gpu::launch_kernel(empty_kernel, 1, gpu::kWarpSize, s, l.pdl));
      break;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds per call over `rounds` timed rounds.
double time_eager(Kernel k, const Buffers& b, int64_t T, cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1,
                  int rounds, const gpu::KvWriteLaunch& l) {
  // Calls per round: enough that a round lasts well over the event resolution.
  const int calls = T >= 16384 ? 10 : 50;
  for (int i = 0; i < 5; ++i) call(k, b, T, s, l);
  std::vector<double> us;
  for (int r = 0; r < rounds; ++r) {
    BENCH_GPU(cudaEventRecord(e0, s));
    for (int i = 0; i < calls; ++i) call(k, b, T, s, l);
    BENCH_GPU(cudaEventRecord(e1, s));
    BENCH_GPU(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_GPU(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(1000.0 * ms / calls);
  }
  return median(us);
}

double time_graph(Kernel k, const Buffers& b, int64_t T, cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1,
                  int rounds, const gpu::KvWriteLaunch& l) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  BENCH_GPU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kGraphCalls; ++i) call(k, b, T, s, l);
  BENCH_GPU(cudaStreamEndCapture(s, &graph));
  BENCH_GPU(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 2; ++i) BENCH_GPU(cudaGraphLaunch(exec, s));
  std::vector<double> us;
  for (int r = 0; r < rounds; ++r) {
    BENCH_GPU(cudaEventRecord(e0, s));
    BENCH_GPU(cudaGraphLaunch(exec, s));
    BENCH_GPU(cudaEventRecord(e1, s));
    BENCH_GPU(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_GPU(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(1000.0 * ms / kGraphCalls);
  }
  BENCH_GPU(cudaGraphExecDestroy(exec));
  BENCH_GPU(cudaGraphDestroy(graph));
  return median(us);
}

// Bytes a KV write must move: read K and V rows and the slot mapping, write the rows.
double useful_bytes(Kernel k, int64_t T) {
  if (k == Kernel::empty) return 0;
  const double elems = double(T) * kRow;
  const double out = k == Kernel::bf16_store ? 2.0 : 1.0;
  return 2 * elems * 2 + double(T) * 8 + 2 * elems * out;
}

// Bytes the unfused path really moves: scale (read 2, write 4), cast (read 4, write 1),
// scatter (read 1 + slot, write 1), for K and for V.
double unfused_moved_bytes(int64_t T) {
  const double elems = double(T) * kRow;
  return 2 * elems * (2 + 4) + 2 * elems * (4 + 1) + 2 * elems * (1 + 1) + double(T) * 8;
}

struct Row {
  int64_t T;
  Kernel kernel;
  bool pdl;
  const char* mode;
  double us;
  double useful;
  double moved;
  int block;
};

void print_row(const Row& r) {
  const double gbs = r.useful > 0 ? r.useful / (r.us * 1e3) : 0.0;
  std::printf("%6lld  %-25s %-4s %-6s %10.3f %10.3f %10.1f %7.1f%%", (long long)r.T, kernel_name(r.kernel),
              r.pdl ? "pdl" : "-", r.mode, r.us, r.useful / 1e6, gbs, 100.0 * gbs / kHbmPeakGBs);
  if (r.moved > r.useful) std::printf("   moved %.1f GB/s", r.moved / (r.us * 1e3));
  if (r.block != gpu::kKvWriteBlockThreads && r.kernel == Kernel::fused) std::printf("   block %d", r.block);
  std::printf("\n");
}

void write_json(const char* path, const std::string& device, const std::vector<Row>& rows,
                const std::vector<Row>& sweep, const std::string& targets_json) {
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "bench_kv_write: cannot write %s\n", path);
    return;
  }
  std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"hbm_peak_gbs\": %.0f,\n", device.c_str(), kHbmPeakGBs);
  std::fprintf(
      f,
      "  \"shape\": {\"num_kv_heads\": %d, \"head_dim\": %d, \"page_size\": %d, \"cache_slots\": %lld, "
      "\"source\": \"bf16\", \"fp8\": \"e4m3fn\", \"graph_calls\": %d},\n",
      kHeads, kHeadDim, kPage, (long long)kCacheSlots, kGraphCalls);
  const auto emit = [&](const char* name, const std::vector<Row>& rs, bool last) {
    std::fprintf(f, "  \"%s\": [\n", name);
    for (size_t i = 0; i < rs.size(); ++i) {
      const Row& r = rs[i];
      const double gbs = r.useful > 0 ? r.useful / (r.us * 1e3) : 0.0;
      std::fprintf(f,
                   "    {\"T\": %lld, \"kernel\": \"%s\", \"pdl\": %s, \"mode\": \"%s\", \"block\": %d, "
                   "\"us_per_call\": %.4f, \"useful_bytes\": %.0f, \"moved_bytes\": %.0f, \"gbs\": %.2f, "
                   "\"fraction_of_peak\": %.4f}%s\n",
                   (long long)r.T, kernel_name(r.kernel), r.pdl ? "true" : "false", r.mode, r.block, r.us,
                   r.useful, r.moved, gbs, gbs / kHbmPeakGBs, i + 1 < rs.size() ? "," : "");
    }
    std::fprintf(f, "  ]%s\n", last ? "" : ",");
  };
  emit("results", rows, false);
  emit("fused_block_sweep", sweep, false);
  std::fprintf(f, "  \"targets\": %s\n}\n", targets_json.c_str());
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  int rounds = 15;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) {
      rounds = std::max(3, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: bench_kv_write [--json PATH] [--rounds N]\n");
      return 2;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIP bench_kv_write: no GPU\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_GPU(cudaGetDeviceProperties(&prop, 0));
  const std::string device = std::string(prop.name) + " (" + std::to_string(prop.multiProcessorCount) +
                             " SMs, L2 " + std::to_string(prop.l2CacheSize >> 20) + " MB)";
  std::printf("bench_kv_write on %s; fp8 conversion: %s\n", device.c_str(),
              gpu::kv_write_conversion_name(KvFormat::fp8_e4m3fn).c_str());
  std::printf(
      "shape: %d KV heads x %d, page %d, bf16 source, e4m3fn cache, %lld cache slots, random distinct "
      "slots\n",
      kHeads, kHeadDim, kPage, (long long)kCacheSlots);

  // Buffers for the largest T, reused by every T.
  Buffers b;
  const size_t src_bytes = size_t(kMaxTokens) * kRow * 2;
  BENCH_GPU(cudaMalloc(&b.k, src_bytes));
  BENCH_GPU(cudaMalloc(&b.v, src_bytes));
  BENCH_GPU(cudaMalloc(&b.slots, size_t(kMaxTokens) * 8));
  BENCH_GPU(cudaMalloc(&b.fp8_k, size_t(kCacheSlots) * kRow));
  BENCH_GPU(cudaMalloc(&b.fp8_v, size_t(kCacheSlots) * kRow));
  BENCH_GPU(cudaMalloc(&b.bf16_k, size_t(kCacheSlots) * kRow * 2));
  BENCH_GPU(cudaMalloc(&b.bf16_v, size_t(kCacheSlots) * kRow * 2));
  BENCH_GPU(cudaMalloc(&b.scales, 8));
  BENCH_GPU(cudaMalloc(&b.scratch, gpu::kv_write_scratch_bytes(kMaxTokens, kRow)));
  {
    std::mt19937_64 rng(42);
    std::normal_distribution<float> normal(0.0f, 40.0f);
    std::vector<uint16_t> host(size_t(kMaxTokens) * kRow);
    for (auto& x : host) x = f32_to_bf16(normal(rng));
    BENCH_GPU(cudaMemcpy(b.k, host.data(), src_bytes, cudaMemcpyHostToDevice));
    std::shuffle(host.begin(), host.end(), rng);
    BENCH_GPU(cudaMemcpy(b.v, host.data(), src_bytes, cudaMemcpyHostToDevice));
    std::vector<int64_t> perm(static_cast<size_t>(kCacheSlots));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);  // every T uses a prefix: distinct, scattered slots
    BENCH_GPU(cudaMemcpy(b.slots, perm.data(), size_t(kMaxTokens) * 8, cudaMemcpyHostToDevice));
    const float scales[2] = {0.37f, 2.9f};
    BENCH_GPU(cudaMemcpy(b.scales, scales, 8, cudaMemcpyHostToDevice));
  }
  cudaStream_t s;
  cudaEvent_t e0, e1;
  BENCH_GPU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BENCH_GPU(cudaEventCreate(&e0));
  BENCH_GPU(cudaEventCreate(&e1));

  const int64_t Ts[] = {1, 8, 64, 256, 1024, 4096, 16384, 65536};
  const int block = gpu::kKvWriteBlockThreads;
  const gpu::KvWriteLaunch plain{block, false}, pdl{block, true};
  std::vector<Row> rows;
  const auto measure = [&](int64_t T, Kernel k, const gpu::KvWriteLaunch& l, const char* mode) {
    const bool graph = !std::strcmp(mode, "graph");
    const double us =
        graph ? time_graph(k, b, T, s, e0, e1, rounds, l) : time_eager(k, b, T, s, e0, e1, rounds, l);
    rows.push_back({T, k, l.pdl, mode, us, useful_bytes(k, T),
                    k == Kernel::unfused ? unfused_moved_bytes(T) : 0, l.block_threads});
    print_row(rows.back());
  };
  std::printf("\n%6s  %-25s %-4s %-6s %10s %10s %10s %8s\n", "T", "kernel", "pdl", "mode", "us/call", "MB",
              "GB/s", "of peak");
  for (const char* mode : {"graph", "eager"}) {
    measure(0, Kernel::empty, plain, mode);
    measure(0, Kernel::empty, pdl, mode);
  }
  for (int64_t T : Ts) {
    for (const char* mode : {"graph", "eager"}) {
      measure(T, Kernel::fused, plain, mode);
      measure(T, Kernel::fused, pdl, mode);
      measure(T, Kernel::unfused, plain, mode);
      measure(T, Kernel::unfused, pdl, mode);
      measure(T, Kernel::bf16_store, plain, mode);
    }
  }
  std::printf("(T <= 4096: source, slots and cache rows stay in L2 across calls; GB/s there is not HBM)\n");

  // Block-size sweep of the fused write (graph replay), to show the chosen default.
  std::vector<Row> sweep;
  std::printf("\nfused write, block-size sweep (graph replay):\n");
  for (int64_t T : {int64_t(256), int64_t(65536)}) {
    for (int bt : {32, 64, 128, 256}) {
      if (bt % gpu::kWarpSize || bt > gpu::kKvWriteMaxBlockThreads) continue;
      for (bool p : {false, true}) {
        const gpu::KvWriteLaunch l{bt, p};
        const double us = time_graph(Kernel::fused, b, T, s, e0, e1, rounds, l);
        sweep.push_back({T, Kernel::fused, p, "graph", us, useful_bytes(Kernel::fused, T), 0, bt});
        std::printf("  block %4d: ", bt);
        print_row(sweep.back());
      }
    }
  }

  // Targets of issue 3, for plain launches and for PDL launches.
  const auto find = [&](int64_t T, Kernel k, bool p, const char* mode) {
    for (const Row& r : rows) {
      if (r.T == T && r.kernel == k && r.pdl == p && !std::strcmp(r.mode, mode)) return r.us;
    }
    return -1.0;
  };
  std::string targets = "{";
  std::printf("\ntargets (H200):\n");
  for (bool p : {false, true}) {
    const char* tag = p ? "pdl" : "plain";
    double worst_small = 0, min_ratio = 1e30;
    for (int64_t T : {1, 8, 64, 256}) {
      worst_small = std::max(worst_small, find(T, Kernel::fused, p, "graph"));
      min_ratio =
          std::min(min_ratio, find(T, Kernel::unfused, p, "graph") / find(T, Kernel::fused, p, "graph"));
    }
    const double big = useful_bytes(Kernel::fused, 65536) / (find(65536, Kernel::fused, p, "graph") * 1e3);
    const double big_eager =
        useful_bytes(Kernel::fused, 65536) / (find(65536, Kernel::fused, p, "eager") * 1e3);
    std::printf("  [%s launches]\n", tag);
    std::printf("    fused, T<=256, graph replay: worst %.3f us/call (target <= 1.2): %s\n", worst_small,
                worst_small <= 1.2 ? "MET" : "MISSED");
    std::printf("    fused, T=65536: %.0f GB/s graph, %.0f GB/s eager (target >= 4000): %s\n", big, big_eager,
                big >= 4000 ? "MET" : "MISSED");
    std::printf("    unfused / fused, T<=256, graph replay: min %.2fx (target >= 5x): %s\n", min_ratio,
                min_ratio >= 5 ? "MET" : "MISSED");
    char buf[512];
    std::snprintf(
        buf, sizeof buf,
        "%s\"%s\": {\"fused_small_worst_us\": %.4f, \"fused_small_met\": %s, \"fused_65536_gbs_graph\": "
        "%.1f, "
        "\"fused_65536_gbs_eager\": %.1f, \"fused_65536_met\": %s, \"unfused_over_fused_min\": %.3f, "
        "\"ratio_met\": %s}",
        p ? ", " : "", tag, worst_small, worst_small <= 1.2 ? "true" : "false", big, big_eager,
        big >= 4000 ? "true" : "false", min_ratio, min_ratio >= 5 ? "true" : "false");
    targets += buf;
  }
  targets += "}";
  if (json_path) {
    write_json(json_path, device, rows, sweep, targets);
    std::printf("wrote %s\n", json_path);
  }
  for (void* p : {b.k, b.v, static_cast<void*>(b.slots), b.fp8_k, b.fp8_v, b.bf16_k, b.bf16_v,
                  static_cast<void*>(b.scales), b.scratch}) {
    BENCH_GPU(cudaFree(p));
  }
  return 0;
}
