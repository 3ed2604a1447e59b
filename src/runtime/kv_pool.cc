#include "src/runtime/kv_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace kvfuse {

namespace {

// Misuse that would otherwise corrupt another sequence's cache (a double free, a slot
// past the reserved length) is a bug in the caller, not a runtime condition: stop loudly.
[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "kvfuse: kv_pool: %s\n", msg.c_str());
  std::abort();
}

// Buffers beyond this are a unit mix-up in the config, not a real cache (256 TiB).
constexpr int64_t kMaxBufferBytes = int64_t(1) << 48;

bool mul_checked(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

int64_t pages_for(int64_t len, int32_t page_size) { return (len + page_size - 1) / page_size; }

// The dirty list may repeat a page (mapped, then unmapped before a sync); deduplicating
// once it outgrows the pool keeps it bounded even if no one syncs for a while.
void compact_dirty(std::vector<int32_t>& dirty, int64_t num_pages) {
  if (dirty.size() <= 2 * size_t(num_pages) + 64) return;
  std::sort(dirty.begin(), dirty.end());
  dirty.erase(std::unique(dirty.begin(), dirty.end()), dirty.end());
}

absl::Status validate(const KvPoolConfig& c) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat("kv pool: ", parts...)); };
  if (c.num_layers <= 0) return bad("num_layers must be > 0 (got ", c.num_layers, ")");
  if (c.page_size <= 0) return bad("page_size must be > 0 (got ", c.page_size, ")");
  if (c.num_kv_heads <= 0) return bad("num_kv_heads must be > 0 (got ", c.num_kv_heads, ")");
  if (c.head_dim <= 0) return bad("head_dim must be > 0 (got ", c.head_dim, ")");
  if (c.num_pages <= 0) return bad("num_pages must be > 0 (got ", c.num_pages, ")");
  // Page ids are int32 in page tables and in AttnBatch::block_table.
  constexpr int64_t kMaxPages = std::numeric_limits<int32_t>::max();
  if (c.num_pages > kMaxPages) return bad("num_pages must be <= ", kMaxPages, " (got ", c.num_pages, ")");
  if (int(c.format) > int(KvFormat::fp8_e5m2)) return bad("unknown kv dtype ", int(c.format));
  if (c.layer_is_swa.size() != size_t(c.num_layers)) {
    return bad("layer_is_swa has ", c.layer_is_swa.size(), " entries, num_layers is ", c.num_layers);
  }
  for (const auto& [name, scales] : {std::pair{"k_scale", &c.k_scale}, std::pair{"v_scale", &c.v_scale}}) {
    if (scales->size() != size_t(c.num_layers)) {
      return bad(name, " has ", scales->size(), " entries, num_layers is ", c.num_layers);
    }
    for (size_t l = 0; l < scales->size(); ++l) {
      const float s = (*scales)[l];
      if (!std::isfinite(s) || !(s > 0.0f))
        return bad(name, "[", l, "] must be finite and > 0 (got ", s, ")");
    }
  }
  const bool any_swa = std::find(c.layer_is_swa.begin(), c.layer_is_swa.end(), true) != c.layer_is_swa.end();
  if (any_swa) {
    if (c.window <= 0)
      return bad("window must be > 0 when a layer uses sliding-window attention (got ", c.window, ")");
    if (c.swa_num_pages <= 0) {
      return bad("swa_num_pages must be > 0 when a layer uses sliding-window attention (got ",
                 c.swa_num_pages, ")");
    }
    if (c.swa_num_pages > kMaxPages)
      return bad("swa_num_pages must be <= ", kMaxPages, " (got ", c.swa_num_pages, ")");
  }
  // Every size below is computed in int64 and checked: a config is untrusted input.
  int64_t page_bytes = 0, slots = 0, table_bytes = 0, full_bytes = 0, swa_bytes = 0;
  const bool sizes_ok = mul_checked(int64_t(c.page_size) * c.num_kv_heads, c.head_dim, page_bytes) &&
                        mul_checked(page_bytes, kv_format_bytes(c.format), page_bytes) &&
                        mul_checked(c.num_pages, c.page_size, slots) &&
                        mul_checked(slots, int64_t(sizeof(int64_t)), table_bytes) &&
                        mul_checked(c.num_pages, page_bytes, full_bytes) &&
                        mul_checked(any_swa ? c.swa_num_pages : 0, page_bytes, swa_bytes);
  if (!sizes_ok || full_bytes > kMaxBufferBytes || swa_bytes > kMaxBufferBytes ||
      (any_swa && table_bytes > kMaxBufferBytes)) {
    return bad("cache size out of range: num_pages=", c.num_pages, " swa_num_pages=", c.swa_num_pages,
               " page_size=", c.page_size, " num_kv_heads=", c.num_kv_heads, " head_dim=", c.head_dim,
               " dtype=", kv_format_name(c.format), " (limit ", kMaxBufferBytes, " bytes per buffer)");
  }
  return absl::OkStatus();
}

}  // namespace

