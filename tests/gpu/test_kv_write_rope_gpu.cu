// GPU KV write with RoPE on the way (kernels/kv_write/kv_write_rope.cuh) against the CPU twin
// (kernels/cpu/kv_write/kv_write.h, kv_write_rope) and against the two kernels it replaces.
//
// What must hold, per case:
// - q within rope's tolerance of the CPU's (the device's sinf/cosf are not the libm's:
//   a rotated pair may land one bf16 ulp apart), and so the rotated K (k_rotated);
// - the K and V caches byte for byte the CPU fused write's (cpu::kv_write_fused) of the K
//   rows the kernel rotated and of V as it stands: the write half is exact;
// - q and the rotated K within rope's tolerance of what launch_rope_neox leaves on the
//   same device, and the V cache byte for byte what launch_kv_write_fused leaves (the two
//   rotations are the same expressions, but compiled into different kernels they round
//   apart by one bf16 ulp now and then on the H200, so their K caches may differ in a
//   few codes);
// - K and V (without k_rotated), the slots and the scales unchanged.
// Over every cache dtype (e4m3fn, e4m3fnuz, e5m2, bf16), head_dim 64/128/256, grouped
// queries (1, 4 and 7 per KV head), page sizes 1/5/16, with and without an SWA table,
// padding (negative), out-of-range and SWA-unmapped slots, tight and padded QKV rows,
// positions up to 300000, attention_scaling 1 and 1.1386, scales != 1 and the pool's
// reciprocals, PDL on and off, T = 1 .. 8 (decode), 37 and 300. Also CUDA-graph replays
// with padding slots and the unsupported-argument path. Without a GPU it skips.
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
#include "kernels/kv_write/kv_write_rope.cuh"
#include "kernels/ops/model_ops.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using gpu_test::check;
using gpu_test::DeviceMem;

struct Case {
  KvFormat dtype = KvFormat::fp8_e4m3fn;
  int32_t q_heads = 8;
  int32_t kv_heads = 2;
  int32_t head_dim = 128;
  int32_t page_size = 16;
  int64_t num_tokens = 8;
  int64_t stride_pad = 0;  // elements after each fused QKV row (a multiple of 8)
  float k_scale = 0.37f;
  float v_scale = 2.9f;
  float attention_scaling = 1.0f;
  bool swa = false;
  bool pdl = false;
  bool inv_scales = false;  // the view carries 1/scale, as the pool's do
  uint64_t seed = 1;
};

std::string describe(const Case& c) {
  return std::string("rope write ") + kv_format_name(c.dtype) + " q=" + std::to_string(c.q_heads) +
         " kv=" + std::to_string(c.kv_heads) + " D=" + std::to_string(c.head_dim) +
         " page=" + std::to_string(c.page_size) + " T=" + std::to_string(c.num_tokens) +
         " pad=" + std::to_string(c.stride_pad) + " ks=" + std::to_string(c.k_scale) +
         " vs=" + std::to_string(c.v_scale) + " as=" + std::to_string(c.attention_scaling) +
         (c.inv_scales ? " inv" : "") + (c.swa ? " swa" : "") + (c.pdl ? " pdl" : "");
}

// The spread of a case's source values: q, K and V (K and V reach about the format's range
// after scaling, so rotated pairs saturate).
float source_scale(const Case& c, int part) {
  const float fmt_max = c.dtype == KvFormat::bf16 ? 8.0f : fp8_max_finite(kv_fp8_format(c.dtype));
  return part == 0 ? 2.0f : 0.6f * fmt_max * (part == 1 ? c.k_scale : c.v_scale);
}

// A step's inputs on the host, laid out as the device copy: fused QKV rows.
struct HostInputs {
  int64_t q_dim = 0, kv_dim = 0, stride = 0, num_pages = 0;
  std::vector<uint16_t> qkv;
  std::vector<int32_t> positions;
  std::vector<float> inv_freq;
  std::vector<int64_t> slots, swa_table;
};

