// KvStorage (src/runtime/kv/kv_storage.h) on its own, on the CPU backend: the per-layer
// buffers (zeroed, sized by each layer's pool), the views and the scales with their
// reciprocals, the device copy of the SWA table and its uploads a run of pages at a
// time, and failed allocations given back.
#include "tests/util/catch.h"

#include <cstring>
#include <memory>
#include <vector>

#include "src/runtime/kv/kv_storage.h"
#include "tests/kv/kv_view_checks.h"
#include "tests/util/forwarding_backend.h"

namespace {

using namespace kvfuse;

// The CPU backend, counting: fresh memory is filled with 0xa5 (so zeroing shows), copies
// to the device are counted, and allocations can be made to fail after a number of them.
class CountingBackend final : public testing::ForwardingBackend {
 public:
  CountingBackend() : ForwardingBackend(make_cpu_backend()) {}
  int64_t live_allocs = 0;
  int64_t allocs_done = 0;
  int64_t fail_alloc_after = -1;
  int64_t copies = 0;
  int64_t copied_bytes = 0;
  std::vector<size_t> alloc_sizes;

  absl::StatusOr<DeviceBuffer> alloc(size_t bytes) override {
    if (fail_alloc_after >= 0 && allocs_done >= fail_alloc_after)
      return absl::ResourceExhaustedError("test: out of memory");
    ++allocs_done;
    absl::StatusOr<DeviceBuffer> buf = ForwardingBackend::alloc(bytes);
    if (!buf.ok()) return buf.status();
    std::memset(buf->get(), 0xa5, bytes);
    ++live_allocs;
    alloc_sizes.push_back(bytes);
    auto held = std::make_shared<DeviceBuffer>(*std::move(buf));
    void* p = held->get();
    return DeviceBuffer(p, bytes, [this, held](void*) {
      held->reset();
      --live_allocs;
    });
  }
  absl::Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    ++copies;
    copied_bytes += int64_t(bytes);
    return ForwardingBackend::copy_to_device(dst, src, bytes);
  }
};

KvPoolConfig make_cfg() {
  KvPoolConfig c;
  c.num_layers = 3;
  c.page_size = 4;
  c.num_pages = 12;
  c.swa_num_pages = 5;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.format = KvFormat::bf16;
  c.layer_is_swa = {false, true, false};
  c.window = 8;
  c.k_scale = {0.5f, 2.0f, 3.0f};
  c.v_scale = {0.25f, 4.0f, 5.0f};
  return c;
}

std::unique_ptr<KvStorage> make_storage(Backend& be, const KvPoolConfig& c,
                                        const std::vector<int64_t>* table) {
  absl::StatusOr<std::unique_ptr<KvStorage>> st = KvStorage::create(be, c, table);
  INFO(st.status().ToString());
  REQUIRE(st.ok());
  return *std::move(st);
}

}  // namespace

TEST_CASE("kv storage: zeroed buffers per layer, views and scales with their reciprocals", "[kv_pool]") {
  CountingBackend be;
  const KvPoolConfig c = make_cfg();
  {
    auto st = make_storage(be, c, nullptr);
    CHECK(&st->backend() == &be);
    const int64_t page_bytes = 4 * 2 * 8 * 2;  // page_size * heads * head_dim * bf16
    CHECK(st->page_bytes() == page_bytes);
    for (int32_t l = 0; l < 3; ++l) {
      CAPTURE(l);
      const PagedKvView v = st->layer_view(l);
      test::check_fresh_view(v, {l == 1 ? 5 : 12, 4, 2, 8, KvFormat::bf16}, page_bytes);
      CHECK(*v.k_scale == c.k_scale[size_t(l)]);
      CHECK(*v.v_scale == c.v_scale[size_t(l)]);
      CHECK(*v.k_inv_scale == 1.0f / c.k_scale[size_t(l)]);
      CHECK(*v.v_inv_scale == 1.0f / c.v_scale[size_t(l)]);
    }
    // Two buffers per layer and the scales; no SWA table without one.
    CHECK(be.alloc_sizes == std::vector<size_t>{12 * page_bytes, 12 * page_bytes, 5 * page_bytes,
                                                5 * page_bytes, 12 * page_bytes, 12 * page_bytes,
                                                4 * 3 * sizeof(float)});
    CHECK(st->swa_table().full_to_swa == nullptr);
    CHECK(st->swa_table().size == 0);

    const int64_t copies = be.copies;
    volatile float third = 3.0f;  // not folded: the division at run time, as the storage's
    REQUIRE(st->write_scales(1, third, 0.125f).ok());
    CHECK(be.copies - copies == 4);  // k, v and the two reciprocals
    CHECK(*st->layer_view(1).k_scale == 3.0f);
    CHECK(*st->layer_view(1).v_scale == 0.125f);
    CHECK(*st->layer_view(1).k_inv_scale == 1.0f / third);
    CHECK(*st->layer_view(1).v_inv_scale == 8.0f);
    CHECK(*st->layer_view(0).k_scale == 0.5f);  // neighbours untouched
    CHECK(*st->layer_view(2).v_inv_scale == 1.0f / 5.0f);
  }
  CHECK(be.live_allocs == 0);
}

