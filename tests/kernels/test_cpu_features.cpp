// The ISA dispatch (cpu_features.h): detection, the level API, and every kernel family run at every
// level this CPU has (portable, avx2, avx512, avx512bf16), each compared with a float64 reference
// and with the portable path. Levels the CPU lacks are skipped with the missing features named.
#include "megadecode/kernels/cpu/cpu_features.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/bandwidth.h"
#include "megadecode/kernels/cpu/kda.h"
#include "megadecode/kernels/cpu/matmul.h"
#include "megadecode/kernels/cpu/mla.h"
#include "megadecode/kernels/cpu/mxfp4.h"

namespace md::cpu {
namespace {

constexpr double kU = 0x1p-24;  // unit roundoff of fp32 (round to nearest)

// gamma_n = n u / (1 - n u): the factor of the standard bound on n roundings of a sum.
double gamma(double n) {
  return n * kU / (1 - n * kU);
}

TEST(CpuFeatures, LevelsAreConsistent) {
  const Isa hw = hardware_isa();
  EXPECT_EQ(missing_features(hw), "");
  EXPECT_EQ(missing_features(Isa::kPortable), "");
  if (hw != Isa::kAvx512Bf16) {
    EXPECT_NE(missing_features(static_cast<Isa>(static_cast<int>(hw) + 1)), "");
  }
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(hw >= Isa::kAvx2, f.avx2 && f.fma && f.popcnt && f.f16c);
  EXPECT_EQ(hw >= Isa::kAvx512,
            hw >= Isa::kAvx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq);
  EXPECT_EQ(hw >= Isa::kAvx512Bf16, hw >= Isa::kAvx512 && f.avx512bf16);
  // In particular a CPU with AVX-512F but not BW/VL/DQ stays below the avx512 level, whose files
  // are compiled with all four.
}

TEST(CpuFeatures, NamesRoundTrip) {
  for (int i = 0; i < kNumIsas; ++i) {
    Isa got = Isa::kPortable;
    ASSERT_TRUE(parse_isa(isa_name(static_cast<Isa>(i)), &got));
    EXPECT_EQ(static_cast<int>(got), i);
  }
  Isa untouched = Isa::kAvx2;
  EXPECT_FALSE(parse_isa("avx-512", &untouched));
  EXPECT_FALSE(parse_isa("auto", &untouched));
  EXPECT_EQ(untouched, Isa::kAvx2);
}

TEST(CpuFeatures, SetIsaClampsAndScopedIsaRestores) {
  const Isa start = active_isa();
  {
    ScopedIsa s(Isa::kAvx512Bf16);
    EXPECT_EQ(s.level(), hardware_isa());  // clamped to what the CPU has
    EXPECT_EQ(active_isa(), hardware_isa());
    {
      ScopedIsa p(Isa::kPortable);
      EXPECT_EQ(active_isa(), Isa::kPortable);
      EXPECT_STREQ(matmul_isa(), "portable");
      EXPECT_STREQ(matmul_mxfp4_isa(), "portable");
      EXPECT_STREQ(kda_isa(), "portable");
      EXPECT_STREQ(mla_isa(), "portable");
    }
    EXPECT_EQ(active_isa(), hardware_isa());
  }
  EXPECT_EQ(active_isa(), start);
  EXPECT_EQ(reset_isa(), start);
}

// An unknown or unsupported MEGADECODE_ISA warns and falls back; it must never abort. The value is
// read once per process, so this runs the CLI (which links the same library) in a child process.
TEST(CpuFeatures, BadEnvironmentValueOnlyWarns) {
  const std::string path = ::testing::TempDir() + "md_cpu_features_env.txt";
  const std::string cmd =
      std::string("MEGADECODE_ISA=no-such-isa ") + MD_CLI_PATH + " --help > /dev/null 2> " + path;
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::string err;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof buf, f)) err += buf;
    std::fclose(f);
  }
  std::remove(path.c_str());
  EXPECT_NE(err.find("MEGADECODE_ISA='no-such-isa' is not one of"), std::string::npos) << err;
}

