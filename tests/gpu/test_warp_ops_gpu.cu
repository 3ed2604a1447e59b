// The cross-lane helpers of kernels/common/gpu.h on the device (shuffles on NVIDIA, DPP on
// AMD CDNA), lane by lane, against host sums, maxima and scans of the same values:
// - warp_reduce_sum of integer-valued floats (exact in any order) and of u64 values that
//   carry across 32-bit words: equal to the host's; of random floats: every lane the same
//   bits, within log2(kWarpSize) * u * sum|x| of the exact sum (gpu.h's bound);
// - warp_reduce_max and warp_reduce of a (value, index) pair with argmax's merge: the
//   host's maximum and the lowest index among ties, in every lane;
// - warp_inclusive_sum of u64 values: lane i gets the sum of lanes 0..i, exactly.
// Two warps per block, so that each warp is seen to reduce only its own lanes.
// Also launch_kernel's errors: a launch the runtime refuses (more threads than a block may
// have), with and without PDL, returns its error and leaves none behind for the next
// launch, which succeeds.
#include "kernels/common/gpu.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/gpu/gpu_test_util.h"

namespace {

using namespace kvfuse;
using gpu::kWarpSize;
using gpu_test::check;

constexpr int kWarps = 2;
constexpr int kLanes = kWarps * kWarpSize;

struct ArgMax {
  float v;
  int32_t i;
};

struct LaneOut {
  float sum;
  float max;
  float arg_v;
  int32_t arg_i;
  unsigned long long usum;
  unsigned long long scan;
};

__device__ ArgMax merge(ArgMax a, ArgMax b) { return b.v > a.v || (b.v == a.v && b.i < a.i) ? b : a; }

__global__ void warp_ops_kernel(const float* x, const float* av, const int32_t* ai,
                                const unsigned long long* u, LaneOut* out) {
  const int t = int(threadIdx.x);
  LaneOut o;
  o.sum = gpu::warp_reduce_sum(x[t]);
  o.max = gpu::warp_reduce_max(x[t]);
  const ArgMax m = gpu::warp_reduce(ArgMax{av[t], ai[t]}, [](ArgMax a, ArgMax b) { return merge(a, b); });
  o.arg_v = m.v;
  o.arg_i = m.i;
  o.usum = gpu::warp_reduce_sum(u[t]);
  o.scan = gpu::warp_inclusive_sum(u[t]);
  out[t] = o;
}

struct Inputs {
  std::vector<float> x = std::vector<float>(kLanes);
  std::vector<float> av = std::vector<float>(kLanes);
  std::vector<int32_t> ai = std::vector<int32_t>(kLanes);
  std::vector<unsigned long long> u = std::vector<unsigned long long>(kLanes);
};

std::vector<LaneOut> run(const Inputs& in) {
  gpu_test::DeviceMem x(kLanes * sizeof(float)), av(kLanes * sizeof(float)), ai(kLanes * sizeof(int32_t)),
      u(kLanes * sizeof(unsigned long long)), out(kLanes * sizeof(LaneOut));
  x.upload(in.x.data(), kLanes * sizeof(float));
  av.upload(in.av.data(), kLanes * sizeof(float));
  ai.upload(in.ai.data(), kLanes * sizeof(int32_t));
  u.upload(in.u.data(), kLanes * sizeof(unsigned long long));
  KVFUSE_TEST_GPU(gpu::launch_kernel(warp_ops_kernel, 1, kLanes, nullptr, false, x.get<float>(),
                                     av.get<float>(), ai.get<int32_t>(), u.get<unsigned long long>(),
                                     out.get<LaneOut>()));
  KVFUSE_TEST_GPU(cudaDeviceSynchronize());
  return out.download<LaneOut>(kLanes);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// `exact_sum`: x holds values whose every partial sum is exact in fp32.
void check_case(const std::string& name, const Inputs& in, bool exact_sum) {
  const std::vector<LaneOut> got = run(in);
  for (int w = 0; w < kWarps; ++w) {
    const int first = w * kWarpSize;
    double sum = 0.0, abs_sum = 0.0;
    float max = -INFINITY;
    ArgMax best{-INFINITY, INT32_MAX};
    unsigned long long usum = 0;
    for (int l = first; l < first + kWarpSize; ++l) {
      sum += in.x[size_t(l)];
      abs_sum += std::fabs(in.x[size_t(l)]);
      max = in.x[size_t(l)] > max ? in.x[size_t(l)] : max;
      const ArgMax a{in.av[size_t(l)], in.ai[size_t(l)]};
      if (a.v > best.v || (a.v == best.v && a.i < best.i)) best = a;
      usum += in.u[size_t(l)];
    }
    const double tol = exact_sum ? 0.0 : std::log2(double(kWarpSize)) * std::ldexp(abs_sum, -24) * 1.0001;
    int bad = 0;
    unsigned long long scan = 0;
    for (int l = first; l < first + kWarpSize; ++l) {
      const LaneOut& o = got[size_t(l)];
      scan += in.u[size_t(l)];
      const bool ok = std::fabs(double(o.sum) - sum) <= tol && same_bits(o.sum, got[size_t(first)].sum) &&
                      same_bits(o.max, max) && same_bits(o.arg_v, best.v) && o.arg_i == best.i &&
                      o.usum == usum && o.scan == scan;
      if (!ok && bad++ < 4) {
        std::printf(
            "  %s warp %d lane %d: sum %.9g (want %.9g +- %.3g, lane 0 %.9g), max %g (%g), "
            "argmax %g@%d (%g@%d), usum %llu (%llu), scan %llu (%llu)\n",
            name.c_str(), w, l - first, o.sum, sum, tol, got[size_t(first)].sum, o.max, max, o.arg_v, o.arg_i,
            best.v, best.i, o.usum, usum, o.scan, scan);
      }
    }
    check(bad == 0, name + " warp " + std::to_string(w) + ": " + std::to_string(bad) + " lanes wrong");
  }
}

void test_all() {
  std::mt19937 rng(64);
  std::uniform_int_distribution<int> small(-1000, 1000);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<unsigned long long> big(0, (1ull << 40) - 1);

  // Integer-valued floats, small ties for argmax, u64 values near 2^32 (the low words
  // carry into the high ones in the sums and scans).
  Inputs in;
  for (int l = 0; l < kLanes; ++l) {
    in.x[size_t(l)] = float(small(rng));
    in.av[size_t(l)] = float(small(rng) % 4);
    in.ai[size_t(l)] = kLanes - l;  // ties resolve to the lowest index, not the lowest lane
    in.u[size_t(l)] = 0xffffffffull - unsigned(l % 3);
  }
  check_case("integers", in, true);

  // Random floats of mixed signs and magnitudes; 40-bit weights as the sampler sums them.
  for (int trial = 0; trial < 8; ++trial) {
    for (int l = 0; l < kLanes; ++l) {
      in.x[size_t(l)] = std::ldexp(normal(rng), small(rng) % 20);
      in.av[size_t(l)] = normal(rng);
      in.ai[size_t(l)] = l;
      in.u[size_t(l)] = big(rng);
    }
    check_case("random " + std::to_string(trial), in, false);
  }

  // The maximum in the first lane, in the last, tied in every lane; -inf everywhere
  // (argmax then keeps the lowest index, as the kernels' INT32_MAX start expects).
  for (int where : {0, kWarpSize - 1}) {
    for (int l = 0; l < kLanes; ++l) {
      in.x[size_t(l)] = float(l % kWarpSize == where ? 5000 : small(rng));
      in.av[size_t(l)] = l % kWarpSize == where ? 7.0f : 1.0f;
      in.ai[size_t(l)] = l;
      in.u[size_t(l)] = 0;
    }
    check_case("maximum in lane " + std::to_string(where), in, true);
  }
  for (int l = 0; l < kLanes; ++l) {
    in.x[size_t(l)] = 3.0f;
    in.av[size_t(l)] = -INFINITY;
    in.ai[size_t(l)] = 1000 + (l * 37) % kLanes;
    in.u[size_t(l)] = 1;
  }
  check_case("all tied, argmax of -inf", in, true);
}

}  // namespace

__global__ void store_kernel(int* p, int v) {
  if (threadIdx.x == 0) *p = v;
}

void test_launch_errors() {
  int* d = nullptr;
  KVFUSE_TEST_GPU(cudaMalloc(&d, sizeof(int)));
  for (bool pdl : {false, true}) {
    const std::string how = pdl ? " (pdl)" : "";
    const cudaError_t refused = gpu::launch_kernel(store_kernel, 1, 4096, nullptr, pdl, d, 1);
    check(refused != cudaSuccess, "a block of 4096 threads refused" + how);
    const cudaError_t next = gpu::launch_kernel(store_kernel, 1, 32, nullptr, false, d, 7);
    check(next == cudaSuccess, std::string("the next launch succeeds, not reporting the refusal: ") +
                                   cudaGetErrorString(next) + how);
    KVFUSE_TEST_GPU(cudaDeviceSynchronize());
    int v = 0;
    KVFUSE_TEST_GPU(cudaMemcpy(&v, d, sizeof(int), cudaMemcpyDeviceToHost));
    check(v == 7, "the next launch ran" + how);
  }
  KVFUSE_TEST_GPU(cudaFree(d));
}

int main() {
  if (gpu_test::gpu_available("test_warp_ops_gpu")) {
    test_all();
    test_launch_errors();
  }
  return gpu_test::tally().report("test_warp_ops_gpu");
}
