// The FP8-weight GEMV and the activation quantizer (kernels/gemm/gemv_fp8.cuh) against the CPU
// reference (kernels/cpu/gemm/gemm_fp8.h): m = 1..8, every variant, activations none (W8A16),
// static_tensor and dynamic_token (W8A8, quantized on the GPU by launch_quantize_rows_fp8),
// fp32 and bf16 outputs, with and without bias, e4m3fn weights (and e4m3fnuz on the smaller
// shapes: on NVIDIA that runs the bit-manipulation decode of sm_80 and AMD, on gfx942 the
// instruction), shapes from k = 16 and n = 1 to llama3-8b's. Without a GPU it skips.
//
// The quantizer must give the CPU's quantize_rows_fp8 bytes and scales exactly, on rows of
// every magnitude, zero rows (+0 and -0), rows holding a NaN, an inf, values near the bf16
// maximum, subnormals, and static scales that saturate.
//
// The GEMV's tolerance. Let u = 2^-24, gamma(j) = j u / (1 - j u), and for output (i, j) let
// T be the exact sum of the dequantized products, sum_p xd[i, p] wd[j, p] with xd = dec(xq[i, p])
// s_i (W8A8) or x[i, p] (W8A16) and wd = dec(w[j, p]) ws_j taken exactly, S = sum_p |xd wd|
// and b the bias (0 without).
// - CPU: xd and wd are each rounded once to fp32, then an in-order fmaf chain of k steps:
//   |c0 - T| <= (gamma(k) + gamma(2)) S (1 + u) <= gamma(k + 2) S (to first order; the
//   difference is O(k u^2) S); then c = fl(c0 + b): |c - (T + b)| <= gamma(k + 3) (S + |b|).
// - GPU: the products of decoded codes (bf16 x e4m3 or e4m3 x e4m3, times a power of two) are
//   exact in fp32, and any order of summing k terms rounds each at most k - 1 times (the
//   lanes' chains, the butterfly, the split-K adds: Higham (4.4)); then the unit (exact), one
//   multiply by ws_j (W8A16) or by fl(s_i ws_j) (W8A8: two roundings), and the bias add: the
//   same gamma(k + 3) (S + |b|).
// So |gpu - cpu| <= 2 gamma(k + 3) (S + |b|) for fp32 out; the test allows 2 gamma(k + 4)
// (S + |b|) =: E, the extra u for S being summed here from the CPU's rounded operands. A bf16
// out g' = bf16(g) is compared with the CPU's fp32 c (the value linear_fp8_bf16 rounds):
// |g' - g| is half a bf16 ulp of g, at most one ulp of c unless g is two binades above c, where
// it is at most 2^-8 |g| <= 2^-8 (|c| + E); so |g' - c| <= ulp_bf16(c) + (1 + 2^-8) E. No
// products underflow here (|x| >= 2^-40 or 0, every decoded product >= 2^-60), which the bound
// would otherwise need an absolute term for. NaN outputs (NaN codes, NaN activations) must be
// NaN on both. And per variant, the bf16 output must be the fp32 output rounded (the same sums);
// W8A8 quantized inside the GEMV must give the bits of the GEMV on the quantizer's codes; and
// the SiLU-mul form (launch_gemv_fp8_silu_mul) the bits of the bf16 output then launch_silu_mul.
// A worst-case bound: about 5e-4 S at k = 4096, loose enough to hide one wrong product there;
// the k = 16 and 256 shapes (every code, in every lane position) are where single ones show.
#include "kernels/common/gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/fp8.h"
#include "kernels/cpu/gemm/gemm.h"
#include "kernels/cpu/gemm/gemm_fp8.h"
#include "kernels/gemm/gemv_fp8.cuh"
#include "kernels/ops/model_ops.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using gpu_test::check;
using gpu_test::DeviceMem;


const char* fmt_name(Fp8Format f) { return f == Fp8Format::e4m3fnuz ? "e4m3fnuz" : "e4m3fn"; }
const char* act_name(Fp8Act a) {
  return a == Fp8Act::none ? "none" : a == Fp8Act::static_tensor ? "static" : "dynamic";
}

