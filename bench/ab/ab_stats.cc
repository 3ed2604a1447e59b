#include "bench/ab/ab_stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace kvfuse::ab {

namespace {

double mean(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m += x / double(v.size());
  return m;
}

// The geometric mean of the values of `v` not dropped.
double geomean(const std::vector<double>& v, const std::vector<bool>& drop) {
  std::vector<double> logs;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!drop[i]) logs.push_back(std::log(v[i]));
  }
  return std::exp(mean(logs));
}

// The paired log ratios log(a tok/s / b tok/s) of a cell.
std::vector<double> log_ratios(const Cell& c) {
  std::vector<double> logs;
  for (size_t i = 0; i < std::min(c.a.size(), c.b.size()); ++i)
    logs.push_back(std::log(c.a[i].tokens_per_s / c.b[i].tokens_per_s));
  return logs;
}

}  // namespace

std::vector<bool> dropped_pairs(const std::vector<double>& log_ratios) {
  const size_t n = log_ratios.size();
  std::vector<bool> drop(n, false);
  if (n < size_t(kMinPairsToDrop)) return drop;
  const std::vector<bool> out = outliers(log_ratios);
  // The farthest from the median first, as many as the cap allows.
  const double med = median(log_ratios);
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i) {
    if (out[i]) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    return std::fabs(log_ratios[x] - med) > std::fabs(log_ratios[y] - med);
  });
  const size_t cap = size_t(std::floor(kMaxDropFraction * double(n) + 1e-9));
  for (size_t k = 0; k < std::min(cap, order.size()); ++k) drop[order[k]] = true;
  return drop;
}

Summary summarize(const Cell& c) {
  Summary s;
  const size_t n = std::min(c.a.size(), c.b.size());
  if (n == 0) return s;
  const std::vector<double> logs = log_ratios(c);
  std::vector<double> a_ms, b_ms, a_tps, b_tps;
  for (size_t i = 0; i < n; ++i) {
    a_ms.push_back(c.a[i].step_ms);
    b_ms.push_back(c.b[i].step_ms);
    a_tps.push_back(c.a[i].tokens_per_s);
    b_tps.push_back(c.b[i].tokens_per_s);
  }
  // A dropped pair leaves every column: the row stays one set of pairs.
  const std::vector<bool> drop = dropped_pairs(logs);
  std::vector<double> kept;
  for (size_t i = 0; i < n; ++i) {
    if (!drop[i]) kept.push_back(logs[i]);
  }
  s.n = int(kept.size());
  s.outliers = int(n - kept.size());
  s.a_tps = geomean(a_tps, drop);
  s.b_tps = geomean(b_tps, drop);
  s.a_step_ms = geomean(a_ms, drop);
  s.b_step_ms = geomean(b_ms, drop);
  // geomean(a) / geomean(b) = exp(mean of the log ratios); the t interval of that mean,
  // exponentiated, around it (ratio x exp(-+half) holds the ratio however it rounds).
  s.ratio = s.a_tps / s.b_tps;
  const double half = bench::mean_ci(kept).half;
  s.ci_low = s.ratio * std::exp(-half);
  s.ci_high = s.ratio * std::exp(half);
  return s;
}

bool too_wide(const Summary& s) { return s.n < 2 || (s.ci_high - s.ci_low) / 2 > kWideInterval * s.ratio; }
bool too_few(const Summary& s) { return s.n < kMinPairs; }

