// Sampling kernel; kernels/ops/sampling.h has the rule, kernels/cpu/ops/sampling.cc the same
// steps sequentially. Every sum is an integer sum (counts, 40-bit fixed-point weights),
// so the block's parallel order gives the CPU's result exactly. The passes over a row
// read it with 16-byte loads (block_for_each_f32, and first_reaching's quads): which
// thread reads which logit changes no result, for the same reason.
#include "kernels/common/gpu.h"

#include "kernels/ops/sampling.cuh"

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
  x = warp_inclusive_sum(x);
  if (lane_id() == kWarpSize - 1) sh.warp_u64[warp_id()] = x;
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

// The largest key t with weight(key >= t among `in`) >= need (kernels/cpu/ops/sampling.cc).
template <class In, class W>
KVFUSE_DEVICE uint32_t radix_threshold(const float* lg, int64_t vocab, In in, W weight, unsigned long long need,
                                       Shared& sh) {
  uint32_t prefix = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = int(threadIdx.x); i < 256; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
    block_for_each_f32<kThreads, 1>(lg, vocab, [&](int64_t i, float l) {
      const uint32_t key = sampling_key(l);
      if (in(i, key) && (key & high_mask) == prefix) {
        atomicAdd(&sh.hist[(key >> shift) & 0xffu], (unsigned long long)weight(i, l));
      }
    });
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
// The row is scanned in chunks of quads, thread order = quad order: quad q holds the
// elements [head - 4 + 4q, head + 4q) that lie in the row (F32Row), so quad 0 is the
// 0-3 elements before the first 16-byte boundary, the whole quads are one 16-byte load
// each, and the last quad holds the 0-3 elements after them. A thread sums its quad's
// weights in order, the block scan gives what precedes the quad, and the lowest index
// whose running weight reaches `need` wins.
template <class In, class W>
KVFUSE_DEVICE int64_t first_reaching(const float* lg, int64_t vocab, In in, W weight, unsigned long long need,
                                     Shared& sh) {
  const F32Row r(lg, vocab);
  const int64_t quads = r.vecs + 2;
  unsigned long long run = 0;
  for (int64_t base = 0; base < quads; base += kThreads) {
    const int64_t q = base + threadIdx.x;
    const int64_t i0 = r.head - 4 + 4 * q;
    float l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (q >= 1 && q <= r.vecs) {
      r.load_vec(q - 1, l);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (i0 + j >= 0 && i0 + j < vocab) l[j] = lg[i0 + j];
      }
    }
    unsigned long long x[4];  // running weight within the quad
    unsigned long long acc = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = i0 + j;
      if (q < quads && i >= 0 && i < vocab && in(i, sampling_key(l[j]))) acc += weight(i, l[j]);
      x[j] = acc;
    }
    unsigned long long total = 0;
    const unsigned long long before = run + block_scan(x[3], sh, total) - x[3];
    if (threadIdx.x == 0) sh.bcast_i32 = INT32_MAX;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = i0 + j;
      if (q < quads && i >= 0 && i < vocab && before + x[j] >= need) {
        atomicMin(&sh.bcast_i32, int(i));
        break;
      }
    }
    __syncthreads();
    const int hit = sh.bcast_i32;
    __syncthreads();
    if (hit < INT32_MAX) return hit;
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
    // The maximum logit (weights are relative to it). NaN never replaces it, so a
    // thread's value is never NaN and the max is the same in any order.
    float bv = -INFINITY;
    block_for_each_f32<kThreads, 1>(lg, vocab, [&](int64_t, float l) { bv = l > bv ? l : bv; });
    bv = warp_reduce_max(bv);
    if (lane_id() == 0) sh.warp_f32[warp_id()] = bv;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) bv = sh.warp_f32[w] > bv ? sh.warp_f32[w] : bv;
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
      block_for_each_f32<kThreads, 1>(lg, vocab,
                                      [&](int64_t, float l) { above += sampling_key(l) > tau_k ? 1 : 0; });
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
      block_for_each_f32<kThreads, 1>(lg, vocab, [&](int64_t i, float l) {
        if (in_k(i, sampling_key(l))) total += mass(i, l);
      });
      total = block_sum(total, sh);
      const unsigned long long target = sampling_top_p_target(p.top_p, total);
      tau_p = radix_threshold(lg, vocab, in_k, mass, target, sh);
      unsigned long long above = 0;
      block_for_each_f32<kThreads, 1>(lg, vocab, [&](int64_t i, float l) {
        const uint32_t key = sampling_key(l);
        if (in_k(i, key) && key > tau_p) above += mass(i, l);
      });
      above = block_sum(above, sh);
      const uint32_t t = tau_p;
      cut_p = first_reaching(
          lg, vocab, [=](int64_t i, uint32_t key) { return in_k(i, key) && key == t; }, mass,
          target - above, sh);
    }
    const uint32_t tp = tau_p;
    const int64_t cp = cut_p;
    const auto top = [=](int64_t i, uint32_t key) {
      return in_k(i, key) && (key > tp || (key == tp && i <= cp));
    };
    // min-p: a token's weight decides, which the key alone does not give; a kept token
    // weighs its mass, every other 0 (first_reaching skips no token by `in` then).
    const unsigned long long min_w = sampling_min_p_floor(p.min_p);
    const auto kept_mass = [=](int64_t i, float l) {
      const unsigned long long m = mass(i, l);
      return top(i, sampling_key(l)) && m >= min_w ? m : 0ull;
    };
    unsigned long long total = 0;
    block_for_each_f32<kThreads, 1>(lg, vocab, [&](int64_t i, float l) { total += kept_mass(i, l); });
    total = block_sum(total, sh);
    const unsigned long long s = sampling_draw(p.u, total);
    const int64_t tok = first_reaching(lg, vocab, all, kept_mass, s + 1, sh);
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

