// Integer arithmetic kvfuse's host code shares.
#pragma once

#include <cstdint>

namespace kvfuse {

// a / b rounded up, for a >= 0 and b > 0: pages for a number of tokens, blocks for a grid.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a rounded up to a multiple of b (a >= 0, b > 0): padded sizes and aligned byte counts.
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// splitmix64 of x: every input bit moves every output bit (the synthetic weights' stream,
// the prefix cache's chain hash).
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace kvfuse
