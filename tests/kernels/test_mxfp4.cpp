#include "megadecode/kernels/cpu/mxfp4.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/util.h"
#include "isa_list.h"
#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu {
namespace {

// Written out independently of the kernels: e2m1 magnitudes of codes 0..7 (bit 3 is the sign).
constexpr double kMagnitude[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

double e2m1(int code) {
  const double m = kMagnitude[code & 7];
  return (code & 8) ? -m : m;
}

// Error bound. Every path forms Y[b, r] from the products c_k * x_k (c_k the unscaled e2m1 value),
// sums short runs of them within one group per lane, scales each run's sum by the group's power of
// two (exact unless it leaves the normal range), accumulates the scaled sums per lane in order and
// reduces the lanes in a tree of depth <= 4. Counting the roundings a term can pass through:
//  * portable: 4 products per lane per group (each product rounded, then 3 adds), the scale
//    multiply, G = K/32 accumulation adds, 3 tree levels: n = 1 + 3 + 1 + G + 3 < G + 9;
//  * AVX-512: 8 products per lane per chunk of 4 groups (mul + 7 fmas: at most 8 roundings), then
//    an fma with the scale into the accumulator (1 rounding per chunk, C = ceil(G/4) chunks), then
//    4 tree levels: n = 8 + C + 4 = C + 12;
//  * AVX2: the same with chunks of 2 groups and 3 tree levels: n = 8 + ceil(G/2) + 3, which is
//    <= G + 9 for G >= 4 and <= ceil(G/4) + 12 = 13 for G <= 3.
// So n = max(G + 9, ceil(G/4) + 12) bounds all three, and the recursive-summation bound gives
// |y - exact| <= gamma_n * sum_k |w_k x_k| with gamma_n < (n + 1) u, u = 2^-24 (n << 2^24). This
// is ~32x tighter than the plain "K u sum|w x|" bound, because the per-group runs are short.
// Results in the subnormal range (tiny scales) also carry an absolute error of at most half an
// fp32 subnormal ulp (2^-150) per underflowing multiply (scale multiply or fma: at most one per
// lane per group, 16 lanes), i.e. at most K/2 + 16 < K + 16 of them. Typical errors are
// ~sqrt(n) u; indexing bugs are caught exactly by the small-integer test.
double error_bound(int64_t K, double sum_abs) {
  const int64_t G = K / 32;
  const double n = static_cast<double>(std::max(G + 9, (G + 3) / 4 + 12));
  return (n + 1) * 0x1p-24 * sum_abs + static_cast<double>(K + 16) * 0x1p-150;
}

using test::IsaList;

struct Problem {
  int64_t rows = 0, K = 0;
  int B = 0;
  int64_t ldx = 0, ldy = 0;
  std::vector<uint8_t> packed, scales;
  std::vector<float> x;
};

// Random codes, scales in [smin, smax], X ~ N(0, 1) * xmul (rounded to bf16 when x_bf16).
// Leading dimensions exceed the logical sizes so that stray reads and writes show up.
Problem make_problem(Rng& rng, int64_t rows, int64_t K, int B, bool x_bf16, int smin = 123,
                     int smax = 131, double xmul = 1.0) {
  Problem p;
  p.rows = rows;
  p.K = K;
  p.B = B;
  p.ldx = K + 3;
  p.ldy = rows + 5;
  p.packed.resize(static_cast<size_t>(rows * K / 2));
  for (auto& v : p.packed) v = static_cast<uint8_t>(rng.next() & 255);
  p.scales.resize(static_cast<size_t>(rows * K / 32));
  for (auto& v : p.scales)
    v = static_cast<uint8_t>(smin + static_cast<int>(rng.next() % (smax - smin + 1)));
  p.x.resize(static_cast<size_t>(B * p.ldx));
  for (auto& v : p.x) {
    v = static_cast<float>(rng.normal() * xmul);
    if (x_bf16) v = round_bf16(v);
    if (std::fabs(v) < 0x1p-125f) v = 0.0f;  // no subnormal X (vdpbf16ps would read it as 0)
  }
  return p;
}

constexpr float kSentinel = -12345.0f;

std::vector<float> run(const Problem& p, int64_t r0, int64_t r1, bool x_bf16) {
  std::vector<float> y(static_cast<size_t>(p.B * p.ldy), kSentinel);
  matmul_mxfp4(p.packed.data(), p.scales.data(), p.K, r0, r1, p.x.data(), p.B, p.ldx, y.data(),
               p.ldy, x_bf16);
  return y;
}

// float64 reference from the independent decode: value and sum |w x| per output.
void reference(const Problem& p, int64_t r, int b, double* y, double* abs_sum) {
  double s = 0, a = 0;
  for (int64_t k = 0; k < p.K; ++k) {
    const uint8_t byte = p.packed[static_cast<size_t>(r * p.K / 2 + k / 2)];
    const int code = (k % 2) ? byte >> 4 : byte & 15;
    const int e = p.scales[static_cast<size_t>(r * p.K / 32 + k / 32)] - 127;
    const double w = std::ldexp(e2m1(code), e);
    const double t = w * static_cast<double>(p.x[static_cast<size_t>(b * p.ldx + k)]);
    s += t;
    a += std::fabs(t);
  }
  *y = s;
  *abs_sum = a;
}

void expect_matches_reference(const Problem& p, const std::vector<float>& y, int64_t r0, int64_t r1,
                              const std::string& what) {
  for (int b = 0; b < p.B; ++b) {
    for (int64_t r = 0; r < p.ldy; ++r) {
      const float got = y[static_cast<size_t>(b * p.ldy + r)];
      if (r < r0 || r >= r1) {
        ASSERT_EQ(got, kSentinel) << what << " wrote outside its rows: b=" << b << " r=" << r;
        continue;
      }
      double ref, abs_sum;
      reference(p, r, b, &ref, &abs_sum);
      ASSERT_LE(std::fabs(static_cast<double>(got) - ref), error_bound(p.K, abs_sum))
          << what << " b=" << b << " r=" << r << " got " << got << " want " << ref;
    }
  }
}

TEST(Mxfp4, DecodeTableExhaustive) {
  for (int s = 0; s < 256; ++s) {
    for (int c = 0; c < 16; ++c) {
      const float v = mxfp4_value(static_cast<uint8_t>(c), static_cast<uint8_t>(s));
      if (s == 255) {
        EXPECT_TRUE(std::isnan(v)) << "code " << c;
        continue;
      }
      const double exact = std::ldexp(e2m1(c), s - 127);
      // Exact up to s = 252; above, the correctly rounded value (which may be +-inf).
      EXPECT_EQ(static_cast<double>(v), static_cast<double>(static_cast<float>(exact)))
          << "code " << c << " scale " << s;
      if (s <= 252) {
        EXPECT_EQ(static_cast<double>(v), exact) << "code " << c << " scale " << s;
      }
      EXPECT_EQ(std::signbit(v), c >= 8) << "code " << c << " scale " << s;
    }
  }
  // Codes of a small e2m1 value times any scale in the bf16 range are bf16-exact too.
  for (int c = 0; c < 16; ++c) {
    const float v = mxfp4_value(static_cast<uint8_t>(c), 127);
    EXPECT_EQ(round_bf16(v), v);
  }
}

TEST(Mxfp4, DequantizeRowNibbleOrder) {
  // Byte j holds column 2j in its low nibble, 2j+1 in its high nibble; scale g covers 32g..32g+31.
  std::vector<uint8_t> packed(32), scales = {127, 130};
  for (int j = 0; j < 32; ++j) packed[j] = static_cast<uint8_t>((j % 16) | ((15 - j % 16) << 4));
  std::vector<float> out(64);
  dequantize_mxfp4_row(packed.data(), scales.data(), 64, out.data());
  for (int k = 0; k < 64; ++k) {
    const int j = k / 2;
    const int code = (k % 2) ? 15 - j % 16 : j % 16;
    EXPECT_EQ(static_cast<double>(out[k]), std::ldexp(e2m1(code), k < 32 ? 0 : 3)) << k;
  }
}

TEST(Mxfp4, FindNanScale) {
  std::vector<uint8_t> s(100, 127);
  EXPECT_EQ(mxfp4_find_nan_scale(s.data(), 100), -1);
  s[37] = 255;
  s[80] = 255;
  EXPECT_EQ(mxfp4_find_nan_scale(s.data(), 100), 37);
  EXPECT_EQ(mxfp4_find_nan_scale(s.data(), 37), -1);
}

TEST(Mxfp4, IsaFollowsLevel) {
  IsaList isas;
  // The AVX-512 kernel serves both AVX-512 levels (it needs no BF16 instruction).
  const char* expect[] = {"portable", "avx2", "avx512", "avx512"};
  for (size_t i = 0; i < isas.names.size(); ++i) {
    isas.use(isas.names[i]);
    EXPECT_STREQ(matmul_mxfp4_isa(), expect[i]) << isas.names[i];
  }
}

TEST(Mxfp4, MatchesFloat64Reference) {
  IsaList isas;
  Rng rng(11);
  struct Shape {
    int64_t rows, K;
    int B;
  };
  const Shape shapes[] = {{1, 32, 1},   {5, 64, 3},    {37, 96, 1},  {18, 160, 2},
                          {3, 7168, 1}, {21, 3072, 5}, {17, 224, 9}, {40, 128, 4},
                          {1, 7168, 2}, {9, 3584, 1},  {70, 64, 70}, {6, 544, 2},
                          {11, 3168, 3}, {19, 3072, 8}};
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (bool x_bf16 : {true, false}) {
      for (const auto& s : shapes) {
        const Problem p = make_problem(rng, s.rows, s.K, s.B, x_bf16);
        const int64_t r0 = s.rows > 2 ? 1 : 0;
        expect_matches_reference(p, run(p, r0, s.rows, x_bf16), r0, s.rows,
                                 isa + (x_bf16 ? " bf16x" : " f32x") +
                                     " rows=" + std::to_string(s.rows) +
                                     " K=" + std::to_string(s.K) + " B=" + std::to_string(s.B));
      }
    }
  }
}

// Small integers and scales 2^-1..2^3: every product and partial sum is exact, so every path must
// equal the reference exactly. Any nibble-order, scale-index or row-stride mistake shows here.
TEST(Mxfp4, ExactOnSmallIntegers) {
  IsaList isas;
  Rng rng(5);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (bool x_bf16 : {true, false}) {
      // K = 256: partial-block path only; 640 = one whole block of 16 groups plus 4 more.
      for (auto [B, K] : {std::pair{1, 256}, {3, 256}, {6, 256}, {1, 640}, {5, 640}}) {
        Problem p = make_problem(rng, 23, K, B, x_bf16, 126, 130);
        for (auto& v : p.x) v = static_cast<float>(static_cast<int>(rng.next() % 17) - 8);
        const auto y = run(p, 0, p.rows, x_bf16);
        for (int b = 0; b < B; ++b) {
          for (int64_t r = 0; r < p.rows; ++r) {
            double ref, a;
            reference(p, r, b, &ref, &a);
            ASSERT_EQ(static_cast<double>(y[static_cast<size_t>(b * p.ldy + r)]), ref)
                << isa << " K=" << K << " B=" << B << " b=" << b << " r=" << r;
          }
        }
      }
    }
  }
}

