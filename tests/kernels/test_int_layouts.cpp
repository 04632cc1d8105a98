// The pack-quantized layouts beyond the plain symmetric one, through the kernels' one entry,
// cpu::linear_rows, at every ISA level:
//  * asymmetric int4 (zero points; kernels/cpu/int4.h int4_zero_point_terms): W4A16 and W4A8
//    against float64 references written out from the format's definition (W[r][k] =
//    (c - zc) * scale), exact on small integers, invariant to row splits and batches; the
//    int8-codes conversion the CUDA executors upload is the same weights;
//  * activation-ordered columns (LinearWeights::col_perm): the same bits as the plain layout
//    on the vectors gathered by the permutation, int4 / int8, W16 and W8 activations, with and
//    without zero points (model/binder.cpp builds the permutation from weight_g_idx; its
//    semantics are tested on a whole checkpoint in tests/model/test_pack_quantized.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "isa_list.h"
#include "matmul_checks.h"
#include "megadecode/base/bf16.h"
#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/int4.h"
#include "megadecode/kernels/cpu/linear.h"
#include "megadecode/kernels/cpu/qdot.h"

namespace md::cpu {
namespace {

using test::IsaList;
using test::kSentinel;
constexpr double u = 0x1p-24;

struct Problem {
  int64_t rows = 0, K = 0;
  int group = 0, B = 0;
  int64_t ldx = 0, ldy = 0;
  std::vector<uint8_t> packed;
  std::vector<bf16> scales;
  std::vector<int8_t> z;  // zc - 8
  std::vector<float> x;
  int64_t G() const { return K / group; }
};

Problem make_problem(Rng& rng, int64_t rows, int64_t K, int group, int B) {
  Problem p;
  p.rows = rows;
  p.K = K;
  p.group = group;
  p.B = B;
  p.ldx = K + 3;
  p.ldy = rows + 5;
  p.packed.resize(size_t(rows * K / 2));
  for (auto& v : p.packed) v = uint8_t(rng.next() & 255);
  p.scales.resize(size_t(rows * p.G()));
  for (auto& v : p.scales) v = f32_to_bf16(float(rng.uniform() * 0.02 + 1e-4));
  p.z.resize(size_t(rows * p.G()));
  for (auto& v : p.z) v = int8_t(int(rng.next() % 16) - 8);
  p.x.resize(size_t(B * p.ldx));
  for (auto& v : p.x) v = round_bf16(float(rng.normal()));
  return p;
}

std::vector<float> run(const Problem& p, int64_t r0, int64_t r1, bool a8) {
  std::vector<float> y(size_t(p.B * p.ldy), kSentinel);
  LinearWeights w;
  w.data = p.packed.data();
  w.scales = reinterpret_cast<const uint8_t*>(p.scales.data());
  w.dtype = DType::U8;
  w.quant = WeightQuant::kInt4;
  w.cols = p.K;
  w.group = p.group;
  w.int_act_bits = a8 ? 8 : 0;
  w.zero_points = p.z.data();
  linear_rows(w, r0, r1, p.x.data(), p.B, p.ldx, y.data(), p.ldy, false);
  return y;
}

int code(const Problem& p, int64_t r, int64_t k) {
  const uint8_t byte = p.packed[size_t(r * p.K / 2 + k / 2)];
  return k % 2 ? byte >> 4 : byte & 15;
}
double scale(const Problem& p, int64_t r, int64_t k) {
  return bf16_to_f32(p.scales[size_t(r * p.G() + k / p.group)]);
}
int zero(const Problem& p, int64_t r, int64_t k) {
  return p.z[size_t(r * p.G() + k / p.group)];
}

// float64: sum_k (c - zc) s x_k with zc = z + 8. W4A8 (a8): the symmetric part's activations are
// quantized (qdot.h's definition), the zero points' part reads x as given (linear.h). The bound
// is the symmetric kernel's on its terms (test_int4.cpp / test_qdot.cpp) plus the zero-point
// terms': xs summed in 16 lanes and a tree (group/16 + 4 roundings), a product and G/16 + 4
// accumulation roundings, and the final subtraction.
void reference(const Problem& p, int64_t r, int b, bool a8, double* y, double* bound) {
  const float* x = p.x.data() + b * p.ldx;
  std::vector<int8_t> t(size_t(p.K));
  std::vector<float> d(size_t(p.K / 32));
  if (a8) quantize_activations_int8(x, p.K, t.data(), d.data());
  double sym = 0, sym_abs = 0, zp = 0, zp_abs = 0;
  for (int64_t k = 0; k < p.K; ++k) {
    const double xa = a8 ? double(t[size_t(k)]) * d[size_t(k / 32)] : double(x[k]);
    const double v = (code(p, r, k) - 8) * scale(p, r, k) * xa;
    sym += v;
    sym_abs += std::fabs(v);
    const double w = zero(p, r, k) * scale(p, r, k) * double(x[k]);
    zp += w;
    zp_abs += std::fabs(w);
  }
  *y = sym - zp;
  const int64_t G = p.K / 32;
  const double n_sym = a8 ? double(G + 9) : double(std::max(G + 9, (G + 3) / 4 + 12)) + 2;
  const double n_zp = double(p.group / 16 + 4) + double((p.G() + 15) / 16 + 4) + 2;
  *bound = n_sym * u * sym_abs + n_zp * u * zp_abs + u * std::fabs(*y);
}

TEST(Int4ZeroPoints, MatchFloat64Reference) {
  IsaList isas;
  Rng rng(41);
  struct Shape {
    int64_t rows, K;
    int group, B;
  };
  const Shape shapes[] = {{1, 32, 32, 1},    {5, 64, 32, 3},      {37, 96, 32, 1},
                          {18, 384, 128, 2}, {3, 7168, 128, 1},   {21, 3072, 64, 5},
                          {9, 2304, 128, 1}, {6, 2304, 2304, 2},  {11, 640, 160, 3},
                          {7, 512, 256, 9},  {19, 3072, 1024, 8}, {4, 4608, 32, 1}};
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (bool a8 : {false, true})
      for (const auto& s : shapes) {
        const Problem p = make_problem(rng, s.rows, s.K, s.group, s.B);
        const int64_t r0 = s.rows > 2 ? 1 : 0;
        const auto y = run(p, r0, s.rows, a8);
        const std::string what = isa + (a8 ? " W4A8" : " W4A16") +
                                 " rows=" + std::to_string(s.rows) + " K=" + std::to_string(s.K) +
                                 " g=" + std::to_string(s.group) + " B=" + std::to_string(s.B);
        test::expect_rows_match(
            y, p.B, p.ldy, r0, s.rows,
            [&](int64_t r, int b, double* want, double* bound) {
              reference(p, r, b, a8, want, bound);
            },
            what);
      }
  }
}

// Small integers, power-of-two scales: every product and sum is exact (W4A16), so every level
// equals the reference exactly; a sign, a group index or a row stride wrong shows here.
TEST(Int4ZeroPoints, ExactOnSmallIntegers) {
  IsaList isas;
  Rng rng(43);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (auto [B, K, g] : {std::tuple{1, 256, 32}, {3, 256, 128}, {2, 1152, 96}, {1, 640, 640}}) {
      Problem p = make_problem(rng, 13, K, g, B);
      for (auto& v : p.scales) v = f32_to_bf16(std::ldexp(1.0f, int(rng.next() % 5) - 1));
      for (auto& v : p.x) v = float(int(rng.next() % 17) - 8);
      const auto y = run(p, 0, p.rows, false);
      for (int b = 0; b < B; ++b)
        for (int64_t r = 0; r < p.rows; ++r) {
          double want, bound;
          reference(p, r, b, false, &want, &bound);
          ASSERT_EQ(double(y[size_t(b * p.ldy + r)]), want)
              << isa << " K=" << K << " g=" << g << " b=" << b << " r=" << r;
        }
    }
  }
}

