#include "src/runtime/model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/loading/rope.h"

namespace kvfuse {


Model::Model(Backend& backend, ModelSpec spec, ModelShard shard)
    : backend_(backend), spec_(std::move(spec)), shard_(shard) {
  const TensorParallelShard& t = shard_.shard;
  dims_.q_heads = t.num_q_heads;
  dims_.kv_heads = t.num_kv_heads;
  dims_.head_dim = spec_.head_dim;
  dims_.intermediate = t.intermediate;
  dims_.vocab = t.vocab;
}

absl::StatusOr<std::unique_ptr<Model>> Model::create(Backend& backend, const ModelSpec& spec,
                                                     HostWeightSource& weights,
                                                     const std::function<void(int32_t)>& after_layer) {
  auto m = create_shard(backend, spec, ModelShard{});
  if (!m.ok()) return m.status();
  {
    HostGlobalWeights g;
    KVFUSE_RETURN_IF_ERROR(weights.globals(g));
    KVFUSE_RETURN_IF_ERROR((*m)->load_globals(g));
  }
  HostLayerWeights h;  // one for every layer: a source may reuse its buffers
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    KVFUSE_RETURN_IF_ERROR(weights.layer(l, h));
    KVFUSE_RETURN_IF_ERROR((*m)->load_layer(l, h));
    if (after_layer) after_layer(l + 1);
  }
  return m;
}

absl::StatusOr<std::unique_ptr<Model>> Model::create_shard(Backend& backend, const ModelSpec& spec,
                                                           const ModelShard& shard) {
  ModelShard sh = shard;
  if (sh.shard.tp <= 1) {
    auto whole = tensor_parallel_shard(spec, 1);
    if (!whole.ok()) return whole.status();
    sh.shard = *whole;
    sh.rank = 0;
  } else {
    auto want = tensor_parallel_shard(spec, sh.shard.tp);
    if (!want.ok()) return want.status();
    if (sh.rank < 0 || sh.rank >= sh.shard.tp || sh.comm == nullptr || sh.comm->size() != sh.shard.tp ||
        sh.comm->rank() != sh.rank) {
      return absl::InvalidArgumentError(absl::StrCat("model shard: rank ", sh.rank, " of tensor_parallel ",
                                                     sh.shard.tp, " needs a communicator of that rank and size"));
    }
    sh.shard = *want;
  }
  std::unique_ptr<Model> m(new Model(backend, spec, sh));
  m->layers_.resize(size_t(spec.num_layers));
  KVFUSE_RETURN_IF_ERROR(m->init_rope());
  return m;
}

absl::Status Model::init_rope() {
  // RoPE's frequency table, scaled as the config says, uploaded once.
  auto rope = rope_table(spec_);
  if (!rope.ok()) return rope.status();
  const size_t bytes = rope->inv_freq.size() * sizeof(float);
  auto b = backend_.alloc(bytes);
  if (!b.ok()) return b.status();
  rope_inv_freq_ = std::move(*b);
  KVFUSE_RETURN_IF_ERROR(backend_.copy_to_device(rope_inv_freq_.get(), rope->inv_freq.data(), bytes));
  rope_attention_scaling_ = rope->attention_scaling;
  return absl::OkStatus();
}

absl::Status Model::logits_rows(const DecoderPass& p, int64_t rows, float* logits) {
  const TensorParallelShard& t = shard_.shard;
  if (t.tp == 1) return backend_.linear_logits(p.last, rows, lm_head_, logits);
  // Vocab-parallel lm_head: each rank's [rows, vocab / tp] slice, gathered rank-major, then
  // laid out as [rows, vocab] with the padding columns dropped.
  const int64_t v = t.vocab;
  KVFUSE_RETURN_IF_ERROR(backend_.linear_logits(p.last, rows, lm_head_, p.logits_shard));
  KVFUSE_RETURN_IF_ERROR(shard_.comm->all_gather(p.logits_shard, p.logits_gathered, rows * v, DType::f32));
  if (shard_.rank != 0) return absl::OkStatus();
  for (int32_t q = 0; q < t.tp; ++q) {
    const int64_t first = t.vocab_begin(q);
    const int64_t width = std::min<int64_t>(v, int64_t(spec_.vocab) - first);
    if (width <= 0) continue;
    KVFUSE_RETURN_IF_ERROR(backend_.copy_2d(logits + first, spec_.vocab * sizeof(float),
                                            p.logits_gathered + q * rows * v, v * sizeof(float),
                                            width * sizeof(float), rows));
  }
  return absl::OkStatus();
}