// Inserts (x, i) into a thread's top-n list (the first `have` entries of tv, ti, best
// first) if it is among the n best the thread has seen (n <= kMaxTopLogprobs).
KVFUSE_DEVICE void top_offer(float (&tv)[kMaxTopLogprobs], int32_t (&ti)[kMaxTopLogprobs], int32_t& have,
                             int32_t n, float x, int32_t i) {
  if (n == 0 || (have == n && !logprob_ranks_before(x, i, tv[n - 1], ti[n - 1]))) return;
  int32_t at = have < n ? have++ : n - 1;
  while (at > 0 && logprob_ranks_before(x, i, tv[at - 1], ti[at - 1])) {
    tv[at] = tv[at - 1];
    ti[at] = ti[at - 1];
    --at;
  }
  tv[at] = x;
  ti[at] = i;
}

// What the warps reduce: lse_combine is commutative (either order scales the smaller
// maximum's sum and adds), pick_better a selection by a total order.
struct LseAcc {
  float m;
  float s;
};
struct TopPick {
  float v;
  int32_t id;
};

// The row pass with 16-byte loads on CDNA only. It changes which thread sums which
// exponentials, so the fp32 sum's rounding (not its error bound: each thread still adds
// about vocab / kLpThreads terms) differs from the strided pass's; on NVIDIA the strided
// pass stays, and its results stay bit for bit.
constexpr bool kLpVec = kWarpSize == 64;

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
    if constexpr (kLpVec) {
      block_for_each_f32<kLpThreads, 1>(lg, vocab, [&](int64_t i, float x) {
        lse_combine(m, s, x, 1.0f);
        top_offer(tv, ti, have, n, x, int32_t(i));
      });
    } else {
      for (int64_t i = threadIdx.x; i < vocab; i += kLpThreads) {
        const float x = lg[i];
        lse_combine(m, s, x, 1.0f);
        top_offer(tv, ti, have, n, x, int32_t(i));
      }
    }
    const LseAcc acc = warp_reduce(LseAcc{m, s}, [](LseAcc a, LseAcc b) {
      lse_combine(a.m, a.s, b.m, b.s);
      return a;
    });
    if (lane_id() == 0) {
      sh.m[warp_id()] = acc.m;
      sh.s[warp_id()] = acc.s;
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
      const TopPick best = warp_reduce(TopPick{v, id}, [](TopPick a, TopPick b) {
        pick_better(a.v, a.id, b.v, b.id);
        return a;
      });
      if (lane_id() == 0) {
        sh.v[warp_id()] = best.v;
        sh.id[warp_id()] = best.id;
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

// ---- Logit processors: one block per row, a thread per entry (entries are few: the
// distinct tokens of a penalised sequence, or a request's logit_bias).
constexpr int kAdjustThreads = 128;

__global__ void KVFUSE_LAUNCH_BOUNDS(kAdjustThreads, 1)
    adjust_rows_kernel(float* logits, int64_t rows, int64_t vocab, const int32_t* start, LogitAdjust* entries,
                       bool restore) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int32_t j = start[row] + int32_t(threadIdx.x); j < start[row + 1]; j += kAdjustThreads) {
      LogitAdjust& a = entries[j];
      float& l = logits[row * vocab + a.token];
      if (restore) {
        l = a.saved;
        continue;
      }
      a.saved = l;
      float x = add_rn(l, a.bias);
      if (a.rep != 1.0f) x = x > 0.0f ? x / a.rep : mul_rn(x, a.rep);
      l = sub_rn(x, a.sub);
    }
  }
}

cudaError_t launch_adjust_rows(float* logits, int64_t rows, int64_t vocab, const int32_t* start,
                               LogitAdjust* entries, bool restore, cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return cudaSuccess;
  const unsigned blocks = rows < 65535 ? unsigned(rows) : 65535u;
  return launch_kernel(adjust_rows_kernel, blocks, kAdjustThreads, stream, false, logits, rows, vocab, start,
                       entries, restore);
}

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
