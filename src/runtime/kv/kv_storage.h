// KvStorage: one tensor-parallel rank's KV cache in its backend's memory
// (docs/design.md#paged-kv-cache-layout, docs/design.md#kv-scales).
//
// Owns, on one backend:
// - per layer, a K and a V buffer of [pages, page_size, num_kv_heads, head_dim] in the
//   stored format, pages being the SWA pool's for window layers and the full pool's for
//   the others; zeroed when allocated;
// - the scales, [4, num_layers] fp32: k, v, then 1/k and 1/v (fp32 division: the correctly
//   rounded reciprocal the kernels and the CPU reference compute);
// - with SWA layers, the device copy of the full_to_swa table (src/runtime/kv/swa_map.h).
//
// Invariants: buffers live as long as the storage and never move, so the views and the
// table it hands out stay valid (a captured graph keeps them); the scales on the device are
// read by the kernels through pointers, so changing one needs no step to sync with the host.
// Which pages hold what, and the host side of the SWA table, are not its business.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/common/kv_types.h"
#include "src/backends/backend.h"
#include "src/runtime/kv/pool_config.h"

namespace kvfuse {

class KvStorage {
 public:
  // Allocates the storage of a (validated) config on `backend`: zeroed K/V buffers, the
  // scales of cfg, and, given the host SWA table, its device copy with the table's entries.
  // A failed allocation or copy is returned, and what was allocated is given back.
  static absl::StatusOr<std::unique_ptr<KvStorage>> create(Backend& backend, const KvPoolConfig& cfg,
                                                           const std::vector<int64_t>* swa_table);

  Backend& backend() const { return *backend_; }
  // Bytes of one page of one layer's K buffer (and of its V buffer).
  int64_t page_bytes() const;

  // Device view of one layer's cache, with pointers to its scales. A layer out of range aborts.
  PagedKvView layer_view(int32_t layer) const;
  // Device copy of the SWA table; empty without SWA layers.
  SwaSlotTable swa_table() const;

  // Writes a layer's scales and their reciprocals to the device (the caller checks them).
  absl::Status write_scales(int32_t layer, float k_scale, float v_scale);
  // Uploads the entries of `pages` (full pages, sorted, distinct) from the host table: one
  // copy per run of consecutive pages. On an error, some may have been uploaded.
  absl::Status upload_swa_pages(const std::vector<int64_t>& table, const std::vector<int32_t>& pages);

 private:
  KvStorage(Backend& backend, const KvPoolConfig& cfg);

  Backend* backend_;
  // The geometry (the pool's config less its scales, which live on the device).
  int32_t num_layers_;
  int32_t page_size_;
  int64_t num_pages_;
  int64_t swa_num_pages_;
  int32_t num_kv_heads_;
  int32_t head_dim_;
  KvFormat format_;
  std::vector<bool> layer_is_swa_;

  std::vector<DeviceBuffer> k_bufs_, v_bufs_;  // per layer
  DeviceBuffer scales_;                        // [4, num_layers] fp32: k, v, 1/k, 1/v
  DeviceBuffer swa_table_;                     // [full slots] int64
  bool has_swa_table_ = false;
  int64_t swa_entries_ = 0;
};

}  // namespace kvfuse