// ---- Every family at every level ---------------------------------------------------------------

class IsaPath : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    level_ = static_cast<Isa>(GetParam());
    const std::string missing = missing_features(level_);
    if (!missing.empty()) {
      GTEST_SKIP() << "CPU lacks " << missing << " needed by the " << isa_name(level_) << " level";
    }
  }
  void TearDown() override { reset_isa(); }
  // Runs f at the level under test, then at the portable level (for the cross-path check).
  template <class F>
  void both(F&& f, std::vector<float>& at_level, std::vector<float>& portable) {
    ASSERT_EQ(set_isa(level_), level_);
    at_level = f();
    set_isa(Isa::kPortable);
    portable = f();
  }
  Isa level_ = Isa::kPortable;
};

std::string level_name(const ::testing::TestParamInfo<int>& info) {
  return isa_name(static_cast<Isa>(info.param));
}

// Tolerance of the matmul kernels, bf16 (or fp32) operands with fp32 accumulation. A product of two
// bf16 values (8-bit significands) is exact in fp32, so the only roundings are those of the sums
// (and, on the portable path, of the fp32 x fp32 product for fp32 X or weights, which is rounded
// once before its add). Every path spreads K over L >= 8 lanes, each lane adding its ceil(K/L)
// terms in order, then reduces the L lanes in a tree of depth log2(L) <= 4 (vdpbf16ps adds its
// two products in sequence, so it is the same as 16 lanes of 2K/16 terms). A term therefore passes
// through at most n = ceil(K/8) + 5 roundings (product, lane sum, tree), and the standard
// recursive-summation bound gives |y - exact| <= gamma_n sum_k |w_k x_k|. Two paths each within
// that bound of the exact value are within twice it of each other.
double matmul_bound(int64_t K, double sum_abs) {
  return gamma(static_cast<double>((K + 7) / 8 + 5)) * sum_abs;
}

TEST_P(IsaPath, MatmulBf16AndF32) {
  Rng rng(7);
  for (int64_t K : {1, 15, 16, 33, 100, 1000}) {
    for (int B : {1, 3, 6}) {
      for (int mode = 0; mode < 3; ++mode) {  // 0: bf16 W, fp32 X; 1: bf16 W, bf16 X; 2: fp32
        const int64_t rows = 13;
        std::vector<float> w(static_cast<size_t>(rows * K)), x(static_cast<size_t>(B * K));
        std::vector<bf16> w16(w.size());
        for (size_t i = 0; i < w.size(); ++i) {
          w[i] = static_cast<float>(0.05 * rng.normal());
          if (mode < 2) w[i] = round_bf16(w[i]);
          w16[i] = f32_to_bf16(w[i]);
        }
        for (auto& v : x)
          v = mode == 1 ? round_bf16(static_cast<float>(rng.normal()))
                        : static_cast<float>(rng.normal());
        auto run = [&] {
          std::vector<float> y(static_cast<size_t>(B * rows));
          if (mode == 2) {
            matmul_f32(w.data(), K, 0, rows, x.data(), B, K, y.data(), rows);
          } else {
            matmul_bf16(w16.data(), K, 0, rows, x.data(), B, K, y.data(), rows, mode == 1);
          }
          return y;
        };
        std::vector<float> y, yp;
        both(run, y, yp);
        for (int b = 0; b < B; ++b) {
          for (int64_t r = 0; r < rows; ++r) {
            double ref = 0, sum_abs = 0;
            for (int64_t k = 0; k < K; ++k) {
              const double t = double{w[r * K + k]} * x[b * K + k];
              ref += t;
              sum_abs += std::fabs(t);
            }
            const double tol = matmul_bound(K, sum_abs);
            const size_t i = static_cast<size_t>(b * rows + r);
            ASSERT_LE(std::fabs(y[i] - ref), tol)
                << matmul_isa() << " mode " << mode << " K " << K << " b " << b << " r " << r;
            ASSERT_LE(std::fabs(y[i] - yp[i]), 2 * tol) << "vs portable, mode " << mode;
          }
        }
      }
    }
  }
}

