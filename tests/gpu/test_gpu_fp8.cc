// FP8 weights on the GPU backend against the CPU backend: the projections op by op (every
// activation scheme, row counts through the GEMV's and past it, with and without a bias,
// bf16 and fp32 out), the norms that quantize for the projection after them, then the
// engine on FP8 models (the tiny-fp8 preset, and W8A16 and
// static W8A8 checkpoints), in and out of graphs. Skips (and says so) in a build without a
// GPU backend or on a machine without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "kernels/common/fp8.h"
#include "src/backends/backend.h"
#include "src/backends/cpu/cpu_backend.h"
#include "src/loading/model_spec.h"
#include "tests/util/catch.h"
#include "tests/util/checkpoint_fp8_util.h"
#include "tests/util/engine_agreement.h"
#include "tests/util/engine_test_util.h"
#include "tests/util/gpu_backend.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using nlohmann::json;

namespace {

// Random e4m3fn codes, no NaN (0x7f, 0xff), and per-row scales around 1 / 64.
struct Fp8Weight {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
Fp8Weight random_fp8(int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  Fp8Weight w;
  w.codes.resize(size_t(n * k));
  for (auto& c : w.codes) {
    do c = uint8_t(rng() & 0xff);
    while ((c & 0x7f) == 0x7f);
  }
  std::uniform_real_distribution<float> s(0.5f / 64, 2.0f / 64);
  w.scales.resize(size_t(n));
  for (auto& x : w.scales) x = s(rng) / 16;  // codes reach 448: keep the sums near 1
  return w;
}

std::vector<bf16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(dist(rng));
  return v;
}

const char* act_name(Fp8Act a) {
  return a == Fp8Act::none ? "W8A16" : a == Fp8Act::static_tensor ? "W8A8 static" : "W8A8 dynamic";
}

}  // namespace

// Tolerance. Both backends decode the same codes (W8A8: the activations' codes are the
// same bytes, one encoder) and multiply exactly; they differ in the order of the fp32 sums
// and, where the library's FP8 GEMM runs (W8A8 past the GEMV's rows), in its accumulator,
// whose partial sums on sm_90 tensor cores keep fewer bits before they are promoted to
// fp32. Bound: |gpu - cpu| <= 2^-12 * sum |terms| (the terms' magnitudes, scales applied)
// + 1e-6, and one bf16 ulp more for bf16 out. linear_logits leaves the bias out on every
// backend (an lm_head has none), so with a bias the two outputs differ by it.
TEST_CASE("gpu fp8: FP8 projections match the CPU backend within the fp32 sums' order", "[gpu][fp8][gemm]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  auto cpu = make_cpu_backend();
  const int64_t k = 512, n = 336;
  const Fp8Weight w = random_fp8(n, k, 40);
  const auto bias = random_bf16(size_t(n), 41);
  for (Fp8Act act : {Fp8Act::none, Fp8Act::static_tensor, Fp8Act::dynamic_token}) {
    for (int64_t m : {1, 3, 8, 9, 40}) {
      for (bool with_bias : {false, true}) {
        CAPTURE(act_name(act), m, with_bias);
        const auto x = random_bf16(size_t(m * k), uint32_t(42 + m));
        const float input_scale = 4.0f / 448.0f;  // |x| up to 4 in range
        std::vector<bf16_t> out[2];
        std::vector<float> logits[2];
        int i = 0;
        for (Backend* b : {cpu.get(), gpu.get()}) {
          auto lw = b->upload_linear_fp8(Fp8LinearHost{w.codes.data(), w.scales.data(), act, input_scale}, n, k,
                                         with_bias ? bias.data() : nullptr);
          REQUIRE(lw.ok());
          LinearOutputs r = linear_outputs(*b, *lw, x, m);
          out[i] = std::move(r.out);
          logits[i] = std::move(r.logits);
          ++i;
        }
        // sum |terms| of each output: |x| (or its dequantized code, within one FP8 step)
        // times |decoded weight| times the scale, bounded above by the bf16 activations'
        // magnitudes times 1.07 (an e4m3 step is at most 1/16 of the value, plus saturation
        // of the static scale's range, which only shrinks terms).
        size_t bad_out = 0, bad_logit = 0;
        float worst = 0;
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t j = 0; j < n; ++j) {
            double mag = 0;
            for (int64_t p = 0; p < k; ++p) {
              mag += std::fabs(double(bf16_to_f32(x[size_t(r * k + p)]))) *
                     std::fabs(double(fp8_decode(w.codes[size_t(j * k + p)], Fp8Format::e4m3fn)));
            }
            const float tol = float(1.07 * mag * w.scales[size_t(j)] * std::ldexp(1.0, -12)) + 1e-6f;
            const size_t at = size_t(r * n + j);
            const float d = std::fabs(logits[0][at] - logits[1][at]);
            worst = std::max(worst, d);
            bad_logit += !(d <= tol);
            const float a = bf16_to_f32(out[0][at]), c = bf16_to_f32(out[1][at]);
            bad_out += !(std::fabs(a - c) <= tol + std::ldexp(std::max(std::fabs(a), std::fabs(c)), -7));
          }
        }
        INFO("max |logit difference| " << worst << "; outside the bound: " << bad_logit << " fp32, " << bad_out
                                       << " bf16 of " << m * n);
        CHECK(bad_logit == 0);
        CHECK(bad_out == 0);
      }
    }
  }
}

