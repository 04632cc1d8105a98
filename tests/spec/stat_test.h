// Goodness of fit for the sampling tests: the G statistic of observed counts against exact
// probabilities, and its chi-square tail (the regularised upper incomplete gamma function), so a
// test can state its false-failure probability.
#pragma once
#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace md::test {

// Q(a, x) = Gamma(a, x) / Gamma(a): the series for P below a + 1, Lentz's continued fraction
// for Q above (both converge fast there).
inline double upper_regularized_gamma(double a, double x) {
  if (x <= 0) return 1.0;
  const double log_front = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 10000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (term < sum * 1e-16) break;
    }
    return 1.0 - sum * std::exp(log_front);
  }
  const double tiny = 1e-300;
  double b = x + 1 - a, c = 1 / tiny, d = 1 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1) < 1e-16) break;
  }
  return std::exp(log_front) * h;
}

// P(chi-square with df degrees of freedom >= x).
inline double chi_square_tail(double x, int df) {
  return upper_regularized_gamma(0.5 * df, 0.5 * x);
}

struct FitResult {
  double g = 0;
  int df = 0;
  double p_value = 1;
  std::string problem;  // an observation the model gives probability 0, if any
};

// observed: count per outcome key; expected: probability per outcome key (summing to 1). Cells
// whose expected count is below 5 are pooled (the chi-square approximation needs it); the G
// statistic 2 sum O ln(O / E) is asymptotically chi-square with cells - 1 degrees of freedom.
template <typename Key>
FitResult g_test(const std::map<Key, long>& observed, const std::map<Key, double>& expected) {
  FitResult r;
  long n = 0;
  for (const auto& [k, c] : observed) {
    n += c;
    if (!expected.count(k) || expected.at(k) <= 0) r.problem = "an outcome of probability 0";
  }
  if (!r.problem.empty()) {
    r.p_value = 0;
    return r;
  }
  std::vector<std::pair<double, double>> cells;  // (observed, expected)
  double pooled_o = 0, pooled_e = 0;
  for (const auto& [k, p] : expected) {
    const double e = p * double(n);
    const double o = observed.count(k) ? double(observed.at(k)) : 0.0;
    if (e < 5) {
      pooled_o += o;
      pooled_e += e;
    } else {
      cells.emplace_back(o, e);
    }
  }
  if (pooled_e >= 5 || cells.empty()) {
    cells.emplace_back(pooled_o, pooled_e);
  } else if (pooled_e > 0) {
    cells.back().first += pooled_o;
    cells.back().second += pooled_e;
  }
  for (const auto& [o, e] : cells)
    if (o > 0) r.g += 2 * o * std::log(o / e);
  r.df = int(cells.size()) - 1;
  r.p_value = r.df > 0 ? chi_square_tail(r.g, r.df) : 1.0;
  return r;
}

}  // namespace md::test
