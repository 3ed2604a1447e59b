// Decode attention benchmark (issue 5): split and unified paged attention for a decode
// batch of B sequences x context C (B in {1, 8, 64, 256}, C in {512, 4096, 32768}), 32
// query heads over 8 KV heads x 128 (llama3-8b), page 16 with pages scattered at random
// over the pool, fp8 e4m3fn and bf16 caches. Each figure is the median of several timed
// rounds of CUDA-graph replay (several calls captured in one graph, time / calls) after
// warm-up; at the target shape also eager launches, the e4m3fn decode variants and fixed
// split partitions. Bandwidth counts the bytes attention must move: K and V of every
// visible key read once, plus q read and out written (negligible). Shapes whose K+V fit
// twice into L2 are marked: replays keep them in L2, so their GB/s is not HBM.
// Combinations that do not fit the device memory are skipped.
//
//   bench_attention [--json PATH] [--rounds N] [--target-only]
//
// --target-only launches split then unified once each at the target shape (batch 64 x
// context 4096, fp8), eagerly and untimed: for profilers.
#include "kernels/gpu.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.cuh"

namespace {

using namespace kvfuse;

constexpr double kHbmPeakGBs = 4800.0;  // H200 HBM3e
constexpr int kKvHeads = 8;
constexpr int kQHeads = 32;
constexpr int kHeadDim = 128;
constexpr int kPage = 16;
constexpr int kPartition = 512;  // the GPU backend's partition_size
constexpr int64_t kRowElems = int64_t(kKvHeads) * kHeadDim;

#define BENCH_GPU(call)                                                                                   \
  do {                                                                                                    \
    const cudaError_t err_ = (call);                                                                      \
    if (err_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "bench_attention: %s failed: %s (line %d)\n", #call, cudaGetErrorString(err_), \
                   __LINE__);                                                                             \
      std::exit(2);                                                                                       \
    }                                                                                                     \
  } while (0)

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
};

enum class Path { split, unified };

struct Variant {
  Path path = Path::split;
  bool graph = true;
  gpu::AttnLaunch launch{};
  const char* label = "";
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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

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
    BENCH_GPU(gpu::launch_attention_split(a, b.scratch, kPartition, s, v.launch));
  }
}

// Median microseconds per call.
double time_it(const AttnArgs& a, const Buffers& b, const Variant& v, cudaStream_t s, cudaEvent_t e0,
               cudaEvent_t e1, int rounds, double est_us) {
  const int calls = std::max(1, std::min(50, int(2000.0 / std::max(est_us, 1.0))));
  std::vector<double> us;
  if (v.graph) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    BENCH_GPU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) call(a, b, v, s);
    BENCH_GPU(cudaStreamEndCapture(s, &graph));
    BENCH_GPU(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 2; ++i) BENCH_GPU(cudaGraphLaunch(exec, s));
    for (int r = 0; r < rounds; ++r) {
      BENCH_GPU(cudaEventRecord(e0, s));
      BENCH_GPU(cudaGraphLaunch(exec, s));
      BENCH_GPU(cudaEventRecord(e1, s));
      BENCH_GPU(cudaEventSynchronize(e1));
      float ms = 0;
      BENCH_GPU(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(1000.0 * ms / calls);
    }
    BENCH_GPU(cudaGraphExecDestroy(exec));
    BENCH_GPU(cudaGraphDestroy(graph));
  } else {
    for (int i = 0; i < 3; ++i) call(a, b, v, s);
    for (int r = 0; r < rounds; ++r) {
      BENCH_GPU(cudaEventRecord(e0, s));
      for (int i = 0; i < calls; ++i) call(a, b, v, s);
      BENCH_GPU(cudaEventRecord(e1, s));
      BENCH_GPU(cudaEventSynchronize(e1));
      float ms = 0;
      BENCH_GPU(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(1000.0 * ms / calls);
    }
  }
  return median(us);
}

