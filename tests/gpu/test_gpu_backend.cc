// GPU backend parity against the CPU backend, op by op, through the Backend interface.
// In a build without a GPU backend, or on a machine without a GPU, every test here
// says so and passes without checking anything else.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>
#include "tests/util/catch.h"

#include "kernels/common/fp8.h"
#include "src/backends/backend.h"
#include "src/backends/cpu/cpu_backend.h"
#include "src/loading/rope.h"
#include "tests/util/gpu_backend.h"

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

std::vector<bf16_t> random_bf16(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(dist(rng));
  return v;
}

// |a - b| <= ulps bf16 ulps of the larger magnitude, plus `abs` for values near zero.
void check_close(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b, float ulps, float abs_tol,
                 const char* what) {
  REQUIRE(a.size() == b.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = bf16_to_f32(a[i]), y = bf16_to_f32(b[i]);
    const float tol = ulps * std::ldexp(std::max(std::fabs(x), std::fabs(y)), -7) + abs_tol;
    if (!(std::fabs(x - y) <= tol)) {
      if (bad++ == 0) first = i;
    }
  }
  INFO(what << ": " << bad << " of " << a.size() << " outside tolerance, first at " << first << " ("
            << bf16_to_f32(a[first]) << " vs " << bf16_to_f32(b[first]) << ")");
  CHECK(bad == 0);
}

// The KV write with RoPE over fused QKV rows [T, (qh + 2 kvh) * D] at qkv (q rotated in
// place), into `cache`, with the rope table's frequencies at inv_freq.
KvWriteRopeArgs qkv_rope_args(bf16_t* qkv, int32_t qh, int32_t kvh, int32_t D, int64_t T,
                              const int64_t* slots, const int32_t* positions, const float* inv_freq,
                              float attention_scaling, const PagedKvView& cache) {
  const int64_t stride = int64_t(qh + 2 * kvh) * D;
  KvWriteRopeArgs r;
  r.kv.k = qkv + qh * D;
  r.kv.v = qkv + (qh + kvh) * D;
  r.kv.k_token_stride = r.kv.v_token_stride = stride;
  r.kv.num_tokens = T;
  r.kv.slot_mapping = slots;
  r.kv.cache = cache;
  r.q = qkv;
  r.q_token_stride = stride;
  r.q_heads = qh;
  r.positions = positions;
  r.inv_freq = inv_freq;
  r.attention_scaling = attention_scaling;
  return r;
}

}  // namespace

