// A Llama-family decoder (Llama-3, Qwen2 with QKV bias, Mistral with a window on every
// layer, and hybrids of window and full layers) running on a Backend: the weights in
// the backend's layouts and the ops of one forward pass. What a pass runs on — the
// batch metadata in device memory, the activations, graphs — is the ModelRunner's
// (src/runtime/model_runner.h).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backends/backend.h"
#include "src/loading/host_weights.h"
#include "src/runtime/kv_pool.h"
#include "src/loading/model_spec.h"

namespace kvfuse {

// One forward pass as the decoder sees it: the batch in device memory and the working
// memory, all sized and owned by the caller. Activations are [tokens, width] rows.
struct DecoderPass {
  const int32_t* token_ids = nullptr;     // [T]
  const int32_t* positions = nullptr;     // [T]
  const int64_t* slot_mapping = nullptr;  // [T] full-pool slots, -1 = skip
  AttnBatch batch;                        // shapes, query_start, context_len (block_table unset)
  const int32_t* block_table_full = nullptr;
  const int32_t* block_table_swa = nullptr;
  const int32_t* logits_rows = nullptr;  // [R] rows of T whose tokens are computed
  int64_t num_logits_rows = 0;
  const RowSampling* sampling = nullptr;  // [R]

  bf16_t *x = nullptr, *h = nullptr, *qkv = nullptr, *attn = nullptr;  // [T, hidden / qkv_dim / q_dim]
  bf16_t *gate_up = nullptr, *act = nullptr;                           // [T, 2 intermediate / intermediate]
  bf16_t* last = nullptr;                                              // [R, hidden]

  float* logits = nullptr;    // out: [logits_capacity >= R, vocab]
  int32_t* tokens = nullptr;  // out: [3, R] greedy tokens, finiteness flags, sampled tokens

  // Logprobs (kernels/sampling.h). Per logits row, or null when no row asks.
  const LogprobRow* logprobs = nullptr;  // [R]
  // Rows of T whose logits serve logprobs only (a prompt token's, its target the next
  // token): run in chunks of logits_capacity rows through `last` and `logits` before the
  // logits rows, which therefore end in `logits`.
  const int32_t* extra_rows = nullptr;          // [E]
  const LogprobRow* extra_logprobs = nullptr;  // [E]
  int64_t num_extra_rows = 0;
  int64_t logits_capacity = 0;       // rows of `last` and `logits`
  LogprobOut* logprob_out = nullptr;  // out: [R + E], logits rows first
};

class Model {
 public:
  // Uploads host weights; `spec` must describe their shapes.
  static absl::StatusOr<std::unique_ptr<Model>> create(Backend& backend, const ModelSpec& spec,
                                                       HostWeightSource& weights);

  const ModelSpec& spec() const { return spec_; }

  // Runs every layer over the pass's tokens, writing their K/V into `pool`, then the
  // final norm, the logits of the pass's logits rows, and each row's greedy token,
  // finiteness flag and (temperature > 0) sampled token. Only device work, no host
  // synchronisation: a graph can record it.
  absl::Status forward(const DecoderPass& pass, KvPool& pool, KvWritePath write, AttentionPath attention);

 private:
  struct Layer {
    DeviceBuffer attn_norm, ffn_norm;  // [hidden] bf16
    LinearWeight qkv, o, gate_up, down;
  };
  Model(Backend& backend, ModelSpec spec) : backend_(backend), spec_(std::move(spec)) {}
  absl::Status init_weights(HostWeightSource& weights);

  Backend& backend_;
  ModelSpec spec_;
  DeviceBuffer embed_;       // [vocab, hidden] bf16
  DeviceBuffer final_norm_;  // [hidden] bf16
  DeviceBuffer rope_inv_freq_;  // [head_dim / 2] fp32 (src/loading/rope.h)
  float rope_attention_scaling_ = 1.0f;
  LinearWeight lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace kvfuse
