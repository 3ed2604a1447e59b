// The cells of kvfuse-bench-engine (a batch size x context length, each variant's
// repetitions), their figures against the memory roofline, and the SVG of them.
#pragma once

#include <string>
#include <vector>

#include "bench/common/stats.h"
#include "bench/engine/roofline.h"
#include "src/runtime/engine.h"

namespace kvfuse::bench {

struct Variant {
  AttentionPath attention = AttentionPath::unified;
  bool graphs = false;
  KvWritePath write = KvWritePath::fused;
  bool name_write = false;  // the run compares write paths: the name says which
  std::string name() const {
    return std::string(to_string(attention)) + (graphs ? "/graphs" : "/eager") +
           (name_write ? std::string("/") + to_string(write) : "");
  }
};

// A run's variants: every attention path x graph mode, each with every write path of
// `writes` (named by it when there are several), or with `config_write` when it is empty.
std::vector<Variant> make_variants(const std::vector<AttentionPath>& attentions,
                                   const std::vector<bool>& graph_modes,
                                   const std::vector<KvWritePath>& writes, KvWritePath config_write);

// One repetition of one variant: mean step time and the bytes a step had to read.
struct Sample {
  double step_ms = 0;
  double bytes = 0;     // mean over the repetition's steps (the context grows by one a step)
  double kv_bytes = 0;  // its KV part
  double context = 0;   // mean keys attended per sequence
};

struct Cell {
  int batch = 0, context = 0;
  KvFootprint fp;
  std::string skip;                    // why it did not run; empty if it ran
  std::vector<std::vector<Sample>> s;  // [variant][repetition]
  double collectives_ms = -1;          // tensor parallelism: the step's collectives alone
};

struct Figures {
  double step_ms = 0, ci_ms = 0, tokens_per_s = 0, bytes = 0, kv_bytes = 0, context = 0;
  double gbs = 0, frac_peak = 0, roofline_ms = 0, ratio = 0, ratio_ci = 0;
};

// A cell's figures for one variant's repetitions; with peak_gbs <= 0 (no roofline: the CPU
// without --peak-gbs) frac_peak, roofline_ms, ratio and ratio_ci are NaN.
Figures figures(const std::vector<Sample>& s, int batch, double peak_gbs);

// Tick values for a log axis over [lo, hi]: round values of each decade, as many as fit
// (the finest of 1-2-5-like series with at most 8 in range).
std::vector<double> y_ticks(double lo, double hi);

// Small multiples, one panel per context: step time / roofline (log y) against batch size
// (log2 x), a line per variant with 95% intervals, and the roofline at 1. With peak_gbs <= 0
// (no roofline) the step time in ms instead, and no roofline.
std::string render_svg(const std::vector<Cell>& cells, const std::vector<Variant>& vars,
                       const std::vector<int>& contexts, double peak_gbs, const std::string& title,
                       const std::string& subtitle);

}  // namespace kvfuse::bench
