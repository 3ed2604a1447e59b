// The RMSNorm that also quantizes its output as an FP8 W8A8 projection's activations (the
// projection after it: qkv after the attention norm, gate_up after the MLP's), so that the
// quantization costs no launch and the projection reads codes (1 byte an activation).
#pragma once

// gpu.h first: on HIP the vendor runtime header must precede kernels/common/host_device.h.
#include "kernels/common/gpu.h"

#include <cstdint>
#include <string>

#include "kernels/common/bf16.h"
#include "kernels/common/fp8.h"

namespace kvfuse::gpu {

// Empty if launch_rmsnorm_fp8 supports the call, else why not: rows >= 1, cols a positive
// multiple of 8 up to 8192 (the norm's vector path), x, y (when given), w and out 16-byte
// aligned, xq 8-byte aligned, x_scale given, act static_tensor (with static_scale) or
// dynamic_token, fmt e4m3fn or e4m3fnuz.
std::string rmsnorm_fp8_unsupported(const bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols,
                                    const bf16_t* out, Fp8Act act, const float* static_scale, Fp8Format fmt,
                                    const uint8_t* xq, const float* x_scale);

// launch_add_rmsnorm (y given) or launch_rmsnorm (y null), x and out the same bits, and in the
// same kernel xq [rows, cols] and x_scale [rows]: launch_quantize_rows_fp8's bytes and scales
// of out (kernels/gemm/gemv_fp8.cuh), bit for bit: the row's amax taken from the bf16 values
// the block holds in registers (dynamic_token) or *static_scale (static_tensor), then the
// same encoder (kernels/common/fp8_act.cuh). out may be x or y. One block per row.
// Asynchronous on `stream`, graph-safe.
LaunchStatus launch_rmsnorm_fp8(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                                bf16_t* out, Fp8Act act, const float* static_scale, Fp8Format fmt, uint8_t* xq,
                                float* x_scale, cudaStream_t stream, bool pdl = false);

}  // namespace kvfuse::gpu
