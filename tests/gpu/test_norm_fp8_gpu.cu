// The RMSNorm that quantizes its output for an FP8 W8A8 projection (kernels/ops/norm_fp8.cuh)
// against the two launches it replaces: launch_rmsnorm or launch_add_rmsnorm, then
// launch_quantize_rows_fp8 on the norm's output (whose bytes tests/gpu/test_gemv_fp8_gpu.cu
// checks against the CPU's quantize_rows_fp8). Everything must be the same bits: the
// residual x after the add, the bf16 out, the codes and the row scales; for e4m3fn and
// e4m3fnuz, static and dynamic scales, with and without the add (out aliasing y, as the
// model runs it), rows of one chunk per thread up to the vector path's 8192 columns, and
// rows whose norm is zero, NaN or saturates a static scale. The refusals too.
#include "kernels/common/gpu.h"

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/fp8.h"
#include "kernels/gemm/gemv_fp8.cuh"
#include "kernels/ops/model_ops.cuh"
#include "kernels/ops/norm_fp8.cuh"
#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using gpu_test::check;
using gpu_test::DeviceMem;

const char* fmt_name(Fp8Format f) { return f == Fp8Format::e4m3fnuz ? "e4m3fnuz" : "e4m3fn"; }

// Rows by kind (row % 5): random of magnitude 1, 1e-3 or 50; all zero (the norm's output
// is zero: the smallest scale), or with zero_rows false a single 0.5; a NaN (the row's output
// all NaN: codes NaN, amax 0).
std::vector<bf16_t> rows_of(int64_t rows, int64_t cols, uint64_t seed, bool zero_rows) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const float mags[3] = {1.0f, 1e-3f, 50.0f};
  std::vector<bf16_t> x(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    const int kind = int(i % 5);
    for (int64_t c = 0; c < cols; ++c) {
      x[size_t(i * cols + c)] = kind < 3 ? f32_to_bf16(unit(rng) * mags[kind]) : bf16_t(0);
    }
    if (kind == 3 && !zero_rows) x[size_t(i * cols)] = f32_to_bf16(0.5f);
    if (kind == 4) x[size_t(i * cols + cols / 2)] = 0x7fc0;
  }
  return x;
}

void run_case(int64_t rows, int64_t cols, bool add, Fp8Act act, float static_scale, Fp8Format fmt, uint64_t seed,
              cudaStream_t stream) {
  const std::string what = std::string("rmsnorm_fp8 ") + std::to_string(rows) + "x" + std::to_string(cols) +
                           (add ? " add " : " ") + (act == Fp8Act::dynamic_token ? "dynamic" : "static") + " " +
                           fmt_name(fmt) + " scale " + std::to_string(static_scale);
  // x's zero rows stay zero without the add; with it, y's one value makes them one-hot.
  const std::vector<bf16_t> x = rows_of(rows, cols, seed, true);
  const std::vector<bf16_t> y = rows_of(rows, cols, seed + 1000, false);
  std::vector<bf16_t> w(static_cast<size_t>(cols));
  std::mt19937_64 rng(seed + 7);
  std::uniform_real_distribution<float> near1(0.5f, 1.5f);
  for (bf16_t& v : w) v = f32_to_bf16(near1(rng));
  const size_t bytes = x.size() * 2;
  DeviceMem x1(bytes), y1(bytes), o1(bytes), q1(x.size()), s1(size_t(rows) * 4);
  DeviceMem x2(bytes), y2(bytes), o2(bytes), q2(x.size()), s2(size_t(rows) * 4);
  DeviceMem dw(w.size() * 2), dss(4);
  for (DeviceMem* d : {&x1, &x2}) d->upload(x.data(), bytes);
  for (DeviceMem* d : {&y1, &y2}) d->upload(y.data(), bytes);
  dw.upload(w.data(), w.size() * 2);
  dss.upload(&static_scale, 4);
  KVFUSE_TEST_GPU(cudaMemsetAsync(q1.get(), 0x5a, x.size(), stream));
  KVFUSE_TEST_GPU(cudaMemsetAsync(q2.get(), 0xa5, x.size(), stream));
  const float eps = 1e-5f;
  // The fused kernel: with the add, out is y (the model's h).
  bf16_t* out1 = add ? y1.get<bf16_t>() : o1.get<bf16_t>();
  const gpu::LaunchStatus st =
      gpu::launch_rmsnorm_fp8(x1.get<bf16_t>(), add ? y1.get<bf16_t>() : nullptr, dw.get<bf16_t>(), rows, cols, eps,
                              out1, act, dss.get<float>(), fmt, q1.get<uint8_t>(), s1.get<float>(), stream, true);
  check(st.ok(), what + ": " + st.message());
  // The two launches it replaces.
  bf16_t* out2 = add ? y2.get<bf16_t>() : o2.get<bf16_t>();
  if (add) {
    KVFUSE_TEST_GPU(gpu::launch_add_rmsnorm(x2.get<bf16_t>(), y2.get<bf16_t>(), dw.get<bf16_t>(), rows, cols, eps,
                                            out2, stream));
  } else {
    KVFUSE_TEST_GPU(gpu::launch_rmsnorm(x2.get<bf16_t>(), dw.get<bf16_t>(), rows, cols, eps, out2, stream));
  }
  const gpu::LaunchStatus sq = gpu::launch_quantize_rows_fp8(out2, rows, cols, act, dss.get<float>(), fmt,
                                                             q2.get<uint8_t>(), s2.get<float>(), stream);
  check(sq.ok(), what + ": quantize: " + sq.message());
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
  check(x1.download<bf16_t>(x.size()) == x2.download<bf16_t>(x.size()), what + ": the residual x differs");
  const DeviceMem& od1 = add ? y1 : o1;
  const DeviceMem& od2 = add ? y2 : o2;
  check(od1.download<bf16_t>(x.size()) == od2.download<bf16_t>(x.size()), what + ": the norm's out differs");
  const std::vector<uint8_t> c1 = q1.download<uint8_t>(x.size()), c2 = q2.download<uint8_t>(x.size());
  int64_t bad = 0;
  for (size_t e = 0; e < c1.size(); ++e) bad += c1[e] != c2[e];
  check(bad == 0, what + ": " + std::to_string(bad) + " codes differ from launch_quantize_rows_fp8's");
  const std::vector<float> g1 = s1.download<float>(size_t(rows)), g2 = s2.download<float>(size_t(rows));
  check(std::memcmp(g1.data(), g2.data(), g1.size() * 4) == 0, what + ": the row scales differ");
}

