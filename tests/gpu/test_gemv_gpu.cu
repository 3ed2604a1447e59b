// The decode GEMM (kernels/gemm/gemv.cuh) against an exact reference: out = x . w^T for m = 1..8
// rows over shapes from tiny to llama3-8b's (n not a multiple of the block's rows, k of
// one 16-byte chunk up to 14336), fp32 and bf16 outputs, and the refusals. Without a GPU
// it skips.
//
// Tolerance: the kernel sums k products in fp32 in its own order, each product exact
// (bf16 x bf16 fits fp32), so |out - exact| <= gamma(k) * sum |x w| with gamma(k) = k u /
// (1 - k u), u = 2^-24 (Higham (4.4), whatever the order); bf16 outputs add one rounding,
// at most half an ulp of the result: the test allows one ulp. The exact value is computed
// in double (products exact, sums of at most 14336 terms with 2^-53 rounding each).
//
// Weights loaded as streaming data (the default) or through L1 give the same bits.
//
// The fused silu_mul variant (launch_gemv_silu_mul_bf16) is checked bit for bit against
// the same variant's bf16 GEMV followed by launch_silu_mul: the sums are the same, so
// must the bits be; so is the pushed GEMV (launch_gemv_push_bf16), each target holding the
// results' push_bits and nothing else.
//
// The skinny tensor-core GEMM (kernels/gemm/gemm_skinny.cuh, m up to 64) is held to the same
// bound for every variant (k split 1 to 8 ways: the parts are fp32 sums too, and adding
// them is more fp32 additions, within gamma(k)), its bf16 output must be its fp32 output
// rounded, and each variant must repeat its own bits on a second launch.
#include "kernels/common/gpu.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/gemm/gemm_skinny.cuh"
#include "kernels/gemm/gemv.cuh"
#include "kernels/ops/model_ops.cuh"
#include "kernels/parallel/tp_push.h"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using gpu_test::check;
using gpu_test::DeviceMem;

double bf16_ulp(double v) {
  int e = 0;
  std::frexp(std::max(std::fabs(v), 1e-30), &e);
  return std::ldexp(1.0, e - 1 - 7);
}

// Random operands: x [m, k] in [-1, 1), w [n, k] in [-0.05, 0.05), bf16.
struct Operands {
  std::vector<bf16_t> x, w;
};
Operands random_operands(int64_t m, int64_t n, int64_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Operands o{std::vector<bf16_t>(size_t(m * k)), std::vector<bf16_t>(size_t(n * k))};
  for (auto& v : o.x) v = f32_to_bf16(dist(rng));
  for (auto& v : o.w) v = f32_to_bf16(dist(rng) * 0.05f);
  return o;
}

// out = x . w^T in double (products exact, sums of at most 14336 terms) and sum |x w| of
// every output, the bound's scale.
struct Exact {
  std::vector<double> value, mag;
};
Exact exact_products(const Operands& o, int64_t m, int64_t n, int64_t k) {
  Exact e{std::vector<double>(size_t(m * n)), std::vector<double>(size_t(m * n))};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0, mag = 0.0;
      for (int64_t c = 0; c < k; ++c) {
        const double p =
            double(bf16_to_f32(o.x[size_t(i * k + c)])) * double(bf16_to_f32(o.w[size_t(j * k + c)]));
        sum += p;
        mag += std::fabs(p);
      }
      e.value[size_t(i * n + j)] = sum;
      e.mag[size_t(i * n + j)] = mag;
    }
  }
  return e;
}

// The fp32 outputs within gamma(k) sum |x w| of the exact ones, the bf16 outputs within
// that and one ulp (the header's bound).
void check_bound(const std::string& what, const Exact& e, int64_t k, const std::vector<float>& of,
                 const std::vector<bf16_t>& ob) {
  const double u = std::ldexp(1.0, -24), gamma = double(k) * u / (1.0 - double(k) * u);
  int64_t bad_f = 0, bad_b = 0;
  double worst = 0.0;
  for (size_t i = 0; i < e.value.size(); ++i) {
    const double tol = gamma * e.mag[i];
    const double ef = std::fabs(double(of[i]) - e.value[i]);
    const double eb = std::fabs(double(bf16_to_f32(ob[i])) - e.value[i]);
    bad_f += !(ef <= tol);
    bad_b += !(eb <= tol + bf16_ulp(e.value[i]));
    if (tol > 0) worst = std::max(worst, ef / tol);
  }
  check(bad_f == 0 && bad_b == 0, what + ": " + std::to_string(bad_f) + " fp32 and " + std::to_string(bad_b) +
                                      " bf16 outputs outside the bound (worst fp32 " + std::to_string(worst) +
                                      " of it)");
}

