#include "src/loading/host_weights.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "kernels/cpu/gemm/gemm_fp8.h"
#include "src/common/arith.h"

namespace kvfuse {

namespace {

// Tensor ids for the synthetic generator.
enum : uint64_t { kEmbed = 1, kFinalNorm, kLmHead, kLayerBase = 16 };
enum : uint64_t { kAttnNorm, kFfnNorm, kQkv, kQkvBias, kO, kGateUp, kDown, kTensorsPerLayer = 16 };

// fill(begin, end) over [0, count) split across the cores (one thread below `serial`
// items): for work whose result does not depend on the split.
template <class Fill>
void on_every_core(int64_t count, int64_t serial, const Fill& fill) {
  const int64_t threads = count < serial ? 1 : std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t)
    pool.emplace_back(fill, count * t / threads, count * (t + 1) / threads);
  fill(0, count / threads);
  for (auto& th : pool) th.join();
}

// Element i of synthetic tensor `tensor` as bf16: the one formula of the bf16 presets'
// values, which the FP8 presets quantize (synth_fp8).
bf16_t synth_value(uint64_t seed, uint64_t tensor, int64_t i, float stddev, float mean) {
  return f32_to_bf16(mean + stddev * synthetic_weight(seed, tensor, uint64_t(i)));
}

// Into `out`, reusing its buffer when it already has `count` elements (the previous
// layer's tensor): a fresh one is zeroed on one core first.
void synth_into(std::vector<bf16_t>& out, uint64_t seed, uint64_t tensor, int64_t count, float stddev,
                float mean = 0.0f) {
  out.resize(static_cast<size_t>(count));
  // Counter-based values: any split of the index range gives the same tensor, so large
  // presets (8B parameters) fill on every core.
  on_every_core(count, int64_t(1) << 20, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[size_t(i)] = synth_value(seed, tensor, i, stddev, mean);
  });
}

std::vector<bf16_t> synth(uint64_t seed, uint64_t tensor, int64_t count, float stddev, float mean = 0.0f) {
  std::vector<bf16_t> out;
  synth_into(out, seed, tensor, count, stddev, mean);
  return out;
}

// A preset's FP8 form of the synthetic bf16 rows [n, k] that synth(seed, tensor, n * k,
// stddev) makes: per output row j, scale_j = amax_j / 448 (the e4m3fn range) and codes
// fp8_encode(w * (1 / scale_j)), the quantization the FP8-dynamic checkpoints the presets
// stand for carry. It is the per-row quantization of activations
// (kernels/cpu/gemm/gemm_fp8.h), applied to weight rows. Made a row at a time on every
// core, without the whole bf16 tensor: a 70B preset's layer is 0.86 GB of codes, in the
// previous layer's buffers when `h` holds them.
void synth_fp8(HostLinear& h, uint64_t seed, uint64_t tensor, int64_t n, int64_t k, float stddev, Fp8Act act) {
  h.w.clear();
  h.w_fp8.resize(size_t(n * k));
  h.w_scale.resize(size_t(n));
  on_every_core(n, 256, [&](int64_t begin, int64_t end) {
    std::vector<bf16_t> row(static_cast<size_t>(k));
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t p = 0; p < k; ++p) row[size_t(p)] = synth_value(seed, tensor, j * k + p, stddev, 0.0f);
      cpu::quantize_rows_fp8(row.data(), 1, k, Fp8Act::dynamic_token, 1.0f, Fp8Format::e4m3fn,
                             h.w_fp8.data() + j * k, h.w_scale.data() + j);
    }
  });
  h.act = act;
}

}  // namespace

float synthetic_weight(uint64_t seed, uint64_t tensor, uint64_t i) {
  // Uniform on [-sqrt(3), sqrt(3)): zero mean, unit variance.
  const uint64_t r = splitmix64(splitmix64(seed ^ (tensor << 40)) ^ i);
  const double u = double(r >> 11) * 0x1.0p-53;
  return float((2.0 * u - 1.0) * 1.7320508075688772);
}

namespace {

// The synthetic weights. Their scales keep activations near unit RMS through the
// residual stream, and make the logits peaked enough (std ~3) that greedy decoding is
// well defined.
class SyntheticWeights final : public HostWeightSource {
 public:
  SyntheticWeights(const ModelSpec& spec, uint64_t seed) : s_(spec), seed_(seed) {}

  absl::Status globals(HostGlobalWeights& g) override {
    const float in_std = 1.0f / std::sqrt(float(s_.hidden));
    g.embed = synth(seed_, kEmbed, int64_t(s_.vocab) * s_.hidden, 1.0f);
    g.final_norm = synth(seed_, kFinalNorm, s_.hidden, 0.05f, 1.0f);
    g.lm_head = HostLinear{};
    if (!s_.tie_embeddings) g.lm_head.w = synth(seed_, kLmHead, int64_t(s_.vocab) * s_.hidden, 3.0f * in_std);
    return absl::OkStatus();
  }

  absl::Status layer(int32_t l, HostLayerWeights& L) override {
    const float in_std = 1.0f / std::sqrt(float(s_.hidden));
    const uint64_t base = kLayerBase + uint64_t(l) * kTensorsPerLayer;
    // Every field is set: L may hold the previous layer, whose buffers are reused.
    synth_into(L.attn_norm, seed_, base + kAttnNorm, s_.hidden, 0.05f, 1.0f);
    synth_into(L.ffn_norm, seed_, base + kFfnNorm, s_.hidden, 0.05f, 1.0f);
    const bool fp8 = s_.quant && s_.quant->linear.format == WeightQuantFormat::fp8_e4m3;
    if (fp8 && s_.quant->linear.activation == ActivationScheme::static_tensor) {
      return absl::InvalidArgumentError("synthetic FP8 weights: static activation scales are not synthesized");
    }
    const Fp8Act act = fp8 ? fp8_act(s_.quant->linear.activation) : Fp8Act::none;
    // Rows [n, k] of tensor `id`, bf16 or in the preset's FP8 form.
    const auto proj = [&](HostLinear& h, uint64_t id, int64_t n, int64_t k, float stddev) {
      if (fp8) {
        synth_fp8(h, seed_, base + id, n, k, stddev, act);
      } else {
        synth_into(h.w, seed_, base + id, n * k, stddev);
        h.w_fp8.clear();
        h.w_scale.clear();
        h.act = Fp8Act::none;
      }
      h.input_scale = 0.0f;
      h.bias.clear();
    };
    const int64_t H = s_.hidden, I = s_.intermediate;
    proj(L.qkv, kQkv, s_.qkv_dim(), H, in_std);
    if (s_.qkv_bias) synth_into(L.qkv.bias, seed_, base + kQkvBias, s_.qkv_dim(), 0.1f);
    proj(L.o, kO, H, s_.q_dim(), 0.5f / std::sqrt(float(s_.q_dim())));
    proj(L.gate_up, kGateUp, 2 * I, H, in_std);
    proj(L.down, kDown, H, I, 0.5f / std::sqrt(float(I)));
    return absl::OkStatus();
  }

 private:
  ModelSpec s_;
  uint64_t seed_;
};

}  // namespace

std::unique_ptr<HostWeightSource> make_synthetic_weights(const ModelSpec& spec, uint64_t seed) {
  return std::make_unique<SyntheticWeights>(spec, seed);
}

}  // namespace kvfuse
