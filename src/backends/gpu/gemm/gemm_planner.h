// The GPU backend's GEMMs: which kernel runs each shape, and running it. A shape is
// planned at its first call: the library's descriptors, then its choice — from this
// process's earlier choices, the GEMM cache file, or timed on the spot over the library's
// heuristic candidates and kvfuse's own kernels (gemm_tuning.h says how and when). The
// GpuBackend owns one planner and calls it from linear, linear_logits and the fused
// epilogues (linear_push, linear_silu_mul).
//
// Families: the bf16 GEMMs (bf16 x and w, fp32 accumulation, bf16 or fp32 out) over
// cuBLASLt/hipBLASLt, kvfuse's GEMV (at most gpu::kGemvMaxRows rows) and its skinny GEMM
// (sm_90, up to KVFUSE_GEMM_SKINNY_ROWS rows); the FP8-weight GEMMs (gemm_fp8, in
// gemm_planner_fp8.cu): kvfuse's FP8 GEMV and the library's FP8 GEMM. Another family joins with a GemmFamily of
// its own (its choices keyed apart), its plan and run methods here, and its candidates
// timed through the same GemmTimer, TunedChoices and cache file.
#pragma once

#include "kernels/common/gpu.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/gemm/gemv_fp8.cuh"
#include "src/backends/backend.h"
#include "src/backends/gpu/gemm/blaslt.h"
#include "src/backends/gpu/gemm/gemm_tuning.h"

namespace kvfuse {

using gemm::GemmOut;

class GemmPlanner {
 public:
  // How the planner's kernels launch, as the backend's other kernels do.
  struct Launch {
    cudaStream_t stream = nullptr;  // the backend's stream: every GEMM and every timing runs on it
    bool pdl = false;               // kvfuse's kernels launch as programmatic dependents
    bool gemv_stream = true;        // the GEMV streams its weights past L1 (KVFUSE_GEMV_STREAM)
  };

  // For the device the caller has made current (`prop` its properties): the library's
  // handle and workspace, from `alloc` (the backend's device memory).
  static absl::StatusOr<std::unique_ptr<GemmPlanner>> create(int device, const cudaDeviceProp& prop,
                                                             const Launch& launch,
                                                             gemm::GemmTimer::Alloc alloc);
  ~GemmPlanner();
  GemmPlanner(const GemmPlanner&) = delete;
  GemmPlanner& operator=(const GemmPlanner&) = delete;

  // out[m, n] = x[m, k] * w[n, k]^T, fp32 accumulation, out bf16 or fp32; by the shape's
  // plan (made at its first call; untimed while `capturing`). w has no bias here.
  absl::Status gemm(const bf16_t* x, int64_t m, const LinearWeight& w, void* out, GemmOut out_type,
                    bool capturing);
  // The GEMV variant planned for the bf16-out shape, or -1 where another kernel runs it:
  // for the epilogues only the GEMV has (the backend launches them). Plans it as gemm()
  // does; call it where gemv_usable.
  absl::StatusOr<int> gemv_variant(const bf16_t* x, int64_t m, const LinearWeight& w, void* out,
                                   bool capturing);
  // FP8 weights (w.fp8): out[m, n] as kernels/cpu/gemm/gemm_fp8.h computes it, fp32 or
  // bf16, plus `bias` (fp32 [n] or null). x: bf16 [m, k]. Runs the shape's plan: kvfuse's
  // FP8 GEMV (m <= gpu::kGemvMaxRows; for W8A8 it quantizes the activations itself,
  // KVFUSE_GEMV_FP8_QUANT=0: a quantizing kernel first) or, W8A8 only, the activations
  // quantized into scratch.xq and scratch.x_scale, the library's FP8 GEMM's unscaled fp32
  // sums into scratch.sums [m, n], and gpu::launch_fp8_gemm_epilogue; timed as gemm()
  // times. W8A16 of more rows: the GEMV over groups of kGemvMaxRows rows.
  struct Fp8Scratch {
    uint8_t* xq = nullptr;      // W8A8: [m, k] activation codes
    float* x_scale = nullptr;   // W8A8: [m] their row scales
    float* sums = nullptr;      // W8A8: [m, n] the library's sums
    bool given = false;         // xq and x_scale hold x's codes already (Backend::norm_to_fp8)
  };
  absl::Status gemm_fp8(const bf16_t* x, int64_t m, const LinearWeight& w, const float* bias,
                        const Fp8Scratch& scratch, void* out, GemmOut out_type, bool capturing);
  // The FP8 GEMV variant planned for the bf16-out shape where the GEMV runs it (W8A16, W8A8
  // quantized in the GEMV, or W8A8 codes given in scratch) at most gpu::kGemvMaxRows rows,
  // else -1: for the epilogue only the GEMV has (SiLU-mul). Plans it as gemm_fp8 does.
  // The activations of the FP8 GEMV for weight w: bf16 x, quantized by the GEMV itself for
  // W8A8 (w's static input scale in device memory where it has one), or, where `scratch`
  // holds x's codes already (Fp8Scratch::given), those codes and their row scales.
  static gpu::Fp8GemvAct gemv_fp8_act(const LinearWeight& w, const Fp8Scratch& scratch);
  absl::StatusOr<int> gemv_fp8_variant(const bf16_t* x, int64_t m, const LinearWeight& w, const float* bias,
                                       const Fp8Scratch& scratch, void* out, bool capturing);
  // kvfuse's GEMV may run this call: it is a candidate (KVFUSE_GEMV) and the operands suit it.
  static bool gemv_usable(const bf16_t* x, int64_t m, const LinearWeight& w, const void* out);

