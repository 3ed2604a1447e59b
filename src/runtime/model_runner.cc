#include "src/runtime/model_runner.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "src/common/arith.h"
#include "src/common/status_macros.h"

namespace kvfuse {

BatchMetaLayout BatchMetaLayout::for_limits(const ModelLimits& limits) {
  const size_t T = size_t(std::max<int64_t>(limits.max_tokens, 0));
  const size_t S = size_t(std::max<int32_t>(limits.max_seqs, 0));
  const size_t P = size_t(std::max<int32_t>(limits.max_pages_per_seq, 0));
  BatchMetaLayout m;
  size_t at = 0;
  auto place = [&](Slice& s, size_t bytes) {
    s.offset = at;
    s.capacity = bytes;
    at = size_t(round_up(int64_t(at + bytes), kAlign));
  };
  place(m.query_start, (S + 1) * sizeof(int32_t));
  place(m.context_len, S * sizeof(int32_t));
  place(m.logits_rows, S * sizeof(int32_t));
  place(m.sampling, S * sizeof(RowSampling));
  place(m.logprobs, S * sizeof(LogprobRow));
  place(m.adjust_start, (S + 1) * sizeof(int32_t));
  place(m.token_ids, T * sizeof(int32_t));
  place(m.positions, T * sizeof(int32_t));
  place(m.slot_mapping, T * sizeof(int64_t));
  place(m.block_table_full, S * P * sizeof(int32_t));
  place(m.block_table_swa, S * P * sizeof(int32_t));
  place(m.extra_rows, T * sizeof(int32_t));
  place(m.extra_logprobs, T * sizeof(LogprobRow));
  m.total = std::max(at, kAlign);
  return m;
}

std::vector<std::pair<const char*, BatchMetaLayout::Slice>> BatchMetaLayout::slices() const {
  return {{"query_start", query_start},
          {"context_len", context_len},
          {"logits_rows", logits_rows},
          {"sampling", sampling},
          {"logprobs", logprobs},
          {"adjust_start", adjust_start},
          {"token_ids", token_ids},
          {"positions", positions},
          {"slot_mapping", slot_mapping},
          {"block_table_full", block_table_full},
          {"block_table_swa", block_table_swa},
          {"extra_rows", extra_rows},
          {"extra_logprobs", extra_logprobs}};
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::create(Backend& backend, Model& model,
                                                                 const ModelLimits& limits) {
  if (limits.max_tokens <= 0 || limits.max_seqs <= 0 || limits.max_pages_per_seq <= 0) {
    return absl::InvalidArgumentError("model limits must be positive");
  }
  std::unique_ptr<ModelRunner> r(new ModelRunner(backend, model, limits));
  KVFUSE_RETURN_IF_ERROR(r->init_workspace());
  return r;
}

absl::Status ModelRunner::init_workspace() {
  const ModelSpec& s = model_.spec();
  const RankDims& d = model_.dims();
  const int64_t T = limits_.max_tokens;
  const int64_t S = limits_.max_seqs;
  struct Want {
    DeviceBuffer* buf;
    size_t bytes;
  };
  const Want wants[] = {
      {&x_, size_t(T * s.hidden) * 2},
      {&h_, size_t(T * s.hidden) * 2},
      {&qkv_, size_t(T * d.qkv_dim()) * 2},
      {&attn_, size_t(T * d.q_dim()) * 2},
      {&gate_up_, size_t(T * 2 * d.intermediate) * 2},
      {&act_, size_t(T * d.intermediate) * 2},
      {&last_, size_t(S * s.hidden) * 2},
      {&logits_, size_t(S * s.vocab) * 4},
      {&argmax_, size_t(3 * S) * 4},
      {&lp_out_, size_t(S + T) * sizeof(LogprobOut)},
      {&meta_, meta_layout_.total},
  };
  for (const Want& w : wants) {
    auto b = backend_.alloc(w.bytes);
    if (!b.ok()) return b.status();
    *w.buf = std::move(*b);
  }
  // Zeroed once, so the bytes of a slice a step does not fill (which the one copy of the
  // used span may carry along) are never uninitialised memory.
  auto staging = backend_.alloc_host(meta_layout_.total);
  if (!staging.ok()) return staging.status();
  meta_host_ = std::move(*staging);
  std::memset(meta_host_.get(), 0, meta_layout_.total);
  KVFUSE_RETURN_IF_ERROR(backend_.memset(meta_.get(), 0, meta_layout_.total));
  if (model_.tp() > 1) {
    // The vocab-parallel lm_head's slice and the gathered slices of every rank.
    for (auto [buf, rows] : {std::pair{&logits_shard_, S}, std::pair{&logits_gathered_, S * model_.tp()}}) {
      auto b = backend_.alloc(size_t(rows * d.vocab) * 4);
      if (!b.ok()) return b.status();
      *buf = std::move(*b);
    }
  }
  // The unfused KV write's intermediates are the backend's scratch, sized here for T.
  return backend_.reserve_kv_write(T, d.kv_dim());
}

absl::Status ModelRunner::upload_batch(const ForwardBatch& b, const std::vector<LogitAdjust>& adjust) {
  const int64_t T = b.num_tokens();
  const int32_t S = b.num_seqs();
  if (T <= 0 || T > limits_.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("forward: ", T, " tokens, limit ", limits_.max_tokens));
  }
  if (S <= 0 || S > limits_.max_seqs || int64_t(b.logits_rows.size()) > limits_.max_seqs) {
    return absl::InvalidArgumentError(absl::StrCat("forward: ", S, " sequences, limit ", limits_.max_seqs));
  }
  if (b.max_pages_per_seq <= 0 || b.max_pages_per_seq > limits_.max_pages_per_seq) {
    return absl::InvalidArgumentError(absl::StrCat("forward: ", b.max_pages_per_seq,
                                                   " pages per sequence, limit ", limits_.max_pages_per_seq));
  }
  // The SWA block table, when there is one, has the full one's shape (it lands in a slice
  // sized like the full one's).
  if (b.positions.size() != size_t(T) || b.slot_mapping.size() != size_t(T) ||
      b.query_start.size() != size_t(S) + 1 ||
      b.block_table_full.size() != size_t(S) * size_t(b.max_pages_per_seq) ||
      (!b.block_table_swa.empty() && b.block_table_swa.size() != b.block_table_full.size())) {
    return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
  }
  for (int32_t id : b.token_ids) {
    if (id < 0 || id >= model_.spec().vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward: token id ", id, " outside the vocabulary [0, ", model_.spec().vocab, ")"));
    }
  }
  if (!b.sampling.empty() && b.sampling.size() != b.logits_rows.size()) {
    return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
  }
  if (!b.logprobs.empty() && b.logprobs.size() != b.logits_rows.size()) {
    return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
  }
  if (!b.adjust_start.empty()) {
    if (b.adjust_start.size() != b.logits_rows.size() + 1 || b.adjust_start.front() != 0 ||
        size_t(b.adjust_start.back()) != adjust.size() ||
        !std::is_sorted(b.adjust_start.begin(), b.adjust_start.end())) {
      return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
    }
    for (const LogitAdjust& a : adjust) {
      if (a.token < 0 || a.token >= model_.spec().vocab) {
        return absl::InvalidArgumentError(absl::StrCat("forward: logit processor token ", a.token,
                                                       " outside the vocabulary [0, ", model_.spec().vocab, ")"));
      }
    }
  } else if (!adjust.empty()) {
    return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
  }
  if (!b.extra_rows.empty()) {
    if (b.extra_logprobs.size() != b.extra_rows.size() || int64_t(b.extra_rows.size()) > T) {
      return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
    }
    for (size_t e = 0; e < b.extra_rows.size(); ++e) {
      const int32_t row = b.extra_rows[e], target = b.extra_logprobs[e].target;
      if (row < 0 || row >= T || target < 0 || target >= model_.spec().vocab) {
        return absl::InvalidArgumentError(
            absl::StrCat("forward: logprobs row ", row, " with target ", target, " is out of range"));
      }
    }
  }

  // The previous step's copy may still be reading the staging buffer only if that step
  // failed before read_back synchronised (see meta_in_flight_).
  if (meta_in_flight_) {
    KVFUSE_RETURN_IF_ERROR(backend_.synchronize());
    meta_in_flight_ = false;
  }
  char* host = meta_host_.as<char>();
  size_t used_end = 0;
  auto put = [&](const BatchMetaLayout::Slice& s, const void* src, size_t bytes) -> absl::Status {
    if (bytes > s.capacity) {  // the checks above bound every size by the limits
      return absl::InternalError(
          absl::StrCat("forward: ", bytes, " bytes of metadata for a slice of ", s.capacity));
    }
    if (bytes == 0) return absl::OkStatus();
    std::memcpy(host + s.offset, src, bytes);
    used_end = std::max(used_end, s.offset + bytes);
    return absl::OkStatus();
  };
  auto put_vec = [&](const BatchMetaLayout::Slice& s, const auto& v) {
    return put(s, v.data(), v.size() * sizeof(v[0]));
  };
  const BatchMetaLayout& L = meta_layout_;
  KVFUSE_RETURN_IF_ERROR(put_vec(L.query_start, b.query_start));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.context_len, b.context_len));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.logits_rows, b.logits_rows));
  if (b.sampling.empty()) sampling_host_.assign(b.logits_rows.size(), RowSampling{});  // every row greedy
  KVFUSE_RETURN_IF_ERROR(put_vec(L.sampling, b.sampling.empty() ? sampling_host_ : b.sampling));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.logprobs, b.logprobs));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.adjust_start, b.adjust_start));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.token_ids, b.token_ids));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.positions, b.positions));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.slot_mapping, b.slot_mapping));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.block_table_full, b.block_table_full));
  // The SWA block table goes right after the full one's used part, not at its own slice's
  // start: a decode step then copies the two tables' used bytes, not the full table's
  // unused tail (megabytes at large limits). Its offset depends only on the full table's
  // size (sequences x pages), which a graph's key fixes, so a replay finds it where the
  // capture did. It stays inside the two tables' slices.
  swa_table_offset_ = L.block_table_full.offset + size_t(round_up(int64_t(b.block_table_full.size() * sizeof(int32_t)),
                                                                   BatchMetaLayout::kAlign));
  const BatchMetaLayout::Slice swa{swa_table_offset_,
                                   L.block_table_swa.offset + L.block_table_swa.capacity - swa_table_offset_};
  KVFUSE_RETURN_IF_ERROR(put_vec(swa, b.block_table_swa));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.extra_rows, b.extra_rows));
  KVFUSE_RETURN_IF_ERROR(put_vec(L.extra_logprobs, b.extra_logprobs));

  // One copy, offset 0 (query_start, always used) to the last used byte; the unused
  // tails of the slices inside that span carry whatever the staging buffer holds there,
  // which no kernel reads.
  last_upload_bytes_ = used_end;
  KVFUSE_RETURN_IF_ERROR(backend_.copy_to_device(meta_.get(), host, used_end));
  meta_in_flight_ = true;
  return upload_adjust(adjust);
}

