// Paged attention on the GPU (CUDA and HIP from one source) over a mixed batch of
// prefill chunks and decode tokens, with the CPU reference's contract
// (kernels/cpu/attention/attention.h, kernels/common/kv_types.h AttnArgs): GQA, causal, optional sliding
// window (keys p-W+1 .. p), FP8 dequantised as float(stored) * scale, fp32 softmax and
// accumulation, the output rounded to bf16 once. kernels/attention/attention_tile.cuh has the
// tiling and the numerics, attention_unified.cu, attention_split.cu and
// attention_merge.cuh the paths.
//
// - unified: one launch for the whole batch. A block per (query block, KV head): a
//   decode row alone, or up to 8 / G consecutive rows of a prefill chunk, with all G query
//   heads of the KV head packed into one 8-row MMA tile; its four warps share the block's
//   visible keys (tiles wholly outside every row's window are never touched), each with an
//   online softmax, merged at the end.
// - split: a split-KV decode kernel (block per (sequence, KV head, partition); partitions
//   sized from the multiprocessor count) writing (max, sum, partial output) per partition,
//   a log-sum-exp merge kernel, and for prefill rows the unified kernel restricted to them.
//   Unified has no split-KV: a decode row is one block, so small decode batches with long
//   contexts (fewer blocks than multiprocessors) belong on the split path (the GPU
//   backend routes them there).
//
// The blocks are kernels/attention/attention_tile.cuh's on NVIDIA (mma.sync, 32-lane warps) and
// kernels/attention/mfma/attention_mfma.h's on CDNA (MFMA, 64-lane waves, up to 16 query rows a block);
// grids, modes, the split arithmetic and the numerics are the same.
//
// All launchers are asynchronous, never read device memory on the host, and are safe to
// capture in a CUDA/HIP graph. Grids come from host fields of AttnBatch (num_seqs,
// num_tokens, max_context_len, max_query_len), so a captured graph stays correct for any
// replay whose contexts stay within the captured max_context_len; rows past
// query_start[num_seqs] (graph padding) are skipped.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/attention/attention_params.h"
#include "kernels/common/dispatch.h"
#include "kernels/common/gpu.h"
#include "kernels/common/kv_types.h"

namespace kvfuse::gpu {

// kAttnMaxGroup (query heads per KV head) and the head dims are kernels/common/dispatch.h's;
// kAttnTileKeys (split partitions are multiples of it) is kernels/attention/attention_params.h's.

// Launch options; the defaults are what the engine uses, the benchmark varies them.
struct AttnLaunch {
  // Programmatic dependent launch (CUDA sm_90+; ignored on HIP), as KvWriteLaunch::pdl.
  bool pdl = false;
  // Split path: keys per partition. 0 chooses it from the multiprocessor count: the
  // partition count that minimises waves of blocks x (keys per block + a fixed block
  // cost), never fewer keys than the caller's partition_size (which bounds the scratch);
  // a decode batch that already fills the multiprocessors (e.g. 64 sequences x 8 KV
  // heads on 132 SMs) gets one partition and no merge. > 0 forces max(split_partition,
  // partition_size), rounded up to a multiple of kAttnTileKeys.
  int32_t split_partition = 0;
  // Multiprocessors to size partitions for; 0 asks the current device (once per device).
  int32_t num_sms = 0;
  // e4m3fn only: 0 picks the fastest exact decode for the device (the cvt.rn.f16x2.e4m3x2
  // instruction on sm_89+, else bit manipulation); 1 forces bit manipulation. Both are
  // exact; the knob is for the benchmark.
  int fp8_decode = 0;
};

// Empty if the kernels support `args`, else a message naming the whole tuple. The
// launchers refuse such arguments with cudaErrorInvalidValue and this message.
std::string attention_unsupported(const AttnArgs& args);

// RoPE and the KV write taken into the attention kernel (KvWritePath::fused_rope at
// decode-only steps): given `rope` (kernels/common/kv_types.h, KvWriteRopeArgs, over the same
// rows: rope.q is args.q, unrotated, and rope.kv.cache is args.cache), the launchers below
// leave the cache and the output as launch_kv_write_rope(rope) followed by the same
// launcher without it would: every block rotates its query heads in shared memory (q
// itself is left unrotated), and the one block that holds a row's own key (the last
// partition of a split row) rotates K and writes the row's K and V into its slot with
// the fused write's conversion before its tiles read them. One launch instead of two;
// the same cache bytes and the same output bits.
//
// Empty if the launchers take `rope` for `args`, else why not: CUDA only (the CDNA
// kernel does not take the write in); a decode-only batch (max_query_len 1); page sizes
// a multiple of 16; bf16, e4m3fn (the default decode) or e5m2 caches; what
// kv_write_rope_unsupported asks; no k_rotated; rope over the same q, cache and tokens.
std::string attention_rope_unsupported(const AttnArgs& args, const KvWriteRopeArgs& rope,
                                       const AttnLaunch& launch = {});

// rope: null, or the write taken in (attention_rope_unsupported(args, *rope) must be
// empty: the launchers refuse it otherwise).
LaunchStatus launch_attention_unified(const AttnArgs& args, cudaStream_t stream,
                                      const AttnLaunch& launch = {}, const KvWriteRopeArgs* rope = nullptr);

// Scratch bytes of the split path for `num_tokens` rows up to `max_context_len` keys,
// with partitions of at least `partition_size` keys. 16-byte aligned memory.
size_t attention_split_scratch_bytes(int64_t num_tokens, int32_t num_q_heads, int32_t head_dim,
                                     int32_t max_context_len, int32_t partition_size);
// The same for the partitions launch_attention_split picks for `args` with this
// partition_size and launch (0 when it picks one partition and needs none): what a caller
// that sizes scratch per call needs, where the bound above would be far larger (short
// partitions at long contexts; the wave heuristic keeps their count near the
// multiprocessors' capacity).
size_t attention_split_scratch_bytes(const AttnArgs& args, int32_t partition_size, const AttnLaunch& launch = {});
// int32 merge counters launch_attention_split needs for `args`: one per token row and KV
// head.
int64_t attention_split_merge_counters(const AttnArgs& args);
// merge_counters: null, or attention_split_merge_counters(args) int32 that are zero
// (cudaMemset once: every launch leaves them zero again), in memory of their own (the
// partial results of another call must not overlap them). With them the tile kernel's
// decode blocks merge the partitions (the last block of a row and KV head to finish, in
// partition order); without, or on CDNA, a merge kernel follows. Same bits either way.
LaunchStatus launch_attention_split(const AttnArgs& args, void* scratch, int32_t partition_size,
                                    cudaStream_t stream, const AttnLaunch& launch = {},
                                    int32_t* merge_counters = nullptr, const KvWriteRopeArgs* rope = nullptr);

// Keys per partition that launch_attention_split uses for `args` (for logs and benchmarks).
int32_t attention_split_partition(const AttnArgs& args, int32_t partition_size, const AttnLaunch& launch = {});

}  // namespace kvfuse::gpu
