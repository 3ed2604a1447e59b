// What a one-token KV write costs, taken apart: the fused write as the engine launches it
// (launch_kv_write_fused, the cache view carrying 1/scale) beside stripped-down kernels of
// the same semantics for one token row of 8 KV heads x 128 (bf16 in, e4m3fn out, x *
// (1/scale) read from device memory), each differing from a plain one in one respect:
//
//   plain          a block of 128 threads per token, 8 elements of K and 8 of V a thread,
//                  plain 16-byte loads, the slot checked for < 0 only, 8-byte stores, a
//                  handful of scalar parameters
//   nc loads       the sources through the non-coherent path (ld.global.nc), as the
//                  engine's kernel reads them
//   64 threads     16 elements a thread (two 16-byte loads each of K and V, 16-byte
//                  stores), the engine's block for this row
//   args struct    the parameters as the engine's kernel takes them (KvWriteArgs by value)
//   full resolve   the engine's slot resolution (the SWA table and the pool bound)
//   slot first     the slot loaded and checked before the row loads are issued (two
//                  dependent round trips; Triton's kernel of the same semantics does this)
//   pdl wait       griddepcontrol.wait and launch_dependents in a launch without PDL, as
//                  the KV writes ran before they were built twice (kernels/common/gpu.h,
//                  pdl_handshake)
// and, launched with programmatic dependent launch (the engine's launch on sm_90):
//   pdl            the plain kernel with the wait, then launch_dependents
//   pdl, trigger first   launch_dependents before the wait (what pdl_handshake does):
//                  the next call's launch overlaps this one's wait as well
//
// Timed as bench_kv_write times: 100 calls captured in one CUDA graph, the median over
// rounds, us per call. Before timing, each variant's cache bytes are compared with the
// engine kernel's (the run fails on a difference). A benchmark, not a test: it prints
// figures.
//
//   bench_kv_write_probe [--rounds N]
#include "kernels/common/gpu.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/common/gpu_bench.cuh"
#include "kernels/common/fp8_convert.cuh"
#include "kernels/kv_write/kv_write.cuh"