uint8_t nan_code(Fp8Format f) { return f == Fp8Format::e4m3fnuz ? 0x80 : 0x7f; }

double bf16_ulp(double v) {
  int e = 0;
  std::frexp(std::max(std::fabs(v), 1e-30), &e);
  return std::ldexp(1.0, e - 8);
}

bool same_bits_or_both_nan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof a) == 0;
}

// One GEMV problem: x rows of magnitudes 1, 100 and 0.01 in turn (so the dynamic scales
// differ and a static scale saturates some rows), random non-NaN codes of every exponent,
// scales in [1e-4, 1e-2), a bias in [-1, 1). with_nan: one NaN code in w row n / 2 and one
// NaN in x row m - 1.
struct Problem {
  int64_t m, n, k;
  Fp8Format fmt;
  std::vector<bf16_t> x;
  std::vector<uint8_t> w;
  std::vector<float> w_scale, bias;
  float static_scale = 0.0173f;
};

Problem make_problem(int64_t m, int64_t n, int64_t k, Fp8Format fmt, uint64_t seed, bool with_nan) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  Problem p{m, n, k, fmt, {}, {}, {}, {}};
  p.x.resize(size_t(m * k));
  p.w.resize(size_t(n * k));
  p.w_scale.resize(size_t(n));
  p.bias.resize(size_t(n));
  const float mags[3] = {1.0f, 100.0f, 0.01f};
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < k; ++c) {
      float v = unit(rng) * mags[i % 3];
      if (std::fabs(v) < 1e-12f) v = 0.0f;  // no underflowing products (the header)
      p.x[size_t(i * k + c)] = f32_to_bf16(v);
    }
  for (auto& c : p.w) {
    do {
      c = uint8_t(rng() & 0xff);
    } while (fp8_is_nan(c, fmt));
  }
  std::uniform_real_distribution<float> sd(1e-4f, 1e-2f);
  for (auto& s : p.w_scale) s = sd(rng);
  for (auto& b : p.bias) b = unit(rng);
  if (with_nan) {
    p.w[size_t((n / 2) * k + k / 3)] = nan_code(fmt);
    p.x[size_t((m - 1) * k + k / 2)] = 0x7fc0;
  }
  return p;
}

// The CPU's result (fp32, the bias added as linear_fp8_bf16 adds it before rounding) and
// S + |b| per output, for the tolerance.
struct Reference {
  std::vector<float> out;
  std::vector<double> mag;
  std::vector<uint8_t> xq;  // quantize_rows_fp8 (act != none)
  std::vector<float> x_scale;
};

