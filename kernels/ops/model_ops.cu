// Row and elementwise ops of the decoder; see model_ops.cuh for the numerics contract.
// These are small next to the GEMMs and attention: simple grid-stride kernels, one
// block per row where a row reduction is needed.
#include "kernels/common/gpu.h"

#include "kernels/ops/model_ops.cuh"

#include "kernels/common/bf16x8.cuh"
#include "kernels/ops/rmsnorm_row.cuh"
#include "kernels/ops/rope_rows.cuh"

namespace kvfuse::gpu {
namespace {

constexpr int kThreads = 256;

KVFUSE_DEVICE float ld(const bf16_t* p, int64_t i) { return bf16_bits_to_f32(p[i]); }

// A 16-byte load from memory this kernel also writes (load_ro_16B is for inputs only).
KVFUSE_DEVICE uint4 load_16B(const void* p) { return *static_cast<const uint4*>(p); }

// The RMSNorm, one block per row: fp32 sum of squares, then out = x * rsqrt(mean + eps)
// * w. kAdd: the residual add fused before it, x = bf16(x + y) written back, and the
// norm of that (y unused otherwise, x only read). Rows of up to kNormVecMaxCols bf16
// whose pointers are 16-byte aligned go through 16-byte vectors (rmsnorm_row_vec,
// kernels/ops/rmsnorm_row.cuh) and stay in registers between the two passes; others take the
// scalar loops. out may be x or y. w is the model's norm weight, never written by the
// kernel before: on the vector path each thread loads its chunks of it before the
// programmatic-launch wait, so that round trip overlaps the kernel before's tail instead
// of following the sum of squares.
KVFUSE_DEVICE bool aligned_16B(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <bool kAdd>
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    rmsnorm_kernel(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                   bf16_t* out) {
  static_assert(kThreads == kNormThreads, "the norm's block");
  __shared__ float partial[kThreads / kWarpSize + 1];
  const bool vec = cols % 8 == 0 && cols <= int64_t(8) * kNormVec * blockDim.x && aligned_16B(x) &&
                   (!kAdd || aligned_16B(y)) && aligned_16B(w) && aligned_16B(out);
  uint4 wvec[kNormVec];  // the vector path's chunks of w, the same for every row
  if (vec) load_norm_weight(w, cols, wvec);
  grid_dependency_wait();  // PDL: x and y come from the kernel before
  launch_dependents();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    bf16_t* xr = x + row * cols;
    const bf16_t* yr = kAdd ? y + row * cols : nullptr;
    bf16_t* orow = out + row * cols;
    if (vec) {
      rmsnorm_row_vec<kAdd>(
          xr, [&](int, int64_t c) { return *reinterpret_cast<const uint4*>(yr + c); }, wvec, cols, eps, orow,
          partial);
    } else {
      float ss = 0.0f;
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        if (kAdd) xr[c] = f32_to_bf16(ld(xr, c) + ld(yr, c));
        const float v = ld(xr, c);
        ss += v * v;
      }
      const float inv = block_inv_rms(ss, cols, eps, partial);
      // Each thread reads back only the elements it wrote above.
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = f32_to_bf16(ld(xr, c) * inv * ld(w, c));
    }
    __syncthreads();  // partial[] is reused by the next row
  }
}

// One thread per rotated pair (i, i + D/2) of one head of one token. The frequency comes
// from the model's table (the reference's values), the angle is the fp32 product.
//
// kVec: one thread per 8 consecutive pairs of one head, x_i and x_{i + D/2} each one
// 16-byte load and store (head_dim % 16 == 0, q, k, inv_freq 16-byte aligned, strides
// whole vectors), with the same arithmetic per pair. A thread then computes 8 angles'
// sin and cos where the scalar kernel computes one: 8 times fewer threads for the same
// work, which at decode sizes (a few thousand pairs) can leave the device emptier; see
// kRopeVec for where it is used.
template <bool kVec>
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    rope_kernel(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride, int32_t kv_heads,
                int32_t head_dim, const int32_t* positions, int64_t n, const float* __restrict__ inv_freq,
                float attention_scaling) {
  const int32_t half = head_dim / 2;
  constexpr int32_t kPairs = kVec ? 8 : 1;  // pairs per thread
  const int32_t groups = half / kPairs;
  const int64_t heads = int64_t(q_heads) + kv_heads;
  const int64_t total = n * heads * groups;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // The scalar kernel's first pair (a decode step's only one): its angle needs only the
  // positions (batch metadata: copied in before the step's first kernel, written by no
  // kernel) and the model's table, so cos and sin are done before the programmatic-launch
  // wait, overlapping the kernel before; q and k come from it and wait.
  // The scalar kernel's cos and sin of pair i of token t (the first pair's and the
  // loop's: one expression, the KV write with RoPE's too, so all give the same bits).
  const auto rotation = [&](int64_t t, int32_t i, float& c, float& s) {
    rope_rows::cos_sin(positions[t], inv_freq[i], attention_scaling, c, s);
  };
  float c_first = 0.0f, s_first = 0.0f;
  if (!kVec && first < total) rotation(first / (groups * heads), int32_t(first % groups), c_first, s_first);
  grid_dependency_wait();  // PDL: q and k come from the kernel before
  launch_dependents();
  for (int64_t idx = first; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int32_t i = int32_t(idx % groups) * kPairs;
    const int64_t h = (idx / groups) % heads;
    const int64_t t = idx / (groups * heads);
    bf16_t* row = h < q_heads ? q + t * q_stride + h * head_dim : k + t * k_stride + (h - q_heads) * head_dim;
    if constexpr (kVec) {
      float freq[8], x0[8], x1[8], y0[8], y1[8];
      load_f32x4s(inv_freq + i, freq);
      widen_bf16x8(load_16B(row + i), x0);
      widen_bf16x8(load_16B(row + i + half), x1);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float c, s;
        rope_rows::cos_sin(positions[t], freq[j], attention_scaling, c, s);
        y0[j] = x0[j] * c - x1[j] * s;
        y1[j] = x1[j] * c + x0[j] * s;
      }
      store_16B(row + i, pack_bf16x8(y0));
      store_16B(row + i + half, pack_bf16x8(y1));
    } else {
      float c = c_first, s = s_first;
      if (idx != first) rotation(t, i, c, s);
      const float x0 = ld(row, i), x1 = ld(row, i + half);
      row[i] = f32_to_bf16(x0 * c - x1 * s);
      row[i + half] = f32_to_bf16(x1 * c + x0 * s);
    }
  }
}

