#include "bench/engine/roofline.h"

#include <algorithm>

#include "src/common/arith.h"
#include "src/runtime/kv_pool.h"
#include "src/runtime/memory_plan.h"

namespace kvfuse::bench {

absl::StatusOr<ModelSpec> rank_shapes(const ModelSpec& spec, int tp) {
  auto shard = tensor_parallel_shard(spec, tp);
  if (!shard.ok()) return shard.status();
  if (tp == 1) return spec;
  ModelSpec r = spec;
  r.num_q_heads = shard->num_q_heads;
  r.num_kv_heads = shard->num_kv_heads;
  r.intermediate = shard->intermediate;
  r.vocab = shard->vocab;  // the lm_head's rows; the (replicated) embedding is read by rows only
  r.tie_embeddings = false;
  return r;
}

int64_t decode_weight_bytes(const ModelSpec& spec) {
  // weight_bytes() counts the (bf16) embedding table and, untied, the lm_head beside it;
  // the untied table is not read as a whole. FP8 projections count a byte a weight and
  // their scales.
  const int64_t embed = int64_t(spec.vocab) * spec.hidden;
  return spec.weight_bytes() - (spec.tie_embeddings ? 0 : 2 * embed);
}

int64_t decode_kv_bytes_per_seq(const ModelSpec& spec, int64_t context_len, int kv_elem_bytes) {
  int64_t keys = 0;
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    const bool swa =
        size_t(l) < spec.layer_is_swa.size() && spec.layer_is_swa[size_t(l)] && spec.sliding_window > 0;
    keys += swa ? std::min<int64_t>(context_len, spec.sliding_window) : context_len;
  }
  return keys * spec.kv_dim() * 2 * kv_elem_bytes;
}

int64_t decode_step_bytes(const ModelSpec& spec, int64_t batch, int64_t context_len, int kv_elem_bytes) {
  return decode_weight_bytes(spec) + batch * decode_kv_bytes_per_seq(spec, context_len, kv_elem_bytes);
}

double roofline_ms(double bytes, double peak_gbs) { return bytes / (peak_gbs * 1e6); }

int64_t kv_pool_bytes(const ModelSpec& spec, int32_t page_size, int kv_elem_bytes, int64_t full_pages,
                      int64_t swa_pages) {
  return kvfuse::kv_pool_bytes(spec, page_size, kv_elem_bytes == 1 ? KvFormat::fp8_e4m3fn : KvFormat::bf16,
                               full_pages, swa_pages);
}

KvFootprint kv_footprint(const ModelSpec& spec, int32_t page_size, int kv_elem_bytes, int64_t batch,
                         int64_t max_len, int32_t max_batch_tokens) {
  KvFootprint f;
  const int64_t full_per_seq = ceil_div(max_len, page_size) + 1;
  f.full_pages = batch * full_per_seq;
  if (spec.any_swa()) {
    // The engine sizes its SWA pool from the same bound.
    KvPoolConfig pc;
    pc.page_size = page_size;
    pc.window = spec.sliding_window;
    pc.max_step_tokens = max_batch_tokens;
    const int64_t swa_per_seq = KvPool::max_swa_pages_held(pc);
    f.swa_pages = batch * std::min(full_per_seq, swa_per_seq);
  }
  f.bytes = kv_pool_bytes(spec, page_size, kv_elem_bytes, f.full_pages, f.swa_pages);
  return f;
}

}  // namespace kvfuse::bench
