// GPU KV write parity (kernels/kv_write/kv_write.cuh) against the CPU reference
// (kernels/cpu/kv_write/kv_write.h): whole K and V cache buffers byte-identical after the fused
// and the unfused write, for every cache dtype (e4m3fn, e4m3fnuz, e5m2, bf16), both
// source dtypes, head_dim 64/128/256, page sizes 1/3/16/64, with and without an SWA
// table, k_scale != v_scale != 1, values beyond the format's range, +-inf, NaN,
// negative, out-of-range and SWA-unmapped slots, strided, padded and misaligned source
// rows; and the inputs unchanged afterwards. Decode sizes (T = 1 .. 8) through both
// thread mappings of the fused write (a block per row and a warp per row), with row
// widths that leave lanes, warps or loop passes partly used. Also: every bf16 value
// through the kernels at scale 1 against the H200 instruction's files, CUDA-graph
// replays with padding slots (T = 64, 8 and 1), and the unsupported-argument path.
// Without a GPU it skips.
#include "kernels/common/gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/kv_write/kv_write.h"
#include "kernels/kv_write/kv_write.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using gpu_test::check;
using gpu_test::DeviceMem;

enum class Path { fused, unfused };

struct Case {
  KvFormat dtype = KvFormat::fp8_e4m3fn;
  KvSrcDtype src = KvSrcDtype::bf16;
  int32_t num_kv_heads = 2;
  int32_t head_dim = 128;
  int32_t page_size = 16;
  int64_t num_tokens = 48;
  int64_t stride_pad = 0;  // extra elements between source rows (a QKV view)
  int64_t src_offset = 0;  // elements between the allocation and row 0: 1 = misaligned
  float k_scale = 0.37f;
  float v_scale = 2.9f;
  bool swa = false;
  bool pdl = false;  // programmatic dependent launch (CUDA sm_90+)
  bool inv_scales = false;  // the view carries 1/scale (PagedKvView::k_inv_scale), as the pool's do
  // KvWriteLaunch::block_team_max_tokens: which thread mapping the fused write uses.
  int block_team_max_tokens = gpu::kKvWriteBlockTeamMaxTokens;
  uint64_t seed = 1;
};

// The fused write's mapping for a case: a block per row or a warp per row.
constexpr int kBlockTeamAlways = std::numeric_limits<int>::max();
constexpr int kWarpTeamAlways = 0;

std::string describe(const Case& c, Path p) {
  return std::string(p == Path::fused ? "fused " : "unfused ") + kv_format_name(c.dtype) +
         (c.src == KvSrcDtype::f16 ? " f16-src" : " bf16-src") + " H=" + std::to_string(c.num_kv_heads) +
         " D=" + std::to_string(c.head_dim) + " page=" + std::to_string(c.page_size) +
         " T=" + std::to_string(c.num_tokens) + " pad=" + std::to_string(c.stride_pad) +
         " off=" + std::to_string(c.src_offset) + " ks=" + std::to_string(c.k_scale) + (c.inv_scales ? " inv" : "") +
         " vs=" + std::to_string(c.v_scale) + (c.swa ? " swa" : "") + (c.pdl ? " pdl" : "") +
         (p == Path::fused ? (c.num_tokens <= c.block_team_max_tokens ? " block/row" : " warp/row") : "");
}

uint16_t narrow(float x, KvSrcDtype s) { return s == KvSrcDtype::bf16 ? f32_to_bf16(x) : f32_to_f16(x); }

// Source values: a third uniformly random 16-bit patterns (every class: NaNs with
// payloads, infinities, subnormals, huge and tiny values), the rest spread over
// +-1.5x the format's range after scaling, with specials sprinkled in.
std::vector<uint16_t> make_source(const Case& c, size_t count, float scale, std::mt19937_64& rng) {
  const float fmt_max = c.dtype == KvFormat::bf16 ? 8.0f : fp8_max_finite(kv_fp8_format(c.dtype));
  std::uniform_real_distribution<float> uni(-1.5f * fmt_max * scale, 1.5f * fmt_max * scale);
  std::uniform_int_distribution<int> pick(0, 99);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffff);
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {std::nanf(""),   -std::nanf(""),   inf,   -inf,  0.0f, -0.0f, 1e-7f, -3e-6f,
                            fmt_max * scale, -fmt_max * scale, 1e30f, -1e30f};
  std::vector<uint16_t> v(count);
  for (size_t i = 0; i < count; ++i) {
    const int p = pick(rng);
    if (p < 33) {
      v[i] = uint16_t(bits(rng));
    } else if (p < 43) {
      v[i] = narrow(specials[size_t(p - 33) % (sizeof specials / sizeof specials[0])], c.src);
    } else {
      v[i] = narrow(uni(rng), c.src);
    }
  }
  return v;
}

