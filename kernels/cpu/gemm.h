// GEMM for the CPU backend through OpenBLAS: y[m, n] = x[m, k] * w[n, k]^T (+ bias),
// the layout of a Linear layer's weight. Weights are held in fp32 (converted once at
// load); activations are bf16 and are widened per call.
#pragma once

#include "kernels/bf16.h"

namespace kvfuse::cpu {

// out (bf16) = round(x * w^T + bias); bias may be null. `scratch` holds m*k + m*n floats.
void linear_bf16(const bf16_t* x, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
                 bf16_t* out, float* scratch);

// out (fp32) = x * w^T; used for logits. `scratch` holds m*k floats.
void linear_f32_out(const bf16_t* x, int64_t m, int64_t k, const float* w, int64_t n, float* out,
                    float* scratch);

}  // namespace kvfuse::cpu
