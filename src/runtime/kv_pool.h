// The paged KV cache: page allocators, per-sequence page tables, slot mapping, and
// the per-layer K/V buffers and scales in device memory (docs/design.md#paged-kv-cache-layout).
//
// Layers are either full-attention layers, whose pages come from the full pool, or
// sliding-window layers, whose pages come from a separate, smaller SWA pool. Every
// token has a slot in the full pool (the slot namespace of the step's slot_mapping,
// even when no layer stores data there); SWA layers find their slot through the
// full_to_swa table. SWA pages that fall wholly out of the window are freed as a
// sequence grows.
//
// KvPool is the one interface the engine, scheduler, model runner and server use. It is
// composed of one piece per job (src/runtime/kv/):
// - PageAllocator (page_allocator.h): a pool's free list and reference counts, one for
//   the full pool and one for the SWA pool;
// - PageTables (page_tables.h): each sequence's pages and the slots of its positions;
// - KvStorage (kv_storage.h): one rank's K/V buffers, scales and device SWA table;
// - SwaMap (swa_map.h): the host full_to_swa table and the logs of its changes;
// - check_kv_pool_invariants (invariants.h): that they all agree.
// KvPool itself owns the config and keeps the pieces in step: it allocates before the
// tables grow, frees and unmaps what they drop, and mirrors every SWA page placed or
// freed in the SwaMap, which each storage uploads at its sync.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/common/kv_types.h"
#include "src/backends/backend.h"
#include "src/runtime/kv/kv_storage.h"
#include "src/runtime/kv/page_allocator.h"
#include "src/runtime/kv/page_tables.h"
#include "src/runtime/kv/pool_config.h"
#include "src/runtime/kv/prefix_cache.h"
#include "src/runtime/kv/swa_map.h"

namespace kvfuse {

enum class PoolKind { full, swa };

struct PoolUsage {
  int64_t total_pages = 0;
  int64_t used_pages = 0;  // pages in use, each counted once however many sequences hold it
  int64_t free_pages = 0;
  int64_t shared_pages = 0;  // of the used pages, those held by more than one sequence
};

// One allocator and one set of page tables serve every tensor-parallel rank of a process:
// a sequence has the same pages on each rank. Each rank has its own storage — its KV
// heads' K/V buffers, the scales and the SWA slot table, in its backend's memory — and
// `storage` below picks it (0 with one rank). cfg.num_kv_heads is the heads of one rank.
class KvPool {
 public:
  // A pool with one storage, on `backend`.
  static absl::StatusOr<std::unique_ptr<KvPool>> create(Backend& backend, const KvPoolConfig& cfg);
  // A pool of `num_storages` ranks whose storage add_storage makes, one call per rank.
  static absl::StatusOr<std::unique_ptr<KvPool>> create_shared(const KvPoolConfig& cfg, int32_t num_storages);
  // Allocates storage `index` on `backend` (zeroed K/V, the scales, the SWA table). Calls
  // for different indices may run at once, each on its rank's thread; before any step.
  absl::Status add_storage(int32_t index, Backend& backend);
  int32_t num_storages() const { return int32_t(storages_.size()); }

  const KvPoolConfig& config() const { return cfg_; }
  bool has_swa() const { return swa_alloc_ != nullptr; }
  int64_t page_bytes_per_layer() const;  // K plus V bytes of one page of one layer

  // Sequences. add: ALREADY_EXISTS if live. release: NOT_FOUND if unknown.
  absl::Status add_sequence(SeqId id);
  bool contains(SeqId id) const { return tables_.contains(id); }
  // Releases the sequence's pages; those the prefix cache holds stay cached, evictable.

  absl::Status release(SeqId id);
  size_t num_sequences() const { return tables_.size(); }

  // ---- The prefix cache (src/runtime/kv/prefix_cache.h, docs/design.md#prefix-cache): on
  // when the config asks for it and the pool has no SWA layers. Cached pages no sequence
  // holds count as free (usage().free_pages): a reservation evicts them, least recently
  // released first, before it could fail.
  bool caching() const { return cache_ != nullptr; }
  // Gives sequence `id` (live, nothing reserved) the pages of the longest cached prefix of
  // tokens[0, limit), whole pages, and returns the tokens they hold (0 with caching off).
  // Counts a query of `limit` tokens and its hits.
  absl::StatusOr<int32_t> take_cached_prefix(SeqId id, const std::vector<int32_t>& tokens, int64_t limit);
  // The sequence's first `computed` tokens have their KV in its pages: its whole pages join
  // the cache. Nothing with caching off or for an unknown id.
  void cache_computed(SeqId id, const std::vector<int32_t>& tokens, int32_t computed);
  // Evicts every cached page no sequence holds; returns how many. When that empties the
  // cache, all_blocks_cleared follows the removals.
  int64_t flush_cache();
  // The cache's events since the last take (src/runtime/kv/prefix_cache.h, KvEvent).
  std::vector<KvEvent> take_kv_events();
  struct CacheStats {
    int64_t query_tokens = 0;  // prompt tokens looked up
    int64_t hit_tokens = 0;    // of those, found cached
    int64_t cached_pages = 0;  // pages whose KV the cache holds
    int64_t evictable_pages = 0;  // of those, held by no sequence
  };
  CacheStats cache_stats() const;

