// FP8 e4m3 (W8A16) kernels against float64 references written out independently of the kernels:
// the e4m3 decode for every byte from the format's definition, every ISA level, group sizes 32..K,
// ragged shapes, split / batch / thread invariance.
#include "megadecode/kernels/cpu/fp8.h"

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

// Error bound (the int8 kernels' sequence, test_int8.cpp): per 32-column sub-group each lane is a
// chain of at most 4 rounded products/adds of exact
// integers times activations, one rounding for the scale (an fma, or a multiply then an add on the
// portable path), K/32 accumulation steps per lane and a tree of depth 3, so every term passes
// through at most n = G + 9 roundings (G = K/32), and |y - exact| <= (n + 2) u sum_k |w_k x_k|
// (the scale is not a power of two: one more rounding).
double error_bound(int64_t K, double sum_abs) {
  const double n = static_cast<double>(K / 32 + 9);
  return (n + 2) * 0x1p-24 * sum_abs;
}

using test::IsaList;

struct Problem {
  int64_t rows = 0, K = 0;
  int group = 0, B = 0;
  int64_t ldx = 0, ldy = 0;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
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
  p.codes.resize(static_cast<size_t>(rows * K));
  for (auto& v : p.codes) {
    v = static_cast<uint8_t>(rng.next() & 255);
    if ((v & 0x7f) == 0x7f) v = 0x7e;  // (NaN bytes are rejected at load)
  }
  p.scales.resize(static_cast<size_t>(rows * (K / group)));
  for (auto& v : p.scales) v = static_cast<float>(rng.uniform() * 0.02 + 1e-4);
  p.x.resize(static_cast<size_t>(B * p.ldx));
  for (auto& v : p.x) v = round_bf16(static_cast<float>(rng.normal()));
  return p;
}

using test::kSentinel;

std::vector<float> run(const Problem& p, int64_t r0, int64_t r1) {
  std::vector<float> y(static_cast<size_t>(p.B * p.ldy), kSentinel);
  matmul_fp8(p.codes.data(), p.scales.data(), p.K, p.group, r0, r1, p.x.data(), p.B, p.ldx,
              y.data(), p.ldy);
  return y;
}

// float64 reference: byte b is (-1)^s 2^(e-7) (1 + m/8) for exponent field e > 0, (-1)^s 2^-6 m/8
// for e = 0 (e4m3fn, OCP FP8).
double e4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double v = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
  return b & 0x80 ? -v : v;
}

double weight(const Problem& p, int64_t r, int64_t k) {
  const uint8_t b = p.codes[static_cast<size_t>(r * p.K + k)];
  return e4m3(b) * double(p.scales[static_cast<size_t>(r * (p.K / p.group) + k / p.group)]);
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

TEST(Fp8, DecodeEveryByte) {
  for (int b = 0; b < 256; ++b) {
    const float v = fp8_e4m3_value(static_cast<uint8_t>(b));
    if ((b & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << b;
      continue;
    }
    EXPECT_EQ(double(v), e4m3(static_cast<uint8_t>(b))) << b;
  }
  EXPECT_EQ(fp8_e4m3_value(0x7e), 448.0f);  // the largest finite value
  EXPECT_EQ(fp8_e4m3_value(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  const uint8_t bytes[] = {0, 0x7e, 0x80, 0xff, 0x7f};
  EXPECT_EQ(fp8_find_nan(bytes, 5), 3);
  EXPECT_EQ(fp8_find_nan(bytes, 3), -1);
}

TEST(Fp8, DequantizeRowGroups) {
  Rng rng(1);
  const Problem p = make_problem(rng, 1, 256, 64, 1);
  std::vector<float> out(256);
  dequantize_fp8_row(p.codes.data(), p.scales.data(), 256, 64, out.data());
  // (One fp32 rounding of the exact product: the e4m3 value has 4 significant bits.)
  for (int64_t k = 0; k < 256; ++k)
    EXPECT_EQ(static_cast<double>(out[k]), static_cast<double>(static_cast<float>(weight(p, 0, k))))
        << k;
}

TEST(Fp8, IsaFollowsLevel) {
  IsaList isas;
  const char* expect[] = {"portable", "avx2", "avx512", "avx512"};
  for (size_t i = 0; i < isas.names.size(); ++i) {
    isas.use(isas.names[i]);
    EXPECT_STREQ(matmul_fp8_isa(), expect[i]) << isas.names[i];
  }
}

TEST(Fp8, MatchesFloat64Reference) {
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
// equals the reference exactly; a byte-order, offset, scale-index or stride mistake shows here.
TEST(Fp8, ExactOnSmallIntegers) {
  IsaList isas;
  Rng rng(5);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (auto [B, K, g] :
         {std::tuple{1, 256, 32}, {3, 256, 128}, {6, 640, 64}, {1, 640, 640}, {5, 1152, 96}}) {
      Problem p = make_problem(rng, 23, K, g, B);
      // Bytes of exponent field 5..9 (values 2^-2 .. 2^2 times 1 + m/8): products with the small
      // integer activations and power-of-two scales stay exact in every partial sum.
      for (auto& v : p.codes)
        v = static_cast<uint8_t>((rng.next() & 0x80) | ((5 + rng.next() % 5) << 3) | (rng.next() & 7));
      for (auto& v : p.scales)
        v = std::ldexp(1.0f, static_cast<int>(rng.next() % 5) - 1);
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
TEST(Fp8, SplitBatchAndThreadInvariance) {
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
            matmul_fp8(p.codes.data(), p.scales.data(), K, g, r0, r1, p.x.data() + b0 * p.ldx, nb,
                       p.ldx, y, p.ldy);
          },
          isa + " K=" + std::to_string(K) + " g=" + std::to_string(g));
    }
  }
}

}  // namespace
}  // namespace md::cpu
