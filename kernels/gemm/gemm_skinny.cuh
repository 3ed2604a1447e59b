// Skinny matrix products on Hopper's tensor cores: out[m, n] = x[m, k] . w[n, k]^T for
// 1 <= m <= kSkinnyMaxRows (the decode batches above the GEMV's kGemvMaxRows), bf16
// operands, fp32 accumulation, the output rounded to bf16 once (or kept in fp32). Like
// the GEMV (kernels/gemm/gemv.cuh) it is a candidate the GPU backend's GEMM tuner times beside
// the BLAS-Lt library's, and it runs only for the shapes where it measured faster.
//
// Memory bound at these sizes (w is read once, m x k of x is a few hundred KiB from L2):
// each block takes 128 or 256 rows of w over a slice of k. One producer thread streams 64-column
// boxes of w and of x (m rounded up to 16, 32 or 64 tokens) into shared memory by TMA,
// about 96 KiB of stages in flight, 128-byte swizzled; two warpgroups multiply them with
// wgmma (the w rows as the MMA's M, the tokens as its N), keeping a step of MMAs in flight.
// Where row blocks are too few to keep every SM streaming (n of a few thousand), variant v
// splits k over skinny_splits(v) blocks per row block, launched as one cluster: each
// leaves its fp32 partial sums in its shared memory, and each block adds its share of
// the outputs' parts from all of them (distributed shared memory) in split order, so the
// result does not depend on timing, and writes it. Bits are deterministic for a (shape, variant); they are
// not the GEMV's or the library's (another summation order), and the CPU reference (kernels/cpu/gemm/gemm.h) is
// the same math in yet another order.
//
// NVIDIA sm_90 only (wgmma and TMA; the kernel is built for sm_90a): on other devices and
// on AMD skinny_unsupported refuses every call, and the tuner keeps to the library there.
#pragma once

// gpu.h first: on HIP the vendor runtime header must precede kernels/common/host_device.h.
#include "kernels/common/gpu.h"

#include <cstdint>
#include <string>

#include "kernels/common/bf16.h"

namespace kvfuse::gpu {

constexpr int64_t kSkinnyMaxRows = 64;
constexpr int64_t kSkinnyStepK = 64;  // k is a whole number of these
// Variant v splits k over skinny_splits(v) blocks, 1, 2, 3, 4, 6 or 8 (v % 6), with row
// blocks of skinny_block_rows(v) rows of w: 128 (v < 6, two blocks an SM) or 256 (one
// block an SM, half the reads of x per row of w); from v = 12 on, the tokens are the
// MMA's M (padded to 64) and each warpgroup's 128 rows its N (wgmma m64n128k16, fewer and
// larger MMAs for m near 64). Both 0 for a v out of range.
constexpr int kSkinnyVariants = 18;
int skinny_splits(int variant);
int skinny_block_rows(int variant);

// Empty if launch_gemm_skinny_bf16 supports the call on the current device, else why not:
// an NVIDIA build on an sm_90 device, 1 <= m <= kSkinnyMaxRows, n a positive multiple of
// 16, k a positive multiple of kSkinnyStepK with at least one such step per split, x, w
// and out 16-byte aligned (x and w rows contiguous, k apart).
std::string skinny_unsupported(const void* x, int64_t m, const void* w, int64_t n, int64_t k, const void* out,
                               int variant);

// out_f32: out is fp32 [m, n], else bf16 [m, n]. Asynchronous on `stream`, graph-safe
// (one launch, no scratch). pdl: launched as a programmatic dependent; early_w: its first
// stages of w are then requested before it waits for the kernel before (which may slow
// that kernel: they share the memory's bandwidth).
LaunchStatus launch_gemm_skinny_bf16(const bf16_t* x, int64_t m, const bf16_t* w, int64_t n, int64_t k,
                                     void* out, bool out_f32, cudaStream_t stream, bool pdl = false,
                                     int variant = 0, bool early_w = true);

}  // namespace kvfuse::gpu
