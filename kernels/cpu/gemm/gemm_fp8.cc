// The CPU FP8-weight GEMM (gemm_fp8.h): packing, activation quantization, and the driver
// that dequantizes one (k block x panel group) of weights at a time into fp32 and hands
// it to gemm_block_f32w (gemm.cc and its per-ISA files). The dequantization is scalar
// code in this file, the same for every ISA, so the tiles of every ISA see the same fp32
// weights and compute the same chains.
#include "kernels/cpu/gemm/gemm_fp8.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/ops/ops.h"

namespace kvfuse::cpu {
namespace {

// The k block and panel group of one dequantized weight block (gemm_fp8_wbuf_floats()
// floats). They set only which chains run together, never the order within one.
constexpr int64_t kKc = 256;
constexpr int64_t kGroup = 6;

int64_t panels_of(int64_t n) { return (n + kGemmPanel - 1) / kGemmPanel; }

// fp8_decode of every code of one format, built once. Exact, so a lookup is the decode.
struct DecodeTables {
  float t[3][256];
  DecodeTables() {
    const Fp8Format fmts[3] = {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz, Fp8Format::e5m2};
    for (int f = 0; f < 3; ++f)
      for (int c = 0; c < 256; ++c) t[f][c] = fp8_decode(uint8_t(c), fmts[f]);
  }
};

const float* decode_table(Fp8Format f) {
  static const DecodeTables tables;
  switch (f) {
    case Fp8Format::e4m3fnuz:
      return tables.t[1];
    case Fp8Format::e5m2:
      return tables.t[2];
    case Fp8Format::e4m3fn:
    default:
      return tables.t[0];
  }
}

[[noreturn]] void fail(const char* what) {
  fprintf(stderr, "kvfuse cpu fp8 gemm: %s\n", what);
  abort();
}

// wd of panels [jp, jp + gp) and k steps [pc, pc + kc) into wbuf, in the packed layout
// with kc * kGemmPanel floats between panels. Columns past n get scale 0 (their bytes
// are 0, so their weights are +0 either way).
void dequantize_block(const Fp8Weight& w, int64_t n, int64_t k, int64_t jp, int64_t gp, int64_t pc,
                      int64_t kc, const float* table, float* wbuf) {
  for (int64_t p = 0; p < gp; ++p) {
    float sc[kGemmPanel];
    for (int64_t c = 0; c < kGemmPanel; ++c) {
      const int64_t col = (jp + p) * kGemmPanel + c;
      sc[c] = col < n ? w.scale[col] : 0.0f;
    }
    const uint8_t* src = w.packed + ((jp + p) * k + pc) * kGemmPanel;
    float* dst = wbuf + p * kc * kGemmPanel;
    for (int64_t e = 0; e < kc; ++e, src += kGemmPanel, dst += kGemmPanel)
      for (int64_t c = 0; c < kGemmPanel; ++c) dst[c] = table[src[c]] * sc[c];
  }
}

// fp8_encode(x * inv) of a bf16 row, with the format a constant of each instance so that
// the encoder's per-format fields fold away (a 70B preset's synthetic weights are 70e9 of
// these, src/loading/host_weights.cc).
template <Fp8Format F>
void encode_row(const bf16_t* row, int64_t k, float inv, uint8_t* out) {
  for (int64_t p = 0; p < k; ++p) out[p] = fp8_encode(kvfuse::bf16_to_f32(row[p]) * inv, F);
}

void encode_row(const bf16_t* row, int64_t k, float inv, Fp8Format f, uint8_t* out) {
  switch (f) {
    case Fp8Format::e4m3fnuz:
      return encode_row<Fp8Format::e4m3fnuz>(row, k, inv, out);
    case Fp8Format::e5m2:
      return encode_row<Fp8Format::e5m2>(row, k, inv, out);
    case Fp8Format::e4m3fn:
    default:
      return encode_row<Fp8Format::e4m3fn>(row, k, inv, out);
  }
}

}  // namespace

size_t gemm_packed_fp8_bytes(int64_t n, int64_t k) { return gemm_packed_elems(n, k); }

void gemm_pack_weight_fp8(const uint8_t* w, int64_t n, int64_t k, uint8_t* packed) {
  gemm_pack_panels(w, n, k, packed);
}

void quantize_rows_fp8(const bf16_t* x, int64_t m, int64_t k, Fp8Act act, float static_scale,
                       Fp8Format act_fmt, uint8_t* q, float* scales) {
  if (act == Fp8Act::none) fail("quantize_rows_fp8 called with Fp8Act::none");
  if (act == Fp8Act::static_tensor && !(static_scale > 0.0f && std::isfinite(static_scale)))
    fail("the static activation scale must be finite and > 0");
  const float fmax = fp8_max_finite(act_fmt);
  for (int64_t i = 0; i < m; ++i) {
    const bf16_t* row = x + i * k;
    float s = static_scale;
    if (act == Fp8Act::dynamic_token) {
      float amax = 0.0f;
      for (int64_t p = 0; p < k; ++p) {
        const float a = std::fabs(kvfuse::bf16_to_f32(row[p]));
        if (a > amax) amax = a;  // NaN compares false: skipped
      }
      const float r = amax / fmax;
      s = r > kFp8MinActScale ? r : kFp8MinActScale;
    }
    scales[i] = s;
    encode_row(row, k, 1.0f / s, act_fmt, q + i * k);
  }
}

void gemm_fp8_f32(const float* x, int64_t m, int64_t k, const Fp8Weight& w, int64_t n, float* y, int64_t ldy,
                  GemmIsa isa, float* wbuf) {
  if (!gemm_begin(m, k, n, y, ldy, isa)) return;
  const int64_t panels = panels_of(n);
  if (wbuf == nullptr) fail("gemm_fp8_f32 needs wbuf");
  const float* table = decode_table(w.fmt);
  for (int64_t pc = 0; pc < k; pc += kKc) {
    const int64_t kc = k - pc < kKc ? k - pc : kKc;
    for (int64_t jp = 0; jp < panels; jp += kGroup) {
      const int64_t gp = panels - jp < kGroup ? panels - jp : kGroup;
      dequantize_block(w, n, k, jp, gp, pc, kc, table, wbuf);
      gemm_block_f32w(x + pc, m, k, wbuf, kc * kGemmPanel, gp, kc, y + jp * kGemmPanel, ldy, pc == 0, isa);
    }
  }
}

size_t gemm_fp8_wbuf_floats() { return size_t(kGroup * kKc * kGemmPanel); }

size_t gemm_fp8_scratch_floats(int64_t m, int64_t k, int64_t n) {
  // xd [m, k], y [m, padded n], the weight block, the row scales [m], the codes (m * k
  // bytes, rounded up to floats).
  return size_t(m * k + m * panels_of(n) * kGemmPanel + m + (m * k + 3) / 4) + gemm_fp8_wbuf_floats();
}

namespace {

// xd into scratch (widened, or quantized and dequantized), then the GEMM into the rest
// of it (row stride = padded n). Returns y.
float* fp8_gemm_into_scratch(const bf16_t* x, int64_t m, int64_t k, const Fp8Weight& w, int64_t n,
                             const Fp8ActQuant& aq, float* scratch, GemmIsa isa) {
  const int64_t ldy = panels_of(n) * kGemmPanel;
  float* xd = scratch;
  float* y = xd + m * k;
  float* wbuf = y + m * ldy;
  float* row_scales = wbuf + gemm_fp8_wbuf_floats();
  uint8_t* q = reinterpret_cast<uint8_t*>(row_scales + m);
  if (aq.act == Fp8Act::none) {
    bf16_to_f32(x, m * k, xd);
  } else {
    quantize_rows_fp8(x, m, k, aq.act, aq.static_scale, aq.fmt, q, row_scales);
    const float* table = decode_table(aq.fmt);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < k; ++p) xd[i * k + p] = table[q[i * k + p]] * row_scales[i];
  }
  gemm_fp8_f32(xd, m, k, w, n, y, ldy, isa, wbuf);
  return y;
}

}  // namespace

void linear_fp8_bf16(const bf16_t* x, int64_t m, int64_t k, const Fp8Weight& w, int64_t n,
                     const Fp8ActQuant& aq, const float* bias, bf16_t* out, float* scratch, GemmIsa isa) {
  if (m <= 0 || n <= 0) return;
  const float* y = fp8_gemm_into_scratch(x, m, k, w, n, aq, scratch, isa);
  const int64_t ldy = panels_of(n) * kGemmPanel;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float v = y[i * ldy + j];
      out[i * n + j] = kvfuse::f32_to_bf16(bias != nullptr ? v + bias[j] : v);
    }
}

void linear_fp8_f32_out(const bf16_t* x, int64_t m, int64_t k, const Fp8Weight& w, int64_t n,
                        const Fp8ActQuant& aq, float* out, float* scratch, GemmIsa isa) {
  if (m <= 0 || n <= 0) return;
  const float* y = fp8_gemm_into_scratch(x, m, k, w, n, aq, scratch, isa);
  const int64_t ldy = panels_of(n) * kGemmPanel;
  for (int64_t i = 0; i < m; ++i) std::memcpy(out + i * n, y + i * ldy, size_t(n) * sizeof(float));
}

}  // namespace kvfuse::cpu