HostInputs make_inputs(const Case& c) {
  std::mt19937_64 rng(c.seed);
  HostInputs in;
  in.q_dim = int64_t(c.q_heads) * c.head_dim;
  in.kv_dim = int64_t(c.kv_heads) * c.head_dim;
  in.stride = in.q_dim + 2 * in.kv_dim + c.stride_pad;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 299);
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {std::nanf(""), inf, -inf, 0.0f, -0.0f, 1e-30f};
  in.qkv.resize(size_t(c.num_tokens * in.stride));
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    for (int64_t e = 0; e < in.stride; ++e) {
      const float scale = source_scale(c, e < in.q_dim ? 0 : e < in.q_dim + in.kv_dim ? 1 : 2);
      const int r = pick(rng);
      in.qkv[size_t(t * in.stride + e)] = f32_to_bf16(r < 6 ? specials[r] : normal(rng) * scale);
    }
  }
  std::uniform_int_distribution<int32_t> pos(0, 300000);
  for (int64_t t = 0; t < c.num_tokens; ++t) in.positions.push_back(t == 0 ? 0 : pos(rng));
  // A plain RoPE table (theta 500000), rounded from double as src/loading/rope.h rounds it.
  for (int32_t i = 0; i < c.head_dim / 2; ++i)
    in.inv_freq.push_back(float(std::pow(500000.0, -2.0 * i / c.head_dim)));

  in.num_pages = (c.num_tokens * 3 / 2) / c.page_size + 2;
  const int64_t num_slots = in.num_pages * c.page_size;
  const int64_t full_slots = c.swa ? 2 * num_slots : num_slots;
  std::vector<int64_t> perm(static_cast<size_t>(full_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  if (c.swa) {
    in.swa_table.assign(size_t(full_slots - 3), -1);  // the last 3 full slots lie beyond the table
    std::vector<int64_t> targets(static_cast<size_t>(num_slots));
    std::iota(targets.begin(), targets.end(), 0);
    std::shuffle(targets.begin(), targets.end(), rng);
    for (size_t i = 0; i < in.swa_table.size() && i < targets.size(); ++i) {
      if (i % 4 != 3) in.swa_table[i] = targets[i];  // every 4th full slot unmapped
    }
    in.swa_table[0] = num_slots + 7;  // maps beyond the cache: skipped
  }
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    const int64_t kind = t % 11;
    in.slots.push_back(kind == 3 ? -1 : kind == 7 ? -5 - t : kind == 9 ? full_slots + t : perm[size_t(t)]);
  }
  return in;
}

// Device pointers of one run.
struct DevicePtrs {
  uint16_t* qkv;
  uint16_t* k_rot;  // a buffer shaped like qkv; k_rotated = k_rot + q_dim (null: none)
  const int32_t* positions;
  const float* inv_freq;
  const int64_t* slots;
  const int64_t* swa;
  void* k_cache;
  void* v_cache;
  const float* scales;  // k, v, 1/k, 1/v
};

KvWriteArgs write_args(const Case& c, const HostInputs& in, const uint16_t* qkv, const int64_t* slots,
                       const int64_t* swa, void* kc, void* vc, const float* scales, bool inv) {
  KvWriteArgs a;
  a.k = qkv + in.q_dim;
  a.v = qkv + in.q_dim + in.kv_dim;
  a.k_token_stride = a.v_token_stride = in.stride;
  a.num_tokens = c.num_tokens;
  a.slot_mapping = slots;
  if (c.swa) a.swa = SwaSlotTable{swa, int64_t(in.swa_table.size())};
  a.cache =
      PagedKvView{kc, vc, in.num_pages, c.page_size, c.kv_heads, c.head_dim, c.dtype, scales, scales + 1};
  if (inv) {
    a.cache.k_inv_scale = scales + 2;
    a.cache.v_inv_scale = scales + 3;
  }
  return a;
}