Reference reference(const Problem& p, Fp8Act act, bool with_bias) {
  const int64_t m = p.m, n = p.n, k = p.k;
  std::vector<uint8_t> packed(cpu::gemm_packed_fp8_bytes(n, k));
  cpu::gemm_pack_weight_fp8(p.w.data(), n, k, packed.data());
  const cpu::Fp8Weight wt{packed.data(), p.w_scale.data(), p.fmt};
  const cpu::Fp8ActQuant aq{act, p.static_scale, p.fmt};
  std::vector<float> scratch(cpu::gemm_fp8_scratch_floats(m, k, n));
  Reference ref{std::vector<float>(size_t(m * n)), std::vector<double>(size_t(m * n)), {}, {}};
  cpu::linear_fp8_f32_out(p.x.data(), m, k, wt, n, aq, ref.out.data(), scratch.data(),
                          cpu::gemm_widest_isa());
  // |xd| per row: the CPU's dequantized (or widened) activations.
  std::vector<double> axd(size_t(m * k));
  if (act == Fp8Act::none) {
    for (size_t e = 0; e < axd.size(); ++e) axd[e] = std::fabs(double(bf16_to_f32(p.x[e])));
  } else {
    ref.xq.resize(size_t(m * k));
    ref.x_scale.resize(size_t(m));
    cpu::quantize_rows_fp8(p.x.data(), m, k, act, p.static_scale, p.fmt, ref.xq.data(), ref.x_scale.data());
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < k; ++c)
        axd[size_t(i * k + c)] =
            std::fabs(double(fp8_decode(ref.xq[size_t(i * k + c)], p.fmt) * ref.x_scale[size_t(i)]));
  }
  std::vector<double> awd(static_cast<size_t>(k));
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < k; ++c)
      awd[size_t(c)] = std::fabs(double(fp8_decode(p.w[size_t(j * k + c)], p.fmt) * p.w_scale[size_t(j)]));
    const float b = with_bias ? p.bias[size_t(j)] : 0.0f;
    for (int64_t i = 0; i < m; ++i) {
      const double* xr = axd.data() + i * k;
      double s[4] = {0, 0, 0, 0};
      int64_t c = 0;
      for (; c + 4 <= k; c += 4)
        for (int t = 0; t < 4; ++t) s[t] += xr[c + t] * awd[size_t(c + t)];
      for (; c < k; ++c) s[0] += xr[c] * awd[size_t(c)];
      float& o = ref.out[size_t(i * n + j)];
      if (with_bias) o = o + b;  // one fp32 add, linear_fp8_bf16's
      ref.mag[size_t(i * n + j)] = s[0] + s[1] + s[2] + s[3] + std::fabs(double(b));
    }
  }
  return ref;
}

// The header's bounds, and bf16 out = fp32 out rounded.
void check_outputs(const std::string& what, const Reference& ref, int64_t k, const std::vector<float>& of,
                   const std::vector<bf16_t>& ob) {
  const double u = std::ldexp(1.0, -24), kk = double(k + 4), gamma = kk * u / (1.0 - kk * u);
  int64_t bad_f = 0, bad_b = 0, not_rounded = 0;
  double worst = 0.0;
  for (size_t e = 0; e < ref.out.size(); ++e) {
    const float c = ref.out[e];
    const float g = of[e];
    const float gb = bf16_to_f32(ob[e]);
    not_rounded += !same_bits_or_both_nan(gb, bf16_to_f32(f32_to_bf16(g)));
    if (std::isnan(c)) {
      bad_f += !std::isnan(g);
      bad_b += !std::isnan(gb);
      continue;
    }
    const double tol = 2.0 * gamma * ref.mag[e];
    const double ef = std::fabs(double(g) - double(c));
    bad_f += !(ef <= tol);
    bad_b += !(std::fabs(double(gb) - double(c)) <= bf16_ulp(c) + (1.0 + 1.0 / 256.0) * tol);
    if (tol > 0) worst = std::max(worst, ef / tol);
  }
  check(bad_f == 0 && bad_b == 0 && not_rounded == 0,
        what + ": " + std::to_string(bad_f) + " fp32 and " + std::to_string(bad_b) +
            " bf16 outputs outside the bound (worst fp32 " + std::to_string(worst) + " of it), " +
            std::to_string(not_rounded) + " bf16 outputs not the fp32 ones rounded");
}

