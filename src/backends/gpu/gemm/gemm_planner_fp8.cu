// The GEMM planner's FP8-weight family (gemm_planner.h, gemm_fp8): which kernel runs a
// shape, chosen as the bf16 family's choices are (gemm_tuning.h: timed in a graph over its
// candidates, kept for the process and in the GEMM cache file), and running it.
//
// Candidates:
// - kvfuse's FP8 GEMV (kernels/gemm/gemv_fp8.cuh), each tiling, for m <= gpu::kGemvMaxRows;
//   for W8A8 it quantizes the activations itself as it reads them (no launch of its own;
//   KVFUSE_GEMV_FP8_QUANT=0: launch_quantize_rows_fp8 first, for the A/B);
// - W8A8 only: launch_quantize_rows_fp8, the library's FP8 GEMM (e4m3 x e4m3, fp32 sums,
//   no scales: the library's scale modes are per tensor, a checkpoint's weight scales per
//   channel), then gpu::launch_fp8_gemm_epilogue, which applies the row and channel scales
//   and the bias. Each candidate is timed with its quantizing launch.
// A W8A16 shape of more rows runs the GEMV over groups of kGemvMaxRows rows (the weights
// read once a group): no library GEMM takes bf16 activations with FP8 weights.
#include "src/backends/gpu/gemm/gemm_planner.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"
#include "src/loading/env_switches.h"

