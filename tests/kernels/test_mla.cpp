// MLA kernels against a float64 evaluation of the unabsorbed formulation: every cache token is
// expanded into per-head keys [W_UK c ; k_pe] and values W_UV c, then scores, softmax and the
// weighted sum are taken in double. Neither kernel formulation (absorbed decode, explicit prefill)
// is reused by the reference. Both instruction-set copies of the kernels are run.
//
// Tolerances. Each compared output gets its own bound, computed by the reference from the double
// quantities of that very query, so the bound follows the magnitudes actually involved:
//  * fp32 arithmetic (u = 2^-24). A sum of n rounded terms a_i has error sum_k d_k S_k over its
//    partial sums S_k, |d_k| <= u. Treating the d_k as independent and zero-mean (the
//    probabilistic model of Higham & Mary, SIAM J. Sci. Comput. 2019) and the random-signed
//    data's partial sums as |S_k| <~ ||a||_2 gives |error| <= lambda u sqrt(n) ||a||_2, exceeded
//    with probability ~exp(-lambda^2 / 2) per sum; lambda = 8 makes that ~1e-14. (The worst-case
//    bound n u sum|a_i| is ~n times larger and would be looser than the bf16 effects below.)
//    A score is a two-level sum: W c over R then q . [k ; k_pe] over N + P (explicit), or W^T q
//    over N then over R + P (absorbed); both levels are bounded and the larger formulation's
//    bound is taken, so one bound e_t per score serves both kernels. Scores off by e_t scale
//    exp(s_t) by at most exp(e_t) and the normaliser by 1 +- D, D = sum_t p_t (exp(e_t) - 1), so
//    p_t is off by a factor within exp(e_t) / (1 - D); exp, the normaliser's sum, the division and
//    the online rescaling add (8 + sqrt(T)) lambda u. Outputs carry rho_t p_t |v_t| summed over t
//    plus the noise of their own sums (v over R and tokens over T; or tokens over T into the
//    latent and then W_UV over R).
//  * bf16 rounding (round_bf16 = true) against the unrounded float64 result. bf16 keeps 8
//    significant bits, so rounding to nearest moves a value by at most a relative 2^-8. The bf16
//    reference rounds k_nope and v (kv_b_proj's output), each score twice (q . k is a bf16 matmul:
//    fp32 sum rounded; the scale then multiplies that bf16 tensor: rounded again) and p (cast back
//    after the fp32 softmax). Applied to each rounded quantity: k_nope moves a score by
//    e'_t = e_t + scale 2^-8 sum_n |q_n| (|k_tn| + fp32 noise); the two score roundings scale the
//    error so far by (1 + 2^-8)^2 and add ((1 + 2^-8)^2 - 1) |s_t|, i.e. the score error becomes
//    about e'_t + |s_t| 2^-8 (2 + 2^-8); p_t moves by the factor above (with these score errors)
//    times (1 + 2^-8), and each output by
//      sum_t p_t [(1 + rho_t)(1 + 2^-8)(|v_t| + fp32 noise) - |v_t|]  (+ its sums' fp32 noise),
//    typically 13-20% of sum_t p_t |v_t| at the real dims (about 10% from k_nope alone, the rest
//    from the score roundings on scores of a few units): the "looser" tolerance.
//  * Emulated bf16: the reference also rounds at the same five points (k_nope, v, q . k, the
//    scaled score, p). A kernel value within e of the exact x rounds to the same bf16 as x unless
//    [x - e, x + e] straddles a rounding boundary (rounding is monotonic); only then is a
//    difference, the width of rnd([x - e, x + e]), allowed. For the score, x is q . k (with the
//    rounded k_nope), e its fp32 noise plus the k_nope boundary cases, and the interval goes
//    through both roundings, widened by a relative 4u between them for the kernel's fp32 scale and
//    product; outside boundary cases the kernel's score is then exactly the reference's, so only
//    the max subtraction's rounding is left on it. This leaves a bound near fp32 noise, so it
//    checks that the rounding sits exactly where the reference puts it.
// The Discriminates tests show that the bounds reject small mistakes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/mla_test_util.h"
#include "megadecode/base/bf16.h"
#include "megadecode/base/error.h"
#include "megadecode/kernels/cpu/cpu_features.h"
#include "megadecode/kernels/cpu/mla.h"

