// Statistics and rendering for kvfuse-ab: paired A/B repetitions, a mean ratio with a
// 95% confidence interval (from bench/common/stats.h), and the table, JSON and SVG outputs.
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

struct Summary {
  double a_tps = 0, b_tps = 0;          // tokens/s at the median step time
  double a_step_ms = 0, b_step_ms = 0;  // median step time
  double ratio = 0;                     // mean of the paired ratios a_tps / b_tps, outliers dropped
  double ci_low = 0, ci_high = 0;       // 95% confidence interval of that mean
  int n = 0;                            // repetitions in the ratio
  int outliers = 0;                     // repetitions dropped from it
};

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

Summary summarize(const Cell& c);
bool too_wide(const Summary& s);

std::string render_table(const std::vector<Cell>& cells, const std::string& a_name,
                         const std::string& b_name);
nlohmann::json to_json(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const nlohmann::json& meta);
// A bar per cell (ratio with its interval), a line at 1.0: readable at a glance.
std::string render_svg(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const std::string& title);

}  // namespace kvfuse::ab