// Every variant of one problem and activation kind, both outputs.
void run_case(const Problem& p, Fp8Act act, bool with_bias, cudaStream_t stream) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const std::string what = std::string("gemv fp8 ") + std::to_string(m) + "x" + std::to_string(n) + "x" +
                           std::to_string(k) + " " + fmt_name(p.fmt) + " act " + act_name(act) +
                           (with_bias ? " bias" : "");
  const Reference ref = reference(p, act, with_bias);
  DeviceMem dx(p.x.size() * 2), dw(p.w.size()), dws(size_t(n) * 4), db(size_t(n) * 4), dss(4),
      dxq(size_t(m * k)), dxs(size_t(m) * 4), df(size_t(m * n) * 4), dbf(size_t(m * n) * 2),
      dsilu(size_t(m * n)), dsilu_ref(size_t(m * n));
  dx.upload(p.x.data(), p.x.size() * 2);
  dw.upload(p.w.data(), p.w.size());
  dws.upload(p.w_scale.data(), size_t(n) * 4);
  db.upload(p.bias.data(), size_t(n) * 4);
  dss.upload(&p.static_scale, 4);
  gpu::Fp8GemvAct ga{act, nullptr, nullptr, p.fmt};
  if (act != Fp8Act::none) {
    const gpu::LaunchStatus sq =
        gpu::launch_quantize_rows_fp8(dx.get<bf16_t>(), m, k, act, dss.get<float>(), p.fmt,
                                      dxq.get<uint8_t>(), dxs.get<float>(), stream, false);
    check(sq.ok(), what + ": quantize: " + sq.message());
    KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
    const std::vector<uint8_t> q = dxq.download<uint8_t>(size_t(m * k));
    const std::vector<float> s = dxs.download<float>(size_t(m));
    check(q == ref.xq && std::memcmp(s.data(), ref.x_scale.data(), s.size() * 4) == 0,
          what + ": the quantized activations differ from quantize_rows_fp8's");
    ga.xq = dxq.get<uint8_t>();
    ga.x_scale = dxs.get<float>();
  }
  const float* bias = with_bias ? db.get<float>() : nullptr;
  // W8A8 twice: from the quantizer's codes, and quantized by the GEMV itself (xq null),
  // which must give the same bits: the same codes, scales and sums.
  gpu::Fp8GemvAct in_kernel{act, nullptr, nullptr, p.fmt, dss.get<float>()};
  for (int v = 0; v < gpu::gemv_variants(m); ++v) {
    std::vector<float> f32_of_codes;
    std::vector<bf16_t> bf16_of_codes;
    for (const bool quantizes : {false, true}) {
      if (quantizes && act == Fp8Act::none) break;
      const gpu::Fp8GemvAct& a = quantizes ? in_kernel : ga;
      const std::string wv = what + " variant " + std::to_string(v) + (quantizes ? " quantized in the GEMV" : "");
      KVFUSE_TEST_GPU(cudaMemsetAsync(df.get(), 0xff, size_t(m * n) * 4, stream));
      KVFUSE_TEST_GPU(cudaMemsetAsync(dbf.get(), 0xff, size_t(m * n) * 2, stream));
      const gpu::LaunchStatus sf = gpu::launch_gemv_fp8(dx.get<bf16_t>(), m, dw.get<uint8_t>(), dws.get<float>(),
                                                        p.fmt, n, k, bias, df.get(), true, a, stream, false, v);
      check(sf.ok(), wv + " f32: " + sf.message());
      const gpu::LaunchStatus sb = gpu::launch_gemv_fp8(dx.get<bf16_t>(), m, dw.get<uint8_t>(), dws.get<float>(),
                                                        p.fmt, n, k, bias, dbf.get(), false, a, stream, true, v);
      check(sb.ok(), wv + " bf16: " + sb.message());
      KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
      const std::vector<float> f32 = df.download<float>(size_t(m * n));
      const std::vector<bf16_t> bf16 = dbf.download<bf16_t>(size_t(m * n));
      check_outputs(wv, ref, k, f32, bf16);
      if (!quantizes) {
        f32_of_codes = f32;
        bf16_of_codes = bf16;
      } else {
        check(std::memcmp(f32.data(), f32_of_codes.data(), f32.size() * 4) == 0 && bf16 == bf16_of_codes,
              wv + ": not the bits of the GEMV on the quantizer's codes");
      }
      // The SiLU-mul epilogue (bf16 x, codes, or quantized in the GEMV): the bits of this
      // GEMV's bf16 out, then launch_silu_mul.
      if (n % 2 == 0) {
        const int64_t inter = n / 2;
        KVFUSE_TEST_GPU(gpu::launch_silu_mul(dbf.get<bf16_t>(), m, inter, dsilu_ref.get<bf16_t>(), stream));
        KVFUSE_TEST_GPU(cudaMemsetAsync(dsilu.get(), 0xff, size_t(m * inter) * 2, stream));
        const gpu::LaunchStatus ss = gpu::launch_gemv_fp8_silu_mul(
            dx.get<bf16_t>(), m, dw.get<uint8_t>(), dws.get<float>(), p.fmt, n, k, bias, dsilu.get<bf16_t>(), a,
            stream, true, v);
        check(ss.ok(), wv + " silu_mul: " + ss.message());
        KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
        check(dsilu.download<bf16_t>(size_t(m * inter)) == dsilu_ref.download<bf16_t>(size_t(m * inter)),
              wv + " silu_mul: not the GEMV's bf16 then silu_mul's bits");
      }
    }
  }
}

