// Tests of the CPU KV write with RoPE on the way (kernels/cpu/kv_write/kv_write.h, kv_write_rope:
// the CPU twin of KvWritePath::fused_rope). Its contract is a composition: q as
// rope_neox leaves it, the cache as rope_neox followed by kv_write_fused leaves it, bit for
// bit, for every KV format, head dims 64/128/256, grouped queries, SWA tables, padding and
// out-of-range slots, plain and scaled RoPE tables, and values that saturate or are not
// finite. Also: K and V read only (unless k_rotated asks for the rotated K), and the CPU
// backend's refusals.
#include "tests/util/catch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/kv_write/kv_write.h"
#include "kernels/cpu/ops/ops.h"
#include "src/backends/cpu/cpu_backend.h"
#include "src/loading/rope.h"

namespace {

using namespace kvfuse;

constexpr uint8_t kSentinel = 0xa5;  // prefilled cache byte: untouched slots must keep it

struct RopeCase {
  KvFormat dtype = KvFormat::fp8_e4m3fn;
  int32_t q_heads = 8;
  int32_t kv_heads = 2;
  int32_t head_dim = 128;
  int32_t page_size = 16;
  int64_t num_pages = 5;
  int64_t num_tokens = 29;
  int64_t stride_pad = 8;  // elements after each fused QKV row
  float k_scale = 0.37f;
  float v_scale = 2.5f;
  bool swa = false;
  bool yarn = false;  // a scaled table with attention_scaling != 1
  uint64_t seed = 1;
};

std::string describe(const RopeCase& c) {
  std::ostringstream s;
  s << kv_format_name(c.dtype) << " q_heads=" << c.q_heads << " kv_heads=" << c.kv_heads
    << " head_dim=" << c.head_dim << " page=" << c.page_size << " tokens=" << c.num_tokens
    << (c.swa ? " swa" : "") << (c.yarn ? " yarn" : "");
  return s.str();
}

// One step's inputs: fused QKV rows [T, (q_heads + 2 kv_heads) * head_dim + pad], the
// positions, the slots (with an SWA table) and the frequency table.
struct Inputs {
  RopeCase c;
  int64_t q_dim = 0, kv_dim = 0, stride = 0, num_slots = 0;
  std::vector<bf16_t> qkv;
  std::vector<int32_t> positions;
  std::vector<int64_t> slots, swa_table;
  RopeTable table;
  int64_t stored = 0;  // tokens whose slot resolves into the cache
};

Inputs make_inputs(const RopeCase& c) {
  Inputs in;
  in.c = c;
  std::mt19937_64 rng(c.seed);
  in.q_dim = int64_t(c.q_heads) * c.head_dim;
  in.kv_dim = int64_t(c.kv_heads) * c.head_dim;
  in.stride = in.q_dim + 2 * in.kv_dim + c.stride_pad;
  in.num_slots = c.num_pages * c.page_size;
  // Values around the scaled format range (K of +-1.3 x max saturates after the
  // rotation in some pairs), with non-finite values and zeros sprinkled in.
  const float fmt_max = c.dtype == KvFormat::bf16 ? 4.0f : fp8_max_finite(kv_fp8_format(c.dtype));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 199);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            0.0f,
                            -0.0f,
                            1e-30f};
  in.qkv.resize(size_t(c.num_tokens * in.stride));
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    for (int64_t e = 0; e < in.stride; ++e) {
      const float scale = e < in.q_dim               ? 2.0f
                          : e < in.q_dim + in.kv_dim ? 0.6f * fmt_max * c.k_scale
                                                     : 0.6f * fmt_max * c.v_scale;
      const int r = pick(rng);
      const float x = r < 6 ? specials[r] : normal(rng) * scale;
      in.qkv[size_t(t * in.stride + e)] = f32_to_bf16(x);
    }
  }
  // Positions: the first, small, and far beyond 2^16 (large angles: the argument
  // reduction of sin and cos at its hardest).
  std::uniform_int_distribution<int32_t> pos(0, 300000);
  for (int64_t t = 0; t < c.num_tokens; ++t)
    in.positions.push_back(t == 0 ? 0 : t < 4 ? int32_t(t) : pos(rng));

  // Slots: unique, shuffled; padding (-1 and other negatives) and beyond the cache (or
  // beyond the SWA table) mixed in.
  const int64_t full_slots = c.swa ? 3 * in.num_slots : in.num_slots;
  std::vector<int64_t> perm(static_cast<size_t>(full_slots));
  for (int64_t i = 0; i < full_slots; ++i) perm[size_t(i)] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    const int64_t kind = t % 7;
    in.slots.push_back(kind == 2 ? -1 : kind == 5 ? -7 - t : kind == 6 ? full_slots + t : perm[size_t(t)]);
  }
  if (c.swa) {
    // The table covers 2/3 of the full slots; every third entry is unmapped and one maps
    // past the end of the SWA cache.
    in.swa_table.assign(size_t(2 * in.num_slots), -1);
    std::vector<int64_t> targets(static_cast<size_t>(in.num_slots));
    for (int64_t i = 0; i < in.num_slots; ++i) targets[size_t(i)] = i;
    std::shuffle(targets.begin(), targets.end(), rng);
    for (size_t i = 0; i < in.swa_table.size() && i < targets.size(); ++i) {
      if (i % 3 != 1) in.swa_table[i] = targets[i];
    }
    in.swa_table[size_t(perm[0] % int64_t(in.swa_table.size()))] = in.num_slots + 3;
    // Token 0 writes whatever the shuffle drew for the others: a full slot that maps.
    for (size_t i = 0; i < in.swa_table.size(); ++i) {
      if (in.swa_table[i] >= 0 && in.swa_table[i] < in.num_slots) {
        in.slots[0] = int64_t(i);
        break;
      }
    }
  }
  RopeScaling sc;
  if (c.yarn) {
    sc.type = RopeType::kYarn;
    sc.factor = 4;
    sc.original_max_position = 1024;
  }
  auto table = rope_table(500000.0, c.head_dim, sc);
  REQUIRE(table.ok());
  in.table = *table;
  if (c.yarn) REQUIRE(in.table.attention_scaling != 1.0f);
  return in;
}

