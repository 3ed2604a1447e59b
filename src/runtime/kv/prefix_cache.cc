#include "src/runtime/kv/prefix_cache.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/arith.h"

namespace kvfuse {

uint64_t prefix_cache_salt(std::string_view identity) {
  std::vector<int32_t> bytes(identity.begin(), identity.end());
  return PrefixCache::default_hash(0, bytes.data(), int32_t(bytes.size()));
}

uint64_t PrefixCache::default_hash(uint64_t parent, const int32_t* tokens, int32_t n) {
  uint64_t h = splitmix64(parent ^ uint64_t(uint32_t(n)));
  for (int32_t i = 0; i < n; ++i) h = splitmix64(h ^ uint64_t(uint32_t(tokens[i])));
  return h;
}

PrefixCache::PrefixCache(int32_t page_size, uint64_t salt, Hasher hasher)
    : page_size_(page_size), salt_(salt), hasher_(hasher) {}

void PrefixCache::reset_root(uint64_t salt) {
  salt_ = salt;
  root_id_ = next_id_++;
}

std::optional<int32_t> PrefixCache::page_of(uint64_t hash, uint64_t parent_id, const int32_t* tokens) const {
  auto [lo, hi] = by_hash_.equal_range(hash);
  for (auto it = lo; it != hi; ++it) {
    const Block& b = blocks_.at(it->second);
    if (b.parent_id == parent_id && std::equal(b.tokens.begin(), b.tokens.end(), tokens)) return it->second;
  }
  return std::nullopt;
}

PrefixCache::Match PrefixCache::match(const int32_t* tokens, int64_t limit) const {
  Match m;
  m.hash = salt_;
  m.block_id = root_id_;
  for (int64_t at = 0; at + page_size_ <= limit; at += page_size_) {
    const uint64_t h = hasher_(m.hash, tokens + at, page_size_);
    const std::optional<int32_t> page = page_of(h, m.block_id, tokens + at);
    if (!page) break;
    m.pages.push_back(*page);
    m.hash = h;
    m.block_id = blocks_.at(*page).id;
  }
  return m;
}

void PrefixCache::start(SeqId id, const Match& m) {
  progress_[id] = Progress{int32_t(m.pages.size()), m.hash, m.block_id};
}

std::vector<int32_t> PrefixCache::add_computed(SeqId id, const int32_t* tokens, int32_t computed,
                                               const std::vector<int32_t>& pages) {
  std::vector<int32_t> added;
  auto it = progress_.find(id);
  if (it == progress_.end()) it = progress_.emplace(id, Progress{0, salt_, root_id_}).first;
  Progress& p = it->second;
  const int32_t whole = std::min<int32_t>(computed / page_size_, int32_t(pages.size()));
  KvEvent stored;
  stored.kind = KvEvent::Kind::block_stored;
  stored.block_size = page_size_;
  const auto flush = [&] {
    if (!stored.block_hashes.empty()) events_.push_back(std::move(stored));
    stored = KvEvent{};
    stored.kind = KvEvent::Kind::block_stored;
    stored.block_size = page_size_;
  };
  for (; p.pages < whole; ++p.pages) {
    const int32_t* t = tokens + int64_t(p.pages) * page_size_;
    const uint64_t h = hasher_(p.hash, t, page_size_);
    const int32_t page = pages[size_t(p.pages)];
    if (const std::optional<int32_t> same = page_of(h, p.block_id, t)) {  // this content is cached already
      flush();
      p.hash = h;
      p.block_id = blocks_.at(*same).id;
      continue;
    }
    if (blocks_.count(page)) {
      // A guard, not a path: the sequence's pages past `progress` are its own, filled by it,
      // and none is a block yet. Were one already, adding it again would leave the index
      // stale; its block stands for the content instead.
      flush();
      p.hash = h;
      p.block_id = blocks_.at(page).id;
      continue;
    }
    Block b;
    b.id = next_id_++;
    b.hash = h;
    b.parent_id = p.block_id;
    b.tokens.assign(t, t + page_size_);
    if (stored.block_hashes.empty() && p.pages > 0) stored.parent_block_hash = p.hash;
    stored.block_hashes.push_back(h);
    stored.token_ids.insert(stored.token_ids.end(), t, t + page_size_);
    p.hash = h;
    p.block_id = b.id;
    blocks_.emplace(page, std::move(b));
    by_hash_.emplace(h, page);
    added.push_back(page);
  }
  flush();
  return added;
}

void PrefixCache::finish(SeqId id) { progress_.erase(id); }

void PrefixCache::evicted(int32_t page) {
  auto it = blocks_.find(page);
  if (it == blocks_.end()) return;
  auto [lo, hi] = by_hash_.equal_range(it->second.hash);
  for (auto h = lo; h != hi; ++h) {
    if (h->second == page) {
      by_hash_.erase(h);
      break;
    }
  }
  // Consecutive removals go in one event.
  if (events_.empty() || events_.back().kind != KvEvent::Kind::block_removed) {
    events_.push_back(KvEvent{KvEvent::Kind::block_removed, {}, std::nullopt, {}, 0});
  }
  events_.back().block_hashes.push_back(it->second.hash);
  blocks_.erase(it);
}

void PrefixCache::cleared() { events_.push_back(KvEvent{KvEvent::Kind::all_blocks_cleared, {}, std::nullopt, {}, 0}); }

std::vector<KvEvent> PrefixCache::take_events() { return std::exchange(events_, {}); }

absl::Status PrefixCache::check(const std::vector<int32_t>& retained) const {
  const std::unordered_set<int32_t> kept(retained.begin(), retained.end());
  if (kept.size() != blocks_.size()) {
    return absl::InternalError(absl::StrCat("prefix cache: ", blocks_.size(), " blocks, ", kept.size(), " retained pages"));
  }
  if (by_hash_.size() != blocks_.size()) {
    return absl::InternalError(absl::StrCat("prefix cache: ", blocks_.size(), " blocks, ", by_hash_.size(), " indexed"));
  }
  for (const auto& [page, b] : blocks_) {
    if (!kept.count(page)) return absl::InternalError(absl::StrCat("prefix cache: block on page ", page, " not retained"));
    if (int32_t(b.tokens.size()) != page_size_) {
      return absl::InternalError(absl::StrCat("prefix cache: block on page ", page, " holds ", b.tokens.size(), " tokens"));
    }
  }
  for (const auto& [hash, page] : by_hash_) {
    auto it = blocks_.find(page);
    if (it == blocks_.end() || it->second.hash != hash) {
      return absl::InternalError(absl::StrCat("prefix cache: index entry for page ", page, " is stale"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