namespace md::cpu {
namespace {

constexpr double kU32 = 0x1p-24;  // fp32 unit roundoff
constexpr double kUB = 0x1p-8;    // bf16 unit roundoff
constexpr double kLambda = 8.0;   // probabilistic-bound multiplier (see top)
constexpr double kNoise = kLambda * kU32;

// One head's keys and values for every cache row, in double.
struct Expanded {
  std::vector<double> w;     // [N + V][R] kv_b rows of the head
  std::vector<double> kv;    // [T][N + V]: k_nope ; v
  std::vector<double> w2c2;  // [T][N + V]: sum_r w^2 c^2, the squared 2-norm of each dot's terms
};

Expanded expand(const Problem& pb, int h) {
  const MlaDims& d = pb.d;
  const int NV = d.N + d.V;
  Expanded ex;
  ex.w.resize(static_cast<size_t>(NV) * d.R);
  for (size_t i = 0; i < ex.w.size(); ++i) {
    ex.w[i] = bf16_to_f32(pb.kv_b[static_cast<size_t>(h) * NV * d.R + i]);
  }
  ex.kv.resize(static_cast<size_t>(pb.T) * NV);
  ex.w2c2.resize(ex.kv.size());
  for (int t = 0; t < pb.T; ++t) {
    const float* c = pb.cache.data() + t * pb.ldc;
    for (int j = 0; j < NV; ++j) {
      double s = 0, s2 = 0;
      for (int r = 0; r < d.R; ++r) {
        const double a = ex.w[static_cast<size_t>(j) * d.R + r] * c[r];
        s += a;
        s2 += a * a;
      }
      ex.kv[static_cast<size_t>(t) * NV + j] = s;
      ex.w2c2[static_cast<size_t>(t) * NV + j] = s2;
    }
  }
  return ex;
}

enum class Mode {
  kExact,        // float64 result, fp32 tolerance
  kBf16Bound,    // float64 result, tolerance for bf16 rounding of k_nope, v, scores and p
  kBf16Emulated  // float64 with the same bf16 rounding points, fp32 tolerance + boundary cases
};

double rnd(double x) {
  return round_bf16(static_cast<float>(x));
}

struct Ref {
  std::vector<double> o, tol;  // [V]
  double pmax = 0;
};

// Attention of one query of head h (qh: its N + P values) over cache rows [0, nk).
Ref reference(const Problem& pb, const Expanded& ex, const float* qh, int nk, Mode mode,
              double scale) {
  const MlaDims& d = pb.d;
  const int N = d.N, P = d.P, V = d.V, R = d.R, NV = N + V;
  auto cache = [&](int t, int j) { return static_cast<double>(pb.cache[t * pb.ldc + j]); };
  auto at = [&](const std::vector<double>& a, int t, int j) {
    return a[static_cast<size_t>(t) * NV + j];
  };

  // k_nope and v as the kernel sees them (rounded when emulating), with their fp32 noise e and the
  // allowance a for values whose noise interval straddles a bf16 rounding boundary.
  std::vector<double> kv(static_cast<size_t>(nk) * NV), e(kv.size()), a(kv.size(), 0.0);
  for (int t = 0; t < nk; ++t) {
    for (int j = 0; j < NV; ++j) {
      const size_t i = static_cast<size_t>(t) * NV + j;
      e[i] = kNoise * std::sqrt(R * ex.w2c2[i]);
      kv[i] = ex.kv[i];
      if (mode == Mode::kBf16Emulated) {
        kv[i] = rnd(ex.kv[i]);
        a[i] = rnd(ex.kv[i] + e[i]) - rnd(ex.kv[i] - e[i]);
      }
    }
  }

  std::vector<double> ql(R, 0.0);  // W_UK^T q_nope, for the absorbed formulation's noise
  for (int n = 0; n < N; ++n) {
    for (int r = 0; r < R; ++r) ql[r] += qh[n] * ex.w[static_cast<size_t>(n) * R + r];
  }
  std::vector<double> s(nk), es(nk);  // scores and their error bounds
  double smax = -INFINITY, smin = INFINITY, sabs = 0;
  for (int t = 0; t < nk; ++t) {
    double dot = 0, pe2 = 0, first2 = 0, explicit2 = 0, absorbed2 = 0, shift = 0;
    for (int n = 0; n < N; ++n) {
      const double k = at(kv, t, n);
      dot += qh[n] * k;
      first2 += static_cast<double>(qh[n]) * qh[n] * at(ex.w2c2, t, n);
      explicit2 += (qh[n] * k) * (qh[n] * k);
      if (mode == Mode::kBf16Emulated) shift += std::abs(qh[n]) * at(a, t, n);
      if (mode == Mode::kBf16Bound) shift += std::abs(qh[n]) * kUB * (std::abs(k) + at(e, t, n));
    }
    for (int j = 0; j < P; ++j) {
      const double x = qh[N + j] * cache(t, R + j);
      dot += x;
      pe2 += x * x;
    }
    for (int r = 0; r < R; ++r) absorbed2 += (ql[r] * cache(t, r)) * (ql[r] * cache(t, r));
    s[t] = scale * dot;
    // Emulating the rounding (explicit prefill only): k_nope is then exact up to the boundary
    // cases counted in shift, leaving the N + P term sum.
    const double noise =
        mode == Mode::kBf16Emulated
            ? kNoise * std::sqrt((N + P) * (explicit2 + pe2))
            : kNoise * (std::sqrt(std::max(R, N) * first2) +
                        std::sqrt((R + N + P) * (std::max(explicit2, absorbed2) + pe2)));
    es[t] = scale * (noise + shift);
    if (mode == Mode::kBf16Emulated) {
      // The score as the kernel forms it: q . k rounded, times the scale, rounded. The kernel's
      // fp32 q . k lies within dot +- e and its fp32 product with its fp32 scale within a relative
      // 4u of the exact product (scale 2u: sqrt and division; product u); rounding is monotonic,
      // so its score lies in [lo, hi], which is the single value s_t unless a boundary is crossed.
      const double e = noise + shift;
      const double lo_prod = rnd(dot - e) * scale, hi_prod = rnd(dot + e) * scale;
      const double lo = rnd(lo_prod - 4 * kU32 * std::abs(lo_prod));
      const double hi = rnd(hi_prod + 4 * kU32 * std::abs(hi_prod));
      s[t] = rnd(rnd(dot) * scale);
      es[t] = std::max(hi - s[t], s[t] - lo);
    }
    smax = std::max(smax, s[t]);
    smin = std::min(smin, s[t]);
    sabs = std::max(sabs, std::abs(s[t]));
  }
  Ref ref;
  std::vector<double> p(nk), ap(nk, 0.0), rho(nk);
  double z = 0;
  for (int t = 0; t < nk; ++t) z += (p[t] = std::exp(s[t] - smax));
  for (int t = 0; t < nk; ++t) ref.pmax = std::max(ref.pmax, p[t] /= z);
  // p_t moves by a factor within exp(e_t) / (1 - D) (see top; the lower side is closer to 1).
  // The scale product (3u with the fp32 scale's own error) and the max subtraction (twice with
  // online rescaling) round once each. With bf16 rounding, the score is rounded after q . k and
  // after the scale product: each moves it and its error so far by a relative 2^-8 at most. When
  // emulating, the rounded score already covers the scale product (see above).
  const double g = mode == Mode::kBf16Bound ? (1 + kUB) * (1 + kUB) : 1.0;
  double dz = 0;
  for (int t = 0; t < nk; ++t) {
    if (mode == Mode::kBf16Emulated) {
      es[t] += 4 * kU32 * (smax - smin);
    } else {  // g = 1 leaves kExact's e_t as it was
      es[t] = g * (es[t] + (3 * kU32 * sabs + 4 * kU32 * (smax - smin))) + (g - 1) * std::abs(s[t]);
    }
    dz += p[t] * std::expm1(es[t]);
  }
  for (int t = 0; t < nk; ++t) {
    rho[t] = std::exp(es[t]) / (1 - dz) * (1 + kNoise * (std::sqrt(nk) + 8)) - 1;
    if (mode == Mode::kBf16Bound) rho[t] = (1 + rho[t]) * (1 + kUB) - 1;
    if (mode == Mode::kBf16Emulated) {
      ap[t] = rnd(p[t] * (1 + rho[t])) - rnd(p[t] * (1 - rho[t]));
      p[t] = rnd(p[t]);
    }
  }

  std::vector<double> ol(R, 0.0), pc2(R, 0.0);  // sum p_t c_t and sum p_t^2 c_t^2
  for (int t = 0; t < nk; ++t) {
    for (int r = 0; r < R; ++r) {
      ol[r] += p[t] * cache(t, r);
      pc2[r] += p[t] * p[t] * cache(t, r) * cache(t, r);
    }
  }
  ref.o.assign(V, 0.0);
  ref.tol.assign(V, 0.0);
  for (int v = 0; v < V; ++v) {
    const int j = N + v;
    const double* wv = ex.w.data() + static_cast<size_t>(j) * R;
    double o = 0, pv_abs = 0, pv2 = 0, vnoise = 0, shifted = 0, moved = 0;
    for (int t = 0; t < nk; ++t) {
      const double x = at(kv, t, j);
      o += p[t] * x;
      pv_abs += p[t] * std::abs(x);
      moved += rho[t] * p[t] * std::abs(x);
      if (mode == Mode::kBf16Emulated) {
        const double pa = p[t] + ap[t], va = std::abs(x) + at(a, t, j);
        pv2 += pa * va * pa * va;
        shifted += ap[t] * std::abs(x) + pa * at(a, t, j);
      } else {
        pv2 += (p[t] * x) * (p[t] * x);
        vnoise += p[t] * std::sqrt(at(ex.w2c2, t, j));
        if (mode == Mode::kBf16Bound) {
          shifted += p[t] * ((1 + rho[t]) * (1 + kUB) * (std::abs(x) + at(e, t, j)) - std::abs(x));
        }
      }
    }
    double absorbed = 0, wol2 = 0;
    for (int r = 0; r < R; ++r) {
      absorbed += std::abs(wv[r]) * std::sqrt(pc2[r]);
      wol2 += (wv[r] * ol[r]) * (wv[r] * ol[r]);
    }
    // Noise of the value sums: explicit = v's own R-term dot, then the T-term sum over tokens;
    // absorbed = the T-term sum into ol, then the R-term W_UV product.
    const double explicit_noise = std::sqrt(R) * vnoise + std::sqrt(nk * pv2);
    const double absorbed_noise = std::sqrt(nk) * absorbed + std::sqrt(R * wol2);
    double tol = kNoise * std::max(explicit_noise, absorbed_noise) + 2 * kU32 * pv_abs;
    if (mode == Mode::kExact) tol += moved;
    if (mode == Mode::kBf16Bound) tol += shifted;
    if (mode == Mode::kBf16Emulated) {  // k, v, p equal the kernel's up to boundary cases
      tol = kNoise * std::sqrt(nk * pv2) + shifted + 2 * kU32 * pv_abs;
    }
    ref.o[v] = o;
    ref.tol[v] = tol;
  }
  return ref;
}

// Largest |got - ref| / tol over the head's V outputs (<= 1 passes).
double violation(const float* got, const Ref& ref) {
  double worst = 0;
  for (size_t v = 0; v < ref.o.size(); ++v) {
    if (!std::isfinite(got[v])) return INFINITY;
    worst = std::max(worst, std::abs(got[v] - ref.o[v]) / ref.tol[v]);
  }
  return worst;
}

// Realistic-scale check over the queries of one test with at least 37 visible rows: a single
// query may be peaked by chance, so the median of max_t p_t is judged.
class SoftmaxShape {
 public:
  void add(const Ref& ref, int nk) {
    if (nk >= 37) spread_.push_back(ref.pmax * nk), pmax_.push_back(ref.pmax);
  }
  ~SoftmaxShape() {
    if (pmax_.empty()) return;
    std::sort(spread_.begin(), spread_.end());
    std::sort(pmax_.begin(), pmax_.end());
    // Uniform attention has max_t p_t * nk = 1; one-hot has max_t p_t = 1.
    EXPECT_GT(spread_[spread_.size() / 2], 3.0) << "softmax nearly uniform: misses score errors";
    EXPECT_LT(pmax_[pmax_.size() / 2], 0.6) << "softmax nearly one-hot: misses value mixing";
  }

