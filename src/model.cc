#include "src/model.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "src/checkpoint.h"

namespace kvfuse {

#define KVFUSE_RETURN_IF_ERROR(expr) \
  do {                               \
    const absl::Status _st = (expr); \
    if (!_st.ok()) return _st;       \
  } while (0)

namespace {

int32_t ceil_div(int64_t a, int64_t b) { return int32_t((a + b - 1) / b); }

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Tensor ids for the synthetic generator.
enum : uint64_t { kEmbed = 1, kFinalNorm, kLmHead, kLayerBase = 16 };
enum : uint64_t { kAttnNorm, kFfnNorm, kQkv, kQkvBias, kO, kGateUp, kDown, kTensorsPerLayer = 16 };

std::vector<bf16_t> synth(uint64_t seed, uint64_t tensor, int64_t count, float stddev, float mean = 0.0f) {
  std::vector<bf16_t> out(static_cast<size_t>(count));
  // Counter-based values: any split of the index range gives the same tensor, so large
  // presets (8B parameters) fill on every core.
  auto fill = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[size_t(i)] = f32_to_bf16(mean + stddev * synthetic_weight(seed, tensor, uint64_t(i)));
    }
  };
  const int64_t threads = count < (int64_t(1) << 20) ? 1 : std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(fill, count * t / threads, count * (t + 1) / threads);
  fill(0, count / threads);
  for (auto& th : pool) th.join();
  return out;
}

}  // namespace

float synthetic_weight(uint64_t seed, uint64_t tensor, uint64_t i) {
  // Uniform on [-sqrt(3), sqrt(3)): zero mean, unit variance.
  const uint64_t r = splitmix64(splitmix64(seed ^ (tensor << 40)) ^ i);
  const double u = double(r >> 11) * 0x1.0p-53;
  return float((2.0 * u - 1.0) * 1.7320508075688772);
}

namespace {

// The synthetic weights. Their scales keep activations near unit RMS through the
// residual stream, and make the logits peaked enough (std ~3) that greedy decoding is
// well defined.
class SyntheticWeights final : public HostWeightSource {
 public:
  SyntheticWeights(const ModelSpec& spec, uint64_t seed) : s_(spec), seed_(seed) {}

  absl::Status globals(HostGlobalWeights& g) override {
    const float in_std = 1.0f / std::sqrt(float(s_.hidden));
    g.embed = synth(seed_, kEmbed, int64_t(s_.vocab) * s_.hidden, 1.0f);
    g.final_norm = synth(seed_, kFinalNorm, s_.hidden, 0.05f, 1.0f);
    g.lm_head = HostLinear{};
    if (!s_.tie_embeddings) g.lm_head.w = synth(seed_, kLmHead, int64_t(s_.vocab) * s_.hidden, 3.0f * in_std);
    return absl::OkStatus();
  }

  absl::Status layer(int32_t l, HostLayerWeights& L) override {
    const float in_std = 1.0f / std::sqrt(float(s_.hidden));
    const uint64_t base = kLayerBase + uint64_t(l) * kTensorsPerLayer;
    L.attn_norm = synth(seed_, base + kAttnNorm, s_.hidden, 0.05f, 1.0f);
    L.ffn_norm = synth(seed_, base + kFfnNorm, s_.hidden, 0.05f, 1.0f);
    L.qkv.w = synth(seed_, base + kQkv, s_.qkv_dim() * s_.hidden, in_std);
    L.qkv.bias = s_.qkv_bias ? synth(seed_, base + kQkvBias, s_.qkv_dim(), 0.1f) : std::vector<bf16_t>{};
    L.o.w = synth(seed_, base + kO, int64_t(s_.hidden) * s_.q_dim(), 0.5f / std::sqrt(float(s_.q_dim())));
    L.gate_up.w = synth(seed_, base + kGateUp, 2 * int64_t(s_.intermediate) * s_.hidden, in_std);
    L.down.w = synth(seed_, base + kDown, int64_t(s_.hidden) * s_.intermediate,
                     0.5f / std::sqrt(float(s_.intermediate)));
    return absl::OkStatus();
  }

