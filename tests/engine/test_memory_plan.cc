// The device memory plan (src/runtime/memory_plan.h): the KV pool's bytes as the storage
// allocates them, pages planned from free memory less the headroom, refusals that name
// the numbers, and the engine's memory split.
#include <memory>
#include <string>
#include <utility>

#include "src/backends/cpu/cpu_backend.h"
#include "src/runtime/memory_plan.h"
#include "tests/util/engine_test_util.h"
#include "tests/util/forwarding_backend.h"

using namespace kvfuse;
using namespace kvfuse::testing;
using Catch::Matchers::ContainsSubstring;
using nlohmann::json;

namespace {

constexpr int64_t kMiB = int64_t(1) << 20;

// The CPU backend, reporting a device of the size and kind a test sets (a GPU's, say),
// whose free memory is what the test gives less what this backend holds.
class SizedBackend : public ForwardingBackend {
 public:
  SizedBackend(DeviceMemory mem, Device kind) : ForwardingBackend(make_cpu_backend()), mem_(mem), kind_(kind) {}
  Device device() const override { return kind_; }
  // Free memory falls as the backend allocates, as on a real device.
  absl::StatusOr<DeviceMemory> device_memory() override {
    return DeviceMemory{mem_.free_bytes - allocated_bytes(), mem_.total_bytes};
  }

 private:
  DeviceMemory mem_;
  Device kind_;
};

absl::StatusOr<std::unique_ptr<Engine>> sized_engine(const json& overrides, DeviceMemory mem,
                                                     Device kind = Device::cpu) {
  return Engine::create(make_config(overrides), std::make_unique<SizedBackend>(mem, kind));
}

// The pool config an engine of make_config(overrides) builds, with `pages` pages.
KvPoolConfig pool_config_of(const json& overrides, int64_t pages) {
  auto e = make_engine(overrides);
  KvPoolConfig pc = e->pool().config();
  pc.num_pages = pages;
  return pc;
}

int64_t no_swa(int64_t) { return 0; }

}  // namespace

TEST_CASE("memory plan: kv_pool_bytes is what the pool allocates", "[memory]") {
  for (bool hybrid : {false, true}) {
    for (const char* dtype : {"bf16", "fp8_e4m3"}) {
      CAPTURE(hybrid, dtype);
      json o = {{"kv_cache_dtype", dtype}, {"num_pages", 300}};
      if (hybrid) {
        o["sliding_window"] = 24;
        o["swa_layers"] = "alternate";
      }
      auto backend = make_cpu_backend();
      auto e = make_engine(o);
      const KvPoolConfig pc = e->pool().config();
      const int64_t before = backend->allocated_bytes();
      auto pool = KvPool::create(*backend, pc);
      REQUIRE(pool.ok());
      CHECK(backend->allocated_bytes() - before == kv_pool_bytes(pc));
      CHECK(e->memory().kv_pool_bytes == kv_pool_bytes(pc));
      pool->reset();
      CHECK(backend->allocated_bytes() == before);  // freed buffers leave the count
    }
  }
}

TEST_CASE("memory plan: pages from free memory less the headroom, and refusals with the numbers", "[memory]") {
  const KvPoolConfig pc = pool_config_of({}, 1);
  const int64_t page = kv_pool_bytes(pool_config_of({}, 2)) - kv_pool_bytes(pc);
  REQUIRE(page > 0);
  PoolBudget b;
  b.headroom_bytes = 64 * kMiB;
  b.weight_bytes = 3 * kMiB;
  b.total_bytes = 1024 * kMiB;
  b.free_bytes = b.headroom_bytes + kv_pool_bytes(pool_config_of({}, 100)) + page / 2;  // 100.5 pages

  auto fit = plan_pool_pages(pc, no_swa, b, 0);
  REQUIRE(fit.ok());
  CHECK(*fit == 100);
  CHECK(*plan_pool_pages(pc, no_swa, b, 100) == 100);
  CHECK(*plan_pool_pages(pc, no_swa, b, 7) == 7);

  const auto over = plan_pool_pages(pc, no_swa, b, 101);
  REQUIRE(over.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(over.status().message()), ContainsSubstring("num_pages 101 needs a KV pool of") &&
                                                        ContainsSubstring("at most 100 pages fit") &&
                                                        ContainsSubstring("64.0 MiB must stay free") &&
                                                        ContainsSubstring("of 1.00 GiB free") &&
                                                        ContainsSubstring("3.0 MiB of weights and") &&
                                                        ContainsSubstring("memory_headroom_mib"));
  b.weights_estimated = true;
  CHECK_THAT(std::string(plan_pool_pages(pc, no_swa, b, 101).status().message()),
             ContainsSubstring("not loaded yet"));

  b.free_bytes = b.headroom_bytes + page / 2;  // not one page
  const auto none = plan_pool_pages(pc, no_swa, b, 0);
  CHECK(none.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(none.status().message()), ContainsSubstring("not one page"));
  b.free_bytes = b.headroom_bytes / 2;  // less than the headroom
  CHECK(plan_pool_pages(pc, no_swa, b, 1).status().code() == absl::StatusCode::kResourceExhausted);
}

