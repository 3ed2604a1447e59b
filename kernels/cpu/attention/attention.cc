// CPU reference of paged attention (docs/design.md#attention-unified-and-split).
//
// Both paths compute, for query row at position p and query head h (KV head
// h / (num_q_heads / num_kv_heads)), softmax(q . k_j * softmax_scale) . v_j over the
// keys j in [lo(p), p], lo(p) = max(0, p - W + 1) with a window W > 0 and 0 without.
// Keys and values are dequantised to fp32 exactly as a GPU kernel would
// (fp8_decode(byte) * scale, one fp32 multiply); scores, softmax and the weighted sum
// are fp32; the output is rounded to bf16 once. The two paths differ only in
// summation order, so their fp32 results agree to a few fp32 ulps and their bf16
// outputs to at most one bf16 ulp.
//
// Only positions some query of the current block can see are ever read, so pages that
// fell out of a sliding window may be -1 in the block table. A -1 page (or a page
// index past max_pages_per_seq) inside a visible range is a caller bug and aborts.
#include "kernels/cpu/attention/attention.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

namespace kvfuse::cpu {

namespace {

// size_t of a (non-negative) count; a function call, not a cast, so vector
// declarations like v(sz(n)) do not parse as function declarations.
inline size_t sz(int64_t n) { return static_cast<size_t>(n); }

constexpr int32_t kBlockQ = 16;  // unified: query rows per block (times the GQA group)
constexpr int32_t kTileK = 32;   // unified: keys per online-softmax step

[[noreturn]] void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("kvfuse cpu attention: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  abort();
}

void check_args(const AttnArgs& a) {
  const PagedKvView& c = a.cache;
  if (c.num_kv_heads <= 0 || c.head_dim <= 0 || c.page_size <= 0)
    fail("bad cache view (num_kv_heads=%d head_dim=%d page_size=%d)", c.num_kv_heads, c.head_dim,
         c.page_size);
  if (a.num_q_heads <= 0 || a.num_q_heads % c.num_kv_heads != 0)
    fail("num_q_heads=%d is not a positive multiple of num_kv_heads=%d", a.num_q_heads, c.num_kv_heads);
  if (a.window < 0) fail("negative window %d", a.window);
  if (c.format != KvFormat::bf16 && (c.k_scale == nullptr || c.v_scale == nullptr))
    fail("%s cache without k/v scales", kv_format_name(c.format));
}

// fp8_decode of every byte of a format, so the reader decodes with a table lookup
// (the same floats, computed once).
const float* fp8_table(Fp8Format f) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 3> t{};
    for (Fp8Format fmt : {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz, Fp8Format::e5m2})
      for (int c = 0; c < 256; ++c) t[size_t(fmt)][size_t(c)] = fp8_decode(uint8_t(c), fmt);
    return t;
  }();
  return tables[size_t(f)].data();
}

// Reads one sequence's keys and values of one KV head out of the paged cache as fp32.
class KvReader {
 public:
  KvReader(const AttnArgs& a, int32_t seq)
      : c_(a.cache),
        seq_(seq),
        pages_(a.batch.block_table + int64_t(seq) * a.batch.max_pages_per_seq),
        max_pages_(a.batch.max_pages_per_seq),
        fp8_(c_.format != KvFormat::bf16),
        fmt_(kv_fp8_format(c_.format)),
        lut_(fp8_ ? fp8_table(fmt_) : nullptr),
        k_scale_(fp8_ ? *c_.k_scale : 1.0f),
        v_scale_(fp8_ ? *c_.v_scale : 1.0f) {}

  int64_t slot(int32_t pos) const {
    const int32_t index = pos / c_.page_size;
    if (index >= max_pages_)
      fail("sequence %d position %d needs page index %d but max_pages_per_seq is %d", seq_, pos, index,
           max_pages_);
    const int32_t page = pages_[index];
    if (page < 0 || page >= c_.num_pages)
      fail("sequence %d position %d is visible but block_table[%d] = %d (num_pages %lld)", seq_, pos, index,
           page, static_cast<long long>(c_.num_pages));
    return int64_t(page) * c_.page_size + pos % c_.page_size;
  }

