// kvfuse-ab's statistics: the paired ratio, its 95% interval, and the outputs.
#include <cmath>
#include <nlohmann/json.hpp>
#include "tests/catch.h"

#include "bench/ab/ab_stats.h"

using namespace kvfuse::ab;

TEST_CASE("ab stats: paired ratio and 95% interval by Student t", "[ab]") {
  CHECK(t95(2) == Approx(12.706));
  CHECK(t95(5) == Approx(2.776));
  CHECK(t95(100) == Approx(1.96));
  Cell c{8, 512, {}, {}};
  // Ratios 1.10, 1.20, 1.00, 1.10, 1.10: mean 1.10, sd 0.0707, half width 2.776 * 0.0707 / sqrt(5).
  const double a[] = {110, 120, 100, 110, 110};
  for (double x : a) {
    c.a.push_back({1000.0 / x, x});
    c.b.push_back({10.0, 100.0});
  }
  const Summary s = summarize(c);
  CHECK(s.ratio == Approx(1.10));
  const double half = 2.776 * std::sqrt(0.005) / std::sqrt(5.0);
  CHECK(s.ci_low == Approx(1.10 - half));
  CHECK(s.ci_high == Approx(1.10 + half));
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
  CHECK(std::count(table.begin(), table.end(), '\n') == 3);
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