// ---- PageAllocator ----------------------------------------------------------------

PageAllocator::PageAllocator(int64_t num_pages) : num_pages_(num_pages) {
  if (num_pages < 0 || num_pages > std::numeric_limits<int32_t>::max()) {
    die(absl::StrCat("PageAllocator: bad page count ", num_pages));
  }
  // Pushed in reverse so pages come out 0, 1, 2, ...: deterministic and easy to read.
  free_.reserve(size_t(num_pages));
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(int32_t(p));
  refs_.assign(size_t(num_pages), 0);
}

bool PageAllocator::allocate(int64_t n, std::vector<int32_t>& out) {
  if (n < 0 || n > num_free()) return false;
  out.reserve(out.size() + size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = free_.back();
    free_.pop_back();
    if (refs_[size_t(p)] != 0) die(absl::StrCat("page ", p, " on the free list is in use"));
    refs_[size_t(p)] = 1;
    out.push_back(p);
  }
  return true;
}

void PageAllocator::free(int32_t page) {
  if (page < 0 || page >= num_pages_)
    die(absl::StrCat("free of page ", page, " out of range [0, ", num_pages_, ")"));
  int32_t& r = refs_[size_t(page)];
  if (r <= 0) die(absl::StrCat("double free of page ", page));
  if (--r == 1) --num_shared_;
  if (r == 0) free_.push_back(page);
}

void PageAllocator::share(int32_t page) {
  if (page < 0 || page >= num_pages_)
    die(absl::StrCat("share of page ", page, " out of range [0, ", num_pages_, ")"));
  int32_t& r = refs_[size_t(page)];
  if (r <= 0) die(absl::StrCat("share of free page ", page));
  if (r++ == 1) ++num_shared_;
}

// ---- KvPool: creation and device state ----------------------------------------------

KvPool::KvPool(KvPoolConfig cfg) : cfg_(std::move(cfg)) {}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::create(Backend& backend, const KvPoolConfig& cfg) {
  auto pool = create_shared(cfg, 1);
  if (!pool.ok()) return pool.status();
  KVFUSE_RETURN_IF_ERROR((*pool)->add_storage(0, backend));
  return pool;
}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::create_shared(const KvPoolConfig& cfg, int32_t num_storages) {
  KVFUSE_RETURN_IF_ERROR(validate(cfg));
  if (num_storages < 1) return absl::InvalidArgumentError("kv pool: at least one storage");
  std::unique_ptr<KvPool> pool(new KvPool(cfg));
  const bool any_swa =
      std::find(cfg.layer_is_swa.begin(), cfg.layer_is_swa.end(), true) != cfg.layer_is_swa.end();
  pool->full_alloc_ = std::make_unique<PageAllocator>(cfg.num_pages);
  if (any_swa) {
    pool->swa_alloc_ = std::make_unique<PageAllocator>(cfg.swa_num_pages);
    pool->swa_table_host_.assign(size_t(cfg.num_pages * cfg.page_size), -1);
  }
  pool->storages_.resize(size_t(num_storages));
  return pool;
}