void run_shape(int64_t m, int64_t n, int64_t k, uint64_t seed, cudaStream_t stream, int variant = 0) {
  const Operands ops = random_operands(m, n, k, seed);
  const auto& [x, w] = ops;
  DeviceMem dx(x.size() * 2), dw(w.size() * 2), df(size_t(m * n) * 4), db(size_t(m * n) * 2);
  dx.upload(x.data(), x.size() * 2);
  dw.upload(w.data(), w.size() * 2);
  const std::string what = "gemv " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                           " variant " + std::to_string(variant);
  const gpu::LaunchStatus sf = gpu::launch_gemv_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k, df.get(),
                                                     true, stream, false, variant);
  check(sf.ok(), what + " f32: " + sf.message());
  const gpu::LaunchStatus sb = gpu::launch_gemv_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k, db.get(),
                                                     false, stream, true, variant);
  check(sb.ok(), what + " bf16: " + sb.message());
  // The weights loaded through L1 as x is (stream_w = false): the same sums, the same bits.
  DeviceMem dl(size_t(m * n) * 4);
  const gpu::LaunchStatus sl = gpu::launch_gemv_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k, dl.get(),
                                                     true, stream, false, variant, /*stream_w=*/false);
  check(sl.ok(), what + " f32, w through L1: " + sl.message());
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const std::vector<float> of = df.download<float>(size_t(m * n));
  const std::vector<bf16_t> ob = db.download<bf16_t>(size_t(m * n));
  check(std::memcmp(of.data(), dl.download<float>(size_t(m * n)).data(), of.size() * sizeof(float)) == 0,
        what + ": the streaming and the L1 weight loads give different bits");
  check_bound(what, exact_products(ops, m, n, k), k, of, ob);
}

// act = silu_mul(x . w^T), w = [gate rows; up rows] of n = 2 x inter rows.
void run_silu_shape(int64_t m, int64_t n, int64_t k, uint64_t seed, cudaStream_t stream, int variant) {
  const auto [x, w] = random_operands(m, n, k, seed);
  const int64_t inter = n / 2;
  DeviceMem dx(x.size() * 2), dw(w.size() * 2), dgu(size_t(m * n) * 2), dref(size_t(m * inter) * 2),
      dact(size_t(m * inter) * 2);
  dx.upload(x.data(), x.size() * 2);
  dw.upload(w.data(), w.size() * 2);
  const std::string what = "gemv silu_mul " + std::to_string(m) + "x" + std::to_string(n) + "x" +
                           std::to_string(k) + " variant " + std::to_string(variant);
  check(gpu::launch_gemv_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k, dgu.get(), false, stream, false, variant)
            .ok(),
        what + ": the GEMV");
  KVFUSE_TEST_GPU(gpu::launch_silu_mul(dgu.get<bf16_t>(), m, inter, dref.get<bf16_t>(), stream));
  const gpu::LaunchStatus st = gpu::launch_gemv_silu_mul_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k,
                                                              dact.get<bf16_t>(), stream, true, variant);
  check(st.ok(), what + ": " + st.message());
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const std::vector<bf16_t> ref = dref.download<bf16_t>(size_t(m * inter));
  const std::vector<bf16_t> got = dact.download<bf16_t>(size_t(m * inter));
  int64_t differ = 0;
  for (size_t i = 0; i < ref.size(); ++i) differ += ref[i] != got[i];
  check(differ == 0, what + ": " + std::to_string(differ) + " of " + std::to_string(ref.size()) +
                         " outputs differ from the GEMV then silu_mul");
}

