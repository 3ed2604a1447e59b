// Linear layers on the CPU through OpenBLAS. The weight is [n, k] row-major (a Linear
// layer's out_features x in_features), so y = x * w^T is one sgemm with w transposed.
// Summation order is OpenBLAS's: results match a naive fp32 loop to fp32 rounding, not
// bit for bit.
#include "kernels/cpu/gemm.h"

#include <cblas.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kvfuse::cpu {
namespace {

blasint blas_dim(int64_t v, const char* name) {
  if (v < 0 || v > INT_MAX) {
    fprintf(stderr, "kvfuse cpu gemm: %s = %lld does not fit a BLAS dimension\n", name,
            static_cast<long long>(v));
    abort();
  }
  return blasint(v);
}

// y[m, n] = widen(x)[m, k] * w[n, k]^T, using xs (m*k floats) for the widened x.
void sgemm_xwt(const bf16_t* x, int64_t m, int64_t k, const float* w, int64_t n, float* y, float* xs) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    memset(y, 0, size_t(m * n) * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < m * k; ++i) xs[i] = bf16_to_f32(x[i]);
  const blasint bm = blas_dim(m, "m"), bn = blas_dim(n, "n"), bk = blas_dim(k, "k");
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bm, bn, bk, 1.0f, xs, bk, w, bk, 0.0f, y, bn);
}

}  // namespace

void linear_bf16(const bf16_t* x, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
                 bf16_t* out, float* scratch) {
  float* y = scratch + m * k;
  sgemm_xwt(x, m, k, w, n, y, scratch);
  // The bias is added to the finished fp32 dot product, then the sum is rounded once.
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float v = y[i * n + j];
      out[i * n + j] = f32_to_bf16(bias != nullptr ? v + bias[j] : v);
    }
}

void linear_f32_out(const bf16_t* x, int64_t m, int64_t k, const float* w, int64_t n, float* out,
                    float* scratch) {
  sgemm_xwt(x, m, k, w, n, out, scratch);
}

}  // namespace kvfuse::cpu