// The fused projections' defaults (linear_silu_mul, linear_push's fallback) run linear on
// FP8 weights: act equals linear then silu_mul on the same backend, bit for bit.
TEST_CASE("gpu fp8: linear_silu_mul on FP8 weights gives linear then silu_mul's bits", "[gpu][fp8][gemm]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  const int64_t k = 256, inter = 272, n = 2 * inter;
  const Fp8Weight w = random_fp8(n, k, 50);
  for (int64_t m : {1, 8, 24}) {
    CAPTURE(m);
    const auto x = random_bf16(size_t(m * k), 51);
    auto lw = gpu->upload_linear_fp8(Fp8LinearHost{w.codes.data(), w.scales.data(), Fp8Act::dynamic_token, 0.0f},
                                     n, k, nullptr);
    REQUIRE(lw.ok());
    Mirror<bf16_t> in(*gpu, x), gu(*gpu, size_t(m * n)), act(*gpu, size_t(m * inter)), ref(*gpu, size_t(m * inter));
    REQUIRE(gpu->linear_silu_mul(in.ptr(), m, *lw, inter, gu.ptr(), act.ptr()).ok());
    REQUIRE(gpu->linear(in.ptr(), m, *lw, gu.ptr()).ok());
    REQUIRE(gpu->silu_mul(gu.ptr(), m, inter, ref.ptr()).ok());
    CHECK(act.read(*gpu) == ref.read(*gpu));
  }
}

// The norms that quantize their output for the W8A8 projection after them (norm_to_fp8,
// then linear_from_fp8 / linear_silu_mul_from_fp8: Model::forward's path to QKV and
// gate/up) against the plain norm, then linear / linear_silu_mul on its bf16 output: the
// same bits, the residual and the norm's output included; through the GEMV (1 and 8 rows)
// and past it (40 rows: the library's FP8 GEMM on the given codes); static and dynamic
// scales; rmsnorm and add_rmsnorm.
TEST_CASE("gpu fp8: the norm's FP8 codes give the projection the bits of the unfused path", "[gpu][fp8][gemm]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  const int64_t k = 512, inter = 176, n = 2 * inter;
  const Fp8Weight w = random_fp8(n, k, 70);
  const auto norm_w = random_bf16(size_t(k), 71);
  for (Fp8Act act : {Fp8Act::static_tensor, Fp8Act::dynamic_token}) {
    auto lw = gpu->upload_linear_fp8(Fp8LinearHost{w.codes.data(), w.scales.data(), act, 3.0f / 448.0f}, n, k,
                                     nullptr);
    REQUIRE(lw.ok());
    for (int64_t m : {1, 8, 40}) {
      for (bool add : {false, true}) {
        CAPTURE(act_name(act), m, add);
        const auto x = random_bf16(size_t(m * k), uint32_t(72 + m));
        const auto y = random_bf16(size_t(m * k), uint32_t(73 + m));
        Mirror<bf16_t> nw(*gpu, norm_w);
        Mirror<bf16_t> x1(*gpu, x), y1(*gpu, y), x2(*gpu, x), y2(*gpu, y);
        Mirror<bf16_t> o1(*gpu, size_t(m * n)), o2(*gpu, size_t(m * n));
        Mirror<bf16_t> gu(*gpu, size_t(m * n)), a1(*gpu, size_t(m * inter)), a2(*gpu, size_t(m * inter));
        // Fused: the norm writes y (the model's h) and its codes.
        auto acts = gpu->norm_to_fp8(x1.ptr(), add ? y1.ptr() : nullptr, nw.ptr(), m, k, 1e-5f, y1.ptr(), *lw);
        REQUIRE(acts.ok());
        CHECK(acts->given());
        REQUIRE(gpu->linear_from_fp8(y1.ptr(), *acts, m, *lw, o1.ptr()).ok());
        REQUIRE(gpu->linear_silu_mul_from_fp8(y1.ptr(), *acts, m, *lw, inter, gu.ptr(), a1.ptr()).ok());
        // Unfused.
        if (add) {
          REQUIRE(gpu->add_rmsnorm(x2.ptr(), y2.ptr(), nw.ptr(), m, k, 1e-5f, y2.ptr()).ok());
        } else {
          REQUIRE(gpu->rmsnorm(x2.ptr(), nw.ptr(), m, k, 1e-5f, y2.ptr()).ok());
        }
        REQUIRE(gpu->linear(y2.ptr(), m, *lw, o2.ptr()).ok());
        REQUIRE(gpu->linear_silu_mul(y2.ptr(), m, *lw, inter, gu.ptr(), a2.ptr()).ok());
        CHECK(x1.read(*gpu) == x2.read(*gpu));
        CHECK(y1.read(*gpu) == y2.read(*gpu));
        CHECK(o1.read(*gpu) == o2.read(*gpu));
        CHECK(a1.read(*gpu) == a2.read(*gpu));
      }
    }
  }
  // Not a W8A8 projection (W8A16): the plain norm, no codes.
  auto w16 = gpu->upload_linear_fp8(Fp8LinearHost{w.codes.data(), w.scales.data(), Fp8Act::none, 0.0f}, n, k,
                                    nullptr);
  REQUIRE(w16.ok());
  Mirror<bf16_t> nw(*gpu, norm_w), x(*gpu, random_bf16(size_t(k), 80)), o(*gpu, size_t(k));
  auto none = gpu->norm_to_fp8(x.ptr(), nullptr, nw.ptr(), 1, k, 1e-5f, o.ptr(), *w16);
  REQUIRE(none.ok());
  CHECK_FALSE(none->given());
}