KvWriteRopeArgs rope_args(const Case& c, const HostInputs& in, uint16_t* qkv, uint16_t* k_rot,
                          const int32_t* positions, const float* inv_freq, const int64_t* slots,
                          const int64_t* swa, void* kc, void* vc, const float* scales, bool inv) {
  KvWriteRopeArgs r;
  r.kv = write_args(c, in, qkv, slots, swa, kc, vc, scales, inv);
  r.q = qkv;
  r.q_token_stride = in.stride;
  r.q_heads = c.q_heads;
  r.positions = positions;
  r.inv_freq = inv_freq;
  r.attention_scaling = c.attention_scaling;
  r.k_rotated = k_rot != nullptr ? k_rot + in.q_dim : nullptr;
  return r;
}

// Elements [begin, end) of every token's row of a QKV-shaped buffer.
std::vector<uint16_t> columns(const HostInputs& in, const std::vector<uint16_t>& qkv, int64_t begin,
                              int64_t end) {
  std::vector<uint16_t> out;
  for (size_t t = 0; t * size_t(in.stride) < qkv.size(); ++t) {
    out.insert(out.end(), qkv.begin() + int64_t(t) * in.stride + begin,
               qkv.begin() + int64_t(t) * in.stride + end);
  }
  return out;
}

// rope's tolerance (tests/gpu/test_gpu_backend.cc, inputs of unit spread): one bf16 ulp of the
// larger magnitude, plus 2e-3 x attention_scaling x the inputs' spread for the
// cancellation in x0*c - x1*s, where the device's cos and sin (within 2 ulp of the libm's)
// move a small result by a part of the inputs' size; NaN against NaN and equal
// infinities match.
bool close_bf16(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, float scaling,
                float spread, const std::string& what) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const float x = bf16_to_f32(got[i]), y = bf16_to_f32(want[i]);
    if (std::isnan(x) && std::isnan(y)) continue;
    if (x == y) continue;
    const float tol = std::ldexp(std::max(std::fabs(x), std::fabs(y)), -7) + 2e-3f * scaling * spread;
    if (!(std::fabs(x - y) <= tol) && bad++ == 0) first = i;
  }
  if (bad) {
    std::printf("  %s: element %zu: got %g want %g\n", what.c_str(), first, bf16_to_f32(got[first]),
                bf16_to_f32(want[first]));
  }
  return check(bad == 0, what + ": " + std::to_string(bad) + " of " + std::to_string(want.size()) +
                             " outside rope's tolerance");
}

bool same_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, const std::string& what) {
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i] && ++bad <= 3)
      std::printf("  %s: byte %zu got 0x%02x want 0x%02x\n", what.c_str(), i, got[i], want[i]);
  }
  return check(bad == 0, what + ": " + std::to_string(bad) + " bytes differ");
}

std::vector<uint8_t> prefilled(size_t bytes, uint64_t seed) {
  std::vector<uint8_t> v(bytes);
  std::mt19937_64 rng(seed);
  for (auto& b : v) b = uint8_t(rng());
  return v;
}

