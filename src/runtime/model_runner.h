// Runs the model on a batch: uploads the step's metadata, owns the working memory of a
// pass (activations, logits), pads decode-only batches to a graph bucket and replays
// their graphs, and reads the results back.
#pragma once

#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "src/backends/backend.h"
#include "src/runtime/kv_pool.h"
#include "src/runtime/model.h"

namespace kvfuse {

// Host-side metadata of one forward pass, built by the engine (nano-vllm style).
struct ForwardBatch {
  std::vector<int32_t> token_ids;         // [T]
  std::vector<int32_t> positions;         // [T]
  std::vector<int64_t> slot_mapping;      // [T] full-pool slots, -1 = skip
  std::vector<int32_t> query_start;       // [S + 1]
  std::vector<int32_t> context_len;       // [S]
  std::vector<int32_t> block_table_full;  // [S, max_pages_per_seq]
  std::vector<int32_t> block_table_swa;   // [S, max_pages_per_seq], empty without SWA layers
  int32_t max_pages_per_seq = 0;
  int32_t max_query_len = 0;
  int32_t max_context_len = 0;
  std::vector<int32_t> logits_rows;   // rows of T whose greedy token (and maybe logits) are returned
  std::vector<uint8_t> logits_host;   // per logits row: 1 copies the row's logits to the host
  std::vector<RowSampling> sampling;  // per logits row: temperature > 0 samples on the device
  // The logit processors (kernels/ops/sampling.h), or both empty when no row has any:
  // logits row k's entries are adjust[adjust_start[k] .. adjust_start[k + 1]), one per token.
  std::vector<int32_t> adjust_start;  // [logits rows + 1]
  std::vector<LogitAdjust> adjust;
  // Logprobs (kernels/ops/sampling.h): per logits row, or empty when no row asks.
  std::vector<LogprobRow> logprobs;
  // Rows of T whose logits serve logprobs only (prompt tokens, targets known); not in a
  // decode-only batch.
  std::vector<int32_t> extra_rows;
  std::vector<LogprobRow> extra_logprobs;  // per extra row

  int64_t num_tokens() const { return int64_t(token_ids.size()); }
  int32_t num_seqs() const { return int32_t(context_len.size()); }
};

struct ForwardOptions {
  KvWritePath kv_write = KvWritePath::fused;
  AttentionPath attention = AttentionPath::unified;
  // Decode-only batches run as a graph captured per (batch bucket, context bucket, paths)
  // on backends that have graphs; elsewhere, and for batches with prefill rows, eagerly.
  bool graphs = true;
  // With graphs: false pads the batch to its bucket exactly as a replay would but runs it
  // eagerly (tests compare the two; a replay must equal it bit for bit).
  bool graph_replay = true;
};

// What a forward pass returns per logits row: the greedy and the sampled token are
// computed on the device, so only rows whose logits are asked for cross the bus.
struct ForwardResult {
  std::vector<int32_t> tokens;   // [logits rows] greedy token (first index of the maximum)
  std::vector<int32_t> finite;   // [logits rows] 1 if every logit of the row is finite
  std::vector<int32_t> sampled;  // [logits rows] token drawn under the row's RowSampling (temperature > 0)
  std::vector<float> logits;     // [rows with logits_host set, vocab], in logits-row order
  std::vector<LogprobOut> logprobs;        // [logits rows] where batch.logprobs asks; else empty
  std::vector<LogprobOut> extra_logprobs;  // [extra rows]
  bool graph = false;            // the pass replayed (or captured) a graph
};

// Counters of the graph path, for tests and logs.
struct GraphStats {
  int64_t captures = 0;      // graphs recorded (each after one eager run of its bucket)
  int64_t replays = 0;       // steps that replayed a graph
  int64_t padded_eager = 0;  // steps padded to a bucket and run eagerly (graph_replay off)
  int64_t invalidated = 0;   // graphs dropped because backend scratch memory was replaced
  int64_t num_graphs = 0;    // graphs held now
};

struct ModelLimits {
  int64_t max_tokens = 0;  // rows of one forward pass
  int32_t max_seqs = 0;
  int32_t max_pages_per_seq = 0;
};

// Where each piece of a step's batch metadata lives: byte offsets into the runner's one
// device buffer of metadata and into its host staging buffer, which is laid out the same
// so that a step uploads with one copy. Fixed by the limits (each slice sized for the
// largest step) and never moved, since captured graphs hold the slices' addresses; every
// slice starts on a kAlign boundary. A slice's bytes in a step are its prefix.
//
// Order: what every step uses first, smallest first — the per-sequence slices, then the
// per-token ones, then the block tables (the SWA one only on models with SWA layers) —
// and last the extra rows that only prompt-logprob steps use, so the used span of a
// decode step (offset 0 to its last used byte) skips the slices it does not use at the end.
struct BatchMetaLayout {
  static constexpr size_t kAlign = 256;
  struct Slice {
    size_t offset = 0;
    size_t capacity = 0;  // bytes
  };
  Slice query_start;       // [max_seqs + 1] int32
  Slice context_len;       // [max_seqs] int32
  Slice logits_rows;       // [max_seqs] int32
  Slice sampling;          // [max_seqs] RowSampling
  Slice logprobs;          // [max_seqs] LogprobRow
  Slice adjust_start;      // [max_seqs + 1] int32 (the entries are a buffer of their own)
  Slice token_ids;         // [max_tokens] int32
  Slice positions;         // [max_tokens] int32
  Slice slot_mapping;      // [max_tokens] int64
  Slice block_table_full;  // [max_seqs * max_pages_per_seq] int32
  Slice block_table_swa;   // [max_seqs * max_pages_per_seq] int32 of room: a step's SWA table starts
                           // right after the full table's used part, inside these two slices
  Slice extra_rows;        // [max_tokens] int32
  Slice extra_logprobs;    // [max_tokens] LogprobRow
  size_t total = 0;        // bytes of the whole buffer, a multiple of kAlign