// Y[b, r] may depend only on row r, vector b and K: row splits, batching and threads change
// nothing, bit for bit.
TEST(Mxfp4, SplitBatchAndThreadInvariance) {
  IsaList isas;
  Rng rng(3);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (bool x_bf16 : {true, false}) {
      for (int64_t K : {int64_t{32}, int64_t{416}, int64_t{3072}}) {
        const int B = 70;  // more than one batch block of 64 and ragged batch tiles
        const Problem p = make_problem(rng, 45, K, B, x_bf16);
        const auto full = run(p, 0, p.rows, x_bf16);
        const std::string what = isa + (x_bf16 ? " bf16x" : " f32x") + " K=" + std::to_string(K);
        // Row by row and in ragged pieces.
        for (int64_t step : {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{17}}) {
          std::vector<float> y(full.size(), kSentinel);
          for (int64_t r = 0; r < p.rows; r += step) {
            matmul_mxfp4(p.packed.data(), p.scales.data(), K, r, std::min(p.rows, r + step),
                         p.x.data(), B, p.ldx, y.data(), p.ldy, x_bf16);
          }
          ASSERT_EQ(0, std::memcmp(y.data(), full.data(), y.size() * sizeof(float)))
              << what << " step " << step;
        }
        // Each vector alone, and sub-batches of every size 1..5 at varying offsets.
        for (int b0 = 0, nb = 1; b0 < B; b0 += nb, nb = nb % 5 + 1) {
          const int n = std::min(nb, B - b0);
          std::vector<float> y(static_cast<size_t>(n * p.ldy), kSentinel);
          matmul_mxfp4(p.packed.data(), p.scales.data(), K, 0, p.rows, p.x.data() + b0 * p.ldx, n,
                       p.ldx, y.data(), p.ldy, x_bf16);
          for (int j = 0; j < n; ++j) {
            for (int64_t r = 0; r < p.rows; ++r) {
              ASSERT_EQ(std::bit_cast<uint32_t>(y[static_cast<size_t>(j * p.ldy + r)]),
                        std::bit_cast<uint32_t>(full[static_cast<size_t>((b0 + j) * p.ldy + r)]))
                  << what << " b=" << b0 + j << " r=" << r;
            }
          }
        }
        // Two threads on interleaved row ranges.
        std::vector<float> y(full.size(), kSentinel);
        auto work = [&](int part) {
          for (int64_t r = part * 5; r < p.rows; r += 10) {
            matmul_mxfp4(p.packed.data(), p.scales.data(), K, r, std::min(p.rows, r + 5),
                         p.x.data(), B, p.ldx, y.data(), p.ldy, x_bf16);
          }
        };
        std::thread t(work, 1);
        work(0);
        t.join();
        ASSERT_EQ(0, std::memcmp(y.data(), full.data(), y.size() * sizeof(float))) << what;
      }
    }
  }
}

