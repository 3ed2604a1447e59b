// The CPU backend's GEMM: y[m, n] = x[m, k] * w[n, k]^T (+ bias), the layout of a Linear
// layer's weight, with a fixed summation order so that the CPU backend is batch-invariant.
//
// Every output element is one fp32 fused multiply-add chain over k in increasing order,
// starting from +0:  acc = 0; for p in 0..k-1: acc = fma(x[i, p], w[j, p], acc).
// Tiles, vector width (AVX-512, AVX2+FMA, or scalar) and k blocking change only how many
// such chains run side by side, never the order within one, so the bits of a row depend
// on that row and the weights alone: not on m, the row's position in the batch, the tail
// handling or the machine's SIMD width.
//
// Weights stay bf16 (half the bytes a decode step streams) and are packed once at load in
// panels of kGemmPanel output columns, k-major within a panel (zero-padded past n), so a
// tile reads a panel row with one vector load and widens it exactly to fp32. Activations
// are bf16 and are widened per call.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/common/bf16.h"

namespace kvfuse::cpu {

constexpr int64_t kGemmPanel = 16;  // output columns per packed weight panel

enum class GemmIsa { generic, avx2, avx512 };

const char* gemm_isa_name(GemmIsa isa);
bool gemm_isa_supported(GemmIsa isa);
// The widest kernel this CPU runs.
GemmIsa gemm_widest_isa();
// The widest supported kernel, or the one named by KVFUSE_CPU_GEMM (generic, avx2,
// avx512); an unknown or unsupported name there is an error naming the variable.
bool gemm_isa_from_env(GemmIsa& isa, std::string& error);

// Elements of a packed [n, k] weight (bf16, or FP8 bytes: kernels/cpu/gemm/gemm_fp8.h).
size_t gemm_packed_elems(int64_t n, int64_t k);
// Packs a [n, k] row-major weight into panels of kGemmPanel rows, k-major within a panel,
// zero past n.
template <class T>
void gemm_pack_panels(const T* w, int64_t n, int64_t k, T* packed) {
  const int64_t panels = (n + kGemmPanel - 1) / kGemmPanel;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t c = 0; c < kGemmPanel; ++c) {
        const int64_t row = p * kGemmPanel + c;
        packed[(p * k + kk) * kGemmPanel + c] = row < n ? w[row * k + kk] : T(0);
      }
}
// Packs a bf16 [n, k] row-major weight.
inline void gemm_pack_weight(const bf16_t* w, int64_t n, int64_t k, bf16_t* packed) {
  gemm_pack_panels(w, n, k, packed);
}

// y[i * ldy + j] = sum_p x[i * k + p] * w[j, p] for j < round_up(n, kGemmPanel) (columns
// past n are 0), with `packed` from gemm_pack_weight. ldy >= round_up(n, kGemmPanel).
// wbuf (gemm_wbuf_floats(), or null) lets large m widen each weight block once.
void gemm_f32(const float* x, int64_t m, int64_t k, const bf16_t* packed, int64_t n, float* y, int64_t ldy,
              GemmIsa isa, float* wbuf = nullptr);
size_t gemm_wbuf_floats();

// What every GEMM entry checks first: false when there is nothing to multiply (m or n is
// 0; k is 0: y's rows are zeroed, every padded column), true otherwise; aborts, naming
// the kernel, when `isa` does not run on this CPU.
bool gemm_begin(int64_t m, int64_t k, int64_t n, float* y, int64_t ldy, GemmIsa isa);

// Floats of scratch linear_bf16 / linear_f32_out need.
size_t gemm_scratch_floats(int64_t m, int64_t k, int64_t n);

// out (bf16) = round(x * w^T + bias); bias may be null. The bias is added to the finished
// fp32 dot product, then the sum is rounded once.
void linear_bf16(const bf16_t* x, int64_t m, int64_t k, const bf16_t* packed, int64_t n, const float* bias,
                 bf16_t* out, float* scratch, GemmIsa isa);

// out (fp32) = x * w^T; used for logits.
void linear_f32_out(const bf16_t* x, int64_t m, int64_t k, const bf16_t* packed, int64_t n, float* out,
                    float* scratch, GemmIsa isa);

// One k block of the GEMM against weights already widened to fp32, in the packed panel
// layout (panel_stride floats from one panel to the next, kGemmPanel floats per k step):
// for i < m and j < panels * kGemmPanel, the chain y[i * ldy + j] (+0 when `first`, else
// the value already there) continues with fma(x[i * lda + p], w[j, p], .) for p = 0..kc-1
// in order (nothing when kc < 1). Every ISA gives the same bits. The FP8 GEMM
// (gemm_fp8.h) dequantizes its weights block by block and runs them through this.
void gemm_block_f32w(const float* x, int64_t m, int64_t lda, const float* w, int64_t panel_stride,
                     int64_t panels, int64_t kc, float* y, int64_t ldy, bool first, GemmIsa isa);

// The per-ISA drivers (gemm_avx2.cc, gemm_avx512.cc; x86-64 builds only).
void gemm_f32_avx2(const float* x, int64_t m, int64_t k, const bf16_t* packed, int64_t panels, float* y,
                   int64_t ldy, float* wbuf);
void gemm_f32_avx512(const float* x, int64_t m, int64_t k, const bf16_t* packed, int64_t panels, float* y,
                     int64_t ldy, float* wbuf);

void gemm_block_f32w_avx2(const float* x, int64_t m, int64_t lda, const float* w, int64_t panel_stride,
                          int64_t panels, int64_t kc, float* y, int64_t ldy, bool first);
void gemm_block_f32w_avx512(const float* x, int64_t m, int64_t lda, const float* w, int64_t panel_stride,
                            int64_t panels, int64_t kc, float* y, int64_t ldy, bool first);

}  // namespace kvfuse::cpu