  static BatchMetaLayout for_limits(const ModelLimits& limits);
  // Every slice with its name, in buffer order.
  std::vector<std::pair<const char*, Slice>> slices() const;
};

class ModelRunner {
 public:
  // Allocates the working memory of a pass for `limits` (all positive).
  static absl::StatusOr<std::unique_ptr<ModelRunner>> create(Backend& backend, Model& model,
                                                             const ModelLimits& limits);

  const ModelLimits& limits() const { return limits_; }

  // Runs the batch, writes the new K/V of every layer into `pool`, and returns for each
  // of `batch.logits_rows` the greedy token, a finiteness flag and, where
  // `batch.logits_host` asks, the fp32 logits. Tensor parallelism: every rank's runner
  // runs the same batch at once (each on its thread, into its storage of the pool); rank
  // 0's result has the tokens, the others' is empty.
  //
  // With opts.graphs, a decode-only batch (one token per sequence) on a backend with
  // graphs is padded to its bucket — sequences to graph_batch_bucket(), keys to
  // graph_context_bucket() — and replays the graph of (bucket, write path, attention
  // path), captured after the bucket's first, eager, run. Padding rows have slot -1 (no
  // KV write) and belong to no sequence (attention skips them).
  absl::Status run(const ForwardBatch& batch, KvPool& pool, const ForwardOptions& opts, ForwardResult& out);
  // run() in two halves: launch() queues the step (its metadata copy, then the graph or
  // the kernels) and returns without waiting; finish() waits for it and fills `out`.
  // Between the two the caller may do host work of its own while the device runs, but
  // must not change `batch` or the pool, nor run another step. Every launch() that
  // succeeds is followed by exactly one finish() with the same batch.
  absl::Status launch(const ForwardBatch& batch, KvPool& pool, const ForwardOptions& opts, ForwardResult& out);
  absl::Status finish(const ForwardBatch& batch, ForwardResult& out);

  const GraphStats& graph_stats() const { return graph_stats_; }
  const BatchMetaLayout& meta_layout() const { return meta_layout_; }
  // Bytes the last step's one metadata copy moved (its used span of the layout).
  size_t last_upload_bytes() const { return last_upload_bytes_; }
  // Buckets: up to 4 sequences a power of two, then multiples of 8 up to 64, of 32 up to
  // 256, of 64 beyond; never above the limits. Context: a power of two from 512 to
  // 4096 keys, then a multiple of 4096; at most max_pages_per_seq pages.
  int32_t graph_batch_bucket(int32_t num_seqs) const;
  int32_t graph_context_bucket(int32_t max_context_len, int32_t page_size) const;