// Scales at both ends of E8M0. Tiny scales (2^-127..2^-119) with X ~ 1 give results down in the
// fp32 subnormal range; large scales (2^103..2^125) with X ~ 2^-96 stay finite. Neither fits
// bf16 weights, which is why the kernels apply the scale after the dot product of the codes.
TEST(Mxfp4, ScaleExtremes) {
  IsaList isas;
  Rng rng(9);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (bool x_bf16 : {true, false}) {
      for (int B : {1, 5}) {
        const Problem lo = make_problem(rng, 13, 512, B, x_bf16, 0, 8);
        expect_matches_reference(lo, run(lo, 0, lo.rows, x_bf16), 0, lo.rows, isa + " low scales");
        const Problem hi = make_problem(rng, 13, 512, B, x_bf16, 230, 252, 0x1p-96);
        expect_matches_reference(hi, run(hi, 0, hi.rows, x_bf16), 0, hi.rows, isa + " high scales");
      }
    }
  }
}

// A NaN scale (255) poisons exactly the rows that contain it, for every vector.
TEST(Mxfp4, NanScalePropagates) {
  IsaList isas;
  Rng rng(13);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (bool x_bf16 : {true, false}) {
      Problem p = make_problem(rng, 9, 128, 3, x_bf16);
      p.scales[static_cast<size_t>(4 * (128 / 32) + 2)] = 255;  // row 4, group 2
      // Make that group's codes all zero: NaN must still propagate (0 * NaN).
      for (int j = 0; j < 16; ++j) p.packed[static_cast<size_t>(4 * 64 + 2 * 16 + j)] = 0;
      const auto y = run(p, 0, p.rows, x_bf16);
      for (int b = 0; b < p.B; ++b) {
        for (int64_t r = 0; r < p.rows; ++r) {
          EXPECT_EQ(std::isnan(y[static_cast<size_t>(b * p.ldy + r)]), r == 4)
              << isa << " b=" << b << " r=" << r;
        }
      }
    }
  }
}

