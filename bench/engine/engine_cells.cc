#include "bench/engine/engine_cells.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "bench/common/stats.h"

namespace kvfuse::bench {

std::vector<Variant> make_variants(const std::vector<AttentionPath>& attentions,
                                   const std::vector<bool>& graph_modes,
                                   const std::vector<KvWritePath>& writes, KvWritePath config_write) {
  std::vector<Variant> vars;
  for (AttentionPath a : attentions) {
    for (bool g : graph_modes) {
      Variant v{a, g, config_write};
      if (writes.empty()) {
        vars.push_back(v);
        continue;
      }
      for (KvWritePath w : writes) {
        v.write = w;
        v.name_write = writes.size() > 1;
        vars.push_back(v);
      }
    }
  }
  return vars;
}

Figures figures(const std::vector<Sample>& s, int batch, double peak_gbs) {
  Figures f;
  std::vector<double> ms, ratios;
  for (const Sample& x : s) {
    ms.push_back(x.step_ms);
    ratios.push_back(x.step_ms / roofline_ms(x.bytes, peak_gbs));
    f.bytes += x.bytes / double(s.size());
    f.kv_bytes += x.kv_bytes / double(s.size());
    f.context += x.context / double(s.size());
  }
  const MeanCi m = mean_ci(ms), r = mean_ci(ratios);
  f.step_ms = m.mean;
  f.ci_ms = m.half;
  f.tokens_per_s = 1000.0 * batch / m.mean;
  f.gbs = f.bytes / m.mean / 1e6;
  if (!(peak_gbs > 0)) {
    f.frac_peak = f.roofline_ms = f.ratio = f.ratio_ci = NAN;
    return f;
  }
  f.frac_peak = f.gbs / peak_gbs;
  f.roofline_ms = roofline_ms(f.bytes, peak_gbs);
  f.ratio = r.mean;
  f.ratio_ci = r.half;
  return f;
}

std::vector<double> y_ticks(double lo, double hi) {
  // Mantissas of each decade, finest first; the finest that puts at most 8 ticks in range wins.
  static const std::vector<std::vector<double>> kSets = {
      {1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.2, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0},
      {1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0},
      {1.0, 2.0, 5.0},
      {1.0}};
  std::vector<double> t;
  for (const std::vector<double>& set : kSets) {
    t.clear();
    for (int e = int(std::floor(std::log10(lo))); e <= int(std::ceil(std::log10(hi))); ++e) {
      for (double m : set) {
        const double v = m * std::pow(10.0, e);
        if (v >= lo && v <= hi) t.push_back(v);
      }
    }
    if (t.size() <= 8) break;
  }
  return t;
}

std::string render_svg(const std::vector<Cell>& cells, const std::vector<Variant>& vars,
                       const std::vector<int>& contexts, double peak_gbs, const std::string& title,
                       const std::string& subtitle) {
  // What is plotted: step time / roofline, or without a roofline the step time (ms).
  const bool roofline = peak_gbs > 0;
  const auto value = [&](const Figures& f) { return roofline ? f.ratio : f.step_ms; };
  const auto half = [&](const Figures& f) { return roofline ? f.ratio_ci : f.ci_ms; };
  std::vector<int> ctxs;
  int bmin = 1 << 30, bmax = 0;
  // The roofline (1) is always in range; without one, the data alone.
  double lo = roofline ? 1.0 : INFINITY, hi = roofline ? 1.0 : 0.0;
  for (int c : contexts) {
    bool any = false;
    for (const Cell& cell : cells) {
      if (cell.context != c || !cell.skip.empty()) continue;
      any = true;
      bmin = std::min(bmin, cell.batch);
      bmax = std::max(bmax, cell.batch);
      for (size_t v = 0; v < vars.size(); ++v) {
        const Figures f = figures(cell.s[v], cell.batch, peak_gbs);
        lo = std::min(lo, value(f));
        hi = std::max(hi, value(f) + std::min(half(f), value(f)));
      }
    }
    if (any) ctxs.push_back(c);
  }
  // The y range is the data's (and the roofline's, 1) with a margin of 4% of the span
  // on each side, so cells a few percent apart stay apart on the page.
  if (!(lo > 0 && hi >= lo)) lo = hi = 1.0;  // no cell ran
  const double span = std::max(std::log10(hi / lo), 0.02);
  const double ylo = lo / std::pow(10.0, 0.04 * span), yhi = hi * std::pow(10.0, 0.04 * span);
  const std::vector<double> ticks = y_ticks(ylo, yhi);
  const double xlo = std::log2(std::max(1, bmin)) - 0.3, xhi = std::log2(std::max(bmin, bmax)) + 0.3;
  const int ncol = std::max<int>(1, std::min<int>(4, int(ctxs.size())));
  const int nrow = std::max<int>(1, (int(ctxs.size()) + ncol - 1) / ncol);
  const double pw = 300, ph = 230, ml = 70, mt = 100, gap = 80;
  // As wide as the panels and the longest heading (about 0.6 em a character), no wider.
  const double text_w = 0.6 * std::max(15.0 * double(title.size()), 12.0 * double(subtitle.size()));
  const double W = std::ceil(std::max(
                   {ml + ncol * (pw + gap) - gap + 20, ml + text_w + 20, ml + 170.0 * double(vars.size())})),
               H = mt + nrow * (ph + 60) + 10;
  // Variants often measure alike (a small decode batch takes the split-KV kernel under
  // unified too), so each gets its own colour and marker and a small sideways offset:
  // coinciding lines stay visible side by side instead of hiding each other.
  auto color_of = [](const Variant& v) {
    if (v.attention == AttentionPath::split) return v.graphs ? "#c0392b" : "#e67e22";
    return v.graphs ? "#1f5fa8" : "#5dade2";
  };
  // Circles for unified, squares for split; filled with graphs, hollow without.
  auto marker = [&](const Variant& v, double x, double y) {
    const std::string c = color_of(v), fill = v.graphs ? c : "white";
    std::ostringstream m;
    if (v.attention == AttentionPath::split) {
      m << "<rect x='" << x - 3 << "' y='" << y - 3 << "' width='6' height='6'";
    } else {
      m << "<circle cx='" << x << "' cy='" << y << "' r='3.4'";
    }
    m << " fill='" << fill << "' stroke='" << c << "' stroke-width='1.3'";
    return m.str();
  };
  auto dodge = [&](size_t v) { return (double(v) - (double(vars.size()) - 1) / 2) * 4.0; };
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << ml << "' y='24' font-size='15'>" << xml_escape(title) << "</text>\n";
  s << "<text x='" << ml << "' y='42' fill='#555'>" << xml_escape(subtitle) << "</text>\n";
  for (size_t v = 0; v < vars.size(); ++v) {  // legend
    const double lx = ml + 170.0 * double(v), ly = 64;
    s << "<line x1='" << lx << "' x2='" << lx + 30 << "' y1='" << ly << "' y2='" << ly << "' stroke='"
      << color_of(vars[v]) << "' stroke-width='2'" << (vars[v].graphs ? "" : " stroke-dasharray='6 4'")
      << "/>" << marker(vars[v], lx + 15, ly) << "/><text x='" << lx + 36 << "' y='" << ly + 4 << "'>"
      << vars[v].name() << "</text>\n";
  }
  auto fmt = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, v >= 100 ? "%.0f" : v >= 1 ? "%.3g" : "%.2g", v);
    return std::string(b);
  };
  for (size_t p = 0; p < ctxs.size(); ++p) {
    const double x0 = ml + double(p % size_t(ncol)) * (pw + gap),
                 y0 = mt + double(p / size_t(ncol)) * (ph + 60);
    auto X = [&](double b) { return x0 + (std::log2(b) - xlo) / (xhi - xlo) * pw; };
    auto Y = [&](double r) {
      return y0 + ph - (std::log10(r) - std::log10(ylo)) / std::log10(yhi / ylo) * ph;
    };
    s << "<rect x='" << x0 << "' y='" << y0 << "' width='" << pw << "' height='" << ph
      << "' fill='none' stroke='#999'/>\n";
    s << "<text x='" << x0 + pw / 2 << "' y='" << y0 - 6
      << "' text-anchor='middle' font-weight='bold'>context " << ctxs[p] << "</text>\n";
    for (double v : ticks) {
      const bool at_roofline = roofline && v == 1.0;
      s << "<line x1='" << x0 << "' x2='" << x0 + pw << "' y1='" << Y(v) << "' y2='" << Y(v) << "' stroke='"
        << (at_roofline ? "#333" : "#eee") << "'" << (at_roofline ? " stroke-dasharray='3 3'" : "")
        << "/><text x='" << x0 - 5 << "' y='" << Y(v) + 4 << "' text-anchor='end'>" << fmt(v) << "</text>\n";
    }
    if (roofline && ylo <= 1.0 && 1.0 <= yhi)
      s << "<text x='" << x0 + pw - 4 << "' y='" << Y(1.0) - 4
        << "' text-anchor='end' fill='#333'>roofline</text>\n";
    for (int b = 1; b <= bmax; b *= 2) {
      if (b < bmin) continue;
      s << "<line x1='" << X(b) << "' x2='" << X(b) << "' y1='" << y0 + ph << "' y2='" << y0 + ph + 4
        << "' stroke='#333'/><text x='" << X(b) << "' y='" << y0 + ph + 16 << "' text-anchor='middle'>" << b
        << "</text>\n";
    }
    s << "<text x='" << x0 + pw / 2 << "' y='" << y0 + ph + 32
      << "' text-anchor='middle'>batch size (log2)</text>\n";
    s << "<text transform='translate(" << x0 - 44 << "," << y0 + ph / 2
      << ") rotate(-90)' text-anchor='middle'>" << (roofline ? "step time / roofline (log)" : "step ms (log)")
      << "</text>\n";
    for (size_t v = 0; v < vars.size(); ++v) {
      const char* color = color_of(vars[v]);
      std::ostringstream path;
      for (const Cell& cell : cells) {
        if (cell.context != ctxs[p] || !cell.skip.empty()) continue;
        const Figures f = figures(cell.s[v], cell.batch, peak_gbs);
        const double x = X(cell.batch) + dodge(v);
        const double y = value(f), h = half(f);
        path << (path.tellp() == 0 ? "M" : " L") << x << "," << Y(y);
        s << "<line x1='" << x << "' x2='" << x << "' y1='" << Y(std::max(ylo, y - h)) << "' y2='"
          << Y(std::min(yhi, y + h)) << "' stroke='" << color << "'/>" << marker(vars[v], x, Y(y))
          << "><title>" << vars[v].name() << " batch " << cell.batch << ": "
          << (roofline ? fmt(f.ratio) + "x roofline, " : std::string()) << fmt(f.step_ms) << " ms</title></"
          << (vars[v].attention == AttentionPath::split ? "rect" : "circle") << ">\n";
      }
      s << "<path d='" << path.str() << "' fill='none' stroke='" << color << "' stroke-width='1.8'"
        << (vars[v].graphs ? "" : " stroke-dasharray='6 4'") << "/>\n";
    }
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace kvfuse::bench
