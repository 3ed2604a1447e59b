// The paged attention test problems that the GPU parity test (tests/gpu/test_attention_gpu.cu)
// and the host lane runs of the MFMA kernel (tests/kernels/test_attention_mfma_lanes.cc) share:
// mixed batches of prefill chunks (with prior context) and decode rows over shuffled
// pages, -1 for pages outside every window and NaN in every slot no query may read; the
// CPU reference's output; and the comparison with its tolerance:
//   |out - cpu| <= ulp_bf16(max(|out|, |cpu|)) + 1e-4
// Both sides compute in fp32 and round the output to bf16 once; they differ in
// summation order (and exp2 vs exp), a few fp32 ulps (1e-4 for outputs near zero
// through cancellation; values here are O(1), and a wrong mask, page or scale moves
// outputs by ~0.1). Out-of-row padding must be untouched and every output written.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention/attention.h"
#include "kernels/common/kv_types.h"

namespace kvfuse::attention_cases {

constexpr double kAbsTol = 1e-4;
constexpr bf16_t kPadBits = 0x1234;    // out padding: must survive
constexpr bf16_t kUnsetBits = 0x7fc1;  // out rows before the call: every one must be overwritten

struct SeqSpec {
  int32_t ctx;    // context length including the new tokens
  int32_t q_len;  // new tokens (1 = decode)
};

struct Case {
  KvFormat dtype = KvFormat::fp8_e4m3fn;
  int fp8_decode = 0;  // AttnLaunch::fp8_decode
  int32_t num_kv_heads = 2;
  int32_t gqa = 4;
  int32_t head_dim = 128;
  int32_t page_size = 16;
  int32_t window = 0;
  int32_t partition = 512;      // the caller's partition_size (the backend's)
  int32_t split_partition = 0;  // AttnLaunch::split_partition (0: from the SM count)
  float k_scale = 0.37f;
  float v_scale = 2.9f;
  int64_t q_pad = 0;
  int64_t out_pad = 0;
  std::vector<SeqSpec> seqs;
  uint64_t seed = 1;
  float q_range = 2.0f;
};

inline std::string describe(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%s%s kvh=%d gqa=%d D=%d page=%d window=%d partition=%d/%d seqs=", kv_format_name(c.dtype),
                c.fp8_decode == 1 ? "(bits)" : "", c.num_kv_heads, c.gqa, c.head_dim, c.page_size, c.window,
                c.partition, c.split_partition);
  std::string s = buf;
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    if (i == 6) {
      std::snprintf(buf, sizeof buf, "...x%zu", c.seqs.size());
      s.append(buf);
      break;
    }
    std::snprintf(buf, sizeof buf, "(%d,%d)", c.seqs[i].ctx, c.seqs[i].q_len);
    s.append(buf);
  }
  return s;
}

inline int32_t first_visible(int32_t pos, int32_t window) {
  return window > 0 ? std::max(0, pos - window + 1) : 0;
}

// Host problem with the layout the device copy gets (kernels/common/kv_types.h).
// Pages for a batch's sequences (each with ctx and q_len): which pages each needs (none
// wholly before its window), drawn from a shuffled pool with 3 spare pages; -1 in the
// block table for every page not needed. The CPU attention test builds its own problems
// with it too (tests/kernels/test_attention.cc).
template <class Seqs, class Rng>
void place_pages(const Seqs& seqs, int32_t window, int32_t ps, int32_t max_pages, Rng& rng, int64_t& num_pages,
                 std::vector<int32_t>& block_table) {
  std::vector<std::vector<bool>> needed(seqs.size());
  int64_t total = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int32_t lo = first_visible(seqs[s].ctx - seqs[s].q_len, window);
    for (int32_t i = 0; i * ps < seqs[s].ctx; ++i) {
      needed[s].push_back((i + 1) * ps - 1 >= lo);
      total += needed[s].back();
    }
  }
  num_pages = total + 3;
  std::vector<int32_t> pool(static_cast<size_t>(num_pages));
  for (int32_t i = 0; i < int32_t(num_pages); ++i) pool[size_t(i)] = i;
  std::shuffle(pool.begin(), pool.end(), rng);
  block_table.assign(seqs.size() * size_t(max_pages), -1);
  size_t next = 0;
  for (size_t s = 0; s < seqs.size(); ++s)
    for (size_t i = 0; i < needed[s].size(); ++i)
      if (needed[s][i]) block_table[s * size_t(max_pages) + i] = pool[next++];
}