namespace {

using namespace kvfuse;
using namespace kvfuse::bench;

constexpr int kHeads = 8, kHeadDim = 128, kRow = kHeads * kHeadDim, kPage = 16;
constexpr int64_t kSlots = 131072;
constexpr int kGraphCalls = 100;

struct Probe {
  int threads = 128;  // per token row: 128 (8 elements a thread) or 64 (16)
  bool nc = false, args_struct = false, full_resolve = false, slot_first = false, pdl_wait = false;
  bool trigger_first = false;  // with pdl_wait: launch_dependents before the wait
  bool launch_pdl = false;     // launched with the programmatic-serialization attribute
};

template <int E, bool kNc>
KVFUSE_DEVICE void load_row(const uint16_t* p, uint4 (&r)[E / 8]) {
#pragma unroll
  for (int i = 0; i < E / 8; ++i)
    r[i] = kNc ? gpu::load_ro_16B(p + 8 * i) : *reinterpret_cast<const uint4*>(p + 8 * i);
}

template <int E>
KVFUSE_DEVICE void store_row(uint8_t* dst, const uint4 (&r)[E / 8], float inv) {
  uint32_t w[E / 4];
#pragma unroll
  for (int i = 0; i < E / 8; ++i) {
    const uint32_t in[4] = {r[i].x, r[i].y, r[i].z, r[i].w};
    float x[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[2 * j] = __uint_as_float(in[j] << 16) * inv;
      x[2 * j + 1] = __uint_as_float(in[j] & 0xffff0000u) * inv;
    }
    w[2 * i] = gpu::cvt_fp8x4<Fp8Format::e4m3fn>(x[0], x[1], x[2], x[3]);
    w[2 * i + 1] = gpu::cvt_fp8x4<Fp8Format::e4m3fn>(x[4], x[5], x[6], x[7]);
  }
  if constexpr (E == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// One token row per block; E elements of K and of V per thread.
template <int E, bool kNc, bool kFullResolve, bool kSlotFirst, bool kPdl, bool kTriggerFirst>
KVFUSE_DEVICE void probe_body(const uint16_t* k, const uint16_t* v, int64_t stride, const int64_t* slots,
                              SwaSlotTable swa, int64_t num_slots, uint8_t* kc, uint8_t* vc,
                              const float* inv_k, const float* inv_v) {
  if constexpr (kPdl && kTriggerFirst) gpu::launch_dependents();
  if constexpr (kPdl) gpu::grid_dependency_wait();
  if constexpr (kPdl && !kTriggerFirst) gpu::launch_dependents();
  const int64_t t = blockIdx.x;
  const int e0 = int(threadIdx.x) * E;
  int64_t slot = 0;
  if constexpr (kSlotFirst) {
    slot = slots[t];
    if (slot < 0) return;
  }
  uint4 kr[E / 8], vr[E / 8];
  load_row<E, kNc>(k + t * stride + e0, kr);
  load_row<E, kNc>(v + t * stride + e0, vr);
  if constexpr (!kSlotFirst) slot = slots[t];
  const float ik = *inv_k, iv = *inv_v;
  if constexpr (kFullResolve) {
    slot = resolve_write_slot(slot, swa, num_slots);
  }
  if (slot < 0) return;
  store_row<E>(kc + slot * kRow + e0, kr, ik);
  store_row<E>(vc + slot * kRow + e0, vr, iv);
}

template <int E, bool kNc, bool kFullResolve, bool kSlotFirst, bool kPdl, bool kTriggerFirst>
__global__ void probe_scalars(const uint16_t* k, const uint16_t* v, int64_t stride, const int64_t* slots,
                              uint8_t* kc, uint8_t* vc, const float* inv_k, const float* inv_v) {
  probe_body<E, kNc, kFullResolve, kSlotFirst, kPdl, kTriggerFirst>(k, v, stride, slots, SwaSlotTable{},
                                                                    kSlots, kc, vc, inv_k, inv_v);
}

template <int E, bool kNc, bool kFullResolve, bool kSlotFirst, bool kPdl, bool kTriggerFirst>
__global__ void probe_args(KvWriteArgs a) {
  probe_body<E, kNc, kFullResolve, kSlotFirst, kPdl, kTriggerFirst>(
      static_cast<const uint16_t*>(a.k), static_cast<const uint16_t*>(a.v), a.k_token_stride, a.slot_mapping,
      a.swa, a.cache.num_slots(), static_cast<uint8_t*>(a.cache.k), static_cast<uint8_t*>(a.cache.v),
      a.cache.k_inv_scale, a.cache.v_inv_scale);
}

template <int E, bool kNc, bool kFullResolve, bool kSlotFirst, bool kPdl, bool kTriggerFirst>
void launch_probe(const Probe& p, const KvWriteArgs& a, cudaStream_t s) {
  const unsigned threads = unsigned(kRow / E);
  if (p.args_struct) {
    BENCH_GPU(gpu::launch_kernel(probe_args<E, kNc, kFullResolve, kSlotFirst, kPdl, kTriggerFirst>,
                                 unsigned(a.num_tokens), threads, s, p.launch_pdl, a));
  } else {
    BENCH_GPU(gpu::launch_kernel(probe_scalars<E, kNc, kFullResolve, kSlotFirst, kPdl, kTriggerFirst>,
                                 unsigned(a.num_tokens), threads, s, p.launch_pdl,
                                 static_cast<const uint16_t*>(a.k), static_cast<const uint16_t*>(a.v),
                                 a.k_token_stride, a.slot_mapping, static_cast<uint8_t*>(a.cache.k),
                                 static_cast<uint8_t*>(a.cache.v), a.cache.k_inv_scale, a.cache.v_inv_scale));
  }
}

// Compile-time dispatch of the probe's switches.
template <int E, bool... kFlags>
void dispatch(const Probe& p, const KvWriteArgs& a, cudaStream_t s) {
  constexpr size_t n = sizeof...(kFlags);
  if constexpr (n == 5) {
    launch_probe<E, kFlags...>(p, a, s);
  } else {
    const bool flag = n == 0   ? p.nc
                      : n == 1 ? p.full_resolve
                      : n == 2 ? p.slot_first
                      : n == 3 ? p.pdl_wait
                               : p.trigger_first;
    if (flag) {
      dispatch<E, kFlags..., true>(p, a, s);
    } else {
      dispatch<E, kFlags..., false>(p, a, s);
    }
  }
}

void call_probe(const Probe& p, const KvWriteArgs& a, cudaStream_t s) {
  if (p.threads == 64) {
    dispatch<16>(p, a, s);
  } else {
    dispatch<8>(p, a, s);
  }
}

}  // namespace

int main(int argc, char** argv) {
  KernelBench kb;
  if (auto rc = start_kernel_bench(argc, argv, {"bench_kv_write_probe", 15, false}, "", kb)) return *rc;
  std::printf(
      "shape: one token, %d KV heads x %d, bf16 source, e4m3fn cache (page %d), %lld slots; graph replay of "
      "%d calls, median of %d rounds\n",
      kHeads, kHeadDim, kPage, (long long)kSlots, kGraphCalls, kb.args.rounds);
  const int64_t T = 1;
  void *k, *v, *kc, *vc;
  int64_t* slots;
  float* scales;
  BENCH_GPU(cudaMalloc(&k, kRow * 2));
  BENCH_GPU(cudaMalloc(&v, kRow * 2));
  BENCH_GPU(cudaMalloc(&kc, size_t(kSlots) * kRow));
  BENCH_GPU(cudaMalloc(&vc, size_t(kSlots) * kRow));
  BENCH_GPU(cudaMalloc(&slots, sizeof(int64_t)));
  BENCH_GPU(cudaMalloc(&scales, 4 * sizeof(float)));
  std::vector<uint16_t> hk(kRow), hv(kRow);
  uint32_t seed = 12345;
  for (int i = 0; i < kRow; ++i) {
    seed = seed * 1664525u + 1013904223u;
    hk[size_t(i)] = f32_to_bf16(float(int(seed >> 8) % 2001 - 1000) / 300.0f);
    seed = seed * 1664525u + 1013904223u;
    hv[size_t(i)] = f32_to_bf16(float(int(seed >> 8) % 2001 - 1000) / 90.0f);
  }
  const int64_t slot = 77777;
  // k_scale 0.37, v_scale 2.9 and their fp32 reciprocals, as the pool keeps them.
  const float hs[4] = {0.37f, 2.9f, 1.0f / 0.37f, 1.0f / 2.9f};
  BENCH_GPU(cudaMemcpy(k, hk.data(), kRow * 2, cudaMemcpyHostToDevice));
  BENCH_GPU(cudaMemcpy(v, hv.data(), kRow * 2, cudaMemcpyHostToDevice));
  BENCH_GPU(cudaMemcpy(slots, &slot, sizeof slot, cudaMemcpyHostToDevice));
  BENCH_GPU(cudaMemcpy(scales, hs, sizeof hs, cudaMemcpyHostToDevice));

  KvWriteArgs a;
  a.k = k;
  a.v = v;
  a.k_token_stride = a.v_token_stride = kRow;
  a.num_tokens = T;
  a.slot_mapping = slots;
  a.cache.k = kc;
  a.cache.v = vc;
  a.cache.num_pages = kSlots / kPage;
  a.cache.page_size = kPage;
  a.cache.num_kv_heads = kHeads;
  a.cache.head_dim = kHeadDim;
  a.cache.format = KvFormat::fp8_e4m3fn;
  a.cache.k_scale = scales;
  a.cache.v_scale = scales + 1;
  a.cache.k_inv_scale = scales + 2;
  a.cache.v_inv_scale = scales + 3;

  GpuTimer timer;
  cudaStream_t s = timer.stream();
  auto row_bytes = [&] {
    std::vector<uint8_t> out(2 * kRow);
    BENCH_GPU(cudaStreamSynchronize(s));
    BENCH_GPU(cudaMemcpy(out.data(), static_cast<uint8_t*>(kc) + slot * kRow, kRow, cudaMemcpyDeviceToHost));
    BENCH_GPU(
        cudaMemcpy(out.data() + kRow, static_cast<uint8_t*>(vc) + slot * kRow, kRow, cudaMemcpyDeviceToHost));
    BENCH_GPU(cudaMemset(kc, 0, size_t(kSlots) * kRow));
    BENCH_GPU(cudaMemset(vc, 0, size_t(kSlots) * kRow));
    return out;
  };
  gpu::KvWriteLaunch engine;  // the engine's launch options, first without PDL
  engine.pdl = false;
  BENCH_GPU(gpu::launch_kv_write_fused(a, s, engine));
  const std::vector<uint8_t> want = row_bytes();

  struct Row {
    std::string name;
    Probe p;
  };
  std::vector<Row> rows = {{"plain", {}},
                           {"nc loads", {128, true}},
                           {"64 threads", {64}},
                           {"args struct", {128, false, true}},
                           {"full resolve", {128, false, false, true}},
                           {"slot first", {128, false, false, false, true}},
                           {"pdl wait", {128, false, false, false, false, true}},
                           {"all but slot first", {64, true, true, true, false, true}},
                           {"pdl", {128, false, false, false, false, true, false, true}},
                           {"pdl, trigger first", {128, false, false, false, false, true, true, true}},
                           {"pdl, nc loads", {128, true, false, false, false, true, false, true}},
                           {"pdl, 64 threads", {64, false, false, false, false, true, false, true}}};
  int status = 0;
  std::printf("%-28s %10s  %s\n", "kernel", "us/call", "bytes");
  const double us_engine =
      timer.graph_us([&](cudaStream_t st) { BENCH_GPU(gpu::launch_kv_write_fused(a, st, engine)); },
                     kGraphCalls, kb.args.rounds);
  std::printf("%-28s %10.3f  %s\n", "engine (launch_kv_write_fused)", us_engine, "reference");
  gpu::KvWriteLaunch engine_pdl = engine;
  engine_pdl.pdl = true;
  const double us_engine_pdl =
      timer.graph_us([&](cudaStream_t st) { BENCH_GPU(gpu::launch_kv_write_fused(a, st, engine_pdl)); },
                     kGraphCalls, kb.args.rounds);
  std::printf("%-28s %10.3f  %s\n", "engine, pdl", us_engine_pdl, "");
  for (const Row& r : rows) {
    call_probe(r.p, a, s);
    const bool same = row_bytes() == want;
    status |= same ? 0 : 1;
    const double us =
        timer.graph_us([&](cudaStream_t st) { call_probe(r.p, a, st); }, kGraphCalls, kb.args.rounds);
    std::printf("%-28s %10.3f  %s\n", r.name.c_str(), us, same ? "equal" : "DIFFER");
  }
  BENCH_GPU(cudaFree(k));
  BENCH_GPU(cudaFree(v));
  BENCH_GPU(cudaFree(kc));
  BENCH_GPU(cudaFree(vc));
  BENCH_GPU(cudaFree(slots));
  BENCH_GPU(cudaFree(scales));
  return status;
}
