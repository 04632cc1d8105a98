// Kimi K3's element-wise and mixing ops against naive float64 versions: block attention residual
// mix, SiTU-GLU, the MLA sigmoid output gate and KDA's lower-bounded decay gate.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/kernels/cpu/attn_res.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/ops.h"

namespace md::cpu {
namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f, float mean = 0.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(mean, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

double sig64(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// The mix in float64 straight from its definition: softmax over sources of w . RMSNorm(src).
std::vector<double> attn_res_ref(const std::vector<std::vector<float>>& src, const float* w,
                                 int64_t D, double eps) {
  const size_t S = src.size();
  std::vector<double> score(S), out(size_t(D), 0.0);
  for (size_t j = 0; j < S; ++j) {
    double ms = 0;
    for (int64_t d = 0; d < D; ++d) ms += double(src[j][d]) * src[j][d];
    const double r = 1.0 / std::sqrt(ms / double(D) + eps);
    double s = 0;
    for (int64_t d = 0; d < D; ++d) s += double(src[j][d]) * r * double(w[d]);
    score[j] = s;
  }
  const double mx = *std::max_element(score.begin(), score.end());
  double z = 0;
  for (double& s : score) z += (s = std::exp(s - mx));
  for (size_t j = 0; j < S; ++j)
    for (int64_t d = 0; d < D; ++d) out[d] += score[j] / z * double(src[j][d]);
  return out;
}

TEST(AttnRes, MixMatchesFloat64) {
  for (int64_t D : {1, 16, 64, 7168})
    for (int S : {1, 2, 5, 9}) {
      std::vector<std::vector<float>> src;
      for (int j = 0; j < S; ++j) src.push_back(randn(size_t(D), 17 * S + j, 0.5f + j));
      // |w| ~ 1/sqrt(D) as in a trained model: scores O(1), the softmax neither flat nor one-hot.
      auto w = randn(size_t(D), 5, 1.0f / std::sqrt(float(D)));
      std::vector<const float*> p;
      for (auto& s : src) p.push_back(s.data());
      std::vector<float> out(static_cast<size_t>(D));
      attn_res_mix(p.data(), S, w.data(), D, 1e-5f, out.data(), false);
      auto ref = attn_res_ref(src, w.data(), D, 1e-5);
      double mx = 0;
      for (auto& s : src)
        for (float v : s) mx = std::max(mx, double(std::abs(v)));
      for (int64_t d = 0; d < D; ++d) {
        // Everything is computed in double and rounded once to fp32: the output (a convex
        // combination, |out| <= max |src|) is within half an fp32 ulp, 2^-24 * 2 max|src|.
        EXPECT_NEAR(out[d], ref[d], 1.2e-7 * mx) << D << " " << S << " " << d;
      }
      std::vector<float> o16(static_cast<size_t>(D));
      attn_res_mix(p.data(), S, w.data(), D, 1e-5f, o16.data(), true);
      for (int64_t d = 0; d < D; ++d) {
        EXPECT_EQ(o16[d], round_bf16(out[d])) << "bf16 mode rounds the fp32 result once";
      }
    }
}

TEST(AttnRes, OneSourceIsTheIdentityAndScoresPickTheAlignedSource) {
  const int64_t D = 32;
  auto a = randn(D, 1), b = randn(D, 2);
  std::vector<float> out(D);
  const float* one[] = {a.data()};
  auto w = randn(D, 3);
  attn_res_mix(one, 1, w.data(), D, 1e-5f, out.data(), false);
  for (int64_t d = 0; d < D; ++d) EXPECT_FLOAT_EQ(out[d], a[d]);
  // A weight aligned with b's normalised direction, scaled up, gives b almost all the mass.
  double ms = 0;
  for (float v : b) ms += double(v) * v;
  for (int64_t d = 0; d < D; ++d) w[d] = float(50.0 * b[d] / std::sqrt(ms));
  const float* two[] = {a.data(), b.data()};
  attn_res_mix(two, 2, w.data(), D, 1e-5f, out.data(), false);
  for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(out[d], b[d], 1e-4 * (std::abs(a[d]) + 1));
}

TEST(Situ, MatchesFloat64) {
  const int n = 4096;
  auto g = randn(n, 11, 6.0f), u = randn(n, 12, 30.0f);
  for (float lb : {25.0f, 0.0f}) {
    std::vector<float> out(n), o16(n);
    situ_mul(g.data(), u.data(), n, 4.0f, lb, out.data(), false);
    situ_mul(g.data(), u.data(), n, 4.0f, lb, o16.data(), true);
    for (int i = 0; i < n; ++i) {
      const double uu = lb > 0 ? lb * std::tanh(double(u[i]) / lb) : double(u[i]);
      const double ref = 4.0 * std::tanh(double(g[i]) / 4.0) * sig64(g[i]) * uu;
      // fp32: about 8 correctly or near-correctly rounded operations (division by beta, tanh,
      // exp, the sigmoid's add and division, three products): each within ~2 ulps, so the result
      // is within 16 * 2^-24 ~ 1e-6 relative.
      EXPECT_NEAR(out[i], ref, 1e-6 * std::abs(ref) + 1e-30) << i;
      // bf16 mode: that fp32 value rounded once, within half a bf16 ulp: 2^-8 relative.
      EXPECT_EQ(o16[i], round_bf16(out[i])) << i;
      EXPECT_NEAR(o16[i], ref, (1.0 / 256 + 1e-6) * std::abs(ref) + 1e-30) << i;
    }
  }
  // The soft caps: the gate factor is bounded by beta, the up factor by linear_beta.
  float gate = 1e4f, up = 1e4f, o = 0;
  situ_mul(&gate, &up, 1, 4.0f, 25.0f, &o, false);
  EXPECT_NEAR(o, 100.0f, 1e-3f);
}

TEST(SigmoidGate, MatchesFloat64) {
  const int n = 1024;
  auto x = randn(n, 21, 2.0f), gt = randn(n, 22, 3.0f);
  auto y = x, y16 = x;
  sigmoid_gate_inplace(y.data(), gt.data(), n, false);
  sigmoid_gate_inplace(y16.data(), gt.data(), n, true);
  for (int i = 0; i < n; ++i) {
    const double ref = double(x[i]) * sig64(gt[i]);
    // exp, add, divide, multiply: within 4 * 2 ulps = 5e-7 relative.
    EXPECT_NEAR(y[i], ref, 5e-7 * std::abs(ref) + 1e-30) << i;
    EXPECT_EQ(y16[i], round_bf16(x[i] * round_bf16(sigmoidf(gt[i])))) << i;
  }
}

TEST(KdaBoundedGate, MatchesFloat64AndStaysInTheBound) {
  const int H = 3, K = 16, C = H * K;
  auto f = randn(C, 31, 0.5f), dt = randn(C, 32, 0.3f, -1.2f), alog = randn(H, 33, 0.4f, 0.7f);
  for (float lb : {-5.0f, -0.5f}) {
    auto g = f;
    kda_decay_gate_bounded(g.data(), alog.data(), dt.data(), K, lb, 0, C);
    for (int c = 0; c < C; ++c) {
      const double a = std::exp(double(alog[c / K])), x = double(f[c]) + dt[c];
      const double ref = lb * sig64(a * x);
      // exp (2 ulps relative on a), the fp32 add (half an ulp of |f| + |dt|, absolute), the
      // product and the sigmoid (slope <= 1/4, ~4 ulps): |err| <= |lb| * (4 * 2^-24 +
      // a * (|f| + |dt|) * 2^-24 / 4 * 3) <= |lb| * 1e-6 * (1 + a * (|f| + |dt|)).
      EXPECT_NEAR(g[c], ref, std::abs(lb) * 1e-6 * (1 + a * (std::abs(f[c]) + std::abs(dt[c]))))
          << c;
      EXPECT_LT(g[c], 0.0f);
      EXPECT_GT(g[c], lb);
    }
  }
  // Only [c0, c1) is touched.
  auto g = f;
  kda_decay_gate_bounded(g.data(), alog.data(), dt.data(), K, -5.0f, K, 2 * K);
  for (int c = 0; c < C; ++c)
    if (c < K || c >= 2 * K) {
      EXPECT_EQ(g[c], f[c]);
    }
}

}  // namespace
}  // namespace md::cpu