absl::Status ModelRunner::upload_adjust(const std::vector<LogitAdjust>& adjust) {
  if (adjust.empty()) return absl::OkStatus();
  if (adjust.size() > adjust_capacity_) {
    size_t cap = std::max<size_t>(adjust_capacity_, 4096);
    while (cap < adjust.size()) cap *= 2;
    // Nothing reads the old buffers now: upload_batch synchronised any copy in flight,
    // and the graphs that hold the device buffer's address go with it.
    KVFUSE_RETURN_IF_ERROR(backend_.synchronize());
    for (auto it = graphs_.begin(); it != graphs_.end();) {
      if (it->first.adjust) {
        ++graph_stats_.invalidated;
        it = graphs_.erase(it);
      } else {
        ++it;
      }
    }
    graph_stats_.num_graphs = int64_t(graphs_.size());
    auto dev = backend_.alloc(cap * sizeof(LogitAdjust));
    if (!dev.ok()) return dev.status();
    auto host = backend_.alloc_host(cap * sizeof(LogitAdjust));
    if (!host.ok()) return host.status();
    adjust_ = std::move(*dev);
    adjust_host_ = std::move(*host);
    adjust_capacity_ = cap;
  }
  const size_t bytes = adjust.size() * sizeof(LogitAdjust);
  std::memcpy(adjust_host_.get(), adjust.data(), bytes);
  return backend_.copy_to_device(adjust_.get(), adjust_host_.get(), bytes);
}

