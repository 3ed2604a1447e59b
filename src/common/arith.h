// Integer arithmetic kvfuse's host code shares.
#pragma once

#include <cstdint>

namespace kvfuse {

// a / b rounded up, for a >= 0 and b > 0: pages for a number of tokens, blocks for a grid.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a rounded up to a multiple of b (a >= 0, b > 0): padded sizes and aligned byte counts.
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace kvfuse