absl::Status KvPool::add_storage(int32_t index, Backend& backend) {
  if (index < 0 || index >= num_storages() || storages_[size_t(index)] != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("kv pool: storage ", index, " is taken or out of range"));
  }
  auto st = std::make_unique<Storage>();
  st->backend = &backend;
  // Zeroed so that a read of a never-written slot (a bug elsewhere) gives 0, not garbage
  // that might be NaN in FP8.
  const int64_t page_bytes = page_bytes_per_layer() / 2;
  auto alloc_zeroed = [&](int64_t bytes) -> absl::StatusOr<DeviceBuffer> {
    absl::StatusOr<DeviceBuffer> buf = backend.alloc(size_t(bytes));
    if (!buf.ok()) return buf.status();
    KVFUSE_RETURN_IF_ERROR(backend.memset(buf->get(), 0, size_t(bytes)));
    return buf;
  };
  for (int32_t l = 0; l < cfg_.num_layers; ++l) {
    const int64_t pages = cfg_.layer_is_swa[size_t(l)] ? cfg_.swa_num_pages : cfg_.num_pages;
    for (auto* bufs : {&st->k_bufs, &st->v_bufs}) {
      absl::StatusOr<DeviceBuffer> buf = alloc_zeroed(pages * page_bytes);
      if (!buf.ok()) return buf.status();
      bufs->push_back(*std::move(buf));
    }
  }

  // [4, num_layers]: k, v, then 1/k and 1/v (fp32 division: the correctly rounded
  // reciprocal the kernels and the CPU reference compute; PagedKvView::k_inv_scale).
  std::vector<float> scales(cfg_.k_scale);
  scales.insert(scales.end(), cfg_.v_scale.begin(), cfg_.v_scale.end());
  for (float k : cfg_.k_scale) scales.push_back(1.0f / k);
  for (float v : cfg_.v_scale) scales.push_back(1.0f / v);
  absl::StatusOr<DeviceBuffer> sbuf = backend.alloc(scales.size() * sizeof(float));
  if (!sbuf.ok()) return sbuf.status();
  st->scales = *std::move(sbuf);
  KVFUSE_RETURN_IF_ERROR(backend.copy_to_device(st->scales.get(), scales.data(), scales.size() * sizeof(float)));

  if (has_swa()) {
    const size_t bytes = swa_table_host_.size() * sizeof(int64_t);
    absl::StatusOr<DeviceBuffer> tbuf = backend.alloc(bytes);
    if (!tbuf.ok()) return tbuf.status();
    st->swa_table = *std::move(tbuf);
    KVFUSE_RETURN_IF_ERROR(backend.copy_to_device(st->swa_table.get(), swa_table_host_.data(), bytes));
  }
  storages_[size_t(index)] = std::move(st);
  return absl::OkStatus();
}

const KvPool::Storage& KvPool::storage(int32_t index) const {
  if (index < 0 || index >= num_storages() || storages_[size_t(index)] == nullptr) {
    die(absl::StrCat("kv pool: storage ", index, " does not exist"));
  }
  return *storages_[size_t(index)];
}

int64_t KvPool::page_bytes_per_layer() const {
  return 2 * int64_t(cfg_.page_size) * cfg_.num_kv_heads * cfg_.head_dim * kv_format_bytes(cfg_.format);
}

PagedKvView KvPool::layer_view(int32_t layer, int32_t index) const {
  if (layer < 0 || layer >= cfg_.num_layers) die(absl::StrCat("layer_view: layer ", layer, " out of range"));
  const Storage& st = storage(index);
  const bool swa = cfg_.layer_is_swa[size_t(layer)];
  PagedKvView v;
  v.k = st.k_bufs[size_t(layer)].get();
  v.v = st.v_bufs[size_t(layer)].get();
  v.num_pages = swa ? cfg_.swa_num_pages : cfg_.num_pages;
  v.page_size = cfg_.page_size;
  v.num_kv_heads = cfg_.num_kv_heads;
  v.head_dim = cfg_.head_dim;
  v.format = cfg_.format;
  v.k_scale = st.scales.as<float>() + layer;
  v.v_scale = st.scales.as<float>() + cfg_.num_layers + layer;
  v.k_inv_scale = st.scales.as<float>() + 2 * cfg_.num_layers + layer;
  v.v_inv_scale = st.scales.as<float>() + 3 * cfg_.num_layers + layer;
  return v;
}

