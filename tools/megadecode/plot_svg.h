// A minimal SVG line plot for `bench --plot`.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace md::cli {

struct PlotSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y)
};

std::string line_plot_svg(const std::string& title, const std::string& xlabel,
                          const std::string& ylabel, const std::vector<PlotSeries>& series,
                          bool log2x);

}  // namespace md::cli