  // Keys/values of positions [begin, end) for KV head `head`, rows of head_dim.
  void load(int32_t head, int32_t begin, int32_t end, float* k, float* v) const {
    const int32_t d = c_.head_dim;
    for (int32_t pos = begin; pos < end; ++pos) {
      const int64_t off = c_.elem_offset(slot(pos), head);
      float* kr = k + int64_t(pos - begin) * d;
      float* vr = v + int64_t(pos - begin) * d;
      if (fp8_) {
        const uint8_t* kc = static_cast<const uint8_t*>(c_.k) + off;
        const uint8_t* vc = static_cast<const uint8_t*>(c_.v) + off;
        for (int32_t i = 0; i < d; ++i) {
          kr[i] = lut_[kc[i]] * k_scale_;
          vr[i] = lut_[vc[i]] * v_scale_;
        }
      } else {
        const bf16_t* kc = static_cast<const bf16_t*>(c_.k) + off;
        const bf16_t* vc = static_cast<const bf16_t*>(c_.v) + off;
        for (int32_t i = 0; i < d; ++i) {
          kr[i] = bf16_to_f32(kc[i]);
          vr[i] = bf16_to_f32(vc[i]);
        }
      }
    }
  }

 private:
  const PagedKvView& c_;
  int32_t seq_;
  const int32_t* pages_;
  int32_t max_pages_;
  bool fp8_;
  Fp8Format fmt_;
  const float* lut_;
  float k_scale_;
  float v_scale_;
};

int32_t key_lo(int32_t pos, int32_t window) { return window > 0 ? std::max(0, pos - window + 1) : 0; }

// Eight interleaved partial sums (lane l takes elements l, l + 8, ...), folded in a fixed
// order: the same bits on every machine, and lanes the compiler can keep in one vector.
float dot(const float* a, const float* b, int32_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int32_t l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) acc[i % 8] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

void load_q(const AttnArgs& a, int64_t row, int32_t head, float* q) {
  const bf16_t* src = a.q + row * a.q_token_stride + int64_t(head) * a.cache.head_dim;
  for (int32_t i = 0; i < a.cache.head_dim; ++i) q[i] = bf16_to_f32(src[i]);
}

void store_out(const AttnArgs& a, int64_t row, int32_t head, const float* acc, float l) {
  bf16_t* dst = a.out + row * a.out_token_stride + int64_t(head) * a.cache.head_dim;
  for (int32_t i = 0; i < a.cache.head_dim; ++i) dst[i] = f32_to_bf16(acc[i] / l);
}

// Online-softmax state of one (query row, query head).
struct OnlineState {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.0f;
};