 private:
  ModelSpec s_;
  uint64_t seed_;
};

absl::Status check_size(const std::vector<bf16_t>& v, int64_t want, const std::string& what) {
  if (int64_t(v.size()) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("model weights: ", what, " has ", v.size(), " values, expected ", want));
}

}  // namespace

std::unique_ptr<HostWeightSource> make_synthetic_weights(const ModelSpec& spec, uint64_t seed) {
  return std::make_unique<SyntheticWeights>(spec, seed);
}

absl::StatusOr<std::unique_ptr<Model>> Model::create_synthetic(Backend& backend, const ModelSpec& spec,
                                                               uint64_t seed, const ModelLimits& limits) {
  SyntheticWeights weights(spec, seed);
  return create_from_weights(backend, spec, weights, limits);
}

absl::StatusOr<std::unique_ptr<Model>> Model::create_from_weights(Backend& backend, const ModelSpec& spec,
                                                                  HostWeightSource& weights,
                                                                  const ModelLimits& limits) {
  if (limits.max_tokens <= 0 || limits.max_seqs <= 0 || limits.max_pages_per_seq <= 0) {
    return absl::InvalidArgumentError("model limits must be positive");
  }
  std::unique_ptr<Model> m(new Model(backend, spec, limits));
  KVFUSE_RETURN_IF_ERROR(m->init_weights(weights));
  KVFUSE_RETURN_IF_ERROR(m->init_workspace());
  return m;
}

absl::StatusOr<std::unique_ptr<Model>> Model::create_from_checkpoint(Backend& backend, const ModelSpec& spec,
                                                                     const Checkpoint& checkpoint,
                                                                     const ModelLimits& limits) {
  const ModelSpec& c = checkpoint.spec();
  if (spec.vocab != c.vocab || spec.hidden != c.hidden || spec.intermediate != c.intermediate ||
      spec.num_layers != c.num_layers || spec.num_q_heads != c.num_q_heads ||
      spec.num_kv_heads != c.num_kv_heads || spec.head_dim != c.head_dim || spec.qkv_bias != c.qkv_bias ||
      spec.tie_embeddings != c.tie_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model spec '", spec.name, "' does not have the shapes of checkpoint ", checkpoint.dir()));
  }
  auto weights = checkpoint.weights();
  return create_from_weights(backend, spec, *weights, limits);
}