int32_t ModelRunner::graph_batch_bucket(int32_t n) const {
  int32_t b = n;
  if (n <= 4) {
    b = 1;
    while (b < n) b *= 2;
  } else {
    const int32_t step = n <= 64 ? 8 : n <= 256 ? 32 : 64;
    b = int32_t(round_up(n, step));
  }
  const int64_t cap = std::min<int64_t>(limits_.max_seqs, limits_.max_tokens);
  return int32_t(std::max<int64_t>(n, std::min<int64_t>(b, cap)));
}

int32_t ModelRunner::graph_context_bucket(int32_t max_context_len, int32_t page_size) const {
  // Powers of two up to 4096 keys, then multiples of 4096: a padded context costs at
  // most an eighth more keys' worth of block table and split partitions beyond that.
  int64_t c = 512;
  while (c < max_context_len && c < 4096) c *= 2;
  if (c < max_context_len) c = (int64_t(max_context_len) + 4095) / 4096 * 4096;
  const int64_t cap = int64_t(limits_.max_pages_per_seq) * page_size;
  return int32_t(std::max<int64_t>(max_context_len, std::min(c, cap)));
}

void ModelRunner::pad_for_graph(const ForwardBatch& in, int32_t ps, ForwardBatch& out) const {
  const int32_t S = in.num_seqs();
  const int32_t Sb = graph_batch_bucket(S);
  const int32_t pages = int32_t(ceil_div(graph_context_bucket(in.max_context_len, ps), ps));
  out.token_ids = in.token_ids;
  out.positions = in.positions;
  out.slot_mapping = in.slot_mapping;
  out.token_ids.resize(size_t(Sb), 0);
  out.positions.resize(size_t(Sb), 0);
  out.slot_mapping.resize(size_t(Sb), -1);  // padding rows write no KV
  // Padding sequences own no query rows and no keys: attention skips them, and the rows
  // past query_start[S] belong to no sequence.
  out.query_start = in.query_start;
  out.query_start.resize(size_t(Sb) + 1, in.query_start.back());
  out.context_len = in.context_len;
  out.context_len.resize(size_t(Sb), 0);
  out.max_pages_per_seq = pages;
  out.max_query_len = 1;
  out.max_context_len = pages * ps;
  const auto restride = [&](const std::vector<int32_t>& src, std::vector<int32_t>& dst) {
    dst.assign(src.empty() ? 0 : size_t(Sb) * size_t(pages), -1);
    if (src.empty()) return;
    for (int32_t s = 0; s < S; ++s) {
      std::copy_n(src.begin() + int64_t(s) * in.max_pages_per_seq, in.max_pages_per_seq,
                  dst.begin() + int64_t(s) * pages);
    }
  };
  restride(in.block_table_full, out.block_table_full);
  restride(in.block_table_swa, out.block_table_swa);
  // Every row's token is computed (the graph does not depend on which rows sample);
  // the caller's rows are picked out afterwards.
  out.logits_rows.resize(size_t(Sb));
  for (int32_t r = 0; r < Sb; ++r) out.logits_rows[size_t(r)] = r;
  out.logits_host.assign(size_t(Sb), 0);
  out.sampling.assign(size_t(Sb), RowSampling{});
  for (size_t k = 0; k < in.logits_rows.size() && k < in.sampling.size(); ++k) {
    out.sampling[size_t(in.logits_rows[k])] = in.sampling[k];
  }
  // The processors' entries stay the caller's (launch uploads `in.adjust`): they keep
  // their order, logits rows ascending with the token rows, and a padding row has none.
  out.adjust_start.clear();
  out.adjust.clear();
  if (!in.adjust_start.empty()) {
    out.adjust_start.assign(size_t(Sb) + 1, 0);
    for (size_t k = 0; k < in.logits_rows.size(); ++k) {
      out.adjust_start[size_t(in.logits_rows[k]) + 1] = in.adjust_start[k + 1] - in.adjust_start[k];
    }
    for (int32_t r = 0; r < Sb; ++r) out.adjust_start[size_t(r) + 1] += out.adjust_start[size_t(r)];
  }
  out.logprobs.clear();
  if (!in.logprobs.empty()) {
    out.logprobs.assign(size_t(Sb), LogprobRow{});
    for (size_t k = 0; k < in.logits_rows.size() && k < in.logprobs.size(); ++k) {
      out.logprobs[size_t(in.logits_rows[k])] = in.logprobs[k];
    }
  }
  out.extra_rows.clear();
  out.extra_logprobs.clear();
}

