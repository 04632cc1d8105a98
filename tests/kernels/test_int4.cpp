// int4 (W4A16) kernels and quantizer against float64 references written out independently of the
// kernels: every ISA level, group sizes 32..K, ragged shapes, split / batch / thread invariance.
#include "megadecode/kernels/cpu/int4.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "isa_list.h"
#include "matmul_checks.h"
#include "megadecode/base/bf16.h"
#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu {
namespace {

// Error bound: the kernels share the MXFP4 kernels' sequence (test_mxfp4.cpp: per 32-column run a
// chain of at most 8 rounded products/adds, one rounding for the scale (an fma into the
// accumulator, or a multiply then an add on the portable path: counted as in the MXFP4 bound),
// ceil(K/128)..K/32 accumulation steps, a tree of depth <= 4), so the same
// n = max(G + 9, ceil(G/4) + 12), G = K/32, and |y - exact| <= (n + 1) u sum_k |w_k x_k| + one
// extra rounding per run for the scale product, which is not a power of two here: (n + 2) u.
double error_bound(int64_t K, double sum_abs) {
  const int64_t G = K / 32;
  const double n = static_cast<double>(std::max(G + 9, (G + 3) / 4 + 12));
  return (n + 2) * 0x1p-24 * sum_abs;
}

using test::IsaList;

struct Problem {
  int64_t rows = 0, K = 0;
  int group = 0, B = 0;
  int64_t ldx = 0, ldy = 0;
  std::vector<uint8_t> packed;
  std::vector<bf16> scales;
  std::vector<float> x;
};

Problem make_problem(Rng& rng, int64_t rows, int64_t K, int group, int B) {
  Problem p;
  p.rows = rows;
  p.K = K;
  p.group = group;
  p.B = B;
  p.ldx = K + 3;
  p.ldy = rows + 5;
  p.packed.resize(static_cast<size_t>(rows * K / 2));
  for (auto& v : p.packed) v = static_cast<uint8_t>(rng.next() & 255);
  p.scales.resize(static_cast<size_t>(rows * (K / group)));
  for (auto& v : p.scales) v = f32_to_bf16(static_cast<float>(rng.uniform() * 0.02 + 1e-4));
  p.x.resize(static_cast<size_t>(B * p.ldx));
  for (auto& v : p.x) v = round_bf16(static_cast<float>(rng.normal()));
  return p;
}

using test::kSentinel;

std::vector<float> run(const Problem& p, int64_t r0, int64_t r1) {
  std::vector<float> y(static_cast<size_t>(p.B * p.ldy), kSentinel);
  matmul_int4(p.packed.data(), p.scales.data(), p.K, p.group, r0, r1, p.x.data(), p.B, p.ldx,
              y.data(), p.ldy);
  return y;
}

// float64 reference: code c is c - 8; byte j holds columns 2j (low nibble) and 2j + 1.
double weight(const Problem& p, int64_t r, int64_t k) {
  const uint8_t byte = p.packed[static_cast<size_t>(r * p.K / 2 + k / 2)];
  const int code = (k % 2) ? byte >> 4 : byte & 15;
  const double s = bf16_to_f32(p.scales[static_cast<size_t>(r * (p.K / p.group) + k / p.group)]);
  return (code - 8) * s;
}

void reference(const Problem& p, int64_t r, int b, double* y, double* abs_sum) {
  double s = 0, a = 0;
  for (int64_t k = 0; k < p.K; ++k) {
    const double t = weight(p, r, k) * static_cast<double>(p.x[static_cast<size_t>(b * p.ldx + k)]);
    s += t;
    a += std::fabs(t);
  }
  *y = s;
  *abs_sum = a;
}

TEST(Int4, DequantizeRowNibbleOrderAndGroups) {
  Rng rng(1);
  const Problem p = make_problem(rng, 1, 256, 64, 1);
  std::vector<float> out(256);
  dequantize_int4_row(p.packed.data(), p.scales.data(), 256, 64, out.data());
  for (int64_t k = 0; k < 256; ++k) EXPECT_EQ(static_cast<double>(out[k]), weight(p, 0, k)) << k;
}

// The quantizer against its definition (int4.h), element by element, and the round trip error:
// |w - q s| <= s / 2 except where clamping at +7 (absmax maps to 7.5 s): <= s.
TEST(Int4, QuantizeRowFollowsTheObserver) {
  Rng rng(2);
  for (int group : {32, 128, 384}) {
    const int64_t K = 768;
    std::vector<bf16> w(K);
    for (auto& v : w) v = f32_to_bf16(static_cast<float>(rng.normal() * 0.05));
    for (int k = 0; k < 32; ++k) w[k] = 0;  // an all-zero group (group 32)
    std::vector<uint8_t> packed(K / 2, 0xAA);
    std::vector<bf16> scales(K / group);
    quantize_int4_row(w.data(), K, group, packed.data(), scales.data());
    for (int64_t g = 0; g < K / group; ++g) {
      double amax = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k)
        amax = std::max(amax, std::fabs(double(bf16_to_f32(w[k]))));
      float want = round_bf16(static_cast<float>(amax / 7.5));
      if (want < FLT_EPSILON) want = FLT_EPSILON;
      ASSERT_EQ(bf16_to_f32(scales[g]), want) << "group " << g << " of " << group;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const int code = (k % 2) ? packed[k / 2] >> 4 : packed[k / 2] & 15;
        const double q = std::clamp(std::nearbyint(double(bf16_to_f32(w[k])) / want), -8.0, 7.0);
        ASSERT_EQ(code - 8, static_cast<int>(q)) << "k " << k << " group " << group;
        ASSERT_LE(std::fabs(bf16_to_f32(w[k]) - (code - 8) * double(want)), double(want) * 1.0001)
            << k;
      }
    }
  }
}