// --- The quantizer -------------------------------------------------------------------------

// Rows by kind (row % 9): random of magnitude 1e-6, 1e-2, 1, 100 or 3e4; all zero (+0 and
// -0); a NaN among random values; huge values (up to the bf16 maximum) with an inf; bf16
// subnormals.
std::vector<bf16_t> quant_rows(int64_t m, int64_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const float mags[5] = {1e-6f, 1e-2f, 1.0f, 100.0f, 3e4f};
  std::vector<bf16_t> x(size_t(m * k));
  for (int64_t i = 0; i < m; ++i) {
    bf16_t* row = x.data() + i * k;
    const int kind = int(i % 9);
    for (int64_t c = 0; c < k; ++c) {
      if (kind < 5) {
        row[c] = f32_to_bf16(unit(rng) * mags[kind]);
      } else if (kind == 5) {
        row[c] = (rng() & 1) ? 0x8000 : 0x0000;
      } else if (kind == 6) {
        row[c] = f32_to_bf16(unit(rng) * 5.0f);
      } else if (kind == 7) {
        row[c] = f32_to_bf16(unit(rng) * 3.3e38f);
      } else {
        row[c] = bf16_t((rng() & 0x807f) | 1);  // a subnormal, either sign
      }
    }
    if (kind == 6) row[k / 2] = (i & 1) ? 0xffc0 : 0x7fc0;
    if (kind == 7) row[k - 1] = 0x7f80;  // +inf: s = inf, the row's codes NaN and zeros
  }
  return x;
}

void run_quant_case(int64_t m, int64_t k, Fp8Act act, Fp8Format fmt, float static_scale, uint64_t seed,
                    cudaStream_t stream) {
  const std::vector<bf16_t> x = quant_rows(m, k, seed);
  std::vector<uint8_t> q(size_t(m * k));
  std::vector<float> s(static_cast<size_t>(m));
  cpu::quantize_rows_fp8(x.data(), m, k, act, static_scale, fmt, q.data(), s.data());
  DeviceMem dx(x.size() * 2), dq(q.size()), ds(s.size() * 4), dss(4);
  dx.upload(x.data(), x.size() * 2);
  dss.upload(&static_scale, 4);
  KVFUSE_TEST_GPU(cudaMemsetAsync(dq.get(), 0x5a, q.size(), stream));
  const std::string what = std::string("quantize ") + std::to_string(m) + "x" + std::to_string(k) + " " +
                           act_name(act) + " " + fmt_name(fmt) + " static scale " +
                           std::to_string(static_scale);
  const gpu::LaunchStatus st = gpu::launch_quantize_rows_fp8(
      dx.get<bf16_t>(), m, k, act, dss.get<float>(), fmt, dq.get<uint8_t>(), ds.get<float>(), stream, true);
  check(st.ok(), what + ": " + st.message());
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> gq = dq.download<uint8_t>(q.size());
  const std::vector<float> gs = ds.download<float>(s.size());
  int64_t bad_bytes = 0, bad_scales = 0;
  for (size_t e = 0; e < q.size(); ++e) bad_bytes += gq[e] != q[e];
  for (size_t i = 0; i < s.size(); ++i) bad_scales += std::memcmp(&gs[i], &s[i], 4) != 0;
  check(bad_bytes == 0 && bad_scales == 0, what + ": " + std::to_string(bad_bytes) + " codes and " +
                                               std::to_string(bad_scales) + " scales differ from the CPU's");
}

