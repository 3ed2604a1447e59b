// The KV pool's configuration (docs/design.md#paged-kv-cache-layout): the geometry of
// the cache, which layers use the sliding window and its SWA pool, and the initial
// per-layer scales (docs/design.md#kv-scales). A config is untrusted input:
// validate_kv_pool_config checks every field and every size derived from them before
// anything is allocated.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/common/kv_types.h"

namespace kvfuse {

struct KvPoolConfig {
  int32_t num_layers = 0;
  int32_t page_size = 16;
  int64_t num_pages = 0;      // full pool
  int64_t swa_num_pages = 0;  // SWA pool; used only if some layer is SWA
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  KvFormat format = KvFormat::bf16;
  std::vector<bool> layer_is_swa;  // [num_layers]
  int32_t window = 0;              // keys per query in SWA layers
  int64_t max_step_tokens = 0;     // tokens a sequence grows by in one step at most (SWA page bound)
  std::vector<float> k_scale;      // [num_layers]
  std::vector<float> v_scale;      // [num_layers]
  // The prefix cache (src/runtime/kv/prefix_cache.h), kept without SWA layers only, and
  // what besides the format and scales makes this pool's KV differ from another's (the
  // model, RoPE): the chains' salt.
  bool prefix_cache = false;
  uint64_t prefix_cache_salt = 0;
};

// Whether some layer uses sliding-window attention (and so the pool has an SWA pool).
bool has_swa_layers(const KvPoolConfig& cfg);

// INVALID_ARGUMENT naming the first bad field ("kv pool: ..."), or OK.
absl::Status validate_kv_pool_config(const KvPoolConfig& cfg);

}  // namespace kvfuse