// A write's inputs on the host, with the same layout the device copy gets.
struct HostInputs {
  int64_t stride = 0;
  std::vector<uint16_t> k, v;  // src_offset + T * stride elements
  std::vector<int64_t> slots;
  std::vector<int64_t> swa_table;
  int64_t num_pages = 0;
};

HostInputs make_inputs(const Case& c) {
  std::mt19937_64 rng(c.seed);
  HostInputs in;
  const int64_t row = int64_t(c.num_kv_heads) * c.head_dim;
  in.stride = row + c.stride_pad;
  const size_t n = size_t(c.src_offset + c.num_tokens * in.stride);
  in.k = make_source(c, n, c.k_scale, rng);
  in.v = make_source(c, n, c.v_scale, rng);
  // Cache big enough that distinct slots can be drawn, odd page counts included.
  in.num_pages = (c.num_tokens * 3 / 2) / c.page_size + 2;
  const int64_t num_slots = in.num_pages * c.page_size;
  // Full-pool slots: with SWA the full pool is larger than the SWA cache and the table
  // maps it injectively, with holes (-1), onto the cache's slots.
  const int64_t full_slots = c.swa ? num_slots * 2 : num_slots;
  std::vector<int64_t> perm(static_cast<size_t>(full_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  if (c.swa) {
    in.swa_table.assign(size_t(full_slots - 3), -1);  // the last 3 full slots lie beyond the table
    std::vector<int64_t> targets(static_cast<size_t>(num_slots));
    std::iota(targets.begin(), targets.end(), 0);
    std::shuffle(targets.begin(), targets.end(), rng);
    for (size_t i = 0; i < in.swa_table.size() && i < targets.size(); i += 1) {
      if (i % 4 != 3) in.swa_table[i] = targets[i];  // every 4th full slot unmapped
    }
    in.swa_table[0] = num_slots + 7;  // maps beyond the cache: must be skipped
  }
  in.slots.resize(size_t(c.num_tokens));
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    const int64_t kind = t % 11;
    if (kind == 3) {
      in.slots[size_t(t)] = -1;  // padding
    } else if (kind == 7) {
      in.slots[size_t(t)] = -5 - t;  // any negative value is padding
    } else if (kind == 9 && !c.swa) {
      in.slots[size_t(t)] = num_slots + t;  // beyond the cache
    } else {
      in.slots[size_t(t)] = perm[size_t(t)];
    }
  }
  if (c.swa && c.num_tokens > 2) {
    in.slots[1] = full_slots - 1;  // beyond the SWA table
    in.slots[2] = 0;               // table entry points beyond the cache
  }
  return in;
}

KvWriteArgs make_args(const Case& c, const HostInputs& in, const void* k, const void* v, const int64_t* slots,
                      const int64_t* swa, void* k_cache, void* v_cache, const float* ks, const float* vs) {
  KvWriteArgs a;
  a.k = static_cast<const uint16_t*>(k) + c.src_offset;
  a.v = static_cast<const uint16_t*>(v) + c.src_offset;
  a.k_token_stride = in.stride;
  a.v_token_stride = in.stride;
  a.src_dtype = c.src;
  a.num_tokens = c.num_tokens;
  a.slot_mapping = slots;
  if (c.swa) {
    a.swa.full_to_swa = swa;
    a.swa.size = int64_t(in.swa_table.size());
  }
  a.cache.k = k_cache;
  a.cache.v = v_cache;
  a.cache.num_pages = in.num_pages;
  a.cache.page_size = c.page_size;
  a.cache.num_kv_heads = c.num_kv_heads;
  a.cache.head_dim = c.head_dim;
  a.cache.format = c.dtype;
  a.cache.k_scale = ks;
  a.cache.v_scale = vs;
  return a;
}

// Reports the first differing bytes of a cache with their position and input.
bool expect_cache(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const Case& c,
                  const char* which, const std::string& what) {
  size_t bad = 0;
  const int64_t row_bytes = int64_t(c.num_kv_heads) * c.head_dim * kv_format_bytes(c.dtype);
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i] && ++bad <= 3) {
      std::printf("  %s %s cache byte %zu (slot %lld, byte-in-row %lld): got 0x%02x want 0x%02x\n",
                  what.c_str(), which, i, (long long)(int64_t(i) / row_bytes),
                  (long long)(int64_t(i) % row_bytes), got[i], want[i]);
    }
  }
  return check(bad == 0, what + ": " + which + " cache, " + std::to_string(bad) + " bytes differ");
}