// One case: the CPU twin, the kernel (with k_rotated, then without), and rope + fused
// write on the device.
void run_case(const Case& c, cudaStream_t stream) {
  const std::string what = describe(c);
  const HostInputs in = make_inputs(c);
  const int64_t row_bytes = in.kv_dim * kv_format_bytes(c.dtype);
  const size_t cache_bytes = size_t(in.num_pages * c.page_size * row_bytes);
  const size_t qkv_bytes = in.qkv.size() * 2;
  const std::vector<uint8_t> garbage_k = prefilled(cache_bytes, c.seed ^ 0x5eed),
                             garbage_v = prefilled(cache_bytes, c.seed ^ 0xfeed);

  // The CPU twin: q and the rotated K of the reference.
  const float scales[4] = {c.k_scale, c.v_scale, 1.0f / c.k_scale, 1.0f / c.v_scale};
  std::vector<uint16_t> cpu_qkv = in.qkv, cpu_rot = in.qkv;
  std::vector<uint8_t> cpu_k = garbage_k, cpu_v = garbage_v;
  cpu::kv_write_rope(rope_args(c, in, cpu_qkv.data(), cpu_rot.data(), in.positions.data(), in.inv_freq.data(),
                               in.slots.data(), in.swa_table.data(), cpu_k.data(), cpu_v.data(), scales,
                               false));

  DeviceMem d_qkv(qkv_bytes), d_rot(qkv_bytes), d_pos(in.positions.size() * 4),
      d_freq(in.inv_freq.size() * 4), d_slots(in.slots.size() * 8), d_swa(in.swa_table.size() * 8 + 8),
      d_scales(16), d_kc(cache_bytes), d_vc(cache_bytes);
  d_qkv.upload(in.qkv.data(), qkv_bytes);
  d_rot.upload(in.qkv.data(), qkv_bytes);
  d_pos.upload(in.positions.data(), in.positions.size() * 4);
  d_freq.upload(in.inv_freq.data(), in.inv_freq.size() * 4);
  d_slots.upload(in.slots.data(), in.slots.size() * 8);
  if (c.swa) d_swa.upload(in.swa_table.data(), in.swa_table.size() * 8);
  d_scales.upload(scales, 16);
  d_kc.upload(garbage_k.data(), cache_bytes);
  d_vc.upload(garbage_v.data(), cache_bytes);
  const auto dev_args = [&](uint16_t* qkv, uint16_t* rot, void* kc, void* vc) {
    return rope_args(c, in, qkv, rot, d_pos.get<int32_t>(), d_freq.get<float>(), d_slots.get<int64_t>(),
                     d_swa.get<int64_t>(), kc, vc, d_scales.get<float>(), c.inv_scales);
  };
  gpu::KvWriteLaunch launch;
  launch.pdl = c.pdl;
  const KvWriteRopeArgs dev = dev_args(d_qkv.get<uint16_t>(), d_rot.get<uint16_t>(), d_kc.get(), d_vc.get());
  if (!check(gpu::kv_write_rope_unsupported(dev).empty(), what + ": supported")) return;
  const gpu::LaunchStatus st = gpu::launch_kv_write_rope(dev, stream, launch);
  check(st.ok(), what + ": launch: " + cudaGetErrorString(st.code()) + " " + st.message());
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const auto gpu_qkv = d_qkv.download<uint16_t>(in.qkv.size());
  const auto gpu_rot = d_rot.download<uint16_t>(in.qkv.size());
  const auto gpu_k = d_kc.download<uint8_t>(cache_bytes), gpu_v = d_vc.download<uint8_t>(cache_bytes);

  // q and the rotated K: within rope's tolerance of the CPU.
  close_bf16(columns(in, gpu_qkv, 0, in.q_dim), columns(in, cpu_qkv, 0, in.q_dim), c.attention_scaling,
             source_scale(c, 0), what + ": q vs CPU");
  close_bf16(columns(in, gpu_rot, in.q_dim, in.q_dim + in.kv_dim),
             columns(in, cpu_rot, in.q_dim, in.q_dim + in.kv_dim), c.attention_scaling, source_scale(c, 1),
             what + ": rotated K vs CPU");
  // K, V and the padding after them: untouched.
  check(columns(in, gpu_qkv, in.q_dim, in.stride) == columns(in, in.qkv, in.q_dim, in.stride),
        what + ": K and V unchanged");
  check(d_slots.download<int64_t>(in.slots.size()) == in.slots &&
            d_scales.download<float>(4) == std::vector<float>(scales, scales + 4),
        what + ": slots and scales unchanged");

  // The caches: exactly the CPU fused write of the rows the kernel rotated.
  std::vector<uint8_t> want_k = garbage_k, want_v = garbage_v;
  cpu::kv_write_fused(write_args(c, in, gpu_rot.data(), in.slots.data(), in.swa_table.data(), want_k.data(),
                                 want_v.data(), scales, false));
  // write_args reads V at q_dim + kv_dim of the buffer it is given: gpu_rot holds the
  // original V there (the kernel only writes the K columns of k_rotated).
  same_bytes(gpu_k, want_k, what + ": K cache vs CPU fused write of the rotated K");
  same_bytes(gpu_v, want_v, what + ": V cache vs CPU fused write");
  same_bytes(gpu_v, cpu_v, what + ": V cache vs CPU twin");

  // Without k_rotated (as the engine runs it): the same q and caches.
  d_qkv.upload(in.qkv.data(), qkv_bytes);
  d_kc.upload(garbage_k.data(), cache_bytes);
  d_vc.upload(garbage_v.data(), cache_bytes);
  KVFUSE_TEST_GPU(gpu::launch_kv_write_rope(dev_args(d_qkv.get<uint16_t>(), nullptr, d_kc.get(), d_vc.get()),
                                            stream, launch));
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  check(d_qkv.download<uint16_t>(in.qkv.size()) == gpu_qkv, what + ": without k_rotated, same q");
  same_bytes(d_kc.download<uint8_t>(cache_bytes), gpu_k, what + ": without k_rotated, same K cache");
  same_bytes(d_vc.download<uint8_t>(cache_bytes), gpu_v, what + ": without k_rotated, same V cache");

  // The two kernels it replaces, on the same device: the same bits.
  d_qkv.upload(in.qkv.data(), qkv_bytes);
  d_kc.upload(garbage_k.data(), cache_bytes);
  d_vc.upload(garbage_v.data(), cache_bytes);
  uint16_t* q = d_qkv.get<uint16_t>();
  KVFUSE_TEST_GPU(gpu::launch_rope_neox(q, in.stride, c.q_heads, q + in.q_dim, in.stride, c.kv_heads,
                                        c.head_dim, d_pos.get<int32_t>(), c.num_tokens, d_freq.get<float>(),
                                        c.attention_scaling, stream, c.pdl));
  KVFUSE_TEST_GPU(
      gpu::launch_kv_write_fused(dev_args(q, nullptr, d_kc.get(), d_vc.get()).kv, stream, launch));
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const auto two_qkv = d_qkv.download<uint16_t>(in.qkv.size());
  // Not bit for bit: on the H200 the two kernels' rotations round apart now and then (one
  // bf16 ulp), so their K caches differ where such a K lands on another FP8 code; each
  // cache is still exactly the fused write of its own rotated K (checked above).
  close_bf16(columns(in, gpu_qkv, 0, in.q_dim), columns(in, two_qkv, 0, in.q_dim), c.attention_scaling,
             source_scale(c, 0), what + ": q vs launch_rope_neox's");
  close_bf16(columns(in, gpu_rot, in.q_dim, in.q_dim + in.kv_dim),
             columns(in, two_qkv, in.q_dim, in.q_dim + in.kv_dim), c.attention_scaling, source_scale(c, 1),
             what + ": rotated K vs launch_rope_neox's");
  same_bytes(d_vc.download<uint8_t>(cache_bytes), gpu_v, what + ": V cache equals rope + fused write's");
}