// Unified: one (sequence, KV head, block of up to kBlockQ query rows) at a time, all
// query heads of the KV head together; key tiles of kTileK cover the union of the
// block's windows, each tile dequantised once and shared by every query of the block.
void unified_block(const AttnArgs& a, const KvReader& kv, int32_t kv_head, int64_t row0, int32_t pos0,
                   int32_t rows) {
  const int32_t d = a.cache.head_dim;
  const int32_t group = a.num_q_heads / a.cache.num_kv_heads;
  const int32_t n = rows * group;  // (row, head) pairs, row-major
  std::vector<float> q(sz(n) * d), acc(sz(n) * d, 0.0f);
  std::vector<OnlineState> st(sz(n));
  for (int32_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < group; ++h) load_q(a, row0 + r, kv_head * group + h, &q[sz(r * group + h) * d]);

  // Tiles are aligned to multiples of kTileK in absolute positions, so a row meets the
  // same tiles, in the same order, whichever block (prefill chunk or decode step) holds
  // it: its bits do not depend on how the sequence was batched or chunked. Only the
  // block's visible keys [lo, hi] are loaded (pages before lo may be gone).
  const int32_t lo = key_lo(pos0, a.window), hi = pos0 + rows - 1;
  std::vector<float> kt(sz(kTileK) * d), vt(sz(kTileK) * d);
  float p[kTileK];
  for (int32_t t0 = lo / kTileK * kTileK; t0 <= hi; t0 += kTileK) {
    const int32_t t1 = std::min(t0 + kTileK, hi + 1);
    const int32_t l0 = std::max(t0, lo);
    kv.load(kv_head, l0, t1, &kt[sz(l0 - t0) * d], &vt[sz(l0 - t0) * d]);
    for (int32_t r = 0; r < rows; ++r) {
      const int32_t pos = pos0 + r;
      const int32_t jb = std::max(t0, key_lo(pos, a.window)), je = std::min(t1, pos + 1);
      if (jb >= je) continue;  // tile wholly outside this row's window or in its future
      for (int32_t h = 0; h < group; ++h) {
        const int32_t i = r * group + h;
        float* ai = &acc[sz(i) * d];
        float tile_max = -std::numeric_limits<float>::infinity();
        for (int32_t j = jb; j < je; ++j) {
          p[j - t0] = dot(&q[sz(i) * d], &kt[sz(j - t0) * d], d) * a.softmax_scale;
          tile_max = std::max(tile_max, p[j - t0]);
        }
        const float m_new = std::max(st[i].m, tile_max);
        const float alpha = std::exp(st[i].m - m_new);  // 0 on the first visible tile
        float l = st[i].l * alpha;
        for (int32_t x = 0; x < d; ++x) ai[x] *= alpha;
        // Masked keys are skipped, never multiplied by a zero weight: a stale or
        // unwritten slot may hold NaN.
        for (int32_t j = jb; j < je; ++j) {
          const float w = std::exp(p[j - t0] - m_new);
          l += w;
          const float* vr = &vt[sz(j - t0) * d];
          for (int32_t x = 0; x < d; ++x) ai[x] += w * vr[x];
        }
        st[i].m = m_new;
        st[i].l = l;
      }
    }
  }
  for (int32_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < group; ++h) {
      const int32_t i = r * group + h;
      store_out(a, row0 + r, kv_head * group + h, &acc[sz(i) * d], st[i].l);
    }
}

// Split: one query row at position `pos` over keys [lo(pos), pos], whose fp32 keys and
// values start at position `base` in k/v. Partitions are aligned to multiples of
// partition_size in absolute positions (as a GPU grid would cut them); those wholly
// before the window are skipped. Each partition yields (m, l, unnormalised acc); the
// merge rescales by exp(m_k - M). Decode rows and prefill rows both come here, so a
// position's output has the same bits whether it was computed in a decode step or in a
// prefill chunk (a recomputation after preemption, a differently chunked prompt).
void split_row(const AttnArgs& a, int32_t kv_head, int64_t row, int32_t pos, const float* k, const float* v,
               int32_t base, int32_t partition_size) {
  const int32_t d = a.cache.head_dim;
  const int32_t group = a.num_q_heads / a.cache.num_kv_heads;
  const int32_t lo = key_lo(pos, a.window);
  const int32_t first = lo / partition_size, last = pos / partition_size;
  const int32_t parts = last - first + 1;

  std::vector<float> q(sz(group) * d);
  for (int32_t h = 0; h < group; ++h) load_q(a, row, kv_head * group + h, &q[sz(h) * d]);
  std::vector<float> m(sz(parts) * group), l(sz(parts) * group);
  std::vector<float> acc(sz(parts) * group * d, 0.0f);
  std::vector<float> s(sz(partition_size));

  for (int32_t p = 0; p < parts; ++p) {
    const int32_t b = std::max(lo, (first + p) * partition_size);
    const int32_t e = std::min(pos + 1, (first + p + 1) * partition_size);
    const float* kp = k + sz(b - base) * d;
    const float* vp = v + sz(b - base) * d;
    for (int32_t h = 0; h < group; ++h) {
      const size_t i = sz(p) * group + h;
      float mk = -std::numeric_limits<float>::infinity();
      for (int32_t j = 0; j < e - b; ++j) {
        s[j] = dot(&q[sz(h) * d], &kp[sz(j) * d], d) * a.softmax_scale;
        mk = std::max(mk, s[j]);
      }
      float lk = 0.0f;
      float* ai = &acc[i * d];
      for (int32_t j = 0; j < e - b; ++j) {
        const float w = std::exp(s[j] - mk);
        lk += w;
        for (int32_t x = 0; x < d; ++x) ai[x] += w * vp[sz(j) * d + x];
      }
      m[i] = mk;
      l[i] = lk;
    }
  }

  // Log-sum-exp merge. Every partition holds at least one visible key, so every m_k
  // is finite.
  std::vector<float> out(sz(d));
  for (int32_t h = 0; h < group; ++h) {
    float big_m = -std::numeric_limits<float>::infinity();
    for (int32_t p = 0; p < parts; ++p) big_m = std::max(big_m, m[sz(p) * group + h]);
    float big_l = 0.0f;
    std::fill(out.begin(), out.end(), 0.0f);
    for (int32_t p = 0; p < parts; ++p) {
      const size_t i = sz(p) * group + h;
      const float f = std::exp(m[i] - big_m);
      big_l += l[i] * f;
      for (int32_t x = 0; x < d; ++x) out[x] += acc[i * d + x] * f;
    }
    store_out(a, row, kv_head * group + h, out.data(), big_l);
  }
}

