// Names of enums whose values run 0, 1, 2, ...: one table per enum, read by value, so
// adding a value is one word in one place (and a value past the table reads "?").
#pragma once

#include <cstddef>
#include <type_traits>

namespace kvfuse {

template <class E, size_t N>
constexpr const char* enum_name(E value, const char* const (&names)[N]) {
  // Through an unsigned type: a negative value wraps past the table and reads "?".
  const auto i = static_cast<std::make_unsigned_t<std::underlying_type_t<E>>>(value);
  return size_t(i) < N ? names[size_t(i)] : "?";
}

}  // namespace kvfuse
