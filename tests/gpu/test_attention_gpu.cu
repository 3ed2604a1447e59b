// GPU paged attention (kernels/attention/attention.cuh), unified and split, against the CPU
// reference (kernels/cpu/attention/attention.h) on mixed batches of prefill chunks (with prior
// context) and decode rows: every cache dtype (e4m3fn through the hardware conversion and
// through bit manipulation, e4m3fnuz, e5m2, bf16), head_dim 64/128/256, GQA 1..8 (7
// included), page sizes 1, 3, 16, 48, 64, sliding windows, shuffled pages with -1 for
// pages outside every window and NaN in every slot no query may read, padded q/out
// rows, long contexts over many split partitions, a decode batch of the benchmark's
// shape, graph replay equal to eager, and the unsupported-argument path. Without a GPU
// it skips.
//
// Tolerance (as tests/kernels/test_attention.cc and tests/gpu/test_gpu_backend.cc): both sides
// compute in fp32 and round the output to bf16 once; they differ in summation order
// (and exp2 vs exp), a few fp32 ulps, so the bf16 outputs agree within one bf16 ulp:
//   |gpu - cpu| <= ulp_bf16(max(|gpu|, |cpu|)) + 1e-4
// (1e-4 for outputs near zero through cancellation; values here are O(1), and a wrong
// mask, page or scale moves outputs by ~0.1). Out-of-row padding must be untouched and
// every output element written.
#include "kernels/common/gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention/attention.cuh"
#include "kernels/cpu/attention/attention.h"
#include "tests/util/attention_cases.h"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using namespace kvfuse::attention_cases;
using gpu_test::check;
using gpu_test::DeviceMem;

struct Device {
  DeviceMem q, qs, cl, bt, k, v, scales, out;
  Device(const Problem& p)
      : q(p.q.size() * 2),
        qs(p.query_start.size() * 4),
        cl(p.context_len.size() * 4 + 4),
        bt(p.block_table.size() * 4),
        k(p.k_cache.size()),
        v(p.v_cache.size()),
        scales(8),
        out(size_t(p.num_tokens * p.out_stride) * 2 + 2) {
    q.upload(p.q.data(), p.q.size() * 2);
    qs.upload(p.query_start.data(), p.query_start.size() * 4);
    cl.upload(p.context_len.data(), p.context_len.size() * 4);
    bt.upload(p.block_table.data(), p.block_table.size() * 4);
    k.upload(p.k_cache.data(), p.k_cache.size());
    v.upload(p.v_cache.data(), p.v_cache.size());
    const float s[2] = {p.k_scale, p.v_scale};
    scales.upload(s, 8);
  }
  AttnArgs args(const Problem& p) {
    return make_args(p, q.get<bf16_t>(), out.get<bf16_t>(), qs.get<int32_t>(), cl.get<int32_t>(),
                     bt.get<int32_t>(), k.get(), v.get(), scales.get<float>(), scales.get<float>() + 1);
  }
};

// split: the decode blocks merge the partitions (the last of each row and KV head to
// finish, counting in the merge counters); split_merge_kernel: the merge kernel does (no
// counters passed).
enum class Path { unified, split, split_merge_kernel };

// One GPU call of `path`; returns the output rows.
std::vector<bf16_t> run_gpu(const Problem& p, Device& d, Path path, cudaStream_t stream, const std::string& what) {
  const std::vector<bf16_t> init = fresh_out(p);
  d.out.upload(init.data(), init.size() * 2);
  const AttnArgs a = d.args(p);
  gpu::AttnLaunch l;
  l.fp8_decode = p.c.fp8_decode;
  l.split_partition = p.c.split_partition;
  cudaError_t err;
  if (path == Path::unified) {
    err = gpu::launch_attention_unified(a, stream, l);
  } else {
    // Exactly the scratch of the partitions the launcher picks (what the GPU backend
    // reserves), never more than the bound from the partition size alone.
    const size_t bytes = gpu::attention_split_scratch_bytes(a, p.c.partition, l);
    const size_t bound = gpu::attention_split_scratch_bytes(p.num_tokens, p.num_q_heads, p.c.head_dim,
                                                            p.max_context_len, p.c.partition);
    check(bytes <= bound, what + ": exact split scratch within the bound");
    DeviceMem scratch(bytes);
    const size_t counters = size_t(gpu::attention_split_merge_counters(a));
    DeviceMem merge_counters(counters * sizeof(int32_t));
    KVFUSE_TEST_GPU(cudaMemset(merge_counters.get(), 0, counters * sizeof(int32_t)));
    err = gpu::launch_attention_split(a, scratch.get(), p.c.partition, stream, l,
                                      path == Path::split ? merge_counters.get<int32_t>() : nullptr);
    KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
    const std::vector<int32_t> left = merge_counters.download<int32_t>(counters);
    check(std::all_of(left.begin(), left.end(), [](int32_t x) { return x == 0; }),
          what + ": merge counters back to 0 after the launch");
  }
  check(err == cudaSuccess, what + ": launch returned " + cudaGetErrorString(err));
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  KVFUSE_TEST_GPU(cudaGetLastError());
  return d.out.download<bf16_t>(init.size());
}

void run_case(const Case& c, cudaStream_t stream) {
  const Problem p = make_problem(c);
  Device d(p);
  const std::vector<bf16_t> ref = run_cpu(p);
  const std::string what = describe(c);
  std::vector<bf16_t> split_out;
  for (Path path : {Path::unified, Path::split, Path::split_merge_kernel}) {
    const std::string name = (path == Path::unified ? "unified "
                              : path == Path::split ? "split "
                                                    : "split, merge kernel ")
                             + what;
    std::vector<bf16_t> got = run_gpu(p, d, path, stream, what);
    const std::string err = compare_outputs(p, got, ref, name);
    check(err.empty(), err.empty() ? name : err);
    if (path == Path::split) split_out = std::move(got);
    if (path == Path::split_merge_kernel) {
      check(got == split_out, name + ": equal bit for bit to the merge in the decode blocks");
    }
  }
}

