// Row and elementwise ops of the decoder; see model_ops.cuh for the numerics contract.
// These are small next to the GEMMs and attention: simple grid-stride kernels, one
// block per row where a row reduction is needed.
#include "kernels/gpu.h"

#include "kernels/model_ops.cuh"

namespace kvfuse::gpu {
namespace {

constexpr int kThreads = 256;

KVFUSE_DEVICE float ld(const bf16_t* p, int64_t i) { return bf16_bits_to_f32(p[i]); }

// 1 / sqrt(mean + eps) of a row from each thread's sum of squares `ss`, for every thread
// of the block: warp sums, then thread 0 adds the warps in order. partial: the block's
// kThreads / kWarpSize + 1 floats of shared memory, free again after the caller's next
// __syncthreads.
//
// The order differs from the CPU's sequential sum, and between vendors (warp_reduce's
// tree). All terms are >= 0, so each fp32 sum is within k * u of the exact one, k the
// additions on its longest path: cols for the CPU; cols / kThreads + log2(kWarpSize) +
// kThreads / kWarpSize here (45 for 8192 columns, on either vendor). So the two sums
// differ by at most about (cols + 45) * u relative (5e-4 at 8192, typically far less),
// the inverse root by half that, and out's values before their bf16 rounding by less
// than bf16's relative half-ulp (2^-9, 2e-3): the rounded values are equal or one ulp
// apart, the tolerance tests/gpu checks.
KVFUSE_DEVICE float block_inv_rms(float ss, int64_t cols, float eps, float* partial) {
  ss = warp_reduce_sum(ss);
  const int warps = int(blockDim.x) / kWarpSize;
  if (lane_id() == 0) partial[warp_id()] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int i = 0; i < warps; ++i) total += partial[i];
    partial[warps] = 1.0f / sqrtf(total / float(cols) + eps);
  }
  __syncthreads();
  return partial[warps];
}

// One block per row: fp32 sum of squares, then x * rsqrt(mean + eps) * w.
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    rmsnorm_kernel(const bf16_t* x, const bf16_t* w, int64_t rows, int64_t cols, float eps, bf16_t* out) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  __shared__ float partial[kThreads / kWarpSize + 1];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const bf16_t* xr = x + row * cols;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = ld(xr, c);
      ss += v * v;
    }
    const float inv = block_inv_rms(ss, cols, eps, partial);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      out[row * cols + c] = f32_to_bf16(ld(xr, c) * inv * ld(w, c));
    }
    __syncthreads();  // partial[] is reused by the next row
  }
}

// The residual add fused with the RMSNorm that follows it: x = bf16(x + y), then
// out = rmsnorm(x) * w, one block per row. Rows of up to 8 * kNormVec * kThreads bf16
// (8192) whose pointers are 16-byte aligned go through 16-byte vectors and stay in
// registers between the two passes; others take the scalar loops. out may be y.
constexpr int kNormVec = 4;

KVFUSE_DEVICE bool aligned_16B(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    add_rmsnorm_kernel(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                       bf16_t* out) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  __shared__ float partial[kThreads / kWarpSize + 1];
  const bool vec = cols % 8 == 0 && cols <= int64_t(8) * kNormVec * blockDim.x && aligned_16B(x) &&
                   aligned_16B(y) && aligned_16B(w) && aligned_16B(out);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    bf16_t* xr = x + row * cols;
    const bf16_t* yr = y + row * cols;
    bf16_t* orow = out + row * cols;
    float ss = 0.0f;
    uint4 keep[kNormVec];
    if (vec) {
#pragma unroll
      for (int k = 0; k < kNormVec; ++k) {
        const int64_t c = (int64_t(k) * blockDim.x + threadIdx.x) * 8;
        if (c >= cols) continue;
        const uint4 a = *reinterpret_cast<const uint4*>(xr + c);
        const uint4 b = *reinterpret_cast<const uint4*>(yr + c);
        const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
        uint32_t ws[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const bf16_t lo = f32_to_bf16(bf16_bits_to_f32(bf16_t(wa[i])) + bf16_bits_to_f32(bf16_t(wb[i])));
          const bf16_t hi =
              f32_to_bf16(bf16_bits_to_f32(bf16_t(wa[i] >> 16)) + bf16_bits_to_f32(bf16_t(wb[i] >> 16)));
          const float vl = bf16_bits_to_f32(lo), vh = bf16_bits_to_f32(hi);
          ss += vl * vl;
          ss += vh * vh;
          ws[i] = uint32_t(lo) | (uint32_t(hi) << 16);
        }
        keep[k] = make_uint4(ws[0], ws[1], ws[2], ws[3]);
        store_16B(xr + c, keep[k]);
      }
    } else {
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        xr[c] = f32_to_bf16(ld(xr, c) + ld(yr, c));
        const float v = ld(xr, c);
        ss += v * v;
      }
    }
    const float inv = block_inv_rms(ss, cols, eps, partial);
    if (vec) {
#pragma unroll
      for (int k = 0; k < kNormVec; ++k) {
        const int64_t c = (int64_t(k) * blockDim.x + threadIdx.x) * 8;
        if (c >= cols) continue;
        const uint4 wv = load_ro_16B(w + c);
        const uint32_t wx[4] = {keep[k].x, keep[k].y, keep[k].z, keep[k].w}, ww[4] = {wv.x, wv.y, wv.z, wv.w};
        uint32_t wo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const bf16_t lo = f32_to_bf16(bf16_bits_to_f32(bf16_t(wx[i])) * inv * bf16_bits_to_f32(bf16_t(ww[i])));
          const bf16_t hi =
              f32_to_bf16(bf16_bits_to_f32(bf16_t(wx[i] >> 16)) * inv * bf16_bits_to_f32(bf16_t(ww[i] >> 16)));
          wo[i] = uint32_t(lo) | (uint32_t(hi) << 16);
        }
        store_16B(orow + c, make_uint4(wo[0], wo[1], wo[2], wo[3]));
      }
    } else {
      // Each thread reads back only the elements it wrote above.
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = f32_to_bf16(ld(xr, c) * inv * ld(w, c));
    }
    __syncthreads();  // partial[] is reused by the next row
  }
}