 private:
  std::vector<double> spread_, pmax_;
};

void check_decode(const MlaDims& d, int T, int h0, int h1, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "H=" << d.H << " R=" << d.R << " T=" << T << " heads [" << h0
                                  << "," << h1 << ")");
  const Problem pb = make_problem(d, T, seed);
  const auto q = random_queries(1, d.H * (d.N + d.P), d, seed + 1);
  std::vector<std::vector<float>> outs;
  for (const char* isa : kIsas) {
    ScopedIsa scoped(isa);
    outs.push_back(run_decode(pb, q.data(), T, h0, h1));
  }
  SoftmaxShape shape;
  for (int h = 0; h < d.H; ++h) {
    const bool in_range = h >= h0 && h < h1;
    const Ref ref = in_range ? reference(pb, expand(pb, h), q.data() + h * (d.N + d.P), T,
                                         Mode::kExact, default_scale(d))
                             : Ref{};
    if (in_range) shape.add(ref, T);
    for (size_t k = 0; k < outs.size(); ++k) {
      const float* oh = outs[k].data() + static_cast<size_t>(h) * d.V;
      if (!in_range) {
        for (int v = 0; v < d.V; ++v) ASSERT_TRUE(std::isnan(oh[v])) << "head " << h << " written";
        continue;
      }
      EXPECT_LE(violation(oh, ref), 1.0) << "head " << h << " isa " << isa_name(kIsas[k]);
    }
  }
}

// The decode split over cache rows (partials + merge) against the float64 reference for several
// split counts, including more splits than blocks (empty splits); S = 1 must reproduce
// mla_decode_absorbed bit for bit (the merge of one partial is exact).
void check_split(const MlaDims& d, int T, int S, int h0, int h1, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "T=" << T << " S=" << S << " heads [" << h0 << "," << h1
                                  << ")");
  const Problem pb = make_problem(d, T, seed);
  const auto q = random_queries(1, d.H * (d.N + d.P), d, seed + 1);
  for (const char* isa : kIsas) {
    ScopedIsa scoped(isa);
    const int nh = h1 - h0;
    const int64_t stride = int64_t(nh) * (d.R + 2);
    std::vector<float> parts(static_cast<size_t>(S) * stride, std::nanf(""));
    std::vector<float> ws(mla_partial_scratch_floats(d, nh));
    int covered = 0;
    for (int i = 0; i < S; ++i) {
      int t0 = 0, t1 = 0;
      mla_split_rows(T, S, i, &t0, &t1);
      ASSERT_EQ(t0, covered) << "splits must be contiguous and ascending";
      ASSERT_LE(t0, t1);
      covered = t1;
      mla_decode_partial(q.data(), pb.view(), t0, t1, pb.kv_b.data(), d, h0, h1,
                         parts.data() + i * stride, ws.data());
    }
    ASSERT_EQ(covered, T);
    std::vector<float> out(static_cast<size_t>(d.H) * d.V, std::nanf(""));
    std::vector<float> acc(static_cast<size_t>(d.R));
    mla_decode_merge(parts.data(), stride, S, pb.kv_b.data(), d, h0, h1, out.data(), acc.data());
    const std::vector<float> whole = run_decode(pb, q.data(), T, h0, h1);
    for (int h = h0; h < h1; ++h) {
      const Ref ref = reference(pb, expand(pb, h), q.data() + h * (d.N + d.P), T, Mode::kExact,
                                default_scale(d));
      const float* oh = out.data() + static_cast<size_t>(h) * d.V;
      EXPECT_LE(violation(oh, ref), 1.0) << "head " << h << " isa " << isa_name(isa);
      if (S == 1) {
        for (int v = 0; v < d.V; ++v)
          ASSERT_EQ(oh[v], whole[static_cast<size_t>(h) * d.V + v]) << "S=1 must equal the unsplit";
      }
    }
  }
}