TEST_CASE("memory plan: the SWA pool counts against the same memory", "[memory]") {
  const json o = {{"sliding_window", 24}, {"swa_layers", "alternate"}};
  const KvPoolConfig pc = pool_config_of(o, 1);
  const auto swa = [](int64_t pages) { return std::min<int64_t>(pages, 8); };
  KvPoolConfig at = pc;
  at.num_pages = 50;
  at.swa_num_pages = 8;
  PoolBudget b;
  b.free_bytes = kv_pool_bytes(at);
  auto fit = plan_pool_pages(pc, swa, b, 0);
  REQUIRE(fit.ok());
  CHECK(*fit == 50);
}

TEST_CASE("memory plan: num_pages 0 sizes the engine's pool to the device's free memory", "[memory]") {
  const int64_t device_free = 200 * kMiB;
  auto e = sized_engine({{"num_pages", 0}, {"memory_headroom_mib", 1}}, {device_free, 512 * kMiB});
  INFO(e.status().ToString());
  REQUIRE(e.ok());
  const MemorySplit& m = (*e)->memory();
  CHECK(m.pool_auto);
  CHECK(m.headroom_bytes == kMiB);
  // The weights as the backend counted them: the model's size, nothing missed.
  CHECK(m.weight_bytes >= (*e)->spec().weight_bytes());
  CHECK(m.weight_bytes < (*e)->spec().weight_bytes() + kMiB);
  CHECK(m.workspace_bytes > 0);
  CHECK(m.device_total_bytes == 512 * kMiB);
  // The pool took every page that fits beside the weights, workspaces and headroom.
  KvPoolConfig pc = (*e)->pool().config();
  CHECK(m.kv_pool_bytes == kv_pool_bytes(pc));
  const int64_t room = device_free - m.weight_bytes - m.workspace_bytes - m.headroom_bytes;
  CHECK(kv_pool_bytes(pc) <= room);
  ++pc.num_pages;
  CHECK(kv_pool_bytes(pc) > room);
  CHECK(m.device_free_bytes == device_free - m.weight_bytes - m.workspace_bytes - m.kv_pool_bytes);
  CHECK(m.device_free_bytes >= m.headroom_bytes);

  // It serves: a prompt and a decode step on the planned pool.
  REQUIRE((*e)->add_sequence(1, prompt_of(20, 0, (*e)->spec().vocab), SamplingParams{}).ok());
  auto r = (*e)->step({StepItem{1, 20, true}});
  REQUIRE(r.ok());
  CHECK((*r)[0].status.ok());
}

TEST_CASE("memory plan: a pool that cannot fit is refused at start, naming the numbers", "[memory]") {
  // A GPU of 512 MiB with 300 MiB free: 4096 pages of the tiny model do not fit beside a
  // 256 MiB headroom.
  const DeviceMemory mem{300 * kMiB, 512 * kMiB};
  const json o = {{"num_pages", 4096}, {"memory_headroom_mib", 256}};
  auto e = sized_engine(o, mem, Device::cuda);
  REQUIRE(e.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(e.status().message()), ContainsSubstring("num_pages 4096 needs a KV pool of 64.0 MiB") &&
                                                     ContainsSubstring("of 512.0 MiB free") &&
                                                     ContainsSubstring("not loaded yet") &&
                                                     ContainsSubstring("256.0 MiB must stay free") &&
                                                     ContainsSubstring("pages fit (num_pages 0 takes them)"));
  // A pool that fits beside the model's size but not beside the weights and workspaces as
  // loaded: the plan before loading passes, the one after refuses with the measured numbers.
  const int64_t weights = make_engine({})->spec().weight_bytes();
  const int64_t pool = kv_pool_bytes(pool_config_of({}, 2048));
  auto after = sized_engine({{"num_pages", 2048}, {"memory_headroom_mib", 256}},
                            {256 * kMiB + weights + pool, 512 * kMiB}, Device::cuda);
  REQUIRE(after.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(after.status().message()),
             ContainsSubstring("num_pages 2048 needs a KV pool of 32.0 MiB") && ContainsSubstring("of workspaces") &&
                 !ContainsSubstring("not loaded yet") && ContainsSubstring("pages fit (num_pages 0 takes them)"));
  // The same on the CPU backend is not checked (host memory is the OS's to share) ...
  CHECK(sized_engine(o, mem, Device::cpu).ok());
  // ... unless the pool is sized to fit.
  CHECK(sized_engine({{"num_pages", 0}, {"memory_headroom_mib", 256}}, mem, Device::cpu).ok());
  CHECK(sized_engine({{"num_pages", 0}, {"memory_headroom_mib", 400}}, mem, Device::cpu).status().code() ==
        absl::StatusCode::kResourceExhausted);
}

TEST_CASE("memory plan: num_pages 0 needs device memory figures and one rank", "[memory]") {
  class Unsized : public ForwardingBackend {
   public:
    Unsized() : ForwardingBackend(make_cpu_backend()) {}
    absl::StatusOr<DeviceMemory> device_memory() override { return absl::UnimplementedError("no figures"); }
  };
  auto e = Engine::create(make_config({{"num_pages", 0}}), std::make_unique<Unsized>());
  CHECK(e.status().code() == absl::StatusCode::kUnimplemented);
  auto tp = Engine::create(make_config({{"num_pages", 0}, {"tensor_parallel", 2}}));
  CHECK(tp.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(tp.status().message()), ContainsSubstring("num_pages 0"));
}