// The pushed GEMV (launch_gemv_push_bf16): out has the plain GEMV's bits, and each of two
// targets holds push_bits of every result and nothing else (the elements around stay
// kPushEmpty). Targets 16-byte aligned (`offset` 0) take the vector stores where n is a
// multiple of 8, one element off (`offset` 1) the element stores; staged or not.
void run_push_shape(int64_t m, int64_t n, int64_t k, uint64_t seed, cudaStream_t stream, int variant,
                    bool staged, int64_t offset) {
  const auto [x, w] = random_operands(m, n, k, seed);
  // Each target: pad elements, count results, pad elements; the two one after the other.
  const int64_t count = m * n, pad = 8, stride = count + 2 * pad;
  const size_t elements = size_t(2 * stride);
  DeviceMem dx(x.size() * 2), dw(w.size() * 2), dref(size_t(count) * 2), dout(size_t(count) * 2),
      dt(elements * 2);
  dx.upload(x.data(), x.size() * 2);
  dw.upload(w.data(), w.size() * 2);
  KVFUSE_TEST_GPU(cudaMemsetAsync(dt.get(), 0xff, elements * 2, stream));
  PushTargets targets;
  targets.count = 2;
  for (int p = 0; p < 2; ++p) targets.dst[p] = dt.get<uint16_t>() + p * stride + pad + offset;
  const std::string what = "gemv push " + std::to_string(m) + "x" + std::to_string(n) + "x" +
                           std::to_string(k) + " variant " + std::to_string(variant) +
                           (staged ? " staged" : "") + " offset " + std::to_string(offset);
  check(gpu::launch_gemv_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k, dref.get(), false, stream, false,
                              variant)
            .ok(),
        what + ": the plain GEMV");
  const gpu::LaunchStatus st =
      gpu::launch_gemv_push_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k, dout.get<bf16_t>(), targets,
                                 stream, true, variant, true, staged);
  check(st.ok(), what + ": " + st.message());
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const std::vector<bf16_t> ref = dref.download<bf16_t>(size_t(count));
  const std::vector<bf16_t> out = dout.download<bf16_t>(size_t(count));
  const std::vector<uint16_t> t = dt.download<uint16_t>(elements);
  int64_t out_differ = 0, pushed_differ = 0, stray = 0;
  for (int64_t i = 0; i < count; ++i) out_differ += ref[size_t(i)] != out[size_t(i)];
  for (int p = 0; p < 2; ++p) {
    const int64_t base = p * stride;
    for (int64_t j = 0; j < stride; ++j) {
      const int64_t i = j - pad - offset;  // the result this element holds, if any
      const uint16_t got = t[size_t(base + j)];
      if (i >= 0 && i < count) {
        const uint16_t want = ref[size_t(i)] == kPushEmpty ? kPushNaN : ref[size_t(i)];
        pushed_differ += got != want;
      } else {
        stray += got != kPushEmpty;
      }
    }
  }
  check(out_differ == 0 && pushed_differ == 0 && stray == 0,
        what + ": " + std::to_string(out_differ) + " outputs differ from the plain GEMV, " +
            std::to_string(pushed_differ) + " pushed elements from push_bits of them, " +
            std::to_string(stray) + " elements written outside the targets' results");
}

