// The decode GEMM (kernels/gemv.cuh) against an exact reference: out = x . w^T for m = 1..8
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
// The fused silu_mul variant (launch_gemv_silu_mul_bf16) is checked bit for bit against
// the same variant's bf16 GEMV followed by launch_silu_mul: the sums are the same, so
// must the bits be.
#include "kernels/gpu.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kernels/gemv.cuh"
#include "kernels/model_ops.cuh"
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

void run_shape(int64_t m, int64_t n, int64_t k, uint64_t seed, cudaStream_t stream, int variant = 0) {
  const auto [x, w] = random_operands(m, n, k, seed);
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
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const std::vector<float> of = df.download<float>(size_t(m * n));
  const std::vector<bf16_t> ob = db.download<bf16_t>(size_t(m * n));
  const double u = std::ldexp(1.0, -24), gamma = double(k) * u / (1.0 - double(k) * u);
  int64_t bad_f = 0, bad_b = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double exact = 0.0, mag = 0.0;
      for (int64_t c = 0; c < k; ++c) {
        const double p =
            double(bf16_to_f32(x[size_t(i * k + c)])) * double(bf16_to_f32(w[size_t(j * k + c)]));
        exact += p;
        mag += std::fabs(p);
      }
      const double tol = gamma * mag;
      const double ef = std::fabs(double(of[size_t(i * n + j)]) - exact);
      const double eb = std::fabs(double(bf16_to_f32(ob[size_t(i * n + j)])) - exact);
      bad_f += !(ef <= tol);
      bad_b += !(eb <= tol + bf16_ulp(exact));
      if (tol > 0) worst = std::max(worst, ef / tol);
    }
  }
  check(bad_f == 0 && bad_b == 0, what + ": " + std::to_string(bad_f) + " fp32 and " + std::to_string(bad_b) +
                                      " bf16 outputs outside the bound (worst fp32 " + std::to_string(worst) +
                                      " of it)");
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

int main() {
  if (!gpu_test::gpu_available("test_gemv_gpu")) return 0;
  cudaStream_t stream;
  KVFUSE_TEST_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  test_refusals(stream);
  uint64_t seed = 1;
  for (int64_t m = 1; m <= gpu::kGemvMaxRows; ++m) {
    for (int v = 0; v < gpu::gemv_variants(m); ++v) {
      for (const auto& [n, k] :
           std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {3, 136}, {130, 1000}, {4096, 4096}, {7, 4104}}) {
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
  KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
  return gpu_test::tally().report("test_gemv_gpu");
}