SwaSlotTable KvPool::swa_table(int32_t index) const {
  if (!has_swa()) return {};
  return {storage(index).swa_table.as<const int64_t>(), int64_t(swa_table_host_.size())};
}

absl::Status KvPool::sync_swa_table() {
  for (int32_t i = 0; i < num_storages(); ++i) KVFUSE_RETURN_IF_ERROR(sync_swa_table(i));
  return absl::OkStatus();
}

absl::Status KvPool::sync_swa_table(int32_t index) {
  Storage& st = storage(index);
  std::vector<int32_t>& dirty = st.swa_dirty_pages;
  if (dirty.empty()) return absl::OkStatus();
  std::sort(dirty.begin(), dirty.end());
  dirty.erase(std::unique(dirty.begin(), dirty.end()), dirty.end());
  // One copy per run of consecutive pages: fewer transfers when pages come out in order.
  const int64_t ps = cfg_.page_size;
  for (size_t i = 0; i < dirty.size();) {
    size_t j = i + 1;
    while (j < dirty.size() && dirty[j] == dirty[j - 1] + 1) ++j;
    const int64_t first = int64_t(dirty[i]) * ps;
    const int64_t count = int64_t(j - i) * ps;
    absl::Status s = st.backend->copy_to_device(st.swa_table.as<int64_t>() + first, swa_table_host_.data() + first,
                                                size_t(count) * sizeof(int64_t));
    if (!s.ok()) return s;  // the dirty list is kept: a retry uploads everything again
    i = j;
  }
  dirty.clear();
  return absl::OkStatus();
}

absl::Status KvPool::set_scales(int32_t layer, float k_scale, float v_scale) {
  if (layer < 0 || layer >= cfg_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("set_scales: layer ", layer, " out of range [0, ", cfg_.num_layers, ")"));
  }
  for (float s : {k_scale, v_scale}) {
    if (!std::isfinite(s) || !(s > 0.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("set_scales: layer ", layer, " scale must be finite and > 0 (got ", s, ")"));
    }
  }
  for (int32_t i = 0; i < num_storages(); ++i) {
    const Storage& st = storage(i);
    float* dev = st.scales.as<float>();
    const float inv_k = 1.0f / k_scale, inv_v = 1.0f / v_scale;
    KVFUSE_RETURN_IF_ERROR(st.backend->copy_to_device(dev + layer, &k_scale, sizeof(float)));
    KVFUSE_RETURN_IF_ERROR(st.backend->copy_to_device(dev + cfg_.num_layers + layer, &v_scale, sizeof(float)));
    KVFUSE_RETURN_IF_ERROR(st.backend->copy_to_device(dev + 2 * cfg_.num_layers + layer, &inv_k, sizeof(float)));
    KVFUSE_RETURN_IF_ERROR(st.backend->copy_to_device(dev + 3 * cfg_.num_layers + layer, &inv_v, sizeof(float)));
  }
  cfg_.k_scale[size_t(layer)] = k_scale;
  cfg_.v_scale[size_t(layer)] = v_scale;
  return absl::OkStatus();
}

PoolUsage KvPool::usage(PoolKind kind) const {
  const PageAllocator* a = kind == PoolKind::full ? full_alloc_.get() : swa_alloc_.get();
  if (a == nullptr) return {};
  return {a->num_pages(), a->num_used(), a->num_free(), a->num_shared()};
}

// ---- KvPool: sequences --------------------------------------------------------------