absl::Status Model::forward(const DecoderPass& p, KvPool& pool, KvWritePath write, AttentionPath attention) {
  const ModelSpec& s = spec_;
  const RankDims& d = dims_;
  if (!globals_loaded_ || layers_loaded_ < s.num_layers) {
    return absl::FailedPreconditionError("model: forward before every weight was loaded");
  }
  const int64_t T = p.batch.num_tokens;
  const int64_t qkv_dim = d.qkv_dim();
  const int32_t store = shard_.local_rank;  // this rank's KV storage in the pool
  Communicator* comm = shard_.shard.tp > 1 ? shard_.comm : nullptr;
  // Where the communicator offers it (peer memory between GPUs), each row-parallel
  // projection that a norm follows pushes its partial sums into the peers, and the norm sums
  // them (Communicator::push_fits): no all-reduce of its own. Pushed calls are numbered in
  // forward order, the same on every rank. The last layer's down projection, which the
  // final residual add follows instead, is all-reduced.
  const bool push = comm != nullptr && comm->push_fits(T, s.hidden);
  int pushed = 0;
  bf16_t* x = p.x;
  bf16_t* h = p.h;
  bf16_t* q = p.qkv;
  bf16_t* k = p.qkv + d.q_dim();
  bf16_t* v = p.qkv + d.q_dim() + d.kv_dim();

  KVFUSE_RETURN_IF_ERROR(backend_.embedding(p.token_ids, T, embed_.as<bf16_t>(), s.hidden, x));
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const Layer& L = layers_[size_t(l)];
    const bool swa = pool.layer_is_swa(l);
    // The previous layer's MLP output (in h) joins the residual stream in the norm's kernel,
    // which may also quantize its output for an FP8 W8A8 qkv (Backend::norm_to_fp8).
    absl::StatusOr<Fp8Acts> acts = Fp8Acts{};  // the QKV input's codes, where the norm made them
    if (push && l > 0) {
      KVFUSE_RETURN_IF_ERROR(
          comm->push_add_rmsnorm(pushed++, h, x, L.attn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h));
    } else {
      acts = backend_.norm_to_fp8(x, l == 0 ? nullptr : h, L.attn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h, L.qkv);
      KVFUSE_RETURN_IF_ERROR(acts.status());
    }
    KVFUSE_RETURN_IF_ERROR(backend_.linear_from_fp8(h, *acts, T, L.qkv, p.qkv));

    // K and V are strided views into the fused QKV rows: the write reads them in place.
    KvWriteArgs w;
    w.k = k;
    w.v = v;
    w.k_token_stride = qkv_dim;
    w.v_token_stride = qkv_dim;
    w.num_tokens = T;
    w.slot_mapping = p.slot_mapping;
    w.swa = swa ? pool.swa_table(store) : SwaSlotTable{};
    w.cache = pool.layer_view(l, store);
    AttnArgs a;
    a.q = q;
    a.q_token_stride = qkv_dim;
    a.out = p.attn;
    a.out_token_stride = d.q_dim();
    a.num_q_heads = d.q_heads;
    a.softmax_scale = 1.0f / std::sqrt(float(s.head_dim));
    a.window = swa ? s.sliding_window : 0;
    a.batch = p.batch;
    a.batch.block_table = swa ? p.block_table_swa : p.block_table_full;
    a.cache = w.cache;
    if (select::rope_in_write(write)) {
      // RoPE inside the write's kernel: q rotated, K rotated on its way into the cache
      // (attention reads K from there, so the QKV rows' K is left unrotated). The backend
      // may take the write into the attention kernel (the GPU's, at decode-only steps).
      KvWriteRopeArgs r;
      r.kv = w;
      r.q = q;
      r.q_token_stride = qkv_dim;
      r.q_heads = d.q_heads;
      r.positions = p.positions;
      r.inv_freq = rope_inv_freq_.as<float>();
      r.attention_scaling = rope_attention_scaling_;
      KVFUSE_RETURN_IF_ERROR(backend_.attention_rope(a, r, attention));
    } else {
      KVFUSE_RETURN_IF_ERROR(backend_.rope(q, qkv_dim, d.q_heads, k, qkv_dim, d.kv_heads, s.head_dim,
                                           p.positions, T, rope_inv_freq_.as<float>(),
                                           rope_attention_scaling_));
      KVFUSE_RETURN_IF_ERROR(backend_.kv_write(w, write));
      KVFUSE_RETURN_IF_ERROR(backend_.attention(a, attention));
    }

    // Row-parallel O and down: each rank's partial sums, all-reduced (or pushed into the norm after them).
    acts = Fp8Acts{};  // the gate/up input's codes, where the norm makes them
    if (push) {
      KVFUSE_RETURN_IF_ERROR(backend_.linear_push(p.attn, T, L.o, h, comm->push_targets(pushed)));
      KVFUSE_RETURN_IF_ERROR(
          comm->push_add_rmsnorm(pushed++, h, x, L.ffn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h));
    } else {
      KVFUSE_RETURN_IF_ERROR(backend_.linear(p.attn, T, L.o, h));
      if (comm) KVFUSE_RETURN_IF_ERROR(comm->all_reduce_sum(h, T * s.hidden, DType::bf16));
      acts = backend_.norm_to_fp8(x, h, L.ffn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h, L.gate_up);
      KVFUSE_RETURN_IF_ERROR(acts.status());
    }
    KVFUSE_RETURN_IF_ERROR(
        backend_.linear_silu_mul_from_fp8(h, *acts, T, L.gate_up, d.intermediate, p.gate_up, p.act));
    if (push && l + 1 < s.num_layers) {
      // The next layer's norm sums it (above).
      KVFUSE_RETURN_IF_ERROR(backend_.linear_push(p.act, T, L.down, h, comm->push_targets(pushed)));
    } else {
      KVFUSE_RETURN_IF_ERROR(backend_.linear(p.act, T, L.down, h));
      if (comm) KVFUSE_RETURN_IF_ERROR(comm->all_reduce_sum(h, T * s.hidden, DType::bf16));
    }
  }
  KVFUSE_RETURN_IF_ERROR(backend_.residual_add(x, h, T * s.hidden));  // the last layer's MLP output

  // Tokens and logprobs are picked on rank 0 only; the other ranks take part in the gathers.
  const bool picks = shard_.rank == 0;
  const int64_t n = p.num_logits_rows;
  for (int64_t e = 0; e < p.num_extra_rows; e += p.logits_capacity) {
    const int64_t c = std::min(p.logits_capacity, p.num_extra_rows - e);
    KVFUSE_RETURN_IF_ERROR(backend_.gather_rows(x, s.hidden, p.extra_rows + e, c, p.last));
    KVFUSE_RETURN_IF_ERROR(backend_.rmsnorm(p.last, final_norm_.as<bf16_t>(), c, s.hidden, s.rms_eps, p.last));
    KVFUSE_RETURN_IF_ERROR(logits_rows(p, c, p.logits));
    if (!picks) continue;
    KVFUSE_RETURN_IF_ERROR(backend_.logprobs_rows(p.logits, c, s.vocab, p.extra_logprobs + e, nullptr, nullptr,
                                                  nullptr, p.logprob_out + n + e));
  }
  if (n == 0) return absl::OkStatus();
  KVFUSE_RETURN_IF_ERROR(backend_.gather_rows(x, s.hidden, p.logits_rows, n, p.last));
  KVFUSE_RETURN_IF_ERROR(backend_.rmsnorm(p.last, final_norm_.as<bf16_t>(), n, s.hidden, s.rms_eps, p.last));
  KVFUSE_RETURN_IF_ERROR(logits_rows(p, n, p.logits));
  if (!picks) return absl::OkStatus();
  // Greedy tokens, then the finiteness flags, then the sampled tokens, from the logits
  // as the processors leave them; then the raw logits back, for logprobs and readers.
  if (p.adjust != nullptr) {
    KVFUSE_RETURN_IF_ERROR(backend_.adjust_rows(p.logits, n, s.vocab, p.adjust_start, p.adjust, false));
  }
  KVFUSE_RETURN_IF_ERROR(backend_.argmax_rows(p.logits, n, s.vocab, p.tokens, p.tokens + n));
  KVFUSE_RETURN_IF_ERROR(backend_.sample_rows(p.logits, n, s.vocab, p.sampling, p.tokens + 2 * n));
  if (p.adjust != nullptr) {
    KVFUSE_RETURN_IF_ERROR(backend_.adjust_rows(p.logits, n, s.vocab, p.adjust_start, p.adjust, true));
  }
  if (p.logprobs == nullptr) return absl::OkStatus();
  return backend_.logprobs_rows(p.logits, n, s.vocab, p.logprobs, p.tokens, p.tokens + 2 * n, p.sampling,
                                p.logprob_out);
}

}  // namespace kvfuse