void test_refusals(cudaStream_t stream) {
  DeviceMem a(1 << 16), b(1 << 16), c(1 << 16), s(1 << 12);
  const gpu::Fp8GemvAct none{};
  const auto gemv = [&](const bf16_t* x, int64_t m, int64_t k, Fp8Format fmt, const gpu::Fp8GemvAct& act,
                        int v = 0) {
    return gpu::launch_gemv_fp8(x, m, b.get<uint8_t>(), s.get<float>(), fmt, 4, k, nullptr, c.get(), true,
                                act, stream, false, v)
        .ok();
  };
  const bf16_t* x = a.get<bf16_t>();
  check(!gemv(x, 9, 16, Fp8Format::e4m3fn, none), "gemv fp8: m = 9 refused");
  check(!gemv(x, 0, 16, Fp8Format::e4m3fn, none), "gemv fp8: m = 0 refused");
  check(!gemv(x, 1, 24, Fp8Format::e4m3fn, none), "gemv fp8: k = 24 refused");
  check(!gemv(x + 1, 1, 16, Fp8Format::e4m3fn, none), "gemv fp8: unaligned x refused");
  check(!gemv(x, 1, 16, Fp8Format::e5m2, none), "gemv fp8: e5m2 weights refused");
  check(!gemv(x, 3, 16, Fp8Format::e4m3fn, none, gpu::gemv_variants(3)),
        "gemv fp8: a variant past the last refused");
  const gpu::Fp8GemvAct mismatch{Fp8Act::dynamic_token, a.get<uint8_t>(), s.get<float>(),
                                 Fp8Format::e4m3fnuz};
  check(!gemv(nullptr, 1, 16, Fp8Format::e4m3fn, mismatch),
        "gemv fp8: activation format != weight format refused");
  const gpu::Fp8GemvAct no_scale{Fp8Act::static_tensor, a.get<uint8_t>(), nullptr, Fp8Format::e4m3fn};
  check(!gemv(nullptr, 1, 16, Fp8Format::e4m3fn, no_scale), "gemv fp8: W8A8 without x_scale refused");
  const gpu::Fp8GemvAct q{Fp8Act::static_tensor, a.get<uint8_t>(), s.get<float>(), Fp8Format::e4m3fn};
  check(gemv(nullptr, 8, 4096, Fp8Format::e4m3fn, q), "gemv fp8: W8A8 8 x 4 x 4096 without x accepted");
  const gpu::Fp8GemvAct own_static{Fp8Act::static_tensor, nullptr, nullptr, Fp8Format::e4m3fn, nullptr};
  check(!gemv(x, 1, 16, Fp8Format::e4m3fn, own_static),
        "gemv fp8: static activations quantized in the GEMV without their scale refused");
  const gpu::Fp8GemvAct own_dynamic{Fp8Act::dynamic_token, nullptr, nullptr, Fp8Format::e4m3fn, nullptr};
  check(!gemv(nullptr, 1, 16, Fp8Format::e4m3fn, own_dynamic),
        "gemv fp8: activations quantized in the GEMV without x refused");
  check(gemv(x, 8, 4096, Fp8Format::e4m3fn, own_dynamic),
        "gemv fp8: dynamic activations quantized in the GEMV, 8 x 4 x 4096, accepted");
  const auto silu = [&](int64_t n, const gpu::Fp8GemvAct& act) {
    return gpu::launch_gemv_fp8_silu_mul(x, 1, b.get<uint8_t>(), s.get<float>(), Fp8Format::e4m3fn, n, 16, nullptr,
                                         c.get<bf16_t>(), act, stream)
        .ok();
  };
  check(!silu(5, none), "gemv fp8 silu_mul: an odd n refused");
  check(silu(4, q), "gemv fp8 silu_mul: 1 x 4 x 16, activations as codes, accepted");
  check(silu(4, own_dynamic), "gemv fp8 silu_mul: 1 x 4 x 16, quantized in the GEMV, accepted");
  check(gpu::gemv_fp8_unsupported(x, 8, b.get<uint8_t>(), s.get<float>(), Fp8Format::e4m3fn, 4096, 4096,
                                  c.get(), none)
            .empty(),
        "gemv fp8: 8 x 4096 x 4096 supported");
  const auto quant = [&](int64_t k, Fp8Act act, const float* ss) {
    return gpu::launch_quantize_rows_fp8(x, 2, k, act, ss, Fp8Format::e4m3fn, b.get<uint8_t>(),
                                         s.get<float>(), stream)
        .ok();
  };
  check(!quant(12, Fp8Act::dynamic_token, nullptr), "quantize: k = 12 refused");
  check(!quant(16, Fp8Act::none, nullptr), "quantize: act none refused");
  check(!quant(16, Fp8Act::static_tensor, nullptr), "quantize: static without its scale refused");
  check(quant(16, Fp8Act::dynamic_token, nullptr), "quantize: dynamic 2 x 16 accepted");
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
}

}  // namespace