absl::Status KvPool::add_sequence(SeqId id) {
  if (!seqs_.emplace(id, SeqPages{}).second) {
    return absl::AlreadyExistsError(absl::StrCat("kv pool: sequence ", id, " already exists"));
  }
  return absl::OkStatus();
}

absl::Status KvPool::share_prefix(SeqId id, SeqId donor, int32_t tokens) {
  if (has_swa()) return absl::FailedPreconditionError("kv pool: prefix pages are not shared with SWA layers");
  auto it = seqs_.find(id);
  auto d = seqs_.find(donor);
  if (it == seqs_.end() || d == seqs_.end() || id == donor) {
    return absl::NotFoundError(absl::StrCat("kv pool: share_prefix of sequences ", id, " and ", donor));
  }
  if (it->second.len != 0 || tokens < 0 || tokens % cfg_.page_size != 0 || tokens > d->second.len) {
    return absl::InvalidArgumentError(absl::StrCat("kv pool: share_prefix of ", tokens, " tokens from sequence ",
                                                   donor, " (", d->second.len, " reserved) to sequence ", id,
                                                   " (", it->second.len, " reserved)"));
  }
  const size_t pages = size_t(tokens / cfg_.page_size);
  for (size_t i = 0; i < pages; ++i) {
    full_alloc_->share(d->second.full[i]);
    it->second.full.push_back(d->second.full[i]);
  }
  it->second.len = tokens;
  return absl::OkStatus();
}

absl::Status KvPool::release(SeqId id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end())
    return absl::NotFoundError(absl::StrCat("kv pool: release of unknown sequence ", id));
  SeqPages& s = it->second;
  for (size_t i = 0; i < s.full.size(); ++i) {
    if (has_swa() && s.swa[i] >= 0) {
      unmap_swa_page(s.full[i]);
      swa_alloc_->free(s.swa[i]);
    }
    full_alloc_->free(s.full[i]);
  }
  seqs_.erase(it);
  return absl::OkStatus();
}

// An unknown id counts as an empty sequence, so admission control can size a request
// before add_sequence.
PagesNeeded KvPool::pages_needed(SeqId id, int32_t new_len) const {
  auto it = seqs_.find(id);
  const int64_t len = it == seqs_.end() ? 0 : it->second.len;
  if (new_len <= len) return {};
  PagesNeeded need;
  const int64_t have = it == seqs_.end() ? 0 : int64_t(it->second.full.size());
  const int64_t target = pages_for(new_len, cfg_.page_size);
  need.full = target - have;
  if (has_swa()) {
    // Pages covering [len, new_len) without an SWA page. Only the first can already
    // have one (a partly filled page); trimmed pages all lie before it.
    for (int64_t i = len / cfg_.page_size; i < target; ++i) {
      const bool mapped =
          it != seqs_.end() && i < int64_t(it->second.swa.size()) && it->second.swa[size_t(i)] >= 0;
      need.swa += mapped ? 0 : 1;
    }
  }
  return need;
}

int64_t KvPool::max_swa_pages_held(const KvPoolConfig& cfg, int64_t len) {
  const int64_t span = std::min<int64_t>(len, int64_t(cfg.window) + cfg.max_step_tokens);
  return pages_for(span, cfg.page_size) + 1;
}

PagesNeeded KvPool::pages_held(SeqId id) const {
  PagesNeeded held;
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return held;
  held.full = int64_t(it->second.full.size());
  for (int32_t p : it->second.swa) held.swa += p >= 0;
  return held;
}

PagesNeeded KvPool::pages_to_reach(SeqId id, int32_t len) const {
  PagesNeeded need = pages_needed(id, len);
  if (has_swa()) need.swa = std::min(need.swa, max_swa_pages_held(cfg_));
  return need;
}

PagesNeeded KvPool::pages_to_hold(SeqId id, int64_t len) const {
  const PagesNeeded held = pages_held(id);
  PagesNeeded need;
  need.full = std::max<int64_t>(0, pages_for(len, cfg_.page_size) - held.full);
  if (has_swa()) need.swa = std::max<int64_t>(0, max_swa_pages_held(cfg_, len) - held.swa);
  return need;
}

