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
// At T <= kKvWriteBlockTeamMaxTokens the fused write runs a block per token row
// (kv_write_token_kernel, a lane per 8 elements); the
// "fused fp8, warp/row" rows are the same write with a warp per row (the mapping used
// above that T), the A/B of that choice.
// The RoPE pair (llama3-8b's 32 query heads over the 8 KV heads, positions up to 131072):
// "rope, fused fp8" is launch_rope_neox then the fused write, two launches as the fused
// path runs them; "fused_rope fp8" is launch_kv_write_rope, the one launch of
// kv_write=fused_rope. Both must move the query rows too (read and write), counted in
// their bytes. Each call rotates q and K again (the values stay bounded: rotations).
//
//   bench_kv_write [--json PATH] [--rounds N] [--peak-gbs GBS]
//
// "% of peak" is of the device's peak bandwidth (bench/common/peak_bandwidth.h).
#include "kernels/common/gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/common/gpu_bench.cuh"
#include "kernels/common/enum_name.h"
#include "kernels/kv_write/kv_write.cuh"
#include "kernels/kv_write/kv_write_rope.cuh"
#include "kernels/ops/model_ops.cuh"

namespace {

using namespace kvfuse;
using namespace kvfuse::bench;

constexpr int kHeads = 8;
constexpr int kHeadDim = 128;
constexpr int kRow = kHeads * kHeadDim;
constexpr int kPage = 16;
constexpr int64_t kMaxTokens = 65536;
constexpr int64_t kCacheSlots = 2 * kMaxTokens;
constexpr int kGraphCalls = 100;
constexpr int kQHeads = 32;  // the RoPE arms' query heads (llama3-8b)
constexpr int kQRow = kQHeads * kHeadDim;

// The launch floor: a kernel that only does the PDL handshake of the real ones.
__global__ void empty_kernel() {
  gpu::grid_dependency_wait();
  gpu::launch_dependents();
}

// fused_inv: the fused write as the engine runs it, its cache view carrying 1/scale
// (KvPool keeps it beside the scale); the other fp8 kernels compute the reciprocal.
enum class Kernel { fused, fused_warp_rows, unfused, bf16_store, empty, rope_then_fused, fused_rope, fused_inv };
const char* kernel_name(Kernel k) {
  static constexpr const char* kNames[] = {"fused fp8",     "fused fp8, warp/row", "unfused fp8 (5 launches)",
                                           "bf16 store",    "empty kernel",        "rope, fused fp8",
                                           "fused_rope fp8", "fused fp8, 1/scale kept"};
  return enum_name(k, kNames);
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
  bf16_t* q = nullptr;  // [T, kQRow], the RoPE arms' queries
  int32_t* positions = nullptr;
  float* inv_freq = nullptr;  // [kHeadDim / 2]
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
    case Kernel::fused_inv: {
      KvWriteArgs a = make_args(b, T, false);
      a.cache.k_inv_scale = b.scales + 2;
      a.cache.v_inv_scale = b.scales + 3;
      BENCH_GPU(gpu::launch_kv_write_fused(a, s, l));
      break;
    }
    case Kernel::fused_warp_rows: {
      gpu::KvWriteLaunch warp_rows = l;
      warp_rows.block_team_max_tokens = 0;
      BENCH_GPU(gpu::launch_kv_write_fused(make_args(b, T, false), s, warp_rows));
      break;
    }
    case Kernel::unfused:
      BENCH_GPU(gpu::launch_kv_write_unfused(make_args(b, T, false), b.scratch, s, l));
      break;
    case Kernel::bf16_store:
      BENCH_GPU(gpu::launch_kv_store_bf16(make_args(b, T, true), s, l));
      break;
    case Kernel::empty:
      BENCH_GPU(gpu::launch_kernel(empty_kernel, 1, gpu::kWarpSize, s, l.pdl));
      break;
    case Kernel::rope_then_fused:
      BENCH_GPU(gpu::launch_rope_neox(b.q, kQRow, kQHeads, static_cast<bf16_t*>(b.k), kRow, kHeads, kHeadDim,
                                      b.positions, T, b.inv_freq, 1.0f, s, l.pdl));
      BENCH_GPU(gpu::launch_kv_write_fused(make_args(b, T, false), s, l));
      break;
    case Kernel::fused_rope: {
      KvWriteRopeArgs r;
      r.kv = make_args(b, T, false);
      r.q = b.q;
      r.q_token_stride = kQRow;
      r.q_heads = kQHeads;
      r.positions = b.positions;
      r.inv_freq = b.inv_freq;
      BENCH_GPU(gpu::launch_kv_write_rope(r, s, l));
      break;
    }
  }
}

