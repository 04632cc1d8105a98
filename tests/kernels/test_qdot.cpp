// Integer dot-product kernels (qdot.h: int4 / int8 / MXFP4 weights x int8 or int16 activations)
// against float64 references written out independently of the kernels: the activation quantizer
// against its definition, the products against the exact sum of the quantized operands, the
// W4A8/W8A8 result against W4A16/W8A16 within the activations' rounding, every ISA level, ragged
// shapes, split / batch / thread invariance.
#include "megadecode/kernels/cpu/qdot.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
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
#include "megadecode/kernels/cpu/int4.h"
#include "megadecode/kernels/cpu/int8.h"
#include "megadecode/kernels/cpu/mxfp4.h"

namespace md::cpu {
namespace {

using test::IsaList;

constexpr QdotCodes kKinds[] = {QdotCodes::kInt4, QdotCodes::kInt8, QdotCodes::kMxfp4};

constexpr QdotActs kActs[] = {QdotActs::kInt8, QdotActs::kInt16};

std::string kind_name(QdotCodes k) {
  return k == QdotCodes::kInt4 ? "int4" : k == QdotCodes::kInt8 ? "int8" : "mxfp4";
}
std::string acts_name(QdotActs a) {
  return a == QdotActs::kInt16 ? "a16" : "a8";
}
// The activations' largest code T (qdot.h).
float top_code(QdotActs a) {
  return a == QdotActs::kInt16 ? 32385.0f : 127.0f;
}

struct Problem {
  QdotCodes kind = QdotCodes::kInt4;
  QdotActs acts = QdotActs::kInt8;
  int64_t rows = 0, K = 0;
  int group = 0, B = 0;
  int64_t ldx = 0, ldy = 0;
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;  // bf16 [rows, K/group] as bytes, or E8M0 [rows, K/32]
  std::vector<float> x;
  QdotWeights weights() const { return {codes.data(), scales.data(), K, group, kind, acts}; }
  int64_t row_bytes() const { return weights().code_row_bytes(); }
  int64_t scale_bytes() const { return weights().scale_row_bytes(); }
  // Sets scale i of row r: a bf16 value, or (MXFP4) the E8M0 byte of 2^e.
  void set_scale(int64_t r, int64_t i, float bf16_value, int e) {
    if (kind == QdotCodes::kMxfp4) {
      scales[static_cast<size_t>(r * scale_bytes() + i)] = static_cast<uint8_t>(e + 127);
    } else {
      const bf16 b = f32_to_bf16(bf16_value);
      std::memcpy(&scales[static_cast<size_t>(r * scale_bytes() + 2 * i)], &b, sizeof(b));
    }
  }
};

// MXFP4's group is the format's 32 whatever `group` says.
Problem make_problem(Rng& rng, QdotCodes kind, int64_t rows, int64_t K, int group, int B,
                     QdotActs acts = QdotActs::kInt8) {
  Problem p;
  p.kind = kind;
  p.acts = acts;
  p.rows = rows;
  p.K = K;
  p.group = kind == QdotCodes::kMxfp4 ? 32 : group;
  p.B = B;
  p.ldx = K + 3;
  p.ldy = rows + 5;
  p.codes.resize(static_cast<size_t>(rows * p.row_bytes()));
  for (auto& v : p.codes) v = static_cast<uint8_t>(rng.next() & 255);
  p.scales.resize(static_cast<size_t>(rows * p.scale_bytes()));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < K / p.group; ++i)
      p.set_scale(r, i, static_cast<float>(rng.uniform() * 0.02 + 1e-4),
                  static_cast<int>(rng.next() % 10) - 9);
  p.x.resize(static_cast<size_t>(B * p.ldx));
  for (auto& v : p.x) v = round_bf16(static_cast<float>(rng.normal()));
  return p;
}

using test::kSentinel;

std::vector<float> run(const Problem& p, int64_t r0, int64_t r1) {
  std::vector<float> y(static_cast<size_t>(p.B * p.ldy), kSentinel);
  matmul_qdot(p.weights(), r0, r1, p.x.data(), p.B, p.ldx, y.data(), p.ldy);
  return y;
}

// The value of column k's code in row r before its scale (int4.h / int8.h / mxfp4.h: low nibble
// first; int codes offset by 8 / 128; e2m1 values from the format's definition: bit 3 the sign,
// then 0, 0.5, 1, 1.5, 2, 3, 4, 6).
double code_value(const Problem& p, int64_t r, int64_t k) {
  const uint8_t* row = p.codes.data() + r * p.row_bytes();
  if (p.kind == QdotCodes::kInt8) return int(row[k]) - 128;
  const int c = k % 2 ? row[k / 2] >> 4 : row[k / 2] & 15;
  if (p.kind == QdotCodes::kInt4) return c - 8;
  constexpr double kMagnitude[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (c & 8 ? -1 : 1) * kMagnitude[c & 7];
}
double weight_scale(const Problem& p, int64_t r, int64_t k) {
  const uint8_t* s = p.scales.data() + r * p.scale_bytes();
  if (p.kind == QdotCodes::kMxfp4) return std::ldexp(1.0, int(s[k / 32]) - 127);
  bf16 b;
  std::memcpy(&b, s + 2 * (k / p.group), sizeof(b));
  return bf16_to_f32(b);
}

// The activation quantization written out from qdot.h's definition, in fp32 as defined.
void quantize_by_definition(const float* x, int64_t K, std::vector<int>& t, std::vector<float>& d,
                            QdotActs acts = QdotActs::kInt8) {
  const float top = top_code(acts);
  t.assign(static_cast<size_t>(K), 0);
  d.assign(static_cast<size_t>(K / 32), 0.0f);
  for (int64_t j = 0; j < K / 32; ++j) {
    float amax = 0.0f;
    for (int64_t k = 32 * j; k < 32 * j + 32; ++k) amax = std::max(amax, std::fabs(x[k]));
    d[j] = amax / top;
    if (amax == 0.0f) continue;
    for (int64_t k = 32 * j; k < 32 * j + 32; ++k) {
      const float q = x[k] / d[j];  // one fp32 division, then round half to even
      t[k] = static_cast<int>(std::clamp(std::nearbyint(q), -top, top));
    }
  }
}

// float64 value of the W·A8 product the kernels compute exactly up to fp32 rounding, and the sum
// of the absolute terms for the error bound.
void reference(const Problem& p, int64_t r, int b, double* y, double* abs_sum) {
  std::vector<int> t;
  std::vector<float> d;
  quantize_by_definition(p.x.data() + b * p.ldx, p.K, t, d, p.acts);
  double s = 0, a = 0;
  for (int64_t k = 0; k < p.K; ++k) {
    const double v = code_value(p, r, k) * weight_scale(p, r, k) * t[k] * double(d[k / 32]);
    s += v;
    a += std::fabs(v);
  }
  *y = s;
  *abs_sum = a;
}

// Per lane, each term is an exact int32 partial sum times d (one rounding), added times s with an
// fma (one rounding; the portable path a multiply and an add: two, and for int8 weights with
// int16 activations the sub-group's int32 sum may round once on conversion) in one of at most
// G = K/32 accumulation steps, then a tree of depth <= 4: every term passes through at most G + 8
// roundings, so |y - exact| <= (G + 9) u sum |terms|.
double error_bound(int64_t K, double abs_sum) {
  return static_cast<double>(K / 32 + 9) * 0x1p-24 * abs_sum;
}

TEST(Qdot, IsaFollowsLevel) {
  IsaList isas;
  const char* expect[] = {"portable", "avx2", "avx2", "avx512vnni"};
  for (size_t i = 0; i < isas.names.size(); ++i) {
    isas.use(isas.names[i]);
    EXPECT_STREQ(matmul_qdot_isa(), expect[i]) << isas.names[i];
  }
}

// quantize_activations_int8 is its definition, element by element, and rounds to within d / 2.
TEST(Qdot, ActivationQuantizerFollowsDefinition) {
  Rng rng(21);
  const int64_t K = 320;
  std::vector<float> x(K);
  for (auto& v : x) v = static_cast<float>(rng.normal() * 3.0);
  for (int k = 32; k < 64; ++k) x[k] = 0.0f;  // an all-zero sub-group: d = 0, t = 0
  x[70] = -1e30f;                             // a huge negative maximum
  for (int k = 96; k < 128; ++k) x[k] = 1e-39f * float(k - 100);  // subnormal inputs
  // Each quantizer's codes and scales against the definition (with its T), within d / 2.
  auto check = [&](const auto& t, const std::vector<float>& d, QdotActs acts) {
    std::vector<int> want_t;
    std::vector<float> want_d;
    quantize_by_definition(x.data(), K, want_t, want_d, acts);
    for (int64_t j = 0; j < K / 32; ++j) {
      ASSERT_EQ(std::bit_cast<uint32_t>(d[j]), std::bit_cast<uint32_t>(want_d[j])) << j;
      for (int64_t k = 32 * j; k < 32 * j + 32; ++k) {
        ASSERT_EQ(int(t[k]), want_t[k]) << k;
        ASSERT_LE(std::fabs(double(x[k]) - t[k] * double(d[j])), double(d[j]) * 0.5000001 + 1e-45)
            << k;
      }
    }
  };
  std::vector<int8_t> t(K, 99);
  std::vector<float> d(K / 32, -1.0f);
  quantize_activations_int8(x.data(), K, t.data(), d.data());
  check(t, d, QdotActs::kInt8);
  EXPECT_EQ(d[1], 0.0f);
  EXPECT_EQ(t[70], -127);
  // int16: the same definition with T = 32385, and a rounding 255 times finer.
  std::vector<int16_t> t16(K, 99);
  quantize_activations_int16(x.data(), K, t16.data(), d.data());
  check(t16, d, QdotActs::kInt16);
  EXPECT_EQ(t16[70], -32385);
  EXPECT_EQ(kQdotInt16Max, 127 * 255);
}

TEST(Qdot, MatchesFloat64Reference) {
  IsaList isas;
  Rng rng(22);
  struct Shape {
    int64_t rows, K;
    int group, B;
  };
  // K = 32, 96, 160, 224: partial last chunks of both formats; B = 70: two batch blocks.
  const Shape shapes[] = {{1, 32, 32, 1},     {5, 64, 64, 3},    {37, 96, 32, 1},
                          {18, 384, 128, 2},  {3, 7168, 128, 1}, {21, 3072, 64, 5},
                          {17, 224, 224, 9},  {40, 128, 128, 4}, {9, 2304, 128, 1},
                          {6, 2304, 2304, 2}, {11, 640, 160, 3}, {70, 512, 256, 70},
                          {4, 1536, 96, 1},   {19, 160, 32, 8}};
  for (const QdotActs acts : kActs)
    for (const QdotCodes kind : kKinds) {
      for (const auto& isa : isas.names) {
        isas.use(isa);
        for (const auto& s : shapes) {
          const Problem p = make_problem(rng, kind, s.rows, s.K, s.group, s.B, acts);
          const int64_t r0 = s.rows > 2 ? 1 : 0;
          const auto y = run(p, r0, s.rows);
          const std::string what = isa + " " + kind_name(kind) + " " + acts_name(acts) +
                                   " rows=" + std::to_string(s.rows) + " K=" + std::to_string(s.K) +
                                   " g=" + std::to_string(s.group) + " B=" + std::to_string(s.B);
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
}

// Every output of p's kernel equal to the exact sum of code x scale x activation (activations that
// quantize to themselves, values whose sums fp32 holds exactly).
void expect_exact(const Problem& p, const std::string& where) {
  const auto y = run(p, 0, p.rows);
  for (int b = 0; b < p.B; ++b)
    for (int64_t r = 0; r < p.rows; ++r) {
      double want = 0;
      for (int64_t k = 0; k < p.K; ++k)
        want += code_value(p, r, k) * weight_scale(p, r, k) * p.x[b * p.ldx + k];
      ASSERT_EQ(static_cast<double>(y[static_cast<size_t>(b * p.ldy + r)]), want)
          << where << " b=" << b << " r=" << r;
    }
}

// Activations that quantize exactly (every sub-group holds +-127 and integers: d = 1, t = x) and
// power-of-two weight scales: every product and sum is exact, so every path equals the reference
// exactly; a nibble-order, offset, correction, scale-index or stride mistake shows here.
TEST(Qdot, ExactOnSmallIntegers) {
  IsaList isas;
  Rng rng(23);
  for (const QdotCodes kind : kKinds) {
    for (const auto& isa : isas.names) {
      isas.use(isa);
      for (auto [B, K, g] : {std::tuple{1, 256, 32},
                             {3, 256, 128},
                             {6, 640, 64},
                             {1, 640, 640},
                             {5, 1152, 96},
                             {2, 96, 32}}) {
        Problem p = make_problem(rng, kind, 23, K, g, B);
        if (kind == QdotCodes::kInt8)
          for (auto& v : p.codes) v = static_cast<uint8_t>(120 + rng.next() % 17);
        for (int64_t r = 0; r < p.rows; ++r) {
          for (int64_t i = 0; i < K / p.group; ++i) {
            const int e = static_cast<int>(rng.next() % 5) - 1;
            p.set_scale(r, i, std::ldexp(1.0f, e), e);
          }
        }
        for (int b = 0; b < B; ++b)
          for (int64_t k = 0; k < K; ++k)
            p.x[b * p.ldx + k] =
                k % 32 == 5 ? 127.0f : static_cast<float>(static_cast<int>(rng.next() % 21) - 10);
        expect_exact(
            p, isa + " " + kind_name(kind) + " K=" + std::to_string(K) + " g=" + std::to_string(g));
      }
    }
  }
}

// int16 activations that quantize exactly (every sub-group holds +-32385 and integers whose split
// t = 255 h + l exercises both bytes' signs: d = 1, t = x) with small weight codes and scales 2^-1
// .. 2^1, so that every product and partial sum is an integer below 2^24: every path equals the
// reference exactly. A wrong split, plane, lane combination or correction shows here.
TEST(Qdot, Int16ExactOnSmallIntegers) {
  IsaList isas;
  Rng rng(27);
  for (const QdotCodes kind : kKinds) {
    for (const auto& isa : isas.names) {
      isas.use(isa);
      for (auto [B, K, g] :
           {std::tuple{1, 256, 32}, {3, 256, 128}, {2, 96, 32}, {5, 192, 96}, {1, 64, 64}}) {
        Problem p = make_problem(rng, kind, 13, K, g, B, QdotActs::kInt16);
        if (kind == QdotCodes::kInt8)
          for (auto& v : p.codes) v = static_cast<uint8_t>(120 + rng.next() % 17);
        for (int64_t r = 0; r < p.rows; ++r)
          for (int64_t i = 0; i < K / p.group; ++i) {
            const int e = static_cast<int>(rng.next() % 3) - 1;
            p.set_scale(r, i, std::ldexp(1.0f, e), e);
          }
        for (int b = 0; b < B; ++b)
          for (int64_t k = 0; k < K; ++k)
            p.x[b * p.ldx + k] = k % 32 == 7   ? (k % 64 == 7 ? 32385.0f : -32385.0f)
                                 : k % 32 == 9 ? -32385.0f + float(rng.next() % 300)
                                               : static_cast<float>(int(rng.next() % 6001) - 3000);
        expect_exact(p, isa + " " + kind_name(kind) + " a16 K=" + std::to_string(K) +
                            " g=" + std::to_string(g));
      }
    }
  }
}

// The W·A8 (W·A16 integer) result differs from the fp32-activation kernel (int4.h / int8.h /
// mxfp4.h) only by the activations' rounding: |x - t d| <= d / 2 per column, so
// |y_int - y_fp32| <= sum_k |w_k| d_k / 2 plus both kernels' fp32 bounds. With int16 activations
// d is 255 times smaller, and so is the gap (checked: below 1/100 of the int8 gap's).
TEST(Qdot, WithinActivationRoundingOfWeightOnlyKernel) {
  Rng rng(24);
  for (const QdotCodes kind : kKinds) {
    double gap[2] = {0, 0};
    for (const QdotActs acts : kActs) {
      const Problem p = make_problem(rng, kind, 33, 2304, 128, 3, acts);
      const auto y8 = run(p, 0, p.rows);
      std::vector<float> y16(y8.size(), kSentinel);
      const auto* bf16_scales = reinterpret_cast<const bf16*>(p.scales.data());
      if (kind == QdotCodes::kInt4) {
        matmul_int4(p.codes.data(), bf16_scales, p.K, p.group, 0, p.rows, p.x.data(), p.B, p.ldx,
                    y16.data(), p.ldy);
      } else if (kind == QdotCodes::kInt8) {
        matmul_int8(p.codes.data(), bf16_scales, p.K, p.group, 0, p.rows, p.x.data(), p.B, p.ldx,
                    y16.data(), p.ldy);
      } else {
        matmul_mxfp4(p.codes.data(), p.scales.data(), p.K, 0, p.rows, p.x.data(), p.B, p.ldx,
                     y16.data(), p.ldy, /*x_is_bf16=*/false);
      }
      double worst = 0;
      for (int b = 0; b < p.B; ++b) {
        std::vector<int> t;
        std::vector<float> d;
        quantize_by_definition(p.x.data() + b * p.ldx, p.K, t, d, acts);
        for (int64_t r = 0; r < p.rows; ++r) {
          double rounding = 0, abs_sum = 0;
          for (int64_t k = 0; k < p.K; ++k) {
            const double w = code_value(p, r, k) * weight_scale(p, r, k);
            rounding += std::fabs(w) * d[k / 32] * 0.5;
            abs_sum += std::fabs(w * p.x[b * p.ldx + k]);
          }
          const double diff = std::fabs(double(y8[b * p.ldy + r]) - double(y16[b * p.ldy + r]));
          ASSERT_LE(diff, rounding + 2 * error_bound(p.K, abs_sum))
              << kind_name(kind) << " " << acts_name(acts) << " r " << r;
          worst = std::max(worst, diff / rounding);
          gap[acts == QdotActs::kInt16] += diff;
        }
      }
      // The bound is not vacuous: the activations' rounding does show (random signs make the
      // typical error far below the worst case, but not zero).
      EXPECT_GT(worst, 0.0) << kind_name(kind) << " " << acts_name(acts);
    }
    EXPECT_LT(gap[1], gap[0] / 100) << kind_name(kind);
  }
}

// Y[b, r] depends only on row r, vector b, K and the group: row splits, batching and threads
// change nothing, bit for bit.
TEST(Qdot, SplitBatchAndThreadInvariance) {
  IsaList isas;
  Rng rng(25);
  for (const QdotActs acts : kActs)
    for (const QdotCodes kind : kKinds) {
      for (const auto& isa : isas.names) {
        isas.use(isa);
        for (auto [K, g] :
             {std::pair<int64_t, int>{32, 32}, {416, 32}, {3072, 128}, {2304, 2304}}) {
          const int B = 70;
          const Problem p = make_problem(rng, kind, 45, K, g, B, acts);
          test::expect_split_batch_thread_invariance(
              p.rows, B, p.ldy,
              [&](int64_t r0, int64_t r1, int b0, int nb, float* y) {
                matmul_qdot(p.weights(), r0, r1, p.x.data() + b0 * p.ldx, nb, p.ldx, y, p.ldy);
              },
              isa + " " + kind_name(kind) + " " + acts_name(acts) + " K=" + std::to_string(K) +
                  " g=" + std::to_string(g));
        }
      }
    }
}

// A kernel may keep the packed activations of its last call and use them again when the next
// call's vectors are bit-identical (qdot_avx2.cpp). Calls that differ from the previous one in
// anything (one element changed in place at the same address, the format, K, the batch, the
// stride) must give what a first call on fresh buffers gives, bit for bit.
TEST(Qdot, ReusedPackingFollowsTheVectors) {
  IsaList isas;
  Rng rng(26);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (int B : {1, 3}) {
      Problem a = make_problem(rng, QdotCodes::kInt4, 12, 256, 128, B);
      const Problem b8 = make_problem(rng, QdotCodes::kInt8, 12, 256, 128, B);
      // Fresh results: each problem on its own copy of the vectors.
      auto fresh = [&](const Problem& p) {
        Problem q = p;
        return run(q, 0, q.rows);
      };
      const std::string where = isa + " B=" + std::to_string(B);
      std::vector<float> want = fresh(a);
      EXPECT_EQ(run(a, 0, a.rows), want) << where;  // first call
      EXPECT_EQ(run(a, 0, a.rows), want) << where;  // the same vectors again
      // The same addresses, one element changed (the last vector's, past the middle), right
      // after a call on them.
      a.x[static_cast<size_t>((B - 1) * a.ldx + 200)] += 0.75f;
      const std::vector<float> got = run(a, 0, a.rows);
      want = fresh(a);
      EXPECT_NE(got, run(b8, 0, b8.rows));  // (the vectors differ, so do the results)
      EXPECT_EQ(got, want) << where << ": changed in place";
      // Another format with other vectors, then back.
      EXPECT_EQ(run(b8, 0, b8.rows), fresh(b8)) << where << ": int8";
      EXPECT_EQ(run(a, 0, a.rows), want) << where << ": int4 again";
      // The same vectors with the other activation format: packed anew (not the int8 packing),
      // then back.
      Problem a16 = a;
      a16.acts = QdotActs::kInt16;
      a16.x = a.x;
      const std::vector<float> want16 = fresh(a16);
      EXPECT_NE(want16, want) << where;  // (the activations' rounding differs)
      std::vector<float> y16(static_cast<size_t>(B * a.ldy), kSentinel);
      matmul_qdot(a16.weights(), 0, a.rows, a.x.data(), B, a.ldx, y16.data(), a.ldy);
      EXPECT_EQ(y16, want16) << where << ": int16 activations of the same vectors";
      EXPECT_EQ(run(a, 0, a.rows), want) << where << ": int8 activations again";
      // Fewer vectors from the same start (a prefix of the batch).
      if (B > 1) {
        Problem one = a;
        one.B = 1;
        std::vector<float> y(static_cast<size_t>(a.ldy), kSentinel);
        matmul_qdot(a.weights(), 0, a.rows, a.x.data(), 1, a.ldx, y.data(), a.ldy);
        EXPECT_EQ(y, fresh(one)) << where << ": prefix";
      }
    }
  }
}

}  // namespace
}  // namespace md::cpu