// Runs one case on the CPU reference and on the GPU path; compares caches and inputs.
// Returns how many rows the write stores (tokens whose slot resolves into the cache).
int64_t run_case(const Case& c, Path path, cudaStream_t stream) {
  const std::string what = describe(c, path);
  const HostInputs in = make_inputs(c);
  const int64_t row_bytes = int64_t(c.num_kv_heads) * c.head_dim * kv_format_bytes(c.dtype);
  const size_t cache_bytes = size_t(in.num_pages * c.page_size * row_bytes);

  // Same prefilled garbage in both caches: untouched slots must keep it.
  std::vector<uint8_t> k_ref(cache_bytes), v_ref(cache_bytes);
  std::mt19937_64 rng(c.seed ^ 0x5eed);
  for (auto& b : k_ref) b = uint8_t(rng());
  for (auto& b : v_ref) b = uint8_t(rng());
  DeviceMem d_kc(cache_bytes), d_vc(cache_bytes);
  d_kc.upload(k_ref.data(), cache_bytes);
  d_vc.upload(v_ref.data(), cache_bytes);

  const float ks = c.k_scale, vs = c.v_scale;
  const KvWriteArgs host = make_args(c, in, in.k.data(), in.v.data(), in.slots.data(), in.swa_table.data(),
                                     k_ref.data(), v_ref.data(), &ks, &vs);
  cpu::kv_write_fused(host);

  DeviceMem d_k(in.k.size() * 2), d_v(in.v.size() * 2), d_slots(in.slots.size() * 8),
      d_swa(in.swa_table.size() * 8), d_scales(16);
  d_k.upload(in.k.data(), in.k.size() * 2);
  d_v.upload(in.v.data(), in.v.size() * 2);
  d_slots.upload(in.slots.data(), in.slots.size() * 8);
  if (c.swa) d_swa.upload(in.swa_table.data(), in.swa_table.size() * 8);
  // The reciprocals as the pool computes them on the host: fp32 division, correctly rounded.
  const float scales[4] = {ks, vs, 1.0f / ks, 1.0f / vs};
  d_scales.upload(scales, 16);
  KvWriteArgs dev = make_args(c, in, d_k.get(), d_v.get(), d_slots.get<int64_t>(), d_swa.get<int64_t>(),
                              d_kc.get(), d_vc.get(), d_scales.get<float>(), d_scales.get<float>() + 1);
  if (c.inv_scales) {
    dev.cache.k_inv_scale = d_scales.get<float>() + 2;
    dev.cache.v_inv_scale = d_scales.get<float>() + 3;
  }
  if (!check(gpu::kv_write_unsupported(dev).empty(), what + ": supported")) return 0;
  cudaError_t err;
  gpu::KvWriteLaunch launch;
  launch.pdl = c.pdl;
  launch.block_team_max_tokens = c.block_team_max_tokens;
  if (path == Path::fused) {
    err = gpu::launch_kv_write_fused(dev, stream, launch);
  } else {
    DeviceMem scratch(gpu::kv_write_scratch_bytes(c.num_tokens, int64_t(c.num_kv_heads) * c.head_dim));
    err = gpu::launch_kv_write_unfused(dev, scratch.get(), stream, launch);
    KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));  // before the scratch is freed
  }
  check(err == cudaSuccess, what + ": launch returned " + cudaGetErrorString(err));
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));

  expect_cache(d_kc.download<uint8_t>(cache_bytes), k_ref, c, "K", what);
  expect_cache(d_vc.download<uint8_t>(cache_bytes), v_ref, c, "V", what);
  const bool unchanged = d_k.download<uint16_t>(in.k.size()) == in.k &&
                         d_v.download<uint16_t>(in.v.size()) == in.v &&
                         d_slots.download<int64_t>(in.slots.size()) == in.slots &&
                         (!c.swa || d_swa.download<int64_t>(in.swa_table.size()) == in.swa_table) &&
                         d_scales.download<float>(4) == std::vector<float>(scales, scales + 4);
  check(unchanged, what + ": inputs unchanged");
  int64_t stored = 0;
  for (int64_t slot : in.slots) {
    stored += resolve_write_slot(slot, host.swa, host.cache.num_slots()) >= 0 ? 1 : 0;
  }
  return stored;
}