namespace kvfuse {
namespace {

using gemm::GemmChoice;
using gemm::GemmKey;
using gemm::TuneMode;

constexpr const char* kGemvFp8Kernel = "kvfuse-gemv-fp8/";

bool w8a8(const LinearWeight& w) { return w.act != Fp8Act::none; }

}  // namespace

gpu::Fp8GemvAct GemmPlanner::gemv_fp8_act(const LinearWeight& w, const Fp8Scratch& scratch) {
  gpu::Fp8GemvAct a{w.act, nullptr, nullptr, w.fp8_format, w.act_scale.get() ? w.act_scale.as<float>() : nullptr};
  if (w8a8(w) && scratch.given) {
    a.xq = scratch.xq;
    a.x_scale = scratch.x_scale;
  }
  return a;
}

// Whether the FP8 GEMV quantizes W8A8 activations itself (KVFUSE_GEMV_FP8_QUANT, default
// on), or a quantizing kernel runs first and the GEMV reads its codes (the A/B).
bool GemmPlanner::gemv_fp8_quantizes() {
  static const bool on = env_flag("KVFUSE_GEMV_FP8_QUANT");
  return on;
}

// One call of a plan on the weights at `wd` (w's own, or the tuner's copy of them): the
// GEMV (one launch per kGemvMaxRows rows, `gemv` the variant where it applies to the
// group's rows), or the quantizing kernel, the library's `algo` and the epilogue.
absl::Status GemmPlanner::run_fp8(const Plan& plan, const blasLtMatmulAlgo_t* algo, int gemv, const Fp8Call& c,
                                  const void* wd) const {
  const LinearWeight& w = c.w;
  const bool f32 = c.out_kind == GemmOut::f32;
  const float* w_scale = w.scale.as<float>();
  const gpu::Fp8GemvAct own = gemv_fp8_act(w, c.scratch);
  // The activations' codes in scratch: given by the kernel before, or quantized here for the
  // library or for a GEMV that reads codes.
  const bool codes = w8a8(w) && (c.scratch.given || algo != nullptr || !gemv_fp8_quantizes());
  if (codes && !c.scratch.given) {
    KVFUSE_RETURN_IF_ERROR(gpu_status(gpu::launch_quantize_rows_fp8(c.x, c.m, w.k, w.act, own.static_scale, w.fp8_format,
                                                                    c.scratch.xq, c.scratch.x_scale, stream_, ops_pdl_),
                                      "quantize_rows_fp8"));
  }
  if (algo == nullptr) {
    const size_t out_elem = f32 ? sizeof(float) : sizeof(bf16_t);
    for (int64_t i0 = 0; i0 < c.m; i0 += gpu::kGemvMaxRows) {
      const int64_t rows = std::min<int64_t>(gpu::kGemvMaxRows, c.m - i0);
      gpu::Fp8GemvAct a = own;
      if (codes) {
        a.xq = c.scratch.xq + i0 * w.k;
        a.x_scale = c.scratch.x_scale + i0;
      }
      const int variant = gemv >= 0 && gemv < gpu::gemv_variants(rows) ? gemv : 0;
      KVFUSE_RETURN_IF_ERROR(
          gpu_status(gpu::launch_gemv_fp8(c.x + i0 * w.k, rows, static_cast<const uint8_t*>(wd), w_scale,
                                          w.fp8_format, w.n, w.k, c.bias,
                                          static_cast<char*>(c.out) + size_t(i0 * w.n) * out_elem, f32, a, stream_,
                                          ops_pdl_, variant),
                     "gemv fp8"));
    }
    return absl::OkStatus();
  }
  const float alpha = 1.0f, beta = 0.0f;
  KVFUSE_BLAS(blasLtMatmul(blas_, plan.desc, &alpha, wd, plan.a, c.scratch.xq, plan.b, &beta, c.scratch.sums, plan.d,
                           c.scratch.sums, plan.d, algo, blas_workspace_.get(), blas_workspace_.bytes(), stream_));
  return gpu_status(gpu::launch_fp8_gemm_epilogue(c.scratch.sums, c.m, w.n, c.scratch.x_scale, w_scale, c.bias, c.out,
                                                  f32, stream_, ops_pdl_),
                    "fp8 gemm epilogue");
}

absl::StatusOr<GemmPlanner::Plan*> GemmPlanner::plan_fp8_of(const Fp8Call& c, bool capturing) {
  const LinearWeight& w = c.w;
  const int64_t m = c.m;
  const bool q = w8a8(w);
  const bool given = q && c.scratch.given;
  const gemm::GemmFamily family = !q     ? gemm::GemmFamily::fp8_w8a16
                                  : given ? gemm::GemmFamily::fp8_w8a8_codes
                                          : gemm::GemmFamily::fp8_w8a8;
  const GemmKey key{family, m, w.n, w.k, c.out_kind};
  if (auto found = plans_.find(key); found != plans_.end()) return found->second.get();
  auto plan = std::make_unique<Plan>();
  const bool gemv_ok = gemv_enabled() && gpu::gemv_fp8_unsupported(c.x, m, w.w.as<uint8_t>(), w.scale.as<float>(),
                                                                   w.fp8_format, w.n, w.k, c.out, gemv_fp8_act(w, c.scratch))
                                             .empty();
  // The library's FP8 GEMM (W8A8): e4m3 operands, fp32 sums.
  int found_n = 0;
  blasLtMatmulHeuristicResult_t heur[gemm::kTuneCandidates] = {};
  const TuneMode mode = capturing || m > gemm::kTuneMaxRows ? TuneMode::off : gemm::tune_mode();
  const bool may_time = mode != TuneMode::off && !tuning_ended_.load(std::memory_order_relaxed);
  if (q) {
    KVFUSE_RETURN_IF_ERROR(
        describe(*plan, blas_fp8_e4m3(w.fp8_format == Fp8Format::e4m3fnuz), BLAS_R_32F, m, w));
    // No algorithm (a library or device without FP8 GEMMs) leaves the GEMV.
    if (!heuristic(*plan, may_time ? gemm::kTuneCandidates : 1, heur, found_n).ok()) found_n = 0;
  }
  // Untimed: the GEMV where it applies (W8A16 always runs it), else the library's first choice.
  plan->gemv = gemv_ok || found_n == 0 ? 0 : -1;
  if (found_n > 0) plan->algo = heur[0].algo;
  // The plan as it stands, for this backend (settle), or also for the process (keep).
  const auto settle = [&] { return plans_.emplace(key, std::move(plan)).first->second.get(); };
  const auto keep = [&] {
    gemm::TunedChoices::keep(device_, key, *plan);
    return settle();
  };
  if (mode == TuneMode::off) return settle();
  if (const auto tuned = gemm::TunedChoices::find(device_, key)) {
    static_cast<GemmChoice&>(*plan) = *tuned;
    return settle();
  }
  // Choices made with the GEMV quantizing its activations kept apart from those made without,
  // and from those whose codes come from the kernel before.
  const char* name = !q                   ? " fp8-w8a16"
                     : given              ? " fp8-w8a8 codes"
                     : gemv_fp8_quantizes() ? " fp8-w8a8"
                                            : " fp8-w8a8 quantize-first";
  const GemmCacheKey ck{absl::StrCat(algo_device_, name), m, w.n, w.k, c.out_kind == GemmOut::f32 ? "f32" : "bf16"};
  if (auto cached = gemm::algo_cache().find(ck)) {
    const int v = gemm::kernel_variant_of(cached->kernel, kGemvFp8Kernel, gpu::gemv_variants(m));
    if (v >= 0 && gemv_ok) {
      plan->gemv = v;
      return keep();
    }
    if (cached->kernel.empty() && cached->algo.size() == sizeof(blasLtMatmulAlgo_t) && found_n > 0) {
      std::memcpy(&plan->algo, cached->algo.data(), sizeof(blasLtMatmulAlgo_t));
      // It must run here (the file could come from another build of the same version).
      if (run_fp8(*plan, &plan->algo, -1, c, w.w.get()).ok()) {
        plan->gemv = -1;
        return keep();
      }
      (void)cudaGetLastError();
      plan->algo = heur[0].algo;
    }
  }
  const int gemv_n = gemv_ok ? gpu::gemv_variants(m) : 0;
  if (!may_time || gemv_n + found_n <= 1) return settle();

  // Time every candidate: the GEMV's variants, then the library's.
  KVFUSE_RETURN_IF_ERROR(timer_.begin(w, mode));
  const auto time = [&](const blasLtMatmulAlgo_t* algo, int gemv) {
    const auto call = [&](const void* wd) {
      return run_fp8(*plan, algo, gemv, c, wd).ok();
    };
    return mode == TuneMode::graph ? timer_.in_graph(call) : timer_.isolated([&] { return call(w.w.get()); });
  };
  std::vector<float> ms;
  for (int v = 0; v < gemv_n; ++v) ms.push_back(time(nullptr, v));
  for (int c = 0; c < found_n; ++c) ms.push_back(time(&heur[c].algo, -1));
  KVFUSE_RETURN_IF_ERROR(timer_.end());
  shapes_timed_.fetch_add(1, std::memory_order_relaxed);
  int best = -1;
  for (int c = 0; c < int(ms.size()); ++c) {
    if (ms[size_t(c)] >= 0 && (best < 0 || ms[size_t(c)] < ms[size_t(best)])) best = c;
  }
  if (best < 0) return absl::InternalError(absl::StrCat("fp8 gemm ", m, "x", w.n, "x", w.k, ": no candidate ran"));
  GemmCacheEntry e;
  if (best < gemv_n) {
    plan->gemv = best;
    e.kernel = kGemvFp8Kernel + std::to_string(best);
  } else {
    plan->gemv = -1;
    plan->algo = heur[best - gemv_n].algo;
    e.algo.resize(sizeof(blasLtMatmulAlgo_t));
    std::memcpy(e.algo.data(), &plan->algo, sizeof(blasLtMatmulAlgo_t));
  }
  if (gemm::tune_log()) {
    std::fprintf(stderr, "kvfuse gemm tune (%s) fp8 %s %lldx%lldx%lld %s: %d gemv variants, %d library: %s %.4f ms\n",
                 gemm::tune_mode_name(mode), q ? "w8a8" : "w8a16", (long long)m, (long long)w.n, (long long)w.k,
                 c.out_kind == GemmOut::f32 ? "f32" : "bf16", gemv_n, found_n,
                 best < gemv_n ? "gemv" : "library", double(ms[size_t(best)]));
  }
  e.us = double(ms[size_t(best)]) * 1e3;
  e.method = gemm::tune_mode_name(mode);
  if (mode == TuneMode::graph && gemv_enabled()) store_choice(ck, e);
  return keep();
}

absl::Status GemmPlanner::gemm_fp8(const bf16_t* x, int64_t m, const LinearWeight& w, const float* bias,
                                   const Fp8Scratch& scratch, void* out, GemmOut out_type, bool capturing) {
  if (m <= 0) return absl::OkStatus();
  if (!w.fp8) return absl::InvalidArgumentError("gemm_fp8: the weight is not FP8");
  const Fp8Call c{x, m, w, bias, scratch, out, out_type};
  auto planned = plan_fp8_of(c, capturing);
  if (!planned.ok()) return planned.status();
  const Plan& p = **planned;
  return run_fp8(p, p.gemv >= 0 ? nullptr : &p.algo, p.gemv, c, w.w.get());
}

absl::StatusOr<int> GemmPlanner::gemv_fp8_variant(const bf16_t* x, int64_t m, const LinearWeight& w,
                                                  const float* bias, const Fp8Scratch& scratch, void* out,
                                                  bool capturing) {
  if (m <= 0 || m > gpu::kGemvMaxRows || !w.fp8 || (w8a8(w) && !gemv_fp8_quantizes() && !scratch.given)) return -1;
  auto planned = plan_fp8_of(Fp8Call{x, m, w, bias, scratch, out, GemmOut::bf16}, capturing);
  if (!planned.ok()) return planned.status();
  return (*planned)->gemv;
}

}  // namespace kvfuse