// K and V caches of `elems` elements of `dtype`, NaN in every slot (a kernel that reads a
// slot nobody wrote produces NaN).
inline void nan_caches(KvFormat dtype, size_t elems, std::vector<uint8_t>& k, std::vector<uint8_t>& v) {
  const size_t eb = size_t(kv_format_bytes(dtype));
  k.assign(elems * eb, 0);
  v.assign(elems * eb, 0);
  for (size_t e = 0; e < elems; ++e) {
    if (dtype != KvFormat::bf16) {
      k[e] = v[e] = fp8_spec(kv_fp8_format(dtype)).nan_code;
    } else {
      const bf16_t nan = 0x7fc0;
      memcpy(&k[e * 2], &nan, 2);
      memcpy(&v[e * 2], &nan, 2);
    }
  }
}

struct Problem {
  Case c;
  int32_t num_q_heads = 0;
  int64_t num_tokens = 0, q_stride = 0, out_stride = 0, row = 0, num_pages = 0;
  int32_t max_pages = 1, max_query_len = 0, max_context_len = 0;
  std::vector<int32_t> query_start, context_len, block_table;
  std::vector<bf16_t> q;
  std::vector<uint8_t> k_cache, v_cache;
  float k_scale = 1.0f, v_scale = 1.0f;
};

// Shuffled page pool; -1 for pages wholly before every window; NaN in every slot no query
// may read (unallocated pages, slots past the context, slots before the window), so a
// kernel that reads or mixes in a masked key produces NaN.
inline Problem make_problem(const Case& c) {
  Problem p;
  p.c = c;
  p.k_scale = c.k_scale;
  p.v_scale = c.v_scale;
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f), qdist(-c.q_range, c.q_range);
  const int32_t ps = c.page_size;
  p.num_q_heads = c.num_kv_heads * c.gqa;
  p.row = int64_t(c.num_kv_heads) * c.head_dim;
  p.query_start.push_back(0);
  for (const SeqSpec& s : c.seqs) {
    p.query_start.push_back(p.query_start.back() + s.q_len);
    p.context_len.push_back(s.ctx);
    p.max_pages = std::max(p.max_pages, (s.ctx + ps - 1) / ps + 1);  // one spare entry
    p.max_query_len = std::max(p.max_query_len, s.q_len);
    p.max_context_len = std::max(p.max_context_len, s.ctx);
  }
  p.num_tokens = p.query_start.back();

  place_pages(c.seqs, c.window, ps, p.max_pages, rng, p.num_pages, p.block_table);

  const size_t cache_elems = size_t(p.num_pages * ps * p.row);
  nan_caches(c.dtype, cache_elems, p.k_cache, p.v_cache);
  const int eb = kv_format_bytes(c.dtype);
  const bool fp8 = c.dtype != KvFormat::bf16;
  const Fp8Format fmt = kv_fp8_format(c.dtype);
  const auto store = [&](std::vector<uint8_t>& cache, size_t elem, float x, float scale) {
    if (fp8) {
      cache[elem] = fp8_encode(x * (1.0f / scale), fmt);
    } else {
      const bf16_t b = f32_to_bf16(x);
      memcpy(&cache[elem * 2], &b, 2);
    }
  };
  // Big problems (the benchmark's shape): random codes straight into the rows, 8 at a
  // time; finite (bit 6 clear: e4m3/e5m2 exponents below the NaN/inf codes; no FNUZ
  // 0x80), bf16 values in [0.5, 1) with random signs.
  const bool big = cache_elems > (size_t(1) << 24);
  uint64_t x = c.seed * 0x9e3779b97f4a7c15ull + 1;
  const auto next64 = [&x]() {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    return x * 0x2545f4914f6cdd1dull;
  };
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const int32_t ctx = c.seqs[s].ctx;
    const int32_t lo = first_visible(ctx - c.seqs[s].q_len, c.window);
    for (int32_t pos = lo; big && pos < ctx; ++pos) {
      const int64_t slot = int64_t(p.block_table[s * size_t(p.max_pages) + size_t(pos / ps)]) * ps + pos % ps;
      for (std::vector<uint8_t>* cache : {&p.k_cache, &p.v_cache}) {
        uint8_t* dst = cache->data() + size_t(slot * p.row * eb);
        for (int64_t i = 0; i < p.row * eb; i += 8) {
          uint64_t r = next64();
          if (fp8) {
            r &= 0xbfbfbfbfbfbfbfbfull;
            if (c.dtype == KvFormat::fp8_e4m3fnuz) r |= 0x0101010101010101ull;  // never 0x80
          } else {
            r = (r & 0x807f807f807f807full) | 0x3f003f003f003f00ull;
          }
          memcpy(dst + i, &r, 8);
        }
      }
    }
    for (int32_t pos = lo; !big && pos < ctx; ++pos) {
      const int64_t slot = int64_t(p.block_table[s * size_t(p.max_pages) + size_t(pos / ps)]) * ps + pos % ps;
      for (int64_t e = 0; e < p.row; ++e) {
        const size_t at = size_t(slot * p.row + e);
        // Keys spread over the FP8 range (including subnormals) after scaling; values O(1).
        const float kx = uni(rng) * (fp8 ? std::exp2(float(int(rng() % 12)) - 6.0f) : 1.0f);
        store(p.k_cache, at, kx * c.k_scale, c.k_scale);
        store(p.v_cache, at, uni(rng) * c.v_scale, c.v_scale);
      }
    }
  }
  p.q_stride = int64_t(p.num_q_heads) * c.head_dim + c.q_pad;
  p.out_stride = int64_t(p.num_q_heads) * c.head_dim + c.out_pad;
  p.q.resize(size_t(p.num_tokens * p.q_stride));
  for (auto& x : p.q) x = f32_to_bf16(qdist(rng));
  return p;
}