// quick: page sizes 3 and 16 only and no large cases (for runs under compute-sanitizer).
void test_matrix(cudaStream_t stream, bool quick) {
  const KvFormat dtypes[] = {KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2, KvFormat::bf16};
  const KvSrcDtype srcs[] = {KvSrcDtype::bf16, KvSrcDtype::f16};
  const int head_dims[] = {64, 128, 256};
  const int pages[] = {1, 3, 16, 64};
  const float scale_pairs[][2] = {{0.37f, 2.9f}, {1.0f / 64.0f, 3.0f}, {1.7f, 0.05f}};
  uint64_t seed = 1;
  int rotation = 0;
  for (KvFormat dt : dtypes) {
    for (KvSrcDtype src : srcs) {
      for (int hd : head_dims) {
        for (int page : pages) {
          if (quick && (page == 1 || page == 64)) continue;
          for (bool swa : {false, true}) {
            Case c;
            c.dtype = dt;
            c.src = src;
            c.head_dim = hd;
            c.num_kv_heads = hd == 64 ? 3 : hd == 128 ? 8 : 2;  // rows of 12, 64 and 32 chunks
            c.page_size = page;
            c.swa = swa;
            c.num_tokens = 37 + 11 * (rotation % 3);
            // Source layouts in rotation: tight rows, padded rows (a QKV view), and rows
            // starting one element off 16-byte alignment (the scalar-load path).
            c.stride_pad = rotation % 3 == 0 ? 0 : 24;
            c.src_offset = rotation % 3 == 2 ? 1 : 0;
            c.k_scale = scale_pairs[rotation % 3][0];
            c.v_scale = scale_pairs[rotation % 3][1];
            c.pdl = rotation % 2 == 1;
            c.inv_scales = rotation % 3 == 1;
            c.seed = seed++;
            ++rotation;
            run_case(c, Path::fused, stream);
            run_case(c, Path::unfused, stream);
          }
        }
      }
    }
  }
  // Wide rows (32 heads x 128: each lane loops over several chunk groups) and a larger T.
  for (KvFormat dt : dtypes) {
    if (quick) break;
    Case c;
    c.dtype = dt;
    c.num_kv_heads = 32;
    c.head_dim = 128;
    c.num_tokens = 300;
    c.seed = seed++;
    run_case(c, Path::fused, stream);
    run_case(c, Path::unfused, stream);
    c.num_kv_heads = 8;
    c.num_tokens = 4099;
    c.page_size = 16;
    c.k_scale = 1.0f;
    c.v_scale = 1.0f;
    run_case(c, Path::fused, stream);
    run_case(c, Path::unfused, stream);
  }
}

