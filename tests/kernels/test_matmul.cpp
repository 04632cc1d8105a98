#include "megadecode/kernels/cpu/matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/base/threads.h"
#include "megadecode/base/util.h"
#include "megadecode/kernels/cpu/bandwidth.h"
#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu {
namespace {

// Error bound. Every path forms each output as fp32 sums of the products w_k * x_k, where a
// product is either exact (bf16 x bf16 fits in fp32; a fused multiply-add rounds only the sum)
// or rounded once (the portable path multiplies and adds separately). Every path spreads K over
// at least 8 lanes and then reduces the lanes in a tree of depth <= 4, so each term passes through
// at most n = ceil(K / 8) + 5 roundings (lane sum, product, tree), each with relative error
// <= u = 2^-24. The standard recursive-summation bound then gives
// |y - exact| <= gamma_n * sum_k |w_k x_k|, gamma_n = n u / (1 - n u) < (n + 1) u for n <= 2^11,
// i.e. K <= 16000. (The "K u sum|w x|" bound of plain sequential accumulation is looser by 8x.)
// Typical errors are ~sqrt(n) u, far smaller; indexing bugs are caught exactly by the
// small-integer test rather than by this bound.
double error_bound(int64_t K, double sum_abs) {
  const double n = static_cast<double>((K + 7) / 8 + 5);
  return (n + 1) * 0x1p-24 * sum_abs;
}

struct Problem {
  int64_t rows = 0, K = 0;
  int B = 0;
  int64_t ldx = 0, ldy = 0;
  std::vector<bf16> w16;
  std::vector<float> w32, x;
};

// W ~ N(0, 0.05) (rounded to bf16 for the bf16 variant), X ~ N(0, 1), optionally rounded to bf16.
// Leading dimensions exceed the logical sizes so that stray reads and writes show up.
Problem make_problem(Rng& rng, int64_t rows, int64_t K, int B, bool x_bf16) {
  Problem p;
  p.rows = rows;
  p.K = K;
  p.B = B;
  p.ldx = K + 3;
  p.ldy = rows + 5;
  p.w16.resize(static_cast<size_t>(rows * K));
  p.w32.resize(p.w16.size());
  for (size_t i = 0; i < p.w16.size(); ++i) {
    float v = static_cast<float>(0.05 * rng.normal());
    p.w16[i] = f32_to_bf16(v);
    p.w32[i] = v;
  }
  p.x.resize(static_cast<size_t>(B * p.ldx));
  for (auto& v : p.x) {
    v = static_cast<float>(rng.normal());
    if (x_bf16) v = round_bf16(v);
  }
  return p;
}

// Sentinel outside [r0, r1) and the padding, so that writes outside the range are detected.
constexpr float kSentinel = -12345.0f;

std::vector<float> run_bf16(const Problem& p, int64_t r0, int64_t r1, bool x_bf16) {
  std::vector<float> y(static_cast<size_t>(p.B * p.ldy), kSentinel);
  matmul_bf16(p.w16.data(), p.K, r0, r1, p.x.data(), p.B, p.ldx, y.data(), p.ldy, x_bf16);
  return y;
}

std::vector<float> run_f32(const Problem& p, int64_t r0, int64_t r1) {
  std::vector<float> y(static_cast<size_t>(p.B * p.ldy), kSentinel);
  matmul_f32(p.w32.data(), p.K, r0, r1, p.x.data(), p.B, p.ldx, y.data(), p.ldy);
  return y;
}

// Checks y against a float64 reference on [r0, r1) and the sentinel elsewhere.
template <class WT>
void check_against_reference(const Problem& p, const std::vector<WT>& w,
                             const std::vector<float>& y, int64_t r0, int64_t r1,
                             const std::string& what) {
  for (int b = 0; b < p.B; ++b) {
    for (int64_t r = 0; r < p.ldy; ++r) {
      const float got = y[static_cast<size_t>(b * p.ldy + r)];
      if (r < r0 || r >= r1) {
        ASSERT_EQ(got, kSentinel) << what << " wrote outside its range: b=" << b << " r=" << r;
        continue;
      }
      double ref = 0, sum_abs = 0;
      for (int64_t k = 0; k < p.K; ++k) {
        double wk;
        if constexpr (sizeof(WT) == 2) {
          wk = bf16_to_f32(w[static_cast<size_t>(r * p.K + k)]);
        } else {
          wk = w[static_cast<size_t>(r * p.K + k)];
        }
        const double t = wk * p.x[static_cast<size_t>(b * p.ldx + k)];
        ref += t;
        sum_abs += std::fabs(t);
      }
      ASSERT_LE(std::fabs(got - ref), error_bound(p.K, sum_abs))
          << what << " b=" << b << " r=" << r << " got=" << got << " ref=" << ref;
    }
  }
}

// The ISA levels this CPU can run (cpu_features.h), lowest first; restores the start-up level
// when destroyed.
struct IsaList {
  std::vector<std::string> names;
  IsaList() {
    for (int i = 0; i <= static_cast<int>(hardware_isa()); ++i)
      names.emplace_back(isa_name(static_cast<Isa>(i)));
  }
  ~IsaList() { reset_isa(); }
  void use(const std::string& n) const {
    Isa isa;
    ASSERT_TRUE(parse_isa(n, &isa)) << n;
    ASSERT_EQ(set_isa(isa), isa) << n;
    ASSERT_EQ(std::string(matmul_isa()), n);
  }
};

const int64_t kKs[] = {1, 7, 16, 31, 32, 33, 100, 513, 2304, 9216};
const int kBs[] = {1, 2, 3, 8, 17};

TEST(Matmul, IsaSelection) {
  IsaList isas;
  set_isa(Isa::kPortable);
  EXPECT_STREQ(matmul_isa(), "portable");
  // Asking for more than the CPU has is clamped to the best it has.
  EXPECT_EQ(set_isa(Isa::kAvx512Bf16), hardware_isa());
  EXPECT_EQ(std::string(matmul_isa()), isas.names.back());
}

TEST(Matmul, Bf16MatchesFloat64Reference) {
  IsaList isas;
  Rng rng(1);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (int64_t K : kKs) {
      for (int B : kBs) {
        for (bool x_bf16 : {false, true}) {
          const int64_t rows = 3 + static_cast<int64_t>(rng.uniform() * 30);
          Problem p = make_problem(rng, rows, K, B, x_bf16);
          const int64_t r0 = static_cast<int64_t>(rng.uniform() * 3);
          const int64_t r1 = rows - static_cast<int64_t>(rng.uniform() * 3);
          auto y = run_bf16(p, r0, r1, x_bf16);
          check_against_reference(p, p.w16, y, r0, r1,
                                  isa + " K=" + std::to_string(K) + " B=" + std::to_string(B) +
                                      " x_bf16=" + std::to_string(x_bf16));
        }
      }
    }
  }
}

