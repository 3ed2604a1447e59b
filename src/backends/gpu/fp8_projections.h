// The GPU backend's FP8-weight projections (src/backends/gpu/gpu_backend.cu hands them its
// FP8 calls): the planner's FP8 GEMMs over chunks of rows with their W8A8 scratch, the FP8
// GEMV's SiLU-mul epilogue, and the norm that quantizes its output for the W8A8 projection
// after it (Backend::norm_to_fp8). The numbers are kernels/cpu/gemm/gemm_fp8.h's.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/backends/backend.h"
#include "src/backends/gpu/gemm/gemm_planner.h"

namespace kvfuse {

class Fp8Projections {
 public:
  // What the backend lends: its planner, its stream and launch mode, whether it is capturing
  // a graph, its scratch-growing rule (GpuBackend::reserve_scratch) and its fp32 GEMM
  // scratch (shared with the biased bf16 projections).
  struct Context {
    GemmPlanner* planner = nullptr;
    const cudaStream_t* stream = nullptr;
    const bool* pdl = nullptr;
    const bool* capturing = nullptr;
    std::function<absl::Status(DeviceBuffer&, size_t, const char*)> reserve;
    DeviceBuffer* sums = nullptr;
  };
  explicit Fp8Projections(Context c) : c_(std::move(c)) {}

  // out[m, w.n] (bf16 or fp32) = x . w^T (+ bias): the planner's FP8 GEMM, at most
  // kRowsPerGemm rows a call (it bounds the W8A8 scratch: the fp32 sums of the library's GEMM
  // take 58 MB for llama3-8b's gate/up projection). xq: x's codes from norm (all m rows), or null.
  absl::Status linear(const bf16_t* x, int64_t m, const LinearWeight& w, const float* bias, void* out,
                      GemmOut out_type, const Fp8Acts* xq = nullptr);
  // The FP8 GEMV with its SiLU-mul epilogue (KVFUSE_GEMV_SILU) where the planner runs the
  // GEMV for the shape: true when it ran (act written), false when the caller must run
  // linear then silu_mul.
  absl::StatusOr<bool> gemv_silu_mul(const bf16_t* x, int64_t m, const LinearWeight& w, int64_t inter, bf16_t* act,
                                     const Fp8Acts* xq);
  // Backend::norm_to_fp8's fused kernel (kernels/ops/norm_fp8.cuh) where it applies: `next`
  // W8A8, the row on the norm's vector path, KVFUSE_FP8_NORM_QUANT on, the scratch able to
  // hold the codes (not growing during a capture); nullopt-like empty Fp8Acts and nothing
  // launched elsewhere (the caller runs the plain norm).
  absl::StatusOr<Fp8Acts> norm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols, float eps,
                               bf16_t* out, const LinearWeight& next);
  // Frees the scratch (before the backend's stream goes).
  void release();

  static constexpr int64_t kRowsPerGemm = gemm::kTuneMaxRows;

 private:
  // The W8A8 scratch of m rows (none for W8A16): the codes xq gives, or room to quantize into;
  // the library's sums.
  absl::StatusOr<GemmPlanner::Fp8Scratch> scratch(int64_t m, const LinearWeight& w, const Fp8Acts* xq);

  Context c_;
  DeviceBuffer xq_;          // activations quantized for the library's GEMM [m, k]
  DeviceBuffer x_scale_;     // and their row scales [m]
  DeviceBuffer norm_xq_;     // activations a norm quantized for the projection after it [m, k]
  DeviceBuffer norm_scale_;  // and their row scales [m]
};

}  // namespace kvfuse