absl::Status KvPool::reserve(SeqId id, int32_t new_len) {
  auto it = seqs_.find(id);
  if (it == seqs_.end())
    return absl::NotFoundError(absl::StrCat("kv pool: reserve for unknown sequence ", id));
  SeqPages& s = it->second;
  if (new_len <= s.len) return absl::OkStatus();
  const PagesNeeded need = pages_needed(id, new_len);
  const int64_t swa_free = has_swa() ? swa_alloc_->num_free() : 0;
  if (need.full > full_alloc_->num_free() || need.swa > swa_free) {
    return absl::ResourceExhaustedError(absl::StrCat("kv pool exhausted: sequence ", id, " growing from ",
                                                     s.len, " to ", new_len, " tokens needs ", need.full,
                                                     " full pages, ", full_alloc_->num_free(), " free; ",
                                                     need.swa, " SWA pages, ", swa_free, " free"));
  }
  // Both checks passed, so neither allocation can fail; the rollback guards the
  // all-or-nothing contract should that ever change.
  std::vector<int32_t> full_pages, swa_pages;
  if (!full_alloc_->allocate(need.full, full_pages)) {
    return absl::ResourceExhaustedError(absl::StrCat("kv pool exhausted: ", need.full, " full pages"));
  }
  if (has_swa() && !swa_alloc_->allocate(need.swa, swa_pages)) {
    for (int32_t p : full_pages) full_alloc_->free(p);
    return absl::ResourceExhaustedError(absl::StrCat("kv pool exhausted: ", need.swa, " SWA pages"));
  }
  const int64_t first_new = s.len / cfg_.page_size;
  s.full.insert(s.full.end(), full_pages.begin(), full_pages.end());
  if (has_swa()) {
    s.swa.resize(s.full.size(), -1);
    size_t next = 0;
    for (size_t i = size_t(first_new); i < s.full.size(); ++i) {
      if (s.swa[i] >= 0) continue;
      s.swa[i] = swa_pages[next++];
      map_swa_page(s.full[i], s.swa[i]);
    }
  }
  s.len = new_len;
  return absl::OkStatus();
}

// Call after the step that wrote the reserved positions: a query at position p sees keys
// p-W+1..p, so once queries up to len-1 have run, the next one is at p >= len and no
// key below len-W+1 is ever read again. Trimming between reserve() and the step would
// free keys the step's own queries still read.
void KvPool::trim_window(SeqId id) {
  if (!has_swa()) return;
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  SeqPages& s = it->second;
  const int64_t visible_from = int64_t(s.len) - cfg_.window + 1;
  // Page i is dead when (i+1)*page_size <= visible_from. Freed pages form a prefix
  // (reserve only maps pages at or after len), so walk down from the last dead page
  // until one already freed: O(pages freed), not O(sequence length).
  const int64_t last_dead = std::min<int64_t>(visible_from / cfg_.page_size, int64_t(s.swa.size())) - 1;
  for (int64_t i = last_dead; i >= 0 && s.swa[size_t(i)] >= 0; --i) {
    unmap_swa_page(s.full[size_t(i)]);
    swa_alloc_->free(s.swa[size_t(i)]);
    s.swa[size_t(i)] = -1;
  }
}

int32_t KvPool::reserved_len(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second.len;
}

int64_t KvPool::slot(SeqId id, int32_t pos) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) die(absl::StrCat("slot: unknown sequence ", id));
  const SeqPages& s = it->second;
  if (pos < 0 || pos >= s.len)
    die(absl::StrCat("slot: position ", pos, " of sequence ", id, " not in [0, ", s.len, ")"));
  return int64_t(s.full[size_t(pos / cfg_.page_size)]) * cfg_.page_size + pos % cfg_.page_size;
}