std::string render_table(const std::vector<Cell>& cells, const std::string& a_name,
                         const std::string& b_name) {
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof line, "%6s %8s | %12s %10s | %12s %10s | %8s %19s %s\n", "batch", "context",
                (a_name + " tok/s").c_str(), "step ms", (b_name + " tok/s").c_str(), "step ms", "A/B",
                "95% CI", " note");
  out << line;
  int wide = 0, few = 0;
  for (const Cell& c : cells) {
    const Summary s = summarize(c);
    std::string note;
    char buf[64];
    if (s.outliers > 0) {
      std::snprintf(buf, sizeof buf, " %d of %d pairs dropped (outliers)", s.outliers, s.n + s.outliers);
      note += buf;
    }
    if (too_few(s)) {
      std::snprintf(buf, sizeof buf, " CI from %d pairs (< %d)", s.n, kMinPairs);
      note += buf;
      ++few;
    }
    if (too_wide(s)) {
      note += " CI wider than +-5%";
      ++wide;
    }
    std::snprintf(line, sizeof line, "%6d %8d | %12.1f %10.3f | %12.1f %10.3f | %8.4f  [%7.4f, %7.4f] %s\n",
                  c.batch, c.context, s.a_tps, s.a_step_ms, s.b_tps, s.b_step_ms, s.ratio, s.ci_low,
                  s.ci_high, note.c_str());
    out << line;
  }
  out << "tok/s and step ms: geometric mean over the pairs kept; A/B: the ratio of the tok/s columns (exp "
         "of the mean paired log ratio) with its 95% paired t interval; with >= 8 pairs, up to 20% beyond "
         "3.5 scaled MADs of the median log ratio are dropped from every column\n";
  if (few > 0) {
    out << "warning: " << few << " of " << cells.size() << " cells have a 95% interval from fewer than "
        << kMinPairs << " pairs: a rough spread and a large t quantile (more --reps)\n";
  }
  if (wide > 0) {
    out << "warning: " << wide << " of " << cells.size()
        << " cells have a 95% interval wider than +-5%: the machine is noisy or the repetitions too few "
           "(more --reps, a quiet machine)\n";
  }
  return out.str();
}

nlohmann::json to_json(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const nlohmann::json& meta) {
  nlohmann::json j;
  j["meta"] = meta;
  j["a"] = a_name;
  j["b"] = b_name;
  j["estimates"] =
      "tokens_per_s and step_ms: geometric mean over the pairs kept; ratio: a_tokens_per_s / b_tokens_per_s, "
      "the exp of the mean paired log ratio log(a/b), with ci95 its paired 95% Student t interval, "
      "exponentiated; with at least 8 pairs, up to 20% of them beyond 3.5 scaled MADs of the median log "
      "ratio are dropped from every figure (dropped_pairs: their indices); ci95_from_fewer_than_5_pairs and "
      "ci95_wider_than_5pct flag intervals that say little";
  for (const Cell& c : cells) {
    const Summary s = summarize(c);
    nlohmann::json cell = {{"batch", c.batch},
                           {"context", c.context},
                           {"a_tokens_per_s", s.a_tps},
                           {"b_tokens_per_s", s.b_tps},
                           {"a_step_ms", s.a_step_ms},
                           {"b_step_ms", s.b_step_ms},
                           {"ratio", s.ratio},
                           {"ci95", {s.ci_low, s.ci_high}},
                           {"pairs", s.n},
                           {"outliers_dropped", s.outliers},
                           {"dropped_pairs", nlohmann::json::array()},
                           {"ci95_from_fewer_than_5_pairs", too_few(s)},
                           {"ci95_wider_than_5pct", too_wide(s)}};
    const std::vector<bool> drop = dropped_pairs(log_ratios(c));
    for (size_t i = 0; i < drop.size(); ++i) {
      if (drop[i]) cell["dropped_pairs"].push_back(i);
    }
    for (const auto& [name, side] : {std::pair{"a_samples", &c.a}, std::pair{"b_samples", &c.b}}) {
      for (const Sample& x : *side)
        cell[name].push_back({{"step_ms", x.step_ms}, {"tokens_per_s", x.tokens_per_s}});
    }
    j["cells"].push_back(cell);
  }
  return j;
}

namespace {

// Width of a line of text in the SVG's sans-serif at `size` px: about 0.6 em a
// character, enough to size the canvas so that nothing is clipped.
double text_width(const std::string& text, double size) { return 0.6 * size * double(text.size()); }

}  // namespace

