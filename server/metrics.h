// Prometheus metrics of the server, rendered in the text exposition format (0.0.4).
// Names follow vLLM's (with the `kvfuse:` prefix in place of `vllm:`), so existing
// dashboards need only the prefix changed. Thread-safe: the engine loop records, the
// HTTP endpoint renders.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace kvfuse::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double v);
  // `labels`: those every series of the histogram carries (`key="value",...`).
  void render(std::string& out, const std::string& name, const std::string& help,
              const std::string& labels = "") const;
  uint64_t count() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct LoadGauges {
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t router_sequences = 0;
  int64_t streams = 0;
  int64_t full_used = 0, full_total = 0;
  int64_t swa_used = 0, swa_total = 0;
  int64_t preemptions = 0;
  // The prefix cache: prompt tokens looked up and found (counters), pages cached (of them
  // held by no sequence: evictable).
  int64_t cache_query_tokens = 0, cache_hit_tokens = 0;
  int64_t cached_pages = 0, evictable_pages = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();

  // Static labels of the kvfuse:engine_info gauge (model, kv_write, kv_cache_dtype, ...).
  void set_info(std::map<std::string, std::string> labels);
  void set_serving(bool serving);
  void set_load(const LoadGauges& g);

  void add_prompt_tokens(int64_t n);
  void add_generation_tokens(int64_t n);
  void count_finished(const std::string& reason);  // length | stop | abort
  void count_failed(const std::string& code);      // the gRPC code's name

  // As last recorded (smg's GetLoads reads them, server/sglang_info.h).
  LoadGauges load() const;
  int64_t generation_tokens() const;

  Histogram ttft{
      {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}};
  Histogram itl{
      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5}};
  Histogram e2e{{0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 60, 120, 240, 480, 960}};
  Histogram step{{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};
  Histogram step_tokens{{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192}};

  std::string render() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::string> info_;
  bool serving_ = false;
  LoadGauges load_;
  int64_t prompt_tokens_ = 0;
  int64_t generation_tokens_ = 0;
  std::map<std::string, int64_t> finished_;
  std::map<std::string, int64_t> failed_;
};

}  // namespace kvfuse::server
