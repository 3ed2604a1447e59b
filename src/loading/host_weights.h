// Host bf16 weights in the model's fused layouts, and the deterministic synthetic
// weights of the presets. A source hands them over one piece at a time, so that a
// checkpoint loader holds at most one layer (or the embeddings) in host memory.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/common/bf16.h"
#include "kernels/common/fp8.h"
#include "src/loading/model_spec.h"

namespace kvfuse {

// A projection's weight: bf16, or FP8 kept as FP8 (w empty, w_fp8 set): e4m3fn codes with
// one scale per output channel (per-tensor scales of a checkpoint arrive expanded, fused
// shards with each shard's own), computed as kernels/cpu/gemm/gemm_fp8.h says.
struct HostLinear {
  std::vector<bf16_t> w;       // [n, k] row-major (out_features x in_features); empty when FP8
  std::vector<bf16_t> bias;    // [n], or empty
  std::vector<uint8_t> w_fp8;  // [n, k] e4m3fn codes, when FP8
  std::vector<float> w_scale;  // [n], when FP8
  Fp8Act act = Fp8Act::none;   // FP8: how the input activations are quantized
  float input_scale = 0.0f;    // FP8 with Fp8Act::static_tensor: the activation scale
  bool fp8() const { return !w_fp8.empty(); }
};
struct HostLayerWeights {
  std::vector<bf16_t> attn_norm, ffn_norm;  // [hidden]
  HostLinear qkv;                           // [q_dim + 2 kv_dim, hidden]: rows q, then k, then v
  HostLinear o;                             // [hidden, q_dim]
  HostLinear gate_up;                       // [2 intermediate, hidden]: rows gate, then up
  HostLinear down;                          // [hidden, intermediate]
};
struct HostGlobalWeights {
  std::vector<bf16_t> embed;       // [vocab, hidden]
  std::vector<bf16_t> final_norm;  // [hidden]
  HostLinear lm_head;              // [vocab, hidden]; empty with tie_embeddings (the embedding is used)
};
class HostWeightSource {
 public:
  virtual ~HostWeightSource() = default;
  virtual absl::Status globals(HostGlobalWeights& out) = 0;
  // Sets every tensor of `out` to layer `layer`'s. `out` may hold the previous layer's
  // tensors, as the loaders pass one object for every layer: a source may reuse their
  // buffers (the synthetic weights do: a fresh 1 GB buffer is zeroed on one core).
  virtual absl::Status layer(int32_t layer, HostLayerWeights& out) = 0;
};

// Deterministic synthetic weights from `seed`: the weights of a preset run without a
// checkpoint.
std::unique_ptr<HostWeightSource> make_synthetic_weights(const ModelSpec& spec, uint64_t seed);

// Deterministic synthetic weight value i of tensor `tensor` (counter-based, so any
// device can generate the same weights independently).
float synthetic_weight(uint64_t seed, uint64_t tensor, uint64_t i);

}  // namespace kvfuse