inline AttnArgs make_args(const Problem& p, const bf16_t* q, bf16_t* out, const int32_t* qs,
                          const int32_t* cl, const int32_t* bt, const void* k, const void* v, const float* ks,
                          const float* vs) {
  AttnArgs a;
  a.q = q;
  a.q_token_stride = p.q_stride;
  a.out = out;
  a.out_token_stride = p.out_stride;
  a.num_q_heads = p.num_q_heads;
  a.softmax_scale = 1.0f / std::sqrt(float(p.c.head_dim));
  a.window = p.c.window;
  a.batch.num_seqs = int32_t(p.c.seqs.size());
  a.batch.num_tokens = p.num_tokens;
  a.batch.query_start = qs;
  a.batch.context_len = cl;
  a.batch.block_table = bt;
  a.batch.max_pages_per_seq = p.max_pages;
  a.batch.max_query_len = p.max_query_len;
  a.batch.max_context_len = p.max_context_len;
  a.cache.k = const_cast<void*>(k);
  a.cache.v = const_cast<void*>(v);
  a.cache.num_pages = p.num_pages;
  a.cache.page_size = p.c.page_size;
  a.cache.num_kv_heads = p.c.num_kv_heads;
  a.cache.head_dim = p.c.head_dim;
  a.cache.format = p.c.dtype;
  a.cache.k_scale = ks;
  a.cache.v_scale = vs;
  return a;
}

inline std::vector<bf16_t> fresh_out(const Problem& p) {
  std::vector<bf16_t> out(size_t(p.num_tokens * p.out_stride), kPadBits);
  for (int64_t t = 0; t < p.num_tokens; ++t)
    for (int64_t e = 0; e < int64_t(p.num_q_heads) * p.c.head_dim; ++e)
      out[size_t(t * p.out_stride + e)] = kUnsetBits;
  return out;
}

inline double bf16_ulp(double x) {
  int e = 0;
  std::frexp(std::max(std::fabs(x), 1e-30), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 7);
}

struct Stats {
  double max_err = 0.0;  // max |gpu - cpu| / tolerance over passing elements
  int64_t elems = 0, equal = 0;
};
inline Stats& stats() {
  static Stats s;
  return s;
}

// Compares one output with the CPU reference; prints the first few mismatches. Empty if
// they agree, else what is wrong.
inline std::string compare_outputs(const Problem& p, const std::vector<bf16_t>& gpu,
                                   const std::vector<bf16_t>& cpu, const std::string& what) {
  const int64_t row = int64_t(p.num_q_heads) * p.c.head_dim;
  int64_t bad = 0, unset = 0, pad = 0;
  double worst = 0.0;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t i = 0; i < p.out_stride; ++i) {
      const size_t at = size_t(t * p.out_stride + i);
      if (i >= row) {
        pad += gpu[at] != kPadBits;
        continue;
      }
      unset += gpu[at] == kUnsetBits;
      const double a = bf16_to_f32(gpu[at]), b = bf16_to_f32(cpu[at]);
      const double ulp = bf16_ulp(std::max(std::fabs(a), std::fabs(b)));
      const double err = std::fabs(a - b);
      if (!(err <= ulp + kAbsTol)) {
        if (++bad <= 3) {
          std::printf("  %s: token %lld head %lld dim %lld: got %.6g cpu %.6g\n", what.c_str(), (long long)t,
                      (long long)(i / p.c.head_dim), (long long)(i % p.c.head_dim), a, b);
        }
      } else {
        worst = std::max(worst, err / (ulp + kAbsTol));
      }
      ++stats().elems;
      stats().equal += gpu[at] == cpu[at];
    }
  }
  stats().max_err = std::max(stats().max_err, worst);
  if (bad == 0 && unset == 0 && pad == 0) return {};
  return what + ": " + std::to_string(bad) + " outside tolerance, " + std::to_string(unset) + " unset, " +
         std::to_string(pad) + " padding changed";
}

