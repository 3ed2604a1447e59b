// Attention with RoPE and the KV write taken in (kernels/attention/attention.cuh, the rope argument
// of launch_attention_unified / launch_attention_split) against the two launches it
// replaces on the same device: launch_kv_write_rope (tested against the CPU twin in
// test_kv_write_rope_gpu) followed by the same attention launcher without the write
// (tested against the CPU reference in test_attention_gpu). Both run on copies of one
// problem; what must hold per case and path:
// - the K and V caches byte for byte equal (every slot: the written rows and the rest);
// - the attention output bit for bit equal (the same rotated Q, the same cache bytes,
//   the same attention math);
// - the merge counters back at zero after the split launches.
// Over bf16, e4m3fn and e5m2 caches, head_dim 64/128/256, 1, 4 and 8 query heads per KV
// head, page sizes 16 and 64, windows, an SWA slot table, padding slots, positions past
// 100000, attention_scaling != 1, the pool's reciprocal scales, contexts from 1 key to
// many split partitions, the unified path, the split path with the merge in its blocks
// and with the merge kernel, PDL on and off, a CUDA-graph replay; and the refusals
// (prefill rows, k_rotated, e4m3fnuz, a write over other rows or another cache). Without
// a GPU it skips.
#include "kernels/common/gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention/attention.cuh"
#include "kernels/kv_write/kv_write_rope.cuh"
#include "tests/util/attention_cases.h"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using namespace kvfuse::attention_cases;
using gpu_test::check;
using gpu_test::DeviceMem;

struct RopeCase {
  Case c;
  float attention_scaling = 1.0f;
  int32_t position_offset = 0;  // rope positions = pos + offset (the kernels take them as given)
  bool swa_table = false;       // slots through a full-to-SWA table (a reversed one)
  bool inv_scales = false;      // the view carries 1/scale, as the pool's do
  bool pdl = false;
  int pad_every = 0;  // > 0: every pad_every-th token gets slot -1 (padding: no write)
};

enum class Path { unified, split, split_merge_kernel };
const char* path_name(Path p) {
  return p == Path::unified ? "unified" : p == Path::split ? "split" : "split, merge kernel";
}

// The device side of one problem: its batch metadata, one QKV buffer, the new tokens'
// positions and slots, and the caches (uploaded fresh for each side).
struct Side {
  DeviceMem qs, cl, bt, qkv, pos, slots, swa, freq, scales, k, v, out;
  int64_t qkv_stride = 0;
  Side(const Problem& p, const std::vector<bf16_t>& qkv_host, const std::vector<int32_t>& positions,
       const std::vector<int64_t>& slot_host, const std::vector<int64_t>& swa_host,
       const std::vector<float>& inv_freq)
      : qs(p.query_start.size() * 4),
        cl(p.context_len.size() * 4 + 4),
        bt(p.block_table.size() * 4),
        qkv(qkv_host.size() * 2),
        pos(positions.size() * 4 + 4),
        slots(slot_host.size() * 8 + 8),
        swa(swa_host.size() * 8 + 8),
        freq(inv_freq.size() * 4),
        scales(16),
        k(p.k_cache.size()),
        v(p.v_cache.size()),
        out(size_t(p.num_tokens * p.out_stride) * 2 + 2) {
    qs.upload(p.query_start.data(), p.query_start.size() * 4);
    cl.upload(p.context_len.data(), p.context_len.size() * 4);
    bt.upload(p.block_table.data(), p.block_table.size() * 4);
    qkv.upload(qkv_host.data(), qkv_host.size() * 2);
    pos.upload(positions.data(), positions.size() * 4);
    slots.upload(slot_host.data(), slot_host.size() * 8);
    if (!swa_host.empty()) swa.upload(swa_host.data(), swa_host.size() * 8);
    freq.upload(inv_freq.data(), inv_freq.size() * 4);
    const float s[4] = {p.k_scale, p.v_scale, 1.0f / p.k_scale, 1.0f / p.v_scale};
    scales.upload(s, 16);
    k.upload(p.k_cache.data(), p.k_cache.size());
    v.upload(p.v_cache.data(), p.v_cache.size());
    const std::vector<bf16_t> init = fresh_out(p);
    out.upload(init.data(), init.size() * 2);
    qkv_stride = int64_t(p.num_q_heads + 2 * p.c.num_kv_heads) * p.c.head_dim;
  }
  AttnArgs args(const Problem& p, const RopeCase& rc) {
    AttnArgs a = make_args(p, qkv.get<bf16_t>(), out.get<bf16_t>(), qs.get<int32_t>(), cl.get<int32_t>(),
                           bt.get<int32_t>(), k.get(), v.get(), scales.get<float>(), scales.get<float>() + 1);
    a.q_token_stride = qkv_stride;
    if (rc.inv_scales) {
      a.cache.k_inv_scale = scales.get<float>() + 2;
      a.cache.v_inv_scale = scales.get<float>() + 3;
    }
    return a;
  }
  KvWriteRopeArgs rope(const Problem& p, const RopeCase& rc, const AttnArgs& a, int64_t swa_size) {
    KvWriteRopeArgs r;
    const int64_t D = p.c.head_dim;
    r.kv.k = qkv.get<bf16_t>() + p.num_q_heads * D;
    r.kv.v = qkv.get<bf16_t>() + (p.num_q_heads + p.c.num_kv_heads) * D;
    r.kv.k_token_stride = r.kv.v_token_stride = qkv_stride;
    r.kv.num_tokens = p.num_tokens;
    r.kv.slot_mapping = slots.get<int64_t>();
    if (rc.swa_table) {
      r.kv.swa.full_to_swa = swa.get<int64_t>();
      r.kv.swa.size = swa_size;
    }
    r.kv.cache = a.cache;
    r.q = qkv.get<bf16_t>();
    r.q_token_stride = qkv_stride;
    r.q_heads = p.num_q_heads;
    r.positions = pos.get<int32_t>();
    r.inv_freq = freq.get<float>();
    r.attention_scaling = rc.attention_scaling;
    return r;
  }
};

