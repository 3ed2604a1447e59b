#include "src/runtime/kv_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/runtime/kv/invariants.h"
#include "src/runtime/kv/kv_common.h"

namespace kvfuse {

using kv_detail::die;
using kv_detail::pages_for;

// ---- Creation and device state ------------------------------------------------------

KvPool::KvPool(KvPoolConfig cfg) : cfg_(std::move(cfg)), tables_(cfg_.page_size, has_swa_layers(cfg_)) {}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::create(Backend& backend, const KvPoolConfig& cfg) {
  auto pool = create_shared(cfg, 1);
  if (!pool.ok()) return pool.status();
  KVFUSE_RETURN_IF_ERROR((*pool)->add_storage(0, backend));
  return pool;
}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::create_shared(const KvPoolConfig& cfg, int32_t num_storages) {
  KVFUSE_RETURN_IF_ERROR(validate_kv_pool_config(cfg));
  if (num_storages < 1) return absl::InvalidArgumentError("kv pool: at least one storage");
  std::unique_ptr<KvPool> pool(new KvPool(cfg));
  pool->full_alloc_ = std::make_unique<PageAllocator>(cfg.num_pages);
  if (has_swa_layers(cfg)) {
    pool->swa_alloc_ = std::make_unique<PageAllocator>(cfg.swa_num_pages);
    pool->swa_map_ = std::make_unique<SwaMap>(cfg.num_pages, cfg.swa_num_pages, cfg.page_size, num_storages);
  }
  pool->storages_.resize(size_t(num_storages));
  if (cfg.prefix_cache && !has_swa_layers(cfg)) {
    pool->cache_ = std::make_unique<PrefixCache>(cfg.page_size, pool->cache_salt());
    PrefixCache* cache = pool->cache_.get();
    pool->full_alloc_->set_on_evict([cache](int32_t page) { cache->evicted(page); });
  }
  return pool;
}

// The chains' salt: the config's, the KV format and every layer's scales.
uint64_t KvPool::cache_salt() const {
  std::vector<int32_t> words = {int32_t(cfg_.format), cfg_.page_size};
  for (size_t l = 0; l < cfg_.k_scale.size(); ++l) {
    for (float s : {cfg_.k_scale[l], cfg_.v_scale[l]}) {
      int32_t bits;
      std::memcpy(&bits, &s, sizeof bits);
      words.push_back(bits);
    }
  }
  return PrefixCache::default_hash(cfg_.prefix_cache_salt, words.data(), int32_t(words.size()));
}

absl::Status KvPool::add_storage(int32_t index, Backend& backend) {
  if (index < 0 || index >= num_storages() || storages_[size_t(index)] != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("kv pool: storage ", index, " is taken or out of range"));
  }
  absl::StatusOr<std::unique_ptr<KvStorage>> st =
      KvStorage::create(backend, cfg_, has_swa() ? &swa_map_->table() : nullptr);
  if (!st.ok()) return st.status();
  // Its table is the host table now: from here on it uploads the pages that change.
  if (has_swa()) swa_map_->open_sync_log(index);
  storages_[size_t(index)] = *std::move(st);
  return absl::OkStatus();
}

const KvStorage& KvPool::storage(int32_t index) const {
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
  return storage(index).layer_view(layer);
}

SwaSlotTable KvPool::swa_table(int32_t index) const {
  if (!has_swa()) return {};
  return storage(index).swa_table();
}

absl::Status KvPool::sync_swa_table() {
  for (int32_t i = 0; i < num_storages(); ++i) KVFUSE_RETURN_IF_ERROR(sync_swa_table(i));
  return absl::OkStatus();
}

