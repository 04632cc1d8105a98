// KDA kernels against float64 implementations written straight from the formulas of kda.h /
// the transformers kimi_linear reference they were taken from. Every test
// runs the portable path and, where the CPU has it, the AVX-512 path.
//
// Tolerances are stated in units of fp32 epsilon (kEps = 2^-23, 1.19e-7) and, for the vector
// outputs of the recurrence, relative to the largest magnitude of the reference quantity
// (norm-wise error): an output element is a dot product of K terms and can be small through
// cancellation while its rounding error scales with the terms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/kernels/cpu/cpu_features.h"
#include "megadecode/kernels/cpu/kda.h"

namespace md::cpu {
namespace {

constexpr double kEps = 1.0 / (1 << 23);

// Runs `body` once per KDA implementation the CPU has (portable, the portable primitives compiled
// for AVX2 at the avx2 level, and AVX-512 at the avx512 level), then restores the start-up ISA
// level.
void for_each_isa(const std::function<void()>& body) {
  std::vector<Isa> levels = {Isa::kPortable};
  if (hardware_isa() >= Isa::kAvx2) levels.push_back(Isa::kAvx2);
  if (hardware_isa() >= Isa::kAvx512) levels.push_back(Isa::kAvx512);
  for (Isa level : levels) {
    set_isa(level);
    SCOPED_TRACE(std::string("isa=") + kda_isa());
    body();
  }
  reset_isa();
}

std::vector<float> normal(std::mt19937_64& rng, size_t n, double sd = 1.0) {
  std::normal_distribution<double> d(0.0, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(d(rng));
  return v;
}

std::vector<float> uniform(std::mt19937_64& rng, size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(d(rng));
  return v;
}

// Log decays with exp(g) uniform in [lo, hi]: the state keeps a real memory, so a wrong decay or
// update shows in the outputs of later tokens instead of being forgotten at once.
std::vector<float> log_decays(std::mt19937_64& rng, size_t n, double lo = 0.2, double hi = 0.95) {
  auto v = uniform(rng, n, lo, hi);
  for (auto& x : v) x = std::log(x);
  return v;
}

double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// ----------------------------------------------------------------------------------------------
// Short convolution.

double silu64(double x) {
  return x / (1.0 + std::exp(-x));
}

// out = silu(sum_j w_j win_j) in float64; with round, the two bf16 rounding points of the
// reference (applied to the float64 value rounded to fp32 first).
double conv_ref(const float* w, const std::vector<double>& win, bool round) {
  double acc = 0.0;
  for (size_t j = 0; j < win.size(); ++j) acc += double{w[j]} * win[j];
  if (!round) return silu64(acc);
  const double a = round_bf16(static_cast<float>(acc));
  return round_bf16(static_cast<float>(silu64(a)));
}

double conv_abs_sum(const float* w, const std::vector<double>& win) {
  double s = 0.0;
  for (size_t j = 0; j < win.size(); ++j) s += std::abs(double{w[j]} * win[j]);
  return s;
}

// Checks one conv output. fp32 path: the W-term sum errs by at most W eps sum|w x| and SiLU
// (derivative in [-0.1, 1.1]) adds a few ulp of the result: 8 eps sum|w x| + 4 eps |ref|.
// bf16 path: the kernel's fp32 sum and SiLU may land on the other side of a bf16 rounding
// boundary than the float64 value, so an output may differ by one bf16 step (2^-7 relative, two
// to cover the two rounding points); the caller bounds how often that happens.
void check_conv(float got, double ref, double abs_sum, bool round, int* mismatches) {
  if (!round) {
    EXPECT_NEAR(got, ref, 8 * kEps * abs_sum + 4 * kEps * std::abs(ref) + 1e-30);
    return;
  }
  EXPECT_EQ(got, round_bf16(got)) << "output is not a bf16 value";
  EXPECT_NEAR(got, ref, 2.0 * std::ldexp(std::abs(ref), -7) + 1e-30);
  if (got != ref) ++*mismatches;
}

// bf16-valued data, as the projections of the bf16 model produce.
std::vector<float> bf16_normal(std::mt19937_64& rng, size_t n, double sd) {
  auto v = normal(rng, n, sd);
  for (auto& x : v) x = round_bf16(x);
  return v;
}

TEST(KdaShortConv, DecodeMatchesFormulaOnSubRange) {
  for (bool round : {false, true}) {
    for (int W : {4, 1}) {
      SCOPED_TRACE("round=" + std::to_string(round) + " W=" + std::to_string(W));
      const int64_t C = 300, c0 = 7, c1 = 291;
      std::mt19937_64 rng(11 + W);
      auto x = bf16_normal(rng, C, 1.0);
      auto cache = bf16_normal(rng, (W - 1) * C, 1.0);
      auto w = bf16_normal(rng, C * W, 0.5);
      const auto cache0 = cache;
      std::vector<float> out(C, -7.0f);
      short_conv_decode(x.data(), cache.data(), w.data(), W, C, c0, c1, out.data(), round);
      int mism = 0;
      for (int64_t c = 0; c < C; ++c) {
        if (c < c0 || c >= c1) {
          EXPECT_EQ(out[c], -7.0f) << c;
          for (int j = 0; j < W - 1; ++j) EXPECT_EQ(cache[j * C + c], cache0[j * C + c]);
          continue;
        }
        std::vector<double> win;
        for (int j = 0; j < W - 1; ++j) win.push_back(cache0[j * C + c]);
        win.push_back(x[c]);
        check_conv(out[c], conv_ref(&w[c * W], win, round), conv_abs_sum(&w[c * W], win), round,
                   &mism);
        // The cache shifts by one: oldest dropped, the new input appended.
        for (int j = 0; j + 1 < W - 1; ++j) EXPECT_EQ(cache[j * C + c], cache0[(j + 1) * C + c]);
        if (W > 1) {
          EXPECT_EQ(cache[(W - 2) * C + c], x[c]);
        }
      }
      EXPECT_LE(mism, (c1 - c0) / 100) << "too many bf16 rounding disagreements";
    }
  }
}

TEST(KdaShortConv, PrefillMatchesFormulaAndDecode) {
  const int64_t C = 96, c0 = 3, c1 = 90;
  for (bool round : {false, true}) {
    for (int W : {4, 2, 1}) {
      for (int T : {1, 2, 3, 9}) {  // T < W - 1 keeps part of the old cache
        SCOPED_TRACE("round=" + std::to_string(round) + " W=" + std::to_string(W) +
                     " T=" + std::to_string(T));
        std::mt19937_64 rng(100 * W + T);
        const int64_t ldx = C + 5, ldo = C + 2;
        auto x = bf16_normal(rng, T * ldx, 1.0);
        auto cache0 = bf16_normal(rng, (W - 1) * C, 1.0);
        auto w = bf16_normal(rng, C * W, 0.5);
        auto cache = cache0;
        std::vector<float> out(T * ldo, -7.0f);
        short_conv_prefill(x.data(), T, ldx, cache.data(), w.data(), W, C, c0, c1, out.data(), ldo,
                           round);
        // The same tokens one at a time through decode.
        auto dcache = cache0;
        std::vector<float> dout(C, -7.0f);
        int mism = 0;
        for (int t = 0; t < T; ++t) {
          short_conv_decode(&x[t * ldx], dcache.data(), w.data(), W, C, c0, c1, dout.data(), round);
          for (int64_t c = 0; c < C; ++c) {
            const float got = out[t * ldo + c];
            if (c < c0 || c >= c1) {
              EXPECT_EQ(got, -7.0f);
              continue;
            }
            // Window of the stream [cache0 rows, x rows] ending at token t.
            std::vector<double> win;
            for (int j = 0; j < W; ++j) {
              const int tau = t - (W - 1) + j;
              win.push_back(tau >= 0 ? x[tau * ldx + c] : cache0[(W - 1 + tau) * C + c]);
            }
            check_conv(got, conv_ref(&w[c * W], win, round), conv_abs_sum(&w[c * W], win), round,
                       &mism);
            EXPECT_NEAR(got, dout[c], 1e-6 * (std::abs(dout[c]) + 1e-3));
          }
        }
        EXPECT_LE(mism, T * (c1 - c0) / 100 + 1);
        // The final cache seeds decode: it must be exactly what T decode steps leave.
        EXPECT_EQ(cache, dcache);
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Decay gate and gated norm.

TEST(KdaDecayGate, MatchesFormulaIncludingSoftplusThreshold) {
  const int K = 16, H = 3;
  std::mt19937_64 rng(5);
  auto f = uniform(rng, H * K, -30.0, 30.0);
  auto dt = uniform(rng, H * K, -2.0, 2.0);
  const std::vector<float> A_log = {-1.5f, 0.0f, 1.2f};
  // Around the threshold: x = f + dt exactly 20, just above, far above (log(1 + exp(x)) is +inf
  // in fp32 beyond x ~ 88.7, so a missing threshold shows as -inf).
  f[K + 1] = 20.0f, dt[K + 1] = 0.0f;
  f[K + 2] = 20.5f, dt[K + 2] = 0.0f;
  f[K + 3] = 100.0f, dt[K + 3] = 0.5f;
  f[2 * K + 4] = 1000.0f, dt[2 * K + 4] = 0.0f;
  f[2 * K + 5] = -40.0f, dt[2 * K + 5] = 0.0f;
  const int64_t c0 = 1, c1 = H * K - 2;
  auto out = f;
  kda_decay_gate(out.data(), A_log.data(), dt.data(), K, c0, c1);
  for (int64_t c = 0; c < H * K; ++c) {
    if (c < c0 || c >= c1) {
      EXPECT_EQ(out[c], f[c]);
      continue;
    }
    const double x = static_cast<float>(f[c] + dt[c]);  // the kernel's fp32 pre-activation
    const double rate = std::exp(double{A_log[c / K]});
    const double sp = x > 20.0 ? x : std::log1p(std::exp(x));
    const double ref = -rate * sp;
    // fp32: exp(A_log) and the product are 1 ulp each; log(1 + exp(x)) errs by ~eps absolute
    // (the rounding of 1 + exp(x), which the reference shares) plus an ulp of its value.
    EXPECT_NEAR(out[c], ref, rate * 4 * kEps * (1.0 + sp)) << "c=" << c << " x=" << x;
    EXPECT_LE(out[c], 0.0f);
    EXPECT_TRUE(std::isfinite(out[c]));
  }
  // Above the threshold softplus is the identity, exactly.
  EXPECT_EQ(out[K + 2], -std::exp(A_log[1]) * 20.5f);
  EXPECT_EQ(out[2 * K + 4], -std::exp(A_log[2]) * 1000.0f);
}

TEST(KdaGatedNorm, MatchesFormula) {
  for (int K : {16, 128}) {
    const int H = 4, h0 = 1, h1 = 4;
    const float eps = 1e-5f;
    std::mt19937_64 rng(K);
    auto o = normal(rng, H * K, 2.0);
    auto gate = normal(rng, H * K, 3.0);
    auto w = uniform(rng, K, 0.5, 1.5);
    // A head with mean(o^2) ~ eps, so that eps and its placement matter.
    for (int i = 0; i < K; ++i) o[2 * K + i] *= 1.5e-3f;
    auto out = o;
    kda_gated_norm(out.data(), gate.data(), w.data(), K, h0, h1, eps);
    for (int h = 0; h < H; ++h) {
      double ms = 0.0;
      for (int i = 0; i < K; ++i) ms += double{o[h * K + i]} * o[h * K + i];
      ms /= K;
      for (int i = 0; i < K; ++i) {
        const int c = h * K + i;
        if (h < h0 || h >= h1) {
          EXPECT_EQ(out[c], o[c]);
          continue;
        }
        const double ref = o[c] / std::sqrt(ms + eps) * w[i] / (1.0 + std::exp(-double{gate[c]}));
        // Six fp32 roundings (sqrt, division, three products, sigmoid's exp and division) of
        // relative size eps each, plus the fp32 rounding of mean + eps.
        EXPECT_NEAR(out[c], ref, 8 * kEps * std::abs(ref) + 1e-30) << "h=" << h << " i=" << i;
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Recurrence: float64 reference.

// One decode step in float64, straight from kda.h: l2-normalise q (then scale by K^-0.5) and k,
// S = diag(exp(g)) S, u = v - S^T k, S += k (beta u)^T, o = S^T q.
void ref_step(std::vector<double>& S, int K, const float* q, const float* k, const float* v,
              const float* g, double beta, double* o) {
  double sq = 0, sk = 0;
  for (int i = 0; i < K; ++i) {
    sq += double{q[i]} * q[i];
    sk += double{k[i]} * k[i];
  }
  std::vector<double> qn(K), kn(K), u(K);
  for (int i = 0; i < K; ++i) {
    qn[i] = q[i] / std::sqrt(sq + 1e-6) / std::sqrt(double(K));
    kn[i] = k[i] / std::sqrt(sk + 1e-6);
  }
  for (int i = 0; i < K; ++i) {
    const double e = std::exp(double{g[i]});
    for (int j = 0; j < K; ++j) S[i * K + j] *= e;
  }
  for (int j = 0; j < K; ++j) {
    double s = 0;
    for (int i = 0; i < K; ++i) s += S[i * K + j] * kn[i];
    u[j] = v[j] - s;
  }
  for (int i = 0; i < K; ++i) {
    for (int j = 0; j < K; ++j) S[i * K + j] += kn[i] * beta * u[j];
  }
  for (int j = 0; j < K; ++j) {
    double s = 0;
    for (int i = 0; i < K; ++i) s += S[i * K + j] * qn[i];
    o[j] = s;
  }
}

// T tokens of H heads in the layout the layer uses: q, k, v, g as [T][H*K], beta as [T][H].
struct Seq {
  int T, H, K;
  std::vector<float> q, k, v, g, beta, S0;  // S0: [H][K][K]
  int64_t ld() const { return int64_t{H} * K; }
};

Seq make_seq(int T, int H, int K, uint64_t seed, double dlo = 0.2, double dhi = 0.95) {
  std::mt19937_64 rng(seed);
  Seq s{T, H, K, {}, {}, {}, {}, {}, {}};
  const size_t n = size_t(T) * H * K;
  s.q = normal(rng, n);
  s.k = normal(rng, n);
  s.v = normal(rng, n);
  s.g = log_decays(rng, n, dlo, dhi);
  s.beta = uniform(rng, size_t(T) * H, 0.05, 0.95);
  s.S0 = normal(rng, size_t(H) * K * K, 0.5);
  return s;
}

// Reference outputs [T][K] and final state of head h.
void ref_head(const Seq& s, int h, int T, std::vector<double>& o, std::vector<double>& S) {
  const int K = s.K;
  S.assign(s.S0.begin() + int64_t{h} * K * K, s.S0.begin() + int64_t{h + 1} * K * K);
  o.assign(size_t(T) * K, 0.0);
  for (int t = 0; t < T; ++t) {
    const int64_t r = t * s.ld() + int64_t{h} * K;
    ref_step(S, K, &s.q[r], &s.k[r], &s.v[r], &s.g[r], s.beta[t * s.H + h], &o[size_t(t) * K]);
  }
}

// Norm-wise error max|got - ref| / max|ref|.
double rel_err(const float* got, int64_t ld_got, const std::vector<double>& ref, int rows,
               int cols) {
  double e = 0.0;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      e = std::max(e, std::abs(got[r * ld_got + c] - ref[size_t(r) * cols + c]));
    }
  }
  return e / max_abs(ref);
}

// Decode: each step's u and o are K-term fp32 dot products (error ~sqrt(K) eps typical, K eps
// worst case, relative to the terms, which are of the size of the outputs since |k| = |q| K^0.5
// = 1), and state errors are not amplified later (decay <= 1, and I - beta k k^T has norm <= 1
// for beta in [0, 1]). 32 eps covers K = 128 with margin over the measured <= 6 eps (40 random
// runs of 20 steps per K); a wrong scale, eps or update order errs by percents.
constexpr double kDecodeTol = 32 * kEps;
// Chunked prefill: the longest fp32 sums are the chunk's 64-term sums (state update, forward
// substitution, intra-chunk output) and the K-term dots, whose terms each carry ~1.5 ulp (an
// exponential and products); linear worst-case growth gives 64 x 1.5 = 96 eps, and the forward
// substitution does not amplify errors (|A_ts| <= beta_t < 1 and the recurrence is contractive).
// Measured: <= 25 eps (final state) and <= 16 eps (outputs) over ~1000 random cases with K in
// {16, 24, 64, 128}. A wrong formula errs by > 1e-2; even an exponential that is 220 ulp off
// (a wrong 1/24 Taylor coefficient) shows as ~130 eps and fails.
constexpr double kPrefillTol = 96 * kEps;

TEST(KdaDecode, MatchesFloat64Recurrence) {
  for_each_isa([] {
    for (int K : {16, 24, 32, 64, 128}) {
      SCOPED_TRACE("K=" + std::to_string(K));
      const int T = 12;
      Seq s = make_seq(T, 1, K, 1000 + K);
      std::vector<double> o_ref, S_ref;
      ref_head(s, 0, T, o_ref, S_ref);
      std::vector<float> S = s.S0, o(size_t(T) * K);
      for (int t = 0; t < T; ++t) {
        const int64_t r = int64_t{t} * K;
        kda_decode_head(S.data(), &s.q[r], &s.k[r], &s.v[r], &s.g[r], s.beta[t], K, &o[r]);
      }
      EXPECT_LT(rel_err(o.data(), K, o_ref, T, K), kDecodeTol);
      EXPECT_LT(rel_err(S.data(), K, S_ref, K, K), kDecodeTol);
    }
  });
}

// With |q|^2 and |k|^2 ~ 1e-4 the 1e-6 inside the l2 norm changes outputs by ~0.5%, so a wrong
// eps (or one applied as max(|x|, eps)) fails here even though it is invisible for unit vectors.
TEST(KdaDecode, SmallNormsSeeTheL2Epsilon) {
  for_each_isa([] {
    const int K = 128, T = 4;
    Seq s = make_seq(T, 1, K, 77);
    for (auto& x : s.q) x *= 1e-3f;
    for (auto& x : s.k) x *= 1e-3f;
    std::vector<double> o_ref, S_ref;
    ref_head(s, 0, T, o_ref, S_ref);
    std::vector<float> S = s.S0, o(size_t(T) * K);
    for (int t = 0; t < T; ++t) {
      const int64_t r = int64_t{t} * K;
      kda_decode_head(S.data(), &s.q[r], &s.k[r], &s.v[r], &s.g[r], s.beta[t], K, &o[r]);
    }
    EXPECT_LT(rel_err(o.data(), K, o_ref, T, K), kDecodeTol);
    EXPECT_LT(rel_err(S.data(), K, S_ref, K, K), kDecodeTol);
  });
}

// Runs kda_prefill_head on head h of `s` (strided layout; o with a padded row stride).
void run_prefill(const Seq& s, int h, int T, int chunk, std::vector<float>& S,
                 std::vector<float>& o, int64_t ldo) {
  const int K = s.K;
  S.assign(s.S0.begin() + int64_t{h} * K * K, s.S0.begin() + int64_t{h + 1} * K * K);
  o.assign(size_t(T) * ldo, 0.0f);
  const int64_t off = int64_t{h} * K;
  kda_prefill_head(S.data(), &s.q[off], &s.k[off], &s.v[off], &s.g[off], &s.beta[h], s.H, T, K,
                   s.ld(), o.data(), ldo, chunk);
}

TEST(KdaPrefill, MatchesFloat64Recurrence) {
  for_each_isa([] {
    for (int K : {16, 24, 128}) {
      for (int T : {1, 5, 63, 64, 65, 130, 200}) {
        SCOPED_TRACE("K=" + std::to_string(K) + " T=" + std::to_string(T));
        const int H = 2, h = 1;
        Seq s = make_seq(T, H, K, 31 * T + K);
        std::vector<double> o_ref, S_ref;
        ref_head(s, h, T, o_ref, S_ref);
        std::vector<float> S, o;
        const int64_t ldo = K + 3;
        run_prefill(s, h, T, 64, S, o, ldo);
        EXPECT_LT(rel_err(o.data(), ldo, o_ref, T, K), kPrefillTol);
        EXPECT_LT(rel_err(S.data(), K, S_ref, K, K), kPrefillTol);
      }
    }
  });
}

// Other chunk sizes (1 degenerates to the recurrence) and slow decays (0.97..1: long memory, the
// regime where errors in the inter-chunk state would accumulate).
TEST(KdaPrefill, OtherChunksAndSlowDecay) {
  for_each_isa([] {
    const int K = 64, T = 90;
    for (int chunk : {1, 16, 40, 64, 128}) {
      for (bool slow : {false, true}) {
        SCOPED_TRACE("chunk=" + std::to_string(chunk) + " slow=" + std::to_string(slow));
        Seq s = slow ? make_seq(T, 1, K, 5, 0.97, 1.0) : make_seq(T, 1, K, 6);
        std::vector<double> o_ref, S_ref;
        ref_head(s, 0, T, o_ref, S_ref);
        std::vector<float> S, o;
        run_prefill(s, 0, T, chunk, S, o, K);
        EXPECT_LT(rel_err(o.data(), K, o_ref, T, K), kPrefillTol);
        EXPECT_LT(rel_err(S.data(), K, S_ref, K, K), kPrefillTol);
      }
    }
  });
}

// Some channels with log decays of -30 per token: their cumulative decay reaches -1900 within a
// chunk, so exp(-gc) alone would overflow to inf (and inf * 0 = NaN). Differences of cumulative
// decays stay finite; the wiped channels must simply forget, like the recurrence.
TEST(KdaPrefill, StrongDecayChannelsStayFinite) {
  for_each_isa([] {
    const int K = 128, T = 130;
    Seq s = make_seq(T, 1, K, 9);
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < K; i += 5) s.g[size_t(t) * K + i] = -30.0f;
    }
    std::vector<double> o_ref, S_ref;
    ref_head(s, 0, T, o_ref, S_ref);
    std::vector<float> S, o;
    run_prefill(s, 0, T, 64, S, o, K);
    for (float x : o) ASSERT_TRUE(std::isfinite(x));
    EXPECT_LT(rel_err(o.data(), K, o_ref, T, K), kPrefillTol);
    EXPECT_LT(rel_err(S.data(), K, S_ref, K, K), kPrefillTol);
  });
}

// The prefill's final state seeds decode: prefill of T1 tokens then T2 decode steps must give the
// outputs of decoding all T1 + T2 tokens (both within their tolerances of the float64 run).
TEST(KdaPrefill, ThenDecodeEqualsDecodingEverything) {
  for_each_isa([] {
    for (int K : {32, 128}) {
      SCOPED_TRACE("K=" + std::to_string(K));
      const int T1 = 70, T2 = 6, T = T1 + T2;
      Seq s = make_seq(T, 1, K, 404 + K);
      std::vector<double> o_ref, S_ref;
      ref_head(s, 0, T, o_ref, S_ref);
      // Path 1: prefill T1, then decode.
      std::vector<float> S1, o1;
      run_prefill(s, 0, T1, 64, S1, o1, K);
      o1.resize(size_t(T) * K);
      for (int t = T1; t < T; ++t) {
        const int64_t r = int64_t{t} * K;
        kda_decode_head(S1.data(), &s.q[r], &s.k[r], &s.v[r], &s.g[r], s.beta[t], K, &o1[r]);
      }
      // Path 2: decode everything.
      std::vector<float> S2 = s.S0, o2(size_t(T) * K);
      for (int t = 0; t < T; ++t) {
        const int64_t r = int64_t{t} * K;
        kda_decode_head(S2.data(), &s.q[r], &s.k[r], &s.v[r], &s.g[r], s.beta[t], K, &o2[r]);
      }
      std::vector<double> o2d(o2.begin(), o2.end()), S2d(S2.begin(), S2.end());
      EXPECT_LT(rel_err(o1.data(), K, o2d, T, K), kPrefillTol + kDecodeTol);
      EXPECT_LT(rel_err(S1.data(), K, S2d, K, K), kPrefillTol + kDecodeTol);
      EXPECT_LT(rel_err(o1.data(), K, o_ref, T, K), kPrefillTol);
      EXPECT_LT(rel_err(o2.data(), K, o_ref, T, K), kDecodeTol);
    }
  });
}

}  // namespace
}  // namespace md::cpu