absl::Status ModelRunner::run_model(const ForwardBatch& b, KvPool& pool, const ForwardOptions& opts) {
  const BatchMetaLayout& L = meta_layout_;
  DecoderPass p;
  p.token_ids = meta<int32_t>(L.token_ids);
  p.positions = meta<int32_t>(L.positions);
  p.slot_mapping = meta<int64_t>(L.slot_mapping);
  p.batch.num_seqs = b.num_seqs();
  p.batch.num_tokens = b.num_tokens();
  p.batch.query_start = meta<int32_t>(L.query_start);
  p.batch.context_len = meta<int32_t>(L.context_len);
  p.batch.max_pages_per_seq = b.max_pages_per_seq;
  p.batch.max_query_len = b.max_query_len;
  p.batch.max_context_len = b.max_context_len;
  p.block_table_full = meta<int32_t>(L.block_table_full);
  p.block_table_swa = reinterpret_cast<int32_t*>(meta_.as<char>() + swa_table_offset_);  // upload_batch's
  p.logits_rows = meta<int32_t>(L.logits_rows);
  p.num_logits_rows = int64_t(b.logits_rows.size());
  p.sampling = meta<RowSampling>(L.sampling);
  if (!b.adjust_start.empty()) {
    p.adjust_start = meta<int32_t>(L.adjust_start);
    p.adjust = adjust_.as<LogitAdjust>();
  }
  p.x = x_.as<bf16_t>();
  p.h = h_.as<bf16_t>();
  p.qkv = qkv_.as<bf16_t>();
  p.attn = attn_.as<bf16_t>();
  p.gate_up = gate_up_.as<bf16_t>();
  p.act = act_.as<bf16_t>();
  p.last = last_.as<bf16_t>();
  p.logits = logits_.as<float>();
  p.logits_shard = logits_shard_.as<float>();
  p.logits_gathered = logits_gathered_.as<float>();
  p.tokens = argmax_.as<int32_t>();
  p.logprobs = b.logprobs.empty() ? nullptr : meta<LogprobRow>(L.logprobs);
  p.extra_rows = meta<int32_t>(L.extra_rows);
  p.extra_logprobs = meta<LogprobRow>(L.extra_logprobs);
  p.num_extra_rows = int64_t(b.extra_rows.size());
  p.logits_capacity = limits_.max_seqs;
  p.logprob_out = lp_out_.as<LogprobOut>();
  return model_.forward(p, pool, opts.kv_write, opts.attention);
}

