#include "src/loading/checkpoint_fp8.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvfuse {

namespace {

absl::Status err(const CheckpointTensor& t, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(t.file->path(), ": tensor '", t.info->name, "' ", what));
}
// "quantization_config (/m/config.json)": where a rule comes from, for messages.
std::string config_of(const QuantConfig& q) { return absl::StrCat("quantization_config (", q.source, ")"); }

}  // namespace

bool fp8_quantized(const QuantConfig& q, absl::string_view weight) {
  // Decoder-layer projections only: lm_head ends in "lm_head.weight", not "_proj.weight".
  if (q.linear.format != WeightQuantFormat::fp8_e4m3 || !absl::StartsWith(weight, "model.layers.") ||
      !absl::EndsWith(weight, "_proj.weight"))
    return false;
  return !q.ignored(weight.substr(0, weight.size() - absl::string_view(".weight").size()));
}

absl::Status check_fp8_expected(const Checkpoint& c, const QuantConfig& q, const CheckpointTensor& t) {
  const std::string& name = t.info->name;
  const StDtype dtype = t.info->dtype;
  const std::string module = absl::EndsWith(name, ".weight") ? strip_suffix(name, ".weight") : name;
  if (!fp8_quantized(q, name)) {
    if (is_float_dtype(dtype)) return absl::OkStatus();
    const std::string why = absl::EndsWith(name, "_proj.weight") && absl::StartsWith(name, "model.layers.")
                                ? absl::StrCat(config_of(q), " leaves ", module, " unquantized")
                                : "kvfuse keeps lm_head, the embeddings, the norms and biases in bf16";
    return err(t, absl::StrCat("has dtype ", st_dtype_name(dtype), "; ", why,
                               ", so it must be BF16, F16, F32 or F64"));
  }
  const std::string base = strip_suffix(name, "weight");
  const std::string scale = base + q.weight_scale_suffix;
  if (dtype != StDtype::F8_E4M3) {
    return err(t, absl::StrCat("has dtype ", st_dtype_name(dtype), "; ", config_of(q), " quantizes ", module,
                               ", so it must be F8_E4M3 with a '", scale, "' tensor"));
  }
  if (c.find(scale) == nullptr)
    return err(t, absl::StrCat("is F8_E4M3 but its weight scale '", scale, "' is missing"));
  if (q.linear.activation == ActivationScheme::static_tensor && c.find(base + "input_scale") == nullptr) {
    return err(t, absl::StrCat("needs the activation scale '", base, "input_scale', which is missing (",
                               config_of(q), " declares static per-tensor input scales)"));
  }
  return absl::OkStatus();
}