// The load-time quantizer (quantize_mxfp4_row) on hand-picked groups, each value's expected code
// worked out from compressed-tensors' rule (mxfp4.h): the scale's power-of-two rounding at 1.75,
// the e2m1 intervals' ties to the even code, saturation, zero groups and negative zeros.
TEST(Mxfp4, QuantizeRowFollowsCompressedTensors) {
  auto quantize = [](std::vector<float> vals, uint8_t* scale) {
    vals.resize(32, 0.0f);
    std::vector<bf16> w(32);
    for (int i = 0; i < 32; ++i) w[i] = f32_to_bf16(vals[size_t(i)]);
    std::vector<uint8_t> packed(16, 0xEE);
    quantize_mxfp4_row(w.data(), 32, packed.data(), scale);
    std::vector<int> codes(32);
    for (int i = 0; i < 32; ++i) codes[size_t(i)] = i % 2 ? packed[i / 2] >> 4 : packed[i / 2] & 15;
    return codes;
  };
  uint8_t s = 0;
  // max 6 = 1.5 * 2^2: stays 2^2, scale 127 + 2 - 2 = 127 (values as they are). Ties: 0.25 -> 0,
  // 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; 5.5 -> 6; -0.1 -> 0 (no sign).
  auto c = quantize({6, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, 5.5f, -0.1f, -3, -0.5f}, &s);
  EXPECT_EQ(s, 127);
  const int want[] = {7, 0, 2, 2, 4, 4, 6, 6, 7, 0, 8 | 5, 8 | 1};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(c[size_t(i)], want[i]) << "value " << i;
  // max 7 = 1.75 * 2^2 rounds up to 2^3: scale 128, values halved; 7 / 2 = 3.5 -> 4.
  c = quantize({7, 1}, &s);
  EXPECT_EQ(s, 128);
  EXPECT_EQ(c[0], 6);
  EXPECT_EQ(c[1], 1);  // 0.5
  // max 1.7 * 2^-10 stays 2^-10: scale 115; 1.7 * 4 = 6.8 saturates to 6.
  c = quantize({std::ldexp(1.7f, -10)}, &s);
  EXPECT_EQ(s, 115);
  EXPECT_EQ(c[0], 7);
  // An all-zero group: scale 0, codes 0 (also for -0).
  c = quantize({0.0f, -0.0f}, &s);
  EXPECT_EQ(s, 0);
  EXPECT_EQ(c[0], 0);
  EXPECT_EQ(c[1], 0);
  // The codes decode to the rounded values times the scale (the kernels' view).
  std::vector<bf16> w(64);
  Rng rng(9);
  for (auto& v : w) v = f32_to_bf16(static_cast<float>(rng.normal() * 0.02));
  std::vector<uint8_t> packed(32), scales(2);
  quantize_mxfp4_row(w.data(), 64, packed.data(), scales.data());
  std::vector<float> back(64);
  dequantize_mxfp4_row(packed.data(), scales.data(), 64, back.data());
  for (int k = 0; k < 64; ++k) {
    const double step = std::ldexp(1.0, int(scales[size_t(k / 32)]) - 127);  // e2m1 spacing <= 2
    EXPECT_LE(std::fabs(double(back[size_t(k)]) - bf16_to_f32(w[size_t(k)])), step * 1.0001)
        << k;
  }
}

}  // namespace
}  // namespace md::cpu
