// A Llama-family decoder (Llama-3, Qwen2 with QKV bias, Mistral with a window on every
// layer, and hybrids of window and full layers) running on a Backend.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backend.h"
#include "src/kv_pool.h"
#include "src/model_spec.h"

namespace kvfuse {

// Host-side metadata of one forward pass, built by the engine (nano-vllm style).
struct ForwardBatch {
  std::vector<int32_t> token_ids;         // [T]
  std::vector<int32_t> positions;         // [T]
  std::vector<int64_t> slot_mapping;      // [T] full-pool slots, -1 = skip
  std::vector<int32_t> query_start;       // [S + 1]
  std::vector<int32_t> context_len;       // [S]
  std::vector<int32_t> block_table_full;  // [S, max_pages_per_seq]
  std::vector<int32_t> block_table_swa;   // [S, max_pages_per_seq], empty without SWA layers
  int32_t max_pages_per_seq = 0;
  int32_t max_query_len = 0;
  int32_t max_context_len = 0;
  std::vector<int32_t> logits_rows;  // rows of T whose logits are returned

  int64_t num_tokens() const { return int64_t(token_ids.size()); }
  int32_t num_seqs() const { return int32_t(context_len.size()); }
};

struct ForwardOptions {
  KvWritePath kv_write = KvWritePath::fused;
  AttentionPath attention = AttentionPath::unified;
};

// Host bf16 weights in the model's fused layouts, handed over one piece at a time so that
// a checkpoint loader holds at most one layer (or the embeddings) in host memory.
struct HostLinear {
  std::vector<bf16_t> w;     // [n, k] row-major (out_features x in_features)
  std::vector<bf16_t> bias;  // [n], or empty
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
  virtual absl::Status layer(int32_t layer, HostLayerWeights& out) = 0;
};

// The deterministic synthetic weights of Model::create_synthetic.
std::unique_ptr<HostWeightSource> make_synthetic_weights(const ModelSpec& spec, uint64_t seed);

class Checkpoint;

struct ModelLimits {
  int64_t max_tokens = 0;  // rows of one forward pass
  int32_t max_seqs = 0;
  int32_t max_pages_per_seq = 0;
};

class Model {
 public:
  // Builds the model with deterministic synthetic weights from `seed`.
  static absl::StatusOr<std::unique_ptr<Model>> create_synthetic(Backend& backend, const ModelSpec& spec,
                                                                 uint64_t seed, const ModelLimits& limits);
  // Builds the model from host weights; `spec` must describe their shapes.
  static absl::StatusOr<std::unique_ptr<Model>> create_from_weights(Backend& backend, const ModelSpec& spec,
                                                                    HostWeightSource& weights,
                                                                    const ModelLimits& limits);
  // Builds the model from a checkpoint's weights. `spec` is the checkpoint's spec with
  // the config's sliding-window overrides applied; its shapes must be the checkpoint's.
  static absl::StatusOr<std::unique_ptr<Model>> create_from_checkpoint(Backend& backend,
                                                                       const ModelSpec& spec,
                                                                       const Checkpoint& checkpoint,
                                                                       const ModelLimits& limits);

  const ModelSpec& spec() const { return spec_; }
  const ModelLimits& limits() const { return limits_; }

  // Runs the batch, writes the new K/V of every layer into `pool`, and returns the
  // logits of `batch.logits_rows` as [rows, vocab] fp32 on the host.
  absl::Status forward(const ForwardBatch& batch, KvPool& pool, const ForwardOptions& opts,
                       std::vector<float>& logits);

 private:
  struct Layer {
    DeviceBuffer attn_norm, ffn_norm;  // [hidden] bf16
    LinearWeight qkv, o, gate_up, down;
  };
  Model(Backend& backend, ModelSpec spec, ModelLimits limits)
      : backend_(backend), spec_(std::move(spec)), limits_(limits) {}
  absl::Status init_weights(HostWeightSource& weights);
  absl::Status init_workspace();
  absl::Status upload_batch(const ForwardBatch& b);

  Backend& backend_;
  ModelSpec spec_;
  ModelLimits limits_;
  DeviceBuffer embed_;       // [vocab, hidden] bf16
  DeviceBuffer final_norm_;  // [hidden] bf16
  LinearWeight lm_head_;
  std::vector<Layer> layers_;

  // Workspace, sized for limits_.
  DeviceBuffer x_, h_, qkv_, attn_, gate_up_, act_, last_, logits_, kv_scratch_;
  DeviceBuffer ids_, pos_, slots_, qstart_, ctx_, bt_full_, bt_swa_, rows_;
};

// Deterministic synthetic weight value i of tensor `tensor` (counter-based, so any
// device can generate the same weights independently).
float synthetic_weight(uint64_t seed, uint64_t tensor, uint64_t i);

}  // namespace kvfuse
