// The model's weights onto the backend: sizes checked, each projection uploaded in its
// form (bf16, or FP8 codes with per-channel scales, src/loading/host_weights.h), and on a
// tensor-parallel rank its Megatron-style slice (src/loading/model_spec.h,
// TensorParallelShard): column-parallel pieces (QKV, gate_up, the lm_head's vocabulary
// rows) take their output rows and those rows' scales; row-parallel ones (O, down) take
// their input columns and keep every output channel's scale.
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/runtime/model.h"

namespace kvfuse {

namespace {

template <class T>
absl::Status check_size(const std::vector<T>& v, int64_t want, const std::string& what) {
  if (int64_t(v.size()) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("model weights: ", what, " has ", v.size(), " values, expected ", want));
}

// A projection of n x k, in either form; bias: n values or none (`bias` false).
absl::Status check_linear(const HostLinear& h, int64_t n, int64_t k, bool bias, const std::string& what) {
  KVFUSE_RETURN_IF_ERROR(check_size(h.bias, bias ? n : 0, what + " bias"));
  if (!h.fp8()) return check_size(h.w, n * k, what);
  KVFUSE_RETURN_IF_ERROR(check_size(h.w, 0, what + " (FP8) bf16 weight"));
  KVFUSE_RETURN_IF_ERROR(check_size(h.w_fp8, n * k, what + " (FP8)"));
  KVFUSE_RETURN_IF_ERROR(check_size(h.w_scale, n, what + " (FP8) scales"));
  if (h.act == Fp8Act::static_tensor && !(h.input_scale > 0.0f && h.input_scale < INFINITY)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model weights: ", what, " (FP8) input scale ", h.input_scale, " must be finite and > 0"));
  }
  return absl::OkStatus();
}

template <class T>
void append_rows(std::vector<T>& dst, const std::vector<T>& w, int64_t k, int64_t first, int64_t n) {
  if (!w.empty()) dst.insert(dst.end(), w.begin() + first * k, w.begin() + (first + n) * k);
}
template <class T>
std::vector<T> cols_of(const std::vector<T>& w, int64_t rows, int64_t k, int64_t first, int64_t n) {
  std::vector<T> out(size_t(rows * n));
  for (int64_t r = 0; r < rows; ++r) std::copy_n(w.begin() + r * k + first, n, out.begin() + r * n);
  return out;
}

// The output rows [first, first + n) of each range, in order (weights, FP8 codes and
// scales, bias), as one projection.
HostLinear rows_of(const HostLinear& h, int64_t k, std::initializer_list<std::pair<int64_t, int64_t>> ranges) {
  HostLinear out;
  out.act = h.act;
  out.input_scale = h.input_scale;
  for (const auto& [first, n] : ranges) {
    if (h.fp8()) {
      append_rows(out.w_fp8, h.w_fp8, k, first, n);
      append_rows(out.w_scale, h.w_scale, 1, first, n);
    } else {
      append_rows(out.w, h.w, k, first, n);
    }
    append_rows(out.bias, h.bias, 1, first, n);
  }
  return out;
}
// The input columns [first, first + n) of every row; every row keeps its scale and bias.
HostLinear cols_of(const HostLinear& h, int64_t rows, int64_t k, int64_t first, int64_t n) {
  HostLinear out;
  out.act = h.act;
  out.input_scale = h.input_scale;
  out.bias = h.bias;
  if (h.fp8()) {
    out.w_fp8 = cols_of(h.w_fp8, rows, k, first, n);
    out.w_scale = h.w_scale;
  } else {
    out.w = cols_of(h.w, rows, k, first, n);
  }
  return out;
}

absl::Status upload_vec(Backend& backend, const std::vector<bf16_t>& v, DeviceBuffer& dst) {
  auto b = backend.alloc(v.size() * sizeof(bf16_t));
  if (!b.ok()) return b.status();
  dst = std::move(*b);
  return backend.copy_to_device(dst.get(), v.data(), v.size() * sizeof(bf16_t));
}

absl::Status upload(Backend& backend, const HostLinear& h, int64_t n, int64_t k, LinearWeight& dst) {
  const bf16_t* bias = h.bias.empty() ? nullptr : h.bias.data();
  auto lw = h.fp8() ? backend.upload_linear_fp8(Fp8LinearHost{h.w_fp8.data(), h.w_scale.data(), h.act, h.input_scale},
                                                n, k, bias)
                    : backend.upload_linear(h.w.data(), n, k, bias);
  if (!lw.ok()) return lw.status();
  dst = std::move(*lw);
  return absl::OkStatus();
}

}  // namespace

absl::Status Model::load_globals(const HostGlobalWeights& g) {
  const ModelSpec& s = spec_;
  const TensorParallelShard& t = shard_.shard;
  KVFUSE_RETURN_IF_ERROR(check_size(g.embed, int64_t(s.vocab) * s.hidden, "embedding"));
  KVFUSE_RETURN_IF_ERROR(check_size(g.final_norm, s.hidden, "final norm"));
  HostLinear tied;
  if (s.tie_embeddings) tied.w = g.embed;
  const HostLinear& head = s.tie_embeddings ? tied : g.lm_head;
  KVFUSE_RETURN_IF_ERROR(check_linear(head, s.vocab, s.hidden, false, "lm_head"));
  KVFUSE_RETURN_IF_ERROR(upload_vec(backend_, g.embed, embed_));
  KVFUSE_RETURN_IF_ERROR(upload_vec(backend_, g.final_norm, final_norm_));
  if (t.tp == 1) {
    KVFUSE_RETURN_IF_ERROR(upload(backend_, head, s.vocab, s.hidden, lm_head_));
  } else {
    // This rank's vocabulary rows; the last rank's rows past the vocabulary are zero
    // (FP8: zero codes with scale 1).
    const int64_t first = t.vocab_begin(shard_.rank);
    const int64_t real = std::clamp<int64_t>(int64_t(s.vocab) - first, 0, t.vocab);
    HostLinear w = rows_of(head, s.hidden, {{first, real}});
    const size_t rows = size_t(t.vocab), elems = size_t(int64_t(t.vocab) * s.hidden);
    if (head.fp8()) {
      w.w_fp8.resize(elems, 0);
      w.w_scale.resize(rows, 1.0f);
    } else {
      w.w.resize(elems, bf16_t{});
    }
    KVFUSE_RETURN_IF_ERROR(upload(backend_, w, t.vocab, s.hidden, lm_head_));
  }
  globals_loaded_ = true;
  return absl::OkStatus();
}

absl::Status Model::load_layer(int32_t l, const HostLayerWeights& h) {
  const ModelSpec& s = spec_;
  const TensorParallelShard& t = shard_.shard;
  if (l < 0 || l >= s.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("model weights: layer ", l, " out of range"));
  }
  Layer& L = layers_[size_t(l)];
  const std::string at = absl::StrCat("layer ", l, " ");
  const int64_t H = s.hidden, D = s.head_dim, I = s.intermediate;
  KVFUSE_RETURN_IF_ERROR(check_size(h.attn_norm, H, at + "attention norm"));
  KVFUSE_RETURN_IF_ERROR(check_size(h.ffn_norm, H, at + "ffn norm"));
  KVFUSE_RETURN_IF_ERROR(check_linear(h.qkv, s.qkv_dim(), H, s.qkv_bias, at + "qkv"));
  KVFUSE_RETURN_IF_ERROR(check_linear(h.o, H, s.q_dim(), false, at + "o"));
  KVFUSE_RETURN_IF_ERROR(check_linear(h.gate_up, 2 * I, H, false, at + "gate_up"));
  KVFUSE_RETURN_IF_ERROR(check_linear(h.down, H, I, false, at + "down"));
  KVFUSE_RETURN_IF_ERROR(upload_vec(backend_, h.attn_norm, L.attn_norm));
  KVFUSE_RETURN_IF_ERROR(upload_vec(backend_, h.ffn_norm, L.ffn_norm));
  if (t.tp == 1) {
    KVFUSE_RETURN_IF_ERROR(upload(backend_, h.qkv, s.qkv_dim(), H, L.qkv));
    KVFUSE_RETURN_IF_ERROR(upload(backend_, h.o, H, s.q_dim(), L.o));
    KVFUSE_RETURN_IF_ERROR(upload(backend_, h.gate_up, 2 * I, H, L.gate_up));
    KVFUSE_RETURN_IF_ERROR(upload(backend_, h.down, H, I, L.down));
  } else {
    // Column-parallel QKV: this rank's query heads, then its KV heads' K rows and V rows.
    const int64_t r = shard_.rank;
    const int64_t q0 = t.q_head_begin(int32_t(r)) * D, nq = dims_.q_dim();
    const int64_t kv0 = t.kv_head_begin(int32_t(r)) * D, nkv = dims_.kv_dim();
    const int64_t k_rows = s.q_dim(), v_rows = s.q_dim() + s.kv_dim();
    KVFUSE_RETURN_IF_ERROR(upload(backend_, rows_of(h.qkv, H, {{q0, nq}, {k_rows + kv0, nkv}, {v_rows + kv0, nkv}}),
                                  dims_.qkv_dim(), H, L.qkv));
    // Row-parallel O: the input columns of this rank's query heads.
    KVFUSE_RETURN_IF_ERROR(upload(backend_, cols_of(h.o, H, s.q_dim(), q0, nq), H, nq, L.o));
    // Column-parallel gate_up (this rank's gate rows, then the same up rows); row-parallel down.
    const int64_t i0 = t.intermediate_begin(int32_t(r)), ni = dims_.intermediate;
    KVFUSE_RETURN_IF_ERROR(upload(backend_, rows_of(h.gate_up, H, {{i0, ni}, {I + i0, ni}}), 2 * ni, H, L.gate_up));
    KVFUSE_RETURN_IF_ERROR(upload(backend_, cols_of(h.down, H, I, i0, ni), H, ni, L.down));
  }
  ++layers_loaded_;
  return absl::OkStatus();
}

}  // namespace kvfuse