KvWriteArgs write_args(const Inputs& in, const bf16_t* qkv, std::vector<uint8_t>& kc,
                       std::vector<uint8_t>& vc, const float* ks, const float* vs) {
  KvWriteArgs a;
  a.k = qkv + in.q_dim;
  a.v = qkv + in.q_dim + in.kv_dim;
  a.k_token_stride = a.v_token_stride = in.stride;
  a.num_tokens = in.c.num_tokens;
  a.slot_mapping = in.slots.data();
  if (in.c.swa) a.swa = SwaSlotTable{in.swa_table.data(), int64_t(in.swa_table.size())};
  a.cache = {.k = kc.data(), .v = vc.data(), .num_pages = in.c.num_pages,
             .page_size = in.c.page_size, .num_kv_heads = in.c.kv_heads, .head_dim = in.c.head_dim,
             .format = in.c.dtype, .k_scale = ks, .v_scale = vs};
  return a;
}

KvWriteRopeArgs rope_args(const Inputs& in, bf16_t* qkv, std::vector<uint8_t>& kc, std::vector<uint8_t>& vc,
                          const float* ks, const float* vs) {
  KvWriteRopeArgs r;
  r.kv = write_args(in, qkv, kc, vc, ks, vs);
  r.q = qkv;
  r.q_token_stride = in.stride;
  r.q_heads = in.c.q_heads;
  r.positions = in.positions.data();
  r.inv_freq = in.table.inv_freq.data();
  r.attention_scaling = in.table.attention_scaling;
  return r;
}