absl::Status KvPool::sync_swa_table(int32_t index) {
  KvStorage& st = storage(index);
  if (!has_swa()) return absl::OkStatus();
  const std::vector<int32_t>& pages = swa_map_->pages_to_sync(index);
  if (pages.empty()) return absl::OkStatus();
  // On an error the log is kept: a retry uploads everything again.
  KVFUSE_RETURN_IF_ERROR(st.upload_swa_pages(swa_map_->table(), pages));
  swa_map_->synced(index);
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
  for (int32_t i = 0; i < num_storages(); ++i)
    KVFUSE_RETURN_IF_ERROR(storage(i).write_scales(layer, k_scale, v_scale));
  const bool changed = cfg_.k_scale[size_t(layer)] != k_scale || cfg_.v_scale[size_t(layer)] != v_scale;
  cfg_.k_scale[size_t(layer)] = k_scale;
  cfg_.v_scale[size_t(layer)] = v_scale;
  if (cache_ && changed) {  // KV cached under the old scales is never served again
    cache_->reset_root(cache_salt());
    flush_cache();
  }
  return absl::OkStatus();
}

PoolUsage KvPool::usage(PoolKind kind) const {
  const PageAllocator* a = kind == PoolKind::full ? full_alloc_.get() : swa_alloc_.get();
  if (a == nullptr) return {};
  return {a->num_pages(), a->num_used(), a->num_free(), a->num_shared()};
}

const std::vector<int64_t>& KvPool::host_swa_table() const {
  static const std::vector<int64_t> kNoTable;
  return has_swa() ? swa_map_->table() : kNoTable;
}

// ---- Sequences ----------------------------------------------------------------------

absl::Status KvPool::add_sequence(SeqId id) { return tables_.add(id); }

absl::Status KvPool::release(SeqId id) {
  absl::StatusOr<SeqPages> s = tables_.release(id);
  if (!s.ok()) return s.status();
  if (cache_) cache_->finish(id);
  // Last page first: a cached chain's later blocks are then evicted before its earlier ones.
  for (size_t i = s->full.size(); i-- > 0;) {
    if (has_swa() && s->swa[i] >= 0) {
      swa_map_->unmap(s->full[i]);
      swa_alloc_->free(s->swa[i]);
    }
    full_alloc_->free(s->full[i]);
  }
  return absl::OkStatus();
}

// ---- Prefix cache -------------------------------------------------------------------

absl::StatusOr<int32_t> KvPool::take_cached_prefix(SeqId id, const std::vector<int32_t>& tokens, int64_t limit) {
  if (!cache_) return 0;
  limit = std::min<int64_t>(limit, int64_t(tokens.size()));
  const PrefixCache::Match m = cache_->match(tokens.data(), limit);
  KVFUSE_RETURN_IF_ERROR(tables_.adopt_prefix(id, m.pages));
  for (int32_t p : m.pages) {
    if (full_alloc_->is_used(p)) {
      full_alloc_->share(p);
    } else {
      full_alloc_->revive(p);
    }
  }
  cache_->start(id, m);
  const int32_t hit = int32_t(m.pages.size()) * cfg_.page_size;
  query_tokens_ += limit;
  hit_tokens_ += hit;
  return hit;
}

void KvPool::cache_computed(SeqId id, const std::vector<int32_t>& tokens, int32_t computed) {
  if (!cache_ || !tables_.contains(id)) return;
  computed = std::min<int32_t>(computed, int32_t(tokens.size()));
  for (int32_t p : cache_->add_computed(id, tokens.data(), computed, tables_.full_pages(id))) full_alloc_->retain(p);
}

int64_t KvPool::flush_cache() {
  if (!cache_) return 0;
  const int64_t n = full_alloc_->evict_all();
  if (n > 0 && cache_->num_blocks() == 0) cache_->cleared();  // a flush that changed nothing says nothing
  return n;
}

std::vector<KvEvent> KvPool::take_kv_events() { return cache_ ? cache_->take_events() : std::vector<KvEvent>{}; }

KvPool::CacheStats KvPool::cache_stats() const {
  CacheStats c;
  c.query_tokens = query_tokens_;
  c.hit_tokens = hit_tokens_;
  c.cached_pages = cache_ ? cache_->num_blocks() : 0;
  c.evictable_pages = full_alloc_->num_evictable();
  return c;
}

// ---- Page policy --------------------------------------------------------------------