// Decode sizes, T = 1 .. 8, through both mappings of the fused write at every T (the
// launch picks one from T; here each is forced): a block per row, and a warp per row.
// Row shapes: 8 x 128 (64 FP8 / 128 bf16 chunks: whole warps), 3 x 64 (12 / 24 chunks:
// part of one warp), 9 x 128 (72 / 144 chunks: a partly used last warp), 32 x 256 (512
// / 1024 chunks, more than the largest block has lanes: a lane takes 2 FP8 chunk pairs
// in one pass, or 4 bf16 ones in two passes of the row loop).
// Every case rotates dtype-independent knobs: source layout (tight, padded QKV view,
// misaligned: the scalar-load path), SWA table, page size, PDL, scales. Slots include
// padding (-1 and other negatives at t = 3 and 7), and with SWA slots beyond the table
// and table entries beyond the cache. T = 37 once more per shape for the block mapping
// on more rows than the launch would give it.
void test_small_t(cudaStream_t stream, bool quick) {
  const KvFormat dtypes[] = {KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2,
                             KvFormat::bf16};
  const int shapes[][2] = {{8, 128}, {3, 64}, {9, 128}, {32, 256}};
  const int pages[] = {16, 3, 64, 1};
  const float scale_pairs[][2] = {{0.37f, 2.9f}, {1.0f / 64.0f, 3.0f}, {1.7f, 0.05f}};
  uint64_t seed = 5000;
  int rotation = 0;
  int64_t stored = 0, skipped = 0;
  for (const auto& shape : shapes) {
    if (quick && shape[0] == 32) continue;
    for (int64_t T : {1, 2, 3, 4, 5, 6, 7, 8, 37}) {
      for (KvFormat dt : dtypes) {
        // r walks the dtypes, q the (shape, T) pairs: every dtype meets every
        // combination of source dtype, SWA and PDL, and every layout and page size.
        const int r = rotation++, q = r / 4;
        Case c;
        c.dtype = dt;
        c.src = (r + q) % 2 == 0 ? KvSrcDtype::bf16 : KvSrcDtype::f16;
        c.num_kv_heads = shape[0];
        c.head_dim = shape[1];
        c.num_tokens = T;
        c.page_size = pages[(r / 2 + q) % 4];
        c.stride_pad = r % 3 == 0 ? 0 : 24;
        c.src_offset = r % 3 == 2 ? 1 : 0;
        c.k_scale = scale_pairs[r % 3][0];
        c.v_scale = scale_pairs[r % 3][1];
        c.swa = (r / 2 + q / 2) % 2 == 1;
        c.pdl = ((r + q / 2) / 2) % 2 == 1;
        c.inv_scales = (r + q) % 3 != 0;
        c.seed = seed++;
        for (int team : {kBlockTeamAlways, kWarpTeamAlways}) {
          // A warp per row at T = 37 is test_matrix's.
          if (T > gpu::kKvWriteBlockTeamMaxTokens && team == kWarpTeamAlways) continue;
          c.block_team_max_tokens = team;
          const int64_t n = run_case(c, Path::fused, stream);
          stored += n;
          skipped += T - n;
        }
      }
    }
  }
  // The slots must exercise both sides: rows stored and rows skipped.
  check(stored > 0 && skipped > 0,
        "small T: " + std::to_string(stored) + " rows stored, " + std::to_string(skipped) + " skipped");
}