// Median microseconds per call over `rounds` timed rounds, eager launches.
double time_eager(Kernel k, const Buffers& b, int64_t T, GpuTimer& t, int rounds,
                  const gpu::KvWriteLaunch& l) {
  // Calls per round: enough that a round lasts well over the event resolution.
  const int calls = T >= 16384 ? 10 : 50;
  return t.eager_us([&](cudaStream_t s) { call(k, b, T, s, l); }, calls, 5, rounds);
}

double time_graph(Kernel k, const Buffers& b, int64_t T, GpuTimer& t, int rounds,
                  const gpu::KvWriteLaunch& l) {
  return t.graph_us([&](cudaStream_t s) { call(k, b, T, s, l); }, kGraphCalls, rounds);
}

// Bytes a KV write must move: read K and V rows and the slot mapping, write the rows.
double useful_bytes(Kernel k, int64_t T) {
  if (k == Kernel::empty) return 0;
  const double elems = double(T) * kRow;
  const double out = k == Kernel::bf16_store ? 2.0 : 1.0;
  // The RoPE arms also read and write the query rows and read the positions.
  const double rope =
      k == Kernel::rope_then_fused || k == Kernel::fused_rope ? double(T) * (kQRow * 4.0 + 4) : 0.0;
  return 2 * elems * 2 + double(T) * 8 + 2 * elems * out + rope;
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

// The fused write's thread mapping in a row ("-" for the other kernels); block_threads
// applies to the warp-per-row mapping only.
const char* mapping(const Row& r) {
  if (r.kernel == Kernel::fused_warp_rows) return "warp/row";
  if (r.kernel != Kernel::fused && r.kernel != Kernel::fused_inv) return "-";
  return r.T <= gpu::kKvWriteBlockTeamMaxTokens ? "block/row" : "warp/row";
}

void print_row(const Row& r, const PeakBandwidth& peak) {
  const double gbs = r.useful > 0 ? r.useful / (r.us * 1e3) : 0.0;
  std::printf("%6lld  %-25s %-4s %-6s %10.3f %10.3f %10.1f %7.1f%%", (long long)r.T, kernel_name(r.kernel),
              r.pdl ? "pdl" : "-", r.mode, r.us, r.useful / 1e6, gbs, 100.0 * fraction_of_peak(gbs, peak));
  if (r.moved > r.useful) std::printf("   moved %.1f GB/s", r.moved / (r.us * 1e3));
  if (r.kernel == Kernel::fused && !std::strcmp(mapping(r), "block/row")) {
    std::printf("   block per row");
  } else if (r.block != gpu::kKvWriteBlockThreads && r.kernel == Kernel::fused) {
    std::printf("   block %d", r.block);
  }
  std::printf("\n");
}

std::vector<std::string> json_rows(const std::vector<Row>& rs, const PeakBandwidth& peak) {
  std::vector<std::string> out;
  for (const Row& r : rs) {
    const double gbs = r.useful > 0 ? r.useful / (r.us * 1e3) : 0.0;
    out.push_back(json_object({{"T", r.T},
                               {"kernel", kernel_name(r.kernel)},
                               {"pdl", r.pdl},
                               {"mode", r.mode},
                               {"block", r.block},
                               {"mapping", mapping(r)},
                               {"us_per_call", Fixed{r.us, 4}},
                               {"useful_bytes", Fixed{r.useful, 0}},
                               {"moved_bytes", Fixed{r.moved, 0}},
                               {"gbs", Fixed{gbs, 2}},
                               {"fraction_of_peak", Fixed{fraction_of_peak(gbs, peak), 4}}}));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  KernelBench kb;
  const std::string conversion = gpu::kv_write_conversion_name(KvFormat::fp8_e4m3fn);
  if (auto rc = start_kernel_bench(argc, argv, {"bench_kv_write", 15, false},
                                   "; fp8 conversion: " + conversion, kb))
    return *rc;
  const int rounds = kb.args.rounds;
  const PeakBandwidth& peak = kb.peak;
  std::printf(
      "shape: %d KV heads x %d, page %d, bf16 source, e4m3fn cache, %lld cache slots, random distinct "
      "slots; RoPE arms: %d query heads, fused_rope block %d\n",
      kHeads, kHeadDim, kPage, (long long)kCacheSlots, kQHeads, [] {
        KvWriteRopeArgs r;
        r.kv.cache.num_kv_heads = kHeads;
        r.kv.cache.head_dim = kHeadDim;
        r.q_heads = kQHeads;
        return gpu::kv_write_rope_block_threads(r);
      }());

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
  BENCH_GPU(cudaMalloc(&b.scales, 16));
  BENCH_GPU(cudaMalloc(&b.scratch, gpu::kv_write_scratch_bytes(kMaxTokens, kRow)));
  BENCH_GPU(cudaMalloc(&b.q, size_t(kMaxTokens) * kQRow * 2));
  BENCH_GPU(cudaMalloc(&b.positions, size_t(kMaxTokens) * 4));
  BENCH_GPU(cudaMalloc(&b.inv_freq, kHeadDim / 2 * 4));
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
    // The scales, then their reciprocals (fp32 division is correctly rounded: the bits
    // the kernel's rcp.rn gives).
    const float scales[4] = {0.37f, 2.9f, 1.0f / 0.37f, 1.0f / 2.9f};
    BENCH_GPU(cudaMemcpy(b.scales, scales, 16, cudaMemcpyHostToDevice));
    std::vector<uint16_t> q(size_t(kMaxTokens) * kQRow);
    for (auto& x : q) x = f32_to_bf16(normal(rng) / 40.0f);
    BENCH_GPU(cudaMemcpy(b.q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    std::vector<int32_t> pos(static_cast<size_t>(kMaxTokens));
    std::uniform_int_distribution<int32_t> any_pos(0, 131071);
    for (auto& p : pos) p = any_pos(rng);
    BENCH_GPU(cudaMemcpy(b.positions, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
    std::vector<float> freq(kHeadDim / 2);
    for (int i = 0; i < kHeadDim / 2; ++i) freq[size_t(i)] = float(std::pow(500000.0, -2.0 * i / kHeadDim));
    BENCH_GPU(cudaMemcpy(b.inv_freq, freq.data(), freq.size() * 4, cudaMemcpyHostToDevice));
  }
  GpuTimer timer;

  const int64_t Ts[] = {1, 8, 64, 256, 1024, 4096, 16384, 65536};
  const int block = gpu::kKvWriteBlockThreads;
  gpu::KvWriteLaunch plain, pdl;
  plain.block_threads = pdl.block_threads = block;
  pdl.pdl = true;
  std::vector<Row> rows;
  const auto measure = [&](int64_t T, Kernel k, const gpu::KvWriteLaunch& l, const char* mode) {
    const bool graph = !std::strcmp(mode, "graph");
    const double us = graph ? time_graph(k, b, T, timer, rounds, l) : time_eager(k, b, T, timer, rounds, l);
    rows.push_back({T, k, l.pdl, mode, us, useful_bytes(k, T),
                    k == Kernel::unfused ? unfused_moved_bytes(T) : 0, l.block_threads});
    print_row(rows.back(), peak);
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
      if (T <= gpu::kKvWriteBlockTeamMaxTokens) {
        measure(T, Kernel::fused_warp_rows, plain, mode);
        measure(T, Kernel::fused_warp_rows, pdl, mode);
        measure(T, Kernel::fused_inv, plain, mode);
        measure(T, Kernel::fused_inv, pdl, mode);
      }
      measure(T, Kernel::unfused, plain, mode);
      measure(T, Kernel::unfused, pdl, mode);
      measure(T, Kernel::bf16_store, plain, mode);
      measure(T, Kernel::rope_then_fused, plain, mode);
      measure(T, Kernel::rope_then_fused, pdl, mode);
      measure(T, Kernel::fused_rope, plain, mode);
      measure(T, Kernel::fused_rope, pdl, mode);
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
        gpu::KvWriteLaunch l;
        l.block_threads = bt;
        l.pdl = p;
        const double us = time_graph(Kernel::fused, b, T, timer, rounds, l);
        sweep.push_back({T, Kernel::fused, p, "graph", us, useful_bytes(Kernel::fused, T), 0, bt});
        std::printf("  block %4d: ", bt);
        print_row(sweep.back(), peak);
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
  std::vector<JsonField> targets;
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
    targets.emplace_back(tag, RawJson{json_object({{"fused_small_worst_us", Fixed{worst_small, 4}},
                                                   {"fused_small_met", worst_small <= 1.2},
                                                   {"fused_65536_gbs_graph", Fixed{big, 1}},
                                                   {"fused_65536_gbs_eager", Fixed{big_eager, 1}},
                                                   {"fused_65536_met", big >= 4000},
                                                   {"unfused_over_fused_min", Fixed{min_ratio, 3}},
                                                   {"ratio_met", min_ratio >= 5}})});
  }
  if (!kb.args.json_path.empty()) {
    const std::string shape = json_object({{"num_kv_heads", kHeads},
                                           {"head_dim", kHeadDim},
                                           {"page_size", kPage},
                                           {"cache_slots", kCacheSlots},
                                           {"source", "bf16"},
                                           {"fp8", "e4m3fn"},
                                           {"graph_calls", kGraphCalls}});
    write_results(kb.args.json_path, kb.device, peak, shape,
                  {{"results", json_rows(rows, peak)}, {"fused_block_sweep", json_rows(sweep, peak)}},
                  json_object(targets));
  }
  for (void* p : {b.k, b.v, static_cast<void*>(b.slots), b.fp8_k, b.fp8_v, b.bf16_k, b.bf16_v,
                  static_cast<void*>(b.scales), b.scratch, static_cast<void*>(b.q),
                  static_cast<void*>(b.positions), static_cast<void*>(b.inv_freq)}) {
    BENCH_GPU(cudaFree(p));
  }
  return 0;
}
