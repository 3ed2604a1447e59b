// Plain view structs shared by the CPU reference and the GPU kernels. Kernels take them
// by value; every pointer is in the memory of the device that runs the kernel.
#pragma once

#include "kernels/common/bf16.h"
#include "kernels/common/enum_name.h"
#include "kernels/common/fp8.h"

namespace kvfuse {

// Concrete element type of a KV cache buffer. fp8_e4m3 in the config resolves to
// e4m3fn or e4m3fnuz depending on the device (docs/design.md#fp8-formats).
enum class KvFormat : uint8_t { bf16, fp8_e4m3fn, fp8_e4m3fnuz, fp8_e5m2 };

KVFUSE_HD int kv_format_bytes(KvFormat d) { return d == KvFormat::bf16 ? 2 : 1; }

constexpr KVFUSE_HD Fp8Format kv_fp8_format(KvFormat d) {
  switch (d) {
    case KvFormat::fp8_e4m3fnuz:
      return Fp8Format::e4m3fnuz;
    case KvFormat::fp8_e5m2:
      return Fp8Format::e5m2;
    default:
      return Fp8Format::e4m3fn;
  }
}

inline const char* kv_format_name(KvFormat d) {
  return enum_name(d, {"bf16", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2"});
}

// Element type of the new K/V rows handed to a write.
enum class KvSrcDtype : uint8_t { bf16, f16 };

// One layer's paged cache: K and V are [num_pages, page_size, num_kv_heads, head_dim],
// token-major within a page (NHD). A slot is page * page_size + offset, so the element
// offset of (slot, head, dim) is ((slot * num_kv_heads + head) * head_dim + dim).
struct PagedKvView {
  void* k = nullptr;
  void* v = nullptr;
  int64_t num_pages = 0;
  int32_t page_size = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  KvFormat format = KvFormat::bf16;
  const float* k_scale = nullptr;  // one float, device memory: read by kernels, never the host
  const float* v_scale = nullptr;
  // Optional: 1 / k_scale and 1 / v_scale in fp32, correctly rounded (the bits recip_rn
  // and the CPU reference compute), kept beside the scales by whoever sets them. When set,
  // the fused write reads them instead of computing the reciprocal after the scale's load:
  // one dependent step less on a decode write's critical path. Same bytes either way.
  const float* k_inv_scale = nullptr;
  const float* v_inv_scale = nullptr;

  KVFUSE_HD int64_t num_slots() const { return num_pages * int64_t(page_size); }
  KVFUSE_HD int64_t row_elems() const { return int64_t(num_kv_heads) * head_dim; }
  KVFUSE_HD int64_t elem_offset(int64_t slot, int32_t head) const {
    return (slot * num_kv_heads + head) * int64_t(head_dim);
  }
};

// Maps a token's full-pool slot to its slot in the SWA pool (docs/design.md#sliding-window-and-the-swa-pool).
// Entries are -1 where the full slot has no SWA slot. A null table means no remap.
struct SwaSlotTable {
  const int64_t* full_to_swa = nullptr;
  int64_t size = 0;  // number of entries (full-pool slots)
};

// Resolves the cache slot a token writes to, or -1 to skip it. The slot is checked for
// negativity before the table is read, and the mapped slot is checked again after.
KVFUSE_HD int64_t resolve_write_slot(int64_t slot, SwaSlotTable swa, int64_t num_cache_slots) {
  if (slot < 0) return -1;
  if (swa.full_to_swa != nullptr) {
    if (slot >= swa.size) return -1;
    slot = swa.full_to_swa[slot];
    if (slot < 0) return -1;
  }
  return slot < num_cache_slots ? slot : -1;
}

// Arguments of a KV write: new rows k/v [num_tokens, num_kv_heads, head_dim] with a
// token stride in elements (rows may be views into a fused QKV projection), and one
// slot per token.
struct KvWriteArgs {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_token_stride = 0;
  int64_t v_token_stride = 0;
  KvSrcDtype src_dtype = KvSrcDtype::bf16;
  int64_t num_tokens = 0;
  const int64_t* slot_mapping = nullptr;
  SwaSlotTable swa;
  PagedKvView cache;
};

// Arguments of the KV write with the rotary embedding on the way (KvWritePath::fused_rope):
// q is rotated in place and kv.k on its way into the cache, exactly as rope_neox
// (kernels/cpu/ops/ops.h) rotates them, then kv is written exactly as the fused write does —
// the cache gets the bytes of rope followed by kv_write_fused, the write no launch of its
// own. kv.k itself is left as it was (attention reads K from the cache) unless k_rotated
// asks for the rotated rows. Sources are bf16 (kv.src_dtype), as rope's are.
struct KvWriteRopeArgs {
  KvWriteArgs kv;
  bf16_t* q = nullptr;  // [kv.num_tokens, q_heads, cache.head_dim], rotated in place
  int64_t q_token_stride = 0;
  int32_t q_heads = 0;
  const int32_t* positions = nullptr;  // [kv.num_tokens]
  const float* inv_freq = nullptr;     // [cache.head_dim / 2], the model's frequency table
  float attention_scaling = 1.0f;      // cos and sin are multiplied by it (yarn's mscale, else 1)
  // Optional: where the rotated K rows go, kv.k_token_stride apart, for every token
  // (padding included, as rope rotates every row). kv.k itself gives rope's in-place
  // contract in full; tests use it to see the K the cache bytes came from.
  bf16_t* k_rotated = nullptr;
};

// Batch metadata of one attention call over the paged cache (nano-vllm style: flat,
// nothing but arrays). Sequence s owns query rows [query_start[s], query_start[s+1]);
// its keys are positions 0 .. context_len[s]-1, the last (query_start[s+1] -
// query_start[s]) of which are the new tokens. Query row j of s is at position
// context_len[s] - q_len + j. block_table[s * max_pages_per_seq + i] is the page that
// holds positions [i * page_size, (i+1) * page_size), or -1 if absent (an SWA page
// that fell out of the window).
struct AttnBatch {
  int32_t num_seqs = 0;
  int64_t num_tokens = 0;
  const int32_t* query_start = nullptr;  // [num_seqs + 1]
  const int32_t* context_len = nullptr;  // [num_seqs]
  const int32_t* block_table = nullptr;  // [num_seqs, max_pages_per_seq]
  int32_t max_pages_per_seq = 0;
  int32_t max_query_len = 0;
  int32_t max_context_len = 0;
};

// q, out: [num_tokens, num_q_heads, head_dim] bf16, rows with a token stride in elements.
struct AttnArgs {
  const bf16_t* q = nullptr;
  int64_t q_token_stride = 0;
  bf16_t* out = nullptr;
  int64_t out_token_stride = 0;
  int32_t num_q_heads = 0;
  float softmax_scale = 0.0f;
  int32_t window = 0;  // 0: full causal attention; W > 0: keys p-W+1 .. p
  AttnBatch batch;
  PagedKvView cache;
};

}  // namespace kvfuse