// Elements [begin, end) of every token's QKV row.
std::vector<bf16_t> columns(const Inputs& in, const std::vector<bf16_t>& qkv, int64_t begin, int64_t end) {
  std::vector<bf16_t> out;
  for (int64_t t = 0; t < in.c.num_tokens; ++t) {
    out.insert(out.end(), qkv.begin() + t * in.stride + begin, qkv.begin() + t * in.stride + end);
  }
  return out;
}

// rope_neox then kv_write_fused (the reference), against kv_write_rope with K read only
// and with k_rotated = K (rope's in-place contract in full).
void run_case(const RopeCase& c) {
  INFO(describe(c));
  const Inputs in = make_inputs(c);
  const int64_t row_bytes = in.kv_dim * kv_format_bytes(c.dtype);
  const size_t cache_bytes = size_t(in.num_slots * row_bytes);
  const float ks = c.k_scale, vs = c.v_scale;

  std::vector<bf16_t> ref = in.qkv;
  std::vector<uint8_t> ref_k(cache_bytes, kSentinel), ref_v(cache_bytes, kSentinel);
  cpu::rope_neox(ref.data(), in.stride, c.q_heads, ref.data() + in.q_dim, in.stride, c.kv_heads, c.head_dim,
                 in.positions.data(), c.num_tokens, in.table.inv_freq.data(), in.table.attention_scaling);
  cpu::kv_write_fused(write_args(in, ref.data(), ref_k, ref_v, &ks, &vs));

  std::vector<bf16_t> got = in.qkv;
  std::vector<uint8_t> got_k(cache_bytes, kSentinel), got_v(cache_bytes, kSentinel);
  cpu::kv_write_rope(rope_args(in, got.data(), got_k, got_v, &ks, &vs));
  CHECK((got_k == ref_k));
  CHECK((got_v == ref_v));
  CHECK((columns(in, got, 0, in.q_dim) == columns(in, ref, 0, in.q_dim)));  // q: rope's bits
  CHECK((columns(in, got, in.q_dim, in.stride) ==
         columns(in, in.qkv, in.q_dim, in.stride)));  // K, V, pad untouched

  std::vector<bf16_t> inplace = in.qkv;
  std::vector<uint8_t> in_k(cache_bytes, kSentinel), in_v(cache_bytes, kSentinel);
  KvWriteRopeArgs r = rope_args(in, inplace.data(), in_k, in_v, &ks, &vs);
  r.k_rotated = inplace.data() + in.q_dim;
  cpu::kv_write_rope(r);
  CHECK((inplace == ref));  // q and K rotated in place, every token, padding included
  CHECK((in_k == ref_k));
  CHECK((in_v == ref_v));

  // Not vacuous: some rows were written and some slots kept the sentinel.
  const auto sentinel_rows = [&](const std::vector<uint8_t>& cache) {
    int64_t n = 0;
    for (int64_t s = 0; s < in.num_slots; ++s) {
      bool all = true;
      for (int64_t b = 0; b < row_bytes && all; ++b) all = cache[size_t(s * row_bytes + b)] == kSentinel;
      n += all ? 1 : 0;
    }
    return n;
  };
  const int64_t untouched = sentinel_rows(ref_v);
  CHECK(untouched < in.num_slots);
  CHECK(untouched > 0);
}

}  // namespace

TEST_CASE("kv write rope (cpu): rope then the fused write bit for bit, every format and head dim",
          "[kv_write][rope]") {
  const KvFormat dtypes[] = {KvFormat::bf16, KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz,
                             KvFormat::fp8_e5m2};
  // Grouped queries (4 per KV head), one query per KV head, and 7 per KV head.
  const int32_t heads[][2] = {{8, 2}, {4, 4}, {7, 1}};
  uint64_t seed = 1;
  int rotation = 0;
  for (KvFormat dtype : dtypes) {
    for (int32_t head_dim : {64, 128, 256}) {
      for (const auto& h : heads) {
        for (bool swa : {false, true}) {
          RopeCase c;
          c.dtype = dtype;
          c.head_dim = head_dim;
          c.q_heads = h[0];
          c.kv_heads = h[1];
          c.swa = swa;
          c.yarn = rotation % 2 == 1;
          c.page_size = rotation % 3 == 0 ? 16 : rotation % 3 == 1 ? 1 : 5;
          c.num_pages = c.page_size == 1 ? 70 : 9;
          c.stride_pad = rotation % 2 == 0 ? 0 : 8;
          c.seed = seed++;
          ++rotation;
          run_case(c);
        }
      }
    }
  }
}

