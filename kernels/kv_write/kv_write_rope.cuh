// The KV write with RoPE on the way, on the GPU (CUDA and HIP from one source): the kernel
// of KvWritePath::fused_rope (kernels/common/kv_types.h, KvWriteRopeArgs). One launch per layer
// does what launch_rope_neox (kernels/ops/model_ops.cuh) and launch_kv_write_fused
// (kernels/kv_write/kv_write.cuh) do in two: q is rotated in place, K is rotated and written into
// the paged cache with the layer's scale, V is written; the write costs no launch of its
// own. The CPU twin is kvfuse::cpu::kv_write_rope.
//
// Numerics: the rotation is rope_kernel's (the angle float(pos) * inv_freq[i], the
// device's cosf/sinf times attention_scaling, x0 * c - x1 * s and x1 * c + x0 * s in fp32
// with every operation rounded on its own, as the CPU's, one bf16 rounding; the attention
// kernel that takes this write in, kernels/attention/attention.cuh, shares the code:
// kernels/ops/rope_rows.cuh), so q lands within rope's tolerance of the CPU reference (the
// device's sin and cos are not the libm's). The rotated K, rounded to bf16, then goes
// through the fused write's conversion: for any K the kernel rotated, the cache bytes are
// exactly cpu::kv_write_fused's for those rows (k_rotated shows the rows; V is bit-exact
// against the CPU as it stands).
//
// The launcher is asynchronous on `stream` and safe to capture in a CUDA/HIP graph (scales
// and positions are read through device pointers, the grid is sized from the slot
// mapping's length, padding slots are skipped in the kernel). It refuses arguments the
// kernel does not support with cudaErrorInvalidValue and kv_write_rope_unsupported's
// message.
#pragma once

#include <string>

#include "kernels/common/gpu.h"
#include "kernels/common/kv_types.h"
#include "kernels/kv_write/kv_write.cuh"

namespace kvfuse::gpu {

// Empty if the kernel supports `args`, else a message naming the whole tuple (head_dim,
// query and KV heads, page size, cache dtype, source dtype) and what is wrong. Beyond the
// fused write's conditions (kv_write_unsupported): bf16 sources, and q, k, v (and
// k_rotated) 16-byte aligned with token strides a multiple of 8 elements, as the rows of
// a QKV projection are.
std::string kv_write_rope_unsupported(const KvWriteRopeArgs& args);

// launch.pdl applies as to the other write kernels (the kernel waits for its predecessor
// before its first memory access); block_threads and block_team_max_tokens do not: the
// kernel runs a block per token, sized from the token's rows.
LaunchStatus launch_kv_write_rope(const KvWriteRopeArgs& args, cudaStream_t stream,
                                  const KvWriteLaunch& launch = {});

// Threads per block the launcher uses for `args` (benchmarks print it).
int kv_write_rope_block_threads(const KvWriteRopeArgs& args);

}  // namespace kvfuse::gpu
