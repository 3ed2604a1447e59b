// Paged attention kernels; see attention.cuh for the contract and the two paths.
//
// Thread mapping: a block of kWarps warps per (query token, KV head) (and partition, in
// the split path). Warps take the visible keys round robin; the lanes of a warp split
// head_dim, kPer = D / kWarpSize elements each, so one key's dot products with the G
// query heads are G warp reductions. Each warp keeps an online softmax state per query
// head (running max m, sum l, output accumulator in registers, kPer per lane); at the
// end the warps' states merge through shared memory. Scores are in the exp2 domain
// (scale folded with log2 e) like the CPU reference's exp, to fp32 accuracy.
#include "kernels/gpu.h"

#include <cfloat>

#include "kernels/attention.cuh"
#include "kernels/fp8.h"

namespace kvfuse::gpu {
namespace {

constexpr int kWarps = 4;
constexpr float kLog2e = 1.4426950408889634f;

// Sequence of a query row: the last s with query_start[s] <= row.
KVFUSE_DEVICE int32_t find_seq(const int32_t* query_start, int32_t num_seqs, int64_t row) {
  int32_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (query_start[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <int D>
KVFUSE_DEVICE void load_row(const PagedKvView& c, const void* base, int64_t slot, int32_t kv_head, float scale,
                            float* out) {
  constexpr int kPer = D / kWarpSize;
  const int64_t off = c.elem_offset(slot, kv_head) + int64_t(lane_id()) * kPer;
  if (c.dtype == KvDtype::bf16) {
    const bf16_t* p = static_cast<const bf16_t*>(base) + off;
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[i] = bf16_bits_to_f32(p[i]);
  } else {
    const uint8_t* p = static_cast<const uint8_t*>(base) + off;
    const Fp8Format f = kv_fp8_format(c.dtype);
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[i] = fp8_decode(p[i], f) * scale;
  }
}

struct RowInfo {
  int32_t seq;
  int32_t pos;  // position of the query row
  int32_t lo;   // first visible key
};

KVFUSE_DEVICE RowInfo row_info(const AttnArgs& a, int64_t row) {
  RowInfo r;
  r.seq = find_seq(a.batch.query_start, a.batch.num_seqs, row);
  const int32_t q_len = a.batch.query_start[r.seq + 1] - a.batch.query_start[r.seq];
  r.pos = a.batch.context_len[r.seq] - q_len + int32_t(row - a.batch.query_start[r.seq]);
  r.lo = a.window > 0 ? max(0, r.pos - a.window + 1) : 0;
  return r;
}

// Scratch layout of the split path, per (row, query head, partition): [D] partial
// output (normalised by its own sum), then max and sum in the log2 domain.
KVFUSE_HD int64_t split_index(int64_t row, int32_t head, int32_t part, int32_t num_heads, int32_t num_parts) {
  return (row * num_heads + head) * num_parts + part;
}

// Grid: (rows, kv heads, partitions). With num_parts == 1 (unified) the block writes the
// final output; otherwise its partition's state.
template <int D>
__global__ void __launch_bounds__(kWarps * kWarpSize)
    attention_kernel(AttnArgs a, int32_t partition_size, int32_t num_parts, float* scratch) {
  constexpr int kPer = D / kWarpSize;
  const int64_t row = blockIdx.x;
  const int32_t kv_head = int32_t(blockIdx.y);
  const int32_t part = int32_t(blockIdx.z);
  const int32_t G = a.num_q_heads / a.cache.num_kv_heads;
  const RowInfo r = row_info(a, row);
  int32_t begin = r.lo, end = r.pos + 1;
  if (num_parts > 1) {
    begin = max(begin, part * partition_size);
    end = min(end, (part + 1) * partition_size);
  }
  const float k_scale = a.cache.dtype == KvDtype::bf16 ? 1.0f : *a.cache.k_scale;
  const float v_scale = a.cache.dtype == KvDtype::bf16 ? 1.0f : *a.cache.v_scale;
  const float qk_scale = a.softmax_scale * kLog2e;

  float q[kAttnMaxGroup][kPer];
  float acc[kAttnMaxGroup][kPer];
  float m[kAttnMaxGroup], l[kAttnMaxGroup];
#pragma unroll
  for (int g = 0; g < kAttnMaxGroup; ++g) {
    m[g] = -FLT_MAX;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      acc[g][i] = 0.0f;
      q[g][i] = 0.0f;
    }
    if (g < G) {
      const bf16_t* qp = a.q + row * a.q_token_stride + int64_t(kv_head * G + g) * D + lane_id() * kPer;
#pragma unroll
      for (int i = 0; i < kPer; ++i) q[g][i] = bf16_bits_to_f32(qp[i]);
    }
  }

  const int32_t* pages = a.batch.block_table + int64_t(r.seq) * a.batch.max_pages_per_seq;
  for (int32_t j = begin + warp_id(); j < end; j += kWarps) {
    const int64_t slot = int64_t(pages[j / a.cache.page_size]) * a.cache.page_size + j % a.cache.page_size;
    float k[kPer], v[kPer];
    load_row<D>(a.cache, a.cache.k, slot, kv_head, k_scale, k);
    load_row<D>(a.cache, a.cache.v, slot, kv_head, v_scale, v);
#pragma unroll
    for (int g = 0; g < kAttnMaxGroup; ++g) {
      if (g >= G) break;
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) s += q[g][i] * k[i];
      s = warp_reduce_sum(s) * qk_scale;
      const float m_new = fmaxf(m[g], s);
      const float corr = exp2f(m[g] - m_new);
      const float p = exp2f(s - m_new);
      l[g] = l[g] * corr + p;
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[g][i] = acc[g][i] * corr + p * v[i];
      m[g] = m_new;
    }
  }

  // Merge the warps' states: each warp publishes (m, l, acc) and warp 0 combines.
  __shared__ float sm_m[kWarps][kAttnMaxGroup], sm_l[kWarps][kAttnMaxGroup];
  __shared__ float sm_acc[kWarps][kAttnMaxGroup][D];
#pragma unroll
  for (int g = 0; g < kAttnMaxGroup; ++g) {
    if (g >= G) break;
    if (lane_id() == 0) {
      sm_m[warp_id()][g] = m[g];
      sm_l[warp_id()][g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) sm_acc[warp_id()][g][lane_id() * kPer + i] = acc[g][i];
  }
  __syncthreads();
  if (warp_id() != 0) return;
  for (int g = 0; g < G; ++g) {
    float mt = -FLT_MAX;
    for (int w = 0; w < kWarps; ++w) mt = fmaxf(mt, sm_m[w][g]);
    float lt = 0.0f;
    float o[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      if (sm_l[w][g] == 0.0f) continue;
      const float c = exp2f(sm_m[w][g] - mt);
      lt += sm_l[w][g] * c;
#pragma unroll
      for (int i = 0; i < kPer; ++i) o[i] += sm_acc[w][g][lane_id() * kPer + i] * c;
    }
    const int32_t head = kv_head * G + g;
    if (num_parts == 1) {
      bf16_t* out = a.out + row * a.out_token_stride + int64_t(head) * D + lane_id() * kPer;
#pragma unroll
      for (int i = 0; i < kPer; ++i) out[i] = f32_to_bf16(o[i] / lt);
    } else {
      float* s = scratch + split_index(row, head, part, a.num_q_heads, num_parts) * (D + 2);
      const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) s[lane_id() * kPer + i] = o[i] * inv;
      if (lane_id() == 0) {
        s[D] = lt > 0.0f ? mt : -FLT_MAX;
        s[D + 1] = lt;
      }
    }
  }
}

// Merges a row's partitions: out = sum_p w_p * o_p / sum_p w_p, w_p = l_p * 2^(m_p - M).
template <int D>
__global__ void attention_merge_kernel(AttnArgs a, int32_t num_parts, const float* scratch) {
  constexpr int kPer = D / kWarpSize;
  const int64_t row = blockIdx.x;
  const int32_t head = int32_t(blockIdx.y) * kWarps + warp_id();
  if (head >= a.num_q_heads) return;
  float mt = -FLT_MAX;
  for (int32_t p = 0; p < num_parts; ++p) {
    mt = fmaxf(mt, scratch[split_index(row, head, p, a.num_q_heads, num_parts) * (D + 2) + D]);
  }
  float o[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) o[i] = 0.0f;
  float wsum = 0.0f;
  for (int32_t p = 0; p < num_parts; ++p) {
    const float* s = scratch + split_index(row, head, p, a.num_q_heads, num_parts) * (D + 2);
    if (s[D + 1] == 0.0f) continue;
    const float w = s[D + 1] * exp2f(s[D] - mt);
    wsum += w;
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] += w * s[lane_id() * kPer + i];
  }
  bf16_t* out = a.out + row * a.out_token_stride + int64_t(head) * D + lane_id() * kPer;
#pragma unroll
  for (int i = 0; i < kPer; ++i) out[i] = f32_to_bf16(o[i] / wsum);
}

template <int D>
cudaError_t launch(const AttnArgs& a, void* scratch, int32_t partition_size, int32_t num_parts,
                   cudaStream_t stream) {
  const dim3 grid(unsigned(a.batch.num_tokens), unsigned(a.cache.num_kv_heads), unsigned(num_parts));
  attention_kernel<D><<<grid, kWarps * kWarpSize, 0, stream>>>(a, partition_size, num_parts,
                                                                 static_cast<float*>(scratch));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || num_parts == 1) return err;
  const dim3 mgrid(unsigned(a.batch.num_tokens), unsigned((a.num_q_heads + kWarps - 1) / kWarps));
  attention_merge_kernel<D><<<mgrid, kWarps * kWarpSize, 0, stream>>>(a, num_parts,
                                                                        static_cast<const float*>(scratch));
  return cudaGetLastError();
}

template <class F>
cudaError_t dispatch_head_dim(int32_t head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    case 256:
      return f(std::integral_constant<int, 256>{});
    default:
      return cudaErrorInvalidValue;
  }
}