TEST(MlaDecode, SplitOverRowsMatchesReference) {
  for (int T : {1, 15, 16, 17, 100, 300})
    for (int S : {1, 2, 3, 5, 32}) check_split(kSmall, T, S, 0, kSmall.H, 1000 + T * 7 + S);
  check_split(kSmall, 300, 4, 1, 3, 77);
}

TEST(MlaDecode, SmallDims) {
  for (int T : {1, 2, 37, 300}) {
    check_decode(kSmall, T, 0, kSmall.H, 100 + T);
    check_decode(kSmall, T, 1, 3, 200 + T);  // sub-range: other heads untouched
  }
}

TEST(MlaDecode, TwoHeads) {
  const MlaDims d{2, 16, 8, 16, 64};
  for (int T : {1, 2, 37, 300}) check_decode(d, T, 0, 2, 300 + T);
}

TEST(MlaDecode, RealDimsAllHeads) {
  for (int T : {1, 2, 37}) check_decode(kReal, T, 0, kReal.H, 400 + T);
}

TEST(MlaDecode, RealDimsLongerContextSubRange) {
  MlaDims d = kReal;
  d.H = 8;
  check_decode(d, 300, 2, 7, 500);
}

TEST(MlaDecode, SingleRowIsItsValue) {
  // One visible row: p = 1 exactly, so the output is W_UV c_0 whatever the query.
  const Problem pb = make_problem(kSmall, 1, 7);
  auto q = random_queries(1, kSmall.H * (kSmall.N + kSmall.P), kSmall, 8);
  for (auto& x : q) x *= 1e3f;  // huge scores must not matter
  const auto out = run_decode(pb, q.data(), 1, 0, kSmall.H);
  for (int h = 0; h < kSmall.H; ++h) {
    const Expanded ex = expand(pb, h);
    for (int v = 0; v < kSmall.V; ++v) {
      const double want = ex.kv[kSmall.N + v];
      // W_UV c_0 as an R-term fp32 sum (worst case n*u*sum|terms|) plus the normalisation.
      const double tol = (kSmall.R + 2) * kU32 * std::sqrt(kSmall.R * ex.w2c2[kSmall.N + v]);
      EXPECT_NEAR(out[h * kSmall.V + v], want, tol);
    }
  }
}