void ModelRunner::drop_stale_graphs() {
  if (backend_.graph_epoch() == graph_epoch_) return;
  // Scratch a graph points at was replaced by a larger eager step: recapture.
  graph_stats_.invalidated += int64_t(graphs_.size());
  graphs_.clear();
  graph_epoch_ = backend_.graph_epoch();
}

absl::Status ModelRunner::run_graph(const ForwardBatch& b, KvPool& pool, const ForwardOptions& opts) {
  drop_stale_graphs();
  const GraphKey key{b.num_seqs(),     b.max_pages_per_seq,   opts.kv_write,
                     opts.attention,   !b.logprobs.empty(),   !b.adjust_start.empty()};
  auto it = graphs_.find(key);
  if (it != graphs_.end()) {
    ++graph_stats_.replays;
    return it->second->replay();
  }
  // The bucket's first step runs eagerly: that is its result, and it grows every lazily
  // sized scratch buffer to this shape, so the capture below needs no allocation.
  KVFUSE_RETURN_IF_ERROR(run_model(b, pool, opts));
  drop_stale_graphs();
  KVFUSE_RETURN_IF_ERROR(backend_.begin_capture());
  const absl::Status recorded = run_model(b, pool, opts);
  auto graph = backend_.end_capture();  // always ends the capture, even after a failure
  if (!recorded.ok()) return recorded;
  if (!graph.ok()) return graph.status();
  graphs_.emplace(key, std::move(*graph));
  ++graph_stats_.captures;
  graph_stats_.num_graphs = int64_t(graphs_.size());
  return absl::OkStatus();
}

absl::Status ModelRunner::run(const ForwardBatch& in, KvPool& pool, const ForwardOptions& opts,
                              ForwardResult& out) {
  KVFUSE_RETURN_IF_ERROR(launch(in, pool, opts, out));
  return finish(in, out);
}

