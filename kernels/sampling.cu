// Sampling kernel; kernels/sampling.h has the rule, kernels/cpu/sampling.cc the same
// steps sequentially. Every sum is an integer sum (counts, 40-bit fixed-point weights),
// so the block's parallel order gives the CPU's result exactly.
#include "kernels/gpu.h"

#include "kernels/sampling.cuh"

namespace kvfuse::gpu {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / kWarpSize;

struct Shared {
  unsigned long long hist[256];
  unsigned long long warp_u64[kWarps];
  float warp_f32[kWarps];
  unsigned long long bcast_u64[2];
  uint32_t bcast_u32;
  int bcast_i32;
};

KVFUSE_DEVICE unsigned long long block_sum(unsigned long long x, Shared& sh) {
  x = warp_reduce_sum(x);
  if (lane_id() == 0) sh.warp_u64[warp_id()] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long t = 0;
    for (int w = 0; w < kWarps; ++w) t += sh.warp_u64[w];
    sh.bcast_u64[0] = t;
  }
  __syncthreads();
  const unsigned long long r = sh.bcast_u64[0];
  __syncthreads();
  return r;
}

// Inclusive scan over the block (thread order = index order within a chunk).
KVFUSE_DEVICE unsigned long long block_scan(unsigned long long x, Shared& sh, unsigned long long& total) {
  const int lane = lane_id();
#pragma unroll
  for (int off = 1; off < kWarpSize; off *= 2) {
    const unsigned long long y = warp_broadcast(x, lane >= off ? lane - off : lane);
    if (lane >= off) x += y;
  }
  if (lane == kWarpSize - 1) sh.warp_u64[warp_id()] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long run = 0;
    for (int w = 0; w < kWarps; ++w) {
      const unsigned long long v = sh.warp_u64[w];
      sh.warp_u64[w] = run;
      run += v;
    }
    sh.bcast_u64[1] = run;
  }
  __syncthreads();
  x += sh.warp_u64[warp_id()];
  total = sh.bcast_u64[1];
  __syncthreads();
  return x;
}

// The largest key t with weight(key >= t among `in`) >= need (kernels/cpu/sampling.cc).
template <class In, class W>
KVFUSE_DEVICE uint32_t radix_threshold(const float* lg, int64_t vocab, In in, W weight, unsigned long long need,
                                       Shared& sh) {
  uint32_t prefix = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = int(threadIdx.x); i < 256; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t key = sampling_key(lg[i]);
      if (!in(i, key) || (key & high_mask) != prefix) continue;
      atomicAdd(&sh.hist[(key >> shift) & 0xffu], (unsigned long long)weight(i, lg[i]));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long acc = 0;
      for (int d = 255; d >= 0; --d) {
        if (acc + sh.hist[d] >= need || d == 0) {
          sh.bcast_u64[0] = need - acc;
          sh.bcast_u32 = prefix | (uint32_t(d) << shift);
          break;
        }
        acc += sh.hist[d];
      }
    }
    __syncthreads();
    need = sh.bcast_u64[0];
    prefix = sh.bcast_u32;
    __syncthreads();
  }
  return prefix;
}

// The first index (in id order) among `in` where the running weight reaches `need`.
template <class In, class W>
KVFUSE_DEVICE int64_t first_reaching(const float* lg, int64_t vocab, In in, W weight, unsigned long long need,
                                     Shared& sh) {
  unsigned long long run = 0;
  for (int64_t base = 0; base < vocab; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    unsigned long long x = 0;
    if (i < vocab && in(i, sampling_key(lg[i]))) x = weight(i, lg[i]);
    unsigned long long total = 0;
    const unsigned long long incl = block_scan(x, sh, total);
    if (threadIdx.x == 0) sh.bcast_i32 = kThreads;
    __syncthreads();
    if (run + incl >= need) atomicMin(&sh.bcast_i32, int(threadIdx.x));
    __syncthreads();
    const int hit = sh.bcast_i32;
    __syncthreads();
    if (hit < kThreads) return base + hit;
    run += total;
  }
  return vocab - 1;
}

