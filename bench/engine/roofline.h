// Byte counting of kvfuse-bench-engine: what one decode step must read from device
// memory at the least (weights once, each sequence's attended K/V once), the memory
// roofline that follows from a peak bandwidth, and the KV pool a benchmark cell needs.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "src/loading/model_spec.h"

namespace kvfuse::bench {

// The shapes one rank of a tensor-parallel group of `tp` ranks holds (heads, intermediate
// and lm_head rows divided, KV heads split or replicated; src/loading/model_spec.h): the
// byte counts below of this spec are one GPU's. tp 1: `spec` itself.
absl::StatusOr<ModelSpec> rank_shapes(const ModelSpec& spec, int tp);

// bf16 weight bytes one decode step reads: every layer, the final norm and the lm_head
// (the embedding table when tied). An untied embedding table is left out: a step reads
// only its batch rows of it.
int64_t decode_weight_bytes(const ModelSpec& spec);

// K and V bytes one decode step reads for one sequence whose query attends
// `context_len` keys (its own new token included): context_len keys in full layers,
// min(context_len, window) in sliding-window layers.
int64_t decode_kv_bytes_per_seq(const ModelSpec& spec, int64_t context_len, int kv_elem_bytes);

// Weights plus the KV of `batch` sequences of `context_len` keys each.
int64_t decode_step_bytes(const ModelSpec& spec, int64_t batch, int64_t context_len, int kv_elem_bytes);

// Milliseconds to move `bytes` at `peak_gbs` GB/s (1 GB = 1e9 bytes).
double roofline_ms(double bytes, double peak_gbs);

// The KV pool (pages and device bytes) that `batch` sequences growing to `max_len`
// tokens need, sized the way the engine sizes its pools: a full-pool page table per
// sequence (plus one spare page), and for sliding-window layers a window plus one
// step's chunk of `max_batch_tokens` (at most the full table).
struct KvFootprint {
  int64_t full_pages = 0;
  int64_t swa_pages = 0;  // 0 without sliding-window layers
  int64_t bytes = 0;      // over all layers, K and V
};
KvFootprint kv_footprint(const ModelSpec& spec, int32_t page_size, int kv_elem_bytes, int64_t batch,
                         int64_t max_len, int32_t max_batch_tokens);
// Device bytes of pools of the given page counts.
int64_t kv_pool_bytes(const ModelSpec& spec, int32_t page_size, int kv_elem_bytes, int64_t full_pages,
                      int64_t swa_pages);

}  // namespace kvfuse::bench
