// The engine's internals that its two files share (src/runtime/engine.cc: creation, the
// step; src/runtime/engine_ranks.cc: the tensor-parallel ranks inside one process).
#pragma once

#include <memory>

#include "src/backends/backend.h"
#include "src/loading/config.h"
#include "src/parallel/communicator.h"
#include "src/runtime/engine.h"
#include "src/runtime/model.h"
#include "src/runtime/model_runner.h"
#include "src/runtime/rank_thread.h"

namespace kvfuse {

// A tensor-parallel rank other than 0: its thread, device, communicator and model.
struct Engine::Rank {
  std::unique_ptr<RankThread> thread;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Model> model;
  std::unique_ptr<ModelRunner> runner;
  ForwardResult fwd;
};

// The runner's size limits from the engine's config.
inline ModelLimits model_limits(const Config& cfg) {
  ModelLimits limits;
  limits.max_tokens = cfg.max_batch_tokens;
  limits.max_seqs = cfg.max_running_seqs;
  limits.max_pages_per_seq = int32_t((int64_t(cfg.max_seq_len) + cfg.page_size - 1) / cfg.page_size);
  return limits;
}

}  // namespace kvfuse