// quick: no T = 300 and no 32 x 8 heads (for runs under compute-sanitizer).
void test_matrix(cudaStream_t stream, bool quick) {
  const KvFormat dtypes[] = {KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2,
                             KvFormat::bf16};
  const int32_t heads[][2] = {{8, 2}, {4, 4}, {7, 1}, {32, 8}};
  const int64_t tokens[] = {1, 2, 3, 5, 8, 37, 300};
  const int pages[] = {16, 1, 5};
  const float scale_pairs[][2] = {{0.37f, 2.9f}, {1.0f / 64.0f, 3.0f}, {1.0f, 1.0f}};
  uint64_t seed = 1;
  int r = 0;
  for (KvFormat dt : dtypes) {
    for (int32_t hd : {64, 128, 256}) {
      for (const auto& h : heads) {
        for (int rep = 0; rep < 2; ++rep, ++r) {
          Case c;
          c.dtype = dt;
          c.head_dim = hd;
          c.q_heads = h[0];
          c.kv_heads = h[1];
          c.num_tokens = tokens[size_t(r) % 7];
          c.page_size = pages[size_t(r / 7) % 3];
          c.stride_pad = r % 2 ? 8 : 0;
          c.k_scale = scale_pairs[r % 3][0];
          c.v_scale = scale_pairs[r % 3][1];
          c.attention_scaling = (r / 2) % 2 ? 1.1386f : 1.0f;
          c.swa = (r / 3) % 2 == 1;
          c.pdl = (r / 5) % 2 == 1;
          c.inv_scales = r % 4 < 2;
          c.seed = seed++;
          if (quick && (c.num_tokens > 64 || c.q_heads == 32)) continue;
          run_case(c, stream);
        }
      }
    }
  }
}