TEST_CASE("gpu backend: row and elementwise ops match the CPU within one bf16 ulp", "[gpu][ops]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  const int64_t rows = 37, hidden = 512, inter = 384, vocab = 1000;
  const auto x = random_bf16(size_t(rows * hidden), 1);
  const auto w = random_bf16(size_t(hidden), 2, 0.1f);
  const auto table = random_bf16(size_t(vocab * hidden), 3);
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) ids[size_t(i)] = int32_t((i * 7919) % vocab);

  auto both = [&](auto&& run) { return std::make_pair(run(*cpu), run(*gpu)); };
  // rmsnorm: GPU sums squares in another order; the result differs by at most an ulp.
  auto [rc, rg] = both([&](Backend& b) {
    Mirror<bf16_t> in(b, x), wt(b, w), out(b, x.size());
    REQUIRE(b.rmsnorm(in.ptr(), wt.ptr(), rows, hidden, 1e-5f, out.ptr()).ok());
    return out.read(b);
  });
  check_close(rc, rg, 1, 0, "rmsnorm");
  // Both of the kernel's paths, in place as well: rows of 512 and 8192 take 16-byte
  // vectors, 8200 (over 8192) and 100 (not a multiple of 8) the scalar loops.
  for (const int64_t cols : {int64_t(512), int64_t(8192), int64_t(8200), int64_t(100)}) {
    for (const bool in_place : {false, true}) {
      CAPTURE(cols, in_place);
      const int64_t n = 3;
      const auto xs = random_bf16(size_t(n * cols), 21);
      const auto ws = random_bf16(size_t(cols), 22, 0.1f);
      auto run = [&](Backend& b) {
        Mirror<bf16_t> xa(b, xs), wa(b, ws), oa(b, xs.size());
        bf16_t* out = in_place ? xa.ptr() : oa.ptr();
        REQUIRE(b.rmsnorm(xa.ptr(), wa.ptr(), n, cols, 1e-5f, out).ok());
        return in_place ? xa.read(b) : oa.read(b);
      };
      check_close(run(*cpu), run(*gpu), 1, 0, "rmsnorm");
    }
  }

  auto [ec, eg] = both([&](Backend& b) {
    Mirror<int32_t> i(b, ids);
    Mirror<bf16_t> t(b, table), out(b, size_t(rows * hidden));
    REQUIRE(b.embedding(i.ptr(), rows, t.ptr(), hidden, out.ptr()).ok());
    return out.read(b);
  });
  CHECK((ec == eg));

  // silu_mul: 384 columns take the 16-byte path, 100 (not a multiple of 8) the scalar one.
  for (const int64_t cols : {inter, int64_t(100)}) {
    CAPTURE(cols);
    const auto gu = random_bf16(size_t(rows * 2 * cols), 4, 2.0f);
    auto [sc, sg] = both([&](Backend& b) {
      Mirror<bf16_t> in(b, gu), out(b, size_t(rows * cols));
      REQUIRE(b.silu_mul(in.ptr(), rows, cols, out.ptr()).ok());
      return out.read(b);
    });
    check_close(sc, sg, 1, 1e-6f, "silu_mul");
  }

  // residual_add: one fp32 add, one rounding: exact on both. The 16-byte path (aligned;
  // whole vectors, and a tail of 5) and the scalar one (y one element off 16-byte
  // alignment).
  const auto y = random_bf16(x.size(), 5);
  for (const int64_t y_off : {int64_t(0), int64_t(1)}) {
    for (const int64_t count : {int64_t(x.size()) - 8, int64_t(x.size()) - 11}) {
      CAPTURE(y_off, count);
      auto [ac, ag] = both([&](Backend& b) {
        Mirror<bf16_t> a(b, x), c(b, y);
        REQUIRE(b.residual_add(a.ptr(), c.ptr() + y_off, count).ok());
        return a.read(b);
      });
      CHECK((ac == ag));
    }
  }

  // The residual add fused with the norm: x exactly residual_add's, out within an ulp of
  // the CPU's (residual_add then rmsnorm), out aliasing y as the decoder calls it. Rows
  // of 512 and 8192 take the 16-byte path; 8200 (over 8192) and 100 (not a multiple of
  // 8) the scalar loops.
  for (const int64_t cols : {int64_t(512), int64_t(8192), int64_t(8200), int64_t(100)}) {
    for (const int64_t n : {int64_t(1), int64_t(5)}) {
      CAPTURE(cols, n);
      const auto xs = random_bf16(size_t(n * cols), 11);
      const auto ys = random_bf16(size_t(n * cols), 12);
      const auto ws = random_bf16(size_t(cols), 13, 0.1f);
      auto run = [&](Backend& b) {
        Mirror<bf16_t> xa(b, xs), ya(b, ys), wa(b, ws);
        REQUIRE(b.add_rmsnorm(xa.ptr(), ya.ptr(), wa.ptr(), n, cols, 1e-5f, ya.ptr()).ok());
        return std::make_pair(xa.read(b), ya.read(b));
      };
      const auto [cx, co] = run(*cpu);
      const auto [gx, go] = run(*gpu);
      CHECK((cx == gx));
      check_close(co, go, 1, 0, "add_rmsnorm");
    }
  }

  // RoPE on a fused QKV row layout: 8 q heads, 2 kv heads of 64 (and of 72, whose half
  // is not whole 16-byte vectors: the scalar kernel), large positions.
  for (const int32_t d : {64, 72}) {
    CAPTURE(d);
    const int32_t qh = 8, kvh = 2;
    const int64_t stride = int64_t(qh + 2 * kvh) * d;
    const auto qkv = random_bf16(size_t(rows * stride), 6);
    std::vector<int32_t> pos(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) pos[size_t(i)] = int32_t(i * 1000 + 3);
    // Plain RoPE, Llama 3.1's llama3 table, and yarn (factor 4, attention factor 1.1386:
    // cos and sin scaled) over an original context that the positions pass.
    RopeScaling llama3;
    llama3.type = RopeType::kLlama3;
    llama3.factor = 8;
    llama3.original_max_position = 8192;
    RopeScaling yarn;
    yarn.type = RopeType::kYarn;
    yarn.factor = 4;
    yarn.original_max_position = 1024;
    for (const RopeScaling& sc : {RopeScaling{}, llama3, yarn}) {
      CAPTURE(rope_type_name(sc.type));
      auto table = rope_table(500000.0, d, sc);
      REQUIRE(table.ok());
      auto [pc, pg] = both([&](Backend& b) {
        Mirror<bf16_t> t(b, qkv);
        Mirror<int32_t> p(b, pos);
        Mirror<float> inv(b, table->inv_freq);
        REQUIRE(b.rope(t.ptr(), stride, qh, t.ptr() + qh * d, stride, kvh, d, p.ptr(), rows, inv.ptr(),
                       table->attention_scaling)
                    .ok());
        return t.read(b);
      });
      // Device sinf/cosf are within 2 ulp of the libm's: the rotated pair may land one
      // bf16 ulp apart, plus an absolute term for the cancellation in x0*c - x1*s.
      check_close(pc, pg, 1, 2e-3f * table->attention_scaling, "rope");
    }
  }
}