// The 16-byte RoPE kernel on CDNA only. There a bf16 load is a 64-lane instruction that
// moves 128 bytes, and the kernel's memory instructions are 8 times as many as the
// vector kernel's; on NVIDIA the scalar kernel, tuned there, stays: its threads' work is
// the sin and cos, which the vector kernel only regroups.
constexpr bool kRopeVec = kWarpSize == 64;

// out = silu(gate) * up. kVec (inter % 8 == 0, gate_up and out 16-byte aligned): a thread
// takes 8 consecutive columns, one 16-byte load of gate, one of up, one store; the same
// arithmetic per element, so the same bits.
template <bool kVec>
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    silu_mul_kernel(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  if constexpr (kVec) {
    const int64_t per_row = inter / 8;
    grid_stride_loop(n * per_row, [&](int64_t v) {
      const int64_t t = v / per_row, j = v % per_row * 8;
      const bf16_t* g = gate_up + t * 2 * inter + j;
      float gf[8], uf[8];
      widen_bf16x8(load_ro_16B(g), gf);
      widen_bf16x8(load_ro_16B(g + inter), uf);
#pragma unroll
      for (int e = 0; e < 8; ++e) gf[e] = silu_mul_f32(gf[e], uf[e]);
      store_16B(out + t * inter + j, pack_bf16x8(gf));
    });
  } else {
    grid_stride_loop(n * inter, [&](int64_t idx) {
      const int64_t t = idx / inter, j = idx % inter;
      out[idx] =
          f32_to_bf16(silu_mul_f32(ld(gate_up, t * 2 * inter + j), ld(gate_up, t * 2 * inter + inter + j)));
    });
  }
}

// x = bf16(x + y). kVec (x and y 16-byte aligned): a thread adds 8 elements with one
// 16-byte load of each and one store, and the count % 8 elements past the last whole
// vector go one per thread; the same bits as the scalar loop.
template <bool kVec>
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    residual_add_kernel(bf16_t* x, const bf16_t* y, int64_t count) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  const int64_t vecs = kVec ? count / 8 : 0;
  grid_stride_loop(vecs, [&](int64_t v) {
    float a[8], b[8];
    widen_bf16x8(load_16B(x + 8 * v), a);
    widen_bf16x8(load_16B(y + 8 * v), b);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] += b[e];
    store_16B(x + 8 * v, pack_bf16x8(a));
  });
  grid_stride_loop(count - 8 * vecs, [&](int64_t i) {
    i += 8 * vecs;
    x[i] = f32_to_bf16(ld(x, i) + ld(y, i));
  });
}