void print_row(const Row& r) {
  const double gbs = r.bytes / (r.us * 1e3);
  char part[32] = "-";
  if (r.partition > 0) std::snprintf(part, sizeof part, "%d", r.partition);
  std::printf("%5d %6d  %-10s %-26s %-5s %6s %10.2f %10.1f %9.1f %6.1f%%%s\n", r.batch, r.ctx, r.dtype,
              r.variant.c_str(), r.graph ? "graph" : "eager", part, r.us, r.bytes / 1e6, gbs,
              100.0 * gbs / kHbmPeakGBs, r.l2_resident ? "  (L2)" : "");
}

void write_json(const char* path, const std::string& device, const std::vector<Row>& rows,
                const std::string& targets) {
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "bench_attention: cannot write %s\n", path);
    return;
  }
  std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"hbm_peak_gbs\": %.0f,\n", device.c_str(), kHbmPeakGBs);
  std::fprintf(f,
               "  \"shape\": {\"num_q_heads\": %d, \"num_kv_heads\": %d, \"head_dim\": %d, \"page_size\": %d, "
               "\"partition_size\": %d, \"decode\": true},\n",
               kQHeads, kKvHeads, kHeadDim, kPage, kPartition);
  std::fprintf(f, "  \"results\": [\n");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double gbs = r.bytes / (r.us * 1e3);
    std::fprintf(f,
                 "    {\"batch\": %d, \"context\": %d, \"dtype\": \"%s\", \"variant\": \"%s\", \"mode\": \"%s\", "
                 "\"partition\": %d, \"us_per_call\": %.3f, \"bytes\": %.0f, \"gbs\": %.1f, "
                 "\"fraction_of_peak\": %.4f, \"l2_resident\": %s}%s\n",
                 r.batch, r.ctx, r.dtype, r.variant.c_str(), r.graph ? "graph" : "eager", r.partition, r.us,
                 r.bytes, gbs, gbs / kHbmPeakGBs, r.l2_resident ? "true" : "false", i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"targets\": %s\n}\n", targets.c_str());
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  int rounds = 7;
  bool target_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) {
      rounds = std::max(3, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--target-only")) {
      target_only = true;
    } else {
      std::fprintf(stderr, "usage: bench_attention [--json PATH] [--rounds N] [--target-only]\n");
      return 2;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIP bench_attention: no GPU\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_GPU(cudaGetDeviceProperties(&prop, 0));
  const std::string device = std::string(prop.name) + " (" + std::to_string(prop.multiProcessorCount) +
                             " SMs, L2 " + std::to_string(prop.l2CacheSize >> 20) + " MB)";
  std::printf("bench_attention on %s\n", device.c_str());
  std::printf("decode: %d q heads over %d KV heads x %d, page %d (scattered), partition_size %d, graph replay\n",
              kQHeads, kKvHeads, kHeadDim, kPage, kPartition);

  const int batches[] = {1, 8, 64, 256};
  const int contexts[] = {512, 4096, 32768};
  const int64_t max_tokens = 256LL * 32768;
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
  BENCH_GPU(cudaMalloc(&b.q, size_t(256) * kQHeads * kHeadDim * 2));
  BENCH_GPU(cudaMalloc(&b.out, size_t(256) * kQHeads * kHeadDim * 2));
  BENCH_GPU(cudaMalloc(&b.query_start, 257 * 4));
  BENCH_GPU(cudaMalloc(&b.context_len, 256 * 4));
  b.table_entries = max_tokens / kPage;
  BENCH_GPU(cudaMalloc(&b.block_table, size_t(b.table_entries) * 4));
  BENCH_GPU(cudaMalloc(&b.scales, 8));
  b.scratch_bytes = gpu::attention_split_scratch_bytes(256, kQHeads, kHeadDim, 32768, kPartition);
  BENCH_GPU(cudaMalloc(&b.scratch, b.scratch_bytes));
  cudaStream_t s;
  cudaEvent_t e0, e1;
  BENCH_GPU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BENCH_GPU(cudaEventCreate(&e0));
  BENCH_GPU(cudaEventCreate(&e1));
  {
    const float scales[2] = {0.37f, 2.9f};
    BENCH_GPU(cudaMemcpy(b.scales, scales, 8, cudaMemcpyHostToDevice));
    std::vector<int32_t> qs(257);
    std::iota(qs.begin(), qs.end(), 0);
    BENCH_GPU(cudaMemcpy(b.query_start, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
    fill(b.q, int64_t(256) * kQHeads * kHeadDim * 2, true, 7u, s);
  }

  std::vector<Row> rows;
  std::printf("\n%5s %6s  %-10s %-26s %-5s %6s %10s %10s %9s %7s\n", "batch", "ctx", "kv dtype", "path", "mode",
              "part", "us/call", "MB", "GB/s", "of peak");
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
        const bool l2 = 2.0 * double(kv_bytes) <= 2.0 * double(prop.l2CacheSize);
        const double est_us = bytes / 3.0e6;
        const bool target_shape = batch == 64 && ctx == 4096 && dt == KvFormat::fp8_e4m3fn;
        std::vector<Variant> variants = {{Path::split, true, {}, "split"}, {Path::unified, true, {}, "unified"}};
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
          for (int32_t part : {512, 1024, 2048, 4096}) {
            gpu::AttnLaunch fixed;
            fixed.split_partition = part;
            variants.push_back({Path::split, true, fixed, part == 512    ? "split, partition 512"
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
          const double us = time_it(a, b, v, s, e0, e1, rounds, est_us);
          const int32_t part = v.path == Path::split ? gpu::attention_split_partition(a, kPartition, v.launch) : 0;
          rows.push_back({batch, ctx, kv_format_name(dt), v.label, v.graph, part, us, bytes, l2});
          print_row(rows.back());
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
    const bool split_met = split_gbs >= 0.8 * kHbmPeakGBs;
    const bool ratio_met = ratio <= 1.25;
    std::printf("\ntargets (H200, batch 64 x context 4096, 32/8 heads x 128, fp8 e4m3fn, graph replay):\n");
    std::printf("  split decode: %.2f us, %.0f GB/s = %.1f%% of %.0f GB/s (target >= 80%%): %s\n", split.us,
                split_gbs, 100.0 * split_gbs / kHbmPeakGBs, kHbmPeakGBs, split_met ? "MET" : "MISSED");
    std::printf("  unified / split: %.2f us / %.2f us = %.3fx (target <= 1.25x): %s\n", unified.us, split.us, ratio,
                ratio_met ? "MET" : "MISSED");
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "{\"split_us\": %.3f, \"split_gbs\": %.1f, \"split_fraction_of_peak\": %.4f, \"split_met\": %s, "
                  "\"unified_us\": %.3f, \"unified_over_split\": %.4f, \"unified_met\": %s}",
                  split.us, split_gbs, split_gbs / kHbmPeakGBs, split_met ? "true" : "false", unified.us, ratio,
                  ratio_met ? "true" : "false");
    targets = buf;
  }
  if (json_path) {
    write_json(json_path, device, rows, targets);
    std::printf("wrote %s\n", json_path);
  }
  for (void* p : {b.k, b.v, static_cast<void*>(b.q), static_cast<void*>(b.out), static_cast<void*>(b.query_start),
                  static_cast<void*>(b.context_len), static_cast<void*>(b.block_table), static_cast<void*>(b.scales),
                  b.scratch}) {
    BENCH_GPU(cudaFree(p));
  }
  BENCH_GPU(cudaEventDestroy(e0));
  BENCH_GPU(cudaEventDestroy(e1));
  BENCH_GPU(cudaStreamDestroy(s));
  return 0;
}