TEST(Int4ZeroPoints, SplitBatchAndThreadInvariance) {
  IsaList isas;
  Rng rng(47);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (bool a8 : {false, true})
      for (auto [K, g] : {std::pair<int64_t, int>{416, 32}, {2304, 128}}) {
        const int B = 11;
        const Problem p = make_problem(rng, 45, K, g, B);
        LinearWeights w;
        w.data = p.packed.data();
        w.scales = reinterpret_cast<const uint8_t*>(p.scales.data());
        w.dtype = DType::U8;
        w.quant = WeightQuant::kInt4;
        w.cols = K;
        w.group = g;
        w.int_act_bits = a8 ? 8 : 0;
        w.zero_points = p.z.data();
        test::expect_split_batch_thread_invariance(
            p.rows, B, p.ldy,
            [&](int64_t r0, int64_t r1, int b0, int nb, float* y) {
              linear_rows(w, r0, r1, p.x.data() + b0 * p.ldx, nb, p.ldx, y, p.ldy, false);
            },
            isa + (a8 ? " W4A8" : " W4A16") + " K=" + std::to_string(K));
      }
  }
}

// The int8 codes (c - zc + 128) the CUDA executors upload hold the same weights.
TEST(Int4ZeroPoints, Int8CodesAreTheSameWeights) {
  Rng rng(53);
  const Problem p = make_problem(rng, 7, 384, 128, 1);
  std::vector<uint8_t> c8(size_t(p.rows * p.K));
  int4_zero_points_to_int8_codes(p.packed.data(), p.z.data(), p.rows, p.K, p.group, c8.data());
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t k = 0; k < p.K; ++k)
      ASSERT_EQ(int(c8[size_t(r * p.K + k)]) - 128, code(p, r, k) - (zero(p, r, k) + 8))
          << r << " " << k;
}