TEST(Matmul, F32MatchesFloat64Reference) {
  IsaList isas;
  Rng rng(2);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (int64_t K : kKs) {
      for (int B : kBs) {
        const int64_t rows = 3 + static_cast<int64_t>(rng.uniform() * 30);
        Problem p = make_problem(rng, rows, K, B, false);
        const int64_t r0 = static_cast<int64_t>(rng.uniform() * 3);
        const int64_t r1 = rows - static_cast<int64_t>(rng.uniform() * 3);
        auto y = run_f32(p, r0, r1);
        check_against_reference(p, p.w32, y, r0, r1,
                                isa + " f32 K=" + std::to_string(K) + " B=" + std::to_string(B));
      }
    }
  }
}

// Small integers make every product and partial sum exact in fp32 (|sum| < 2^24), so every path
// must reproduce the reference exactly: a skipped, repeated or misplaced element cannot hide
// inside the rounding bound.
TEST(Matmul, ExactOnSmallIntegers) {
  IsaList isas;
  Rng rng(3);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (int64_t K : kKs) {
      for (int B : {1, 3, 8}) {
        const int64_t rows = 21;
        Problem p = make_problem(rng, rows, K, B, true);
        for (size_t i = 0; i < p.w16.size(); ++i) {
          p.w32[i] = static_cast<float>(static_cast<int>(rng.next() % 15) - 7);
          p.w16[i] = f32_to_bf16(p.w32[i]);
        }
        for (auto& v : p.x) v = static_cast<float>(static_cast<int>(rng.next() % 15) - 7);
        for (int mode = 0; mode < 3; ++mode) {
          auto y = mode == 2 ? run_f32(p, 0, rows) : run_bf16(p, 0, rows, mode == 1);
          for (int b = 0; b < B; ++b) {
            for (int64_t r = 0; r < rows; ++r) {
              int64_t ref = 0;
              for (int64_t k = 0; k < K; ++k) {
                ref += static_cast<int64_t>(p.w32[static_cast<size_t>(r * K + k)]) *
                       static_cast<int64_t>(p.x[static_cast<size_t>(b * p.ldx + k)]);
              }
              ASSERT_EQ(y[static_cast<size_t>(b * p.ldy + r)], static_cast<float>(ref))
                  << isa << " mode=" << mode << " K=" << K << " B=" << B << " b=" << b
                  << " r=" << r;
            }
          }
        }
      }
    }
  }
}

