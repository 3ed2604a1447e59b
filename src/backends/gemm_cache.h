// The GEMM algorithm cache: which BLAS-Lt algorithm a decode-sized GEMM shape runs, as the
// GPU backend's tuner chose it, kept in a file that every kvfuse process on the machine
// reads. Two servers on one device (a fused/unfused A/B) then run the same GEMMs, and a
// restart does not tune again.
//
// The file is JSON: {"format": "kvfuse-gemm-algos-v1", "entries": [{"device", "m", "n",
// "k", "out", "algo", "us", "method", "kernel"}, ...]}. "device" names the GPU, its
// architecture and the BLAS-Lt library and version (an algorithm is only valid for the
// library that made it), and ends in " +skinny" where kvfuse's skinny GEMM was among
// the shape's candidates; "algo" is the library's opaque algorithm struct in hex, or empty when
// "kernel" names kvfuse's own kernel instead ("kvfuse-gemv/N", variant N of
// kernels/gemm/gemv.cuh, or "kvfuse-skinny/N", of kernels/gemm/gemm_skinny.cuh; absent for the
// library's). Writers take an advisory lock (flock on "<file>.lock"), merge with what is
// there and replace the file by a rename, so concurrent processes never leave a torn file
// and never lose each other's entries. A file that cannot be parsed is ignored (and
// replaced at the next store).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"

namespace kvfuse {

struct GemmCacheKey {
  std::string device;  // e.g. "NVIDIA H200 sm_90 cuBLASLt 130200"
  int64_t m = 0, n = 0, k = 0;
  std::string out;  // "bf16" or "f32"
  bool operator<(const GemmCacheKey& o) const {
    return std::tie(device, m, n, k, out) < std::tie(o.device, o.m, o.n, o.k, o.out);
  }
};

struct GemmCacheEntry {
  std::vector<uint8_t> algo;  // the opaque algorithm struct's bytes
  double us = 0;              // its time per call when it was chosen
  std::string method;         // how it was timed ("graph")
  std::string kernel;         // "" (the library's algorithm), "kvfuse-gemv/N" or "kvfuse-skinny/N"
};

class GemmAlgoCache {
 public:
  // `path` empty: no file (lookups miss, stores do nothing).
  explicit GemmAlgoCache(std::string path) : path_(std::move(path)) {}

  // KVFUSE_GEMM_CACHE when set ("" turns the file off), else
  // $XDG_CACHE_HOME/kvfuse/gemm-algos.json, else $HOME/.cache/kvfuse/gemm-algos.json, else "".
  static std::string default_path();

  const std::string& path() const { return path_; }
  // The entry for `key`, reading the file again when it changed since the last read.
  std::optional<GemmCacheEntry> find(const GemmCacheKey& key);
  // Adds (or replaces) the entry and writes the file (creating its folder). An error names
  // the path; the caller keeps its choice for this process either way.
  absl::Status store(const GemmCacheKey& key, const GemmCacheEntry& entry);

  // For tests and the parser's callers: the entries of a file's text; nullopt when it is
  // not a cache file of this format.
  static std::optional<std::map<GemmCacheKey, GemmCacheEntry>> parse(const std::string& text);
  static std::string serialize(const std::map<GemmCacheKey, GemmCacheEntry>& entries);

 private:
  void reload_if_changed();

  std::string path_;
  std::mutex mu_;
  std::map<GemmCacheKey, GemmCacheEntry> entries_;
  int64_t loaded_mtime_ns_ = -1;
  int64_t loaded_size_ = -1;
};

}  // namespace kvfuse