// Stored column j multiplies X[perm[j]]: the call equals the plain layout's on the vectors
// gathered in that order, bit for bit (the entry gathers, then runs the same kernels).
TEST(ActOrder, EqualsThePlainLayoutOnGatheredVectors) {
  IsaList isas;
  Rng rng(59);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (WeightQuant q : {WeightQuant::kInt4, WeightQuant::kInt8})
      for (bool a8 : {false, true})
        for (bool zp : {false, true}) {
          if (zp && q != WeightQuant::kInt4) continue;
          const int64_t rows = 19, K = 384;
          const int group = 64, B = 3;
          Problem p = make_problem(rng, rows, K, group, B);
          if (q == WeightQuant::kInt8) {
            p.packed.resize(size_t(rows * K));
            for (auto& v : p.packed) v = uint8_t(rng.next() & 255);
          }
          std::vector<int32_t> perm(static_cast<size_t>(K));
          for (int64_t k = 0; k < K; ++k) perm[size_t(k)] = int32_t(k);
          for (int64_t k = K - 1; k > 0; --k)
            std::swap(perm[size_t(k)], perm[size_t(rng.next() % uint64_t(k + 1))]);
          LinearWeights w;
          w.data = p.packed.data();
          w.scales = reinterpret_cast<const uint8_t*>(p.scales.data());
          w.dtype = DType::U8;
          w.quant = q;
          w.cols = K;
          w.group = group;
          w.int_act_bits = a8 ? 8 : 0;
          w.zero_points = zp ? p.z.data() : nullptr;
          std::vector<float> xg(size_t(B * K));
          for (int b = 0; b < B; ++b)
            for (int64_t j = 0; j < K; ++j)
              xg[size_t(b * K + j)] = p.x[size_t(b * p.ldx + perm[size_t(j)])];
          std::vector<float> want(size_t(B * p.ldy), kSentinel), got(want);
          linear_rows(w, 2, rows, xg.data(), B, K, want.data(), p.ldy, false);
          w.col_perm = perm.data();
          linear_rows(w, 2, rows, p.x.data(), B, p.ldx, got.data(), p.ldy, false);
          ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4))
              << isa << (q == WeightQuant::kInt4 ? " int4" : " int8") << (a8 ? " A8" : "")
              << (zp ? " zero points" : "");
        }
  }
}

}  // namespace
}  // namespace md::cpu