absl::Status Model::init_weights(HostWeightSource& weights) {
  const ModelSpec& s = spec_;
  auto upload_vec = [&](const std::vector<bf16_t>& v, DeviceBuffer& dst) -> absl::Status {
    auto b = backend_.alloc(v.size() * sizeof(bf16_t));
    if (!b.ok()) return b.status();
    dst = std::move(*b);
    return backend_.copy_to_device(dst.get(), v.data(), v.size() * sizeof(bf16_t));
  };
  auto upload_linear = [&](const HostLinear& h, int64_t n, int64_t k, bool bias, const std::string& what,
                           LinearWeight& dst) -> absl::Status {
    KVFUSE_RETURN_IF_ERROR(check_size(h.w, n * k, what));
    KVFUSE_RETURN_IF_ERROR(check_size(h.bias, bias ? n : 0, what + " bias"));
    auto lw = backend_.upload_linear(h.w.data(), n, k, bias ? h.bias.data() : nullptr);
    if (!lw.ok()) return lw.status();
    dst = std::move(*lw);
    return absl::OkStatus();
  };

  {
    HostGlobalWeights g;
    KVFUSE_RETURN_IF_ERROR(weights.globals(g));
    KVFUSE_RETURN_IF_ERROR(check_size(g.embed, int64_t(s.vocab) * s.hidden, "embedding"));
    KVFUSE_RETURN_IF_ERROR(check_size(g.final_norm, s.hidden, "final norm"));
    KVFUSE_RETURN_IF_ERROR(upload_vec(g.embed, embed_));
    KVFUSE_RETURN_IF_ERROR(upload_vec(g.final_norm, final_norm_));
    if (s.tie_embeddings) g.lm_head.w = std::move(g.embed);
    KVFUSE_RETURN_IF_ERROR(upload_linear(g.lm_head, s.vocab, s.hidden, false, "lm_head", lm_head_));
  }
  layers_.resize(size_t(s.num_layers));
  for (int32_t l = 0; l < s.num_layers; ++l) {
    Layer& L = layers_[size_t(l)];
    HostLayerWeights h;
    KVFUSE_RETURN_IF_ERROR(weights.layer(l, h));
    const std::string at = absl::StrCat("layer ", l, " ");
    KVFUSE_RETURN_IF_ERROR(check_size(h.attn_norm, s.hidden, at + "attention norm"));
    KVFUSE_RETURN_IF_ERROR(check_size(h.ffn_norm, s.hidden, at + "ffn norm"));
    KVFUSE_RETURN_IF_ERROR(upload_vec(h.attn_norm, L.attn_norm));
    KVFUSE_RETURN_IF_ERROR(upload_vec(h.ffn_norm, L.ffn_norm));
    KVFUSE_RETURN_IF_ERROR(upload_linear(h.qkv, s.qkv_dim(), s.hidden, s.qkv_bias, at + "qkv", L.qkv));
    KVFUSE_RETURN_IF_ERROR(upload_linear(h.o, s.hidden, s.q_dim(), false, at + "o", L.o));
    KVFUSE_RETURN_IF_ERROR(
        upload_linear(h.gate_up, 2 * int64_t(s.intermediate), s.hidden, false, at + "gate_up", L.gate_up));
    KVFUSE_RETURN_IF_ERROR(upload_linear(h.down, s.hidden, s.intermediate, false, at + "down", L.down));
  }
  return absl::OkStatus();
}

absl::Status Model::init_workspace() {
  const ModelSpec& s = spec_;
  const int64_t T = limits_.max_tokens;
  const int64_t S = limits_.max_seqs;
  const int64_t P = limits_.max_pages_per_seq;
  struct Want {
    DeviceBuffer* buf;
    size_t bytes;
  };
  const Want wants[] = {
      {&x_, size_t(T * s.hidden) * 2},
      {&h_, size_t(T * s.hidden) * 2},
      {&qkv_, size_t(T * s.qkv_dim()) * 2},
      {&attn_, size_t(T * s.q_dim()) * 2},
      {&gate_up_, size_t(T * 2 * s.intermediate) * 2},
      {&act_, size_t(T * s.intermediate) * 2},
      {&last_, size_t(S * s.hidden) * 2},
      {&logits_, size_t(S * s.vocab) * 4},
      {&kv_scratch_, backend_.kv_write_scratch_bytes(T, s.kv_dim())},
      {&ids_, size_t(T) * 4},
      {&pos_, size_t(T) * 4},
      {&slots_, size_t(T) * 8},
      {&qstart_, size_t(S + 1) * 4},
      {&ctx_, size_t(S) * 4},
      {&bt_full_, size_t(S * P) * 4},
      {&bt_swa_, size_t(S * P) * 4},
      {&rows_, size_t(S) * 4},
      {&argmax_, size_t(3 * S) * 4},
      {&sampling_, size_t(S) * sizeof(RowSampling)},
  };
  for (const Want& w : wants) {
    auto b = backend_.alloc(w.bytes);
    if (!b.ok()) return b.status();
    *w.buf = std::move(*b);
  }
  return absl::OkStatus();
}