// MXFP4: the weights are e2m1 codes (exact in bf16) times a power of two per group of 32. Each
// path sums short runs of unscaled products within a group per lane (at most 8 roundings), scales
// each run's sum (exact for these scales) and accumulates it into the lane (one rounding per run:
// at most G = K/32 of them per lane on the portable path, fewer on the vector paths, which cover
// 2 or 4 groups per run), then reduces the lanes in a tree (<= 4 levels): n <= G + 12 roundings.
TEST_P(IsaPath, Mxfp4) {
  Rng rng(8);
  for (int64_t K : {32, 64, 96, 544, 1024}) {
    for (int B : {1, 2, 5}) {
      const int64_t rows = 11, G = K / 32;
      std::vector<uint8_t> packed(static_cast<size_t>(rows * K / 2)),
          scales(static_cast<size_t>(rows * G));
      for (auto& p : packed) p = static_cast<uint8_t>(rng.next());
      for (auto& s : scales) s = static_cast<uint8_t>(118 + rng.next() % 12);
      std::vector<float> x(static_cast<size_t>(B * K));
      for (auto& v : x) v = round_bf16(static_cast<float>(rng.normal()));
      auto run = [&] {
        std::vector<float> y(static_cast<size_t>(B * rows));
        matmul_mxfp4(packed.data(), scales.data(), K, 0, rows, x.data(), B, K, y.data(), rows,
                     true);
        return y;
      };
      std::vector<float> y, yp;
      both(run, y, yp);
      std::vector<float> wr(static_cast<size_t>(K));
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_mxfp4_row(packed.data() + r * K / 2, scales.data() + r * G, K, wr.data());
        for (int b = 0; b < B; ++b) {
          double ref = 0, sum_abs = 0;
          for (int64_t k = 0; k < K; ++k) {
            const double t = double{wr[k]} * x[b * K + k];
            ref += t;
            sum_abs += std::fabs(t);
          }
          const double tol = gamma(static_cast<double>(G + 12)) * sum_abs;
          const size_t i = static_cast<size_t>(b * rows + r);
          ASSERT_LE(std::fabs(y[i] - ref), tol) << matmul_mxfp4_isa() << " K " << K << " r " << r;
          ASSERT_LE(std::fabs(y[i] - yp[i]), 2 * tol) << "vs portable";
        }
      }
    }
  }
}

