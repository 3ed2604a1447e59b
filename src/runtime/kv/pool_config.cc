#include "src/runtime/kv/pool_config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvfuse {

namespace {

// Buffers beyond this are a unit mix-up in the config, not a real cache (256 TiB).
constexpr int64_t kMaxBufferBytes = int64_t(1) << 48;

bool mul_checked(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

}  // namespace

bool has_swa_layers(const KvPoolConfig& c) {
  return std::find(c.layer_is_swa.begin(), c.layer_is_swa.end(), true) != c.layer_is_swa.end();
}

absl::Status validate_kv_pool_config(const KvPoolConfig& c) {
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
  const bool any_swa = has_swa_layers(c);
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

}  // namespace kvfuse