// The asymmetric quantizer against its definition (int4.h), computed here in float64 from the
// group's min and max: the scale (hi - lo) / 15 rounded to bf16, z = round(-8 - lo / s) and each
// code round(w / s + z) clamped to [-8, 7] (a tie in float64 that fp32 would break otherwise is
// skipped, none occur with these draws). Round trip: the grid (q - z) s spans [lo, hi] up to half
// a step at each end and the scale's bf16 rounding (relative 2^-9, over 15 steps), so
// |w - (q - z) s| <= s (0.5 + 16 * 2^-9). The rows: centred, all positive, all negative, skewed,
// an all-zero group.
TEST(Int4, AsymmetricQuantizeRowFollowsTheObserver) {
  Rng rng(3);
  const int64_t K = 768;
  for (int shape = 0; shape < 4; ++shape)
    for (int group : {32, 128, 768}) {
      std::vector<bf16> w(K);
      for (auto& v : w) {
        const double n = rng.normal() * 0.05;
        const double x = shape == 0   ? n
                         : shape == 1 ? std::fabs(n)
                         : shape == 2 ? -std::fabs(n)
                                      : n + 0.04;
        v = f32_to_bf16(static_cast<float>(x));
      }
      for (int k = 32; k < 64; ++k) w[k] = 0;  // an all-zero group (group 32)
      std::vector<uint8_t> packed(K / 2, 0xAA);
      std::vector<bf16> scales(K / group);
      std::vector<int8_t> zp(K / group, 99);
      quantize_int4_row(w.data(), K, group, packed.data(), scales.data(), zp.data());
      std::vector<float> back(K);
      dequantize_int4_row(packed.data(), scales.data(), K, group, back.data(), zp.data());
      for (int64_t g = 0; g < K / group; ++g) {
        SCOPED_TRACE("shape " + std::to_string(shape) + " group " + std::to_string(group) + " #" +
                     std::to_string(g));
        double lo = 0, hi = 0;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          lo = std::min(lo, double(bf16_to_f32(w[k])));
          hi = std::max(hi, double(bf16_to_f32(w[k])));
        }
        double s = round_bf16(static_cast<float>((hi - lo) / 15));
        if (s < FLT_EPSILON) s = FLT_EPSILON;
        ASSERT_EQ(double(bf16_to_f32(scales[g])), s);
        const double z = std::clamp(std::nearbyint(-8 - lo / s), -8.0, 7.0);
        ASSERT_EQ(zp[g], static_cast<int>(z));
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const int code = (k % 2) ? packed[k / 2] >> 4 : packed[k / 2] & 15;
          const double t = double(bf16_to_f32(w[k])) / s + z;
          if (std::fabs(t - std::floor(t) - 0.5) > 1e-6) {
            ASSERT_EQ(code - 8, static_cast<int>(std::nearbyint(std::clamp(t, -8.0, 7.0))))
                << "k " << k;
          }
          ASSERT_EQ(double(back[k]), (code - 8 - z) * s) << "k " << k;
          ASSERT_LE(std::fabs(bf16_to_f32(w[k]) - back[k]), s * (0.5 + 16.0 / 512)) << "k " << k;
        }
      }
    }
}