// KDA decode step, S' = diag(e^g) S + k d^T, d = beta (v - (diag(e^g) S)^T k), o = S'^T q, with
// q, k L2-normalised. Each output o_j is a dot product over K key channels (<= K + 5 roundings per
// term in any lane layout) of terms that carry their own few roundings (exp within ~2 ulp,
// normalisation ~3, products 2), plus the rank-one term (k.q) d_j whose d_j is itself such a dot
// product: every term passes through fewer than n = 2K + 32 roundings, so
// |o_j - exact| <= gamma_n A_j with A_j = sum_i |e^g_i S_ij q_i| + |k.q| beta (|v_j| +
// sum_i |e^g_i S_ij k_i|), the same sums with absolute values, evaluated in double.
TEST_P(IsaPath, KdaDecode) {
  Rng rng(9);
  for (int K : {32, 128, 40}) {
    std::vector<float> S0(static_cast<size_t>(K) * K), q(K), k(K), v(K), g(K);
    for (auto& s : S0) s = static_cast<float>(0.2 * rng.normal());
    for (int i = 0; i < K; ++i) {
      q[i] = static_cast<float>(rng.normal());
      k[i] = static_cast<float>(rng.normal());
      v[i] = static_cast<float>(rng.normal());
      g[i] = static_cast<float>(-0.1 * std::fabs(rng.normal()));
    }
    const float beta = 0.6f;
    auto run = [&] {
      std::vector<float> S = S0, o(K);
      kda_decode_head(S.data(), q.data(), k.data(), v.data(), g.data(), beta, K, o.data());
      o.insert(o.end(), S.begin(), S.end());
      return o;
    };
    std::vector<float> y, yp;
    both(run, y, yp);
    // Reference in double.
    auto norm = [&](const std::vector<float>& a, double scale) {
      double ss = 0;
      for (float t : a) ss += double{t} * t;
      std::vector<double> out(a.size());
      for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] / std::sqrt(ss + 1e-6) * scale;
      return out;
    };
    const auto qn = norm(q, 1.0 / std::sqrt(double(K))), kn = norm(k, 1.0);
    double kq = 0;
    for (int i = 0; i < K; ++i) kq += kn[i] * qn[i];
    for (int j = 0; j < K; ++j) {
      double kv = 0, kv_abs = 0, oa = 0, oa_abs = 0;
      for (int i = 0; i < K; ++i) {
        const double s = std::exp(double{g[i]}) * S0[static_cast<size_t>(i) * K + j];
        kv += s * kn[i];
        kv_abs += std::fabs(s * kn[i]);
        oa += s * qn[i];
        oa_abs += std::fabs(s * qn[i]);
      }
      const double d = beta * (v[j] - kv);
      const double ref = oa + kq * d;
      const double A = oa_abs + std::fabs(kq) * beta * (std::fabs(v[j]) + kv_abs);
      const double tol = gamma(2.0 * K + 32) * A;
      ASSERT_LE(std::fabs(y[j] - ref), tol) << kda_isa() << " K " << K << " j " << j;
      ASSERT_LE(std::fabs(y[j] - yp[j]), 2 * tol) << "vs portable";
    }
  }
}