TEST_CASE("gpu backend: linear layers match OpenBLAS within fp32 accumulation and one bf16 ulp",
          "[gpu][gemm]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  for (int64_t m : {1, 5, 64}) {
    const int64_t k = 256, n = 320;
    CAPTURE(m);
    const auto x = random_bf16(size_t(m * k), 10);
    const auto w = random_bf16(size_t(n * k), 11, 1.0f / 16);
    const auto bias = random_bf16(size_t(n), 12);
    for (bool with_bias : {false, true}) {
      std::vector<bf16_t> out[2];
      std::vector<float> logits[2];
      int i = 0;
      for (Backend* b : {cpu.get(), gpu.get()}) {
        auto lw = b->upload_linear(w.data(), n, k, with_bias ? bias.data() : nullptr);
        REQUIRE(lw.ok());
        LinearOutputs r = linear_outputs(*b, *lw, x, m);
        out[i] = std::move(r.out);
        logits[i] = std::move(r.logits);
        ++i;
      }
      // Outputs have magnitude ~1; fp32 sums of 256 products differ by ~1e-6.
      check_close(out[0], out[1], 1, 1e-4f, "linear");
      float worst = 0;
      for (size_t j = 0; j < logits[0].size(); ++j)
        worst = std::max(worst, std::fabs(logits[0][j] - logits[1][j]));
      INFO("linear_logits max |difference| " << worst);
      CHECK(worst < 1e-4f);
    }
  }
}

// A server ends GEMM tuning after its warm-up, so that a step whose GEMM shape is new
// (a mixed prefill step's token count) does not wait while the shape's candidates are
// timed: such a shape then runs an untimed choice, with the same results within the
// GEMM's tolerance.
TEST_CASE("gpu backend: after end_gemm_tuning a new GEMM shape runs untimed and right", "[gpu][gemm]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  // Shapes that no other test, and no earlier run (choices persist in the GEMM cache
  // file), is likely to have timed.
  std::random_device rd;
  const int64_t k = 256, n = 16 * (64 + int64_t(rd() % 4096));
  const auto w = random_bf16(size_t(n * k), 30, 1.0f / 16);
  auto lw_gpu = gpu->upload_linear(w.data(), n, k, nullptr);
  auto lw_cpu = cpu->upload_linear(w.data(), n, k, nullptr);
  REQUIRE(lw_gpu.ok());
  REQUIRE(lw_cpu.ok());
  const auto linear = [&](Backend& b, const LinearWeight& lw, int64_t m) {
    const auto x = random_bf16(size_t(m * k), uint32_t(31 + m));
    Mirror<bf16_t> in(b, x), o(b, size_t(m * n));
    REQUIRE(b.linear(in.ptr(), m, lw, o.ptr()).ok());
    return o.read(b);
  };
  const char* tune = std::getenv("KVFUSE_GEMM_TUNE");
  const bool tuning = tune == nullptr || (std::strcmp(tune, "0") != 0 && std::strcmp(tune, "off") != 0);
  const char* keep = std::getenv("KVFUSE_GEMM_TUNE_WHILE_SERVING");
  const bool ends = keep == nullptr || std::strcmp(keep, "1") != 0;
  CAPTURE(n, tuning, ends);

  const int64_t before = gpu->gemm_shapes_timed();
  check_close(linear(*cpu, *lw_cpu, 3), linear(*gpu, *lw_gpu, 3), 1, 1e-4f, "linear, m 3, tuned");
  const int64_t after_first = gpu->gemm_shapes_timed();
  if (tuning) CHECK(after_first == before + 1);
  CHECK(gpu->end_gemm_tuning() == ends);
  check_close(linear(*cpu, *lw_cpu, 6), linear(*gpu, *lw_gpu, 6), 1, 1e-4f, "linear, m 6, after the end");
  check_close(linear(*cpu, *lw_cpu, 3), linear(*gpu, *lw_gpu, 3), 1, 1e-4f, "linear, m 3, again");
  if (ends) {
    CHECK(gpu->gemm_shapes_timed() == after_first);
  } else {
    WARN("KVFUSE_GEMM_TUNE_WHILE_SERVING=1: the backend keeps tuning, as asked");
  }
}