// Every bf16 value through the kernels at scale 1 (T=64 rows of 4 x 256; V holds the
// values in reverse): bytes must equal the H200 instruction's files for e4m3fn and e5m2
// and fp8_encode for e4m3fnuz, for the fused and the unfused path.
void test_all_bf16_sweep(cudaStream_t stream) {
  std::vector<uint16_t> k(65536), v(65536);
  for (uint32_t i = 0; i < 65536; ++i) {
    k[i] = uint16_t(i);
    v[i] = uint16_t(65535 - i);
  }
  std::vector<int64_t> slots(64);
  std::iota(slots.begin(), slots.end(), 0);
  DeviceMem d_k(65536 * 2), d_v(65536 * 2), d_slots(64 * 8), d_scales(8), d_kc(65536), d_vc(65536);
  d_k.upload(k.data(), 65536 * 2);
  d_v.upload(v.data(), 65536 * 2);
  d_slots.upload(slots.data(), 64 * 8);
  const float ones[2] = {1.0f, 1.0f};
  d_scales.upload(ones, 8);
  DeviceMem scratch(gpu::kv_write_scratch_bytes(64, 1024));
  const std::pair<KvFormat, const char*> formats[] = {{KvFormat::fp8_e4m3fn, "all_bf16.e4m3fn_satfinite.u8"},
                                                     {KvFormat::fp8_e5m2, "all_bf16.e5m2_satfinite.u8"},
                                                     {KvFormat::fp8_e4m3fnuz, nullptr}};
  for (const auto& [dtype, file] : formats) {
    std::vector<uint8_t> want(65536);
    if (file) {
      want = gpu_test::read_file(gpu_test::data_path(file));
    } else {
      for (uint32_t i = 0; i < 65536; ++i)
        want[i] = fp8_encode(bf16_to_f32(uint16_t(i)), Fp8Format::e4m3fnuz);
    }
    std::vector<uint8_t> want_v(want.rbegin(), want.rend());
    for (Path p : {Path::fused, Path::unfused}) {
      KvWriteArgs a;
      a.k = d_k.get();
      a.v = d_v.get();
      a.k_token_stride = a.v_token_stride = 1024;
      a.num_tokens = 64;
      a.slot_mapping = d_slots.get<int64_t>();
      a.cache = PagedKvView{
          d_kc.get(), d_vc.get(), 4, 16, 4, 256, dtype, d_scales.get<float>(), d_scales.get<float>() + 1};
      KVFUSE_TEST_GPU(cudaMemsetAsync(d_kc.get(), 0, 65536, stream));
      KVFUSE_TEST_GPU(cudaMemsetAsync(d_vc.get(), 0, 65536, stream));
      const cudaError_t err = p == Path::fused ? gpu::launch_kv_write_fused(a, stream)
                                               : gpu::launch_kv_write_unfused(a, scratch.get(), stream);
      KVFUSE_TEST_GPU(err);
      KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
      const std::string what = std::string("all-bf16 sweep ") + (p == Path::fused ? "fused " : "unfused ") +
                               kv_format_name(dtype) + (file ? " vs H200 file" : " vs fp8_encode");
      Case c;
      c.dtype = dtype;
      c.num_kv_heads = 4;
      c.head_dim = 256;
      expect_cache(d_kc.download<uint8_t>(65536), want, c, "K", what);
      expect_cache(d_vc.download<uint8_t>(65536), want_v, c, "V", what);
    }
  }
}

// The fused write captured in a graph with padded slots (as a decode step with graph
// batch padding: tokens from first_pad on) and replayed twice: same bytes as the
// reference. T <= kKvWriteBlockTeamMaxTokens captures the block-per-row mapping.
void test_graph_replay(cudaStream_t stream, bool pdl, int64_t num_tokens, int64_t first_pad) {
  Case c;
  c.num_tokens = num_tokens;
  c.seed = 777 + uint64_t(num_tokens);
  HostInputs in = make_inputs(c);
  for (int64_t t = first_pad; t < num_tokens; ++t) in.slots[size_t(t)] = -1;  // padding tail
  const int64_t row_bytes = int64_t(c.num_kv_heads) * c.head_dim;
  const size_t cache_bytes = size_t(in.num_pages * c.page_size * row_bytes);
  std::vector<uint8_t> k_ref(cache_bytes, 0x5a), v_ref(cache_bytes, 0x5a);
  const float ks = c.k_scale, vs = c.v_scale;
  cpu::kv_write_fused(make_args(c, in, in.k.data(), in.v.data(), in.slots.data(), nullptr, k_ref.data(),
                                v_ref.data(), &ks, &vs));
  DeviceMem d_k(in.k.size() * 2), d_v(in.v.size() * 2), d_slots(in.slots.size() * 8), d_scales(8),
      d_kc(cache_bytes), d_vc(cache_bytes);
  d_k.upload(in.k.data(), in.k.size() * 2);
  d_v.upload(in.v.data(), in.v.size() * 2);
  d_slots.upload(in.slots.data(), in.slots.size() * 8);
  const float scales[2] = {ks, vs};
  d_scales.upload(scales, 8);
  KVFUSE_TEST_GPU(cudaMemset(d_kc.get(), 0x5a, cache_bytes));
  KVFUSE_TEST_GPU(cudaMemset(d_vc.get(), 0x5a, cache_bytes));
  const KvWriteArgs dev = make_args(c, in, d_k.get(), d_v.get(), d_slots.get<int64_t>(), nullptr, d_kc.get(),
                                    d_vc.get(), d_scales.get<float>(), d_scales.get<float>() + 1);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVFUSE_TEST_GPU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gpu::KvWriteLaunch options;
  options.pdl = pdl;
  // Two writes in a row, as consecutive layers' writes in a decode graph.
  const cudaError_t launch = gpu::launch_kv_write_fused(dev, stream, options);
  const cudaError_t launch2 = gpu::launch_kv_write_fused(dev, stream, options);
  KVFUSE_TEST_GPU(cudaStreamEndCapture(stream, &graph));
  KVFUSE_TEST_GPU(launch2);
  KVFUSE_TEST_GPU(launch);
  KVFUSE_TEST_GPU(cudaGraphInstantiate(&exec, graph, 0));
  KVFUSE_TEST_GPU(cudaGraphLaunch(exec, stream));
  KVFUSE_TEST_GPU(cudaGraphLaunch(exec, stream));
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const std::string what = "graph replay, T=" + std::to_string(num_tokens) + ", padding from " +
                           std::to_string(first_pad) + (pdl ? ", pdl" : "");
  expect_cache(d_kc.download<uint8_t>(cache_bytes), k_ref, c, "K", what);
  expect_cache(d_vc.download<uint8_t>(cache_bytes), v_ref, c, "V", what);
  KVFUSE_TEST_GPU(cudaGraphExecDestroy(exec));
  KVFUSE_TEST_GPU(cudaGraphDestroy(graph));
}