// Every variant of the skinny GEMM for one shape, fp32 and bf16 outputs, against the
// exact products (computed once).
void run_skinny_shape(int64_t m, int64_t n, int64_t k, uint64_t seed, cudaStream_t stream) {
  const Operands ops = random_operands(m, n, k, seed);
  const auto& [x, w] = ops;
  const Exact exact = exact_products(ops, m, n, k);
  DeviceMem dx(x.size() * 2), dw(w.size() * 2), df(size_t(m * n) * 4), db(size_t(m * n) * 2);
  dx.upload(x.data(), x.size() * 2);
  dw.upload(w.data(), w.size() * 2);
  for (int v = 0; v < gpu::kSkinnyVariants; ++v) {
    const std::string what = "skinny " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                             " variant " + std::to_string(v);
    if (!gpu::skinny_unsupported(dx.get(), m, dw.get(), n, k, df.get(), v).empty()) {
      check(gpu::skinny_splits(v) > k / gpu::kSkinnyStepK,
            what + ": refused only for more splits than k's steps");
      continue;
    }
    const gpu::LaunchStatus sf = gpu::launch_gemm_skinny_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k,
                                                              df.get(), true, stream, false, v);
    check(sf.ok(), what + " f32: " + sf.message());
    const gpu::LaunchStatus sb = gpu::launch_gemm_skinny_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k,
                                                              db.get(), false, stream, true, v);
    check(sb.ok(), what + " bf16: " + sb.message());
    KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
    const std::vector<float> of = df.download<float>(size_t(m * n));
    const std::vector<bf16_t> ob = db.download<bf16_t>(size_t(m * n));
    check_bound(what, exact, k, of, ob);
    int64_t bad_bits = 0;
    for (size_t i = 0; i < of.size(); ++i)
      bad_bits += f32_to_bf16(of[i]) != ob[i];  // the same sums, rounded once
    check(bad_bits == 0, what + ": " + std::to_string(bad_bits) + " bf16 outputs are not the fp32 ones rounded");
    // Again: the same bits.
    KVFUSE_TEST_GPU(cudaMemsetAsync(df.get(), 0xff, size_t(m * n) * 4, stream));
    check(gpu::launch_gemm_skinny_bf16(dx.get<bf16_t>(), m, dw.get<bf16_t>(), n, k, df.get(), true, stream,
                                       false, v)
              .ok(),
          what + ": second launch");
    KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
    const std::vector<float> again = df.download<float>(size_t(m * n));
    check(std::memcmp(again.data(), of.data(), of.size() * 4) == 0,
          what + ": a second launch gives other bits");
  }
}

// Why the skinny GEMM refuses this device (it is built for sm_90 only), or empty.
std::string skinny_device_refusal() {
  DeviceMem a(1 << 16), b(1 << 16), c(1 << 16);
  const std::string why = gpu::skinny_unsupported(a.get(), 16, b.get(), 16, 64, c.get(), 0);
  return why.find("sm_90 only") != std::string::npos ? why : std::string();
}

void test_skinny_refusals(cudaStream_t stream) {
  DeviceMem a(1 << 20), b(1 << 20), c(1 << 20);
  const auto launch = [&](int64_t m, int64_t n, int64_t k, int v, int a_off = 0) {
    return gpu::launch_gemm_skinny_bf16(a.get<bf16_t>() + a_off, m, b.get<bf16_t>(), n, k, c.get(), true,
                                        stream, false, v)
        .ok();
  };
  check(!launch(65, 16, 64, 0), "skinny: m = 65 refused");
  check(!launch(0, 16, 64, 0), "skinny: m = 0 refused");
  check(!launch(16, 24, 64, 0), "skinny: n = 24 refused");
  check(!launch(16, 16, 96, 0), "skinny: k = 96 refused");
  check(!launch(16, 16, 64, 0, 1), "skinny: unaligned x refused");
  check(!launch(16, 16, 128, 2), "skinny: 3 splits of 2 steps refused");
  check(!launch(16, 16, 64, gpu::kSkinnyVariants), "skinny: a variant past kSkinnyVariants refused");
  check(!launch(16, 16, 64, -1), "skinny: a negative variant refused");
  check(launch(16, 16, 64, 0), "skinny: 16 x 16 x 64 unsplit");
  check(launch(16, 16, 128, 1), "skinny: 16 x 16 x 128 in 2 splits");
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
}

void test_refusals(cudaStream_t stream) {
  DeviceMem a(4096), b(4096), c(4096);
  check(!gpu::launch_gemv_bf16(a.get<bf16_t>(), 9, b.get<bf16_t>(), 4, 8, c.get(), true, stream).ok(),
        "m = 9 refused");
  check(!gpu::launch_gemv_bf16(a.get<bf16_t>(), 1, b.get<bf16_t>(), 4, 12, c.get(), true, stream).ok(),
        "k = 12 refused");
  check(!gpu::launch_gemv_bf16(a.get<bf16_t>() + 1, 1, b.get<bf16_t>(), 4, 8, c.get(), true, stream).ok(),
        "unaligned x refused");
  check(gpu::gemv_unsupported(a.get(), 8, b.get(), 4096, 4096, c.get()).empty(), "8 x 4096 x 4096 supported");
  check(!gpu::launch_gemv_bf16(a.get<bf16_t>(), 3, b.get<bf16_t>(), 4, 8, c.get(), true, stream, false,
                               gpu::gemv_variants(3))
             .ok(),
        "a variant past gemv_variants(m) refused");
  check(!gpu::launch_gemv_silu_mul_bf16(a.get<bf16_t>(), 1, b.get<bf16_t>(), 5, 8, c.get<bf16_t>(), stream).ok(),
        "silu_mul with an odd n refused");
}

}  // namespace

