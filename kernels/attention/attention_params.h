// What every paged attention kernel and its host launcher agree on, in plain C++ that
// the CPU build compiles too: the block modes, the kernel parameters, the split-KV
// partition arithmetic, the rows and keys of a block (block_rows) and the merge of the
// partitions. The CUDA tile kernel (kernels/attention/attention_tile.cuh), the CDNA MFMA
// kernel (kernels/attention/mfma/attention_mfma.h) and the host lane runs of the latter
// (tests/kernels/test_attention_mfma_lanes.cc) all read them here.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/common/bf16.h"
#include "kernels/common/host_device.h"
#include "kernels/common/kv_types.h"

namespace kvfuse::gpu {

constexpr int kAttnTileKeys = 16;  // keys per MMA tile; split partitions are multiples of it

namespace attention_detail {

constexpr int kTileKeys = kAttnTileKeys;

enum Mode : int32_t {
  kModeUnified = 0,  // token grid, every row; decode rows take their whole context
  kModePrefill = 1,  // token grid, prefill rows only (split path)
  kModeDecode = 2,   // sequence grid x partitions, decode rows only (split path)
};

struct Params {
  AttnArgs a;
  float* part_o;      // split: [row][q head][partition][D] partial outputs (v scale applied)
  float* part_ml;     // split: [row][q head][partition][2] max (log2 domain), sum
  // split, when not null: [row][KV head] counts of the partitions done; the last decode
  // block of a row and KV head to finish merges its heads' partitions (no merge kernel)
  // and sets the count back to 0. Zero before every launch and after it.
  int32_t* part_done;
  int32_t part_len;   // split: fewest keys per partition, a multiple of kTileKeys
  int32_t num_parts;  // split: partitions in the grid
  int32_t mode;
  int32_t ps_shift;    // log2(page_size) for powers of two, else -1
  int32_t page_tiles;  // page_size % kTileKeys == 0: a tile lies in one page
  // Decode-only batches, when rope_write is set: RoPE and the KV write inside the kernel
  // (launch_attention_* with an AttnRope, kernels/attention/attention.cuh). a.q is then unrotated;
  // every block rotates its query heads into shared memory, and the block that holds a
  // row's own key rotates K and writes the row's K and V into the cache before it reads
  // them.
  KvWriteRopeArgs rope;
  int32_t rope_write;
};

// Split path: a decode row's visible keys [lo, pos] are cut into partitions of `len`
// keys from base = lo rounded down to a tile, len = the span over the grid's partitions
// (at least min_len, a multiple of the tile): every sequence spreads over the grid by its
// own length, so a graph captured for a longer context stays balanced. Partitions
// 0 .. last are used; the decode kernel and the merge compute the same.
struct SplitRange {
  int32_t base, len, last;
};
KVFUSE_HD SplitRange split_range(int32_t lo, int32_t pos, int32_t num_parts, int32_t min_len) {
  SplitRange r;
  r.base = lo & ~(kTileKeys - 1);
  const int32_t span = pos + 1 - r.base;
  const int32_t even = ((span + num_parts - 1) / num_parts + kTileKeys - 1) & ~(kTileKeys - 1);
  r.len = min_len > even ? min_len : even;
  r.last = (pos - r.base) / r.len;
  return r;
}

// The rows and keys of one block of an attention kernel (the CUDA tile kernel,
// kernels/attention/attention_unified.cu, and the CDNA MFMA kernel,
// kernels/attention/mfma/attention_mfma.h: one definition for both), by p.mode:
// - kModeDecode: block bid of the grid partitions x sequences x KV heads takes its
//   sequence's row if that is a decode row (a query of one token), and of its keys the
//   partition's part of split_range;
// - kModeUnified, kModePrefill: block bid of the grid token rows x KV heads takes up to
//   kRows / G consecutive rows of one sequence (a decode row alone), if its token is the
//   first of such a run; kModePrefill only the rows of prefill chunks. Its keys: the
//   window of its first row up to its last row.
struct BlockRows {
  int32_t seq, kvh;     // sequence, KV head
  int32_t row0, nrows;  // token rows [row0, row0 + nrows): kvh's G query heads each
  int32_t pos0;         // position of row row0
  int32_t part;         // kModeDecode: the partition, else 0
  // Keys [begin, end). End first: the field order steers nvcc's register numbering, and
  // this one gives the CUDA kernel the machine code it had with the mapping written inline.
  int32_t end, begin;
  int32_t last_part;  // kModeDecode: the row's last partition, else 0
  bool to_scratch;    // kModeDecode, the row split over partitions: partial results out
};

// The last s with query_start[s] <= tok, by binary search (query_start is
// non-decreasing); -1 when none. A FindSeq of block_rows.
struct BinaryFindSeq {
  KVFUSE_HD int32_t operator()(const int32_t* query_start, int32_t num_seqs, int64_t tok) const {
    int32_t lo_s = 0, hi_s = num_seqs;  // answer in [lo_s - 1, hi_s)
    while (lo_s < hi_s) {
      const int32_t mid = (lo_s + hi_s) / 2;
      if (query_start[mid] <= tok) {
        lo_s = mid + 1;
      } else {
        hi_s = mid;
      }
    }
    return lo_s - 1;
  }
};

// min and max of block_rows: in CUDA device code CUDA's own (one PTX instruction each),
// elsewhere the comparison.
template <class T>
KVFUSE_HD T rows_min(T x, T y) {
#if defined(__CUDA_ARCH__)
  return min(x, y);
#else
  return x < y ? x : y;
#endif
}
template <class T>
KVFUSE_HD T rows_max(T x, T y) {
#if defined(__CUDA_ARCH__)
  return max(x, y);
#else
  return x > y ? x : y;
#endif
}

// Fills b for the block of index bid() in p's grid, kRows query rows (token x head) a
// block; false if the block has no rows (the caller returns). find_seq(query_start,
// num_seqs, tok): the last s with query_start[s] <= tok, or -1 (BinaryFindSeq, or the
// CUDA kernel's whole-block search); every thread of the block calls it with the same
// values.
template <int kRows, class BlockIndex, class FindSeq>
KVFUSE_HD bool block_rows(const Params& p, BlockIndex bid, FindSeq find_seq, BlockRows& b) {
  const AttnArgs& a = p.a;
  const int32_t H = a.cache.num_kv_heads;
  const int32_t G = a.num_q_heads / H;
  b.part = 0;
  if (p.mode == kModeDecode) {
    const int64_t per_part = int64_t(a.batch.num_seqs) * H;
    b.part = int32_t(bid() / per_part);
    const int32_t rest = int32_t(bid() % per_part);
    b.seq = rest / H;
    b.kvh = rest % H;
    const int32_t q0 = a.batch.query_start[b.seq];
    if (a.batch.query_start[b.seq + 1] - q0 != 1) return false;
    b.row0 = q0;
    b.nrows = 1;
    b.pos0 = a.batch.context_len[b.seq] - 1;
  } else {
    const int64_t tok = bid() / H;
    b.kvh = int32_t(bid() % H);
    b.seq = find_seq(a.batch.query_start, a.batch.num_seqs, tok);
    if (b.seq < 0) return false;
    const int32_t q0 = a.batch.query_start[b.seq];
    const int32_t qlen = a.batch.query_start[b.seq + 1] - q0;
    const int32_t j = int32_t(tok - q0);
    if (j >= qlen) return false;  // past the last sequence: graph padding
    if (p.mode == kModePrefill && qlen == 1) return false;
    const int32_t rows_per_block = (qlen == 1 || G >= kRows) ? 1 : kRows / G;
    if (j % rows_per_block != 0) return false;
    b.row0 = int32_t(tok);
    b.nrows = rows_min(rows_per_block, qlen - j);
    b.pos0 = a.batch.context_len[b.seq] - qlen + j;
  }
  const int32_t lo = a.window > 0 ? rows_max(0, b.pos0 - a.window + 1) : 0;
  b.begin = lo;
  b.end = b.pos0 + b.nrows;
  b.to_scratch = false;
  b.last_part = 0;
  if (p.mode == kModeDecode) {
    const SplitRange r = split_range(lo, b.pos0, p.num_parts, p.part_len);
    if (b.part > r.last) return false;
    b.begin = int32_t(rows_max(int64_t(b.begin), int64_t(r.base) + int64_t(b.part) * r.len));
    b.end = int32_t(rows_min(int64_t(b.end), int64_t(r.base) + int64_t(b.part + 1) * r.len));
    b.to_scratch = r.last > 0;
    b.last_part = r.last;
  }
  return true;
}

inline Params base_params(const AttnArgs& a) {
  Params p{};
  p.a = a;
  const int32_t ps = a.cache.page_size;
  p.ps_shift = -1;
  if ((ps & (ps - 1)) == 0) {
    p.ps_shift = 0;
    while ((1 << p.ps_shift) < ps) ++p.ps_shift;
  }
  p.page_tiles = ps % kTileKeys == 0 ? 1 : 0;
  p.part_len = INT32_MAX;
  p.num_parts = 1;
  return p;
}

// Fixed cost of a decode block (Q, first loads, merge of its groups, partial output and
// its share of the merge kernel), in keys: fitted on the H200 (batch 64 x 4096, e4m3fn,
// partitions of 512..4096 keys took waves x (keys + 180) to within 1.2%;
// bench/journal/results/attention_h200.txt). Not refitted for CDNA.
constexpr int64_t kBlockOverheadKeys = 180;
// Cost of each partition in a row's merge, in keys: the merge reads every partition's
// partial result (max, sum and D outputs per query head) one after another, once per row
// after its blocks. Fitted on the H200 (batch 1, e4m3fn, 8 and 64 partitions of 64 keys
// at 512 and 4096 keys: 7.8 against 17.6 us, 0.17 us a partition against 0.013 us a key;
// bench/results/attention_split_parts_h200.txt). It keeps a lone sequence's long context
// from splitting into more short partitions than the merge can take back.
constexpr int64_t kMergeKeysPerPartition = 13;

inline int64_t round_up_keys(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Keys per partition of the split path. `slots`: decode blocks resident at once on the
// device (multiprocessors x blocks per multiprocessor). split_partition > 0 forces
// max(split_partition, partition_size) rounded up to a tile. Otherwise blocks of one
// partition run as waves over the slots and a block costs its keys plus a fixed
// overhead, and the merge a cost per partition: pick the partition count that minimises
// waves x (keys per block + overhead) + partitions x merge cost, since more partitions only
// pay while they fill idle multiprocessors and their merge stays short.
inline int32_t split_partition_keys(const AttnArgs& a, int32_t partition_size, int32_t split_partition,
                                    int64_t slots) {
  const int64_t min_len = round_up_keys(partition_size > 1 ? partition_size : 1, kTileKeys);
  if (split_partition > 0) {
    const int64_t forced = round_up_keys(split_partition, kTileKeys);
    return int32_t(forced > min_len ? forced : min_len);
  }
  const int64_t max_ctx = a.batch.max_context_len > 1 ? a.batch.max_context_len : 1;
  const int64_t blocks_per_part = int64_t(a.batch.num_seqs > 1 ? a.batch.num_seqs : 1) *
                                  (a.cache.num_kv_heads > 1 ? a.cache.num_kv_heads : 1);
  const int64_t by_len = (max_ctx + min_len - 1) / min_len, by_slots = 4 * slots / blocks_per_part + 1;
  const int64_t max_parts = by_len < by_slots ? by_len : by_slots;
  int64_t best_len = round_up_keys(max_ctx, kTileKeys), best_cost = INT64_MAX;
  for (int64_t parts = 1; parts <= (max_parts > 1 ? max_parts : 1); ++parts) {
    const int64_t even = round_up_keys((max_ctx + parts - 1) / parts, kTileKeys);
    const int64_t len = even > min_len ? even : min_len;
    const int64_t real_parts = (max_ctx + len - 1) / len;
    const int64_t waves = (real_parts * blocks_per_part + slots - 1) / slots;
    const int64_t cost = waves * ((len < max_ctx ? len : max_ctx) + kBlockOverheadKeys) +
                         (real_parts > 1 ? real_parts * kMergeKeysPerPartition : 0);
    if (cost < best_cost) {
      best_cost = cost;
      best_len = len;
    }
  }
  return int32_t(best_len < INT32_MAX / 2 ? best_len : INT32_MAX / 2);
}

// Partitions of `len` keys that cover max_context_len.
inline int32_t split_parts(int32_t max_context_len, int32_t len) {
  return max_context_len <= len ? 1 : int32_t((int64_t(max_context_len) + len - 1) / len);
}

// The split path's decode blocks: `parts` partitions of at least partition_size keys
// (each sequence spreads its own keys over them, split_range), partial results in
// `scratch` (attention_split_scratch_bytes; may be null when parts == 1). Their grid is
// parts x num_seqs x num_kv_heads blocks; prefill rows run with mode kModePrefill on the
// token grid, and the merge follows when parts > 1.
inline Params split_decode_params(const AttnArgs& a, int32_t partition_size, int32_t parts, float* scratch) {
  Params p = base_params(a);
  p.mode = kModeDecode;
  p.part_len = int32_t(round_up_keys(partition_size > 1 ? partition_size : 1, kTileKeys));
  p.num_parts = parts;
  p.part_o = scratch;
  p.part_ml = scratch == nullptr
                  ? nullptr
                  : scratch + a.batch.num_tokens * a.num_q_heads * int64_t(parts) * a.cache.head_dim;
  p.part_done = nullptr;  // the launcher sets it where the decode blocks merge
  return p;
}

// Split path, last step: merges the partial results of decode row `seq`'s partitions for
// query head qh, dimensions [d0, d0 + N) of D: out = sum_p o_p 2^(m_p - M) / sum_p l_p
// 2^(m_p - M). Rows with one partition were written by the decode blocks directly.
// Load(p) reads a partial result: a plain load, or on the GPU one that bypasses the
// multiprocessor's L1 when other blocks of the same kernel wrote it.
struct PlainLoad {
  KVFUSE_HD float operator()(const float* p) const { return *p; }
};

template <int D, int N, class Load = PlainLoad>
KVFUSE_HD void merge_partitions(const AttnArgs& a, const float* part_o, const float* part_ml,
                                int32_t part_len, int32_t num_parts, int32_t seq, int32_t qh, int d0,
                                Load ld = {}) {
  const int32_t q0 = a.batch.query_start[seq];
  if (a.batch.query_start[seq + 1] - q0 != 1) return;
  const int32_t pos = a.batch.context_len[seq] - 1;
  const int32_t lo = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
  const SplitRange r = split_range(lo, pos, num_parts, part_len);
  if (r.last == 0) return;  // written by the decode kernel directly
  const int64_t base = (int64_t(q0) * a.num_q_heads + qh) * num_parts;
  float mx = -INFINITY;
  for (int32_t pp = 0; pp <= r.last; ++pp) mx = fmaxf(mx, ld(part_ml + 2 * (base + pp)));
  float o[N];
  for (int i = 0; i < N; ++i) o[i] = 0.0f;
  float total = 0.0f;
  for (int32_t pp = 0; pp <= r.last; ++pp) {
    const float f = exp2f(ld(part_ml + 2 * (base + pp)) - mx);
    total += ld(part_ml + 2 * (base + pp) + 1) * f;
    const float* po = part_o + (base + pp) * D + d0;
    for (int i = 0; i < N; ++i) o[i] += ld(po + i) * f;
  }
  bf16_t* out = a.out + int64_t(q0) * a.out_token_stride + int64_t(qh) * D + d0;
  for (int i = 0; i < N; ++i) out[i] = f32_to_bf16(o[i] / total);
}

}  // namespace attention_detail
}  // namespace kvfuse::gpu
