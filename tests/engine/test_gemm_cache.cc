// The GEMM algorithm cache file (src/backends/gemm_cache.h): what one process stores,
// another reads; concurrent writers merge; a damaged file is ignored and replaced.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>
#include "tests/util/catch.h"

#include "src/backends/gemm_cache.h"

using namespace kvfuse;

namespace {

std::string temp_dir() {
  std::string t = (std::filesystem::temp_directory_path() / "kvfuse-gemm-cache-XXXXXX").string();
  REQUIRE(mkdtemp(t.data()) != nullptr);
  return t;
}

GemmCacheKey key(int64_t m, const char* device = "NVIDIA H200 sm_90 cuBLASLt 130200") {
  return GemmCacheKey{device, m, 6144, 4096, "bf16"};
}

GemmCacheEntry entry(uint8_t fill, double us) {
  return GemmCacheEntry{std::vector<uint8_t>(64, fill), us, "graph", ""};
}

}  // namespace

TEST_CASE("gemm cache: one process's choices are another's, per device and shape", "[gemm_cache]") {
  const std::string dir = temp_dir();
  const std::string path = dir + "/sub/gemm-algos.json";  // the folder is made on the first store
  GemmAlgoCache a(path), b(path);
  CHECK_FALSE(a.find(key(1)).has_value());
  REQUIRE(a.store(key(1), entry(0xab, 12.5)).ok());
  auto got = b.find(key(1));
  REQUIRE(got.has_value());
  CHECK(got->algo == std::vector<uint8_t>(64, 0xab));
  CHECK(got->us == 12.5);
  CHECK(got->method == "graph");
  CHECK_FALSE(b.find(key(2)).has_value());                             // another shape
  CHECK_FALSE(b.find(key(1, "NVIDIA H100 sm_90 cuBLASLt 130200")).has_value());  // another device
  // b adds its own; a's entry stays in the file beside it, and a sees b's.
  REQUIRE(b.store(key(8), entry(0x11, 20.0)).ok());
  GemmAlgoCache c(path);
  CHECK(c.find(key(1)).has_value());
  CHECK(c.find(key(8)).has_value());
  CHECK(a.find(key(8)).has_value());
  std::filesystem::remove_all(dir);
}

TEST_CASE("gemm cache: a shape that runs kvfuse's own GEMV keeps that, with no library algorithm",
          "[gemm_cache]") {
  const std::string dir = temp_dir();
  const std::string path = dir + "/gemm-algos.json";
  GemmAlgoCache a(path);
  GemmCacheEntry e;
  e.us = 9.5;
  e.method = "graph";
  e.kernel = "kvfuse-gemv/1";
  REQUIRE(a.store(key(1), e).ok());
  REQUIRE(a.store(key(8), entry(0x22, 30.0)).ok());
  GemmAlgoCache b(path);
  auto got = b.find(key(1));
  REQUIRE(got.has_value());
  CHECK(got->kernel == "kvfuse-gemv/1");
  CHECK(got->algo.empty());
  CHECK(got->us == 9.5);
  auto lib = b.find(key(8));
  REQUIRE(lib.has_value());
  CHECK(lib->kernel.empty());  // the library's: no "kernel" in the file
  std::filesystem::remove_all(dir);
}

TEST_CASE("gemm cache: writers in parallel lose nothing - a damaged file is ignored and replaced",
          "[gemm_cache]") {
  const std::string dir = temp_dir();
  const std::string path = dir + "/gemm-algos.json";
  std::vector<std::thread> writers;
  for (int w = 0; w < 4; ++w) {
    writers.emplace_back([&, w] {
      GemmAlgoCache mine(path);  // a process of its own
      for (int i = 0; i < 10; ++i) REQUIRE(mine.store(key(1 + w * 10 + i), entry(uint8_t(w), i)).ok());
    });
  }
  for (auto& t : writers) t.join();
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto all = GemmAlgoCache::parse(text);
  REQUIRE(all.has_value());
  CHECK(all->size() == 40);

  { std::ofstream(path, std::ios::trunc) << "{\"format\": \"kvfuse-gemm-algos-v1\", \"entries\": [{"; }
  GemmAlgoCache d(path);
  CHECK_FALSE(d.find(key(1)).has_value());
  REQUIRE(d.store(key(3), entry(7, 1.0)).ok());
  GemmAlgoCache e(path);
  CHECK(e.find(key(3)).has_value());
  // Entries that are not well formed are skipped, the others kept.
  CHECK(GemmAlgoCache::parse("{\"format\": \"kvfuse-gemm-algos-v1\", \"entries\": [{\"device\": \"x\", \"m\": 1, "
                             "\"n\": 1, \"k\": 1, \"out\": \"f32\", \"algo\": \"zz\"}, {\"device\": \"x\", \"m\": 1, "
                             "\"n\": 1, \"k\": 1, \"out\": \"f32\", \"algo\": \"0a0b\"}]}")
            ->size() == 1);
  CHECK_FALSE(GemmAlgoCache::parse("{\"format\": \"other\", \"entries\": []}").has_value());
  // No path: nothing is written, lookups within the process still work.
  GemmAlgoCache off("");
  REQUIRE(off.store(key(5), entry(1, 1.0)).ok());
  CHECK(off.find(key(5)).has_value());
  std::filesystem::remove_all(dir);
}

TEST_CASE("gemm cache: the default path follows KVFUSE_GEMM_CACHE, then XDG_CACHE_HOME, then HOME", "[gemm_cache]") {
  const char* saved = std::getenv("KVFUSE_GEMM_CACHE");
  const std::string keep = saved ? saved : "";
  setenv("KVFUSE_GEMM_CACHE", "/tmp/x.json", 1);
  CHECK(GemmAlgoCache::default_path() == "/tmp/x.json");
  setenv("KVFUSE_GEMM_CACHE", "", 1);
  CHECK(GemmAlgoCache::default_path().empty());  // "" turns the file off
  unsetenv("KVFUSE_GEMM_CACHE");
  setenv("XDG_CACHE_HOME", "/var/cache/me", 1);
  CHECK(GemmAlgoCache::default_path() == "/var/cache/me/kvfuse/gemm-algos.json");
  unsetenv("XDG_CACHE_HOME");
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    CHECK(GemmAlgoCache::default_path() == std::string(home) + "/.cache/kvfuse/gemm-algos.json");
  }
  if (saved) setenv("KVFUSE_GEMM_CACHE", keep.c_str(), 1);
}