// One thread per rotated pair (i, i + D/2) of one head of one token. The frequency comes
// from the model's table (the reference's values), the angle is the fp32 product.
__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    rope_kernel(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride, int32_t kv_heads,
                int32_t head_dim, const int32_t* positions, int64_t n, const float* __restrict__ inv_freq,
                float attention_scaling) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  const int32_t half = head_dim / 2;
  const int64_t heads = int64_t(q_heads) + kv_heads;
  const int64_t total = n * heads * half;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int32_t i = int32_t(idx % half);
    const int64_t h = (idx / half) % heads;
    const int64_t t = idx / (half * heads);
    bf16_t* row = h < q_heads ? q + t * q_stride + h * head_dim : k + t * k_stride + (h - q_heads) * head_dim;
    const float angle = float(positions[t]) * inv_freq[i];
    const float c = cosf(angle) * attention_scaling, s = sinf(angle) * attention_scaling;
    const float x0 = ld(row, i), x1 = ld(row, i + half);
    row[i] = f32_to_bf16(x0 * c - x1 * s);
    row[i + half] = f32_to_bf16(x1 * c + x0 * s);
  }
}

__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    silu_mul_kernel(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  const int64_t total = n * inter;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / inter, j = idx % inter;
    const float g = ld(gate_up, t * 2 * inter + j);
    const float u = ld(gate_up, t * 2 * inter + inter + j);
    out[idx] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
  }
}

__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    residual_add_kernel(bf16_t* x, const bf16_t* y, int64_t count) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = f32_to_bf16(ld(x, i) + ld(y, i));
  }
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
// whether every value is finite. A thread keeps its own first maximum over a strided
// walk; the merge prefers the larger value, then the lower index.
constexpr int kArgmaxThreads = 1024;
KVFUSE_DEVICE void argmax_merge(float& v, int32_t& i, float ov, int32_t oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}
__global__ void KVFUSE_LAUNCH_BOUNDS(kArgmaxThreads, 1)
    argmax_rows_kernel(const float* logits, int64_t rows, int64_t vocab, int32_t* tokens, int32_t* finite) {
  grid_dependency_wait();  // PDL: the inputs come from the kernel before
  launch_dependents();
  __shared__ float sv[kArgmaxThreads / kWarpSize];
  __shared__ int32_t si[kArgmaxThreads / kWarpSize];
  __shared__ int32_t snan;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* x = logits + row * vocab;
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    int bad = 0;
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
      const float v = x[c];
      if (!isfinite(v)) bad = 1;
      if (v > bv || (v == bv && int32_t(c) < bi)) {
        bv = v;
        bi = int32_t(c);
      }
    }
    if (threadIdx.x == 0) snan = 0;
    __syncthreads();
    if (bad) snan = 1;
    for (int off = kWarpSize / 2; off > 0; off /= 2) {
      argmax_merge(bv, bi, warp_shfl_xor(bv, off), warp_shfl_xor(bi, off));
    }
    if (lane_id() == 0) {
      sv[warp_id()] = bv;
      si[warp_id()] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < int(blockDim.x) / kWarpSize; ++w) argmax_merge(bv, bi, sv[w], si[w]);
      // A row of -inf or NaN only has no maximum: index 0, as the sequential rule gives.
      tokens[row] = bi == INT32_MAX ? 0 : bi;
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
  return launch_kernel(rmsnorm_kernel, row_blocks(rows), kThreads, stream, pdl, x, w, rows, cols, eps, out);
}

cudaError_t launch_add_rmsnorm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                               bf16_t* out, cudaStream_t stream, bool pdl) {
  if (rows <= 0) return cudaSuccess;
  return launch_kernel(add_rmsnorm_kernel, row_blocks(rows), kThreads, stream, pdl, x, y, w, rows, cols, eps,
                       out);
}

cudaError_t launch_rope_neox(bf16_t* q, int64_t q_stride, int32_t q_heads, bf16_t* k, int64_t k_stride,
                             int32_t kv_heads, int32_t head_dim, const int32_t* positions, int64_t n,
                             const float* inv_freq, float attention_scaling, cudaStream_t stream, bool pdl) {
  const int64_t total = n * (int64_t(q_heads) + kv_heads) * (head_dim / 2);
  if (total <= 0) return cudaSuccess;
  return launch_kernel(rope_kernel, elementwise_blocks(total), kThreads, stream, pdl, q, q_stride, q_heads,
                       k, k_stride, kv_heads, head_dim, positions, n, inv_freq, attention_scaling);
}

cudaError_t launch_silu_mul(const bf16_t* gate_up, int64_t n, int64_t inter, bf16_t* out,
                            cudaStream_t stream, bool pdl) {
  if (n * inter <= 0) return cudaSuccess;
  return launch_kernel(silu_mul_kernel, elementwise_blocks(n * inter), kThreads, stream, pdl, gate_up, n,
                       inter, out);
}

cudaError_t launch_residual_add(bf16_t* x, const bf16_t* y, int64_t count, cudaStream_t stream, bool pdl) {
  if (count <= 0) return cudaSuccess;
  return launch_kernel(residual_add_kernel, elementwise_blocks(count), kThreads, stream, pdl, x, y, count);
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
