// The CUDA tiles' weight-streaming GEMV (src/kernels/cuda/gemv.cuh) on the simulation, through
// both of its paths: direct (fp32 rows, and bf16 rows that are not whole 16-byte units: each lane
// loads kDirectUnroll weights ahead) and staged (bf16 through the bulk-copy stages, rows whole in
// a stage or segmented). Each output is checked against a float64 reference within the bound of
// fp32 accumulation, and bit for bit against the summation order gemv.cuh documents (the order
// every executor that runs the tile gets).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/kernels/cuda/sim.h"
#define MD_CUDA_SIM 1
#include "../../src/kernels/cuda/gemv.cuh"

namespace md::cuda {
namespace {

struct Case {
  int64_t rows, cols;
  WDType dtype;
  int batch;
};

// The warp butterfly's sum as lane 0 sees it (port::warp_sum: at offsets 16, 8, .., 1 each lane
// adds lane ^ offset's value to its own).
float butterfly(std::vector<float> v) {
  for (uint32_t m = 16; m >= 1; m /= 2) {
    std::vector<float> n(32);
    for (uint32_t i = 0; i < 32; ++i) n[i] = v[i] + v[i ^ m];
    v = n;
  }
  return v[0];
}

// Row r of token row t in gemv.cuh's order. Direct: lane l sums columns l, l + 32, .. in
// ascending order. Staged: lane l sums its 16-byte units (8 columns, added left to right) in
// ascending order within a stage's segment of the row; segments' warp sums add up in order.
float in_gemv_order(const Case& c, const std::vector<float>& w, const float* x, int64_t r) {
  const bool staged = c.dtype == WDType::kBF16 && c.cols % 8 == 0;
  if (!staged) {
    std::vector<float> lanes(32, 0.0f);
    for (int64_t col = 0; col < c.cols; ++col) {
      const float p = w[size_t(r * c.cols + col)] * x[col];
      lanes[size_t(col % 32)] += p;
    }
    return butterfly(lanes);
  }
  const int64_t row_bytes = c.cols * 2;
  const int64_t seg_cols = row_bytes > int64_t(kStageBytes) ? int64_t(kStageBytes) / 2 : c.cols;
  float total = 0.0f;
  for (int64_t c0 = 0; c0 < c.cols; c0 += seg_cols) {
    const int64_t nc = std::min(seg_cols, c.cols - c0);
    std::vector<float> lanes(32, 0.0f);
    for (int64_t g = 0; g < nc / 8; ++g)
      for (int i = 0; i < 8; ++i) {
        const int64_t col = c0 + g * 8 + i;
        lanes[size_t(g % 32)] += w[size_t(r * c.cols + col)] * x[col];
      }
    const float s = butterfly(lanes);
    total = c0 == 0 ? s : total + s;
  }
  return total;
}

TEST(CudaSimGemv, BothPathsMatchFloat64AndTheirSummationOrder) {
  const Case cases[] = {
      {37, 300, WDType::kF32, 1},   // direct, 256 columns unrolled + a remainder
      {9, 2304, WDType::kF32, 5},   // the kl48 router's width; two token blocks
      {5, 256, WDType::kF32, 4},    // exactly one unrolled step a lane
      {3, 40, WDType::kF32, 2},     // the remainder loop only
      {6, 300, WDType::kBF16, 3},   // bf16 rows of a partial 16-byte unit: direct
      {13, 2304, WDType::kBF16, 1}, // staged, 3 rows a stage
      {7, 512, WDType::kBF16, 6},   // staged, two token blocks
      {3, 9000, WDType::kBF16, 2},  // staged
      // staged, rows wider than a stage: segmented over two stages
      {3, int64_t(kStageBytes) / 2 + 1064, WDType::kBF16, 2},
  };
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto uniform = [&] {  // in [-1, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return float(int64_t(state >> 40) - (int64_t(1) << 23)) / float(1 << 23);
  };
  const sim::Config saved = sim::config();
  sim::config().sm_count = 1;
  for (const Case& c : cases) {
    const std::string what = std::to_string(c.rows) + " x " + std::to_string(c.cols) +
                             (c.dtype == WDType::kF32 ? " fp32" : " bf16") + ", batch " +
                             std::to_string(c.batch);
    const size_t n = size_t(c.rows * c.cols);
    std::vector<float> wf(n);  // the weights as the kernel sees them
    std::vector<float> f32(c.dtype == WDType::kF32 ? n : 0);
    std::vector<uint16_t> b16(c.dtype == WDType::kBF16 ? n + 8 : 0);
    for (size_t i = 0; i < n; ++i) {
      const float v = uniform();
      if (c.dtype == WDType::kF32) {
        f32[i] = wf[i] = v;
      } else {
        b16[i] = f32_to_bf16(v);
        wf[i] = bf16_to_f32(b16[i]);
      }
    }
    std::vector<float> x(size_t(c.batch * c.cols));
    for (float& v : x) v = uniform();
    DevWeight dw;
    dw.data = c.dtype == WDType::kF32 ? static_cast<const void*>(f32.data()) : b16.data();
    dw.rows = c.rows;
    dw.cols = c.cols;
    dw.dtype = c.dtype;
    ASSERT_EQ(reinterpret_cast<uintptr_t>(dw.data) % 16, 0u) << what;
    std::vector<float> y(size_t(c.batch * c.rows), std::numeric_limits<float>::quiet_NaN());
    sim::launch(1, kTileThreads, kSmemBytes, false, [&] {
      init_pipe();
      Pipe pipe;
      gemv_block(
          dw, 0, c.rows, c.batch, [&](int t) { return x.data() + int64_t(t) * c.cols; },
          [&](int t, int64_t r, float v) { y[size_t(t * c.rows + r)] = v; }, pipe);
    });
    for (int t = 0; t < c.batch; ++t)
      for (int64_t r = 0; r < c.rows; ++r) {
        const float* xt = x.data() + int64_t(t) * c.cols;
        double ref = 0, mag = 0;
        for (int64_t col = 0; col < c.cols; ++col) {
          const double p = double(wf[size_t(r * c.cols + col)]) * double(xt[col]);
          ref += p;
          mag += std::fabs(p);
        }
        const float got = y[size_t(t * c.rows + r)];
        // fp32 products and sums: at most (cols + 6) roundings of unit 2^-24 on the magnitudes.
        const double bound = double(c.cols + 6) * std::ldexp(1.0, -24) * mag;
        ASSERT_FALSE(std::isnan(got)) << what << ": row " << r << " token " << t << " not written";
        EXPECT_LE(std::fabs(double(got) - ref), bound) << what << ": row " << r << " token " << t;
        EXPECT_EQ(got, in_gemv_order(c, wf, xt, r)) << what << ": row " << r << " token " << t;
      }
  }
  sim::config() = saved;
}

}  // namespace
}  // namespace md::cuda
