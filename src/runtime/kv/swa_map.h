// SwaMap: the full_to_swa slot table, host side, and the logs of its changes
// (docs/design.md#sliding-window-and-the-swa-pool, docs/design.md#padding-slots).
//
// Every token has a slot in the full pool; sliding-window layers store it in the SWA pool
// and find their slot through this table: one int64 entry per full-pool slot, the SWA slot
// or -1 for none. Entries change a whole page at a time: a full page is mapped to an SWA
// page (entry o of the page is swa_page * page_size + o) or unmapped (all -1).
//
// Owns: the host table, and which full pages changed since each reader last looked:
// - one sync log per storage (a rank's device copy of the table, src/runtime/kv/kv_storage.h):
//   the pages to upload at its next sync. A log records from open_sync_log on, which its
//   storage calls once it has uploaded the whole table;
// - the change log for tensor parallelism across processes: from track_changes() on, the
//   pages whose mapping take_changes() hands to another process's pool (apply_changes).
//
// Invariants:
// - every entry is -1 or swa_page * page_size + o with swa_page in [0, num_swa_pages), and
//   the entries of one full page are all -1 or all of one SWA page, in order;
// - a device copy equals the host table once the pages of its sync log are uploaded;
// - the logs may repeat a page; each is deduplicated once it outgrows 2 * num_full_pages + 64
//   entries, so it stays bounded however long no one reads it.
// Which SWA page belongs to which sequence, and freeing SWA pages, are the page tables' and
// the SWA allocator's: this table only mirrors them (KvPool keeps them in step).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace kvfuse {

// A full-pool page's SWA page (-1: none), as the SWA slot table maps it.
struct SwaPageMapping {
  int32_t full_page = 0;
  int32_t swa_page = -1;
};

class SwaMap {
 public:
  // A table of num_full_pages * page_size entries, all -1, with `num_storages` sync logs
  // (none open yet).
  SwaMap(int64_t num_full_pages, int64_t num_swa_pages, int32_t page_size, int32_t num_storages);

  const std::vector<int64_t>& table() const { return table_; }
  int64_t num_full_pages() const { return num_full_pages_; }
  int64_t num_swa_pages() const { return num_swa_pages_; }
  int32_t page_size() const { return page_size_; }
  // The SWA page a full page maps to, -1 for none.
  int32_t swa_page(int32_t full_page) const;

  // Sets the entries of a full page to those of an SWA page (map) or to -1 (unmap), and
  // records the page in every open log. Pages out of range are a caller bug: aborts.
  void map(int32_t full_page, int32_t swa_page);
  void unmap(int32_t full_page);

  // ---- Device copies, one per storage. Calls for different storages may run at once.
  // Starts recording for `storage` (its copy equals table() now); drops what was recorded.
  void open_sync_log(int32_t storage);
  // The full pages whose entries changed since the last synced(storage), sorted and distinct.
  const std::vector<int32_t>& pages_to_sync(int32_t storage);
  // The storage's copy is up to date: clears its log.
  void synced(int32_t storage);

  // ---- Tensor parallelism across processes.
  // Starts the change log (the pool that allocates, rank 0's).
  void track_changes();
  // The pages changed since the last call, in page order, each with its mapping now.
  std::vector<SwaPageMapping> take_changes();
  // Applies another pool's changes (a pool that allocates nothing itself), in order:
  // INVALID_ARGUMENT at the first one out of range, those before it applied.
  absl::Status apply_changes(const std::vector<SwaPageMapping>& changes);

 private:
  struct Log {
    bool open = false;
    std::vector<int32_t> pages;
  };
  void check_full_page(int32_t full_page, const char* what) const;
  void record(int32_t full_page);
  Log& sync_log(int32_t storage);

  int64_t num_full_pages_;
  int64_t num_swa_pages_;
  int32_t page_size_;
  std::vector<int64_t> table_;  // [num_full_pages * page_size]
  std::vector<Log> sync_logs_;  // [num_storages]
  Log changes_;                 // open once track_changes() ran
};

}  // namespace kvfuse
