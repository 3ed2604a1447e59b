// Tests of the CPU paged attention (kernels/cpu/attention/attention.h): unified and split agree
// with each other and with a dense double-precision reference on mixed batches, GQA,
// sliding windows, FP8 and bf16 caches, shuffled page tables and multi-partition
// split-KV.
//
// Tolerances. Both kernels compute in fp32 and round the output to bf16 once; they
// differ only in summation order (tiles vs partitions vs two-pass), so their fp32
// results differ by a few fp32 ulps and their bf16 outputs by at most one bf16 ulp when
// the fp32 values straddle a rounding boundary. Hence:
//  - unified vs split: |a - b| <= 1 bf16 ulp of max(|a|, |b|) + kAbsTol;
//  - kernel vs the double reference: |out - ref| <= 2^-7 |ref| + kAbsTol (bf16 keeps 8
//    significant bits, so rounding alone costs up to half an ulp = 2^-8 relative; the
//    other half ulp covers the fp32 accumulation and exp).
// kAbsTol covers outputs that are near zero through cancellation, where the fp32
// accumulation error (~1e-6 of max |v| for the few hundred keys used here) is many bf16
// ulps of the tiny result. Values are O(1), so 1e-4 is far below any real error (a
// wrong mask, scale or page changes outputs by ~1e-1).
#include "tests/util/catch.h"
#include "tests/util/attention_cases.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/attention/attention.h"

namespace {

using namespace kvfuse;

// The tolerance, the padding and unset-row markers and a sequence's shape are those of
// the GPU parity test's problems (tests/util/attention_cases.h).
using attention_cases::kAbsTol;
using attention_cases::kPadBits;
using attention_cases::kUnsetBits;
using attention_cases::SeqSpec;

struct AttnCase {
  KvFormat dtype = KvFormat::bf16;
  int32_t num_kv_heads = 2;
  int32_t gqa = 1;  // query heads per KV head
  int32_t head_dim = 64;
  int32_t page_size = 16;
  int32_t window = 0;
  int32_t partition = 8;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  int64_t q_pad = 0;    // extra elements per q row
  int64_t out_pad = 0;  // extra elements per out row
  std::vector<SeqSpec> seqs;
  uint64_t seed = 1;
};

std::string describe(const AttnCase& c) {
  std::ostringstream s;
  s << kv_format_name(c.dtype) << " kv_heads=" << c.num_kv_heads << " gqa=" << c.gqa
    << " head_dim=" << c.head_dim << " page=" << c.page_size << " window=" << c.window
    << " partition=" << c.partition << " seqs=";
  for (const SeqSpec& q : c.seqs) s << "(" << q.ctx << "," << q.q_len << ")";
  return s.str();
}

// Mixed batch: fresh prefill, prefill chunks with prior context, decode rows (one at
// position 0), contexts long enough for many partitions of 8.
std::vector<SeqSpec> mixed_batch() {
  return {{37, 37}, {70, 19}, {1, 1}, {45, 1}, {129, 1}, {200, 33}, {17, 2}, {64, 1}};
}

using attention_cases::first_visible;

struct Problem {
  AttnCase c;
  int32_t num_q_heads;
  int64_t num_tokens;
  int64_t q_stride, out_stride;
  int64_t row;  // elements of one cache row (all KV heads of a slot)
  std::vector<int32_t> query_start, context_len, block_table;
  int32_t max_pages;
  int64_t num_pages;
  std::vector<bf16_t> q;
  std::vector<uint8_t> k_cache, v_cache;  // raw bytes, dtype per c.dtype
  // Dequantised keys/values as the kernels must see them, per sequence, dense:
  // [ctx, num_kv_heads, head_dim]; positions no query can see are left at 0.
  std::vector<std::vector<float>> k_dense, v_dense;
  float k_scale, v_scale;
};

// Builds the batch: a shuffled page pool, -1 for pages wholly outside every window,
// and NaN in every cache slot no query may read (unallocated pages, slots past the
// context, slots before the window): a kernel that reads or mixes in a masked key
// produces NaN.
Problem make_problem(const AttnCase& c) {
  Problem p;
  p.c = c;
  p.k_scale = c.k_scale;
  p.v_scale = c.v_scale;
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  const int32_t ps = c.page_size, hd = c.head_dim, nkv = c.num_kv_heads;
  p.num_q_heads = nkv * c.gqa;
  p.row = int64_t(nkv) * hd;

  p.query_start.push_back(0);
  p.max_pages = 1;
  for (const SeqSpec& s : c.seqs) {
    p.query_start.push_back(p.query_start.back() + s.q_len);
    p.context_len.push_back(s.ctx);
    p.max_pages = std::max(p.max_pages, (s.ctx + ps - 1) / ps + 1);  // one spare entry
  }
  p.num_tokens = p.query_start.back();

  attention_cases::place_pages(c.seqs, c.window, ps, p.max_pages, rng, p.num_pages, p.block_table);

  const size_t cache_elems = size_t(p.num_pages * ps * p.row);
  attention_cases::nan_caches(c.dtype, cache_elems, p.k_cache, p.v_cache);
  const bool fp8 = c.dtype != KvFormat::bf16;
  const Fp8Format fmt = kv_fp8_format(c.dtype);
  const auto store = [&](std::vector<uint8_t>& cache, size_t elem, float x, float scale) -> float {
    if (fp8) {
      cache[elem] = fp8_encode(x * (1.0f / scale), fmt);
      return fp8_decode(cache[elem], fmt) * scale;
    }
    const bf16_t b = f32_to_bf16(x);
    memcpy(&cache[elem * 2], &b, 2);
    return bf16_to_f32(b);
  };
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const int32_t ctx = c.seqs[s].ctx;
    const int32_t lo = first_visible(ctx - c.seqs[s].q_len, c.window);
    p.k_dense.emplace_back(size_t(ctx) * size_t(p.row), 0.0f);
    p.v_dense.emplace_back(size_t(ctx) * size_t(p.row), 0.0f);
    for (int32_t pos = lo; pos < ctx; ++pos) {
      const int64_t slot = int64_t(p.block_table[s * size_t(p.max_pages) + size_t(pos / ps)]) * ps + pos % ps;
      for (int64_t e = 0; e < p.row; ++e) {
        const size_t at = size_t(slot * p.row + e), dense = size_t(pos * p.row + e);
        p.k_dense[s][dense] = store(p.k_cache, at, uni(rng), c.k_scale);
        p.v_dense[s][dense] = store(p.v_cache, at, uni(rng), c.v_scale);
      }
    }
  }