TEST(MlaDecode, LargeScoresNeedTheMaxShift) {
  // Scores of several hundred: exp overflows fp32 unless the running max is subtracted, and the
  // online rescaling must cope with the max jumping between blocks.
  const int T = 300;
  const Problem pb = make_problem(kSmall, T, 11);
  const int64_t ld = kSmall.H * (kSmall.N + kSmall.P);
  const auto q = random_queries(1, ld, kSmall, 12, 200.0);
  std::vector<float> pre(static_cast<size_t>(kSmall.H) * kSmall.V);
  for (const char* isa : kIsas) {
    ScopedIsa scoped(isa);
    const auto dec = run_decode(pb, q.data(), T, 0, kSmall.H);
    mla_prefill(q.data(), ld, 1, T - 1, pb.view(), pb.kv_b.data(), kSmall, 0, kSmall.H, pre.data(),
                kSmall.H * kSmall.V, false);
    for (int h = 0; h < kSmall.H; ++h) {
      const Ref ref = reference(pb, expand(pb, h), q.data() + h * (kSmall.N + kSmall.P), T,
                                Mode::kExact, default_scale(kSmall));
      EXPECT_LE(violation(dec.data() + h * kSmall.V, ref), 1.0) << "decode head " << h;
      EXPECT_LE(violation(pre.data() + h * kSmall.V, ref), 1.0) << "prefill head " << h;
    }
  }
}