 private:
  ModelRunner(Backend& backend, Model& model, ModelLimits limits)
      : backend_(backend),
        model_(model),
        limits_(limits),
        meta_layout_(BatchMetaLayout::for_limits(limits)) {}
  absl::Status init_workspace();
  // Validates the batch, packs its metadata into the staging buffer and queues the one
  // copy of the used span to the device.
  // `adjust`: the entries b.adjust_start indexes (the caller's batch's, also when `b` is
  // its padded copy).
  absl::Status upload_batch(const ForwardBatch& b, const std::vector<LogitAdjust>& adjust);
  // Queues the copy of the logit-processor entries, growing their buffers first when
  // they are too small.
  absl::Status upload_adjust(const std::vector<LogitAdjust>& adjust);
  // A slice of the device metadata buffer.
  template <class T>
  T* meta(const BatchMetaLayout::Slice& s) const {
    return reinterpret_cast<T*>(meta_.as<char>() + s.offset);
  }
  // The pass over the uploaded batch `b`: every op after the upload, what a graph holds.
  absl::Status run_model(const ForwardBatch& b, KvPool& pool, const ForwardOptions& opts);
  void pad_for_graph(const ForwardBatch& in, int32_t page_size, ForwardBatch& out) const;
  absl::Status run_graph(const ForwardBatch& b, KvPool& pool, const ForwardOptions& opts);
  void drop_stale_graphs();
  // Copies the caller's rows of a pass over `ran` (the batch, or its padded copy) to `out`.
  absl::Status read_back(const ForwardBatch& in, const ForwardBatch& ran, bool padded, ForwardResult& out);

  struct GraphKey {
    int32_t seqs, pages;
    KvWritePath write;
    AttentionPath attention;
    bool logprobs;  // the graph ends with the logprobs kernel
    bool adjust;    // the graph runs the logit processors
    bool operator<(const GraphKey& o) const {
      return std::tie(seqs, pages, write, attention, logprobs, adjust) <
             std::tie(o.seqs, o.pages, o.write, o.attention, o.logprobs, o.adjust);
    }
  };

  Backend& backend_;
  Model& model_;
  ModelLimits limits_;

  std::map<GraphKey, std::unique_ptr<BackendGraph>> graphs_;
  uint64_t graph_epoch_ = 0;
  GraphStats graph_stats_;
  ForwardBatch padded_;                     // reused between steps
  std::vector<int32_t> host_rows_;          // tokens, finite flags, sampled tokens of every computed row
  std::vector<RowSampling> sampling_host_;  // all-greedy parameters when a batch brings none

  // The step's metadata: one device buffer, sliced by meta_layout_, and its host staging
  // copy (pinned on GPUs), each this runner's own (tensor-parallel ranks run their
  // runners at once, on their threads). The copy from the staging buffer is asynchronous
  // on GPUs, so the buffer must not be rewritten while it may be in flight: every
  // successful step ends in read_back, which synchronises the stream, so the next step
  // finds it free; a step that failed after queueing its copy leaves meta_in_flight_
  // set, and the next upload synchronises first. A path that skips that synchronisation
  // (overlapping the next step's packing with this step's kernels) would need two
  // staging buffers used in turn.
  BatchMetaLayout meta_layout_;
  DeviceBuffer meta_;
  HostBuffer meta_host_;
  bool meta_in_flight_ = false;
  bool launched_padded_ = false;  // launch() ran the padded copy (padded_): finish() reads its rows
  size_t swa_table_offset_ = 0;  // this step's SWA block table (after the full table's used part)
  size_t last_upload_bytes_ = 0;

  // Working memory, sized for limits_.
  DeviceBuffer x_, h_, qkv_, attn_, gate_up_, act_, last_, logits_;
  DeviceBuffer logits_shard_, logits_gathered_;  // tensor parallelism only
  DeviceBuffer argmax_;  // [3, rows] int32: greedy tokens, finiteness flags, sampled tokens
  DeviceBuffer lp_out_;  // [max_seqs + max_tokens] LogprobOut
  // The logit processors' entries: a step's are copied from the staging buffer (pinned on
  // GPUs; the same in-flight rule as the metadata's). Both grow on demand (doubling),
  // which drops the graphs that run the processors (they hold the old address).
  DeviceBuffer adjust_;
  HostBuffer adjust_host_;
  size_t adjust_capacity_ = 0;  // entries
  std::vector<LogprobOut> lp_host_;
};

}  // namespace kvfuse