// The engine splits rows across threads and tiles and batches vectors in varying numbers; each
// output must not depend on that (bitwise), nor vary between identical calls.
TEST(Matmul, RowSplitAndBatchInvariance) {
  IsaList isas;
  Rng rng(4);
  for (const auto& isa : isas.names) {
    isas.use(isa);
    for (int64_t K : {7, 33, 100, 2304}) {
      for (int B : {1, 2, 3, 17, 66}) {
        for (int mode = 0; mode < 3; ++mode) {
          const bool x_bf16 = mode == 1;
          const int64_t rows = 45;
          Problem p = make_problem(rng, rows, K, B, x_bf16);
          auto full = [&](int64_t a, int64_t e) {
            return mode == 2 ? run_f32(p, a, e) : run_bf16(p, a, e, x_bf16);
          };
          const auto y = full(0, rows);
          ASSERT_EQ(0, std::memcmp(y.data(), full(0, rows).data(), y.size() * sizeof(float)))
              << isa << " not deterministic";
          // Random pieces, including single rows and odd boundaries, in one shared output.
          std::vector<float> pieces(y.size(), kSentinel);
          for (int64_t a = 0; a < rows;) {
            const int64_t e = std::min<int64_t>(rows, a + 1 + rng.next() % 11);
            auto part = full(a, e);
            for (int b = 0; b < B; ++b)
              for (int64_t r = a; r < e; ++r) {
                const size_t i = static_cast<size_t>(b * p.ldy + r);
                pieces[i] = part[i];
              }
            a = e;
          }
          ASSERT_EQ(0, std::memcmp(y.data(), pieces.data(), y.size() * sizeof(float)))
              << isa << " mode=" << mode << " K=" << K << " B=" << B << ": row split changed bits";
          // Each vector alone (B = 1) against its slot in the batch.
          Problem one = p;
          one.B = 1;
          for (int b = 0; b < B; b += 5) {
            one.x.assign(p.x.begin() + b * p.ldx, p.x.begin() + (b + 1) * p.ldx);
            auto y1 = mode == 2 ? run_f32(one, 0, rows) : run_bf16(one, 0, rows, x_bf16);
            ASSERT_EQ(0, std::memcmp(y1.data(), y.data() + b * p.ldy, rows * sizeof(float)))
                << isa << " mode=" << mode << " K=" << K << " B=" << B << " b=" << b
                << ": batch size changed bits";
          }
        }
      }
    }
  }
}

// Different ISAs round differently but must each stay within the bound of the exact result, so
// they agree within twice the bound.
TEST(Matmul, IsasAgree) {
  IsaList isas;
  if (isas.names.size() < 2) GTEST_SKIP() << "only the portable path runs on this CPU";
  Rng rng(5);
  for (int64_t K : {33, 2304, 9216}) {
    for (int B : {1, 4}) {
      for (int mode = 0; mode < 3; ++mode) {
        const bool x_bf16 = mode == 1;
        Problem p = make_problem(rng, 19, K, B, x_bf16);
        std::vector<std::vector<float>> ys;
        for (const auto& isa : isas.names) {
          isas.use(isa);
          ys.push_back(mode == 2 ? run_f32(p, 0, p.rows) : run_bf16(p, 0, p.rows, x_bf16));
        }
        for (int b = 0; b < B; ++b) {
          for (int64_t r = 0; r < p.rows; ++r) {
            double sum_abs = 0;
            for (int64_t k = 0; k < K; ++k) {
              const double w = mode == 2 ? p.w32[static_cast<size_t>(r * K + k)]
                                         : bf16_to_f32(p.w16[static_cast<size_t>(r * K + k)]);
              sum_abs += std::fabs(w * p.x[static_cast<size_t>(b * p.ldx + k)]);
            }
            const size_t i = static_cast<size_t>(b * p.ldy + r);
            for (size_t j = 1; j < ys.size(); ++j) {
              ASSERT_LE(std::fabs(static_cast<double>(ys[j][i]) - ys[0][i]),
                        2 * error_bound(K, sum_abs))
                  << isas.names[j] << " vs " << isas.names[0] << " mode=" << mode << " K=" << K;
            }
          }
        }
      }
    }
  }
}

TEST(Matmul, EmptyRangeWritesNothing) {
  Rng rng(6);
  Problem p = make_problem(rng, 8, 40, 2, true);
  auto y = run_bf16(p, 5, 5, true);
  for (float v : y) ASSERT_EQ(v, kSentinel);
}

TEST(Bandwidth, StreamSumsAgreeAndMeasurementIsPositive) {
  std::vector<unsigned char> raw(64 * 1000 + 64);
  unsigned char* p = raw.data() + (64 - reinterpret_cast<uintptr_t>(raw.data()) % 64) % 64;
  for (size_t i = 0; i < 64 * 1000; ++i) p[i] = static_cast<unsigned char>(i * 7 + 3);
  const auto a = detail::stream_read_sum_portable(p, 64 * 1000);
  if (__builtin_cpu_supports("avx512f")) {
    EXPECT_EQ(a, detail::stream_read_sum_avx512(p, 64 * 1000));
  }
  EXPECT_EQ(a, stream_read_sum(p, 64 * 1000));
  ThreadPool pool(2);
  const double gbps = measure_read_bandwidth_gbps(pool, size_t{16} << 20, 3);
  release_bandwidth_buffer();
  EXPECT_GT(gbps, 0.1);
}

}  // namespace
}  // namespace md::cpu