int main() {
  if (!gpu_test::gpu_available("test_gemv_fp8_gpu")) return 0;
  const bool quick = gpu_test::quick();
  cudaStream_t stream;
  KVFUSE_TEST_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint64_t seed = 1;
  test_refusals(stream);

  // The quantizer, bit for bit.
  for (const Fp8Format fmt : {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz}) {
    for (const auto& [m, k] :
         std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {9, 16}, {18, 4104}, {37, 4096}, {8, 14336}}) {
      if (quick && k > 4104) continue;
      run_quant_case(m, k, Fp8Act::dynamic_token, fmt, 1.0f, ++seed, stream);
      for (const float ss : {1.0f, 0.0173f, 2.5e-7f})
        run_quant_case(m, k, Fp8Act::static_tensor, fmt, ss, ++seed, stream);
    }
  }

  // The GEMV: edge shapes (k of one chunk, k one chunk past 4096, n of 1 and of a partial
  // block) and llama3-8b's qkv, o, gate/up and down at a sixteenth of their rows, every m
  // and activation kind, e4m3fn; e4m3fnuz on the edge shapes; a NaN code and a NaN
  // activation in the 33 x 4112 cases.
  const std::vector<std::pair<int64_t, int64_t>> edge = {
      {1, 16}, {33, 16}, {1, 4112}, {33, 4112}, {4096, 256}};
  const std::vector<std::pair<int64_t, int64_t>> llama_small = {
      {384, 4096}, {256, 4096}, {1792, 4096}, {256, 14336}};
  const Fp8Act acts[3] = {Fp8Act::none, Fp8Act::static_tensor, Fp8Act::dynamic_token};
  for (int64_t m = 1; m <= gpu::kGemvMaxRows; ++m) {
    if (quick && m != 1 && m != 3 && m != 8) continue;
    for (const Fp8Format fmt : {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz}) {
      if (quick && fmt == Fp8Format::e4m3fnuz && m != 3) continue;
      std::vector<std::pair<int64_t, int64_t>> shapes = edge;
      if (fmt == Fp8Format::e4m3fn && !quick)
        shapes.insert(shapes.end(), llama_small.begin(), llama_small.end());
      for (const auto& [n, k] : shapes) {
        const bool with_nan = n == 33 && k == 4112;
        const Problem p = make_problem(m, n, k, fmt, ++seed, with_nan);
        for (int a = 0; a < 3; ++a) run_case(p, acts[a], (seed + uint64_t(a)) % 2 == 0, stream);
      }
    }
  }
  // llama3-8b's decode shapes in full at m = 1: qkv, gate/up, down (o is 4096 x 4096).
  if (!quick) {
    for (const auto& [n, k] :
         std::vector<std::pair<int64_t, int64_t>>{{6144, 4096}, {28672, 4096}, {4096, 14336}}) {
      const Problem p = make_problem(1, n, k, Fp8Format::e4m3fn, ++seed, false);
      run_case(p, Fp8Act::none, true, stream);
      run_case(p, Fp8Act::dynamic_token, false, stream);
    }
  }
  KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
  return gpu_test::tally().report("test_gemv_fp8_gpu");
}