// The kernel captured in a graph (a decode step's write: padding slots from first_pad
// on) and replayed twice, q restored before each replay: the bytes of a plain launch.
void test_graph_replay(cudaStream_t stream, bool pdl, int64_t num_tokens, int64_t first_pad) {
  Case c;
  c.num_tokens = num_tokens;
  c.pdl = pdl;
  c.seed = 777 + uint64_t(num_tokens);
  HostInputs in = make_inputs(c);
  for (int64_t t = first_pad; t < num_tokens; ++t) in.slots[size_t(t)] = -1;
  const size_t cache_bytes = size_t(in.num_pages * c.page_size * in.kv_dim);
  const size_t qkv_bytes = in.qkv.size() * 2;
  const float scales[4] = {c.k_scale, c.v_scale, 1.0f / c.k_scale, 1.0f / c.v_scale};
  DeviceMem d_qkv(qkv_bytes), d_pos(in.positions.size() * 4), d_freq(in.inv_freq.size() * 4),
      d_slots(in.slots.size() * 8), d_scales(16), d_kc(cache_bytes), d_vc(cache_bytes);
  d_qkv.upload(in.qkv.data(), qkv_bytes);
  d_pos.upload(in.positions.data(), in.positions.size() * 4);
  d_freq.upload(in.inv_freq.data(), in.inv_freq.size() * 4);
  d_slots.upload(in.slots.data(), in.slots.size() * 8);
  d_scales.upload(scales, 16);
  KVFUSE_TEST_GPU(cudaMemset(d_kc.get(), 0x5a, cache_bytes));
  KVFUSE_TEST_GPU(cudaMemset(d_vc.get(), 0x5a, cache_bytes));
  const KvWriteRopeArgs dev =
      rope_args(c, in, d_qkv.get<uint16_t>(), nullptr, d_pos.get<int32_t>(), d_freq.get<float>(),
                d_slots.get<int64_t>(), nullptr, d_kc.get(), d_vc.get(), d_scales.get<float>(), true);
  gpu::KvWriteLaunch launch;
  launch.pdl = pdl;
  // The expectation: one plain launch.
  KVFUSE_TEST_GPU(gpu::launch_kv_write_rope(dev, stream, launch));
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const auto want_q = d_qkv.download<uint16_t>(in.qkv.size());
  const auto want_k = d_kc.download<uint8_t>(cache_bytes), want_v = d_vc.download<uint8_t>(cache_bytes);

  KVFUSE_TEST_GPU(cudaMemset(d_kc.get(), 0x5a, cache_bytes));
  KVFUSE_TEST_GPU(cudaMemset(d_vc.get(), 0x5a, cache_bytes));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVFUSE_TEST_GPU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t launched = gpu::launch_kv_write_rope(dev, stream, launch);
  KVFUSE_TEST_GPU(cudaStreamEndCapture(stream, &graph));
  KVFUSE_TEST_GPU(launched);
  KVFUSE_TEST_GPU(cudaGraphInstantiate(&exec, graph, 0));
  const std::string what = "rope write graph replay, T=" + std::to_string(num_tokens) + ", padding from " +
                           std::to_string(first_pad) + (pdl ? ", pdl" : "");
  for (int replay = 0; replay < 2; ++replay) {
    KVFUSE_TEST_GPU(cudaMemcpyAsync(d_qkv.get(), in.qkv.data(), qkv_bytes, cudaMemcpyHostToDevice, stream));
    KVFUSE_TEST_GPU(cudaGraphLaunch(exec, stream));
    KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
    check(d_qkv.download<uint16_t>(in.qkv.size()) == want_q, what + ": q");
    same_bytes(d_kc.download<uint8_t>(cache_bytes), want_k, what + ": K cache");
    same_bytes(d_vc.download<uint8_t>(cache_bytes), want_v, what + ": V cache");
  }
  KVFUSE_TEST_GPU(cudaGraphExecDestroy(exec));
  KVFUSE_TEST_GPU(cudaGraphDestroy(graph));
}