int32_t num_partitions(int32_t max_context_len, int32_t partition_size) {
  return max_context_len <= partition_size ? 1 : (max_context_len + partition_size - 1) / partition_size;
}

}  // namespace

std::string attention_unsupported(const AttnArgs& a) {
  const int32_t kvh = a.cache.num_kv_heads;
  const bool dim_ok = a.cache.head_dim == 64 || a.cache.head_dim == 128 || a.cache.head_dim == 256;
  const bool group_ok = kvh > 0 && a.num_q_heads % kvh == 0 && a.num_q_heads / kvh <= kAttnMaxGroup;
  if (dim_ok && group_ok && a.cache.page_size > 0) return {};
  return "attention: unsupported (head_dim " + std::to_string(a.cache.head_dim) + ", q heads " +
         std::to_string(a.num_q_heads) + ", kv heads " + std::to_string(kvh) + ", page size " +
         std::to_string(a.cache.page_size) + "): head_dim must be 64, 128 or 256 and q heads a multiple of kv heads "
         "with at most " + std::to_string(kAttnMaxGroup) + " per kv head";
}

cudaError_t launch_attention_unified(const AttnArgs& a, cudaStream_t stream) {
  if (!attention_unsupported(a).empty()) return cudaErrorInvalidValue;
  if (a.batch.num_tokens <= 0) return cudaSuccess;
  return dispatch_head_dim(a.cache.head_dim, [&](auto d) { return launch<decltype(d)::value>(a, nullptr, 0, 1, stream); });
}

size_t attention_split_scratch_bytes(int64_t num_tokens, int32_t num_q_heads, int32_t head_dim,
                                     int32_t max_context_len, int32_t partition_size) {
  const int32_t parts = num_partitions(max_context_len, partition_size);
  return size_t(num_tokens) * size_t(num_q_heads) * size_t(parts) * size_t(head_dim + 2) * sizeof(float);
}

cudaError_t launch_attention_split(const AttnArgs& a, void* scratch, int32_t partition_size, cudaStream_t stream) {
  if (!attention_unsupported(a).empty() || partition_size <= 0) return cudaErrorInvalidValue;
  if (a.batch.num_tokens <= 0) return cudaSuccess;
  const int32_t parts = num_partitions(a.batch.max_context_len, partition_size);
  if (parts > 1 && scratch == nullptr) return cudaErrorInvalidValue;
  return dispatch_head_dim(a.cache.head_dim,
                           [&](auto d) { return launch<decltype(d)::value>(a, scratch, partition_size, parts, stream); });
}

}  // namespace kvfuse::gpu
