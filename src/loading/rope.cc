#include "src/loading/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace kvfuse {

namespace {

constexpr double kPi = std::numbers::pi;

absl::Status bad(const std::string& prefix, const char* field, double value, const char* want) {
  return absl::InvalidArgumentError(absl::StrCat("'", prefix, field, "' is ", value, "; ", want));
}

bool positive(double x) { return std::isfinite(x) && x > 0.0; }

// yarn's mscale(scale, m): the attention temperature of the YaRN paper.
double yarn_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

double yarn_attention_factor(const RopeScaling& sc) {
  if (sc.attention_factor) return *sc.attention_factor;
  // transformers tests both for truthiness: absent, null and 0 all fall back.
  if (sc.mscale.value_or(0.0) != 0.0 && sc.mscale_all_dim.value_or(0.0) != 0.0)
    return yarn_mscale(sc.factor, *sc.mscale) / yarn_mscale(sc.factor, *sc.mscale_all_dim);
  return yarn_mscale(sc.factor, 1.0);
}

// The (fractional) dimension whose wavelength makes `rotations` turns over `context`.
double yarn_correction_dim(double rotations, double dim, double theta, double context) {
  return dim * std::log(context / (rotations * 2.0 * kPi)) / (2.0 * std::log(theta));
}

}  // namespace

absl::Status validate_rope_scaling(const RopeScaling& sc, const std::string& p) {
  if (sc.type == RopeType::kDefault) return absl::OkStatus();
  if (!positive(sc.factor)) return bad(p, "factor", sc.factor, "a finite number > 0 was expected");
  if (sc.type == RopeType::kLinear) return absl::OkStatus();
  if (sc.original_max_position < 1) {
    return absl::InvalidArgumentError(absl::StrCat("'", p, "original_max_position_embeddings' is ",
                                                   sc.original_max_position,
                                                   "; an integer >= 1 was expected"));
  }
  if (sc.type == RopeType::kLlama3) {
    if (!positive(sc.low_freq_factor))
      return bad(p, "low_freq_factor", sc.low_freq_factor, "a finite number > 0 was expected");
    if (!std::isfinite(sc.high_freq_factor) || sc.high_freq_factor <= sc.low_freq_factor) {
      return bad(
          p, "high_freq_factor", sc.high_freq_factor,
          absl::StrCat("a finite number > low_freq_factor (", sc.low_freq_factor, ") was expected").c_str());
    }
    return absl::OkStatus();
  }
  // yarn
  if (!positive(sc.beta_fast)) return bad(p, "beta_fast", sc.beta_fast, "a finite number > 0 was expected");
  if (!positive(sc.beta_slow)) return bad(p, "beta_slow", sc.beta_slow, "a finite number > 0 was expected");
  if (sc.attention_factor && !positive(*sc.attention_factor))
    return bad(p, "attention_factor", *sc.attention_factor, "a finite number > 0 was expected");
  if (sc.mscale && !std::isfinite(*sc.mscale))
    return bad(p, "mscale", *sc.mscale, "a finite number was expected");
  if (sc.mscale_all_dim && !std::isfinite(*sc.mscale_all_dim))
    return bad(p, "mscale_all_dim", *sc.mscale_all_dim, "a finite number was expected");
  const double a = yarn_attention_factor(sc);
  if (!positive(a) || !positive(float(a))) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", p, "mscale' and '", p, "mscale_all_dim' (", sc.mscale.value_or(0.0), ", ",
                     sc.mscale_all_dim.value_or(0.0), ") give the attention factor ", a,
                     "; a finite number > 0 was expected"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RopeTable> rope_table(double theta, int32_t head_dim, const RopeScaling& sc) {
  if (head_dim < 2 || head_dim % 2 != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("'head_dim' is ", head_dim, "; RoPE needs an even head_dim"));
  if (!positive(theta) || (sc.type == RopeType::kYarn && theta <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("'rope_theta' is ", theta,
                                                   sc.type == RopeType::kYarn
                                                       ? "; yarn needs a finite theta > 1"
                                                       : "; a finite number > 0 was expected"));
  }
  KVFUSE_RETURN_IF_ERROR(validate_rope_scaling(sc));
  const int32_t half = head_dim / 2;
  const double dim = double(head_dim);
  RopeTable t;
  t.inv_freq.resize(size_t(half));
  // theta^(-2i/D) in double: the unscaled frequency every type starts from.
  auto base = [&](int32_t i) { return std::pow(theta, -2.0 * double(i) / dim); };

  switch (sc.type) {
    case RopeType::kDefault:
      for (int32_t i = 0; i < half; ++i) t.inv_freq[size_t(i)] = float(base(i));
      break;
    case RopeType::kLinear:
      for (int32_t i = 0; i < half; ++i) t.inv_freq[size_t(i)] = float(base(i) / sc.factor);
      break;
    case RopeType::kLlama3: {
      const double original = double(sc.original_max_position);
      const double low_wavelen = original / sc.low_freq_factor;    // longer: interpolate fully
      const double high_wavelen = original / sc.high_freq_factor;  // shorter: keep
      for (int32_t i = 0; i < half; ++i) {
        const double f = base(i), wavelen = 2.0 * kPi / f;
        double v = f;
        if (wavelen > low_wavelen) {
          v = f / sc.factor;
        } else if (!(wavelen < high_wavelen)) {
          const double s =
              (original / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor);
          v = (1.0 - s) * f / sc.factor + s * f;
        }
        t.inv_freq[size_t(i)] = float(v);
      }
      break;
    }
    case RopeType::kYarn: {
      const double original = double(sc.original_max_position);
      double low = yarn_correction_dim(sc.beta_fast, dim, theta, original);
      double high = yarn_correction_dim(sc.beta_slow, dim, theta, original);
      if (sc.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1.0);
      if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
      for (int32_t i = 0; i < half; ++i) {
        const double extrapolated = base(i), interpolated = extrapolated / sc.factor;
        // ramp: 0 below `low` (high frequencies: extrapolate), 1 above `high` (interpolate).
        const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
        t.inv_freq[size_t(i)] = float(interpolated * ramp + extrapolated * (1.0 - ramp));
      }
      t.attention_scaling = float(yarn_attention_factor(sc));
      break;
    }
  }
  // An extreme factor (1e-300) can overflow fp32: refuse rather than rotate by inf.
  for (int32_t i = 0; i < half; ++i) {
    if (!std::isfinite(t.inv_freq[size_t(i)])) {
      return absl::InvalidArgumentError(
          absl::StrCat("'factor' is ", sc.factor, "; it makes inv_freq[", i, "] overflow fp32"));
    }
  }
  return t;
}

absl::StatusOr<RopeTable> rope_table(const ModelSpec& spec) {
  return rope_table(double(spec.rope_theta), spec.head_dim, spec.rope_scaling);
}

}  // namespace kvfuse
