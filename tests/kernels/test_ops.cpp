#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/kernels/cpu/ops.h"

namespace md::cpu {
namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

TEST(Ops, RmsNormMatchesFloat64) {
  for (int n : {1, 7, 64, 2304}) {
    auto x = randn(n, 1 + n, 3.0f), w = randn(n, 2 + n);
    std::vector<float> y(n);
    rmsnorm(x.data(), w.data(), n, 1e-5f, y.data(), false);
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    double r = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; ++i) {
      double ref = double(x[i]) * r * w[i];
      // Two fp32 roundings of the products and the fp32 rsqrt: a few ulps of |ref|.
      EXPECT_NEAR(y[i], ref, 4e-7 * std::abs(ref) + 1e-30) << n << " " << i;
    }
  }
}

TEST(Ops, RmsNormBf16RoundsLikeTheReference) {
  const int n = 128;
  auto x = randn(n, 5, 2.0f), w = randn(n, 6);
  for (auto* v : {&x, &w})
    for (auto& e : *v) e = round_bf16(e);
  std::vector<float> y(n);
  rmsnorm(x.data(), w.data(), n, 1e-5f, y.data(), true);
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  float r = float(1.0 / std::sqrt(ss / n + 1e-5));
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(y[i], round_bf16(y[i])) << "output must be a bf16 value";
    // The reference: weight * bf16(x * r), rounded to bf16. Our r may differ from torch's by an
    // ulp, which can move a product across a bf16 rounding boundary: allow one bf16 ulp.
    float ref = round_bf16(w[i] * round_bf16(x[i] * r));
    EXPECT_NEAR(y[i], ref, std::abs(ref) * 0x1p-7f + 1e-30f) << i;
  }
}

TEST(Ops, SiluMul) {
  const int n = 1000;
  auto g = randn(n, 7, 3.0f), u = randn(n, 8);
  std::vector<float> o(n), ob(n);
  silu_mul(g.data(), u.data(), n, o.data(), false);
  silu_mul(g.data(), u.data(), n, ob.data(), true);
  for (int i = 0; i < n; ++i) {
    double s = double(g[i]) / (1.0 + std::exp(-double(g[i])));
    double ref = s * u[i];
    EXPECT_NEAR(o[i], ref, 1e-6 * std::abs(ref) + 1e-7 * std::abs(s)) << i;
    // Two bf16 roundings: relative error below 2 * 2^-8 (+ the fp32 part).
    EXPECT_NEAR(ob[i], ref, 2 * 0x1p-8 * std::abs(ref) + 1e-6) << i;
  }
  // Around and far beyond the exp's clamps (fast_exp_inf: -87 and 88): finite results within the
  // same tolerance (exactly -0 where the exp overflows); in place (out = gate) as the draft uses
  // it, with the same bits.
  std::vector<float> ge = {-1e30f, -200.0f, -88.5f, -88.0f, -87.5f, -20.0f, -1e-30f, 0.0f,
                           1e-30f, 20.0f,   87.5f,  88.0f,  88.5f,  200.0f, 1e30f};
  std::vector<float> ue(ge.size(), 1.5f), oe(ge.size()), inplace = ge;
  silu_mul(ge.data(), ue.data(), int64_t(ge.size()), oe.data(), false);
  silu_mul(inplace.data(), ue.data(), int64_t(ge.size()), inplace.data(), false);
  for (size_t i = 0; i < ge.size(); ++i) {
    const double x = ge[i];
    const double ref = (x < -700 ? 0.0 : x / (1.0 + std::exp(-x))) * 1.5;
    EXPECT_TRUE(std::isfinite(oe[i])) << ge[i];
    EXPECT_NEAR(oe[i], ref, 1e-6 * std::abs(ref) + 1e-30) << ge[i];
    EXPECT_EQ(inplace[i], oe[i]) << ge[i];
  }
}

// Straightforward float64 router: sigmoid, bias-corrected choice (ties to the lower id), optional
// grouping by the sum of the top-2 scores in each group.
void naive_route(const std::vector<float>& logits, const std::vector<float>& bias,
                 const RouterParams& p, std::vector<int>& ids, std::vector<double>& w) {
  const int E = p.num_experts;
  std::vector<double> s(E), choice(E);
  for (int e = 0; e < E; ++e) {
    s[e] = 1.0 / (1.0 + std::exp(-double(logits[e])));
    choice[e] = float(float(s[e]) + bias[e]);
  }
  if (p.num_groups > 1) {
    int per = E / p.num_groups;
    std::vector<std::pair<double, int>> gs;
    for (int g = 0; g < p.num_groups; ++g) {
      std::vector<double> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gs.push_back({-(v[0] + v[1]), g});
    }
    std::stable_sort(gs.begin(), gs.end(),
                     [](auto& a, auto& b) { return a.first < b.first; });
    std::vector<bool> keep(p.num_groups, false);
    for (int i = 0; i < p.topk_groups; ++i) keep[gs[i].second] = true;
    for (int e = 0; e < E; ++e)
      if (!keep[e / per]) choice[e] = -INFINITY;
  }
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return choice[a] > choice[b]; });
  ids.assign(order.begin(), order.begin() + p.top_k);
  std::sort(ids.begin(), ids.end());
  double sum = 0;
  w.clear();
  for (int e : ids) {
    w.push_back(p.biased_weights ? s[e] + bias[e] : s[e]);
    sum += w.back();
  }
  for (auto& x : w) x = (p.renormalize ? x / sum : x) * p.scaling;
}

TEST(Ops, RouterMatchesNaive) {
  for (int trial = 0; trial < 200; ++trial) {
    RouterParams p;
    p.num_experts = trial % 2 ? 32 : 256;
    p.top_k = trial % 3 == 0 ? 8 : 4;
    p.num_groups = trial % 4 == 0 ? 8 : 1;
    p.topk_groups = p.num_groups > 1 ? 4 : 1;
    p.renormalize = trial % 5 != 0;
    p.scaling = 2.446f;
    p.biased_weights = trial % 7 == 0;
    auto logits = randn(p.num_experts, 100 + trial, 2.0f);
    auto bias = randn(p.num_experts, 200 + trial, 0.05f);
    std::vector<int> ids(p.top_k), nids;
    std::vector<float> w(p.top_k);
    std::vector<double> nw;
    route_topk(logits.data(), bias.data(), p, ids.data(), w.data());
    naive_route(logits, bias, p, nids, nw);
    ASSERT_EQ(ids, nids) << "trial " << trial;
    for (int i = 0; i < p.top_k; ++i) EXPECT_NEAR(w[i], nw[i], 1e-6 * p.scaling) << trial;
  }
}

TEST(Ops, RouterTiesPickLowestId) {
  RouterParams p{8, 3, 1, 1, true, 1.0f, false};
  std::vector<float> logits(8, 0.5f), bias(8, 0.0f);
  std::vector<int> ids(3);
  std::vector<float> w(3);
  route_topk(logits.data(), bias.data(), p, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int>{0, 1, 2}));
  for (float x : w) EXPECT_NEAR(x, 1.0f / 3, 1e-7);
  // The bias decides the choice, not the weight: expert 7 wins on bias alone.
  bias[7] = 0.1f;
  route_topk(logits.data(), bias.data(), p, ids.data(), w.data());
  EXPECT_EQ(ids, (std::vector<int>{0, 1, 7}));
  for (float x : w) EXPECT_NEAR(x, 1.0f / 3, 1e-7);  // unbiased scores are all equal
}

}  // namespace
}  // namespace md::cpu