__global__ void KVFUSE_LAUNCH_BOUNDS(kThreads, 1)
    sample_rows_kernel(const float* logits, int64_t rows, int64_t vocab, const RowSampling* params,
                       int32_t* tokens) {
  __shared__ Shared sh;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* lg = logits + row * vocab;
    const RowSampling p = params[row];
    if (p.temperature == 0.0f) continue;  // greedy rows: argmax_rows gives their token
    // The maximum logit (weights are relative to it).
    float bv = -INFINITY;
    int64_t bi = vocab;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      if (lg[i] > bv) {
        bv = lg[i];
        bi = i;
      }
    }
    for (int off = kWarpSize / 2; off > 0; off /= 2) {
      const float ov = warp_shfl_xor(bv, off);
      const int64_t oi = warp_shfl_xor(bi, off);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane_id() == 0) {
      sh.warp_f32[warp_id()] = bv;
      sh.warp_u64[warp_id()] = (unsigned long long)bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) {
        const float ov = sh.warp_f32[w];
        const int64_t oi = int64_t(sh.warp_u64[w]);
        if (ov > bv || (ov == bv && oi < bi)) {
          bv = ov;
          bi = oi;
        }
      }
      sh.bcast_i32 = int(bi >= vocab ? 0 : bi);
      sh.warp_f32[0] = bv;
    }
    __syncthreads();
    const float max_logit = sh.warp_f32[0];
    __syncthreads();
    const double inv_t = 1.0 / double(p.temperature);
    const auto all = [](int64_t, uint32_t) { return true; };
    const auto one = [](int64_t, float) { return 1ull; };
    const auto mass = [=](int64_t, float l) {
      return (unsigned long long)sampling_weight(l, max_logit, inv_t);
    };

    uint32_t tau_k = 0;
    int64_t cut_k = vocab;
    if (p.top_k > 0 && p.top_k < vocab) {
      tau_k = radix_threshold(lg, vocab, all, one, (unsigned long long)p.top_k, sh);
      unsigned long long above = 0;
      for (int64_t i = threadIdx.x; i < vocab; i += kThreads) above += sampling_key(lg[i]) > tau_k ? 1 : 0;
      above = block_sum(above, sh);
      const uint32_t t = tau_k;
      cut_k = first_reaching(lg, vocab, [=](int64_t, uint32_t key) { return key == t; }, one,
                             (unsigned long long)p.top_k - above, sh);
    }
    const uint32_t tk = tau_k;
    const int64_t ck = cut_k;
    const auto in_k = [=](int64_t i, uint32_t key) { return key > tk || (key == tk && i <= ck); };

    uint32_t tau_p = 0;
    int64_t cut_p = vocab;
    if (p.top_p < 1.0f) {
      unsigned long long total = 0;
      for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
        if (in_k(i, sampling_key(lg[i]))) total += mass(i, lg[i]);
      }
      total = block_sum(total, sh);
      const unsigned long long target = sampling_top_p_target(p.top_p, total);
      tau_p = radix_threshold(lg, vocab, in_k, mass, target, sh);
      unsigned long long above = 0;
      for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
        const uint32_t key = sampling_key(lg[i]);
        if (in_k(i, key) && key > tau_p) above += mass(i, lg[i]);
      }
      above = block_sum(above, sh);
      const uint32_t t = tau_p;
      cut_p = first_reaching(
          lg, vocab, [=](int64_t i, uint32_t key) { return in_k(i, key) && key == t; }, mass,
          target - above, sh);
    }
    const uint32_t tp = tau_p;
    const int64_t cp = cut_p;
    const auto kept = [=](int64_t i, uint32_t key) {
      return in_k(i, key) && (key > tp || (key == tp && i <= cp));
    };
    unsigned long long total = 0;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      if (kept(i, sampling_key(lg[i]))) total += mass(i, lg[i]);
    }
    total = block_sum(total, sh);
    const unsigned long long s = sampling_draw(p.u, total);
    const int64_t tok = first_reaching(lg, vocab, kept, mass, s + 1, sh);
    if (threadIdx.x == 0) tokens[row] = int32_t(tok);
    __syncthreads();
  }
}


// ---- Logprobs: one block per row, one pass over the logits. Each thread keeps an
// online (max, sum of exponentials) and its own top-n list; the block combines the
// sums, then takes the top n by n rounds of a block-wide pick of the best list head.
constexpr int kLpThreads = 256;
constexpr int kLpWarps = kLpThreads / kWarpSize;

struct LpShared {
  float m[kLpWarps];
  float s[kLpWarps];
  float v[kLpWarps];
  int32_t id[kLpWarps];
};

// (m, s) of the union of two sets: s relative to m.
KVFUSE_DEVICE void lse_combine(float& m, float& s, float om, float os) {
  if (om == -INFINITY) return;
  if (m == -INFINITY) {
    m = om;
    s = os;
    return;
  }
  if (om > m) {
    s = s * expf(m - om) + os;
    m = om;
  } else {
    s += os * expf(om - m);
  }
}

// The better of (v, id) and (ov, oid) in the top-n order; id < 0 is "none".
KVFUSE_DEVICE void pick_better(float& v, int32_t& id, float ov, int32_t oid) {
  if (oid < 0) return;
  if (id < 0 || logprob_ranks_before(ov, oid, v, id)) {
    v = ov;
    id = oid;
  }
}