std::string render_svg(const std::vector<Cell>& cells, const std::string& a_name, const std::string& b_name,
                       const std::string& title) {
  const std::string subtitle =
      "tokens/s ratio " + a_name + " / " + b_name +
      ": geometric mean of paired repetitions, 95% paired t interval; above 1: " + a_name + " faster";
  std::vector<Summary> sums;
  double lo = 1.0, hi = 1.0;
  for (const Cell& c : cells) {
    sums.push_back(summarize(c));
    lo = std::min({lo, sums.back().ci_low, sums.back().ratio});
    hi = std::max({hi, sums.back().ci_high, sums.back().ratio});
  }
  // The interval is a ratio's (exponentiated): above 0, however wide.
  lo = std::max(0.0, lo);
  const double span = hi - lo;
  const Axis axis = nice_axis(std::max(0.0, lo - 0.08 * span), hi + 0.12 * span, 5);

  const double left = 70, right = 20, top = 60, plot_h = 250, slot_min = 64;
  const double bottom = top + plot_h;
  const double w =
      std::ceil(std::max({left + right + slot_min * double(std::max<size_t>(cells.size(), 1)), 640.0,
                          left + text_width(title, 15) + right, left + text_width(subtitle, 12) + right}));
  const double h = bottom + 50;
  // The cells share the whole plot width.
  const double slot = (w - left - right) / double(std::max<size_t>(cells.size(), 1));
  const double bar = std::min(40.0, slot * 0.55);
  auto y = [&](double v) { return bottom - (v - axis.lo) / (axis.hi - axis.lo) * plot_h; };
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << left << "' y='24' font-size='15'>" << xml_escape(title) << "</text>\n";
  s << "<text x='" << left << "' y='42' fill='#555'>" << xml_escape(subtitle) << "</text>\n";
  for (double v = axis.lo; v <= axis.hi + axis.step * 1e-6; v += axis.step) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.*f", axis.decimals, v);
    s << "<line x1='" << left << "' x2='" << w - right << "' y1='" << y(v) << "' y2='" << y(v)
      << "' stroke='#eee'/><text x='" << left - 8 << "' y='" << y(v) + 4 << "' text-anchor='end'>" << buf
      << "</text>\n";
  }
  s << "<text transform='translate(18," << (top + bottom) / 2
    << ") rotate(-90)' text-anchor='middle'>ratio</text>\n";
  if (axis.lo <= 1.0 && 1.0 <= axis.hi) {
    s << "<line x1='" << left << "' x2='" << w - right << "' y1='" << y(1.0) << "' y2='" << y(1.0)
      << "' stroke='#333' stroke-dasharray='4 3'/>\n";
  }
  for (size_t i = 0; i < cells.size(); ++i) {
    const double x = left + slot * (double(i) + 0.5);
    const Summary& m = sums[i];
    const bool faster = m.ci_low > 1.0, slower = m.ci_high < 1.0;
    const char* color = faster ? "#2a7f3f" : slower ? "#b03030" : "#888";
    const double y0 = y(std::clamp(1.0, axis.lo, axis.hi)), y1 = y(m.ratio);
    s << "<rect x='" << x - bar / 2 << "' y='" << std::min(y0, y1) << "' width='" << bar << "' height='"
      << std::fabs(y1 - y0) + 0.5 << "' fill='" << color << "' opacity='0.8'/>\n";
    const double ci_lo = std::max(axis.lo, m.ci_low), ci_hi = std::min(axis.hi, m.ci_high);
    s << "<line x1='" << x << "' x2='" << x << "' y1='" << y(ci_lo) << "' y2='" << y(ci_hi)
      << "' stroke='black'/>\n";
    for (double v : {ci_lo, ci_hi}) {
      s << "<line x1='" << x - 6 << "' x2='" << x + 6 << "' y1='" << y(v) << "' y2='" << y(v)
        << "' stroke='black'/>\n";
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%+.1f%%", (m.ratio - 1.0) * 100.0);
    s << "<text x='" << x << "' y='" << std::min(y(ci_hi), y1) - 6 << "' text-anchor='middle'>" << buf
      << (too_wide(m) ? " (wide CI)" : "");
    if (too_few(m)) s << " (" << m.n << " pairs)";
    s << "</text>\n";
    s << "<text x='" << x << "' y='" << bottom + 18 << "' text-anchor='middle'>b=" << cells[i].batch
      << "</text>\n";
    s << "<text x='" << x << "' y='" << bottom + 32 << "' text-anchor='middle' fill='#555'>ctx "
      << cells[i].context << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace kvfuse::ab
