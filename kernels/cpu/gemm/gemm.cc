// The CPU GEMM (gemm.h): weight packing, the choice of kernel, the scalar kernel, and the
// Linear wrappers. The scalar kernel runs the same tiles with one lane and fmaf, so it
// computes the same chains as the vector kernels, bit for bit.
#include "kernels/cpu/gemm/gemm.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/common/enum_name.h"
#include "kernels/cpu/gemm/gemm_tiles.h"
#include "kernels/cpu/ops/ops.h"

namespace kvfuse::cpu {
namespace {

struct Scalar {
  using reg = float;
  static constexpr int kLanes = 1;
  static constexpr int kMaxRows = 2;
  static constexpr int kMaxAcc = 32;
  static reg zero() { return 0.0f; }
  static reg load(const float* p) { return *p; }
  static void store(float* p, reg r) { *p = r; }
  static reg set1(float x) { return x; }
  static reg load_w(const uint16_t* p) { return kvfuse::bf16_to_f32(*p); }
  // Rounded once, as the vector FMA instructions do (a libm call without hardware FMA).
  static reg fma(reg a, reg b, reg c) { return __builtin_fmaf(a, b, c); }
};

int64_t panels_of(int64_t n) { return (n + kGemmPanel - 1) / kGemmPanel; }

#if defined(__x86_64__)
bool cpu_has(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::avx512:
      return __builtin_cpu_supports("avx512f");
    case GemmIsa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case GemmIsa::generic:
      return true;
  }
  return false;
}
#else
bool cpu_has(GemmIsa isa) { return isa == GemmIsa::generic; }
#endif

}  // namespace

const char* gemm_isa_name(GemmIsa isa) { return enum_name(isa, {"generic", "avx2", "avx512"}); }

bool gemm_isa_supported(GemmIsa isa) { return cpu_has(isa); }

GemmIsa gemm_widest_isa() {
  for (GemmIsa i : {GemmIsa::avx512, GemmIsa::avx2}) {
    if (cpu_has(i)) return i;
  }
  return GemmIsa::generic;
}

bool gemm_isa_from_env(GemmIsa& isa, std::string& error) {
  // A switch of the registry (src/loading/env_switches.h), read with getenv here:
  // kernels/ never includes src/.
  const char* want = std::getenv("KVFUSE_CPU_GEMM");
  if (want == nullptr || *want == '\0') {
    isa = gemm_widest_isa();
    return true;
  }
  for (GemmIsa i : {GemmIsa::avx512, GemmIsa::avx2, GemmIsa::generic}) {
    if (std::strcmp(want, gemm_isa_name(i)) != 0) continue;
    if (!cpu_has(i)) {
      error = std::string("KVFUSE_CPU_GEMM=") + want + ": this CPU cannot run the " + want + " kernel";
      return false;
    }
    isa = i;
    return true;
  }
  error = std::string("KVFUSE_CPU_GEMM=") + want + ": unknown kernel; allowed: avx512, avx2, generic";
  return false;
}

size_t gemm_packed_elems(int64_t n, int64_t k) { return size_t(panels_of(n) * kGemmPanel * k); }


size_t gemm_wbuf_floats() { return size_t(kTileGroup * kTileKc * kTilePanel); }

bool gemm_begin(int64_t m, int64_t k, int64_t n, float* y, int64_t ldy, GemmIsa isa) {
  const int64_t panels = panels_of(n);
  if (m <= 0 || panels == 0) return false;
  if (k <= 0) {
    for (int64_t i = 0; i < m; ++i) std::memset(y + i * ldy, 0, size_t(panels * kGemmPanel) * sizeof(float));
    return false;
  }
  if (!cpu_has(isa)) {
    fprintf(stderr, "kvfuse cpu gemm: the %s kernel does not run on this CPU\n", gemm_isa_name(isa));
    abort();
  }
  return true;
}

void gemm_f32(const float* x, int64_t m, int64_t k, const bf16_t* packed, int64_t n, float* y, int64_t ldy,
              GemmIsa isa, float* wbuf) {
  if (!gemm_begin(m, k, n, y, ldy, isa)) return;
  const int64_t panels = panels_of(n);
  switch (isa) {
#if defined(__x86_64__)
    case GemmIsa::avx512:
      return gemm_f32_avx512(x, m, k, packed, panels, y, ldy, wbuf);
    case GemmIsa::avx2:
      return gemm_f32_avx2(x, m, k, packed, panels, y, ldy, wbuf);
#endif
    default:
      return gemm_tiles<Scalar>(x, m, k, packed, panels, y, ldy, wbuf);
  }
}

void gemm_block_f32w(const float* x, int64_t m, int64_t lda, const float* w, int64_t panel_stride,
                     int64_t panels, int64_t kc, float* y, int64_t ldy, bool first, GemmIsa isa) {
  if (m <= 0 || panels <= 0 || kc <= 0) return;
  if (!cpu_has(isa)) {
    fprintf(stderr, "kvfuse cpu gemm: the %s kernel does not run on this CPU\n", gemm_isa_name(isa));
    abort();
  }
  switch (isa) {
#if defined(__x86_64__)
    case GemmIsa::avx512:
      return gemm_block_f32w_avx512(x, m, lda, w, panel_stride, panels, kc, y, ldy, first);
    case GemmIsa::avx2:
      return gemm_block_f32w_avx2(x, m, lda, w, panel_stride, panels, kc, y, ldy, first);
#endif
    default:
      return block_rows<Scalar>(x, m, lda, w, panel_stride, panels, kc, y, ldy, first);
  }
}

size_t gemm_scratch_floats(int64_t m, int64_t k, int64_t n) {
  return size_t(m * k + m * panels_of(n) * kGemmPanel) + gemm_wbuf_floats();
}

namespace {

// Widens x into scratch and runs the GEMM into the rest of it (row stride = padded n).
float* gemm_into_scratch(const bf16_t* x, int64_t m, int64_t k, const bf16_t* packed, int64_t n,
                         float* scratch, GemmIsa isa) {
  float* xs = scratch;
  float* y = scratch + m * k;
  float* wbuf = y + m * panels_of(n) * kGemmPanel;
  bf16_to_f32(x, m * k, xs);
  gemm_f32(xs, m, k, packed, n, y, panels_of(n) * kGemmPanel, isa, wbuf);
  return y;
}

}  // namespace

void linear_bf16(const bf16_t* x, int64_t m, int64_t k, const bf16_t* packed, int64_t n, const float* bias,
                 bf16_t* out, float* scratch, GemmIsa isa) {
  if (m <= 0 || n <= 0) return;
  const float* y = gemm_into_scratch(x, m, k, packed, n, scratch, isa);
  const int64_t ldy = panels_of(n) * kGemmPanel;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float v = y[i * ldy + j];
      out[i * n + j] = kvfuse::f32_to_bf16(bias != nullptr ? v + bias[j] : v);
    }
}

void linear_f32_out(const bf16_t* x, int64_t m, int64_t k, const bf16_t* packed, int64_t n, float* out,
                    float* scratch, GemmIsa isa) {
  if (m <= 0 || n <= 0) return;
  const float* y = gemm_into_scratch(x, m, k, packed, n, scratch, isa);
  const int64_t ldy = panels_of(n) * kGemmPanel;
  for (int64_t i = 0; i < m; ++i) std::memcpy(out + i * n, y + i * ldy, size_t(n) * sizeof(float));
}

}  // namespace kvfuse::cpu
