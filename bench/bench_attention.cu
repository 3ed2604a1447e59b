// Decode attention benchmark (issue 5): split and unified paged attention for a decode
// batch of B sequences x context C (by default B in {1, 8, 64, 256}, C in {512, 4096,
// 32768}; --batch and --context give other lists, B up to 256, C up to 32768), 32
// query heads over 8 KV heads x 128 (llama3-8b), page 16 with pages scattered at random
// over the pool, fp8 e4m3fn and bf16 caches. Each figure is the median of several timed
// rounds of CUDA-graph replay (several calls captured in one graph, time / calls) after
// warm-up; at the target shape also eager launches, the e4m3fn decode variants and fixed
// split partitions. Bandwidth counts the bytes attention must move: K and V of every
// visible key read once, plus q read and out written (negligible). Shapes whose K+V fit
// twice into L2 are marked: replays keep them in L2, so their GB/s is not HBM.
// Combinations that do not fit the device memory are skipped.
//
//   bench_attention [--json PATH] [--rounds N] [--peak-gbs GBS] [--target-only]
//                   [--batch N,...] [--context N,...]
//
// --target-only launches split then unified once each at the target shape (batch 64 x
// context 4096, fp8), eagerly and untimed: for profilers. "% of peak" is of the device's
// peak bandwidth (bench/common/peak_bandwidth.h).
#include "kernels/common/gpu.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench/common/gpu_bench.cuh"
#include "kernels/attention/attention.cuh"

namespace {

using namespace kvfuse;
using namespace kvfuse::bench;

constexpr int kKvHeads = 8;
constexpr int kQHeads = 32;
constexpr int kHeadDim = 128;
constexpr int kPage = 16;
constexpr int kPartition = 64;  // the GPU backend's partition_size for decode-only batches
// Scratch for the split path's partial results: every cell's exact need
// (attention_split_scratch_bytes of its arguments) is far below it, and checked.
constexpr size_t kScratchBytes = size_t(64) << 20;
constexpr int64_t kRowElems = int64_t(kKvHeads) * kHeadDim;

// Fills bytes with finite values: FP8 codes with |x| <= 1.875 * 2^(7-7), bf16 values in
// about [-2, 2] (a hash of the index, so nothing is uploaded).
__global__ void fill_kernel(uint8_t* p, int64_t bytes, bool bf16, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes / 4;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // e4m3fn: clear bit 6 of every byte (exponent < 8: no NaN, |x| < 2); bf16: keep the
    // exponent around 2^0 (0x3f80 / 0xbf80 plus mantissa bits).
    const uint32_t v = bf16 ? ((h & 0x807f807fu) | 0x3f003f00u) : (h & 0xbfbfbfbfu);
    reinterpret_cast<uint32_t*>(p)[i] = v;
  }
}

void fill(void* p, int64_t bytes, bool bf16, uint32_t seed, cudaStream_t s) {
  fill_kernel<<<1024, 256, 0, s>>>(static_cast<uint8_t*>(p), bytes, bf16, seed);
  BENCH_GPU(cudaGetLastError());
}

struct Buffers {
  void* k = nullptr;
  void* v = nullptr;
  int64_t cache_bytes = 0;  // capacity of k and of v
  bf16_t* q = nullptr;
  bf16_t* out = nullptr;
  int32_t* query_start = nullptr;
  int32_t* context_len = nullptr;
  int32_t* block_table = nullptr;
  int64_t table_entries = 0;
  float* scales = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  int32_t* merge_counters = nullptr;  // zero; the engine's split path passes them
};

enum class Path { split, unified };

struct Variant {
  Path path = Path::split;
  bool graph = true;
  gpu::AttnLaunch launch{};
  const char* label = "";
  bool merge_kernel = false;  // split: the merge as a kernel of its own (no merge counters)
};

struct Row {
  int batch, ctx;
  const char* dtype;
  std::string variant;
  bool graph;
  int32_t partition;  // split: keys per partition used; unified: 0
  double us, bytes;
  bool l2_resident;
};

AttnArgs make_args(const Buffers& b, int batch, int ctx, KvFormat dt) {
  AttnArgs a;
  a.q = b.q;
  a.q_token_stride = int64_t(kQHeads) * kHeadDim;
  a.out = b.out;
  a.out_token_stride = int64_t(kQHeads) * kHeadDim;
  a.num_q_heads = kQHeads;
  a.softmax_scale = 0.08838834764831845f;
  a.batch.num_seqs = batch;
  a.batch.num_tokens = batch;
  a.batch.query_start = b.query_start;
  a.batch.context_len = b.context_len;
  a.batch.block_table = b.block_table;
  a.batch.max_pages_per_seq = (ctx + kPage - 1) / kPage;
  a.batch.max_query_len = 1;
  a.batch.max_context_len = ctx;
  a.cache.k = b.k;
  a.cache.v = b.v;
  a.cache.num_pages = int64_t(batch) * a.batch.max_pages_per_seq;
  a.cache.page_size = kPage;
  a.cache.num_kv_heads = kKvHeads;
  a.cache.head_dim = kHeadDim;
  a.cache.format = dt;
  a.cache.k_scale = b.scales;
  a.cache.v_scale = b.scales + 1;
  return a;
}