// Split, a sequence's query rows (one decode row or a prefill chunk): the keys of the
// rows' visible range are dequantised once per KV head, then each row is split_row.
void split_rows(const AttnArgs& a, const KvReader& kv, int32_t kv_head, int64_t row0, int32_t pos0,
                int32_t rows, int32_t partition_size) {
  const int32_t d = a.cache.head_dim;
  const int32_t lo = key_lo(pos0, a.window), hi = pos0 + rows - 1;
  const int32_t nk = hi - lo + 1;
  std::vector<float> k(sz(nk) * d), v(sz(nk) * d);
  kv.load(kv_head, lo, hi + 1, k.data(), v.data());
  for (int32_t r = 0; r < rows; ++r)
    split_row(a, kv_head, row0 + r, pos0 + r, k.data(), v.data(), lo, partition_size);
}

struct SeqRows {
  int64_t row0;  // first query row in q/out
  int32_t rows;  // query length
  int32_t pos0;  // position of the first query row
};

SeqRows seq_rows(const AttnBatch& b, int32_t s) {
  const int32_t q0 = b.query_start[s], q1 = b.query_start[s + 1];
  const int32_t ctx = b.context_len[s];
  if (q1 < q0 || q1 - q0 > ctx) fail("sequence %d: query rows [%d, %d) but context_len %d", s, q0, q1, ctx);
  return {q0, q1 - q0, ctx - (q1 - q0)};
}

}  // namespace

void attention_unified(const AttnArgs& args) {
  check_args(args);
  for (int32_t s = 0; s < args.batch.num_seqs; ++s) {
    const SeqRows sr = seq_rows(args.batch, s);
    if (sr.rows == 0) continue;
    const KvReader kv(args, s);
    for (int32_t g = 0; g < args.cache.num_kv_heads; ++g)
      for (int32_t r0 = 0; r0 < sr.rows; r0 += kBlockQ)
        unified_block(args, kv, g, sr.row0 + r0, sr.pos0 + r0, std::min(kBlockQ, sr.rows - r0));
  }
}

void attention_split(const AttnArgs& args, int32_t partition_size) {
  check_args(args);
  if (partition_size <= 0) fail("partition_size %d must be positive", partition_size);
  for (int32_t s = 0; s < args.batch.num_seqs; ++s) {
    const SeqRows sr = seq_rows(args.batch, s);
    if (sr.rows == 0) continue;
    const KvReader kv(args, s);
    for (int32_t g = 0; g < args.cache.num_kv_heads; ++g)
      split_rows(args, kv, g, sr.row0, sr.pos0, sr.rows, partition_size);
  }
}

}  // namespace kvfuse::cpu
