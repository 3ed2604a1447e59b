// A Llama-family decoder (Llama-3, Qwen2 with QKV bias, Mistral with a window on every
// layer, and hybrids of window and full layers) running on a Backend: the weights in
// the backend's layouts and the ops of one forward pass. What a pass runs on — the
// batch metadata in device memory, the activations, graphs — is the ModelRunner's
// (src/runtime/model_runner.h).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backends/backend.h"
#include "src/loading/host_weights.h"
#include "src/loading/model_spec.h"
#include "src/parallel/communicator.h"
#include "src/runtime/kv_pool.h"

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
  // The logit processors (kernels/ops/sampling.h), or null when no row has any: row r's
  // entries are adjust[adjust_start[r] .. adjust_start[r + 1]).
  const int32_t* adjust_start = nullptr;  // [R + 1]
  LogitAdjust* adjust = nullptr;

  bf16_t *x = nullptr, *h = nullptr, *qkv = nullptr, *attn = nullptr;  // [T, hidden / qkv_dim / q_dim]
  bf16_t *gate_up = nullptr, *act = nullptr;                           // [T, 2 intermediate / intermediate]
  bf16_t* last = nullptr;                                              // [R, hidden]

  float* logits = nullptr;    // out: [logits_capacity >= R, vocab]
  // Tensor parallelism: this rank's slice of the logits [logits_capacity, shard vocab] and
  // the gathered slices of all ranks [tp, logits_capacity, shard vocab]; unused at tp 1.
  float* logits_shard = nullptr;
  float* logits_gathered = nullptr;
  int32_t* tokens = nullptr;  // out: [3, R] greedy tokens, finiteness flags, sampled tokens

  // Logprobs (kernels/ops/sampling.h). Per logits row, or null when no row asks.
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

// This rank's part of the model (tensor parallelism; src/loading/model_spec.h): which
// shard, and the communicator of its group. tp 1 is the whole model and needs none.
struct ModelShard {
  TensorParallelShard shard;  // tp 1: the whole model
  int32_t rank = 0;        // in the group
  int32_t local_rank = 0;  // in this process: its KV storage in the pool (KvPool::add_rank)
  Communicator* comm = nullptr;  // required when shard.tp > 1
};

// The widths of one rank's activations: the whole model's at tp 1.
struct RankDims {
  int32_t q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t intermediate = 0;
  int32_t vocab = 0;  // this rank's rows of the lm_head (padded vocabulary / tp)
  int64_t q_dim() const { return int64_t(q_heads) * head_dim; }
  int64_t kv_dim() const { return int64_t(kv_heads) * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
};

class Model {
 public:
  // Uploads host weights; `spec` must describe their shapes. `after_layer(n)`, when set,
  // is called once n decoder layers are uploaded (n = 1 ... num_layers).
  static absl::StatusOr<std::unique_ptr<Model>> create(Backend& backend, const ModelSpec& spec,
                                                       HostWeightSource& weights,
                                                       const std::function<void(int32_t)>& after_layer = {});
  // A rank's model with no weights yet: load_globals and load_layer (every layer) take the
  // whole model's host weights and upload this rank's slices. The host weights can then be
  // read once and handed to every rank.
  static absl::StatusOr<std::unique_ptr<Model>> create_shard(Backend& backend, const ModelSpec& spec,
                                                             const ModelShard& shard);
  absl::Status load_globals(const HostGlobalWeights& g);
  absl::Status load_layer(int32_t layer, const HostLayerWeights& h);

  // The whole model's shapes (at any tp).
  const ModelSpec& spec() const { return spec_; }
  const ModelShard& shard() const { return shard_; }
  const RankDims& dims() const { return dims_; }
  int32_t tp() const { return shard_.shard.tp; }

  // Runs every layer over the pass's tokens, writing their K/V into `pool` (this rank's
  // heads), then the final norm, the logits of the pass's logits rows, and each row's
  // greedy token, finiteness flag and (temperature > 0) sampled token. Only device work,
  // no host synchronisation: a graph can record it. At tp > 1 the O and down projections
  // end in an all-reduce and the logits in a gather, so every rank of the group must run
  // the same pass at the same time; only rank 0 picks tokens and logprobs.
  absl::Status forward(const DecoderPass& pass, KvPool& pool, KvWritePath write, AttentionPath attention);

 private:
  struct Layer {
    DeviceBuffer attn_norm, ffn_norm;  // [hidden] bf16
    LinearWeight qkv, o, gate_up, down;
  };
  Model(Backend& backend, ModelSpec spec, ModelShard shard);
  absl::Status init_rope();
  // The lm_head's rows of this rank's vocabulary slice, then the gather of all ranks'
  // logits into `logits` [rows, vocab] (at tp 1: the lm_head straight into `logits`).
  absl::Status logits_rows(const DecoderPass& p, int64_t rows, float* logits);

  Backend& backend_;
  ModelSpec spec_;
  ModelShard shard_;
  RankDims dims_;
  DeviceBuffer embed_;       // [vocab, hidden] bf16 (whole, on every rank)
  DeviceBuffer final_norm_;  // [hidden] bf16
  DeviceBuffer rope_inv_freq_;  // [head_dim / 2] fp32 (src/loading/rope.h)
  float rope_attention_scaling_ = 1.0f;
  LinearWeight lm_head_;
  std::vector<Layer> layers_;
  int32_t layers_loaded_ = 0;
  bool globals_loaded_ = false;
};

}  // namespace kvfuse