// With --skinny, only the skinny GEMM's cases.
int main(int argc, char** argv) {
  if (!gpu_test::gpu_available("test_gemv_gpu")) return 0;
  const bool skinny_only = argc > 1 && std::string(argv[1]) == "--skinny";
  cudaStream_t stream;
  KVFUSE_TEST_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint64_t seed = 1;
  if (!skinny_only) {
    test_refusals(stream);
    for (int64_t m = 1; m <= gpu::kGemvMaxRows; ++m) {
      for (int v = 0; v < gpu::gemv_variants(m); ++v) {
        for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{
                 {1, 8}, {3, 136}, {130, 1000}, {4096, 4096}, {7, 4104}}) {
          run_shape(m, n, k, ++seed, stream, v);
        }
      }
    }
    // llama3-8b's decode shapes at m = 1 and 8: qkv, o, gate/up, down (lm_head's n is the
    // vocabulary, 128256: its 8 x 4096 row is the o shape's).
    for (int64_t m : {1, 8}) {
      for (int v = 0; v < gpu::gemv_variants(m); ++v) {
        for (const auto& [n, k] :
             std::vector<std::pair<int64_t, int64_t>>{{6144, 4096}, {28672, 4096}, {4096, 14336}}) {
          run_shape(m, n, k, ++seed, stream, v);
        }
      }
    }
    // The fused silu_mul epilogue: small and odd shapes for every m and variant, then
    // llama3-8b's gate/up (2 x 14336 rows of 4096) at m = 1 and 8.
    for (int64_t m = 1; m <= gpu::kGemvMaxRows; ++m) {
      for (int v = 0; v < gpu::gemv_variants(m); ++v) {
        for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{2, 8}, {6, 136}, {260, 1000}}) {
          run_silu_shape(m, n, k, ++seed, stream, v);
        }
      }
    }
    for (int64_t m : {1, 8}) {
      for (int v = 0; v < gpu::gemv_variants(m); ++v) run_silu_shape(m, 28672, 4096, ++seed, stream, v);
    }
    // The pushed GEMV: n a multiple of 8 (vector stores into aligned targets), of 4 only,
    // and odd with a partial block; targets aligned and not; staged and not.
    for (int64_t m = 1; m <= gpu::kGemvMaxRows; ++m) {
      for (int v = 0; v < gpu::gemv_variants(m); ++v) {
        for (const auto& [n, k] :
             std::vector<std::pair<int64_t, int64_t>>{{4096, 256}, {4100, 136}, {131, 1000}}) {
          for (bool staged : {true, false}) {
            for (int64_t offset : {0, 1}) run_push_shape(m, n, k, ++seed, stream, v, staged, offset);
          }
        }
      }
    }
  }
  if (const std::string why = skinny_device_refusal(); !why.empty()) {
    std::printf("test_gemv_gpu: the skinny GEMM's cases skipped: %s\n", why.c_str());
  } else {
    // The skinny GEMM: every token-tile count (m up to 16, 32, 64) with partial tiles, n
    // of one MMA tile, of a partial 128-row block and of several blocks, k of one 64-column
    // step up to 1024 (k splits that leave the last blocks no step); then llama3-8b's o,
    // qkv, down and gate/up shapes at batch sizes the engine runs.
    test_skinny_refusals(stream);
    for (int64_t m : {1, 8, 9, 16, 17, 31, 32, 33, 48, 63, 64}) {
      for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{16, 64}, {144, 1024}, {400, 256}}) {
        run_skinny_shape(m, n, k, ++seed, stream);
      }
    }
    for (const auto& [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {64, 4096, 4096}, {40, 6144, 4096}, {64, 4096, 14336}, {12, 4096, 4096}, {16, 28672, 4096}}) {
      run_skinny_shape(m, n, k, ++seed, stream);
    }
  }
  KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
  return gpu_test::tally().report("test_gemv_gpu");
}