// linear_silu_mul is linear then silu_mul, whichever the backend runs (the fused GEMV at
// the decode sizes where the tuner picked it, else the two ops): act's bits equal the two
// ops' on the same backend, and the CPU's within the ops' tolerance.
TEST_CASE("gpu backend: linear_silu_mul gives linear then silu_mul's bits", "[gpu][gemm]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  const int64_t k = 512, inter = 264, n = 2 * inter;
  for (int64_t m : {1, 2, 8, 40}) {
    CAPTURE(m);
    const auto x = random_bf16(size_t(m * k), 20);
    const auto w = random_bf16(size_t(n * k), 21, 1.0f / 16);
    std::vector<bf16_t> fused[2], two_ops[2];
    int i = 0;
    for (Backend* b : {cpu.get(), gpu.get()}) {
      auto lw = b->upload_linear(w.data(), n, k, nullptr);
      REQUIRE(lw.ok());
      Mirror<bf16_t> in(*b, x), gu(*b, size_t(m * n)), act(*b, size_t(m * inter)), ref(*b, size_t(m * inter));
      REQUIRE(b->linear_silu_mul(in.ptr(), m, *lw, inter, gu.ptr(), act.ptr()).ok());
      REQUIRE(b->linear(in.ptr(), m, *lw, gu.ptr()).ok());
      REQUIRE(b->silu_mul(gu.ptr(), m, inter, ref.ptr()).ok());
      fused[i] = act.read(*b);
      two_ops[i] = ref.read(*b);
      ++i;
    }
    CHECK(fused[0] == two_ops[0]);
    CHECK(fused[1] == two_ops[1]);
    check_close(fused[0], fused[1], 3, 1e-4f, "linear_silu_mul");
  }
}

