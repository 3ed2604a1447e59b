// The rotary embedding's frequency table of a model: inv_freq[i] for the pair
// (i, i + head_dim/2), and the factor that multiplies cos and sin, computed on the host
// once per model and handed to Backend::rope (kernels/cpu/ops/ops.h rope_neox has the
// contract). The formulas are transformers' (modeling_rope_utils.py, the 5.x release):
//   default  inv_freq[i] = theta^(-2i/D)
//   linear   theta^(-2i/D) / factor
//   llama3   wavelengths 2 pi / inv_freq longer than original / low_freq_factor are
//            divided by factor, shorter than original / high_freq_factor kept, and the
//            band between interpolated with s = (original / wavelen - low) / (high - low):
//            (1 - s) inv_freq / factor + s inv_freq
//   yarn     a linear ramp over the dimensions between the correction dimensions of
//            beta_fast and beta_slow rotations over the original context (floor / ceil
//            when truncate) blends extrapolation (theta^(-2i/D)) into interpolation
//            (theta^(-2i/D) / factor); attention_scaling is attention_factor, else
//            mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
//            non-zero, else mscale(factor, 1), with mscale(f, m) = 0.1 m ln f + 1 (1 when
//            f <= 1)
// Each value is computed in double and rounded to fp32 once. The default table is
// float(pow(double(theta), -2i/D)), the correctly rounded value the kernels always used;
// transformers computes it in fp32 and may differ by an ulp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/loading/model_spec.h"

namespace kvfuse {

struct RopeTable {
  std::vector<float> inv_freq;     // [head_dim / 2]
  float attention_scaling = 1.0f;  // multiplies cos and sin (yarn); 1 otherwise
};

// The scaling's values: factor > 0, the original context >= 1, llama3's
// 0 < low_freq_factor < high_freq_factor, yarn's betas > 0, attention_factor > 0 and a
// finite, positive mscale ratio. Errors are INVALID_ARGUMENT and name the field,
// prefixed with `field_prefix` (e.g. "rope_scaling.").
absl::Status validate_rope_scaling(const RopeScaling& sc, const std::string& field_prefix = "");

// The table of a head_dim (even, >= 2) and theta (> 0; > 1 for yarn) with `sc` applied.
absl::StatusOr<RopeTable> rope_table(double theta, int32_t head_dim, const RopeScaling& sc);
absl::StatusOr<RopeTable> rope_table(const ModelSpec& spec);

}  // namespace kvfuse