// Unsupported arguments are refused with the whole tuple named, and nothing launches.
void test_unsupported() {
  KvWriteArgs a;
  a.cache.head_dim = 96;
  a.cache.num_kv_heads = 8;
  a.cache.page_size = 16;
  a.cache.format = KvFormat::fp8_e5m2;
  a.src_dtype = KvSrcDtype::f16;
  a.k_token_stride = a.v_token_stride = 768;
  const std::string msg = gpu::kv_write_unsupported(a);
  check(msg.find("head_dim=96") != std::string::npos && msg.find("fp8_e5m2") != std::string::npos &&
            msg.find("f16") != std::string::npos,
        "unsupported head_dim names the tuple: '" + msg + "'");
  check(gpu::launch_kv_write_fused(a, nullptr) == cudaErrorInvalidValue,
        "unsupported head_dim: fused refuses");
  check(gpu::launch_kv_write_unfused(a, nullptr, nullptr) == cudaErrorInvalidValue,
        "unsupported head_dim: unfused refuses");
  a.cache.head_dim = 128;
  a.k_token_stride = a.v_token_stride = 1024;
  check(gpu::kv_write_unsupported(a).find("k_scale") != std::string::npos,
        "FP8 cache without scales is refused");
  // Zero tokens (an empty step): nothing to do, success, no launch.
  float s = 1.0f;
  a.cache.k_scale = a.cache.v_scale = &s;
  check(gpu::launch_kv_write_fused(a, nullptr) == cudaSuccess, "zero tokens: success without a launch");
}

}  // namespace

int main() {
  if (!gpu_test::gpu_available("test_kv_write_gpu")) return 0;
  cudaStream_t stream;
  KVFUSE_TEST_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (KvFormat d : {KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2, KvFormat::bf16}) {
    std::printf("conversion for %s: %s\n", kv_format_name(d), gpu::kv_write_conversion_name(d).c_str());
  }
  test_unsupported();
  const bool quick = gpu_test::quick();
  test_matrix(stream, quick);
  test_small_t(stream, quick);
  test_all_bf16_sweep(stream);
  for (bool pdl : {false, true}) {
    test_graph_replay(stream, pdl, 64, 40);
    test_graph_replay(stream, pdl, 8, 5);
    test_graph_replay(stream, pdl, 1, 1);  // one sequence, itself padding
    test_graph_replay(stream, pdl, 1, 2);  // one sequence, written
  }
  KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
  return gpu_test::tally().report("test_kv_write_gpu");
}