absl::Status check_scale_tensor(const Checkpoint& c, const std::optional<QuantConfig>& quant,
                                const std::map<std::string, std::vector<int64_t>>& expected,
                                const CheckpointTensor& t, bool& handled) {
  const std::string& name = t.info->name;
  const StTensorInfo& info = *t.info;
  const std::string wsuffix = quant ? quant->weight_scale_suffix : "weight_scale";
  const bool wscale = absl::EndsWith(name, "." + wsuffix);
  handled = wscale || absl::EndsWith(name, ".input_scale");
  if (!handled) return absl::OkStatus();
  const std::string base = strip_suffix(name, wscale ? wsuffix : "input_scale");
  const auto w = expected.find(base + "weight");
  if (w == expected.end() || !is_projection(base + "weight"))
    return err(t, "is not expected in this architecture");
  if (!is_float_dtype(info.dtype))
    return err(t, absl::StrCat("has dtype ", st_dtype_name(info.dtype), "; scales must be floating point"));

  if (!wscale) {
    // Activation scales are used only by static FP8 projections; otherwise tolerated
    // and unused (bf16 compute, or dynamic scales computed at run time).
    if (!quant || quant->linear.activation != ActivationScheme::static_tensor ||
        !fp8_quantized(*quant, base + "weight"))
      return absl::OkStatus();
    if (info.num_elements() != 1 || info.shape.size() > 1)
      return err(
          t, absl::StrCat("has shape ", shape_str(info.shape), "; an input_scale is one value ([] or [1])"));
    if (info.dtype == StDtype::F64) return err(t, "has dtype F64; an input_scale must be F32, BF16 or F16");
    const float x = *st_element_f32(info.dtype, t.file->data(info), 0, name);
    if (!std::isfinite(x) || x <= 0.0f)
      return err(t, absl::StrCat("is ", x, "; an input_scale must be finite and > 0"));
    return absl::OkStatus();
  }

  const CheckpointTensor* wt = c.find(base + "weight");
  if (wt == nullptr || wt->info->dtype != StDtype::F8_E4M3)
    return err(t, "scales a weight that is not F8_E4M3");
  const int64_t n = w->second[0], count = info.num_elements();
  const bool per_tensor = count == 1 && info.shape.size() <= 1;
  const bool per_channel =
      count == n && (info.shape == std::vector<int64_t>{n} || info.shape == std::vector<int64_t>{n, 1});
  if (!per_tensor && !per_channel) {
    return err(t, absl::StrCat("has shape ", shape_str(info.shape),
                               "; weight scales must be per tensor ([] or [1]) or per output channel ([", n,
                               "] or [", n, ", 1]); block scales are not supported"));
  }
  for (int64_t i = 0; i < count; ++i) {
    const float x = *st_element_f32(info.dtype, t.file->data(info), i, name);
    if (!std::isfinite(x) || x <= 0.0f)
      return err(t, absl::StrCat("holds ", x, " at ", i, "; scales must be finite and > 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> fp8_projection(const Checkpoint& c, const std::vector<std::string>& shards) {
  // Without a quantization_config nothing declares how to compute with FP8 weights:
  // they are dequantized to bf16 (src/loading/checkpoint.h).
  if (!c.spec().quant || shards.empty()) return false;
  const CheckpointTensor* first = c.find(shards[0]);
  if (first == nullptr)
    return absl::NotFoundError(absl::StrCat(c.dir(), ": missing tensor '", shards[0], "'"));
  const bool fp8 = first->info->dtype == StDtype::F8_E4M3;
  for (size_t i = 1; i < shards.size(); ++i) {
    const CheckpointTensor* t = c.find(shards[i]);
    if (t == nullptr) return absl::NotFoundError(absl::StrCat(c.dir(), ": missing tensor '", shards[i], "'"));
    if ((t->info->dtype == StDtype::F8_E4M3) != fp8) {
      return absl::InvalidArgumentError(
          absl::StrCat(c.dir(), ": tensors '", shards[0], "' (", st_dtype_name(first->info->dtype), ") and '",
                       shards[i], "' (", st_dtype_name(t->info->dtype),
                       ") are shards of one fused projection and must both be F8_E4M3 or both not"));
    }
  }
  return fp8;
}

absl::Status append_fp8_shard(const Checkpoint& c, const std::string& weight, HostLinear& out) {
  const QuantConfig& q = *c.spec().quant;
  const CheckpointTensor* t = c.find(weight);
  const std::string base = strip_suffix(weight, "weight");
  const CheckpointTensor* sc = c.find(base + q.weight_scale_suffix);
  if (t == nullptr || sc == nullptr || t->info->shape.size() != 2 || t->info->dtype != StDtype::F8_E4M3)
    return absl::InternalError(absl::StrCat(c.dir(), ": '", weight, "' is not an FP8 weight with its scale"));
  const StTensorInfo& info = *t->info;
  const int64_t rows = info.shape[0], count = info.num_elements();
  const uint8_t* codes = t->file->data(info);
  // Codes stay e4m3fn bytes as stored; a backend for e4m3fnuz devices converts them.
  for (int64_t i = 0; i < count; ++i) {
    if (fp8_is_nan(codes[i], Fp8Format::e4m3fn)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: tensor '%s' holds a non-finite value (NaN code 0x%02x) at element %d",
                          t->file->path(), weight, codes[i], i));
    }
  }
  out.w_fp8.insert(out.w_fp8.end(), codes, codes + count);
  const int64_t nscales = sc->info->num_elements();
  const uint8_t* sdata = sc->file->data(*sc->info);
  for (int64_t r = 0; r < rows; ++r)
    out.w_scale.push_back(*st_element_f32(sc->info->dtype, sdata, nscales == 1 ? 0 : r, weight));
  out.act = fp8_act(q.linear.activation);
  if (out.act == Fp8Act::static_tensor) {
    const CheckpointTensor* in = c.find(base + "input_scale");
    if (in == nullptr)
      return absl::InternalError(absl::StrCat(c.dir(), ": '", weight, "' has no input_scale"));
    // Fused shards share one activation scale: the largest of theirs, as vLLM does, so
    // that no shard's inputs saturate where they did not in calibration.
    out.input_scale =
        std::max(out.input_scale, *st_element_f32(in->info->dtype, in->file->data(*in->info), 0, weight));
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
