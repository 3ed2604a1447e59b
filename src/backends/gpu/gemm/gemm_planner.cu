#include "src/backends/gpu/gemm/gemm_planner.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/gemm/gemm_skinny.cuh"
#include "kernels/gemm/gemv.cuh"
#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"
#include "src/loading/env_switches.h"

namespace kvfuse {
namespace {

using gemm::GemmChoice;
using gemm::GemmKey;
using gemm::TuneMode;

constexpr size_t kBlasWorkspace = size_t(32) << 20;

blasDataType_t blas_type(GemmOut out) { return out == GemmOut::f32 ? BLAS_R_32F : BLAS_R_16BF; }

}  // namespace

GemmPlanner::Plan::~Plan() {
  if (d) blasLtMatrixLayoutDestroy(d);
  if (b) blasLtMatrixLayoutDestroy(b);
  if (a) blasLtMatrixLayoutDestroy(a);
  if (desc) blasLtMatmulDescDestroy(desc);
}

GemmPlanner::GemmPlanner(int device, const Launch& launch, gemm::GemmTimer::Alloc alloc)
    : device_(device),
      stream_(launch.stream),
      ops_pdl_(launch.pdl),
      gemv_stream_(launch.gemv_stream),
      alloc_(std::move(alloc)),
      timer_(launch.stream, alloc_) {}

absl::StatusOr<std::unique_ptr<GemmPlanner>> GemmPlanner::create(int device, const cudaDeviceProp& prop,
                                                                 const Launch& launch,
                                                                 gemm::GemmTimer::Alloc alloc) {
  std::unique_ptr<GemmPlanner> p(new GemmPlanner(device, launch, std::move(alloc)));
  KVFUSE_RETURN_IF_ERROR(blas_status(blasLtCreate(&p->blas_), "blasLtCreate(&blas_)"));
#if defined(KVFUSE_HIP)
  p->algo_device_ =
      absl::StrCat(prop.name, " ", prop.gcnArchName, " ", KVFUSE_BLASLT_NAME, " ", blaslt_version(p->blas_));
#else
  p->algo_device_ = absl::StrCat(prop.name, " sm_", prop.major, prop.minor, " ", KVFUSE_BLASLT_NAME, " ",
                                 blaslt_version(p->blas_));
#endif
  auto ws = p->alloc_(kBlasWorkspace);
  if (!ws.ok()) return ws.status();
  p->blas_workspace_ = std::move(*ws);
  return p;
}

GemmPlanner::~GemmPlanner() {
  // The caller has synchronized the stream; teardown is best effort.
  plans_.clear();
  blas_workspace_.reset();
  if (blas_) blasLtDestroy(blas_);
}

// KVFUSE_GEMM_TUNE_WHILE_SERVING=1 keeps timing new shapes (the behaviour before the
// server ended tuning after its warm-up), for A/B runs.
bool GemmPlanner::end_tuning() {
  static const bool keep = env_flag("KVFUSE_GEMM_TUNE_WHILE_SERVING");
  if (!keep) tuning_ended_.store(true, std::memory_order_relaxed);
  return !keep;
}

// kvfuse's GEMV is a candidate for shapes of at most gpu::kGemvMaxRows rows, timed as the
// library's are, and runs where it is the fastest (KVFUSE_GEMV=0 leaves it out).
bool GemmPlanner::gemv_enabled() {
  static const bool on = env_flag("KVFUSE_GEMV");  // read once: gemm() asks on every call
  return on;
}
bool GemmPlanner::gemv_usable(const bf16_t* x, int64_t m, const LinearWeight& w, const void* out) {
  return gemv_enabled() && gpu::gemv_unsupported(x, m, w.w.get(), w.n, w.k, out).empty();
}
// kvfuse's skinny GEMM the same way (KVFUSE_GEMM_SKINNY=0 leaves it out: the A/B), for
// calls of at most KVFUSE_GEMM_SKINNY_ROWS rows (default 16, at most 64). Above 16 rows
// its calls won in the tuner's graphs and the llama3-8b step still lost 1-2% at batch 32
// on an H200, attention before it slower by about 3.5 us a layer (bench/journal/2026-12-02.md).
bool GemmPlanner::skinny_enabled() {
  static const bool on = env_flag("KVFUSE_GEMM_SKINNY");
  return on;
}
int64_t GemmPlanner::skinny_rows() {
  static const int64_t rows = [] {
    const std::optional<std::string> v = env_value("KVFUSE_GEMM_SKINNY_ROWS");
    const long long r = std::atoll(v ? v->c_str() : env_default("KVFUSE_GEMM_SKINNY_ROWS"));
    return int64_t(std::clamp<long long>(r, 0, gpu::kSkinnyMaxRows));
  }();
  return rows;
}
// Whether its first weights are read before the kernel in front of it has finished
// (KVFUSE_GEMM_SKINNY_EARLY=0: after).
bool GemmPlanner::skinny_early_weights() {
  static const bool on = env_flag("KVFUSE_GEMM_SKINNY_EARLY");
  return on;
}
bool GemmPlanner::skinny_usable(const bf16_t* x, int64_t m, const LinearWeight& w, const void* out,
                                int variant) {
  return skinny_enabled() && m <= skinny_rows() &&
         gpu::skinny_unsupported(x, m, w.w.get(), w.n, w.k, out, variant).empty();
}

GemmKey GemmPlanner::key_of(int64_t m, const LinearWeight& w, GemmOut out) const {
  return GemmKey{gemm::GemmFamily::bf16, m, w.n, w.k, out};
}

// Choices made with the skinny GEMM among the candidates are kept apart from those made
// without it (KVFUSE_GEMM_SKINNY=0, m above KVFUSE_GEMM_SKINNY_ROWS, or a file written
// before it existed), so raising KVFUSE_GEMM_SKINNY_ROWS tunes the newly offered shapes.
GemmCacheKey GemmPlanner::cache_key(const GemmKey& k) const {
  const bool skinny = skinny_enabled() && k.m <= skinny_rows();
  return GemmCacheKey{skinny ? algo_device_ + " +skinny" : algo_device_, k.m, k.n, k.k,
                      k.out == GemmOut::f32 ? "f32" : "bf16"};
}

// The library's call of `plan` with `algo` on weights `w` (true when it launched). Column-major view:
// out^T (n x m) = op(W) (n x k, W stored k x n, transposed) * x^T (k x m).
bool GemmPlanner::matmul(const Plan& plan, const blasLtMatmulAlgo_t& algo, const bf16_t* x, const void* w,
                         void* out) const {
  const float alpha = 1.0f, beta = 0.0f;
  return blasLtMatmul(blas_, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, out, plan.d, out, plan.d, &algo,
                      blas_workspace_.get(), blas_workspace_.bytes(), stream_) == BLAS_STATUS_SUCCESS;
}

// A timed choice into the GEMM cache file; a file that cannot be written is said once (the
// choice still holds for this process).
void GemmPlanner::store_choice(const GemmCacheKey& key, const GemmCacheEntry& entry) {
  if (absl::Status st = gemm::algo_cache().store(key, entry); !st.ok() && !cache_warned_) {
    cache_warned_ = true;
    std::fprintf(stderr, "kvfuse: %s (GEMM choices are not shared with other processes)\n",
                 std::string(st.message()).c_str());
  }
}

// The plan's descriptors, column-major: out^T (n x m) = op(W) (W stored k x n, transposed) *
// x^T (k x m), operands of type `in`, the result of type `out`, fp32 accumulation.
absl::Status GemmPlanner::describe(Plan& plan, blasDataType_t in, blasDataType_t out, int64_t m,
                                   const LinearWeight& w) {
  const auto t = BLAS_OP_T, n = BLAS_OP_N;
  KVFUSE_BLAS(blasLtMatmulDescCreate(&plan.desc, BLAS_COMPUTE_32F, BLAS_R_32F));
  KVFUSE_BLAS(blasLtMatmulDescSetAttribute(plan.desc, BLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  KVFUSE_BLAS(blasLtMatmulDescSetAttribute(plan.desc, BLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)));
  KVFUSE_BLAS(blasLtMatrixLayoutCreate(&plan.a, in, uint64_t(w.k), uint64_t(w.n), int64_t(w.k)));
  KVFUSE_BLAS(blasLtMatrixLayoutCreate(&plan.b, in, uint64_t(w.k), uint64_t(m), int64_t(w.k)));
  KVFUSE_BLAS(blasLtMatrixLayoutCreate(&plan.d, out, uint64_t(w.n), uint64_t(m), int64_t(w.n)));
  return absl::OkStatus();
}

// The library heuristic's first `count` algorithms for `plan` within the workspace, into
// heur; found: how many it gave.
absl::Status GemmPlanner::heuristic(const Plan& plan, int count, blasLtMatmulHeuristicResult_t* heur,
                                    int& found) const {
  struct Pref {
    blasLtMatmulPreference_t p = nullptr;
    ~Pref() {
      if (p) blasLtMatmulPreferenceDestroy(p);
    }
  } pref;
  found = 0;
  KVFUSE_BLAS(blasLtMatmulPreferenceCreate(&pref.p));
  const size_t ws = blas_workspace_.bytes();
  KVFUSE_BLAS(
      blasLtMatmulPreferenceSetAttribute(pref.p, BLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  KVFUSE_BLAS(blasLtMatmulAlgoGetHeuristic(blas_, plan.desc, plan.a, plan.b, plan.d, plan.d, pref.p, count, heur,
                                           &found));
  return absl::OkStatus();
}

absl::StatusOr<GemmPlanner::Plan*> GemmPlanner::plan_of(const bf16_t* x, int64_t m, const LinearWeight& w,
                                                        void* out, GemmOut out_kind, bool capturing) {
  const GemmKey key = key_of(m, w, out_kind);
  auto found = plans_.find(key);
  if (found != plans_.end()) return found->second.get();
  auto plan = std::make_unique<Plan>();
  KVFUSE_RETURN_IF_ERROR(describe(*plan, BLAS_R_16BF, blas_type(out_kind), m, w));

  const TuneMode mode = capturing || m > gemm::kTuneMaxRows ? TuneMode::off : gemm::tune_mode();
  // After end_tuning(): choices already made are still taken, none is timed.
  const bool may_time = !tuning_ended_.load(std::memory_order_relaxed);
  int cached_gemv = -1, cached_skinny = -1;
  if (mode != TuneMode::off) {
    if (const auto tuned = gemm::TunedChoices::find(device_, key)) {
      static_cast<GemmChoice&>(*plan) = *tuned;
      return plans_.emplace(key, std::move(plan)).first->second.get();
    }
    // Another process's choice for this device, library and shape.
    auto cached = gemm::algo_cache().find(cache_key(key));
    // kvfuse's GEMV: the library's first choice is still looked up below, for calls
    // whose operands the GEMV does not take.
    cached_gemv =
        cached ? gemm::kernel_variant_of(cached->kernel, "kvfuse-gemv/", gpu::gemv_variants(m)) : -1;
    if (!gemv_usable(x, m, w, out)) cached_gemv = -1;
    cached_skinny =
        cached ? gemm::kernel_variant_of(cached->kernel, "kvfuse-skinny/", gpu::kSkinnyVariants) : -1;
    if (cached_skinny >= 0 && !skinny_usable(x, m, w, out, cached_skinny)) cached_skinny = -1;
    if (cached && cached->kernel.empty() && cached->algo.size() == sizeof(blasLtMatmulAlgo_t)) {
      std::memcpy(&plan->algo, cached->algo.data(), sizeof(blasLtMatmulAlgo_t));
      // It must run here (the file could come from another build of the same version).
      if (matmul(*plan, plan->algo, x, w.w.get(), out)) {
        gemm::TunedChoices::keep(device_, key, GemmChoice{plan->algo, -1, -1});
        return plans_.emplace(key, std::move(plan)).first->second.get();
      }
      (void)cudaGetLastError();
    }
  }
  blasLtMatmulHeuristicResult_t heur[gemm::kTuneCandidates] = {};
  int found_n = 0;
  const bool timed = mode != TuneMode::off && may_time && cached_gemv < 0 && cached_skinny < 0;
  KVFUSE_RETURN_IF_ERROR(heuristic(*plan, timed ? gemm::kTuneCandidates : 1, heur, found_n));
  if (found_n == 0) {
    return absl::InternalError(
        absl::StrCat(KVFUSE_BLASLT_NAME, ": no algorithm for a ", m, "x", w.n, "x", w.k, " bf16 GEMM"));
  }
  int best = 0;
  std::vector<float> ms(size_t(found_n), -1.0f);
  float gemv_ms = -1.0f, skinny_ms = -1.0f;
  int gemv_best = -1, skinny_best = -1;
  if (timed && found_n > 1) {
    KVFUSE_RETURN_IF_ERROR(timer_.begin(w, mode));
    const bool out_f32 = out_kind == GemmOut::f32;
    for (int c = 0; c < found_n; ++c) {
      const blasLtMatmulAlgo_t& algo = heur[c].algo;
      ms[size_t(c)] = mode == TuneMode::graph
                          ? timer_.in_graph([&](const void* wc) { return matmul(*plan, algo, x, wc, out); })
                          : timer_.isolated([&] { return matmul(*plan, algo, x, w.w.get(), out); });
    }
    for (int v = 0; mode == TuneMode::graph && gemv_usable(x, m, w, out) && v < gpu::gemv_variants(m); ++v) {
      const float t_ms = timer_.in_graph([&](const void* wc) {
        return gpu::launch_gemv_bf16(x, m, static_cast<const bf16_t*>(wc), w.n, w.k, out, out_f32, stream_,
                                     ops_pdl_, v, gemv_stream_)
            .ok();
      });
      if (t_ms >= 0 && (gemv_ms < 0 || t_ms < gemv_ms)) {
        gemv_ms = t_ms;
        gemv_best = v;
      }
    }
    for (int v = 0; mode == TuneMode::graph && v < gpu::kSkinnyVariants; ++v) {
      if (!skinny_usable(x, m, w, out, v)) continue;
      const float t_ms = timer_.in_graph([&](const void* wc) {
        return gpu::launch_gemm_skinny_bf16(x, m, static_cast<const bf16_t*>(wc), w.n, w.k, out, out_f32,
                                            stream_, ops_pdl_, v, skinny_early_weights())
            .ok();
      });
      if (gemm::tune_log()) {
        std::fprintf(
            stderr,
            "kvfuse gemm tune %lldx%lldx%lld: kvfuse skinny variant %d (%d splits, %d rows) %.4f ms\n",
            (long long)m, (long long)w.n, (long long)w.k, v, gpu::skinny_splits(v), gpu::skinny_block_rows(v),
            double(t_ms));
      }
      if (t_ms >= 0 && (skinny_ms < 0 || t_ms < skinny_ms)) {
        skinny_ms = t_ms;
        skinny_best = v;
      }
    }
    KVFUSE_RETURN_IF_ERROR(timer_.end());
    shapes_timed_.fetch_add(1, std::memory_order_relaxed);
    for (int c = 0; c < found_n; ++c) {
      if (ms[size_t(c)] >= 0 && (ms[size_t(best)] < 0 || ms[size_t(c)] < ms[size_t(best)])) best = c;
    }
    // The fastest of the three kinds; the library on a tie.
    const auto faster = [](float a, float b) { return a >= 0 && (b < 0 || a < b); };
    const float lib_ms = ms[size_t(best)];
    if (faster(gemv_ms, lib_ms) && !faster(skinny_ms, gemv_ms)) {
      plan->gemv = gemv_best;
    } else if (faster(skinny_ms, lib_ms)) {
      plan->skinny = skinny_best;
    }
    if (gemm::tune_log()) {
      std::fprintf(
          stderr,
          "kvfuse gemm tune (%s) %lldx%lldx%lld %s: %d candidates, heuristic first %.4f ms, best #%d "
          "%.4f ms, kvfuse gemv %.4f ms (variant %d), kvfuse skinny %.4f ms (variant %d): %s\n",
          gemm::tune_mode_name(mode), (long long)m, (long long)w.n, (long long)w.k, out_f32 ? "f32" : "bf16",
          found_n, double(ms[0]), best, double(lib_ms), double(gemv_ms), gemv_best, double(skinny_ms),
          skinny_best,
          plan->gemv >= 0     ? "gemv"
          : plan->skinny >= 0 ? "skinny"
                              : "library");
    }
  }
  plan->algo = heur[best].algo;
  if (cached_gemv >= 0) plan->gemv = cached_gemv;
  if (cached_gemv < 0 && cached_skinny >= 0) plan->skinny = cached_skinny;
  // An untimed pick after end_tuning() stays with this backend: the process's choices
  // (and the file) are for timed ones and the file's.
  if (mode != TuneMode::off && (may_time || cached_gemv >= 0 || cached_skinny >= 0)) {
    gemm::TunedChoices::keep(device_, key, *plan);
    // A choice made without the GEMV (KVFUSE_GEMV=0) stays in this process: the file is
    // for choices among every candidate.
    const bool every_candidate = gemv_enabled() || m > gpu::kGemvMaxRows;
    if (timed && every_candidate && mode == TuneMode::graph && found_n > 1 && ms[size_t(best)] >= 0) {
      GemmCacheEntry e;
      if (plan->gemv >= 0) {
        e.kernel = "kvfuse-gemv/" + std::to_string(plan->gemv);
        e.us = double(gemv_ms) * 1e3;
      } else if (plan->skinny >= 0) {
        e.kernel = "kvfuse-skinny/" + std::to_string(plan->skinny);
        e.us = double(skinny_ms) * 1e3;
      } else {
        e.algo.resize(sizeof(blasLtMatmulAlgo_t));
        std::memcpy(e.algo.data(), &plan->algo, sizeof(blasLtMatmulAlgo_t));
        e.us = double(ms[size_t(best)]) * 1e3;
      }
      e.method = "graph";
      store_choice(cache_key(key), e);
    }
  }
  return plans_.emplace(key, std::move(plan)).first->second.get();
}

absl::Status GemmPlanner::gemm(const bf16_t* x, int64_t m, const LinearWeight& w, void* out, GemmOut out_type,
                               bool capturing) {
  if (m <= 0) return absl::OkStatus();
  auto planned = plan_of(x, m, w, out, out_type, capturing);
  if (!planned.ok()) return planned.status();
  Plan& p = **planned;
  const bool out_f32 = out_type == GemmOut::f32;
  if (p.gemv >= 0 && gemv_usable(x, m, w, out)) {
    return gpu_status(gpu::launch_gemv_bf16(x, m, w.w.as<bf16_t>(), w.n, w.k, out, out_f32, stream_, ops_pdl_,
                                            p.gemv, gemv_stream_),
                      "gemv");
  }
  if (p.skinny >= 0 && skinny_usable(x, m, w, out, p.skinny)) {
    return gpu_status(gpu::launch_gemm_skinny_bf16(x, m, w.w.as<bf16_t>(), w.n, w.k, out, out_f32, stream_,
                                                   ops_pdl_, p.skinny, skinny_early_weights()),
                      "skinny gemm");
  }
  const float alpha = 1.0f, beta = 0.0f;
  KVFUSE_BLAS(blasLtMatmul(blas_, p.desc, &alpha, w.w.get(), p.a, x, p.b, &beta, out, p.d, out, p.d, &p.algo,
                           blas_workspace_.get(), blas_workspace_.bytes(), stream_));
  return absl::OkStatus();
}

absl::StatusOr<int> GemmPlanner::gemv_variant(const bf16_t* x, int64_t m, const LinearWeight& w, void* out,
                                              bool capturing) {
  auto planned = plan_of(x, m, w, out, GemmOut::bf16, capturing);
  if (!planned.ok()) return planned.status();
  return (*planned)->gemv;
}

}  // namespace kvfuse
