// The model's row and elementwise ops on the GPU (CUDA and HIP from one source), with
// the CPU reference's contracts (kernels/cpu/ops/ops.h): bf16 in memory, fp32 arithmetic,
// one bf16 rounding per result. Results differ from the CPU only by summation order
// (rmsnorm's reduction) and by the device's sin/cos/exp (rope, silu): within one bf16
// ulp of the reference, which tests/gpu checks.
//
// `pdl`: launch as a programmatic dependent of the kernel before (CUDA sm_90+; ignored
// on HIP). Every kernel here waits for its predecessor's completion before it touches
// memory, so any predecessor is safe; the gain is the launch overlapping its tail. The
// exceptions, read before the wait: the norms' weight w, and rope's positions and
// frequency table (its first pair's cos and sin are done before the wait). They must not
// come from the kernel just before: the model's weights and the step's batch metadata
// (copied in before the step's first kernel) never do.
#pragma once

#include "kernels/common/bf16.h"
#include "kernels/common/gpu.h"

namespace kvfuse::gpu {

// silu(g) * u in fp32, as launch_silu_mul computes each element (and the GEMV's fused
// silu_mul epilogue, kernels/gemm/gemv.cuh).
KVFUSE_DEVICE float silu_mul_f32(float g, float u) { return g / (1.0f + expf(-g)) * u; }

cudaError_t launch_embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden, bf16_t* out,
                             cudaStream_t stream, bool pdl = false);
// out = rmsnorm(x) * w, one block per row (16-byte vectors where the row allows). out may
// alias x.
cudaError_t launch_rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                           bf16_t* out, cudaStream_t stream, bool pdl = false);
// x = bf16(x + y) (the residual add), then out = rmsnorm(x) * w: launch_residual_add and
// launch_rmsnorm in one kernel (the same kernel, the add compiled in), with x's bytes
// exactly theirs. out may alias y.
cudaError_t launch_add_rmsnorm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                               bf16_t* out, cudaStream_t stream, bool pdl = false);
cudaError_t launch_rope_neox(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride,
                             int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n,
                             const float* inv_freq, float attention_scaling, cudaStream_t stream, bool pdl = false);
cudaError_t launch_silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out,
                            cudaStream_t stream, bool pdl = false);
cudaError_t launch_residual_add(bf16_t* x, const bf16_t* y, int64_t count, cudaStream_t stream, bool pdl = false);
// out[i, :] = x[rows[i], :]
cudaError_t launch_gather_rows(const bf16_t* x, int64_t cols, const int32_t* rows, int64_t n, bf16_t* out,
                               cudaStream_t stream, bool pdl = false);
// out[m, n] = bf16(y[m, n] + bias[n]) from an fp32 GEMM result: one rounding, as the
// CPU reference's linear does (sgemm, add the bias, round).
cudaError_t launch_bias_round(const float* y, const float* bias, int64_t m, int64_t n, bf16_t* out,
                              cudaStream_t stream, bool pdl = false);
// Per row of fp32 logits [rows, vocab]: tokens[row] = the first index of the maximum
// (greedy sampling, kvfuse::argmax's rule), finite[row] = 1 if every value is finite.
cudaError_t launch_argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                               int32_t* finite, cudaStream_t stream, bool pdl = false);
// bf16 <-> fp32 conversions.
cudaError_t launch_bf16_to_f32(const bf16_t* x, int64_t count, float* out, cudaStream_t stream, bool pdl = false);

}  // namespace kvfuse::gpu
