// Uniform random bf16 values for the CPU kernel tests: n values on [lo, hi), from `seed`.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/common/bf16.h"

namespace kvfuse::testing {

inline std::vector<bf16_t> random_bf16(size_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(lo, hi);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(uni(rng));
  return v;
}

}  // namespace kvfuse::testing
