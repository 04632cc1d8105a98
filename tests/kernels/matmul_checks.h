// Checks shared by the weight-format kernel tests (int4, int8, FP8, MXFP4, the integer dot
// products): every output against a float64 reference within a bound, nothing written outside
// the rows asked for, and the numerics contract that row splits, batching and threads change no
// bit of any output.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace md::cpu::test {

// The value every output slot holds before a call: a slot outside the rows asked for must keep it.
inline constexpr float kSentinel = -12345.0f;

// y holds B vectors of ldy outputs from a call on rows [r0, r1) of a matrix with `rows` rows (ldy
// >= rows); ref(r, b, &value, &bound) gives the float64 reference and the allowed error.
inline void expect_rows_match(const std::vector<float>& y, int B, int64_t ldy, int64_t r0,
                              int64_t r1,
                              const std::function<void(int64_t, int, double*, double*)>& ref,
                              const std::string& what) {
  for (int b = 0; b < B; ++b) {
    for (int64_t r = 0; r < ldy; ++r) {
      const float got = y[static_cast<size_t>(b * ldy + r)];
      if (r < r0 || r >= r1) {
        ASSERT_EQ(got, kSentinel) << what << " wrote outside its rows: b=" << b << " r=" << r;
        continue;
      }
      double want, bound;
      ref(r, b, &want, &bound);
      ASSERT_LE(std::fabs(static_cast<double>(got) - want), bound)
          << what << " b=" << b << " r=" << r << " got " << got << " want " << want;
    }
  }
}

// mm(r0, r1, b0, nb, y): the kernel on rows [r0, r1) of vectors [b0, b0 + nb), writing vector j's
// outputs at y[j * ldy + r]. The whole call (all rows, all B vectors) against: rows in pieces of
// 1, 3, 7 and 17; sub-batches of every size 1..5 at varying offsets; two threads on interleaved
// row ranges. All bit for bit.
inline void expect_split_batch_thread_invariance(
    int64_t rows, int B, int64_t ldy,
    const std::function<void(int64_t, int64_t, int, int, float*)>& mm, const std::string& what) {
  std::vector<float> full(static_cast<size_t>(B * ldy), kSentinel);
  mm(0, rows, 0, B, full.data());
  for (int64_t step : {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{17}}) {
    std::vector<float> y(full.size(), kSentinel);
    for (int64_t r = 0; r < rows; r += step) mm(r, std::min(rows, r + step), 0, B, y.data());
    ASSERT_EQ(0, std::memcmp(y.data(), full.data(), y.size() * sizeof(float)))
        << what << " step " << step;
  }
  for (int b0 = 0, nb = 1; b0 < B; b0 += nb, nb = nb % 5 + 1) {
    const int n = std::min(nb, B - b0);
    std::vector<float> y(static_cast<size_t>(n * ldy), kSentinel);
    mm(0, rows, b0, n, y.data());
    for (int j = 0; j < n; ++j)
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(std::bit_cast<uint32_t>(y[static_cast<size_t>(j * ldy + r)]),
                  std::bit_cast<uint32_t>(full[static_cast<size_t>((b0 + j) * ldy + r)]))
            << what << " b=" << b0 + j << " r=" << r;
  }
  std::vector<float> y(full.size(), kSentinel);
  auto work = [&](int part) {
    for (int64_t r = part * 5; r < rows; r += 10) mm(r, std::min(rows, r + 5), 0, B, y.data());
  };
  std::thread t(work, 1);
  work(0);
  t.join();
  ASSERT_EQ(0, std::memcmp(y.data(), full.data(), y.size() * sizeof(float))) << what;
}

}  // namespace md::cpu::test