// Runs one side: with `fused`, the attention launcher takes the write; else
// launch_kv_write_rope, then the launcher. Returns false if a launch failed.
bool run_side(const Problem& p, const RopeCase& rc, Side& s, Path path, bool fused, int64_t swa_size,
              cudaStream_t stream, const std::string& what) {
  const AttnArgs a = s.args(p, rc);
  const KvWriteRopeArgs r = s.rope(p, rc, a, swa_size);
  gpu::AttnLaunch l;
  l.pdl = rc.pdl;
  l.split_partition = rc.c.split_partition;
  gpu::KvWriteLaunch wl;
  wl.pdl = rc.pdl;
  if (!fused) {
    const gpu::LaunchStatus st = gpu::launch_kv_write_rope(r, stream, wl);
    check(st.ok(), what + ": kv_write_rope: " + st.message());
    if (!st.ok()) return false;
  }
  const KvWriteRopeArgs* take = fused ? &r : nullptr;
  const size_t counters = size_t(gpu::attention_split_merge_counters(a));
  DeviceMem scratch(gpu::attention_split_scratch_bytes(a, p.c.partition, l) + 16);
  DeviceMem merge_counters(counters * sizeof(int32_t) + 4);
  KVFUSE_TEST_GPU(cudaMemset(merge_counters.get(), 0, counters * sizeof(int32_t) + 4));
  const gpu::LaunchStatus st =
      path == Path::unified
          ? gpu::launch_attention_unified(a, stream, l, take)
          : gpu::launch_attention_split(a, scratch.get(), p.c.partition, stream, l,
                                        path == Path::split ? merge_counters.get<int32_t>() : nullptr, take);
  check(st.ok(), what + ": attention: " + st.message());
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  KVFUSE_TEST_GPU(cudaGetLastError());
  const std::vector<int32_t> left = merge_counters.download<int32_t>(counters);
  check(std::all_of(left.begin(), left.end(), [](int32_t x) { return x == 0; }),
        what + ": merge counters back to 0");
  return st.ok();
}

struct Inputs {
  Problem p;
  std::vector<bf16_t> qkv;
  std::vector<int32_t> positions;
  std::vector<int64_t> slots, swa;
  std::vector<float> inv_freq;
};

