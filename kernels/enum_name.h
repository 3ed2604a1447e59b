// Names of enums whose values run 0, 1, 2, ...: one table per enum, read by value, so
// adding a value is one word in one place (and a value past the table reads "?").
#pragma once

#include <cstddef>
#include <type_traits>

namespace kvfuse {

template <class E, size_t N>
constexpr const char* enum_name(E value, const char* const (&names)[N]) {
  using U = std::underlying_type_t<E>;
  const U i = static_cast<U>(value);
  if constexpr (std::is_signed_v<U>) {
    if (i < 0) return "?";
  }
  return size_t(i) < N ? names[size_t(i)] : "?";
}

}  // namespace kvfuse