// What the zero point buys: on a group whose values are all on one side of 0 the symmetric grid
// wastes half its codes, so the asymmetric round trip's rms error is about half the symmetric
// one's (measured 0.5x; asserted below 0.7x), and on centred data it is no worse than the
// symmetric one by more than the bf16 rounding of its scale (asserted within 1.15x).
TEST(Int4, AsymmetricHalvesTheErrorOfOneSidedGroups) {
  Rng rng(4);
  const int64_t K = 4096, group = 128;
  for (bool one_sided : {true, false}) {
    std::vector<bf16> w(K);
    for (auto& v : w) {
      const double n = rng.normal() * 0.05;
      v = f32_to_bf16(static_cast<float>(one_sided ? std::fabs(n) : n));
    }
    std::vector<uint8_t> packed(K / 2);
    std::vector<bf16> scales(K / group);
    std::vector<int8_t> zp(K / group);
    std::vector<float> sym(K), asym(K);
    quantize_int4_row(w.data(), K, group, packed.data(), scales.data());
    dequantize_int4_row(packed.data(), scales.data(), K, group, sym.data());
    quantize_int4_row(w.data(), K, group, packed.data(), scales.data(), zp.data());
    dequantize_int4_row(packed.data(), scales.data(), K, group, asym.data(), zp.data());
    double es = 0, ea = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double x = bf16_to_f32(w[k]);
      es += (x - sym[k]) * (x - sym[k]);
      ea += (x - asym[k]) * (x - asym[k]);
    }
    const double ratio = std::sqrt(ea / es);
    if (one_sided) {
      EXPECT_LT(ratio, 0.7) << "one-sided";
    } else {
      EXPECT_LT(ratio, 1.15) << "centred";
    }
  }
}

TEST(Int4, IsaFollowsLevel) {
  IsaList isas;
  const char* expect[] = {"portable", "avx2", "avx512", "avx512"};
  for (size_t i = 0; i < isas.names.size(); ++i) {
    isas.use(isas.names[i]);
    EXPECT_STREQ(matmul_int4_isa(), expect[i]) << isas.names[i];
  }
}

TEST(Int4, MatchesFloat64Reference) {
  IsaList isas;
  Rng rng(11);
  struct Shape {
    int64_t rows, K;
    int group, B;
  };
  const Shape shapes[] = {{1, 32, 32, 1},     {5, 64, 64, 3},     {37, 96, 32, 1},
                          {18, 384, 128, 2},  {3, 7168, 128, 1},  {21, 3072, 64, 5},
                          {17, 224, 224, 9},  {40, 128, 128, 4},  {9, 2304, 128, 1},
                          {6, 2304, 2304, 2}, {11, 640, 160, 3},  {70, 512, 256, 70},
                          {4, 1536, 96, 1},   {19, 3072, 1024, 8}};
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (const auto& s : shapes) {
      const Problem p = make_problem(rng, s.rows, s.K, s.group, s.B);
      const int64_t r0 = s.rows > 2 ? 1 : 0;
      const auto y = run(p, r0, s.rows);
      const std::string what = isa + " rows=" + std::to_string(s.rows) +
                               " K=" + std::to_string(s.K) + " g=" + std::to_string(s.group) +
                               " B=" + std::to_string(s.B);
      test::expect_rows_match(
          y, p.B, p.ldy, r0, s.rows,
          [&](int64_t r, int b, double* want, double* bound) {
            double abs_sum;
            reference(p, r, b, want, &abs_sum);
            *bound = error_bound(p.K, abs_sum);
          },
          what);
    }
  }
}

// Small integers and power-of-two scales: every product and partial sum is exact, so every path
// equals the reference exactly; a nibble-order, scale-index or stride mistake shows here.
TEST(Int4, ExactOnSmallIntegers) {
  IsaList isas;
  Rng rng(5);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (auto [B, K, g] :
         {std::tuple{1, 256, 32}, {3, 256, 128}, {6, 640, 64}, {1, 640, 640}, {5, 1152, 96}}) {
      Problem p = make_problem(rng, 23, K, g, B);
      for (auto& v : p.scales)
        v = f32_to_bf16(std::ldexp(1.0f, static_cast<int>(rng.next() % 5) - 1));
      for (auto& v : p.x) v = static_cast<float>(static_cast<int>(rng.next() % 17) - 8);
      const auto y = run(p, 0, p.rows);
      for (int b = 0; b < B; ++b) {
        for (int64_t r = 0; r < p.rows; ++r) {
          double ref, a;
          reference(p, r, b, &ref, &a);
          ASSERT_EQ(static_cast<double>(y[static_cast<size_t>(b * p.ldy + r)]), ref)
              << isa << " K=" << K << " g=" << g << " B=" << B << " b=" << b << " r=" << r;
        }
      }
    }
  }
}

// Y[b, r] depends only on row r, vector b, K and the group: row splits, batching and threads
// change nothing, bit for bit.
TEST(Int4, SplitBatchAndThreadInvariance) {
  IsaList isas;
  Rng rng(3);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (auto [K, g] : {std::pair<int64_t, int>{32, 32}, {416, 32}, {3072, 128}, {2304, 2304}}) {
      const int B = 70;
      const Problem p = make_problem(rng, 45, K, g, B);
      test::expect_split_batch_thread_invariance(
          p.rows, B, p.ldy,
          [&](int64_t r0, int64_t r1, int b0, int nb, float* y) {
            matmul_int4(p.packed.data(), p.scales.data(), K, g, r0, r1, p.x.data() + b0 * p.ldx, nb,
                        p.ldx, y, p.ldy);
          },
          isa + " K=" + std::to_string(K) + " g=" + std::to_string(g));
    }
  }
}

}  // namespace
}  // namespace md::cpu