  p.q_stride = int64_t(p.num_q_heads) * hd + c.q_pad;
  p.out_stride = int64_t(p.num_q_heads) * hd + c.out_pad;
  p.q.resize(size_t(p.num_tokens * p.q_stride));
  for (auto& x : p.q) x = f32_to_bf16(uni(rng));
  return p;
}

AttnArgs make_args(Problem& p, std::vector<bf16_t>& out) {
  AttnArgs a;
  a.q = p.q.data();
  a.q_token_stride = p.q_stride;
  a.out = out.data();
  a.out_token_stride = p.out_stride;
  a.num_q_heads = p.num_q_heads;
  a.softmax_scale = 1.0f / std::sqrt(float(p.c.head_dim));
  a.window = p.c.window;
  a.batch.num_seqs = int32_t(p.c.seqs.size());
  a.batch.num_tokens = p.num_tokens;
  a.batch.query_start = p.query_start.data();
  a.batch.context_len = p.context_len.data();
  a.batch.block_table = p.block_table.data();
  a.batch.max_pages_per_seq = p.max_pages;
  for (const SeqSpec& s : p.c.seqs) {
    a.batch.max_query_len = std::max(a.batch.max_query_len, s.q_len);
    a.batch.max_context_len = std::max(a.batch.max_context_len, s.ctx);
  }
  a.cache = {.k = p.k_cache.data(), .v = p.v_cache.data(), .num_pages = p.num_pages,
             .page_size = p.c.page_size, .num_kv_heads = p.c.num_kv_heads, .head_dim = p.c.head_dim,
             .format = p.c.dtype, .k_scale = &p.k_scale, .v_scale = &p.v_scale};
  return a;
}