void test_refusals(cudaStream_t stream) {
  DeviceMem a(1 << 16), b(1 << 16), w(1 << 15), q(1 << 16), s(1 << 10);
  bf16_t* x = a.get<bf16_t>();
  const auto launch = [&](int64_t cols, Fp8Act act, const float* ss, uint8_t* xq, const bf16_t* y = nullptr) {
    return gpu::launch_rmsnorm_fp8(x, y, w.get<bf16_t>(), 2, cols, 1e-5f, b.get<bf16_t>(), act, ss,
                                   Fp8Format::e4m3fn, xq, s.get<float>(), stream)
        .ok();
  };
  uint8_t* xq = q.get<uint8_t>();
  const float* ss = s.get<float>();
  check(!launch(12, Fp8Act::dynamic_token, nullptr, xq), "rmsnorm_fp8: cols 12 refused");
  check(!launch(8200, Fp8Act::dynamic_token, nullptr, xq), "rmsnorm_fp8: cols 8200 (past the vector path) refused");
  check(!launch(64, Fp8Act::none, nullptr, xq), "rmsnorm_fp8: act none refused");
  check(!launch(64, Fp8Act::static_tensor, nullptr, xq), "rmsnorm_fp8: static without its scale refused");
  check(!launch(64, Fp8Act::dynamic_token, nullptr, xq + 4), "rmsnorm_fp8: xq not 8-byte aligned refused");
  check(!launch(64, Fp8Act::dynamic_token, nullptr, xq, x + 1), "rmsnorm_fp8: y not 16-byte aligned refused");
  check(launch(64, Fp8Act::static_tensor, ss, xq), "rmsnorm_fp8: 2 x 64 static accepted");
  KVFUSE_TEST_GPU(cudaStreamSynchronize(stream));
}

}  // namespace

int main() {
  if (!gpu_test::gpu_available("test_norm_fp8_gpu")) return 0;
  const bool quick = gpu_test::quick();
  cudaStream_t stream;
  KVFUSE_TEST_GPU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  test_refusals(stream);
  uint64_t seed = 1;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 8}, {3, 64}, {5, 2056}, {8, 4096}, {40, 4096},
                                                           {2, 8192}};
  for (const Fp8Format fmt : {Fp8Format::e4m3fn, Fp8Format::e4m3fnuz}) {
    for (const auto& [rows, cols] : shapes) {
      if (quick && rows == 40) continue;
      for (const bool add : {false, true}) {
        run_case(rows, cols, add, Fp8Act::dynamic_token, 1.0f, fmt, ++seed, stream);
        // A scale that keeps the values in range, and one that saturates most of them.
        for (const float ss : {0.01f, 1e-4f}) run_case(rows, cols, add, Fp8Act::static_tensor, ss, fmt, ++seed, stream);
      }
    }
  }
  KVFUSE_TEST_GPU(cudaStreamDestroy(stream));
  return gpu_test::tally().report("test_norm_fp8_gpu");
}