__global__ void KVFUSE_LAUNCH_BOUNDS(kLpThreads, 1)
    logprobs_rows_kernel(const float* logits, int64_t rows, int64_t vocab, const LogprobRow* req,
                         const int32_t* greedy, const int32_t* sampled, const RowSampling* params,
                         LogprobOut* out) {
  __shared__ LpShared sh;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const LogprobRow rq = req[row];
    if (rq.top_n < 0) continue;
    const int32_t n = min(min(rq.top_n, kMaxTopLogprobs), int32_t(vocab));
    const float* lg = logits + row * vocab;
    float m = -INFINITY, s = 0.0f;
    float tv[kMaxTopLogprobs];
    int32_t ti[kMaxTopLogprobs];
    int32_t have = 0;
    for (int64_t i = threadIdx.x; i < vocab; i += kLpThreads) {
      const float x = lg[i];
      lse_combine(m, s, x, 1.0f);
      if (n == 0 || (have == n && !logprob_ranks_before(x, int32_t(i), tv[n - 1], ti[n - 1]))) continue;
      int32_t at = have < n ? have++ : n - 1;
      while (at > 0 && logprob_ranks_before(x, int32_t(i), tv[at - 1], ti[at - 1])) {
        tv[at] = tv[at - 1];
        ti[at] = ti[at - 1];
        --at;
      }
      tv[at] = x;
      ti[at] = int32_t(i);
    }
    for (int off = kWarpSize / 2; off > 0; off /= 2) {
      const float om = warp_shfl_xor(m, off), os = warp_shfl_xor(s, off);
      lse_combine(m, s, om, os);
    }
    if (lane_id() == 0) {
      sh.m[warp_id()] = m;
      sh.s[warp_id()] = s;
    }
    __syncthreads();
    m = sh.m[0];
    s = sh.s[0];
    for (int w = 1; w < kLpWarps; ++w) lse_combine(m, s, sh.m[w], sh.s[w]);
    const float log_s = logf(s);
    __syncthreads();
    const auto lp = [&](float x) { return (x - m) - log_s; };

    int32_t head = 0;
    for (int32_t r = 0; r < n; ++r) {
      float v = 0.0f;
      int32_t id = -1;
      if (head < have) {
        v = tv[head];
        id = ti[head];
      }
      for (int off = kWarpSize / 2; off > 0; off /= 2) {
        const float ov = warp_shfl_xor(v, off);
        const int32_t oid = warp_shfl_xor(id, off);
        pick_better(v, id, ov, oid);
      }
      if (lane_id() == 0) {
        sh.v[warp_id()] = v;
        sh.id[warp_id()] = id;
      }
      __syncthreads();
      v = sh.v[0];
      id = sh.id[0];
      for (int w = 1; w < kLpWarps; ++w) pick_better(v, id, sh.v[w], sh.id[w]);
      __syncthreads();
      if (head < have && ti[head] == id) ++head;
      if (threadIdx.x == 0) {
        out[row].top_ids[r] = id;
        out[row].top_logprobs[r] = lp(v);
      }
    }
    if (threadIdx.x == 0) {
      int32_t t = rq.target;
      if (t < 0) t = (params != nullptr && params[row].temperature > 0.0f) ? sampled[row] : greedy[row];
      out[row].token = t;
      out[row].logprob = (t >= 0 && t < vocab) ? lp(lg[t]) : NAN;
      out[row].top_n = n;
    }
  }
}
}  // namespace

cudaError_t launch_sample_rows(const float* logits, int64_t rows, int64_t vocab, const RowSampling* params,
                               int32_t* tokens, cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return cudaSuccess;
  if (vocab > INT32_MAX) return cudaErrorInvalidValue;
  const unsigned blocks = rows < 65535 ? unsigned(rows) : 65535u;
  return launch_kernel(sample_rows_kernel, blocks, kThreads, stream, false, logits, rows, vocab, params, tokens);
}

cudaError_t launch_logprobs_rows(const float* logits, int64_t rows, int64_t vocab, const LogprobRow* req,
                                 const int32_t* greedy, const int32_t* sampled, const RowSampling* params,
                                 LogprobOut* out, cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return cudaSuccess;
  if (vocab > INT32_MAX) return cudaErrorInvalidValue;
  const unsigned blocks = rows < 65535 ? unsigned(rows) : 65535u;
  return launch_kernel(logprobs_rows_kernel, blocks, kLpThreads, stream, false, logits, rows, vocab, req, greedy,
                       sampled, params, out);
}

}  // namespace kvfuse::gpu