const std::vector<int32_t>& KvPool::page_table(SeqId id, PoolKind kind) const {
  static const std::vector<int32_t> kEmpty;
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return kEmpty;
  return kind == PoolKind::full ? it->second.full : it->second.swa;
}

void KvPool::map_swa_page(int32_t full_page, int32_t swa_page) {
  const int64_t ps = cfg_.page_size;
  for (int64_t o = 0; o < ps; ++o) swa_table_host_[size_t(full_page * ps + o)] = swa_page * ps + o;
  mark_dirty(full_page);
}

void KvPool::mark_dirty(int32_t full_page) {
  for (auto& st : storages_) {
    if (st == nullptr) continue;
    st->swa_dirty_pages.push_back(full_page);
    compact_dirty(st->swa_dirty_pages, cfg_.num_pages);
  }
  if (track_changes_) {
    changed_pages_.push_back(full_page);
    compact_dirty(changed_pages_, cfg_.num_pages);
  }
}

void KvPool::track_swa_changes() { track_changes_ = has_swa(); }

std::vector<SwaPageMapping> KvPool::take_swa_changes() {
  std::sort(changed_pages_.begin(), changed_pages_.end());
  changed_pages_.erase(std::unique(changed_pages_.begin(), changed_pages_.end()), changed_pages_.end());
  std::vector<SwaPageMapping> out;
  out.reserve(changed_pages_.size());
  const int64_t ps = cfg_.page_size;
  for (int32_t page : changed_pages_) {
    const int64_t slot = swa_table_host_[size_t(page * ps)];
    out.push_back({page, slot < 0 ? -1 : int32_t(slot / ps)});
  }
  changed_pages_.clear();
  return out;
}

absl::Status KvPool::apply_swa_changes(const std::vector<SwaPageMapping>& changes) {
  if (!changes.empty() && !has_swa()) {
    return absl::InvalidArgumentError("kv pool: SWA table changes for a pool without SWA layers");
  }
  for (const SwaPageMapping& m : changes) {
    if (m.full_page < 0 || m.full_page >= cfg_.num_pages || m.swa_page < -1 ||
        m.swa_page >= cfg_.swa_num_pages) {
      return absl::InvalidArgumentError(absl::StrCat("kv pool: SWA table change of full page ", m.full_page,
                                                     " to SWA page ", m.swa_page, " is out of range"));
    }
    if (m.swa_page < 0) {
      unmap_swa_page(m.full_page);
    } else {
      map_swa_page(m.full_page, m.swa_page);
    }
  }
  return absl::OkStatus();
}

void KvPool::unmap_swa_page(int32_t full_page) {
  const int64_t ps = cfg_.page_size;
  std::fill_n(swa_table_host_.begin() + full_page * ps, ps, int64_t(-1));
  mark_dirty(full_page);
}

// ---- KvPool: invariants -------------------------------------------------------------