// out[r, :] = x[rows[r], :], one block per row. Also the embedding lookup (x the table,
// rows the token ids).
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    gather_rows_kernel(const bf16_t* x, int64_t cols, const int32_t* rows, int64_t n, bf16_t* out) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const bf16_t* src = x + int64_t(rows[r]) * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[r * cols + c] = src[c];
  }
}

__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    bias_round_kernel(const float* y, const float* bias, int64_t m, int64_t n, bf16_t* out) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  const int64_t total = m * n;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = f32_to_bf16(y[i] + bias[i % n]);
  }
}

__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    bf16_to_f32_kernel(const bf16_t* x, int64_t count, float* out) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = ld(x, i);
  }
}

// One block per row: the first index of the row's maximum (kvfuse::argmax's rule), and
// whether every value is finite. A thread keeps its own first maximum over its elements
// (block_for_each_f32: 16-byte loads); the merge prefers the larger value, then the
// lower index. That is a total order on (value, index) for the values it can hold (NaN
// never replaces a maximum, so a thread's value is never NaN), so every grouping and
// every order of merges, the warp's tree included, gives the same index.
constexpr int kArgmaxThreads = 1024;
// Vectors in flight per thread: greedy decoding reads each row once, one block per row,
// so at small batches the pass waits on memory rather than on its few compares.
constexpr int kArgmaxUnroll = 4;
struct ArgMax {
  float v;
  int32_t i;
};
KVFUSE_DEVICE ArgMax argmax_merge(ArgMax a, ArgMax b) {
  return b.v > a.v || (b.v == a.v && b.i < a.i) ? b : a;
}

__global__ void KVFUSE_LAUNCH_BOUNDS(kArgmaxThreads, 1)
    argmax_rows_kernel(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens, int32_t* finite) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  __shared__ ArgMax sm[kArgmaxThreads / kWarpSize];
  __shared__ int32_t snan;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    ArgMax best{-INFINITY, INT32_MAX};
    int bad = 0;
    block_for_each_f32<kArgmaxThreads, kArgmaxUnroll>(logits + row * vocab, vocab, [&](int64_t c, float v) {
      if (!isfinite(v)) bad = 1;
      best = argmax_merge(best, ArgMax{v, int32_t(c)});
    });
    if (threadIdx.x == 0) snan = 0;
    __syncthreads();
    if (bad) snan = 1;
    best = warp_reduce(best, [](ArgMax a, ArgMax b) { return argmax_merge(a, b); });
    if (lane_id() == 0) sm[warp_id()] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < int(blockDim.x) / kWarpSize; ++w) best = argmax_merge(best, sm[w]);
      // A row of -inf or NaN only has no maximum: index 0, as the sequential rule gives.
      tokens[row] = best.i == INT32_MAX ? 0 : best.i;
      finite[row] = snan ? 0 : 1;
    }
    __syncthreads();  // shared state is reused by the next row
  }
}

// Elementwise grids: enough blocks to fill the device, the kernels loop for the rest.
unsigned elementwise_blocks(int64_t count) {
  const unsigned b = grid_blocks(count, kThreads);
  return b < 65535u ? (b == 0 ? 1u : b) : 65535u;
}
unsigned row_blocks(int64_t rows) { return rows < 65535 ? unsigned(rows < 1 ? 1 : rows) : 65535u; }

}  // namespace

cudaError_t launch_embedding(const int32_t* ids, int64_t n, const bf16_t* table, int64_t hidden, bf16_t* out,
                             cudaStream_t stream, bool pdl) {
  if (n <= 0) return cudaSuccess;
  return launch_kernel(gather_rows_kernel, row_blocks(n), kThreads, stream, pdl, table, hidden, ids, n, out);
}

cudaError_t launch_rmsnorm(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                           bf16_t* out, cudaStream_t stream, bool pdl) {
  if (rows <= 0) return cudaSuccess;
  // x is only read (kAdd false).
  return launch_kernel(rmsnorm_kernel<false>, row_blocks(rows), kThreads, stream, pdl, const_cast<bf16_t*>(x),
                       static_cast<const bf16_t*>(nullptr), w, rows, cols, eps, out);
}