absl::Status ModelRunner::launch(const ForwardBatch& in, KvPool& pool, const ForwardOptions& opts,
                                 ForwardResult& out) {
  out.graph = false;
  const bool decode_only =
      in.max_query_len == 1 && in.num_tokens() == in.num_seqs() && in.extra_rows.empty();
  const bool replay = opts.graph_replay && backend_.supports_graphs();
  const bool pad = opts.graphs && decode_only && (replay || !opts.graph_replay);
  const ForwardBatch* b = &in;
  if (pad) {
    if (in.logits_rows.size() != in.logits_host.size() ||
        in.query_start.size() != size_t(in.num_seqs()) + 1) {
      return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
    }
    pad_for_graph(in, pool.config().page_size, padded_);
    b = &padded_;
  }
  KVFUSE_RETURN_IF_ERROR(upload_batch(*b, in.adjust));
  KVFUSE_RETURN_IF_ERROR(pool.sync_swa_table(model_.shard().local_rank));
  if (pad && replay) {
    KVFUSE_RETURN_IF_ERROR(run_graph(*b, pool, opts));
    out.graph = true;
  } else {
    KVFUSE_RETURN_IF_ERROR(run_model(*b, pool, opts));
    if (pad) ++graph_stats_.padded_eager;
  }
  launched_padded_ = pad;
  return absl::OkStatus();
}

absl::Status ModelRunner::finish(const ForwardBatch& in, ForwardResult& out) {
  KVFUSE_RETURN_IF_ERROR(read_back(in, launched_padded_ ? padded_ : in, launched_padded_, out));
  // read_back succeeds only after the stream is synchronised: the metadata copy is done.
  meta_in_flight_ = false;
  return absl::OkStatus();
}

absl::Status ModelRunner::read_back(const ForwardBatch& in, const ForwardBatch& ran, bool padded,
                                    ForwardResult& out) {
  // Every successful return below has synchronised the stream (synchronize, or
  // copy_to_host, which waits): run() relies on it to reuse the metadata staging buffer.
  if (model_.shard().rank != 0) {
    // Tokens, logits and logprobs are rank 0's; the others only report their own errors.
    const bool graph = out.graph;
    out = ForwardResult{};
    out.graph = graph;
    return backend_.synchronize();
  }
  // Every computed row's token and flag in one copy, then the logits rows the caller
  // wants. Padded passes computed row r for token row r; others, row k for k.
  const int64_t computed = int64_t(ran.logits_rows.size());
  const size_t n = in.logits_rows.size();
  out.tokens.resize(n);
  out.finite.resize(n);
  out.sampled.resize(n);
  out.logits.clear();
  out.logprobs.clear();
  out.extra_logprobs.clear();
  const size_t extra = in.extra_rows.size();
  if (!in.logprobs.empty() || extra > 0) {
    // Logits rows first, then the extra rows (DecoderPass::logprob_out).
    lp_host_.resize(size_t(computed) + extra);
    KVFUSE_RETURN_IF_ERROR(
        backend_.copy_to_host(lp_host_.data(), lp_out_.get(), lp_host_.size() * sizeof(LogprobOut)));
    if (!in.logprobs.empty()) {
      out.logprobs.resize(n);
      for (size_t k = 0; k < n; ++k) out.logprobs[k] = lp_host_[size_t(padded ? in.logits_rows[k] : int64_t(k))];
    }
    out.extra_logprobs.assign(lp_host_.begin() + computed, lp_host_.end());
  }
  if (n == 0) return backend_.synchronize();
  host_rows_.resize(size_t(3 * computed));
  const int32_t* dev = argmax_.as<int32_t>();
  KVFUSE_RETURN_IF_ERROR(backend_.copy_to_host(host_rows_.data(), dev, host_rows_.size() * sizeof(int32_t)));
  const size_t vocab = size_t(model_.spec().vocab);
  size_t wanted = 0;
  for (size_t k = 0; k < n; ++k) wanted += (k < in.logits_host.size() && in.logits_host[k]) ? 1 : 0;
  out.logits.resize(wanted * vocab);
  size_t w = 0;
  for (size_t k = 0; k < n; ++k) {
    const int64_t row = padded ? in.logits_rows[k] : int64_t(k);
    out.tokens[k] = host_rows_[size_t(row)];
    out.finite[k] = host_rows_[size_t(computed + row)];
    out.sampled[k] = host_rows_[size_t(2 * computed + row)];
    if (k < in.logits_host.size() && in.logits_host[k]) {
      KVFUSE_RETURN_IF_ERROR(backend_.copy_to_host(
          out.logits.data() + w * vocab, logits_.as<float>() + size_t(row) * vocab, vocab * sizeof(float)));
      ++w;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