absl::Status KvPool::check_invariants() const {
  auto fail = [](auto&&... parts) {
    return absl::InternalError(absl::StrCat("kv pool invariant: ", parts...));
  };
  const int64_t ps = cfg_.page_size;
  // Owner of each page as 1 + index into `ids`, 0 for none.
  std::vector<SeqId> ids;
  std::vector<int32_t> full_holders(size_t(full_alloc_->num_pages()), 0);
  std::vector<int64_t> swa_owner(has_swa() ? size_t(swa_alloc_->num_pages()) : 0, 0);
  std::vector<int64_t> full_to_swa_page(size_t(full_alloc_->num_pages()), -1);
  auto claim = [&](const PageAllocator& a, std::vector<int64_t>& owner, int32_t p, const char* pool,
                   SeqId id) -> absl::Status {
    if (p < 0 || p >= a.num_pages()) return fail(pool, " page ", p, " of sequence ", id, " out of range");
    if (!a.is_used(p)) return fail(pool, " page ", p, " of sequence ", id, " is on the free list");
    if (owner[size_t(p)] != 0) {
      return fail(pool, " page ", p, " owned by sequences ", ids[size_t(owner[size_t(p)] - 1)], " and ", id);
    }
    owner[size_t(p)] = int64_t(ids.size());
    return absl::OkStatus();
  };
  int64_t full_owned = 0, swa_owned = 0;
  for (const auto& [id, s] : seqs_) {
    ids.push_back(id);
    if (int64_t(s.full.size()) != pages_for(s.len, cfg_.page_size)) {
      return fail("sequence ", id, " has ", s.full.size(), " full pages for ", s.len, " tokens");
    }
    if (s.swa.size() != (has_swa() ? s.full.size() : 0)) {
      return fail("sequence ", id, " has ", s.swa.size(), " SWA entries for ", s.full.size(), " full pages");
    }
    for (int32_t p : s.full) {
      // Full pages may be shared (prefix reuse): one holder per reference.
      if (p < 0 || p >= full_alloc_->num_pages()) return fail("full page ", p, " of sequence ", id, " out of range");
      if (!full_alloc_->is_used(p)) return fail("full page ", p, " of sequence ", id, " is on the free list");
      if (full_holders[size_t(p)]++ == 0) ++full_owned;
    }
    bool seen_mapped = false;
    for (size_t i = 0; i < s.swa.size(); ++i) {
      if (s.swa[i] < 0) {
        // Freed pages are a prefix, and only ones no future query can see.
        if (seen_mapped) return fail("sequence ", id, " SWA page ", i, " freed after a live one");
        if (int64_t(i + 1) * ps > int64_t(s.len) - cfg_.window + 1) {
          return fail("sequence ", id, " SWA page ", i, " freed while still in the window (len ", s.len, ")");
        }
        continue;
      }
      seen_mapped = true;
      KVFUSE_RETURN_IF_ERROR(claim(*swa_alloc_, swa_owner, s.swa[i], "SWA", id));
      full_to_swa_page[size_t(s.full[i])] = s.swa[i];
      ++swa_owned;
    }
  }
  int64_t shared = 0;
  for (int64_t p = 0; p < full_alloc_->num_pages(); ++p) {
    const int32_t refs = full_alloc_->refs(int32_t(p));
    if (refs != full_holders[size_t(p)]) {
      return fail("full page ", p, " has ", refs, " references and ", full_holders[size_t(p)], " holders");
    }
    shared += refs > 1 ? 1 : 0;
  }
  if (shared != full_alloc_->num_shared()) {
    return fail("full pool: ", shared, " pages shared, ", full_alloc_->num_shared(), " by count");
  }
  // Owned == used, and the allocator's bitmap agrees with its free list: no leak.
  for (const auto& [a, owned, pool] :
       {std::tuple{full_alloc_.get(), full_owned, "full"}, std::tuple{swa_alloc_.get(), swa_owned, "SWA"}}) {
    if (a == nullptr) continue;
    int64_t used = 0;
    for (int64_t p = 0; p < a->num_pages(); ++p) used += a->is_used(int32_t(p)) ? 1 : 0;
    if (used != a->num_used() || owned != a->num_used()) {
      return fail(pool, " pool: ", owned, " pages owned, ", a->num_used(), " used by count, ", used,
                  " used by bitmap (", a->num_pages(), " total)");
    }
  }
  if (!has_swa()) {
    if (!swa_table_host_.empty()) return fail("SWA slot table present without SWA layers");
    return absl::OkStatus();
  }
  if (int64_t(swa_table_host_.size()) != full_alloc_->num_pages() * ps) {
    return fail("SWA slot table has ", swa_table_host_.size(), " entries");
  }
  for (int64_t f = 0; f < full_alloc_->num_pages(); ++f) {
    const int64_t m = full_to_swa_page[size_t(f)];
    for (int64_t o = 0; o < ps; ++o) {
      const int64_t want = m >= 0 ? m * ps + o : -1;
      if (swa_table_host_[size_t(f * ps + o)] != want) {
        return fail("SWA slot table entry ", f * ps + o, " is ", swa_table_host_[size_t(f * ps + o)],
                    ", want ", want);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
