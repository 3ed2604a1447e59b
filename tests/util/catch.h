// Catch2 for the tests, whichever major version the system ships: v2 (Debian 12, a
// single header) or v3 (newer distributions, e.g. the ROCm images' Ubuntu 24.04).
#pragma once

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
using Catch::Approx;
#else
#include <catch2/catch.hpp>
// v3's name for the substring matcher; v2 spells it Contains (which v3 removed). Tests
// use the v3 spelling.
namespace Catch::Matchers {
inline StdString::ContainsMatcher ContainsSubstring(const std::string& s,
                                                    CaseSensitive::Choice cs = CaseSensitive::Yes) {
  return Contains(s, cs);
}
}  // namespace Catch::Matchers
#endif
