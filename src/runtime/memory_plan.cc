#include "src/runtime/memory_plan.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvfuse {

namespace {

double gib(int64_t bytes) { return double(bytes) / double(int64_t(1) << 30); }

// "71.25 GiB", or "300.0 MiB" under a GiB (negative: what is missing).
std::string size_str(int64_t bytes) {
  if (bytes >= (int64_t(1) << 30) || bytes <= -(int64_t(1) << 30)) return absl::StrFormat("%.2f GiB", gib(bytes));
  return absl::StrFormat("%.1f MiB", double(bytes) / double(int64_t(1) << 20));
}

// The pool of `pages` full pages, its SWA pool as swa_pages says.
int64_t pool_bytes_for(KvPoolConfig cfg, const std::function<int64_t(int64_t)>& swa_pages, int64_t pages) {
  cfg.num_pages = pages;
  cfg.swa_num_pages = has_swa_layers(cfg) ? swa_pages(pages) : 0;
  return kv_pool_bytes(cfg);
}

}  // namespace

std::string describe_memory(const MemorySplit& m) {
  return absl::StrCat("weights ", size_str(m.weight_bytes), ", KV pool ", size_str(m.kv_pool_bytes),
                      m.pool_auto ? " (sized to fit)" : "", ", workspaces ", size_str(m.workspace_bytes), ", graphs ",
                      size_str(m.graph_bytes), "; device ", size_str(m.device_total_bytes), ", ",
                      size_str(m.device_free_bytes), " free (headroom ", size_str(m.headroom_bytes), ")");
}

absl::Status check_cpu_weight_memory(const ModelSpec& s, double available_gib) {
  // Refuse shapes whose weights cannot fit in memory with a message instead of failing an
  // allocation half way.
  const double need_gib = double(s.weight_bytes()) / double(1 << 30);
  if (available_gib > 0 && need_gib > 0.8 * available_gib) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("model '%s' needs %.1f GiB of %s weights on the CPU backend, %.1f GiB available; "
                        "use a GPU device or the tiny preset",
                        s.name, need_gib, s.weight_format(), available_gib));
  }
  return absl::OkStatus();
}

int64_t kv_pool_bytes(const KvPoolConfig& cfg) {
  const int64_t page_bytes =
      int64_t(cfg.page_size) * cfg.num_kv_heads * cfg.head_dim * int64_t(kv_format_bytes(cfg.format));
  int64_t bytes = 0;
  for (int32_t l = 0; l < cfg.num_layers; ++l) {
    const bool swa = size_t(l) < cfg.layer_is_swa.size() && cfg.layer_is_swa[size_t(l)];
    bytes += 2 * (swa ? cfg.swa_num_pages : cfg.num_pages) * page_bytes;
  }
  bytes += 4 * int64_t(cfg.num_layers) * int64_t(sizeof(float));
  if (has_swa_layers(cfg)) bytes += cfg.num_pages * cfg.page_size * int64_t(sizeof(int64_t));
  return bytes;
}

int64_t kv_pool_bytes(const ModelSpec& spec, int32_t page_size, KvFormat format, int64_t full_pages,
                      int64_t swa_pages) {
  KvPoolConfig pc;
  pc.num_layers = spec.num_layers;
  pc.page_size = page_size;
  pc.num_pages = full_pages;
  pc.swa_num_pages = swa_pages;
  pc.num_kv_heads = spec.num_kv_heads;
  pc.head_dim = spec.head_dim;
  pc.format = format;
  pc.layer_is_swa = spec.layer_is_swa;
  return kv_pool_bytes(pc);
}

absl::StatusOr<int64_t> plan_pool_pages(const KvPoolConfig& cfg, const std::function<int64_t(int64_t)>& swa_pages,
                                        const PoolBudget& b, int64_t requested) {
  const int64_t room = b.free_bytes - b.headroom_bytes;
  const auto bytes = [&](int64_t pages) { return pool_bytes_for(cfg, swa_pages, pages); };
  // The most pages that fit in `room` (0 if not one): the pool's bytes grow with its pages.
  int64_t lo = 0, hi = std::numeric_limits<int32_t>::max();
  if (room <= 0 || bytes(1) > room) {
    hi = 0;
  } else {
    lo = 1;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (bytes(mid) <= room) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
  }
  const int64_t fit = lo;
  if (requested > 0 && bytes(requested) <= room) return requested;
  if (requested == 0 && fit > 0) return fit;
  const std::string in = absl::StrCat(size_str(b.weight_bytes), " of weights",
                                      b.weights_estimated ? " (the model's size; not loaded yet)" : "", " and ",
                                      size_str(b.workspace_bytes), " of workspaces");
  const std::string device = absl::StrCat("the device has ", size_str(b.free_bytes), " of ", size_str(b.total_bytes),
                                          " free with ", in, ", and ", size_str(b.headroom_bytes),
                                          " must stay free (memory_headroom_mib)");
  if (requested == 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("num_pages 0 (as many as fit): not one page of ", size_str(bytes(1)), " fits: ", device));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "num_pages ", requested, " needs a KV pool of ", size_str(bytes(requested)), ", ", device,
      fit > 0 ? absl::StrCat("; at most ", fit, " pages fit (num_pages 0 takes them)") : "; not one page fits"));
}

}  // namespace kvfuse