TEST_CASE("gpu backend: paged attention (unified and split) matches the CPU reference", "[gpu][attention]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  std::mt19937 rng(7);
  for (KvFormat dtype : {KvFormat::bf16, KvFormat::fp8_e4m3fn, KvFormat::fp8_e5m2}) {
    for (int32_t head_dim : {64, 128, 256}) {
      for (int32_t window : {0, 37}) {
        CAPTURE(kv_format_name(dtype), head_dim, window);
        const int32_t kvh = 2, qh = 8, ps = 16, num_pages = 160;
        // Three sequences: a prefill chunk after some context, and two decodes, one
        // with a context longer than a split partition.
        const std::vector<int32_t> qlen = {9, 1, 1}, ctx = {70, 1200, 33};
        std::vector<int32_t> qstart = {0};
        for (int32_t l : qlen) qstart.push_back(qstart.back() + l);
        const int32_t T = qstart.back();
        const int32_t maxp = (1200 + ps - 1) / ps;
        std::vector<int32_t> pages(static_cast<size_t>(num_pages));
        for (int32_t i = 0; i < num_pages; ++i) pages[size_t(i)] = i;
        std::shuffle(pages.begin(), pages.end(), rng);
        std::vector<int32_t> bt(size_t(3 * maxp), -1);
        int32_t next = 0;
        for (int s = 0; s < 3; ++s) {
          for (int32_t p = 0; p < (ctx[size_t(s)] + ps - 1) / ps; ++p)
            bt[size_t(s * maxp + p)] = pages[size_t(next++)];
        }
        const size_t cache_elems = size_t(num_pages) * ps * kvh * head_dim;
        const int eb = kv_format_bytes(dtype);
        std::vector<uint8_t> kc(cache_elems * size_t(eb)), vc(cache_elems * size_t(eb));
        for (size_t i = 0; i < cache_elems; ++i) {
          const float a = std::normal_distribution<float>(0, 1)(rng),
                      b = std::normal_distribution<float>(0, 1)(rng);
          if (dtype == KvFormat::bf16) {
            const bf16_t x = f32_to_bf16(a), y = f32_to_bf16(b);
            std::memcpy(&kc[2 * i], &x, 2);
            std::memcpy(&vc[2 * i], &y, 2);
          } else {
            kc[i] = fp8_encode(a / 0.05f, kv_fp8_format(dtype));
            vc[i] = fp8_encode(b / 0.02f, kv_fp8_format(dtype));
          }
        }
        const auto q = random_bf16(size_t(T * qh * head_dim), 20);
        const std::vector<float> scales = {0.05f, 0.02f};
        std::vector<bf16_t> results[3];
        int r = 0;
        for (Backend* b : {cpu.get(), gpu.get(), gpu.get()}) {
          Mirror<uint8_t> K(*b, kc), V(*b, vc);
          Mirror<float> S(*b, scales);
          Mirror<int32_t> QS(*b, qstart), CL(*b, ctx), BT(*b, bt);
          Mirror<bf16_t> Q(*b, q), O(*b, size_t(T * qh * head_dim));
          AttnArgs a;
          a.q = Q.ptr();
          a.q_token_stride = qh * head_dim;
          a.out = O.ptr();
          a.out_token_stride = qh * head_dim;
          a.num_q_heads = qh;
          a.softmax_scale = 1.0f / std::sqrt(float(head_dim));
          a.window = window;
          a.batch = {3, T, QS.ptr(), CL.ptr(), BT.ptr(), maxp, 9, 1200};
          a.cache = {K.ptr(), V.ptr(), num_pages, ps, kvh, head_dim, dtype, S.ptr(), S.ptr() + 1};
          REQUIRE(b->attention(a, r == 2 ? AttentionPath::split : AttentionPath::unified).ok());
          results[r++] = O.read(*b);
        }
        // Same fp32 math in another order (and exp2f for exp): one bf16 ulp, as the
        // CPU's own unified/split comparison allows, plus 1e-4 near zero.
        check_close(results[0], results[1], 1, 1e-4f, "unified");
        check_close(results[0], results[2], 1, 1e-4f, "split");
      }
    }
  }
}

TEST_CASE("gpu backend: KV writes through the backend give the CPU's bytes", "[gpu][kv_write]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  const int32_t H = 8, D = 128, ps = 16, pages = 8, T = 40;
  auto src = random_bf16(size_t(T * 3 * H * D), 30, 50.0f);  // a QKV-shaped row: K and V are strided views
  src[5] = 0x7f80;                                           // +inf
  src[H * D + 9] = 0x7fc1;                                   // NaN in K
  std::vector<int64_t> slots(static_cast<size_t>(T));
  for (int32_t t = 0; t < T; ++t) slots[size_t(t)] = t % 7 == 3 ? -1 : int64_t((t * 37) % (pages * ps));
  for (KvFormat dtype : {KvFormat::bf16, KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2}) {
    for (KvWritePath path : {KvWritePath::fused, KvWritePath::unfused}) {
      CAPTURE(kv_format_name(dtype), int(path));
      std::vector<uint8_t> caches[2];
      int i = 0;
      for (Backend* b : {cpu.get(), gpu.get()}) {
        const size_t bytes = size_t(pages * ps * H * D * kv_format_bytes(dtype));
        Mirror<bf16_t> in(*b, src);
        Mirror<int64_t> sl(*b, slots);
        Mirror<uint8_t> kc(*b, bytes), vc(*b, bytes);
        Mirror<float> sc(*b, std::vector<float>{0.37f, 2.5f});
        KvWriteArgs w;
        w.k = in.ptr() + H * D;
        w.v = in.ptr() + 2 * H * D;
        w.k_token_stride = w.v_token_stride = 3 * H * D;
        w.num_tokens = T;
        w.slot_mapping = sl.ptr();
        w.cache = {kc.ptr(), vc.ptr(), pages, ps, H, D, dtype, sc.ptr(), sc.ptr() + 1};
        REQUIRE(b->kv_write(w, path).ok());
        caches[i] = kc.read(*b);
        const auto v = vc.read(*b);
        caches[i].insert(caches[i].end(), v.begin(), v.end());
        ++i;
      }
      CHECK((caches[0] == caches[1]));
    }
  }
}