Inputs make_inputs(const RopeCase& rc) {
  Inputs in;
  in.p = make_problem(rc.c);
  const Problem& p = in.p;
  const int64_t D = p.c.head_dim, H = p.c.num_kv_heads;
  std::mt19937_64 rng(rc.c.seed * 31 + 7);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  const int64_t stride = (p.num_q_heads + 2 * H) * D;
  in.qkv.resize(size_t(p.num_tokens * stride));
  for (auto& x : in.qkv) x = f32_to_bf16(uni(rng));
  for (int64_t i = 0; i < D / 2; ++i)
    in.inv_freq.push_back(float(std::pow(500000.0, -2.0 * double(i) / double(D))));
  const int64_t num_slots = p.num_pages * p.c.page_size;
  if (rc.swa_table) {  // full slot f maps to SWA slot num_slots - 1 - f: a table the kernels must follow
    in.swa.resize(size_t(num_slots));
    for (int64_t f = 0; f < num_slots; ++f) in.swa[size_t(f)] = num_slots - 1 - f;
  }
  for (size_t s = 0; s < p.c.seqs.size(); ++s) {
    const int32_t t = p.query_start[s], pos = p.context_len[s] - 1;
    in.positions.push_back(pos + rc.position_offset);
    const int64_t slot =
        int64_t(p.block_table[s * size_t(p.max_pages) + size_t(pos / p.c.page_size)]) * p.c.page_size +
        pos % p.c.page_size;
    // The token's slot in the full pool: with the table, the full slot that maps to it.
    int64_t full = rc.swa_table ? num_slots - 1 - slot : slot;
    if (rc.pad_every > 0 && t % rc.pad_every == rc.pad_every - 1) full = -1;
    in.slots.push_back(full);
  }
  return in;
}

void run_case(const RopeCase& rc, cudaStream_t stream) {
  const Inputs in = make_inputs(rc);
  const Problem& p = in.p;
  char extra[160];
  std::snprintf(extra, sizeof extra, " scaling=%g pos+%d%s%s%s pad=%d", rc.attention_scaling,
                rc.position_offset, rc.swa_table ? " swa-table" : "", rc.inv_scales ? " inv-scales" : "",
                rc.pdl ? " pdl" : "", rc.pad_every);
  const std::string base = describe(rc.c) + extra;
  const int64_t swa_size = int64_t(in.swa.size());
  for (Path path : {Path::unified, Path::split, Path::split_merge_kernel}) {
    const std::string what = std::string(path_name(path)) + " " + base;
    Side two(p, in.qkv, in.positions, in.slots, in.swa, in.inv_freq);
    Side one(p, in.qkv, in.positions, in.slots, in.swa, in.inv_freq);
    if (!run_side(p, rc, two, path, false, swa_size, stream, what + " (two launches)")) continue;
    if (!run_side(p, rc, one, path, true, swa_size, stream, what + " (one launch)")) continue;
    const size_t cache_bytes = p.k_cache.size();
    const std::vector<uint8_t> k2 = two.k.download<uint8_t>(cache_bytes),
                               k1 = one.k.download<uint8_t>(cache_bytes);
    const std::vector<uint8_t> v2 = two.v.download<uint8_t>(cache_bytes),
                               v1 = one.v.download<uint8_t>(cache_bytes);
    int64_t kd = 0, vd = 0;
    for (size_t i = 0; i < cache_bytes; ++i) {
      kd += k1[i] != k2[i];
      vd += v1[i] != v2[i];
    }
    check(kd == 0 && vd == 0, what + ": " + std::to_string(kd) + " K and " + std::to_string(vd) +
                                  " V cache bytes differ from kv_write_rope then attention");
    // The written rows did change the cache (the problem's slots held other values).
    int64_t written = 0;
    for (size_t i = 0; i < cache_bytes; ++i) written += k1[i] != p.k_cache[i];
    check(written > 0 || std::all_of(in.slots.begin(), in.slots.end(), [](int64_t s) { return s < 0; }),
          what + ": no K byte written");
    const size_t out_elems = size_t(p.num_tokens * p.out_stride);
    const std::vector<bf16_t> o2 = two.out.download<bf16_t>(out_elems),
                              o1 = one.out.download<bf16_t>(out_elems);
    int64_t od = 0;
    for (size_t i = 0; i < out_elems; ++i) od += o1[i] != o2[i];
    check(od == 0, what + ": " + std::to_string(od) + " of " + std::to_string(out_elems) +
                       " outputs differ from kv_write_rope then attention");
  }
}