std::vector<bf16_t> fresh_out(const Problem& p) {
  std::vector<bf16_t> out(size_t(p.num_tokens * p.out_stride), kPadBits);
  for (int64_t t = 0; t < p.num_tokens; ++t)
    for (int64_t e = 0; e < int64_t(p.num_q_heads) * p.c.head_dim; ++e)
      out[size_t(t * p.out_stride + e)] = kUnsetBits;
  return out;
}

// Dense reference in double over gathered K/V: out[t, h, :] for every query row.
std::vector<double> reference(const Problem& p) {
  const int32_t hd = p.c.head_dim, nq = p.num_q_heads;
  const double scale = double(1.0f / std::sqrt(float(hd)));
  std::vector<double> out(size_t(p.num_tokens) * size_t(nq) * size_t(hd), 0.0);
  std::vector<double> w;
  for (size_t s = 0; s < p.c.seqs.size(); ++s) {
    const int32_t ctx = p.c.seqs[s].ctx, q_len = p.c.seqs[s].q_len;
    for (int32_t j = 0; j < q_len; ++j) {
      const int64_t t = p.query_start[s] + j;
      const int32_t pos = ctx - q_len + j, lo = first_visible(pos, p.c.window);
      for (int32_t h = 0; h < nq; ++h) {
        const int32_t g = h / p.c.gqa;
        const bf16_t* q = &p.q[size_t(t * p.q_stride + int64_t(h) * hd)];
        w.assign(size_t(pos - lo + 1), 0.0);
        double mx = -1e300;
        for (int32_t k = lo; k <= pos; ++k) {
          const float* kr = &p.k_dense[s][size_t((int64_t(k) * p.c.num_kv_heads + g) * hd)];
          double dot = 0.0;
          for (int32_t d = 0; d < hd; ++d) dot += double(bf16_to_f32(q[d])) * double(kr[d]);
          w[size_t(k - lo)] = dot * scale;
          mx = std::max(mx, dot * scale);
        }
        double sum = 0.0;
        for (double& x : w) sum += (x = std::exp(x - mx));
        double* o = &out[(size_t(t) * size_t(nq) + size_t(h)) * size_t(hd)];
        for (int32_t k = lo; k <= pos; ++k) {
          const float* vr = &p.v_dense[s][size_t((int64_t(k) * p.c.num_kv_heads + g) * hd)];
          for (int32_t d = 0; d < hd; ++d) o[d] += w[size_t(k - lo)] / sum * double(vr[d]);
        }
      }
    }
  }
  return out;
}

double bf16_ulp(double x) {
  int e = 0;
  std::frexp(std::max(std::fabs(x), 1e-30), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 7);
}

struct Errors {
  int64_t bad_ref = 0, bad_pair = 0, unset = 0, pad_changed = 0, bitwise_equal = 0, total = 0;
  double max_ref_err = 0.0;  // in units of the tolerance
  std::string first;
};

Errors compare(const Problem& p, const std::vector<bf16_t>& uni, const std::vector<bf16_t>& spl,
               const std::vector<double>& ref) {
  Errors e;
  const int64_t row = int64_t(p.num_q_heads) * p.c.head_dim;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t i = 0; i < p.out_stride; ++i) {
      const size_t at = size_t(t * p.out_stride + i);
      if (i >= row) {
        e.pad_changed += (uni[at] != kPadBits) + (spl[at] != kPadBits);
        continue;
      }
      e.unset += (uni[at] == kUnsetBits) + (spl[at] == kUnsetBits);
      const double a = bf16_to_f32(uni[at]), b = bf16_to_f32(spl[at]), r = ref[size_t(t * row + i)];
      ++e.total;
      e.bitwise_equal += uni[at] == spl[at];
      const double tol_ref = std::ldexp(std::fabs(r), -7) + kAbsTol;
      const double err = std::max(std::fabs(a - r), std::fabs(b - r));
      e.max_ref_err = std::max(e.max_ref_err, err / tol_ref);
      const bool ok_ref = err <= tol_ref;  // false for NaN
      const bool ok_pair = std::fabs(a - b) <= bf16_ulp(std::max(std::fabs(a), std::fabs(b))) + kAbsTol;
      if ((!ok_ref || !ok_pair) && e.first.empty())
        e.first = (std::ostringstream() << "token " << t << " elem " << i << ": unified " << a << " split "
                                        << b << " reference " << r)
                      .str();
      e.bad_ref += !ok_ref;
      e.bad_pair += !ok_pair;
    }
  }
  return e;
}