// Prefill of Tq tokens at positions [T0, T0 + Tq) against the reference for each head and token.
void check_prefill(const MlaDims& d, int T0, int Tq, int h0, int h1, bool round, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "H=" << d.H << " R=" << d.R << " T0=" << T0 << " Tq=" << Tq
                                  << " heads [" << h0 << "," << h1 << ") round=" << round);
  const Problem pb = make_problem(d, T0 + Tq, seed);
  const int64_t ldq = d.H * (d.N + d.P) + 5, ldo = d.H * d.V + 7;
  const auto q = random_queries(Tq, ldq, d, seed + 1);
  std::vector<std::vector<float>> outs;
  for (const char* isa : kIsas) {
    ScopedIsa scoped(isa);
    outs.emplace_back(static_cast<size_t>(Tq) * ldo, std::numeric_limits<float>::quiet_NaN());
    mla_prefill(q.data(), ldq, Tq, T0, pb.view(), pb.kv_b.data(), d, h0, h1, outs.back().data(),
                ldo, round);
  }
  SoftmaxShape shape;
  for (int h = 0; h < d.H; ++h) {
    if (h < h0 || h >= h1) {
      for (const auto& out : outs) {
        for (int i = 0; i < Tq; ++i) {
          for (int v = 0; v < d.V; ++v) ASSERT_TRUE(std::isnan(out[i * ldo + h * d.V + v]));
        }
      }
      continue;
    }
    const Expanded ex = expand(pb, h);
    for (int i = 0; i < Tq; ++i) {
      const float* qh = q.data() + i * ldq + h * (d.N + d.P);
      const int nk = T0 + i + 1;
      const Ref ref =
          reference(pb, ex, qh, nk, round ? Mode::kBf16Bound : Mode::kExact, default_scale(d));
      const Ref emu =
          round ? reference(pb, ex, qh, nk, Mode::kBf16Emulated, default_scale(d)) : Ref{};
      shape.add(ref, nk);
      for (size_t k = 0; k < outs.size(); ++k) {
        const float* oh = outs[k].data() + i * ldo + h * d.V;
        EXPECT_LE(violation(oh, ref), 1.0)
            << "head " << h << " token " << i << " isa " << isa_name(kIsas[k]);
        if (round) {
          EXPECT_LE(violation(oh, emu), 1.0)
              << "emulated, head " << h << " token " << i << " isa " << isa_name(kIsas[k]);
        }
      }
    }
  }
  // Padding between rows is never written.
  for (const auto& out : outs) {
    for (int i = 0; i < Tq; ++i) {
      for (int64_t j = d.H * d.V; j < ldo; ++j) ASSERT_TRUE(std::isnan(out[i * ldo + j]));
    }
  }
}

