// The GEMM tiles on AVX-512F: 16 floats a register, 8 rows x 3 panels (24 accumulators
// of 32 registers). Compiled with -mavx512f; called only where the CPU has it.
#include <immintrin.h>

#include "kernels/cpu/gemm/gemm.h"
#include "kernels/cpu/gemm/gemm_tiles.h"

namespace kvfuse::cpu {
namespace {

struct Avx512 {
  using reg = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 8;
  static constexpr int kMaxAcc = 24;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg r) { _mm512_storeu_ps(p, r); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  // 16 bf16 -> fp32: zero-extend to 32 bits, shift into the high half (exact).
  static reg load_w(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    // The maskz forms: GCC 12 warns that the unmasked ones read an undefined register.
    const __m512i w = _mm512_maskz_cvtepu16_epi32(0xffff, h);
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16));
  }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
};

}  // namespace

void gemm_f32_avx512(const float* x, int64_t m, int64_t k, const uint16_t* packed, int64_t panels, float* y,
                     int64_t ldy, float* wbuf) {
  gemm_tiles<Avx512>(x, m, k, packed, panels, y, ldy, wbuf);
}

void gemm_block_f32w_avx512(const float* x, int64_t m, int64_t lda, const float* w, int64_t panel_stride,
                            int64_t panels, int64_t kc, float* y, int64_t ldy, bool first) {
  block_rows<Avx512>(x, m, lda, w, panel_stride, panels, kc, y, ldy, first);
}

}  // namespace kvfuse::cpu