void run_case(const AttnCase& c) {
  INFO(describe(c));
  Problem p = make_problem(c);
  const std::vector<uint8_t> k_before = p.k_cache, v_before = p.v_cache;
  const std::vector<bf16_t> q_before = p.q;
  std::vector<bf16_t> out_u = fresh_out(p), out_s = fresh_out(p);
  cpu::attention_unified(make_args(p, out_u));
  cpu::attention_split(make_args(p, out_s), c.partition);
  const Errors e = compare(p, out_u, out_s, reference(p));
  INFO(e.first);
  INFO("max error vs reference, in units of the tolerance: " << e.max_ref_err);
  INFO("unified and split bitwise equal: " << e.bitwise_equal << " of " << e.total);
  CHECK(e.total > 0);
  CHECK(e.unset == 0);
  CHECK(e.pad_changed == 0);
  CHECK(e.bad_ref == 0);
  CHECK(e.bad_pair == 0);
  // Different summation orders still give the same bf16 almost everywhere.
  CHECK(double(e.bitwise_equal) >= 0.99 * double(e.total));
  // Double parentheses: compare without Catch2 printing whole buffers.
  CHECK((p.k_cache == k_before));
  CHECK((p.v_cache == v_before));
  CHECK((p.q == q_before));
}

}  // namespace

TEST_CASE("attention: unified and split match a dense reference (bf16 cache, GQA 1/2/4/8, pages 1 and 16)",
          "[attention]") {
  uint64_t seed = 1;
  for (int32_t gqa : {1, 2, 4, 8})
    for (int32_t ps : {1, 16}) {
      AttnCase c;
      c.gqa = gqa;
      c.page_size = ps;
      c.seqs = mixed_batch();
      c.seed = seed++;
      run_case(c);
    }
}

TEST_CASE("attention: unified and split match a dense reference (fp8 caches, k_scale != v_scale)",
          "[attention]") {
  uint64_t seed = 100;
  for (KvFormat d : {KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2})
    for (int32_t ps : {1, 16}) {
      AttnCase c;
      c.dtype = d;
      c.gqa = ps == 1 ? 4 : 2;
      c.page_size = ps;
      c.k_scale = 0.0113f;  // |x| <= 2 becomes up to ~177 stored: most of the e4m3 range
      c.v_scale = 0.0271f;
      c.seqs = mixed_batch();
      c.seed = seed++;
      run_case(c);
    }
}

TEST_CASE("attention: sliding windows 5 and 17 with -1 pages outside every window", "[attention]") {
  uint64_t seed = 200;
  for (int32_t window : {5, 17})
    for (int32_t ps : {1, 16})
      for (KvFormat d : {KvFormat::bf16, KvFormat::fp8_e4m3fn}) {
        AttnCase c;
        c.dtype = d;
        c.window = window;
        c.page_size = ps;
        c.gqa = window == 5 ? 8 : 2;
        c.k_scale = 0.02f;
        c.v_scale = 0.05f;
        c.seqs = mixed_batch();
        c.seqs.push_back({300, 1});  // decode far past the window: most pages are -1
        c.seqs.push_back({90, 40});  // a chunk longer than the window
        c.seed = seed++;
        run_case(c);
      }
}

TEST_CASE("attention: split-KV merges many partitions (context > partition_size)", "[attention]") {
  uint64_t seed = 300;
  for (int32_t partition : {8, 64, 256})
    for (int32_t window : {0, 100}) {
      AttnCase c;
      c.gqa = 4;
      c.page_size = 16;
      c.partition = partition;
      c.window = window;
      c.dtype = partition == 64 ? KvFormat::fp8_e5m2 : KvFormat::bf16;
      c.k_scale = 0.5f;
      c.v_scale = 0.25f;
      c.seqs = {{300, 1}, {513, 1}, {700, 1}, {257, 1}, {256, 1}, {9, 1}};
      c.seed = seed++;
      run_case(c);
    }
}

