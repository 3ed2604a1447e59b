// The kernel-path rules of kernels/common/kernel_select.h, each at its boundaries: these
// functions are the only place the model, the backends and the launchers decide which
// kernel runs, so the GPU's choices are checked here on any machine.
#include "kernels/common/kernel_select.h"

#include "tests/util/catch.h"

namespace kvfuse {
namespace {

using select::AttentionKernel;
using select::KvWriteTeam;

TEST_CASE("kernel select: RoPE goes into the write only with kv_write fused_rope") {
  CHECK(select::rope_in_write(KvWritePath::fused_rope));
  CHECK_FALSE(select::rope_in_write(KvWritePath::fused));
  CHECK_FALSE(select::rope_in_write(KvWritePath::unfused));
}

TEST_CASE("kernel select: attention takes the write in only when offered and accepted") {
  CHECK(select::write_in_attention(true, true));
  CHECK_FALSE(select::write_in_attention(true, false));   // e.g. a step with prefill rows
  CHECK_FALSE(select::write_in_attention(false, true));   // KVFUSE_ROPE_IN_ATTENTION=0, or the CPU
  CHECK_FALSE(select::write_in_attention(false, false));
}

TEST_CASE("kernel select: split partitions keep 512 keys unless the batch is decode-only") {
  CHECK(select::split_min_keys(false, kSplitPartitionDecode) == kSplitPartition);
  CHECK(select::split_min_keys(true, kSplitPartitionDecode) == kSplitPartitionDecode);
  CHECK(select::split_min_keys(true, 256) == 256);  // KVFUSE_SPLIT_MIN_KEYS
  CHECK(kSplitPartition == 512);
  CHECK(kSplitPartitionDecode == 64);
}

TEST_CASE("kernel select: the configured split path is always split") {
  for (bool decode_only : {false, true}) {
    CHECK(select::attention_kernel(AttentionPath::split, decode_only, 0, 0) == AttentionKernel::split);
    CHECK(select::attention_kernel(AttentionPath::split, decode_only, 4096, 128) == AttentionKernel::split);
  }
}

TEST_CASE("kernel select: unified splits only a decode-only batch whose partition is shorter than its context") {
  // Decode-only, the partition the split launcher would use shorter than the longest context.
  CHECK(select::attention_kernel(AttentionPath::unified, true, 128, 32768) == AttentionKernel::split);
  CHECK(select::attention_kernel(AttentionPath::unified, true, 2047, 2048) == AttentionKernel::split);
  // One partition would hold the whole context: nothing to split.
  CHECK(select::attention_kernel(AttentionPath::unified, true, 2048, 2048) == AttentionKernel::unified);
  CHECK(select::attention_kernel(AttentionPath::unified, true, 4096, 100) == AttentionKernel::unified);
  // Prefill rows keep the one unified launch, however long the context.
  CHECK(select::attention_kernel(AttentionPath::unified, false, 64, 1 << 20) == AttentionKernel::unified);
}

TEST_CASE("kernel select: the fused write's thread mapping by tokens and row width") {
  const int bt = kKvWriteBlockTeamMaxTokens;
  // Decode batches: a block per token row while a lane per 8 elements fits a block.
  const int64_t widest_token_row = int64_t(kKvWriteMaxBlockThreads) * 8;
  CHECK(select::kv_write_team(1, 128, bt) == KvWriteTeam::token);
  CHECK(select::kv_write_team(bt, widest_token_row, bt) == KvWriteTeam::token);
  // Wider rows: the block team, its lanes taking chunks in turn.
  CHECK(select::kv_write_team(1, widest_token_row + 8, bt) == KvWriteTeam::block);
  CHECK(select::kv_write_team(bt, widest_token_row * 4, bt) == KvWriteTeam::block);
  // Past the decode sizes a warp per row, whatever the width.
  CHECK(select::kv_write_team(bt + 1, 128, bt) == KvWriteTeam::warp);
  CHECK(select::kv_write_team(bt + 1, widest_token_row * 4, bt) == KvWriteTeam::warp);
  // block_team_max_tokens 0 (the benchmark's A/B): a warp per row at every size.
  CHECK(select::kv_write_team(1, 128, 0) == KvWriteTeam::warp);
  // An empty step launches nothing (the launcher returns first); the rule still answers.
  CHECK(select::kv_write_team(0, 128, bt) == KvWriteTeam::token);
}

}  // namespace
}  // namespace kvfuse
