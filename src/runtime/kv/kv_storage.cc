#include "src/runtime/kv/kv_storage.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/runtime/kv/kv_common.h"

namespace kvfuse {

using kv_detail::die;

KvStorage::KvStorage(Backend& backend, const KvPoolConfig& cfg)
    : backend_(&backend),
      num_layers_(cfg.num_layers),
      page_size_(cfg.page_size),
      num_pages_(cfg.num_pages),
      swa_num_pages_(cfg.swa_num_pages),
      num_kv_heads_(cfg.num_kv_heads),
      head_dim_(cfg.head_dim),
      format_(cfg.format),
      layer_is_swa_(cfg.layer_is_swa) {}

absl::StatusOr<std::unique_ptr<KvStorage>> KvStorage::create(Backend& backend, const KvPoolConfig& cfg,
                                                             const std::vector<int64_t>* swa_table) {
  std::unique_ptr<KvStorage> st(new KvStorage(backend, cfg));
  // Zeroed so that a read of a never-written slot (a bug elsewhere) gives 0, not garbage
  // that might be NaN in FP8.
  const int64_t page_bytes = st->page_bytes();
  auto alloc_zeroed = [&](int64_t bytes) -> absl::StatusOr<DeviceBuffer> {
    absl::StatusOr<DeviceBuffer> buf = backend.alloc(size_t(bytes));
    if (!buf.ok()) return buf.status();
    KVFUSE_RETURN_IF_ERROR(backend.memset(buf->get(), 0, size_t(bytes)));
    return buf;
  };
  for (int32_t l = 0; l < cfg.num_layers; ++l) {
    const int64_t pages = cfg.layer_is_swa[size_t(l)] ? cfg.swa_num_pages : cfg.num_pages;
    for (auto* bufs : {&st->k_bufs_, &st->v_bufs_}) {
      absl::StatusOr<DeviceBuffer> buf = alloc_zeroed(pages * page_bytes);
      if (!buf.ok()) return buf.status();
      bufs->push_back(*std::move(buf));
    }
  }

  // [4, num_layers]: k, v, then 1/k and 1/v (fp32 division: the correctly rounded
  // reciprocal the kernels and the CPU reference compute; PagedKvView::k_inv_scale).
  std::vector<float> scales(cfg.k_scale);
  scales.insert(scales.end(), cfg.v_scale.begin(), cfg.v_scale.end());
  for (float k : cfg.k_scale) scales.push_back(1.0f / k);
  for (float v : cfg.v_scale) scales.push_back(1.0f / v);
  absl::StatusOr<DeviceBuffer> sbuf = backend.alloc(scales.size() * sizeof(float));
  if (!sbuf.ok()) return sbuf.status();
  st->scales_ = *std::move(sbuf);
  KVFUSE_RETURN_IF_ERROR(
      backend.copy_to_device(st->scales_.get(), scales.data(), scales.size() * sizeof(float)));

  if (swa_table != nullptr) {
    const size_t bytes = swa_table->size() * sizeof(int64_t);
    absl::StatusOr<DeviceBuffer> tbuf = backend.alloc(bytes);
    if (!tbuf.ok()) return tbuf.status();
    st->swa_table_ = *std::move(tbuf);
    st->has_swa_table_ = true;
    st->swa_entries_ = int64_t(swa_table->size());
    KVFUSE_RETURN_IF_ERROR(backend.copy_to_device(st->swa_table_.get(), swa_table->data(), bytes));
  }
  return st;
}

int64_t KvStorage::page_bytes() const {
  return int64_t(page_size_) * num_kv_heads_ * head_dim_ * kv_format_bytes(format_);
}

PagedKvView KvStorage::layer_view(int32_t layer) const {
  if (layer < 0 || layer >= num_layers_) die(absl::StrCat("layer_view: layer ", layer, " out of range"));
  const bool swa = layer_is_swa_[size_t(layer)];
  PagedKvView v;
  v.k = k_bufs_[size_t(layer)].get();
  v.v = v_bufs_[size_t(layer)].get();
  v.num_pages = swa ? swa_num_pages_ : num_pages_;
  v.page_size = page_size_;
  v.num_kv_heads = num_kv_heads_;
  v.head_dim = head_dim_;
  v.format = format_;
  v.k_scale = scales_.as<float>() + layer;
  v.v_scale = scales_.as<float>() + num_layers_ + layer;
  v.k_inv_scale = scales_.as<float>() + 2 * num_layers_ + layer;
  v.v_inv_scale = scales_.as<float>() + 3 * num_layers_ + layer;
  return v;
}

SwaSlotTable KvStorage::swa_table() const {
  if (!has_swa_table_) return {};
  return {swa_table_.as<const int64_t>(), swa_entries_};
}

absl::Status KvStorage::write_scales(int32_t layer, float k_scale, float v_scale) {
  if (layer < 0 || layer >= num_layers_) die(absl::StrCat("write_scales: layer ", layer, " out of range"));
  float* dev = scales_.as<float>();
  const float inv_k = 1.0f / k_scale, inv_v = 1.0f / v_scale;
  KVFUSE_RETURN_IF_ERROR(backend_->copy_to_device(dev + layer, &k_scale, sizeof(float)));
  KVFUSE_RETURN_IF_ERROR(backend_->copy_to_device(dev + num_layers_ + layer, &v_scale, sizeof(float)));
  KVFUSE_RETURN_IF_ERROR(backend_->copy_to_device(dev + 2 * num_layers_ + layer, &inv_k, sizeof(float)));
  KVFUSE_RETURN_IF_ERROR(backend_->copy_to_device(dev + 3 * num_layers_ + layer, &inv_v, sizeof(float)));
  return absl::OkStatus();
}

absl::Status KvStorage::upload_swa_pages(const std::vector<int64_t>& table,
                                         const std::vector<int32_t>& pages) {
  if (int64_t(table.size()) != swa_entries_) {
    die(absl::StrCat("SWA table of ", table.size(), " entries for a device copy of ", swa_entries_));
  }
  // One copy per run of consecutive pages: fewer transfers when pages come out in order.
  const int64_t ps = page_size_;
  for (size_t i = 0; i < pages.size();) {
    size_t j = i + 1;
    while (j < pages.size() && pages[j] == pages[j - 1] + 1) ++j;
    const int64_t first = int64_t(pages[i]) * ps;
    const int64_t count = int64_t(j - i) * ps;
    KVFUSE_RETURN_IF_ERROR(backend_->copy_to_device(swa_table_.as<int64_t>() + first, table.data() + first,
                                                    size_t(count) * sizeof(int64_t)));
    i = j;
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