std::vector<RopeCase> cases() {
  std::vector<RopeCase> out;
  uint64_t seed = 100;
  const std::vector<std::vector<SeqSpec>> batches = {
      {{1, 1}},                                  // the first token: its own key only
      {{37, 1}},                                 // one partial tile
      {{512, 1}},                                // batch 1 x 512 (the benchmark's cell)
      {{3000, 1}, {17, 1}, {64, 1}, {1025, 1}},  // uneven rows over many partitions
  };
  for (KvFormat f : {KvFormat::fp8_e4m3fn, KvFormat::fp8_e5m2, KvFormat::bf16}) {
    for (int32_t d : {64, 128, 256}) {
      for (int32_t g : {1, 4, 8}) {
        for (size_t b = 0; b < batches.size(); ++b) {
          RopeCase rc;
          rc.c.dtype = f;
          rc.c.head_dim = d;
          rc.c.gqa = g;
          rc.c.num_kv_heads = g == 8 ? 1 : 2;
          rc.c.page_size = (b % 2 == 0) ? 16 : 64;
          rc.c.partition = 64;
          rc.c.seqs = batches[b];
          rc.c.seed = ++seed;
          rc.inv_scales = (seed % 2) == 0;
          rc.pdl = (seed % 3) == 0;
          out.push_back(rc);
        }
      }
    }
  }
  // Windows, an SWA table, padding slots, far positions, scaling, a forced partition.
  RopeCase w;
  w.c.seqs = {{700, 1}, {90, 1}, {1, 1}, {333, 1}};
  w.c.window = 100;
  w.c.partition = 64;
  w.c.seed = 900;
  w.swa_table = true;
  w.pad_every = 3;
  w.position_offset = 100000;
  w.attention_scaling = 1.1386f;
  out.push_back(w);
  w.c.dtype = KvFormat::fp8_e5m2;
  w.c.split_partition = 128;
  w.c.seed = 901;
  w.pdl = true;
  out.push_back(w);
  // The benchmark's batch: 64 rows x 2048, 8 KV heads x 128, e4m3fn.
  RopeCase big;
  big.c.num_kv_heads = 8;
  big.c.gqa = 4;
  big.c.seqs.assign(64, SeqSpec{2048, 1});
  big.c.partition = 64;
  big.c.seed = 902;
  big.inv_scales = true;
  big.pdl = true;
  out.push_back(big);
  return out;
}

// A graph of the one-launch split path, replayed, equals its eager launch.
void test_graph_replay(cudaStream_t stream) {
  RopeCase rc;
  rc.c.seqs = {{300, 1}, {45, 1}};
  rc.c.partition = 64;
  rc.c.seed = 77;
  rc.inv_scales = true;
  rc.pdl = true;
  const Inputs in = make_inputs(rc);
  const Problem& p = in.p;
  Side eager(p, in.qkv, in.positions, in.slots, in.swa, in.inv_freq);
  run_side(p, rc, eager, Path::split, true, 0, stream, "graph replay, eager");
  Side graph_side(p, in.qkv, in.positions, in.slots, in.swa, in.inv_freq);
  const AttnArgs a = graph_side.args(p, rc);
  const KvWriteRopeArgs r = graph_side.rope(p, rc, a, 0);
  gpu::AttnLaunch l;
  l.pdl = true;
  DeviceMem scratch(gpu::attention_split_scratch_bytes(a, 64, l) + 16);
  const size_t counters = size_t(gpu::attention_split_merge_counters(a));
  DeviceMem merge_counters(counters * 4 + 4);
  KVFUSE_TEST_GPU(cudaMemset(merge_counters.get(), 0, counters * 4 + 4));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVFUSE_TEST_GPU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const gpu::LaunchStatus st =
      gpu::launch_attention_split(a, scratch.get(), 64, stream, l, merge_counters.get<int32_t>(), &r);
  KVFUSE_TEST_GPU(cudaStreamEndCapture(stream, &graph));
  check(st.ok(), "graph replay: capture: " + st.message());
  KVFUSE_TEST_GPU(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) KVFUSE_TEST_GPU(cudaGraphLaunch(exec, stream));
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const size_t out_elems = size_t(p.num_tokens * p.out_stride);
  check(graph_side.out.download<bf16_t>(out_elems) == eager.out.download<bf16_t>(out_elems),
        "graph replay: output equal to eager bit for bit");
  check(graph_side.k.download<uint8_t>(p.k_cache.size()) == eager.k.download<uint8_t>(p.k_cache.size()) &&
            graph_side.v.download<uint8_t>(p.v_cache.size()) == eager.v.download<uint8_t>(p.v_cache.size()),
        "graph replay: caches equal to eager byte for byte");
  KVFUSE_TEST_GPU(cudaGraphExecDestroy(exec));
  KVFUSE_TEST_GPU(cudaGraphDestroy(graph));
}