TEST_CASE("kv write rope (cpu): scales of 1 and of 1/64, and a single decode token", "[kv_write][rope]") {
  for (KvFormat dtype : {KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2}) {
    RopeCase c;
    c.dtype = dtype;
    c.k_scale = 1.0f;
    c.v_scale = 1.0f / 64.0f;
    c.seed = 900;
    run_case(c);
    c.num_tokens = 1;  // a decode step of one sequence: position 0, slot perm[0]
    c.seed = 901;
    run_case(c);
  }
}

TEST_CASE("kv write rope (cpu): a batch of padding rotates q and writes nothing", "[kv_write][rope]") {
  RopeCase c;
  Inputs in = make_inputs(c);
  for (size_t t = 0; t < in.slots.size(); ++t) in.slots[t] = t % 2 ? -1 : -3;
  const size_t cache_bytes = size_t(in.num_slots * in.kv_dim);
  const float ks = c.k_scale, vs = c.v_scale;
  std::vector<bf16_t> ref = in.qkv, got = in.qkv;
  cpu::rope_neox(ref.data(), in.stride, c.q_heads, ref.data() + in.q_dim, in.stride, c.kv_heads, c.head_dim,
                 in.positions.data(), c.num_tokens, in.table.inv_freq.data(), in.table.attention_scaling);
  std::vector<uint8_t> k(cache_bytes, kSentinel), v(cache_bytes, kSentinel);
  cpu::kv_write_rope(rope_args(in, got.data(), k, v, &ks, &vs));
  const std::vector<uint8_t> untouched(cache_bytes, kSentinel);
  CHECK((k == untouched));
  CHECK((v == untouched));
  CHECK((columns(in, got, 0, in.q_dim) == columns(in, ref, 0, in.q_dim)));
  CHECK((columns(in, got, in.q_dim, in.stride) == columns(in, in.qkv, in.q_dim, in.stride)));
}

TEST_CASE("kv write rope (cpu): the backend runs it, refuses f16 sources, and kv_write refuses fused_rope",
          "[kv_write][rope][errors]") {
  auto backend = make_cpu_backend();
  RopeCase c;
  const Inputs in = make_inputs(c);
  const size_t cache_bytes = size_t(in.num_slots * in.kv_dim);
  const float ks = c.k_scale, vs = c.v_scale;
  std::vector<bf16_t> ref = in.qkv, got = in.qkv;
  std::vector<uint8_t> ref_k(cache_bytes, kSentinel), ref_v(cache_bytes, kSentinel);
  std::vector<uint8_t> k(cache_bytes, kSentinel), v(cache_bytes, kSentinel);
  cpu::kv_write_rope(rope_args(in, ref.data(), ref_k, ref_v, &ks, &vs));
  KvWriteRopeArgs r = rope_args(in, got.data(), k, v, &ks, &vs);
  REQUIRE(backend->kv_write_rope(r).ok());
  CHECK((got == ref));
  CHECK((k == ref_k));
  CHECK((v == ref_v));

  r.kv.src_dtype = KvSrcDtype::f16;
  const absl::Status f16 = backend->kv_write_rope(r);
  CHECK(f16.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(f16.message()), Catch::Matchers::ContainsSubstring("bf16"));
  const absl::Status wrong_op = backend->kv_write(r.kv, KvWritePath::fused_rope);
  CHECK(wrong_op.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(wrong_op.message()), Catch::Matchers::ContainsSubstring("kv_write_rope"));
}
