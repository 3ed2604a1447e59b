// What the GPU kernels are built for, as constexpr facts and plain C++ predicates that
// CPU-only code can use (Backend::check_supported at engine start, tests). The
// launchers' argument checks (kv_write_unsupported, attention_unsupported) take their
// verdicts from here, and kernels/common/dispatch.cuh turns the same lists into template
// instantiations: a shape is either listed here and compiled, or refused with a message
// naming it (docs/design.md#kernel-dispatch).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "kernels/common/kv_types.h"

namespace kvfuse::gpu {

// Head dims the KV write and attention kernels are instantiated and tested for.
inline constexpr std::array<int32_t, 3> kHeadDims = {64, 128, 256};
// Query heads per KV head: attention packs the G query heads of a KV head into the 8
// rows of one MMA tile.
inline constexpr int32_t kAttnMaxGroup = 8;
// The stored KV formats the kernels read and write (every KvFormat).
inline constexpr std::array<KvFormat, 4> kKvFormats = {KvFormat::bf16, KvFormat::fp8_e4m3fn,
                                                       KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2};

constexpr bool head_dim_supported(int32_t head_dim) {
  for (int32_t d : kHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

constexpr bool kv_format_supported(KvFormat format) {
  for (KvFormat f : kKvFormats) {
    if (f == format) return true;
  }
  return false;
}

// num_q_heads a positive multiple of num_kv_heads, at most kAttnMaxGroup per KV head.
constexpr bool attn_group_supported(int32_t num_q_heads, int32_t num_kv_heads) {
  return num_kv_heads > 0 && num_q_heads > 0 && num_q_heads % num_kv_heads == 0 &&
         num_q_heads / num_kv_heads <= kAttnMaxGroup;
}

// "64, 128, 256"
inline std::string supported_head_dims() {
  std::string s;
  for (int32_t d : kHeadDims) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

// Why the kernels cannot serve a model of this shape with this KV format (every reason,
// each naming the value and what is supported), or empty if they can.
inline std::string model_shape_unsupported(int32_t head_dim, int32_t num_q_heads, int32_t num_kv_heads,
                                           KvFormat format) {
  std::string why;
  const auto add = [&why](const std::string& s) { why += (why.empty() ? "" : "; ") + s; };
  if (!head_dim_supported(head_dim)) {
    add("head_dim " + std::to_string(head_dim) + " (supported: " + supported_head_dims() + ")");
  }
  if (!attn_group_supported(num_q_heads, num_kv_heads)) {
    add(std::to_string(num_q_heads) + " query heads over " + std::to_string(num_kv_heads) +
        " KV heads (supported: a positive multiple, at most " + std::to_string(kAttnMaxGroup) +
        " per KV head)");
  }
  if (!kv_format_supported(format)) add(std::string("KV format ") + kv_format_name(format));
  return why;
}

}  // namespace kvfuse::gpu
