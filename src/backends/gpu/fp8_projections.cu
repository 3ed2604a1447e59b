// The GPU backend's FP8-weight projections (src/backends/gpu/fp8_projections.h).
#include "kernels/common/gpu.h"

#include "src/backends/gpu/fp8_projections.h"

#include <algorithm>

#include "kernels/gemm/gemv_fp8.cuh"
#include "kernels/ops/norm_fp8.cuh"
#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"
#include "src/loading/env_switches.h"

namespace kvfuse {

absl::Status Fp8Projections::linear(const bf16_t* x, int64_t m, const LinearWeight& w, const float* bias, void* out,
                                    GemmOut out_type, const Fp8Acts* xq) {
  auto s = scratch(m, w, xq);
  if (!s.ok()) return s.status();
  const size_t out_elem = out_type == GemmOut::f32 ? sizeof(float) : sizeof(bf16_t);
  for (int64_t i0 = 0; i0 < m; i0 += kRowsPerGemm) {
    GemmPlanner::Fp8Scratch part = *s;
    if (part.given) {
      part.xq += i0 * w.k;
      part.x_scale += i0;
    }
    KVFUSE_RETURN_IF_ERROR(c_.planner->gemm_fp8(x + i0 * w.k, std::min(m - i0, kRowsPerGemm), w, bias, part,
                                                static_cast<char*>(out) + size_t(i0 * w.n) * out_elem, out_type,
                                                *c_.capturing));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Fp8Projections::gemv_silu_mul(const bf16_t* x, int64_t m, const LinearWeight& w, int64_t inter,
                                                   bf16_t* act, const Fp8Acts* xq) {
  static const bool fuse = env_flag("KVFUSE_GEMV_SILU");
  if (!fuse || m <= 0 || m > gpu::kGemvMaxRows || !w.fp8 || w.n != 2 * inter) return false;
  auto s = scratch(m, w, xq);
  if (!s.ok()) return s.status();
  const float* bias = w.bias.get() ? w.bias.as<float>() : nullptr;
  auto gemv = c_.planner->gemv_fp8_variant(x, m, w, bias, *s, act, *c_.capturing);
  if (!gemv.ok()) return gemv.status();
  if (*gemv < 0) return false;
  KVFUSE_RETURN_IF_ERROR(gpu_status(gpu::launch_gemv_fp8_silu_mul(x, m, w.w.as<uint8_t>(), w.scale.as<float>(),
                                                                  w.fp8_format, w.n, w.k, bias, act,
                                                                  GemmPlanner::gemv_fp8_act(w, *s), *c_.stream,
                                                                  *c_.pdl, *gemv),
                                    "gemv fp8 silu_mul"));
  return true;
}

absl::StatusOr<Fp8Acts> Fp8Projections::norm(bf16_t* x, const bf16_t* y, const bf16_t* w, int64_t rows, int64_t cols,
                                             float eps, bf16_t* out, const LinearWeight& next) {
  static const bool on = env_flag("KVFUSE_FP8_NORM_QUANT");
  if (!on || rows <= 0 || !next.fp8 || next.act == Fp8Act::none || next.k != cols) return Fp8Acts{};
  // Scratch that would have to grow during a capture leaves the plain norm too.
  if (!c_.reserve(norm_xq_, size_t(rows * cols), "norm: FP8 activations").ok() ||
      !c_.reserve(norm_scale_, size_t(rows) * sizeof(float), "norm: FP8 row scales").ok()) {
    return Fp8Acts{};
  }
  const float* static_scale = next.act_scale.get() ? next.act_scale.as<float>() : nullptr;
  uint8_t* codes = norm_xq_.as<uint8_t>();
  float* scales = norm_scale_.as<float>();
  if (!gpu::rmsnorm_fp8_unsupported(x, y, w, rows, cols, out, next.act, static_scale, next.fp8_format, codes, scales)
           .empty()) {
    return Fp8Acts{};
  }
  KVFUSE_RETURN_IF_ERROR(gpu_status(gpu::launch_rmsnorm_fp8(x, y, w, rows, cols, eps, out, next.act, static_scale,
                                                            next.fp8_format, codes, scales, *c_.stream, *c_.pdl),
                                    "rmsnorm_fp8"));
  return Fp8Acts{codes, scales};
}

void Fp8Projections::release() {
  xq_.reset();
  x_scale_.reset();
  norm_xq_.reset();
  norm_scale_.reset();
}

absl::StatusOr<GemmPlanner::Fp8Scratch> Fp8Projections::scratch(int64_t m, const LinearWeight& w,
                                                                const Fp8Acts* xq) {
  if (m <= 0 || w.act == Fp8Act::none) return GemmPlanner::Fp8Scratch{};
  const int64_t rows = std::min(m, kRowsPerGemm);
  KVFUSE_RETURN_IF_ERROR(c_.reserve(*c_.sums, size_t(rows * w.n) * sizeof(float), "linear: fp32"));
  if (xq != nullptr && xq->given()) {
    return GemmPlanner::Fp8Scratch{const_cast<uint8_t*>(xq->codes), const_cast<float*>(xq->scales),
                                   c_.sums->as<float>(), true};
  }
  KVFUSE_RETURN_IF_ERROR(c_.reserve(xq_, size_t(rows * w.k), "linear: FP8 activations"));
  KVFUSE_RETURN_IF_ERROR(c_.reserve(x_scale_, size_t(rows) * sizeof(float), "linear: FP8 row scales"));
  return GemmPlanner::Fp8Scratch{xq_.as<uint8_t>(), x_scale_.as<float>(), c_.sums->as<float>()};
}

}  // namespace kvfuse
