// PrefixCache: which full-pool pages hold the KV of which token prefix, so that a new
// sequence whose prompt begins with a cached prefix takes those pages instead of computing
// them again (docs/design.md#prefix-cache).
//
// A block is one full page of computed KV: the page_size tokens it holds and the chain of
// blocks before it. Its hash chains the block before it: hash = H(parent's hash, its
// tokens), the first block's parent hash being the cache's salt, which stands for
// everything else that makes KV differ (the model, the KV format and scales, RoPE); a
// router that reads the cache's events sees these hashes. A hash only finds candidates:
// a block is a hit only if its tokens equal the prompt's and its parent is the very block
// matched before it (a block id, never reused), so two prefixes that share a hash are told
// apart, and a hit means the whole prefix is the same tokens.
//
// Owns: the blocks (one per cached page), the index by hash, each live sequence's progress
// through its own pages, and the events not yet taken. The pages themselves are the
// allocator's (src/runtime/kv/page_allocator.h: a cached page is retained; evicting it
// calls evicted() here); which sequence holds them, the page tables'.
//
// Invariants:
// - a block's page is retained in the allocator, and each retained page has one block;
// - a block never changes once added (its page is full and only ever read);
// - the events, in order, replay the blocks added and removed.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "src/runtime/kv/page_tables.h"

namespace kvfuse {

// What the cache did, in the shape routers read (vLLM's and SGLang's KV events):
// block_stored (hashes of consecutive blocks, the hash before the first, their tokens),
// block_removed (hashes), all_blocks_cleared.
struct KvEvent {
  enum class Kind { block_stored, block_removed, all_blocks_cleared };
  Kind kind = Kind::block_stored;
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_block_hash;  // block_stored: none for a first block
  std::vector<int32_t> token_ids;             // block_stored: block_size per hash
  int32_t block_size = 0;                     // block_stored
};

// A chain salt from a description of what makes KV differ (Engine: the model's identity).
uint64_t prefix_cache_salt(std::string_view identity);

class PrefixCache {
 public:
  // hash(parent hash, tokens, n): the chain's step. The default is a 64-bit mix of every
  // token; tests pass a degenerate one to force collisions.
  using Hasher = uint64_t (*)(uint64_t parent, const int32_t* tokens, int32_t n);
  static uint64_t default_hash(uint64_t parent, const int32_t* tokens, int32_t n);

  PrefixCache(int32_t page_size, uint64_t salt, Hasher hasher = &default_hash);

  // A new salt (the KV's scales changed): every block cached so far becomes unreachable,
  // the chains starting again from a new root.
  void reset_root(uint64_t salt);

  // A cached prefix: its pages in order, and where the chain stands after it.
  struct Match {
    std::vector<int32_t> pages;
    uint64_t hash = 0;      // the last block's hash (the salt for none)
    uint64_t block_id = 0;  // the last block's id (the root's for none)
  };
  // The longest chain of cached blocks that tokens[0, limit) begins with, whole pages only.
  Match match(const int32_t* tokens, int64_t limit) const;

  // Sequence `id` starts with the matched prefix (possibly empty) as its first pages.
  void start(SeqId id, const Match& m);
  // Sequence `id` (started) has computed KV for its first `computed` tokens, in `pages`
  // (its page table): each whole page past those already seen becomes a block, unless a
  // block of the same content exists (another page computed it: that block stands for it
  // in the chain). Returns the pages that became blocks, to be retained.
  std::vector<int32_t> add_computed(SeqId id, const int32_t* tokens, int32_t computed,
                                    const std::vector<int32_t>& pages);
  // The sequence is gone (its pages released).
  void finish(SeqId id);
  // The allocator took back a retained page: its block goes (block_removed).
  void evicted(int32_t page);
  // Every block's page was evicted: all_blocks_cleared (the cache is empty).
  void cleared();

  int64_t num_blocks() const { return int64_t(blocks_.size()); }
  bool holds(int32_t page) const { return blocks_.count(page) != 0; }
  // The events since the last take, in order.
  std::vector<KvEvent> take_events();
  // Index and blocks agree; every block's page is one of `retained` (for tests).
  absl::Status check(const std::vector<int32_t>& retained) const;

 private:
  struct Block {
    uint64_t id = 0;
    uint64_t hash = 0;
    uint64_t parent_id = 0;  // the root's id for the first block of a chain
    std::vector<int32_t> tokens;
  };
  struct Progress {
    int32_t pages = 0;  // pages of the sequence seen so far
    uint64_t hash = 0;
    uint64_t block_id = 0;
  };
  // The page of the block of this content after `parent_id`, if one is cached.
  std::optional<int32_t> page_of(uint64_t hash, uint64_t parent_id, const int32_t* tokens) const;

  int32_t page_size_;
  uint64_t salt_;
  Hasher hasher_;
  uint64_t next_id_ = 1;
  uint64_t root_id_ = next_id_++;  // the parent of every chain's first block
  std::unordered_map<int32_t, Block> blocks_;              // by page
  std::unordered_multimap<uint64_t, int32_t> by_hash_;     // hash -> page
  std::unordered_map<SeqId, Progress> progress_;
  std::vector<KvEvent> events_;
};

}  // namespace kvfuse