// MLA absorbed decode: out_v = sum_t p_t (W_UV c_t)_v, p = softmax(s), s_t = scale (ql . c_t +
// q_pe . kpe_t), ql = W_UK^T q_nope. First-order error analysis:
//  * value side: ol = sum_t p_t c_t (T terms, plus up to T/16 + 2 online-softmax rescalings, each
//    an exp and a multiply) and out = W_UV ol (R terms): n1 = R + T + T/8 + 32 roundings, on
//    M = sum_r |W_UV_vr| sum_t p_t |c_tr|;
//  * score side: a relative error e on the scores' terms gives |ds_t| <= e Smax with Smax the
//    largest absolute score sum scale (sum_r (sum_n |W_UK_nr q_n|) |c_tr| + sum |q_pe kpe|), and
//    softmax turns |ds| <= delta into |dp_t| <= 2 delta p_t; e = gamma(N + R + P + 16) (ql over N,
//    the score dot over R + P, the scale). That adds 2 gamma(N + R + P + 16) Smax M.
TEST_P(IsaPath, MlaDecode) {
  Rng rng(10);
  const MlaDims d{3, 16, 8, 16, 64};
  const int RP = d.R + d.P, NV = d.N + d.V;
  for (int T : {1, 17, 50}) {
    std::vector<float> cache(static_cast<size_t>(T) * RP),
        q(static_cast<size_t>(d.H) * (d.N + d.P));
    std::vector<bf16> kvb(static_cast<size_t>(d.H) * NV * d.R);
    for (auto& c : cache) c = round_bf16(static_cast<float>(rng.normal()));
    for (auto& x : q) x = round_bf16(static_cast<float>(rng.normal()));
    for (auto& w : kvb) w = f32_to_bf16(static_cast<float>(0.1 * rng.normal()));
    auto run = [&] {
      std::vector<float> out(static_cast<size_t>(d.H) * d.V),
          scratch(static_cast<size_t>(T) + 2 * d.R);
      mla_decode_absorbed(q.data(), LatentCache::contiguous(cache.data(), RP, T), T, kvb.data(), d,
                          0, d.H, out.data(), scratch.data());
      return out;
    };
    std::vector<float> y, yp;
    both(run, y, yp);
    const double scale = 1.0 / std::sqrt(double(d.N + d.P));
    for (int h = 0; h < d.H; ++h) {
      auto W = [&](int row, int r) {
        return double{bf16_to_f32(kvb[(size_t(h) * NV + row) * d.R + r])};
      };
      const float* qh = q.data() + size_t(h) * (d.N + d.P);
      std::vector<double> ql(d.R), ql_abs(d.R), s(T), p(T);
      for (int r = 0; r < d.R; ++r)
        for (int n = 0; n < d.N; ++n) {
          ql[r] += W(n, r) * qh[n];
          ql_abs[r] += std::fabs(W(n, r) * qh[n]);
        }
      double smax_abs = 0, m = -INFINITY, z = 0;
      for (int t = 0; t < T; ++t) {
        const float* c = cache.data() + size_t(t) * RP;
        double acc = 0, acc_abs = 0;
        for (int r = 0; r < d.R; ++r) {
          acc += ql[r] * c[r];
          acc_abs += ql_abs[r] * std::fabs(c[r]);
        }
        for (int i = 0; i < d.P; ++i) {
          acc += double{qh[d.N + i]} * c[d.R + i];
          acc_abs += std::fabs(double{qh[d.N + i]} * c[d.R + i]);
        }
        s[t] = acc * scale;
        smax_abs = std::max(smax_abs, acc_abs * scale);
        m = std::max(m, s[t]);
      }
      for (int t = 0; t < T; ++t) z += p[t] = std::exp(s[t] - m);
      for (int vi = 0; vi < d.V; ++vi) {
        double ref = 0, M = 0;
        for (int r = 0; r < d.R; ++r) {
          double ol = 0, ol_abs = 0;
          for (int t = 0; t < T; ++t) {
            ol += p[t] / z * cache[size_t(t) * RP + r];
            ol_abs += p[t] / z * std::fabs(cache[size_t(t) * RP + r]);
          }
          ref += W(d.N + vi, r) * ol;
          M += std::fabs(W(d.N + vi, r)) * ol_abs;
        }
        const double tol =
            gamma(d.R + T + T / 8.0 + 32) * M + 2 * gamma(d.N + d.R + d.P + 16) * smax_abs * M;
        const size_t i = size_t(h) * d.V + vi;
        ASSERT_LE(std::fabs(y[i] - ref), tol) << mla_isa() << " T " << T << " h " << h;
        ASSERT_LE(std::fabs(y[i] - yp[i]), 2 * tol) << "vs portable";
      }
    }
  }
}

// The bandwidth probe's sum is integer arithmetic (64-bit lanes, wrapping), so every path must
// give exactly the scalar sum.
TEST_P(IsaPath, BandwidthStreamSum) {
  constexpr size_t kBytes = 64 * 1000;
  std::vector<uint64_t> buf(kBytes / 8 + 8);
  uint64_t* p = buf.data();
  while (reinterpret_cast<uintptr_t>(p) % 64) ++p;
  Rng rng(11);
  uint64_t ref = 0;
  for (size_t i = 0; i < kBytes / 8; ++i) ref += p[i] = rng.next();
  ASSERT_EQ(set_isa(level_), level_);
  EXPECT_EQ(stream_read_sum(p, kBytes), ref);
}

INSTANTIATE_TEST_SUITE_P(Levels, IsaPath,
                         ::testing::Values(static_cast<int>(Isa::kPortable),
                                           static_cast<int>(Isa::kAvx2),
                                           static_cast<int>(Isa::kAvx512),
                                           static_cast<int>(Isa::kAvx512Bf16)),
                         level_name);

}  // namespace
}  // namespace md::cpu