absl::Status Model::upload_batch(const ForwardBatch& b) {
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
  if (b.positions.size() != size_t(T) || b.slot_mapping.size() != size_t(T) ||
      b.query_start.size() != size_t(S) + 1 ||
      b.block_table_full.size() != size_t(S) * size_t(b.max_pages_per_seq)) {
    return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
  }
  for (int32_t id : b.token_ids) {
    if (id < 0 || id >= spec_.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("forward: token id ", id, " outside the vocabulary [0, ", spec_.vocab, ")"));
    }
  }
  auto up = [&](DeviceBuffer& dst, const auto& v) {
    return backend_.copy_to_device(dst.get(), v.data(), v.size() * sizeof(v[0]));
  };
  KVFUSE_RETURN_IF_ERROR(up(ids_, b.token_ids));
  KVFUSE_RETURN_IF_ERROR(up(pos_, b.positions));
  KVFUSE_RETURN_IF_ERROR(up(slots_, b.slot_mapping));
  KVFUSE_RETURN_IF_ERROR(up(qstart_, b.query_start));
  KVFUSE_RETURN_IF_ERROR(up(ctx_, b.context_len));
  KVFUSE_RETURN_IF_ERROR(up(bt_full_, b.block_table_full));
  if (!b.block_table_swa.empty()) KVFUSE_RETURN_IF_ERROR(up(bt_swa_, b.block_table_swa));
  KVFUSE_RETURN_IF_ERROR(up(rows_, b.logits_rows));
  if (!b.sampling.empty() && b.sampling.size() != b.logits_rows.size()) {
    return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
  }
  if (b.sampling.empty()) {
    // Every row greedy.
    sampling_host_.assign(b.logits_rows.size(), RowSampling{});
    KVFUSE_RETURN_IF_ERROR(up(sampling_, sampling_host_));
  } else {
    KVFUSE_RETURN_IF_ERROR(up(sampling_, b.sampling));
  }
  return absl::OkStatus();
}

int32_t Model::graph_batch_bucket(int32_t n) const {
  int32_t b = n;
  if (n <= 4) {
    b = 1;
    while (b < n) b *= 2;
  } else {
    const int32_t step = n <= 64 ? 8 : n <= 256 ? 32 : 64;
    b = (n + step - 1) / step * step;
  }
  const int64_t cap = std::min<int64_t>(limits_.max_seqs, limits_.max_tokens);
  return int32_t(std::max<int64_t>(n, std::min<int64_t>(b, cap)));
}

int32_t Model::graph_context_bucket(int32_t max_context_len, int32_t page_size) const {
  // Powers of two up to 4096 keys, then multiples of 4096: a padded context costs at
  // most an eighth more keys' worth of block table and split partitions beyond that.
  int64_t c = 512;
  while (c < max_context_len && c < 4096) c *= 2;
  if (c < max_context_len) c = (int64_t(max_context_len) + 4095) / 4096 * 4096;
  const int64_t cap = int64_t(limits_.max_pages_per_seq) * page_size;
  return int32_t(std::max<int64_t>(max_context_len, std::min(c, cap)));
}

void Model::pad_for_graph(const ForwardBatch& in, int32_t ps, ForwardBatch& out) const {
  const int32_t S = in.num_seqs();
  const int32_t Sb = graph_batch_bucket(S);
  const int32_t pages = ceil_div(graph_context_bucket(in.max_context_len, ps), ps);
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
}