TEST_CASE("gpu backend: the KV write with RoPE gives rope's q and the CPU write's bytes of its K",
          "[gpu][kv_write][rope]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  // A QKV row of llama3-8b's grouping (4 query heads per KV head), large positions.
  const int32_t qh = 8, kvh = 2, D = 128, ps = 16, pages = 8, T = 40;
  const int64_t stride = int64_t(qh + 2 * kvh) * D;
  const auto src = random_bf16(size_t(T * stride), 31, 20.0f);
  std::vector<int64_t> slots(static_cast<size_t>(T));
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int32_t t = 0; t < T; ++t) {
    slots[size_t(t)] = t % 7 == 3 ? -1 : int64_t((t * 37) % (pages * ps));
    pos[size_t(t)] = t * 997 + 5;
  }
  auto table = rope_table(500000.0, D, RopeScaling{});
  REQUIRE(table.ok());
  for (KvFormat dtype : {KvFormat::bf16, KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2}) {
    CAPTURE(kv_format_name(dtype));
    const size_t bytes = size_t(pages * ps * kvh * D * kv_format_bytes(dtype));
    // The GPU: q rotated in place, the rotated K into a copy of the rows (k_rotated).
    Mirror<bf16_t> in(*gpu, src), rot(*gpu, src);
    Mirror<int64_t> sl(*gpu, slots);
    Mirror<int32_t> p(*gpu, pos);
    Mirror<float> inv(*gpu, table->inv_freq), sc(*gpu, std::vector<float>{0.37f, 2.5f});
    Mirror<uint8_t> kc(*gpu, bytes), vc(*gpu, bytes);
    KvWriteRopeArgs r =
        qkv_rope_args(in.ptr(), qh, kvh, D, T, sl.ptr(), p.ptr(), inv.ptr(), table->attention_scaling,
                      {kc.ptr(), vc.ptr(), pages, ps, kvh, D, dtype, sc.ptr(), sc.ptr() + 1});
    r.k_rotated = rot.ptr() + qh * D;
    REQUIRE(gpu->kv_write_rope(r).ok());
    const auto g_qkv = in.read(*gpu), g_rot = rot.read(*gpu);
    const auto g_k = kc.read(*gpu), g_v = vc.read(*gpu);

    // The CPU: rope, then the fused write of the GPU's rotated K (and V as it stands).
    std::vector<bf16_t> c_qkv = src;
    REQUIRE(cpu->rope(c_qkv.data(), stride, qh, c_qkv.data() + qh * D, stride, kvh, D, pos.data(), T,
                      table->inv_freq.data(), table->attention_scaling)
                .ok());
    // The source rows with columns [begin, end) of each row taken from the CPU's rope.
    const auto rotated_cols = [&](int64_t begin, int64_t end) {
      std::vector<bf16_t> want = src;
      for (int64_t t = 0; t < T; ++t)
        std::copy(c_qkv.begin() + t * stride + begin, c_qkv.begin() + t * stride + end,
                  want.begin() + t * stride + begin);
      return want;
    };
    // rope's tolerance (above), its absolute part scaled by the inputs' spread of 20.
    check_close(g_qkv, rotated_cols(0, qh * D), 1, 2e-3f * 20.0f, "q (K and V unchanged)");
    check_close(g_rot, rotated_cols(qh * D, (qh + kvh) * D), 1, 2e-3f * 20.0f, "k_rotated");
    std::vector<uint8_t> want_k(bytes), want_v(bytes);
    const float scales[2] = {0.37f, 2.5f};
    KvWriteArgs w;
    w.k = g_rot.data() + qh * D;
    w.v = g_rot.data() + (qh + kvh) * D;
    w.k_token_stride = w.v_token_stride = stride;
    w.num_tokens = T;
    w.slot_mapping = slots.data();
    w.cache = {want_k.data(), want_v.data(), pages, ps, kvh, D, dtype, scales, scales + 1};
    REQUIRE(cpu->kv_write(w, KvWritePath::fused).ok());
    CHECK((g_k == want_k));
    CHECK((g_v == want_v));
  }
}

TEST_CASE("gpu backend: attention with RoPE that attention refuses writes no KV", "[gpu][attention][rope]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  // Two sequences of llama3-8b's grouping, their new rows at slots 0..3, a negative
  // window (attention refuses it; the write alone would take these rows). Once as a
  // decode-only batch (the write may go inside attention), once with a prefill row (the
  // write would be its own kernel).
  const int32_t qh = 8, kvh = 2, D = 128, ps = 16, pages = 4;
  const int64_t stride = int64_t(qh + 2 * kvh) * D;
  auto table = rope_table(500000.0, D, RopeScaling{});
  REQUIRE(table.ok());
  for (const std::vector<int32_t>& qlen : {std::vector<int32_t>{1, 1}, std::vector<int32_t>{2, 1}}) {
    CAPTURE(qlen[0]);
    std::vector<int32_t> qstart = {0, qlen[0], qlen[0] + qlen[1]};
    const int32_t T = qstart[2];
    const std::vector<int32_t> ctx = {5, 9}, bt = {0, 1};
    std::vector<int64_t> slots(static_cast<size_t>(T));
    std::vector<int32_t> pos(static_cast<size_t>(T));
    for (int32_t t = 0; t < T; ++t) {
      slots[size_t(t)] = t;
      pos[size_t(t)] = 4 + t;
    }
    const auto src = random_bf16(size_t(T * stride), 32, 3.0f);
    const size_t bytes = size_t(pages * ps * kvh * D);
    Mirror<bf16_t> in(*gpu, src), out(*gpu, size_t(T * qh * D));
    Mirror<int64_t> sl(*gpu, slots);
    Mirror<int32_t> p(*gpu, pos), QS(*gpu, qstart), CL(*gpu, ctx), BT(*gpu, bt);
    Mirror<float> inv(*gpu, table->inv_freq), sc(*gpu, std::vector<float>{0.37f, 2.5f});
    Mirror<uint8_t> kc(*gpu, bytes), vc(*gpu, bytes);
    AttnArgs a;
    a.q = in.ptr();
    a.q_token_stride = stride;
    a.out = out.ptr();
    a.out_token_stride = qh * D;
    a.num_q_heads = qh;
    a.softmax_scale = 1.0f / std::sqrt(float(D));
    a.window = -1;
    a.batch = {2, T, QS.ptr(), CL.ptr(), BT.ptr(), 1, qlen[0], 9};
    a.cache = {kc.ptr(), vc.ptr(), pages, ps, kvh, D, KvFormat::fp8_e4m3fn, sc.ptr(), sc.ptr() + 1};
    const KvWriteRopeArgs r = qkv_rope_args(in.ptr(), qh, kvh, D, T, sl.ptr(), p.ptr(), inv.ptr(),
                                            table->attention_scaling, a.cache);
    for (AttentionPath path : {AttentionPath::unified, AttentionPath::split}) {
      const absl::Status st = gpu->attention_rope(a, r, path);
      INFO(st.message());
      CHECK(st.code() == absl::StatusCode::kInvalidArgument);
      CHECK(st.message().find("window") != std::string::npos);
    }
    REQUIRE(gpu->synchronize().ok());
    const std::vector<uint8_t> zeros(bytes, 0);
    CHECK((kc.read(*gpu) == zeros));
    CHECK((vc.read(*gpu) == zeros));
    CHECK((in.read(*gpu) == src));  // q not rotated either
  }
}
