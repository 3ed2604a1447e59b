#include "src/backends/gemm_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "src/loading/env_switches.h"

namespace kvfuse {

namespace {

constexpr const char* kFormat = "kvfuse-gemm-algos-v1";

std::string to_hex(const std::vector<uint8_t>& b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(b.size() * 2);
  for (uint8_t x : b) {
    s.push_back(d[x >> 4]);
    s.push_back(d[x & 15]);
  }
  return s;
}

std::optional<std::vector<uint8_t>> from_hex(const std::string& s) {
  if (s.size() % 2 != 0) return std::nullopt;
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::vector<uint8_t> out(s.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = uint8_t(hi << 4 | lo);
  }
  return out;
}

bool read_file(const std::string& path, std::string& text) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  text = ss.str();
  return true;
}

// Holds an exclusive flock on `path` while alive (the fd is -1 when it could not be taken).
struct FileLock {
  int fd = -1;
  explicit FileLock(const std::string& path) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0 && ::flock(fd, LOCK_EX) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ~FileLock() {
    if (fd >= 0) {
      ::flock(fd, LOCK_UN);
      ::close(fd);
    }
  }
};

}  // namespace

std::string GemmAlgoCache::default_path() {
  if (const std::optional<std::string> p = env_raw("KVFUSE_GEMM_CACHE")) return *p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    return absl::StrCat(x, "/kvfuse/gemm-algos.json");
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    return absl::StrCat(h, "/.cache/kvfuse/gemm-algos.json");
  }
  return "";
}

std::optional<std::map<GemmCacheKey, GemmCacheEntry>> GemmAlgoCache::parse(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("format", "") != kFormat || !j.contains("entries") ||
      !j["entries"].is_array()) {
    return std::nullopt;
  }
  std::map<GemmCacheKey, GemmCacheEntry> out;
  for (const auto& e : j["entries"]) {
    if (!e.is_object() || !e.contains("device") || !e["device"].is_string() || !e.contains("algo") ||
        !e["algo"].is_string()) {
      continue;  // an entry of another writer's making: skipped, the rest still count
    }
    GemmCacheKey key;
    key.device = e["device"].get<std::string>();
    key.m = e.value("m", int64_t(0));
    key.n = e.value("n", int64_t(0));
    key.k = e.value("k", int64_t(0));
    key.out = e.value("out", "");
    auto algo = from_hex(e["algo"].get<std::string>());
    if (!algo || key.m <= 0 || key.n <= 0 || key.k <= 0) continue;
    GemmCacheEntry entry;
    entry.algo = std::move(*algo);
    entry.us = e.value("us", 0.0);
    entry.method = e.value("method", "");
    entry.kernel = e.value("kernel", "");
    out[key] = std::move(entry);
  }
  return out;
}

std::string GemmAlgoCache::serialize(const std::map<GemmCacheKey, GemmCacheEntry>& entries) {
  nlohmann::json j;
  j["format"] = kFormat;
  j["entries"] = nlohmann::json::array();
  for (const auto& [k, e] : entries) {
    j["entries"].push_back({{"device", k.device},
                            {"m", k.m},
                            {"n", k.n},
                            {"k", k.k},
                            {"out", k.out},
                            {"algo", to_hex(e.algo)},
                            {"us", e.us},
                            {"method", e.method}});
    if (!e.kernel.empty()) j["entries"].back()["kernel"] = e.kernel;
  }
  return j.dump(1) + "\n";
}

void GemmAlgoCache::reload_if_changed() {
  struct stat st {};
  if (path_.empty() || ::stat(path_.c_str(), &st) != 0) return;
  const int64_t mtime = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  if (mtime == loaded_mtime_ns_ && int64_t(st.st_size) == loaded_size_) return;
  std::string text;
  if (!read_file(path_, text)) return;
  loaded_mtime_ns_ = mtime;
  loaded_size_ = int64_t(st.st_size);
  if (auto parsed = parse(text)) {
    for (auto& [k, e] : *parsed) entries_[k] = std::move(e);
  }
}

std::optional<GemmCacheEntry> GemmAlgoCache::find(const GemmCacheKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) return it->second;
  reload_if_changed();
  it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

absl::Status GemmAlgoCache::store(const GemmCacheKey& key, const GemmCacheEntry& entry) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_[key] = entry;
  if (path_.empty()) return absl::OkStatus();
  std::error_code ec;
  const std::filesystem::path p(path_);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  FileLock file_lock(path_ + ".lock");
  if (file_lock.fd < 0) {
    return absl::UnavailableError(absl::StrCat("gemm cache ", path_, ": cannot lock ", path_, ".lock (",
                                               std::strerror(errno), ")"));
  }
  // Merge with what other processes wrote since: theirs first, ours on top.
  std::map<GemmCacheKey, GemmCacheEntry> merged;
  std::string text;
  if (read_file(path_, text)) {
    if (auto parsed = parse(text)) merged = std::move(*parsed);
  }
  for (const auto& [k, e] : entries_) merged[k] = e;
  const std::string tmp = absl::StrCat(path_, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << serialize(merged);
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      return absl::UnavailableError(absl::StrCat("gemm cache ", path_, ": cannot write ", tmp));
    }
  }
  if (::rename(tmp.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    std::filesystem::remove(tmp, ec);
    return absl::UnavailableError(
        absl::StrCat("gemm cache ", path_, ": cannot replace the file (", std::strerror(err), ")"));
  }
  entries_ = std::move(merged);
  return absl::OkStatus();
}

}  // namespace kvfuse