TEST(MlaPrefill, SmallDimsNoPrefix) {
  for (int Tq : {1, 5, 70}) {
    for (bool round : {false, true}) check_prefill(kSmall, 0, Tq, 0, kSmall.H, round, 600 + Tq);
  }
}

TEST(MlaPrefill, SmallDimsWithPrefix) {
  for (int Tq : {1, 5, 70}) {
    for (bool round : {false, true}) check_prefill(kSmall, 45, Tq, 1, 4, round, 700 + Tq);
  }
}

TEST(MlaPrefill, RealDims) {
  MlaDims d = kReal;
  d.H = 4;
  for (bool round : {false, true}) {
    check_prefill(d, 0, 5, 0, 4, round, 800);
    check_prefill(d, 40, 70, 1, 3, round, 801);
  }
  for (bool round : {false, true}) check_prefill(kReal, 3, 1, 0, kReal.H, round, 802);
}

// The absorbed decode of the token at position T0 + i and the explicit prefill of the same token
// approximate the same exact value, each within its bound, so they differ by at most the sum.
TEST(MlaConsistency, DecodeMatchesPrefill) {
  for (const MlaDims& d : {kSmall, MlaDims{4, 128, 64, 128, 512}}) {
    const int T0 = 30, Tq = 5;
    const Problem pb = make_problem(d, T0 + Tq, 900 + d.R);
    const int64_t ldq = d.H * (d.N + d.P);
    const auto q = random_queries(Tq, ldq, d, 901);
    std::vector<float> pre(static_cast<size_t>(Tq) * d.H * d.V);
    mla_prefill(q.data(), ldq, Tq, T0, pb.view(), pb.kv_b.data(), d, 0, d.H, pre.data(), d.H * d.V,
                false);
    for (int h = 0; h < d.H; ++h) {
      const Expanded ex = expand(pb, h);
      for (int i = 0; i < Tq; ++i) {
        const auto dec = run_decode(pb, q.data() + i * ldq, T0 + i + 1, 0, d.H);
        const Ref ref = reference(pb, ex, q.data() + i * ldq + h * (d.N + d.P), T0 + i + 1,
                                  Mode::kExact, default_scale(d));
        for (int v = 0; v < d.V; ++v) {
          EXPECT_NEAR(dec[h * d.V + v], pre[(i * d.H + h) * d.V + v], 2 * ref.tol[v])
              << "R=" << d.R << " head " << h << " token " << i << " v " << v;
        }
      }
    }
  }
}