absl::Status Model::run_body(const ForwardBatch& b, KvPool& pool, const ForwardOptions& opts) {
  const ModelSpec& s = spec_;
  const int64_t T = b.num_tokens();
  const int64_t qkv_dim = s.qkv_dim();
  bf16_t* x = x_.as<bf16_t>();
  bf16_t* h = h_.as<bf16_t>();
  bf16_t* qkv = qkv_.as<bf16_t>();
  bf16_t* q = qkv;
  bf16_t* k = qkv + s.q_dim();
  bf16_t* v = qkv + s.q_dim() + s.kv_dim();

  AttnBatch ab;
  ab.num_seqs = b.num_seqs();
  ab.num_tokens = T;
  ab.query_start = qstart_.as<int32_t>();
  ab.context_len = ctx_.as<int32_t>();
  ab.max_pages_per_seq = b.max_pages_per_seq;
  ab.max_query_len = b.max_query_len;
  ab.max_context_len = b.max_context_len;

  KVFUSE_RETURN_IF_ERROR(backend_.embedding(ids_.as<int32_t>(), T, embed_.as<bf16_t>(), s.hidden, x));
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const Layer& L = layers_[size_t(l)];
    const bool swa = pool.layer_is_swa(l);
    KVFUSE_RETURN_IF_ERROR(backend_.rmsnorm(x, L.attn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h));
    KVFUSE_RETURN_IF_ERROR(backend_.linear(h, T, L.qkv, qkv));
    KVFUSE_RETURN_IF_ERROR(backend_.rope(q, qkv_dim, s.num_q_heads, k, qkv_dim, s.num_kv_heads, s.head_dim,
                                         pos_.as<int32_t>(), T, s.rope_theta));

    // K and V are strided views into the fused QKV rows: the write reads them in place.
    KvWriteArgs w;
    w.k = k;
    w.v = v;
    w.k_token_stride = qkv_dim;
    w.v_token_stride = qkv_dim;
    w.num_tokens = T;
    w.slot_mapping = slots_.as<int64_t>();
    w.swa = swa ? pool.swa_table() : SwaSlotTable{};
    w.cache = pool.layer_view(l);
    KVFUSE_RETURN_IF_ERROR(backend_.kv_write(w, opts.kv_write, kv_scratch_.get()));

    AttnArgs a;
    a.q = q;
    a.q_token_stride = qkv_dim;
    a.out = attn_.as<bf16_t>();
    a.out_token_stride = s.q_dim();
    a.num_q_heads = s.num_q_heads;
    a.softmax_scale = 1.0f / std::sqrt(float(s.head_dim));
    a.window = swa ? s.sliding_window : 0;
    a.batch = ab;
    a.batch.block_table = swa ? bt_swa_.as<int32_t>() : bt_full_.as<int32_t>();
    a.cache = w.cache;
    KVFUSE_RETURN_IF_ERROR(backend_.attention(a, opts.attention));

    KVFUSE_RETURN_IF_ERROR(backend_.linear(attn_.as<bf16_t>(), T, L.o, h));
    KVFUSE_RETURN_IF_ERROR(backend_.residual_add(x, h, T * s.hidden));
    KVFUSE_RETURN_IF_ERROR(backend_.rmsnorm(x, L.ffn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h));
    KVFUSE_RETURN_IF_ERROR(backend_.linear(h, T, L.gate_up, gate_up_.as<bf16_t>()));
    KVFUSE_RETURN_IF_ERROR(backend_.silu_mul(gate_up_.as<bf16_t>(), T, s.intermediate, act_.as<bf16_t>()));
    KVFUSE_RETURN_IF_ERROR(backend_.linear(act_.as<bf16_t>(), T, L.down, h));
    KVFUSE_RETURN_IF_ERROR(backend_.residual_add(x, h, T * s.hidden));
  }

  const int64_t n = int64_t(b.logits_rows.size());
  if (n == 0) return absl::OkStatus();
  bf16_t* last = last_.as<bf16_t>();
  KVFUSE_RETURN_IF_ERROR(backend_.gather_rows(x, s.hidden, rows_.as<int32_t>(), n, last));
  KVFUSE_RETURN_IF_ERROR(backend_.rmsnorm(last, final_norm_.as<bf16_t>(), n, s.hidden, s.rms_eps, last));
  KVFUSE_RETURN_IF_ERROR(backend_.linear_logits(last, n, lm_head_, logits_.as<float>()));
  int32_t* tokens = argmax_.as<int32_t>();
  // Greedy tokens, then the finiteness flags, then the sampled tokens.
  KVFUSE_RETURN_IF_ERROR(backend_.argmax_rows(logits_.as<float>(), n, s.vocab, tokens, tokens + n));
  return backend_.sample_rows(logits_.as<float>(), n, s.vocab, sampling_.as<RowSampling>(), tokens + 2 * n);
}