void call(const AttnArgs& a, const Buffers& b, const Variant& v, cudaStream_t s) {
  if (v.path == Path::unified) {
    BENCH_GPU(gpu::launch_attention_unified(a, s, v.launch));
  } else {
    BENCH_GPU(gpu::launch_attention_split(a, b.scratch, kPartition, s, v.launch,
                                          v.merge_kernel ? nullptr : b.merge_counters));
  }
}

// Median microseconds per call.
double time_it(const AttnArgs& a, const Buffers& b, const Variant& v, GpuTimer& t, int rounds,
               double est_us) {
  const int calls = std::max(1, std::min(50, int(2000.0 / std::max(est_us, 1.0))));
  const auto one = [&](cudaStream_t s) { call(a, b, v, s); };
  return v.graph ? t.graph_us(one, calls, rounds) : t.eager_us(one, calls, 3, rounds);
}

void print_row(const Row& r, const PeakBandwidth& peak) {
  const double gbs = r.bytes / (r.us * 1e3);
  char part[32] = "-";
  if (r.partition > 0) std::snprintf(part, sizeof part, "%d", r.partition);
  std::printf("%5d %6d  %-10s %-26s %-5s %6s %10.2f %10.1f %9.1f %6.1f%%%s\n", r.batch, r.ctx, r.dtype,
              r.variant.c_str(), r.graph ? "graph" : "eager", part, r.us, r.bytes / 1e6, gbs,
              100.0 * fraction_of_peak(gbs, peak), r.l2_resident ? "  (L2)" : "");
}

std::vector<std::string> json_rows(const std::vector<Row>& rows, const PeakBandwidth& peak) {
  std::vector<std::string> out;
  for (const Row& r : rows) {
    const double gbs = r.bytes / (r.us * 1e3);
    out.push_back(json_object({{"batch", r.batch},
                               {"context", r.ctx},
                               {"dtype", r.dtype},
                               {"variant", r.variant},
                               {"mode", r.graph ? "graph" : "eager"},
                               {"partition", r.partition},
                               {"us_per_call", Fixed{r.us, 3}},
                               {"bytes", Fixed{r.bytes, 0}},
                               {"gbs", Fixed{gbs, 1}},
                               {"fraction_of_peak", Fixed{fraction_of_peak(gbs, peak), 4}},
                               {"l2_resident", r.l2_resident}}));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  KernelBench kb;
  KernelBenchSpec spec{"bench_attention", 7, true};
  spec.grid = true;
  if (auto rc = start_kernel_bench(argc, argv, spec, "", kb)) return *rc;
  const PeakBandwidth& peak = kb.peak;
  const int rounds = kb.args.rounds;
  const bool target_only = kb.args.target_only;
  std::printf(
      "decode: %d q heads over %d KV heads x %d, page %d (scattered), partition_size %d, graph replay\n",
      kQHeads, kKvHeads, kHeadDim, kPage, kPartition);

  // The grid: --batch and --context, or batch 1, 8, 64, 256 x context 512, 4096, 32768.
  constexpr int kMaxBatch = 256, kMaxContext = 32768;
  const std::vector<int> batches =
      kb.args.batches.empty() ? std::vector<int>{1, 8, 64, 256} : kb.args.batches;
  const std::vector<int> contexts =
      kb.args.contexts.empty() ? std::vector<int>{512, 4096, 32768} : kb.args.contexts;
  for (const auto& [flag, list, most] :
       {std::tuple{"--batch", &batches, kMaxBatch}, std::tuple{"--context", &contexts, kMaxContext}}) {
    for (int v : *list) {
      if (v > most) {
        std::fprintf(stderr, "bench_attention: %s %d: at most %d\n", flag, v, most);
        return 2;
      }
    }
  }
  const int64_t max_tokens = int64_t(kMaxBatch) * kMaxContext;
  Buffers b;
  // K and V capacity: the largest bf16 shape if it fits, else as much as allocates.
  for (int64_t want = max_tokens * kRowElems * 2; want >= (int64_t(1) << 26); want /= 2) {
    void* k = nullptr;
    void* v = nullptr;
    if (cudaMalloc(&k, size_t(want)) == cudaSuccess && cudaMalloc(&v, size_t(want)) == cudaSuccess) {
      b.k = k;
      b.v = v;
      b.cache_bytes = want;
      break;
    }
    if (k) BENCH_GPU(cudaFree(k));
    (void)cudaGetLastError();
  }
  if (!b.k) {
    std::printf("bench_attention: cannot allocate a KV cache\n");
    return 1;
  }
  std::printf("KV cache capacity: 2 x %.1f GB\n", double(b.cache_bytes) / 1e9);
  BENCH_GPU(cudaMalloc(&b.q, size_t(kMaxBatch) * kQHeads * kHeadDim * 2));
  BENCH_GPU(cudaMalloc(&b.out, size_t(kMaxBatch) * kQHeads * kHeadDim * 2));
  BENCH_GPU(cudaMalloc(&b.query_start, (kMaxBatch + 1) * 4));
  BENCH_GPU(cudaMalloc(&b.context_len, kMaxBatch * 4));
  b.table_entries = max_tokens / kPage;
  BENCH_GPU(cudaMalloc(&b.block_table, size_t(b.table_entries) * 4));
  BENCH_GPU(cudaMalloc(&b.scales, 8));
  b.scratch_bytes = kScratchBytes;
  BENCH_GPU(cudaMalloc(&b.scratch, b.scratch_bytes));
  BENCH_GPU(cudaMalloc(&b.merge_counters, kMaxBatch * kKvHeads * sizeof(int32_t)));
  BENCH_GPU(cudaMemset(b.merge_counters, 0, kMaxBatch * kKvHeads * sizeof(int32_t)));
  GpuTimer timer;
  const cudaStream_t s = timer.stream();
  {
    const float scales[2] = {0.37f, 2.9f};
    BENCH_GPU(cudaMemcpy(b.scales, scales, 8, cudaMemcpyHostToDevice));
    std::vector<int32_t> qs(kMaxBatch + 1);
    std::iota(qs.begin(), qs.end(), 0);
    BENCH_GPU(cudaMemcpy(b.query_start, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
    fill(b.q, int64_t(kMaxBatch) * kQHeads * kHeadDim * 2, true, 7u, s);
  }

  std::vector<Row> rows;
  std::printf("\n%5s %6s  %-10s %-26s %-5s %6s %10s %10s %9s %7s\n", "batch", "ctx", "kv dtype", "path",
              "mode", "part", "us/call", "MB", "GB/s", "of peak");
  for (int batch : batches) {
    for (int ctx : contexts) {
      if (target_only && (batch != 64 || ctx != 4096)) continue;
      const int64_t tokens = int64_t(batch) * ctx;
      const int32_t pages_per_seq = (ctx + kPage - 1) / kPage;
      {
        // Every sequence at context ctx; pages a random permutation of the pool.
        std::vector<int32_t> cl(size_t(batch), ctx);
        BENCH_GPU(cudaMemcpy(b.context_len, cl.data(), cl.size() * 4, cudaMemcpyHostToDevice));
        std::vector<int32_t> table(size_t(int64_t(batch) * pages_per_seq));
        std::iota(table.begin(), table.end(), 0);
        std::mt19937 rng(uint32_t(batch * 131 + ctx));
        std::shuffle(table.begin(), table.end(), rng);
        BENCH_GPU(cudaMemcpy(b.block_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
      }
      for (KvFormat dt : {KvFormat::fp8_e4m3fn, KvFormat::bf16}) {
        if (target_only && dt != KvFormat::fp8_e4m3fn) continue;
        const int eb = kv_format_bytes(dt);
        const int64_t kv_bytes = tokens * kRowElems * eb;  // of K (and of V)
        if (kv_bytes > b.cache_bytes) {
          std::printf("%5d %6d  %-10s skipped: %.1f GB per K and V exceeds the allocation\n", batch, ctx,
                      kv_format_name(dt), double(kv_bytes) / 1e9);
          continue;
        }
        fill(b.k, kv_bytes, dt == KvFormat::bf16, 11u, s);
        fill(b.v, kv_bytes, dt == KvFormat::bf16, 13u, s);
        BENCH_GPU(cudaStreamSynchronize(s));
        const AttnArgs a = make_args(b, batch, ctx, dt);
        const double bytes = 2.0 * double(kv_bytes) + 2.0 * batch * kQHeads * kHeadDim * 2;
        const bool l2 = 2.0 * double(kv_bytes) <= 2.0 * double(kb.device.l2_bytes);
        const double est_us = bytes / 3.0e6;
        const bool target_shape = batch == 64 && ctx == 4096 && dt == KvFormat::fp8_e4m3fn;
        std::vector<Variant> variants = {{Path::split, true, {}, "split"},
                                         {Path::unified, true, {}, "unified"}};
        if (target_shape) {
          gpu::AttnLaunch bits;
          bits.fp8_decode = 1;
          gpu::AttnLaunch pdl;
          pdl.pdl = true;
          variants.push_back({Path::split, false, {}, "split"});
          variants.push_back({Path::unified, false, {}, "unified"});
          variants.push_back({Path::split, true, bits, "split, e4m3 bit decode"});
          variants.push_back({Path::unified, true, bits, "unified, e4m3 bit decode"});
          variants.push_back({Path::split, true, pdl, "split, pdl"});
          variants.push_back({Path::split, true, {}, "split, merge kernel", true});
          for (int32_t part : {512, 1024, 2048, 4096}) {
            gpu::AttnLaunch fixed;
            fixed.split_partition = part;
            variants.push_back({Path::split, true, fixed,
                                part == 512    ? "split, partition 512"
                                : part == 1024 ? "split, partition 1024"
                                : part == 2048 ? "split, partition 2048"
                                               : "split, partition 4096"});
          }
        }
        if (target_only) {
          call(a, b, variants[0], s);
          call(a, b, variants[1], s);
          BENCH_GPU(cudaStreamSynchronize(s));
          std::printf("target shape: split (partition %d) and unified launched once\n",
                      gpu::attention_split_partition(a, kPartition, variants[0].launch));
          continue;
        }
        for (const Variant& v : variants) {
          if (v.path == Path::split && gpu::attention_split_scratch_bytes(a, kPartition, v.launch) > b.scratch_bytes) {
            std::fprintf(stderr, "bench_attention: batch %d x %d needs more split scratch than %zu bytes\n", batch,
                         ctx, b.scratch_bytes);
            return 1;
          }
          const double us = time_it(a, b, v, timer, rounds, est_us);
          const int32_t part =
              v.path == Path::split ? gpu::attention_split_partition(a, kPartition, v.launch) : 0;
          rows.push_back({batch, ctx, kv_format_name(dt), v.label, v.graph, part, us, bytes, l2});
          print_row(rows.back(), peak);
        }
      }
    }
  }
  std::printf("((L2): K+V fit in twice the L2 and stay there across replays: not an HBM figure)\n");

  // Targets of issue 5.
  const auto find = [&](const char* variant, bool graph) {
    for (const Row& r : rows) {
      if (r.batch == 64 && r.ctx == 4096 && !std::strcmp(r.dtype, "fp8_e4m3fn") && r.variant == variant &&
          r.graph == graph)
        return r;
    }
    return Row{0, 0, "", "", false, 0, 0.0, 0.0, false};
  };
  const Row split = find("split", true), unified = find("unified", true);
  std::string targets = "{}";
  if (split.us > 0 && unified.us > 0) {
    const double split_gbs = split.bytes / (split.us * 1e3);
    const double ratio = unified.us / split.us;
    const bool split_met = split_gbs >= 0.8 * peak.gbs;
    const bool ratio_met = ratio <= 1.25;
    std::printf("\ntargets (H200, batch 64 x context 4096, 32/8 heads x 128, fp8 e4m3fn, graph replay):\n");
    std::printf("  split decode: %.2f us, %.0f GB/s = %.1f%% of %.0f GB/s (target >= 80%%): %s\n", split.us,
                split_gbs, 100.0 * fraction_of_peak(split_gbs, peak), peak.gbs, split_met ? "MET" : "MISSED");
    std::printf("  unified / split: %.2f us / %.2f us = %.3fx (target <= 1.25x): %s\n", unified.us, split.us,
                ratio, ratio_met ? "MET" : "MISSED");
    targets = json_object({{"split_us", Fixed{split.us, 3}},
                           {"split_gbs", Fixed{split_gbs, 1}},
                           {"split_fraction_of_peak", Fixed{fraction_of_peak(split_gbs, peak), 4}},
                           {"split_met", split_met},
                           {"unified_us", Fixed{unified.us, 3}},
                           {"unified_over_split", Fixed{ratio, 4}},
                           {"unified_met", ratio_met}});
  }
  if (!kb.args.json_path.empty()) {
    const std::string shape = json_object({{"num_q_heads", kQHeads},
                                           {"num_kv_heads", kKvHeads},
                                           {"head_dim", kHeadDim},
                                           {"page_size", kPage},
                                           {"partition_size", kPartition},
                                           {"decode", true}});
    write_results(kb.args.json_path, kb.device, peak, shape, {{"results", json_rows(rows, peak)}}, targets);
  }
  for (void* p : {b.k, b.v, static_cast<void*>(b.q), static_cast<void*>(b.out),
                  static_cast<void*>(b.query_start), static_cast<void*>(b.context_len),
                  static_cast<void*>(b.block_table), static_cast<void*>(b.scales), b.scratch,
                  static_cast<void*>(b.merge_counters)}) {
    BENCH_GPU(cudaFree(p));
  }
  return 0;
}
