// Checks of a freshly created layer view shared by the KV pool's tests: its geometry as
// configured and its K and V buffers all zero bytes (a new pool holds no stale KV).
#pragma once

#include <cstdint>

#include "kernels/common/kv_types.h"
#include "tests/util/catch.h"

namespace kvfuse::test {

struct ViewShape {
  int64_t num_pages;
  int32_t page_size;
  int32_t num_kv_heads;
  int32_t head_dim;
  KvFormat format;
};

inline void check_fresh_view(const PagedKvView& v, const ViewShape& want, int64_t page_bytes) {
  CHECK(v.num_pages == want.num_pages);
  CHECK(v.page_size == want.page_size);
  CHECK(v.num_kv_heads == want.num_kv_heads);
  CHECK(v.head_dim == want.head_dim);
  CHECK(v.format == want.format);
  CHECK(v.k != v.v);
  for (void* buf : {v.k, v.v}) {
    const auto* bytes = static_cast<const unsigned char*>(buf);
    int64_t nonzero = 0;
    for (int64_t i = 0; i < v.num_pages * page_bytes; ++i) nonzero += bytes[i] != 0;
    CHECK(nonzero == 0);
  }
}

}  // namespace kvfuse::test