  // ---- Page policy: how many pages a sequence takes, for admission and reservation.
  // Pages leaving the window are freed after every step, so the SWA pages a sequence
  // holds at once span at most min(len, window + max_step_tokens) tokens, plus one for
  // a window that starts inside a page. The engine sizes the SWA pool from this bound.
  static int64_t max_swa_pages_held(const KvPoolConfig& cfg,
                                    int64_t len = std::numeric_limits<int64_t>::max());
  // Pages that reserve(id, new_len) would take now. An unknown id is an empty sequence.
  PagesNeeded pages_needed(SeqId id, int32_t new_len) const;
  // Pages the sequence holds now (SWA: those still mapped); none for an unknown id.
  PagesNeeded pages_held(SeqId id) const;
  // Pages still to reserve, over the steps to come, for the sequence to reach `len`
  // tokens: the SWA part bounded by max_swa_pages_held.
  PagesNeeded pages_to_reach(SeqId id, int32_t len) const;
  // Pages beyond those held that the sequence may hold at once on its way to `len`
  // tokens: what admission promises a sequence (SWA counted at its bound for `len`).
  PagesNeeded pages_to_hold(SeqId id, int64_t len) const;
  // Makes room for positions [len, new_len): full-pool pages for them, and SWA pages
  // for the SWA layers. All or nothing: RESOURCE_EXHAUSTED leaves the sequence as it was.
  absl::Status reserve(SeqId id, int32_t new_len);
  // Frees SWA pages no future query can see: every position < new_len - window + 1.
  void trim_window(SeqId id);

  int32_t reserved_len(SeqId id) const;
  // Full-pool slot of a position (the step's slot_mapping entry).
  int64_t slot(SeqId id, int32_t pos) const;
  // Page table of a sequence in a pool; -1 entries are SWA pages already freed.
  const std::vector<int32_t>& page_table(SeqId id, PoolKind kind) const;

  // Device views of one layer's cache, and of the SWA slot table for SWA layers.
  PagedKvView layer_view(int32_t layer, int32_t storage = 0) const;
  bool layer_is_swa(int32_t layer) const { return cfg_.layer_is_swa[size_t(layer)]; }
  SwaSlotTable swa_table(int32_t storage = 0) const;
  // Uploads the SWA slot-table entries changed since the last sync of that storage. Call
  // before a step: each rank for its own storage (concurrently), or for all of them.
  absl::Status sync_swa_table(int32_t storage);
  absl::Status sync_swa_table();
  // Tensor parallelism across processes: rank 0's pool (the one that allocates) records,
  // from track_swa_changes() on, the full pages whose SWA table entries changed, and
  // take_swa_changes() hands them over with their mapping now, for another process's pool
  // of the same geometry, which allocates nothing itself, to apply to its own table
  // (apply_swa_changes; its storage uploads them at its next sync_swa_table).
  void track_swa_changes();
  std::vector<SwaPageMapping> take_swa_changes();
  absl::Status apply_swa_changes(const std::vector<SwaPageMapping>& changes);
  // Sets the scales of a layer (written to the device memory of every storage).
  absl::Status set_scales(int32_t layer, float k_scale, float v_scale);

  PoolUsage usage(PoolKind kind) const;
  // Host copy of the SWA slot table, for tests.
  const std::vector<int64_t>& host_swa_table() const;
  // Checks every internal invariant (ownership, table consistency); for tests.
  absl::Status check_invariants() const;

 private:
  explicit KvPool(KvPoolConfig cfg);
  uint64_t cache_salt() const;
  // Dies if storage `index` does not exist (out of range, or not added yet).
  const KvStorage& storage(int32_t index) const;
  KvStorage& storage(int32_t index) { return const_cast<KvStorage&>(std::as_const(*this).storage(index)); }

  KvPoolConfig cfg_;  // its scales are the ones set last (set_scales)
  std::unique_ptr<PageAllocator> full_alloc_;
  std::unique_ptr<PageAllocator> swa_alloc_;  // null without SWA layers
  PageTables tables_;
  std::unique_ptr<SwaMap> swa_map_;                   // null without SWA layers
  std::unique_ptr<PrefixCache> cache_;                // null with caching off
  int64_t query_tokens_ = 0, hit_tokens_ = 0;
  std::vector<std::unique_ptr<KvStorage>> storages_;  // [num_storages]; null until added
};

}  // namespace kvfuse
