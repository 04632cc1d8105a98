// A small hand-written SVG line plot (no dependency): one polyline with markers per series,
// labelled axes, "nice" y ticks from zero, x either linear or log2 (batch sizes).
#include "plot_svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace md::cli {

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else
      o += c;
  }
  return o;
}

// A step of 1, 2 or 5 times a power of ten giving about `n` intervals over [0, hi].
double nice_step(double hi, int n) {
  const double raw = hi / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

}  // namespace

std::string line_plot_svg(const std::string& title, const std::string& xlabel,
                          const std::string& ylabel, const std::vector<PlotSeries>& series,
                          bool log2x) {
  const double Wd = 720, Ht = 440, L = 80, R = 170, T = 50, B = 60;
  const double pw = Wd - L - R, ph = Ht - T - B;
  double xmin = INFINITY, xmax = -INFINITY, ymax = 0;
  for (const auto& s : series)
    for (auto [x, y] : s.points) {
      const double xv = log2x ? std::log2(x) : x;
      xmin = std::min(xmin, xv);
      xmax = std::max(xmax, xv);
      ymax = std::max(ymax, y);
    }
  if (!(xmin <= xmax)) xmin = 0, xmax = 1;
  if (xmax == xmin) xmin -= 0.5, xmax += 0.5;
  if (ymax <= 0) ymax = 1;
  const double ystep = nice_step(ymax, 5);
  const double ytop = std::ceil(ymax / ystep) * ystep;
  auto px = [&](double x) { return L + ((log2x ? std::log2(x) : x) - xmin) / (xmax - xmin) * pw; };
  auto py = [&](double y) { return T + ph - y / ytop * ph; };
  static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "font-family=\"sans-serif\" font-size=\"13\">\n<rect width=\"100%\" height=\"100%\" "
      "fill=\"white\"/>\n",
      Wd, Ht, Wd, Ht);
  o += fmt::format("<text x=\"{}\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">{}</text>\n",
                   L + pw / 2, esc(title));
  // Grid and y ticks.
  for (double y = 0; y <= ytop + ystep / 2; y += ystep) {
    o += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{:g}</text>\n",
        L, py(y), L + pw, py(y), L - 6, py(y) + 4, y);
  }
  // x ticks at the data's x values.
  std::vector<double> xs;
  for (const auto& s : series)
    for (auto [x, y] : s.points) xs.push_back(x);
  std::sort(xs.begin(), xs.end());
  xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  for (double x : xs)
    o += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#333\"/>\n"
        "<text x=\"{0:.1f}\" y=\"{3:.1f}\" text-anchor=\"middle\">{4:g}</text>\n",
        px(x), T + ph, T + ph + 5, T + ph + 20, x);
  // Axes and labels.
  o += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#333\"/>\n"
      "<line x1=\"{0}\" y1=\"{2}\" x2=\"{3}\" y2=\"{2}\" stroke=\"#333\"/>\n",
      L, T, T + ph, L + pw);
  o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", L + pw / 2,
                   Ht - 15, esc(xlabel + (log2x ? " (log2 scale)" : "")));
  o += fmt::format(
      "<text x=\"20\" y=\"{0}\" text-anchor=\"middle\" transform=\"rotate(-90 20 "
      "{0})\">{1}</text>\n",
      T + ph / 2, esc(ylabel));
  // Series and legend.
  for (size_t i = 0; i < series.size(); ++i) {
    const char* col = colors[i % std::size(colors)];
    std::string pts;
    auto sorted = series[i].points;
    std::sort(sorted.begin(), sorted.end());
    for (auto [x, y] : sorted) pts += fmt::format("{:.1f},{:.1f} ", px(x), py(y));
    o += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>\n",
                     col, pts);
    for (auto [x, y] : sorted)
      o += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\"/>\n", px(x),
                       py(y), col);
    const double ly = T + 10 + 22 * double(i);
    o += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"/>\n"
        "<text x=\"{4}\" y=\"{5}\">{6}</text>\n",
        L + pw + 15, ly, L + pw + 40, col, L + pw + 46, ly + 4, esc(series[i].name));
  }
  o += "</svg>\n";
  return o;
}

}  // namespace md::cli
