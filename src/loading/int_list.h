// Comma-separated integers on command lines (--batch 1,8,32, --prompt-ids 1,2,3): one
// parser for every tool. Empty items are skipped; anything else must be a whole
// integer, or the result is INVALID_ARGUMENT naming the item.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvfuse {

inline absl::StatusOr<std::vector<int32_t>> parse_int_list(const std::string& text) {
  std::vector<int32_t> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(item), &v)) {
      return absl::InvalidArgumentError(absl::StrCat("'", item, "' is not an integer"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace kvfuse