TEST_CASE("kv storage swa: the device table starts as the host's and uploads runs of changed pages",
          "[kv_pool][swa]") {
  CountingBackend be;
  const KvPoolConfig c = make_cfg();
  const int64_t ps = c.page_size;
  std::vector<int64_t> host(size_t(c.num_pages * ps), -1);
  for (int64_t o = 0; o < ps; ++o) host[size_t(2 * ps + o)] = 3 * ps + o;  // full page 2 -> SWA page 3
  auto st = make_storage(be, c, &host);
  const SwaSlotTable t = st->swa_table();
  REQUIRE(t.size == int64_t(host.size()));
  CHECK(std::memcmp(t.full_to_swa, host.data(), host.size() * sizeof(int64_t)) == 0);
  CHECK(be.alloc_sizes.back() == host.size() * sizeof(int64_t));

  // Change pages 1, 2, 3, 7, 9 and 10 on the host, and one more (5) not announced.
  for (int32_t page : {1, 2, 3, 5, 7, 9, 10}) {
    for (int64_t o = 0; o < ps; ++o) host[size_t(page * ps + o)] = int64_t(page % 5) * ps + o;
  }
  const int64_t copies = be.copies, bytes = be.copied_bytes;
  REQUIRE(st->upload_swa_pages(host, {1, 2, 3, 7, 9, 10}).ok());
  CHECK(be.copies - copies == 3);  // runs 1-3, 7, 9-10
  CHECK(be.copied_bytes - bytes == 6 * ps * int64_t(sizeof(int64_t)));
  for (int32_t page = 0; page < c.num_pages; ++page) {
    CAPTURE(page);
    const bool same = std::memcmp(t.full_to_swa + page * ps, host.data() + page * ps, size_t(ps) * 8) == 0;
    CHECK(same == (page != 5));  // exactly the announced pages were uploaded
  }
  REQUIRE(st->upload_swa_pages(host, {}).ok());
  CHECK(be.copies - copies == 3);
  REQUIRE(st->upload_swa_pages(host, {5}).ok());
  CHECK(std::memcmp(t.full_to_swa, host.data(), host.size() * sizeof(int64_t)) == 0);
}

TEST_CASE("kv storage: a failed allocation is returned and what was allocated given back", "[kv_pool]") {
  CountingBackend be;
  const KvPoolConfig c = make_cfg();
  const std::vector<int64_t> host(size_t(c.num_pages * c.page_size), -1);
  // 6 buffers, the scales, the SWA table: each allocation in turn fails.
  for (int64_t n = 0; n < 8; ++n) {
    CAPTURE(n);
    be.fail_alloc_after = be.allocs_done + n;
    CHECK(KvStorage::create(be, c, &host).status().code() == absl::StatusCode::kResourceExhausted);
    CHECK(be.live_allocs == 0);
  }
  be.fail_alloc_after = be.allocs_done + 8;
  CHECK(KvStorage::create(be, c, &host).ok());
  CHECK(be.live_allocs == 0);
}