PagesNeeded KvPool::pages_needed(SeqId id, int32_t new_len) const {
  return tables_.pages_needed(id, new_len);
}

int64_t KvPool::max_swa_pages_held(const KvPoolConfig& cfg, int64_t len) {
  const int64_t span = std::min<int64_t>(len, int64_t(cfg.window) + cfg.max_step_tokens);
  return pages_for(span, cfg.page_size) + 1;
}

PagesNeeded KvPool::pages_held(SeqId id) const { return tables_.pages_held(id); }

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

// ---- Growing and trimming -----------------------------------------------------------

absl::Status KvPool::reserve(SeqId id, int32_t new_len) {
  const SeqPages* s = tables_.find(id);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("kv pool: reserve for unknown sequence ", id));
  if (new_len <= s->len) return absl::OkStatus();
  const PagesNeeded need = pages_needed(id, new_len);
  const int64_t swa_free = has_swa() ? swa_alloc_->num_free() : 0;
  if (need.full > full_alloc_->num_free() || need.swa > swa_free) {
    return absl::ResourceExhaustedError(absl::StrCat("kv pool exhausted: sequence ", id, " growing from ",
                                                     s->len, " to ", new_len, " tokens needs ", need.full,
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
  for (const SwaPageMapping& m : tables_.grow(id, new_len, full_pages, swa_pages)) {
    swa_map_->map(m.full_page, m.swa_page);
  }
  return absl::OkStatus();
}

void KvPool::trim_window(SeqId id) {
  if (!has_swa()) return;
  for (const SwaPageMapping& m : tables_.trim_window(id, cfg_.window)) {
    swa_map_->unmap(m.full_page);
    swa_alloc_->free(m.swa_page);
  }
}

// ---- Tables and slots ---------------------------------------------------------------

int32_t KvPool::reserved_len(SeqId id) const { return tables_.reserved_len(id); }

int64_t KvPool::slot(SeqId id, int32_t pos) const { return tables_.slot(id, pos); }

const std::vector<int32_t>& KvPool::page_table(SeqId id, PoolKind kind) const {
  return kind == PoolKind::full ? tables_.full_pages(id) : tables_.swa_pages(id);
}

// ---- SWA table changes across processes ---------------------------------------------

void KvPool::track_swa_changes() {
  if (has_swa()) swa_map_->track_changes();
}

std::vector<SwaPageMapping> KvPool::take_swa_changes() {
  if (!has_swa()) return {};
  return swa_map_->take_changes();
}

absl::Status KvPool::apply_swa_changes(const std::vector<SwaPageMapping>& changes) {
  if (!changes.empty() && !has_swa()) {
    return absl::InvalidArgumentError("kv pool: SWA table changes for a pool without SWA layers");
  }
  if (changes.empty()) return absl::OkStatus();
  return swa_map_->apply_changes(changes);
}

// ---- Invariants ---------------------------------------------------------------------

absl::Status KvPool::check_invariants() const {
  KVFUSE_RETURN_IF_ERROR(
      check_kv_pool_invariants(tables_, *full_alloc_, swa_alloc_.get(), swa_map_.get(), cfg_.window));
  // The prefix cache's blocks are exactly the retained pages; the evictable ones are the
  // retained pages no sequence holds.
  std::vector<int32_t> retained;
  int64_t evictable = 0;
  for (int32_t p = 0; p < int32_t(full_alloc_->num_pages()); ++p) {
    if (full_alloc_->is_retained(p)) retained.push_back(p);
    evictable += full_alloc_->is_evictable(p) ? 1 : 0;
  }
  if (evictable != full_alloc_->num_evictable()) {
    return absl::InternalError(absl::StrCat("kv pool: ", evictable, " evictable pages, ",
                                            full_alloc_->num_evictable(), " by count"));
  }
  if (!cache_) {
    if (!retained.empty()) return absl::InternalError("kv pool: retained pages without a prefix cache");
    return absl::OkStatus();
  }
  return cache_->check(retained);
}

}  // namespace kvfuse