// The bounds must be able to fail: each test feeds a small, plausible mistake and expects a
// violation.
TEST(MlaDiscriminates, WrongScale) {
  // 1/sqrt(N) instead of 1/sqrt(N + P): a plausible bug (forgetting the rope part).
  const Problem pb = make_problem(kReal, 300, 1000);
  const auto q = random_queries(1, kReal.H * (kReal.N + kReal.P), kReal, 1001);
  const auto out = run_decode(pb, q.data(), 300, 0, 1);
  const Expanded ex = expand(pb, 0);
  const Ref wrong = reference(pb, ex, q.data(), 300, Mode::kExact, 1.0 / std::sqrt(kReal.N));
  EXPECT_GT(violation(out.data(), wrong), 10.0);
}

TEST(MlaDiscriminates, Bf16RoundingIsVisible) {
  // The fp32 tolerance must reject a result with bf16 rounding, and the emulated-rounding
  // tolerance must reject a result without it: so both tests above check the rounding points.
  MlaDims d = kReal;
  d.H = 1;
  const int T0 = 20, Tq = 40;
  const Problem pb = make_problem(d, T0 + Tq, 1100);
  const int64_t ld = d.N + d.P;
  const auto q = random_queries(Tq, ld, d, 1101);
  std::vector<float> rounded(static_cast<size_t>(Tq) * d.V), plain(rounded.size());
  mla_prefill(q.data(), ld, Tq, T0, pb.view(), pb.kv_b.data(), d, 0, 1, rounded.data(), d.V, true);
  mla_prefill(q.data(), ld, Tq, T0, pb.view(), pb.kv_b.data(), d, 0, 1, plain.data(), d.V, false);
  const Expanded ex = expand(pb, 0);
  double rounded_vs_exact = 0, plain_vs_emulated = 0;
  for (int i = 0; i < Tq; ++i) {
    const float* qi = q.data() + i * ld;
    const Ref exact = reference(pb, ex, qi, T0 + i + 1, Mode::kExact, default_scale(d));
    const Ref emu = reference(pb, ex, qi, T0 + i + 1, Mode::kBf16Emulated, default_scale(d));
    rounded_vs_exact = std::max(rounded_vs_exact, violation(rounded.data() + i * d.V, exact));
    plain_vs_emulated = std::max(plain_vs_emulated, violation(plain.data() + i * d.V, emu));
  }
  EXPECT_GT(rounded_vs_exact, 3.0);
  EXPECT_GT(plain_vs_emulated, 3.0);
}

}  // namespace
}  // namespace md::cpu
