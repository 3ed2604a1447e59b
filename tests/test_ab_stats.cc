// kvfuse-ab's statistics: the paired ratio, its 95% interval, and the outputs.
#include <cmath>
#include <nlohmann/json.hpp>
#include "tests/catch.h"

#include "bench/ab/ab_stats.h"

using namespace kvfuse::ab;

TEST_CASE("ab stats: paired ratio and 95% interval by Student t", "[ab]") {
  CHECK(t95(2) == Approx(12.70620).epsilon(1e-5));
  CHECK(t95(5) == Approx(2.776445).epsilon(1e-5));
  // Past 30 degrees of freedom too: not the normal 1.96.
  CHECK(t95(32) == Approx(2.0395).epsilon(1e-4));
  CHECK(t95(100) == Approx(1.9842).epsilon(1e-4));
  Cell c{8, 512, {}, {}};
  // Ratios 1.10, 1.20, 1.00, 1.10, 1.10: mean 1.10, sd 0.0707, half width 2.776 * 0.0707 / sqrt(5).
  const double a[] = {110, 120, 100, 110, 110};
  for (double x : a) {
    c.a.push_back({1000.0 / x, x});
    c.b.push_back({10.0, 100.0});
  }
  const Summary s = summarize(c);
  CHECK(s.ratio == Approx(1.10));
  const double half = 2.776445 * std::sqrt(0.005) / std::sqrt(5.0);
  CHECK(s.ci_low == Approx(1.10 - half).epsilon(1e-4));
  CHECK(s.ci_high == Approx(1.10 + half).epsilon(1e-4));
  CHECK(s.outliers == 0);
  CHECK(s.a_tps == Approx(110));
  CHECK(s.b_step_ms == Approx(10.0));
}

TEST_CASE("ab stats: table, JSON and SVG carry every cell", "[ab]") {
  std::vector<Cell> cells;
  for (int b : {1, 32}) {
    Cell c{b, 4096, {}, {}};
    for (int i = 0; i < 5; ++i) {
      c.a.push_back({1.0, 1000.0 + i});
      c.b.push_back({1.1, 950.0});
    }
    cells.push_back(c);
  }
  const std::string table = render_table(cells, "fused", "unfused");
  CHECK(table.find("4096") != std::string::npos);
  CHECK(std::count(table.begin(), table.end(), '\n') == 4);  // header, two cells, how they are estimated
  const auto j = to_json(cells, "fused", "unfused", {{"model", "tiny"}});
  REQUIRE(j["cells"].size() == 2);
  CHECK(j["cells"][1]["batch"] == 32);
  CHECK(j["cells"][0]["a_samples"].size() == 5);
  CHECK(j["cells"][0]["ratio"].get<double>() > 1.0);
  const std::string svg = render_svg(cells, "fused", "unfused", "title");
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("b=32") != std::string::npos);
  CHECK(svg.find("</svg>") != std::string::npos);
}

TEST_CASE("ab stats: one stray repetition is dropped and tok/s agrees with step time", "[ab]") {
  // Batch 1, context 512 on a busy CPU: nine repetitions near 9 ms against 15 ms, and
  // one of 61.5 ms on side A.
  Cell c{1, 512, {}, {}};
  const double a_ms[] = {9.0, 9.1, 8.9, 9.0, 61.5, 9.05, 8.95, 9.0, 9.1, 8.9};
  for (double ms : a_ms) {
    c.a.push_back({ms, 1000.0 / ms});
    c.b.push_back({15.0, 1000.0 / 15.0});
  }
  const Summary s = summarize(c);
  CHECK(s.outliers == 1);
  CHECK(s.n == 9);
  CHECK(s.a_step_ms == Approx(9.0));
  // The same statistic in both columns: tok/s is batch over the step time.
  CHECK(s.a_tps * s.a_step_ms / 1000.0 == Approx(1.0));
  CHECK(s.ratio == Approx(15.0 / 9.0).epsilon(0.01));
  CHECK(s.ci_high - s.ci_low < 0.05);
  CHECK(!too_wide(s));
  CHECK(render_table({c}, "fused", "unfused").find("1 outlier(s) dropped") != std::string::npos);
}

TEST_CASE("ab stats: a cell with an interval wider than 5% is flagged", "[ab]") {
  Cell c{1, 512, {}, {}};
  for (double ms : {8.0, 12.0, 9.0, 11.0}) {
    c.a.push_back({ms, 1000.0 / ms});
    c.b.push_back({10.0, 100.0});
  }
  const Summary s = summarize(c);
  CHECK(too_wide(s));
  const std::string table = render_table({c}, "fused", "unfused");
  CHECK(table.find("CI wider than +-5%") != std::string::npos);
  CHECK(table.find("warning: 1 of 1 cells") != std::string::npos);
  CHECK(to_json({c}, "fused", "unfused", {})["cells"][0]["ci95_wider_than_5pct"] == true);
}

TEST_CASE("ab stats: the plot has round ticks, no negative ratios, and room for its title", "[ab]") {
  Axis a = nice_axis(0.99, 1.036, 5);
  CHECK(a.step == Approx(0.01));
  CHECK(a.lo == Approx(0.99));
  CHECK(a.hi == Approx(1.04));
  CHECK(a.decimals == 2);
  a = nice_axis(0.0, 3.3, 5);
  CHECK(a.step == Approx(1.0));
  CHECK(a.hi == Approx(4.0));
  CHECK(a.decimals == 0);
  a = nice_axis(0.9, 1.1, 4);
  CHECK(a.step == Approx(0.05));
  CHECK(a.decimals == 2);

  // One wild repetition of three: the interval reaches below 0, the axis does not.
  Cell c{1, 512, {}, {}};
  for (double ms : {9.0, 61.5, 8.9}) {
    c.a.push_back({ms, 1000.0 / ms});
    c.b.push_back({15.0, 1000.0 / 15.0});
  }
  REQUIRE(summarize(c).ci_low < 0);
  const std::string title(120, 't');
  const std::string svg = render_svg({c}, "fused", "unfused", title);
  CHECK(svg.find(">-") == std::string::npos);  // no negative tick label
  CHECK(svg.find("(wide CI)") != std::string::npos);
  const auto at = svg.find("width='");
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(svg.substr(at + 7)) >= 0.6 * 15 * 120);  // the title is not clipped
}