TEST_CASE("attention: head_dim 64, 128 and 256", "[attention]") {
  uint64_t seed = 400;
  for (int32_t hd : {64, 128, 256}) {
    AttnCase c;
    c.head_dim = hd;
    c.num_kv_heads = 1;
    c.gqa = 2;
    c.dtype = hd == 128 ? KvFormat::fp8_e4m3fn : KvFormat::bf16;
    c.k_scale = 0.015f;
    c.v_scale = 0.03f;
    c.seqs = {{50, 20}, {77, 1}, {33, 1}};
    c.seed = seed++;
    run_case(c);
  }
}

TEST_CASE("attention: strided q and out rows, out padding untouched", "[attention]") {
  AttnCase c;
  c.gqa = 2;
  c.q_pad = 2 * 2 * 64 + 3;  // q as a view into a fused QKV row
  c.out_pad = 5;
  c.seqs = mixed_batch();
  c.seed = 500;
  run_case(c);
}

TEST_CASE("attention: a single visible key returns its value exactly", "[attention]") {
  // Window 1 (or context 1): softmax over one key has weight exactly 1, so the output is
  // the stored value, bit for bit, whatever the scores.
  for (int32_t window : {0, 1}) {
    AttnCase c;
    c.window = window;
    c.gqa = 2;
    c.seqs = window == 0 ? std::vector<SeqSpec>{{1, 1}} : std::vector<SeqSpec>{{20, 6}, {40, 1}};
    Problem p = make_problem(c);
    std::vector<bf16_t> out_u = fresh_out(p), out_s = fresh_out(p);
    cpu::attention_unified(make_args(p, out_u));
    cpu::attention_split(make_args(p, out_s), 8);
    int64_t bad = 0;
    for (size_t s = 0; s < c.seqs.size(); ++s)
      for (int32_t j = 0; j < c.seqs[s].q_len; ++j) {
        const int64_t t = p.query_start[s] + j;
        const int32_t pos = c.seqs[s].ctx - c.seqs[s].q_len + j;
        for (int32_t h = 0; h < p.num_q_heads; ++h)
          for (int32_t d = 0; d < c.head_dim; ++d) {
            const float v =
                p.v_dense[s][size_t((int64_t(pos) * c.num_kv_heads + h / c.gqa) * c.head_dim + d)];
            const size_t at = size_t(t * p.out_stride + int64_t(h) * c.head_dim + d);
            bad += (out_u[at] != f32_to_bf16(v)) + (out_s[at] != f32_to_bf16(v));
          }
      }
    INFO("window " << window);
    CHECK(bad == 0);
  }
}

// A -1 page inside a visible range is a caller bug: the kernel must abort with a
// message rather than read page -1. Checked in a forked child whose stderr is captured.
TEST_CASE("attention: a -1 page inside the visible range aborts with a message", "[attention]") {
  for (int path = 0; path < 2; ++path)
    for (int32_t q_len : {1, 5}) {
      AttnCase c;
      c.seqs = {{40, q_len}};
      Problem p = make_problem(c);
      p.block_table[1] = -1;  // positions 16..31: visible to every query of the sequence
      std::vector<bf16_t> out = fresh_out(p);
      int fds[2];
      REQUIRE(pipe(fds) == 0);
      fflush(nullptr);
      const pid_t pid = fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        signal(SIGABRT, SIG_DFL);  // Catch2's handler would report a failure in the child
        dup2(fds[1], STDERR_FILENO);
        if (path == 0)
          cpu::attention_unified(make_args(p, out));
        else
          cpu::attention_split(make_args(p, out), 8);
        _exit(0);
      }
      close(fds[1]);
      std::string message;
      char buf[256];
      for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) message.append(buf, size_t(n));
      close(fds[0]);
      int status = 0;
      REQUIRE(waitpid(pid, &status, 0) == pid);
      INFO("path " << path << " q_len " << q_len << " stderr: " << message);
      CHECK(WIFSIGNALED(status));
      CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT));
      CHECK(message.find("block_table[1] = -1") != std::string::npos);
    }
}