// Unsupported arguments are refused with the tuple named, and nothing launches.
void test_unsupported() {
  alignas(16) static uint16_t rows[4096];
  static const int32_t pos[1] = {0};
  static const float freq[128] = {};
  static const int64_t slot[1] = {0};
  static const float one = 1.0f;
  alignas(16) static uint8_t cache[2][1024];
  KvWriteRopeArgs a;
  a.kv.k = rows + 1024;
  a.kv.v = rows + 2048;
  a.kv.k_token_stride = a.kv.v_token_stride = 3072;
  a.kv.num_tokens = 1;
  a.kv.slot_mapping = slot;
  a.kv.cache = PagedKvView{cache[0], cache[1], 1, 1, 8, 128, KvFormat::fp8_e4m3fn, &one, &one};
  a.q = rows;
  a.q_token_stride = 3072;
  a.q_heads = 8;
  a.positions = pos;
  a.inv_freq = freq;
  check(gpu::kv_write_rope_unsupported(a).empty(), "unsupported: the base case is supported");

  KvWriteRopeArgs b = a;
  b.kv.src_dtype = KvSrcDtype::f16;
  std::string msg = gpu::kv_write_rope_unsupported(b);
  check(msg.find("bf16") != std::string::npos && msg.find("q_heads=8") != std::string::npos &&
            msg.find("fp8_e4m3fn") != std::string::npos,
        "f16 sources are refused, naming the tuple: '" + msg + "'");
  check(gpu::launch_kv_write_rope(b, nullptr) == cudaErrorInvalidValue, "f16 sources: the launch refuses");
  b = a;
  b.q = rows + 1;
  check(gpu::kv_write_rope_unsupported(b).find("16-byte aligned") != std::string::npos,
        "misaligned q is refused");
  b = a;
  b.q_token_stride = 3072 - 8;
  b.kv.k_token_stride = b.kv.v_token_stride = 3072 - 4;
  check(!gpu::kv_write_rope_unsupported(b).empty(), "strides that are not a multiple of 8 are refused");
  b = a;
  b.positions = nullptr;
  check(gpu::kv_write_rope_unsupported(b).find("positions") != std::string::npos,
        "missing positions are refused");
  b = a;
  b.kv.cache.head_dim = 96;
  b.kv.cache.num_kv_heads = 8;
  msg = gpu::kv_write_rope_unsupported(b);
  check(msg.find("head_dim=96") != std::string::npos, "unsupported head_dim names it: '" + msg + "'");
  check(gpu::launch_kv_write_rope(b, nullptr) == cudaErrorInvalidValue, "head_dim 96: the launch refuses");
  b = a;
  b.kv.num_tokens = 0;
  check(gpu::launch_kv_write_rope(b, nullptr) == cudaSuccess, "zero tokens: success without a launch");
}

}  // namespace

int main() {
  if (!gpu_test::gpu_available("test_kv_write_rope_gpu")) return 0;
  cudaStream_t stream;
  KVFUSE_TEST_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  test_unsupported();
  const bool quick = gpu_test::quick();
  test_matrix(stream, quick);
  for (bool pdl : {false, true}) {
    test_graph_replay(stream, pdl, 64, 40);
    test_graph_replay(stream, pdl, 8, 5);
    test_graph_replay(stream, pdl, 1, 1);  // one sequence, itself padding
    test_graph_replay(stream, pdl, 1, 2);  // one sequence, written
  }
  KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
  return gpu_test::tally().report("test_kv_write_rope_gpu");
}
