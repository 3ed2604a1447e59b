// Decode-sized matrix products on the GPU (CUDA and HIP from one source): out[m, n] =
// x[m, k] . w[n, k]^T for m <= kGemvMaxRows, bf16 operands, fp32 accumulation, the output
// rounded to bf16 once (or kept in fp32). The GPU backend's GEMM tuner offers it as one
// more candidate beside the BLAS-Lt library's (src/backends/gpu/gemm/gemm_planner.cu), so
// it runs only for the shapes where it measured faster; the CPU reference is the same math
// (kernels/cpu/gemm/gemm.h) in another summation order.
//
// Memory bound at these sizes: each warp streams a few rows of w with 16-byte loads, each
// lane a strided run of 8-element chunks, several in flight, x read through the cache (it
// is small and every warp reads it); the lanes' partial sums meet in a butterfly at the
// end.
#pragma once

// gpu.h first: on HIP the vendor runtime header must precede kernels/common/host_device.h.
#include "kernels/common/gpu.h"

#include <cstdint>
#include <string>

#include "kernels/common/bf16.h"
#include "kernels/parallel/tp_push.h"

namespace kvfuse::gpu {

constexpr int64_t kGemvMaxRows = 8;
// Tilings of the kernel (rows of w per warp, chunks in flight per row, warps per row),
// for the tuner to time: gemv_variants(m) of them are offered for m rows (five where the
// kernel is most latency bound, m <= 2; three above).
constexpr int kGemvVariants = 5;
int gemv_variants(int64_t m);

// Empty if launch_gemv_bf16 supports the call, else why not: 1 <= m <= kGemvMaxRows,
// k a multiple of 8, x, w and out 16-byte aligned.
std::string gemv_unsupported(const void* x, int64_t m, const void* w, int64_t n, int64_t k, const void* out);

// out_f32: out is fp32 [m, n], else bf16 [m, n]. variant: 0 .. gemv_variants(m) - 1.
// stream_w: w is loaded as data read once (no L1 allocation, evicted first from L2; CUDA
// only), leaving L1 to x; false loads it as x is loaded. The same bits either way.
// Asynchronous on `stream`, graph-safe.
LaunchStatus launch_gemv_bf16(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k, void* out,
                              bool out_f32, cudaStream_t stream, bool pdl = false, int variant = 0,
                              bool stream_w = true);

// launch_gemv_bf16 into bf16 out (the same bits), each result also stored at the same
// index of every push.dst (as push_bits, kernels/parallel/tp_push.cuh): a row-parallel projection
// delivering its partial sums into its tensor-parallel peers' inboxes from its epilogue.
// staged: for 2-8 token rows, the block stores its results into the targets a token row at
// a time through shared memory; else each warp stores its own results of a token row, as one
// vector where n is a multiple of 8 and every target 16-byte aligned, else one at a time
// (the same bits every way).
LaunchStatus launch_gemv_push_bf16(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k,
                                   bf16_t* out, const PushTargets& push, cudaStream_t stream,
                                   bool pdl = false, int variant = 0, bool stream_w = true,
                                   bool staged = true);

// act[m, n / 2] = silu_mul(x . w^T) for w = [gate rows; up rows] (n even): the same
// GEMV (variant as above, the same sums) with each warp's rows paired as gate row j and
// up row j, and launch_silu_mul's formula in its epilogue: the bits of launch_gemv_bf16
// into [m, n] followed by launch_silu_mul, in one launch and without the [m, n] rows.
LaunchStatus launch_gemv_silu_mul_bf16(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k,
                                       bf16_t* act, cudaStream_t stream, bool pdl = false, int variant = 0,
                                       bool stream_w = true);

}  // namespace kvfuse::gpu
