// The device memory the engine plans and reports (docs/design.md#device-memory): the KV
// pool's pages from what the device has free once the weights and workspaces are in,
// less a stated headroom, and the split of the device's memory that the start-up log and
// GetInfo show.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "src/loading/model_spec.h"
#include "src/runtime/kv/pool_config.h"

namespace kvfuse {

// Where the device's memory went. The first three are counted by Backend::allocated_bytes
// around what allocates them; graph_bytes is what the device lost between the end of
// loading and the end of the graph warm-up beyond kvfuse's own allocations (captured
// graphs, library workspaces), on backends with graphs.
struct MemorySplit {
  int64_t weight_bytes = 0;     // the model's weights (and their scales) on the device
  int64_t kv_pool_bytes = 0;    // the KV pool: K and V pages of every layer, scales, SWA table
  int64_t workspace_bytes = 0;  // activations, scratch, GEMM workspaces (grown by the warm-up)
  int64_t graph_bytes = 0;      // captured graphs and library memory (0 without graphs)
  int64_t device_total_bytes = 0;
  int64_t device_free_bytes = 0;  // free after the warm-up (or after loading, before it)
  int64_t headroom_bytes = 0;     // memory_headroom_gib
  bool pool_auto = false;         // num_pages 0: the pool took what was free less the headroom
};

// "weights 7.48 GiB, KV pool 60.00 GiB (sized to fit), ...": one line for logs and messages.
std::string describe_memory(const MemorySplit& m);

// RESOURCE_EXHAUSTED naming the sizes when the model's weights would take more than 80%
// of `available_gib` (the CPU backend's check at engine creation; <= 0: unknown, ok).
absl::Status check_cpu_weight_memory(const ModelSpec& spec, double available_gib);

// The bytes KvStorage::create allocates for `cfg` (src/runtime/kv/kv_storage.cc): every
// layer's K and V pages (the SWA pool's for SWA layers), the four per-layer scale rows,
// and the SWA slot table when a layer uses the window.
int64_t kv_pool_bytes(const KvPoolConfig& cfg);
// The same for a pool of `spec`'s layers, KV heads and window layers, `full_pages` and
// `swa_pages` pages of page_size tokens stored as `format`.
int64_t kv_pool_bytes(const ModelSpec& spec, int32_t page_size, KvFormat format, int64_t full_pages,
                      int64_t swa_pages);

// What the pool may take: the device's free bytes now, the headroom to leave, and what is
// already in (for the message).
struct PoolBudget {
  int64_t free_bytes = 0;       // free on the device now
  int64_t headroom_bytes = 0;   // to stay free after the pool
  int64_t weight_bytes = 0;     // in the device's memory already (or about to be: estimate)
  int64_t workspace_bytes = 0;  // likewise
  int64_t total_bytes = 0;      // the device's memory in all
  bool weights_estimated = false;  // before loading: weight_bytes is the model's, not measured
};

// The full pool's pages. `requested` > 0: those pages, if the pool (with the SWA pool
// `swa_pages(pages)` gives) fits in free − headroom; else RESOURCE_EXHAUSTED naming every
// number and the most pages that fit. `requested` 0: the most pages that fit (at least
// one, else RESOURCE_EXHAUSTED). `cfg` is the pool's geometry; its page counts are ignored.
absl::StatusOr<int64_t> plan_pool_pages(const KvPoolConfig& cfg, const std::function<int64_t(int64_t)>& swa_pages,
                                        const PoolBudget& budget, int64_t requested);

}  // namespace kvfuse