cudaError_t launch_add_rmsnorm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                               bf16_t* out, cudaStream_t stream, bool pdl) {
  if (rows <= 0) return cudaSuccess;
  return launch_kernel(rmsnorm_kernel<true>, row_blocks(rows), kThreads, stream, pdl, x, y, w, rows, cols, eps,
                       out);
}

cudaError_t launch_rope_neox(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride,
                             int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n,
                             const float* inv_freq, float attention_scaling, cudaStream_t stream, bool pdl) {
  const int64_t total = n * (int64_t(q_heads) + kv_heads) * (head_dim / 2);
  if (total <= 0) return cudaSuccess;
  if (kRopeVec && head_dim % 16 == 0 && is_aligned(q, 16) && is_aligned(k, 16) && is_aligned(inv_freq, 16) &&
      q_stride % 8 == 0 && k_stride % 8 == 0) {
    return launch_kernel(rope_kernel<kRopeVec>, elementwise_blocks(total / 8), kThreads, stream, pdl, q,
                         q_stride, q_heads, k, k_stride, kv_heads, head_dim, positions, n, inv_freq,
                         attention_scaling);
  }
  return launch_kernel(rope_kernel<false>, elementwise_blocks(total), kThreads, stream, pdl, q, q_stride,
                       q_heads, k, k_stride, kv_heads, head_dim, positions, n, inv_freq, attention_scaling);
}

cudaError_t launch_silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out,
                            cudaStream_t stream, bool pdl) {
  if (n * inter <= 0) return cudaSuccess;
  if (inter % 8 == 0 && is_aligned(gate_up, 16) && is_aligned(out, 16)) {
    return launch_kernel(silu_mul_kernel<true>, elementwise_blocks(n * inter / 8), kThreads, stream, pdl,
                         gate_up, n, inter, out);
  }
  return launch_kernel(silu_mul_kernel<false>, elementwise_blocks(n * inter), kThreads, stream, pdl, gate_up,
                       n, inter, out);
}

cudaError_t launch_residual_add(bf16_t* x, const bf16_t* y, int64_t count, cudaStream_t stream, bool pdl) {
  if (count <= 0) return cudaSuccess;
  if (is_aligned(x, 16) && is_aligned(y, 16)) {
    // count / 8 vectors, and the tail's (at most 7) elements on the first threads.
    return launch_kernel(residual_add_kernel<true>, elementwise_blocks((count + 7) / 8), kThreads, stream,
                         pdl, x, y, count);
  }
  return launch_kernel(residual_add_kernel<false>, elementwise_blocks(count), kThreads, stream, pdl, x, y,
                       count);
}

cudaError_t launch_gather_rows(const bf16_t* x, int64_t cols, const int32_t* rows, int64_t n, bf16_t* out,
                               cudaStream_t stream, bool pdl) {
  if (n <= 0) return cudaSuccess;
  return launch_kernel(gather_rows_kernel, row_blocks(n), kThreads, stream, pdl, x, cols, rows, n, out);
}

cudaError_t launch_bias_round(const float* y, const float* bias, int64_t m, int64_t n, bf16_t* out,
                              cudaStream_t stream, bool pdl) {
  if (m * n <= 0) return cudaSuccess;
  return launch_kernel(bias_round_kernel, elementwise_blocks(m * n), kThreads, stream, pdl, y, bias, m, n,
                       out);
}

cudaError_t launch_argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens,
                               int32_t* finite, cudaStream_t stream, bool pdl) {
  if (rows <= 0 || vocab <= 0) return cudaSuccess;
  if (vocab > INT32_MAX) return cudaErrorInvalidValue;
  return launch_kernel(argmax_rows_kernel, row_blocks(rows), kArgmaxThreads, stream, pdl, logits, rows, vocab,
                       tokens, finite);
}

cudaError_t launch_bf16_to_f32(const bf16_t* x, int64_t count, float* out, cudaStream_t stream, bool pdl) {
  if (count <= 0) return cudaSuccess;
  return launch_kernel(bf16_to_f32_kernel, elementwise_blocks(count), kThreads, stream, pdl, x, count, out);
}

}  // namespace kvfuse::gpu