TEST_CASE("gpu fp8: FP8 weights of an in_features the kernels do not take are refused at upload, named",
          "[gpu][fp8]") {
  auto gpu = gpu_or_skip();
  if (!gpu) return;
  const Fp8Weight w = random_fp8(32, 40, 60);
  auto lw = gpu->upload_linear_fp8(Fp8LinearHost{w.codes.data(), w.scales.data(), Fp8Act::none, 0.0f}, 32, 40,
                                   nullptr);
  REQUIRE_FALSE(lw.ok());
  CHECK_THAT(std::string(lw.status().message()), Catch::Matchers::ContainsSubstring("in_features 40"));
}

namespace {

std::unique_ptr<Engine> engine_on(json cfg, const char* device) {
  cfg["device"] = device;
  cfg["num_pages"] = 512;
  cfg["max_seq_len"] = 1024;
  cfg["max_batch_tokens"] = 1024;
  auto c = config_from_json(cfg);
  REQUIRE(c.ok());
  auto e = Engine::create(*c);
  REQUIRE(e.ok());
  return std::move(*e);
}

// The GPU engine's logits against the CPU engine's, as tests/gpu/test_gpu_engine.cc
// compares the bf16 models: teacher-forced top-1 >= 95%, and max |dlogit| < max_dlogit:
// 0.25 as there for weight-only models; 0.5 where activations are quantized, since a bf16
// rounding that differs between the backends can move an activation across an FP8
// rounding boundary, one e4m3 step (1/8 of the value's binade, where bf16's is 1/128).
// Measured on an H100 (2026-12-05): 0.07 for W8A16, 0.37 and 0.39 for W8A8.
void compare_engines(const json& cfg, const char* what, float max_dlogit) {
  auto gpu = engine_on(cfg, "auto");
  if (gpu->backend().device() == Device::cpu) {
    WARN("GPU FP8 engine tests skipped: this build has no GPU backend or no GPU is visible");
    return;
  }
  auto cpu = engine_on(cfg, "cpu");
  const auto prompt = prompt_of(300, 13, cpu->spec().vocab);
  const EngineAgreement a = engine_agreement(*cpu, *gpu, prompt, 48);
  std::printf("gpu fp8 engine %s: max |dlogit| %.4f, teacher-forced top-1 %d/%zu, greedy prefix %d/48\n", what,
              a.max_dlogit, a.top1, a.positions, a.prefix);
  CHECK(a.max_dlogit < max_dlogit);
  CHECK(a.top1 >= int(0.95 * double(a.positions)));
  CHECK(gpu->pool().usage(PoolKind::full).used_pages == 0);
}

}  // namespace

TEST_CASE("gpu fp8 engine: tiny-fp8 (W8A8, dynamic per token) matches the CPU engine, graphs on and off",
          "[gpu][fp8][engine]") {
  for (const bool graphs : {true, false}) {
    CAPTURE(graphs);
    compare_engines({{"model", "tiny-fp8"}, {"kv_cache_dtype", "fp8_e4m3"}, {"graphs", graphs ? "on" : "off"}},
                    graphs ? "tiny-fp8, graphs" : "tiny-fp8, eager", 0.5f);
  }
}

TEST_CASE("gpu fp8 engine: W8A16 and static W8A8 checkpoints match the CPU engine", "[gpu][fp8][engine]") {
  auto spec = model_preset("tiny");
  REQUIRE(spec.ok());
  json weight_only = kCtDynamic;
  weight_only["config_groups"]["group_0"]["input_activations"] = nullptr;
  json ct_static = kCtDynamic;
  ct_static["config_groups"]["group_0"]["input_activations"] = {
      {"num_bits", 8}, {"strategy", "tensor"}, {"type", "float"}, {"dynamic", false}};
  for (const bool is_static : {false, true}) {
    CAPTURE(is_static);
    TempDir dir;
    Fp8Layout layout;
    layout.quant = is_static ? ct_static : weight_only;
    if (is_static) layout.input_scale = [](const std::string&) { return 8.0f / 448.0f; };
    write_fp8(dir.path(), *spec, layout);
    compare_engines({{"model_path", dir.path()}}, is_static ? "W8A8 static checkpoint" : "W8A16 checkpoint",
                    is_static ? 0.5f : 0.25f);
  }
}