// What the launchers refuse, with the reason named, and nothing launched.
void test_unsupported(cudaStream_t stream) {
  RopeCase rc;
  rc.c.seqs = {{40, 1}, {20, 1}};
  rc.c.seed = 5;
  const Inputs in = make_inputs(rc);
  const Problem& p = in.p;
  Side s(p, in.qkv, in.positions, in.slots, in.swa, in.inv_freq);
  const AttnArgs a = s.args(p, rc);
  const KvWriteRopeArgs r = s.rope(p, rc, a, 0);
  check(gpu::attention_rope_unsupported(a, r).empty(),
        "the plain decode batch is supported: " + gpu::attention_rope_unsupported(a, r));
  const auto refused = [&](const AttnArgs& aa, const KvWriteRopeArgs& rr, const std::string& word,
                           const std::string& what) {
    const std::string why = gpu::attention_rope_unsupported(aa, rr);
    check(why.find(word) != std::string::npos, what + ": refused naming '" + word + "': " + why);
    const gpu::LaunchStatus st = gpu::launch_attention_unified(aa, stream, {}, &rr);
    check(!st.ok() && st.message().find(word) != std::string::npos, what + ": unified launcher refuses");
    const gpu::LaunchStatus st2 = gpu::launch_attention_split(aa, nullptr, 64, stream, {}, nullptr, &rr);
    check(!st2.ok() && st2.message().find(word) != std::string::npos, what + ": split launcher refuses");
  };
  AttnArgs prefill = a;
  prefill.batch.max_query_len = 2;
  refused(prefill, r, "prefill", "prefill rows");
  KvWriteRopeArgs rot = r;
  rot.k_rotated = const_cast<bf16_t*>(static_cast<const bf16_t*>(r.kv.k));
  refused(a, rot, "k_rotated", "k_rotated");
  AttnArgs fnuz = a;
  fnuz.cache.format = KvFormat::fp8_e4m3fnuz;
  KvWriteRopeArgs rfnuz = r;
  rfnuz.kv.cache.format = KvFormat::fp8_e4m3fnuz;
  refused(fnuz, rfnuz, "e4m3fnuz", "e4m3fnuz");
  KvWriteRopeArgs other = r;
  other.kv.num_tokens = 1;
  refused(a, other, "differ", "a write over other tokens");
  other = r;
  other.kv.cache.v = s.k.get();
  refused(a, other, "differ", "a write into another cache");
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  const std::vector<bf16_t> untouched = s.out.download<bf16_t>(size_t(p.num_tokens * p.out_stride));
  check(untouched == fresh_out(p), "refusals launched nothing: the output rows untouched");
}

}  // namespace

int main() {
  if (!gpu_test::gpu_available("test_attention_rope_gpu")) return 0;
  cudaStream_t stream;
  KVFUSE_TEST_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (gpu::kWarpSize != 32) {  // CDNA: the launchers refuse the write, the engine keeps two launches
    RopeCase rc;
    rc.c.seqs = {{40, 1}};
    const Inputs in = make_inputs(rc);
    Side s(in.p, in.qkv, in.positions, in.slots, in.swa, in.inv_freq);
    const AttnArgs a = s.args(in.p, rc);
    const std::string why = gpu::attention_rope_unsupported(a, s.rope(in.p, rc, a, 0));
    check(why.find("CDNA") != std::string::npos, "CDNA refuses the write, naming why: " + why);
    std::printf("SKIP: the CDNA attention kernel does not take the write in\n");
    KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
    return gpu_test::tally().report("test_attention_rope_gpu");
  }
  test_unsupported(stream);
  int n = 0;
  for (const RopeCase& rc : cases()) {
    run_case(rc, stream);
    ++n;
  }
  std::printf("%d cases, 3 paths each\n", n);
  test_graph_replay(stream);
  KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
  return gpu_test::tally().report("test_attention_rope_gpu");
}
