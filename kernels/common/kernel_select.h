// Which kernel runs each part of a step. Every rule that picks a kernel path is here; the
// model, the backends and the kernel launchers ask these functions instead of deciding
// on their own, so a path is changed, and read, in one place (docs/architecture.md,
// "Kernel paths"). Host code without device dependencies: the CPU build compiles it and
// tests/kernels/test_kernel_select.cc checks each rule.
//
// The one choice made by measurement rather than by rule, which GEMM kernel runs a shape
// (kvfuse's GEMV, its skinny GEMM or the vendor library's), is the GEMM planner's
// (src/backends/gpu/gemm/gemm_planner.h): it times the candidates in the step's graph and
// keeps the fastest in the GEMM cache file.
#pragma once

#include <cstdint>

namespace kvfuse {

// The paths a config picks (config keys `kv_write` and `attention`, docs/configuration.md).
// fused_rope: the fused write with RoPE in the same kernel (Backend::attention_rope).
enum class KvWritePath { fused, unfused, fused_rope };
enum class AttentionPath { unified, split };

// The largest block the KV write kernels are compiled for (their launch bounds). Larger
// blocks were slower on the H200 at every size, and a bound of 1024 capped the
// registers so low that the CDNA kernels spilled.
constexpr int kKvWriteMaxBlockThreads = 256;
// Up to this many tokens the fused write gives each token row a block of its own
// (kv_write_team below). Decode batches of 1 .. 8 sequences.
constexpr int kKvWriteBlockTeamMaxTokens = 8;

// Fewest keys per partition of the split attention path. A decode-only batch may split
// down to 64 keys (a tile per group of the block kernel): at batch 1 x 1024 keys the
// partition heuristic picks 8 partitions of 128 keys per KV head where a floor of 512
// left two. Its scratch holds a partial result per decode row and partition, and the
// heuristic keeps the partitions near what the multiprocessors hold, so it stays a few
// MiB. A batch with prefill rows indexes that scratch by token row: its partitions keep
// 512 keys. KVFUSE_SPLIT_MIN_KEYS overrides the decode minimum (a multiple of 16; the A/B).
constexpr int32_t kSplitPartition = 512;
constexpr int32_t kSplitPartitionDecode = 64;

namespace select {

// ---- One layer's RoPE, KV write and attention ------------------------------------------

// The model: with kv_write fused_rope, RoPE runs inside the write's kernel and the
// model hands rope, write and attention to the backend together (Backend::attention_rope);
// otherwise rope, kv_write (fused or unfused) and attention are three calls.
constexpr bool rope_in_write(KvWritePath write) { return write == KvWritePath::fused_rope; }

// The backend, given such a layer: the attention kernel takes RoPE and the write in (one
// launch instead of two, the same bytes) when the backend offers it (`offered`: the GPU's,
// on unless KVFUSE_ROPE_IN_ATTENTION=0) and its kernel accepts these arguments
// (`accepted`: gpu::attention_rope_unsupported is empty, e.g. decode-only steps);
// otherwise kv_write_rope then attention.
constexpr bool write_in_attention(bool offered, bool accepted) { return offered && accepted; }

// ---- Attention: the unified kernel or the split-KV path -------------------------------

enum class AttentionKernel { unified, split };

// Fewest keys per partition for a split launch of this batch (`decode_min_keys`:
// kSplitPartitionDecode or KVFUSE_SPLIT_MIN_KEYS).
constexpr int32_t split_min_keys(bool decode_only, int32_t decode_min_keys) {
  return decode_only ? decode_min_keys : kSplitPartition;
}

// `path` is the config's. The unified kernel gives a decode row one block: a decode-only
// batch too small to fill the device with (sequence, KV head) blocks would leave most
// multiprocessors idle on long contexts (batch 1 x 32768 keys: 22 ms against 6.3 ms a
// step for llama3-8b on an H200), so such a batch takes the split path even under
// `unified`. `partition_keys` is the partition the split launcher would use for it
// (gpu::attention_split_partition); the batch is small when that partition is shorter
// than its longest context. Backends without the heuristic (the CPU's, which runs
// either path exactly as configured) pass decode_only = false.
constexpr AttentionKernel attention_kernel(AttentionPath path, bool decode_only, int64_t partition_keys,
                                           int64_t max_context_len) {
  if (path == AttentionPath::split) return AttentionKernel::split;
  const bool small_decode = decode_only && partition_keys < max_context_len;
  return small_decode ? AttentionKernel::split : AttentionKernel::unified;
}

// ---- The fused KV write's thread mapping -----------------------------------------------

// token: a block per token row, a lane per 8 elements of K and of V (decode is
// latency-bound: one 16-byte load of each per lane); block: a block per row whose lanes
// take 16-byte chunks in turn, for rows too wide for `token`; warp: a warp per row
// (bandwidth-bound batches: each lane streams several chunks).
// `block_team_max_tokens`: KvWriteLaunch's (kKvWriteBlockTeamMaxTokens; 0 in the
// benchmark's A/B, a warp per row at every size).
enum class KvWriteTeam { token, block, warp };
constexpr KvWriteTeam kv_write_team(int64_t num_tokens, int64_t row_elems, int block_team_max_tokens) {
  if (num_tokens > block_team_max_tokens) return KvWriteTeam::warp;
  return row_elems / 8 <= kKvWriteMaxBlockThreads ? KvWriteTeam::token : KvWriteTeam::block;
}

}  // namespace select
}  // namespace kvfuse
