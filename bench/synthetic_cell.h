// A decode-benchmark cell without a prefill: `batch` sequences whose first `context - 1`
// tokens count as computed (Engine::assume_computed reserves their pages; the cache
// keeps whatever bytes the pages hold), then one step of the last prompt token, after
// which every sequence decodes over a context of `context` keys. Shared by kvfuse-ab and
// kvfuse-bench-engine.
#pragma once

#include <optional>
#include <vector>

#include "src/common/status_macros.h"
#include "src/runtime/engine.h"

namespace kvfuse::bench {

inline absl::Status start_synthetic_cell(Engine& e, int batch, int context, SeqId first_id,
                                         const std::optional<ForwardOptions>& opts = std::nullopt) {
  const int32_t vocab = e.spec().vocab;
  std::vector<StepItem> items;
  for (int i = 0; i < batch; ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(context));
    for (int t = 0; t < context; ++t) prompt[size_t(t)] = (t * 31 + i * 7 + 1) % vocab;
    const SeqId id = first_id + SeqId(i);
    KVFUSE_RETURN_IF_ERROR(e.add_sequence(id, std::move(prompt), SamplingParams{}));
    KVFUSE_RETURN_IF_ERROR(e.assume_computed(id, context - 1));
    items.push_back({id, 1, true});
  }
  auto r = opts ? e.step(items, *opts) : e.step(items);
  if (!r.ok()) return r.status();
  for (const auto& x : *r) {
    if (!x.status.ok()) return x.status;
  }
  return absl::OkStatus();
}

}  // namespace kvfuse::bench