void test_matrix(cudaStream_t stream, bool quick) {
  const std::vector<Case> cases = attention_cases::matrix_cases(quick);
  int n = 0;
  for (const Case& c : cases) {
    run_case(c, stream);
    ++n;
  }
  std::printf("matrix: %d cases, %lld outputs, %.2f%% bit-equal to the CPU, worst error %.3f of the tolerance\n", n,
              (long long)stats().elems, 100.0 * double(stats().equal) / double(std::max<int64_t>(1, stats().elems)),
              stats().max_err);
}

// The benchmark's decode shape: batch 64 x context 4096, 32 q heads over 8 KV heads x 128,
// e4m3fn, page 16; split with the backend's partition of 512 and unified.
void test_bench_shape(cudaStream_t stream) {
  Case c;
  c.dtype = KvFormat::fp8_e4m3fn;
  c.num_kv_heads = 8;
  c.gqa = 4;
  c.head_dim = 128;
  c.page_size = 16;
  c.partition = 512;
  c.seqs.assign(64, SeqSpec{4096, 1});
  c.seed = 4096;
  run_case(c, stream);
  std::printf("bench shape: worst error so far %.3f of the tolerance\n", stats().max_err);
}

// A graph of both paths, replayed, equals eager launches bit for bit.
void test_graph_replay(cudaStream_t stream) {
  Case c;
  c.dtype = KvFormat::fp8_e4m3fn;
  c.gqa = 4;
  c.partition = 64;
  c.window = 50;
  c.seqs = mixed_batch();
  c.seed = 77;
  const Problem p = make_problem(c);
  for (Path path : {Path::unified, Path::split}) {
    Device d(p);
    const std::string what = std::string(path == Path::unified ? "unified" : "split") + " graph replay";
    const std::vector<bf16_t> eager = run_gpu(p, d, path, stream, what);
    const std::vector<bf16_t> init = fresh_out(p);
    d.out.upload(init.data(), init.size() * 2);
    const size_t bytes =
        gpu::attention_split_scratch_bytes(p.num_tokens, p.num_q_heads, p.c.head_dim, p.max_context_len, 64);
    DeviceMem scratch(bytes);
    const AttnArgs a = d.args(p);
    const size_t counters = size_t(gpu::attention_split_merge_counters(a));
    DeviceMem merge_counters(counters * sizeof(int32_t));
    KVFUSE_TEST_GPU(cudaMemset(merge_counters.get(), 0, counters * sizeof(int32_t)));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KVFUSE_TEST_GPU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const cudaError_t err = path == Path::unified ? gpu::launch_attention_unified(a, stream)
                                                  : gpu::launch_attention_split(a, scratch.get(), 64, stream, {},
                                                                                merge_counters.get<int32_t>());
    KVFUSE_TEST_GPU(cudaStreamEndCapture(stream, &graph));
    check(err == cudaSuccess, what + ": capture");
    KVFUSE_TEST_GPU(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; ++i) KVFUSE_TEST_GPU(cudaGraphLaunch(exec, stream));
    KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
    const std::vector<bf16_t> replay = d.out.download<bf16_t>(init.size());
    check(replay == eager, what + ": equal to eager bit for bit");
    KVFUSE_TEST_GPU(cudaGraphExecDestroy(exec));
    KVFUSE_TEST_GPU(cudaGraphDestroy(graph));
  }
}

void test_unsupported() {
  AttnArgs a;
  a.num_q_heads = 36;
  a.cache.num_kv_heads = 4;  // 9 per KV head
  a.cache.head_dim = 128;
  a.cache.page_size = 16;
  a.cache.format = KvFormat::bf16;
  a.batch.num_tokens = 1;
  a.batch.num_seqs = 1;
  const std::string why = gpu::attention_unsupported(a);
  check(why.find("q heads 36") != std::string::npos && why.find("kv heads 4") != std::string::npos,
        "unsupported GQA ratio names the tuple: " + why);
  check(gpu::launch_attention_unified(a, nullptr) == cudaErrorInvalidValue, "unsupported: unified refuses");
  a.num_q_heads = 28;  // 7 per KV head: supported
  a.cache.head_dim = 96;
  check(!gpu::attention_unsupported(a).empty(), "head_dim 96 unsupported");
  a.cache.head_dim = 128;
  a.cache.format = KvFormat::fp8_e4m3fn;  // no scales
  check(!gpu::attention_unsupported(a).empty(), "fp8 without scales unsupported");
  a.cache.format = KvFormat::bf16;
  check(gpu::attention_unsupported(a).empty(), "28 q heads over 4 kv heads x 128 supported");
  a.batch.num_tokens = 0;
  check(gpu::launch_attention_split(a, nullptr, 512, nullptr) == cudaSuccess, "zero tokens: success, no launch");
}

}  // namespace

int main() {
  if (!gpu_test::gpu_available("test_attention_gpu")) return 0;
  cudaStream_t stream;
  KVFUSE_TEST_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const bool quick = gpu_test::quick();
  test_unsupported();
  test_matrix(stream, quick);
  if (!quick) test_bench_shape(stream);
  test_graph_replay(stream);
  KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
  return gpu_test::tally().report("test_attention_gpu");
}
