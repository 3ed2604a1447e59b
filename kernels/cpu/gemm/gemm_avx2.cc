// The GEMM tiles on AVX2 + FMA: 8 floats a register, 6 rows x 1 panel (12 accumulators
// of 16 registers). Compiled with -mavx2 -mfma; called only where the CPU has both.
#include <immintrin.h>

#include "kernels/cpu/gemm/gemm.h"
#include "kernels/cpu/gemm/gemm_tiles.h"

namespace kvfuse::cpu {
namespace {

struct Avx2 {
  using reg = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxRows = 6;
  static constexpr int kMaxAcc = 12;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg r) { _mm256_storeu_ps(p, r); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  // 8 bf16 -> fp32: zero-extend to 32 bits, shift into the high half (exact).
  static reg load_w(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
};

}  // namespace

void gemm_f32_avx2(const float* x, int64_t m, int64_t k, const uint16_t* packed, int64_t panels, float* y,
                   int64_t ldy, float* wbuf) {
  gemm_tiles<Avx2>(x, m, k, packed, panels, y, ldy, wbuf);
}

void gemm_block_f32w_avx2(const float* x, int64_t m, int64_t lda, const float* w, int64_t panel_stride,
                          int64_t panels, int64_t kc, float* y, int64_t ldy, bool first) {
  block_rows<Avx2>(x, m, lda, w, panel_stride, panels, kc, y, ldy, first);
}

}  // namespace kvfuse::cpu
