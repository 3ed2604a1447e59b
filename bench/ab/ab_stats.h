// Statistics and rendering for kvfuse-ab: paired A/B repetitions summarized by geometric
// means, their ratio with a paired 95% confidence interval (from bench/common/stats.h), and
// the table, JSON and SVG outputs.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "bench/common/stats.h"

namespace kvfuse::ab {

// One measurement of one side in one repetition.
struct Sample {
  double step_ms = 0;       // mean decode step time
  double tokens_per_s = 0;  // decode tokens per second
};

struct Cell {
  int batch = 0;
  int context = 0;
  std::vector<Sample> a, b;  // paired: a[i] and b[i] ran back to back
};

// A cell's row. Every column comes from the same kept pairs: tok/s and step ms are the
// geometric means over them, and the ratio is a_tps / b_tps, which is exp of the mean of
// the paired log ratios log(a tok/s / b tok/s); its interval is the paired Student t
// interval of those logs, exponentiated, so it always holds the ratio, and tok/s x step ms
// is the batch in both columns.
struct Summary {
  double a_tps = 0, b_tps = 0;          // geometric mean tokens/s
  double a_step_ms = 0, b_step_ms = 0;  // geometric mean step time
  double ratio = 0;                     // a_tps / b_tps
  double ci_low = 0, ci_high = 0;       // its 95% confidence interval
  int n = 0;                            // pairs kept
  int outliers = 0;                     // pairs dropped (from every column)
};

// Outliers (beyond 3.5 scaled MADs of the median log ratio) are dropped only from this
// many pairs on, and never more than this fraction of them (the farthest first).
inline constexpr int kMinPairsToDrop = 8;
inline constexpr double kMaxDropFraction = 0.2;
// An interval from fewer pairs than this is flagged: its t quantile is large and its
// spread estimate rough.
inline constexpr int kMinPairs = 5;
// A cell whose interval is wider than +-5% of its ratio says little: flagged.
inline constexpr double kWideInterval = 0.05;

// The shared statistics and plot helpers (bench/common/stats.h), under the names the
// A/B code and its tests use.
using bench::Axis;
using bench::median;
using bench::nice_axis;
using bench::outliers;
using bench::t95;
using bench::xml_escape;

// Which of the paired log ratios `log_ratios` summarize() drops: the outliers, with at
// least kMinPairsToDrop of them, at most kMaxDropFraction, the farthest from the median.
std::vector<bool> dropped_pairs(const std::vector<double>& log_ratios);
Summary summarize(const Cell& c);
bool too_wide(const Summary& s);
bool too_few(const Summary& s);  // an interval from fewer than kMinPairs pairs

std::string render_table(const std::vector<Cell>& cells, const std::string& a_name,
                         const std::string& b_name);
nlohmann::json to_json(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const nlohmann::json& meta);
// A bar per cell (ratio with its interval), a line at 1.0: readable at a glance.
std::string render_svg(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const std::string& title);

}  // namespace kvfuse::ab
