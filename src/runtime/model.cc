#include "src/runtime/model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/loading/rope.h"

namespace kvfuse {

namespace {

absl::Status check_size(const std::vector<bf16_t>& v, int64_t want, const std::string& what) {
  if (int64_t(v.size()) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("model weights: ", what, " has ", v.size(), " values, expected ", want));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> Model::create(Backend& backend, const ModelSpec& spec,
                                                     HostWeightSource& weights) {
  std::unique_ptr<Model> m(new Model(backend, spec));
  KVFUSE_RETURN_IF_ERROR(m->init_weights(weights));
  return m;
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
    // RoPE's frequency table, scaled as the config says, uploaded once.
    auto rope = rope_table(s);
    if (!rope.ok()) return rope.status();
    const size_t bytes = rope->inv_freq.size() * sizeof(float);
    auto b = backend_.alloc(bytes);
    if (!b.ok()) return b.status();
    rope_inv_freq_ = std::move(*b);
    KVFUSE_RETURN_IF_ERROR(backend_.copy_to_device(rope_inv_freq_.get(), rope->inv_freq.data(), bytes));
    rope_attention_scaling_ = rope->attention_scaling;
  }
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

absl::Status Model::forward(const DecoderPass& p, KvPool& pool, KvWritePath write, AttentionPath attention) {
  const ModelSpec& s = spec_;
  const int64_t T = p.batch.num_tokens;
  const int64_t qkv_dim = s.qkv_dim();
  bf16_t* x = p.x;
  bf16_t* h = p.h;
  bf16_t* q = p.qkv;
  bf16_t* k = p.qkv + s.q_dim();
  bf16_t* v = p.qkv + s.q_dim() + s.kv_dim();

  KVFUSE_RETURN_IF_ERROR(backend_.embedding(p.token_ids, T, embed_.as<bf16_t>(), s.hidden, x));
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const Layer& L = layers_[size_t(l)];
    const bool swa = pool.layer_is_swa(l);
    // The previous layer's MLP output (in h) joins the residual stream in the norm's kernel.
    if (l == 0) {
      KVFUSE_RETURN_IF_ERROR(backend_.rmsnorm(x, L.attn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h));
    } else {
      KVFUSE_RETURN_IF_ERROR(backend_.add_rmsnorm(x, h, L.attn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h));
    }
    KVFUSE_RETURN_IF_ERROR(backend_.linear(h, T, L.qkv, p.qkv));
    KVFUSE_RETURN_IF_ERROR(backend_.rope(q, qkv_dim, s.num_q_heads, k, qkv_dim, s.num_kv_heads, s.head_dim,
                                         p.positions, T, rope_inv_freq_.as<float>(),
                                         rope_attention_scaling_));

    // K and V are strided views into the fused QKV rows: the write reads them in place.
    KvWriteArgs w;
    w.k = k;
    w.v = v;
    w.k_token_stride = qkv_dim;
    w.v_token_stride = qkv_dim;
    w.num_tokens = T;
    w.slot_mapping = p.slot_mapping;
    w.swa = swa ? pool.swa_table() : SwaSlotTable{};
    w.cache = pool.layer_view(l);
    KVFUSE_RETURN_IF_ERROR(backend_.kv_write(w, write));

    AttnArgs a;
    a.q = q;
    a.q_token_stride = qkv_dim;
    a.out = p.attn;
    a.out_token_stride = s.q_dim();
    a.num_q_heads = s.num_q_heads;
    a.softmax_scale = 1.0f / std::sqrt(float(s.head_dim));
    a.window = swa ? s.sliding_window : 0;
    a.batch = p.batch;
    a.batch.block_table = swa ? p.block_table_swa : p.block_table_full;
    a.cache = w.cache;
    KVFUSE_RETURN_IF_ERROR(backend_.attention(a, attention));

    KVFUSE_RETURN_IF_ERROR(backend_.linear(p.attn, T, L.o, h));
    KVFUSE_RETURN_IF_ERROR(backend_.add_rmsnorm(x, h, L.ffn_norm.as<bf16_t>(), T, s.hidden, s.rms_eps, h));
    KVFUSE_RETURN_IF_ERROR(backend_.linear(h, T, L.gate_up, p.gate_up));
    KVFUSE_RETURN_IF_ERROR(backend_.silu_mul(p.gate_up, T, s.intermediate, p.act));
    KVFUSE_RETURN_IF_ERROR(backend_.linear(p.act, T, L.down, h));
  }
  KVFUSE_RETURN_IF_ERROR(backend_.residual_add(x, h, T * s.hidden));  // the last layer's MLP output

  const int64_t n = p.num_logits_rows;
  for (int64_t e = 0; e < p.num_extra_rows; e += p.logits_capacity) {
    const int64_t c = std::min(p.logits_capacity, p.num_extra_rows - e);
    KVFUSE_RETURN_IF_ERROR(backend_.gather_rows(x, s.hidden, p.extra_rows + e, c, p.last));
    KVFUSE_RETURN_IF_ERROR(backend_.rmsnorm(p.last, final_norm_.as<bf16_t>(), c, s.hidden, s.rms_eps, p.last));
    KVFUSE_RETURN_IF_ERROR(backend_.linear_logits(p.last, c, lm_head_, p.logits));
    KVFUSE_RETURN_IF_ERROR(backend_.logprobs_rows(p.logits, c, s.vocab, p.extra_logprobs + e, nullptr, nullptr,
                                                  nullptr, p.logprob_out + n + e));
  }
  if (n == 0) return absl::OkStatus();
  KVFUSE_RETURN_IF_ERROR(backend_.gather_rows(x, s.hidden, p.logits_rows, n, p.last));
  KVFUSE_RETURN_IF_ERROR(backend_.rmsnorm(p.last, final_norm_.as<bf16_t>(), n, s.hidden, s.rms_eps, p.last));
  KVFUSE_RETURN_IF_ERROR(backend_.linear_logits(p.last, n, lm_head_, p.logits));
  // Greedy tokens, then the finiteness flags, then the sampled tokens.
  KVFUSE_RETURN_IF_ERROR(backend_.argmax_rows(p.logits, n, s.vocab, p.tokens, p.tokens + n));
  KVFUSE_RETURN_IF_ERROR(backend_.sample_rows(p.logits, n, s.vocab, p.sampling, p.tokens + 2 * n));
  if (p.logprobs == nullptr) return absl::OkStatus();
  return backend_.logprobs_rows(p.logits, n, s.vocab, p.logprobs, p.tokens, p.tokens + 2 * n, p.sampling,
                                p.logprob_out);
}

}  // namespace kvfuse