absl::Status Model::run_graph(const ForwardBatch& b, KvPool& pool, const ForwardOptions& opts) {
  if (backend_.graph_epoch() != graph_epoch_) {
    // Scratch a graph points at was replaced by a larger eager step: recapture.
    graph_stats_.invalidated += int64_t(graphs_.size());
    graphs_.clear();
    graph_epoch_ = backend_.graph_epoch();
  }
  const GraphKey key{b.num_seqs(), b.max_pages_per_seq, opts.kv_write, opts.attention};
  auto it = graphs_.find(key);
  if (it != graphs_.end()) {
    ++graph_stats_.replays;
    return it->second->replay();
  }
  // The bucket's first step runs eagerly: that is its result, and it grows every lazily
  // sized scratch buffer to this shape, so the capture below needs no allocation.
  KVFUSE_RETURN_IF_ERROR(run_body(b, pool, opts));
  if (backend_.graph_epoch() != graph_epoch_) {
    graph_stats_.invalidated += int64_t(graphs_.size());
    graphs_.clear();
    graph_epoch_ = backend_.graph_epoch();
  }
  KVFUSE_RETURN_IF_ERROR(backend_.begin_capture());
  const absl::Status recorded = run_body(b, pool, opts);
  auto graph = backend_.end_capture();  // always ends the capture, even after a failure
  if (!recorded.ok()) return recorded;
  if (!graph.ok()) return graph.status();
  graphs_.emplace(key, std::move(*graph));
  ++graph_stats_.captures;
  graph_stats_.num_graphs = int64_t(graphs_.size());
  return absl::OkStatus();
}

absl::Status Model::forward(const ForwardBatch& in, KvPool& pool, const ForwardOptions& opts,
                            ForwardResult& out) {
  const ModelSpec& s = spec_;
  out.graph = false;
  const bool decode_only = in.max_query_len == 1 && in.num_tokens() == in.num_seqs();
  const bool replay = opts.graph_replay && backend_.supports_graphs();
  const bool pad = opts.graphs && decode_only && (replay || !opts.graph_replay);
  const ForwardBatch* b = &in;
  if (pad) {
    if (in.logits_rows.size() != in.logits_host.size() || in.query_start.size() != size_t(in.num_seqs()) + 1) {
      return absl::InvalidArgumentError("forward: inconsistent batch metadata sizes");
    }
    pad_for_graph(in, pool.config().page_size, padded_);
    b = &padded_;
  }
  KVFUSE_RETURN_IF_ERROR(upload_batch(*b));
  KVFUSE_RETURN_IF_ERROR(pool.sync_swa_table());
  if (pad && replay) {
    KVFUSE_RETURN_IF_ERROR(run_graph(*b, pool, opts));
    out.graph = true;
  } else {
    KVFUSE_RETURN_IF_ERROR(run_body(*b, pool, opts));
    if (pad) ++graph_stats_.padded_eager;
  }

  // Results: every computed row's token and flag in one copy, then the logits rows the
  // caller wants. Padded passes computed row r for token row r; others, row k for k.
  const int64_t computed = int64_t(b->logits_rows.size());
  const size_t n = in.logits_rows.size();
  out.tokens.resize(n);
  out.finite.resize(n);
  out.sampled.resize(n);
  out.logits.clear();
  if (n == 0) return backend_.synchronize();
  host_rows_.resize(size_t(3 * computed));
  const int32_t* dev = argmax_.as<int32_t>();
  KVFUSE_RETURN_IF_ERROR(backend_.copy_to_host(host_rows_.data(), dev, host_rows_.size() * sizeof(int32_t)));
  const size_t vocab = size_t(s.vocab);
  size_t wanted = 0;
  for (size_t k = 0; k < n; ++k) wanted += (k < in.logits_host.size() && in.logits_host[k]) ? 1 : 0;
  out.logits.resize(wanted * vocab);
  size_t w = 0;
  for (size_t k = 0; k < n; ++k) {
    const int64_t row = pad ? in.logits_rows[k] : int64_t(k);
    out.tokens[k] = host_rows_[size_t(row)];
    out.finite[k] = host_rows_[size_t(computed + row)];
    out.sampled[k] = host_rows_[size_t(2 * computed + row)];
    if (k < in.logits_host.size() && in.logits_host[k]) {
      KVFUSE_RETURN_IF_ERROR(backend_.copy_to_host(out.logits.data() + w * vocab,
                                                   logits_.as<float>() + size_t(row) * vocab,
                                                   vocab * sizeof(float)));
      ++w;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvfuse
