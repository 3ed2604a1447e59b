// CPU reference of the KV write (docs/design.md#kv-scales and #kv-write-paths).
//
// Numerics shared by both paths, so they produce the same bytes:
// - FP8 cache: stored = fp8_encode(x * inv) with inv = 1.0f / scale computed once per
//   call in fp32 and x the source element widened exactly to fp32. One fp32 multiply,
//   then one saturating round-to-nearest-even conversion.
// - bf16 cache: no scaling (scales apply to FP8 only). A bf16 source is copied bit for
//   bit (NaN payloads included); an f16 source is widened exactly and rounded to bf16
//   (RNE).
#include "kernels/cpu/kv_write/kv_write.h"

#include <cstring>
#include <vector>

#include "kernels/cpu/ops/rope_rows.h"

namespace kvfuse::cpu {
namespace {

// Exact widening of one source element.
inline float load_src(const void* base, int64_t index, KvSrcDtype src) {
  const uint16_t bits = static_cast<const uint16_t*>(base)[index];
  return src == KvSrcDtype::bf16 ? bf16_to_f32(bits) : f16_to_f32(bits);
}

inline const void* src_row(const void* base, int64_t token, int64_t token_stride) {
  return static_cast<const uint16_t*>(base) + token * token_stride;
}

// One row (all heads of one token) of the fused write into `dst_row`, which points at
// the slot's first element in the cache.
void write_row_fused(const void* src, KvSrcDtype src_dtype, int64_t row_elems, KvFormat dtype, float inv,
                     void* dst_row) {
  if (dtype == KvFormat::bf16) {
    bf16_t* dst = static_cast<bf16_t*>(dst_row);
    if (src_dtype == KvSrcDtype::bf16) {
      memcpy(dst, src, size_t(row_elems) * sizeof(bf16_t));
    } else {
      for (int64_t e = 0; e < row_elems; ++e) dst[e] = f32_to_bf16(load_src(src, e, src_dtype));
    }
    return;
  }
  const Fp8Format fmt = kv_fp8_format(dtype);
  uint8_t* dst = static_cast<uint8_t*>(dst_row);
  for (int64_t e = 0; e < row_elems; ++e) dst[e] = fp8_encode(load_src(src, e, src_dtype) * inv, fmt);
}

// Stage 1/2 of the unfused path: scaled = x * inv in fp32 (FP8 caches), or x exactly
// (bf16 caches, which are not scaled).
void scale_stage(const void* src, int64_t token_stride, KvSrcDtype src_dtype, int64_t num_tokens,
                 int64_t row_elems, bool apply_scale, float inv, float* scaled) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const void* row = src_row(src, t, token_stride);
    float* out = scaled + t * row_elems;
    for (int64_t e = 0; e < row_elems; ++e) {
      const float x = load_src(row, e, src_dtype);
      out[e] = apply_scale ? x * inv : x;
    }
  }
}

// Stage 3/4: fp32 scratch to cache-dtype bytes, rows of row_elems * kv_format_bytes.
// For a bf16 cache with a bf16 source the scratch values are exact widenings, so taking
// the high half reproduces the source bits (NaN payloads included), as the fused copy
// does; f16 sources round to nearest even like the fused path.
void cast_stage(const float* scaled, int64_t num_tokens, int64_t row_elems, KvFormat dtype,
                KvSrcDtype src_dtype, uint8_t* cast) {
  const int64_t count = num_tokens * row_elems;
  if (dtype == KvFormat::bf16) {
    bf16_t* out = reinterpret_cast<bf16_t*>(cast);
    for (int64_t i = 0; i < count; ++i) {
      out[i] = src_dtype == KvSrcDtype::bf16 ? bf16_t(f32_bits(scaled[i]) >> 16) : f32_to_bf16(scaled[i]);
    }
    return;
  }
  const Fp8Format fmt = kv_fp8_format(dtype);
  for (int64_t i = 0; i < count; ++i) cast[i] = fp8_encode(scaled[i], fmt);
}

// What every path reads of the cache once per call: row geometry, the FP8 reciprocals
// (1.0f / scale in fp32; 1 for a bf16 cache, whose scale pointers may be null) and the
// K/V bases.
struct CacheRows {
  explicit CacheRows(const PagedKvView& cache)
      : row_elems(cache.row_elems()),
        row_bytes(row_elems * kv_format_bytes(cache.format)),
        num_slots(cache.num_slots()),
        fp8(cache.format != KvFormat::bf16),
        inv_k(fp8 ? 1.0f / *cache.k_scale : 1.0f),
        inv_v(fp8 ? 1.0f / *cache.v_scale : 1.0f),
        k(static_cast<uint8_t*>(cache.k)),
        v(static_cast<uint8_t*>(cache.v)) {}
  int64_t row_elems;
  int64_t row_bytes;
  int64_t num_slots;
  bool fp8;
  float inv_k;
  float inv_v;
  uint8_t* k;
  uint8_t* v;
};

}  // namespace

void kv_write_fused(const KvWriteArgs& args) {
  const PagedKvView& cache = args.cache;
  const CacheRows c(cache);
  for (int64_t t = 0; t < args.num_tokens; ++t) {
    const int64_t slot = resolve_write_slot(args.slot_mapping[t], args.swa, c.num_slots);
    if (slot < 0) continue;
    write_row_fused(src_row(args.k, t, args.k_token_stride), args.src_dtype, c.row_elems, cache.format, c.inv_k,
                    c.k + slot * c.row_bytes);
    write_row_fused(src_row(args.v, t, args.v_token_stride), args.src_dtype, c.row_elems, cache.format, c.inv_v,
                    c.v + slot * c.row_bytes);
  }
}

void kv_write_rope(const KvWriteRopeArgs& args) {
  const KvWriteArgs& kv = args.kv;
  const PagedKvView& cache = kv.cache;
  const CacheRows c(cache);
  const int64_t row_elems = c.row_elems;
  const int32_t half = cache.head_dim / 2;
  std::vector<float> cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
  std::vector<bf16_t> k_row(static_cast<size_t>(row_elems));

  for (int64_t t = 0; t < kv.num_tokens; ++t) {
    rope_cos_sin(args.positions[t], args.inv_freq, half, args.attention_scaling, cos_t.data(), sin_t.data());
    rope_rotate_heads(args.q + t * args.q_token_stride, args.q_heads, cache.head_dim, cos_t.data(),
                      sin_t.data());
    const int64_t slot = resolve_write_slot(kv.slot_mapping[t], kv.swa, c.num_slots);
    if (slot < 0 && args.k_rotated == nullptr) continue;
    // K is rotated in a copy of its row: the caller's rows are the input of the step.
    memcpy(k_row.data(), src_row(kv.k, t, kv.k_token_stride), size_t(row_elems) * sizeof(bf16_t));
    rope_rotate_heads(k_row.data(), cache.num_kv_heads, cache.head_dim, cos_t.data(), sin_t.data());
    if (args.k_rotated != nullptr) {
      memcpy(args.k_rotated + t * kv.k_token_stride, k_row.data(), size_t(row_elems) * sizeof(bf16_t));
    }
    if (slot < 0) continue;
    write_row_fused(k_row.data(), KvSrcDtype::bf16, row_elems, cache.format, c.inv_k, c.k + slot * c.row_bytes);
    write_row_fused(src_row(kv.v, t, kv.v_token_stride), KvSrcDtype::bf16, row_elems, cache.format, c.inv_v,
                    c.v + slot * c.row_bytes);
  }
}

void kv_write_unfused(const KvWriteArgs& args, const KvWriteScratch& scratch) {
  const PagedKvView& cache = args.cache;
  const CacheRows c(cache);
  const int64_t n = args.num_tokens;

  // Launches 1-4. Every token is converted, padding included, as the GPU's
  // elementwise kernels do; only the scatter looks at slots.
  scale_stage(args.k, args.k_token_stride, args.src_dtype, n, c.row_elems, c.fp8, c.inv_k, scratch.k_scaled);
  scale_stage(args.v, args.v_token_stride, args.src_dtype, n, c.row_elems, c.fp8, c.inv_v, scratch.v_scaled);
  cast_stage(scratch.k_scaled, n, c.row_elems, cache.format, args.src_dtype, scratch.k_cast);
  cast_stage(scratch.v_scaled, n, c.row_elems, cache.format, args.src_dtype, scratch.v_cast);

  // Launch 5: scatter both.
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = resolve_write_slot(args.slot_mapping[t], args.swa, c.num_slots);
    if (slot < 0) continue;
    memcpy(c.k + slot * c.row_bytes, scratch.k_cast + t * c.row_bytes, size_t(c.row_bytes));
    memcpy(c.v + slot * c.row_bytes, scratch.v_cast + t * c.row_bytes, size_t(c.row_bytes));
  }
}

}  // namespace kvfuse::cpu
