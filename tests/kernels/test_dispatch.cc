// What the GPU kernels are built for (kernels/common/dispatch.h), checked on the CPU: the
// predicates the launchers and Backend::check_supported use, and the messages that name
// an unsupported shape. The GPU side of the same verdicts is tests/gpu and
// tests/gpu/test_gpu_engine.cc.
#include <string>

#include "tests/util/catch.h"

#include "kernels/common/dispatch.h"
#include "src/backends/cpu/cpu_backend.h"

using namespace kvfuse;
using Catch::Matchers::ContainsSubstring;

TEST_CASE("dispatch: head dims, GQA groups and formats the GPU kernels are built for", "[dispatch]") {
  for (int32_t d : {64, 128, 256}) CHECK(gpu::head_dim_supported(d));
  for (int32_t d : {0, -64, 16, 32, 80, 96, 112, 192, 512}) CHECK_FALSE(gpu::head_dim_supported(d));
  CHECK(gpu::supported_head_dims() == "64, 128, 256");
  static_assert(gpu::head_dim_supported(128) && !gpu::head_dim_supported(96), "usable at compile time");

  CHECK(gpu::attn_group_supported(32, 8));        // llama3-8b: 4 per KV head
  CHECK(gpu::attn_group_supported(28, 4));        // qwen2.5-7b: 7
  CHECK(gpu::attn_group_supported(8, 8));         // MHA
  CHECK(gpu::attn_group_supported(64, 8));        // 8: the largest group
  CHECK_FALSE(gpu::attn_group_supported(36, 4));  // 9 per KV head
  CHECK_FALSE(gpu::attn_group_supported(30, 4));  // not a multiple
  CHECK_FALSE(gpu::attn_group_supported(8, 0));
  CHECK_FALSE(gpu::attn_group_supported(0, 8));

  for (KvFormat f : {KvFormat::bf16, KvFormat::fp8_e4m3fn, KvFormat::fp8_e4m3fnuz, KvFormat::fp8_e5m2}) {
    CHECK(gpu::kv_format_supported(f));
  }
  CHECK_FALSE(gpu::kv_format_supported(static_cast<KvFormat>(7)));
}

TEST_CASE("dispatch: an unsupported model shape is named with what is supported", "[dispatch]") {
  CHECK(gpu::model_shape_unsupported(128, 32, 8, KvFormat::fp8_e4m3fn).empty());
  CHECK(gpu::model_shape_unsupported(64, 4, 2, KvFormat::bf16).empty());

  const std::string dim = gpu::model_shape_unsupported(96, 32, 8, KvFormat::bf16);
  CHECK_THAT(dim, ContainsSubstring("head_dim 96"));
  CHECK_THAT(dim, ContainsSubstring("64, 128, 256"));
  CHECK_THAT(dim, !ContainsSubstring("query heads"));

  const std::string group = gpu::model_shape_unsupported(128, 36, 4, KvFormat::fp8_e5m2);
  CHECK_THAT(group, ContainsSubstring("36 query heads over 4 KV heads"));
  CHECK_THAT(group, ContainsSubstring("at most 8 per KV head"));
  CHECK_THAT(group, !ContainsSubstring("head_dim"));

  const std::string both = gpu::model_shape_unsupported(80, 10, 3, KvFormat::bf16);
  CHECK_THAT(both, ContainsSubstring("head_dim 80"));
  CHECK_THAT(both, ContainsSubstring("10 query heads over 3 KV heads"));

  CHECK_THAT(gpu::model_shape_unsupported(128, 8, 8, static_cast<KvFormat>(7)),
             ContainsSubstring("KV format"));
}

TEST_CASE("dispatch: the CPU backend serves any head_dim the GPU kernels lack", "[dispatch][engine]") {
  const auto cpu = make_cpu_backend();
  ModelSpec s;
  s.name = "odd";
  s.num_q_heads = 12;
  s.num_kv_heads = 1;  // 12 per KV head: beyond the GPU's 8
  for (int32_t d : {16, 96, 128}) {
    s.head_dim = d;
    const absl::Status st = cpu->check_supported(s, KvFormat::fp8_e4m3fn);
    INFO(st.ToString());
    CHECK(st.ok());
  }
  s.num_q_heads = 10;
  s.num_kv_heads = 4;  // the reference needs whole groups
  const absl::Status st = cpu->check_supported(s, KvFormat::bf16);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(st.message()), ContainsSubstring("10 query heads over 4 KV heads"));
}