inline std::vector<bf16_t> run_cpu(const Problem& p) {
  std::vector<bf16_t> out = fresh_out(p);
  const AttnArgs a =
      make_args(p, p.q.data(), out.data(), p.query_start.data(), p.context_len.data(), p.block_table.data(),
                p.k_cache.data(), p.v_cache.data(), &p.k_scale, &p.v_scale);
  cpu::attention_unified(a);
  return out;
}

// Mixed batch: fresh prefill, prefill chunks with prior context, decode rows (one at
// position 0), contexts over several partitions of 64.
inline std::vector<SeqSpec> mixed_batch() {
  return {{37, 37}, {70, 19}, {1, 1}, {45, 1}, {129, 1}, {200, 33}, {17, 2}, {64, 1}, {300, 1}};
}

// The parity matrix: every dtype x head_dim x GQA ratio on the mixed batch, page sizes
// x windows, other GQA ratios and KV head counts, long contexts over many partitions.
// `quick` keeps a corner of each group.
inline std::vector<Case> matrix_cases(bool quick) {
  const KvFormat all[] = {KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2, KvFormat::bf16};
  std::vector<Case> cases;
  uint64_t seed = 100;
  // Every dtype x head_dim x GQA ratio on the mixed batch, small partitions.
  for (KvFormat dt : all) {
    for (int fp8_decode : {0, 1}) {
      if (fp8_decode == 1 && dt != KvFormat::fp8_e4m3fn) continue;
      for (int32_t d : {64, 128, 256}) {
        for (int32_t gqa : {1, 2, 4, 7, 8}) {
          if (quick && !(gqa == 4 || (gqa == 7 && d == 64))) continue;
          Case c;
          c.dtype = dt;
          c.fp8_decode = fp8_decode;
          c.head_dim = d;
          c.gqa = gqa;
          c.num_kv_heads = gqa == 1 ? 3 : 2;
          c.partition = 64;
          c.seqs = mixed_batch();
          c.seed = ++seed;
          cases.push_back(c);
        }
      }
    }
  }
  // Page sizes (aligned and not, powers of two and not) x windows, two dtypes.
  for (KvFormat dt : {KvFormat::fp8_e4m3fn, KvFormat::bf16}) {
    for (int32_t ps : {1, 3, 16, 48, 64}) {
      for (int32_t window : {0, 7, 64, 1000}) {
        if (quick && !((ps == 3 && window == 7) || (ps == 48 && window == 64) || (ps == 1 && window == 0)))
          continue;
        Case c;
        c.dtype = dt;
        c.page_size = ps;
        c.window = window;
        c.gqa = 3;
        c.head_dim = 64;
        c.partition = 32;
        c.q_pad = 8;
        c.out_pad = 24;
        c.seqs = mixed_batch();
        c.seed = ++seed;
        cases.push_back(c);
      }
    }
  }
  // Other GQA ratios and KV head counts, e5m2 / fnuz with windows.
  for (int32_t gqa : {3, 5, 6}) {
    if (quick) break;
    Case c;
    c.dtype = gqa == 5 ? KvFormat::fp8_e5m2 : KvFormat::fp8_e4m3fnuz;
    c.gqa = gqa;
    c.num_kv_heads = 1;
    c.window = 20;
    c.partition = 16;
    c.seqs = mixed_batch();
    c.seed = ++seed;
    cases.push_back(c);
  }
  // Long contexts: many partitions, windows that drop most pages, prefill over a long
  // prior context, the backend's partition of 512 with the automatic split.
  for (int32_t window : {0, 1500}) {
    for (int32_t part : {64, 512}) {
      if (quick && (window != 1500 || part != 64)) continue;
      for (int32_t split : {0, 4096}) {
        Case c;
        c.dtype = KvFormat::fp8_e4m3fn;
        c.gqa = 4;
        c.num_kv_heads = 2;
        c.window = window;
        c.partition = part;
        c.split_partition = split;
        c.page_size = 16;
        c.seqs = quick ? std::vector<SeqSpec>{{2100, 1}, {1700, 3}}
                       : std::vector<SeqSpec>{{5000, 1}, {3000, 1}, {4096, 1}, {4500, 40}, {1, 1}, {9000, 1}};
        c.seed = ++seed;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

}  // namespace kvfuse::attention_cases