  // Backend::end_gemm_tuning and gemm_shapes_timed.
  bool end_tuning();
  int64_t shapes_timed() const { return shapes_timed_.load(std::memory_order_relaxed); }

 private:
  // A bf16 shape's plan: the library's descriptors (host objects, made once) and its choice.
  struct Plan : gemm::GemmChoice {
    blasLtMatmulDesc_t desc = nullptr;
    blasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    Plan() = default;
    Plan(const Plan&) = delete;
    Plan& operator=(const Plan&) = delete;
    ~Plan();
  };

  GemmPlanner(int device, const Launch& launch, gemm::GemmTimer::Alloc alloc);

  absl::StatusOr<Plan*> plan_of(const bf16_t* x, int64_t m, const LinearWeight& w, void* out,
                                GemmOut out_kind, bool capturing);
  gemm::GemmKey key_of(int64_t m, const LinearWeight& w, GemmOut out) const;
  // The FP8 family's plan of a shape (gemm_planner_fp8.cu): its library descriptors (W8A8)
  // and its choice; and one call of a plan's kernels (algo null: the GEMV of variant gemv).
  struct Fp8Call {
    const bf16_t* x;
    int64_t m;
    const LinearWeight& w;
    const float* bias;
    const Fp8Scratch& scratch;
    void* out;
    GemmOut out_kind;
  };
  absl::StatusOr<Plan*> plan_fp8_of(const Fp8Call& c, bool capturing);
  absl::Status run_fp8(const Plan& plan, const blasLtMatmulAlgo_t* algo, int gemv, const Fp8Call& c,
                       const void* wd) const;
  static bool gemv_fp8_quantizes();
  GemmCacheKey cache_key(const gemm::GemmKey& k) const;
  void store_choice(const GemmCacheKey& key, const GemmCacheEntry& entry);
  absl::Status describe(Plan& plan, blasDataType_t in, blasDataType_t out, int64_t m, const LinearWeight& w);
  absl::Status heuristic(const Plan& plan, int count, blasLtMatmulHeuristicResult_t* heur, int& found) const;
  bool matmul(const Plan& plan, const blasLtMatmulAlgo_t& algo, const bf16_t* x, const void* w,
              void* out) const;

  static bool gemv_enabled();
  static bool skinny_enabled();
  static int64_t skinny_rows();
  static bool skinny_early_weights();
  static bool skinny_usable(const bf16_t* x, int64_t m, const LinearWeight& w, const void* out, int variant);

  const int device_;
  cudaStream_t stream_;
  const bool ops_pdl_;
  const bool gemv_stream_;
  gemm::GemmTimer::Alloc alloc_;
  gemm::GemmTimer timer_;
  std::string algo_device_;  // the GEMM cache's device key: name, architecture, library and version
  blasLtHandle_t blas_ = nullptr;
  DeviceBuffer blas_workspace_;
  std::map<gemm::GemmKey, std::unique_ptr<Plan>> plans_;
  std::atomic<bool> tuning_ended_{false};  // end_tuning()
  std::atomic<int64_t> shapes_timed_{0};
  bool cache_warned_ = false;
};

}  // namespace kvfuse
