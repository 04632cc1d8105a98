// The CUDA tiles' weight-streaming GEMV (src/kernels/cuda/gemv.cuh) on the simulation, through
// both of its paths: direct (fp32 rows, and bf16 rows that are not whole 16-byte units: each lane
// loads kDirectUnroll weights ahead) and staged (bf16 through the bulk-copy stages, rows whole in
// a stage or segmented). Each output is checked against a float64 reference within the bound of
// fp32 accumulation, and bit for bit against the summation order gemv.cuh documents (the order
// every executor that runs the tile gets). Then the quantized formats (int4, int8, FP8, MXFP4) the
// same way, from the CPU kernels' own decoders (kernels/cpu).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "megadecode/base/bf16.h"
#include "megadecode/kernels/cpu/fp8.h"
#include "megadecode/kernels/cpu/int4.h"
#include "megadecode/kernels/cpu/int8.h"
#include "megadecode/kernels/cpu/mxfp4.h"
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

// Every FP8 e4m3 byte but the two NaNs decodes to the CPU's exact value (normals, subnormals,
// zeros of both signs).
TEST(CudaSimGemv, Fp8DecodeIsExact) {
  for (uint32_t b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    const float want = cpu::fp8_e4m3_value(uint8_t(b));
    EXPECT_EQ(std::bit_cast<uint32_t>(e4m3(b)), std::bit_cast<uint32_t>(want)) << "byte " << b;
  }
  for (uint32_t c = 0; c < 256; ++c) {
    EXPECT_EQ(code_minus(c, kInt8Bias), float(int(c) - 128));
    if (c < 16) {
      EXPECT_EQ(code_minus(c, kInt4Bias), float(int(c) - 8));
    }
  }
}

struct QCase {
  int64_t rows, cols;
  WDType dtype;
  int group;  // columns per scale (MXFP4: 32)
  int batch;
};

// Rows of random codes and scales in `c`'s format, decoded by the CPU's dequantizers (the
// reference of the format), the unscaled values, and the scale of each (row, column).
struct QMatrix {
  std::vector<uint8_t> codes, scales;  // as the device reads them
  std::vector<float> deq, unscaled, scale;  // [rows * cols]
};

QMatrix make_quant(const QCase& c, uint64_t& state) {
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return uint32_t(state >> 33);
  };
  const int64_t E = c.dtype == WDType::kInt8 || c.dtype == WDType::kFp8 ? 1 : 2;  // codes a byte
  const int64_t rb = c.cols / E, groups = c.cols / c.group;
  const size_t n = size_t(c.rows * c.cols);
  QMatrix m;
  m.codes.resize(size_t(c.rows * rb) + 16);
  for (int64_t i = 0; i < c.rows * rb; ++i) {
    uint8_t b = uint8_t(next());
    if (c.dtype == WDType::kFp8 && (b & 0x7f) == 0x7f) b ^= 1;  // not NaN
    m.codes[size_t(i)] = b;
  }
  const size_t sbytes = c.dtype == WDType::kFp8 ? 4 : c.dtype == WDType::kMXFP4 ? 1 : 2;
  m.scales.resize(size_t(c.rows * groups) * sbytes);
  for (int64_t i = 0; i < c.rows * groups; ++i) {
    const float v = 0.01f + float(next() % 1000) * 1e-4f;
    if (c.dtype == WDType::kFp8)
      std::memcpy(&m.scales[size_t(i) * 4], &v, 4);
    else if (c.dtype == WDType::kMXFP4)
      m.scales[size_t(i)] = uint8_t(118 + next() % 12);
    else
      reinterpret_cast<uint16_t*>(m.scales.data())[i] = f32_to_bf16(v);
  }
  m.deq.resize(n);
  m.unscaled.resize(n);
  m.scale.resize(n);
  for (int64_t r = 0; r < c.rows; ++r) {
    const uint8_t* cr = m.codes.data() + r * rb;
    float* out = m.deq.data() + r * c.cols;
    const uint8_t* sr = m.scales.data() + size_t(r * groups) * sbytes;
    switch (c.dtype) {
      case WDType::kInt4:
        cpu::dequantize_int4_row(cr, reinterpret_cast<const bf16*>(sr), c.cols, c.group, out);
        break;
      case WDType::kInt8:
        cpu::dequantize_int8_row(cr, reinterpret_cast<const bf16*>(sr), c.cols, c.group, out);
        break;
      case WDType::kFp8:
        cpu::dequantize_fp8_row(cr, reinterpret_cast<const float*>(sr), c.cols, c.group, out);
        break;
      default:
        cpu::dequantize_mxfp4_row(cr, sr, c.cols, out);
    }
    for (int64_t k = 0; k < c.cols; ++k) {
      const int64_t g = k / c.group;
      float sc;
      if (c.dtype == WDType::kFp8)
        std::memcpy(&sc, sr + g * 4, 4);
      else if (c.dtype == WDType::kMXFP4)
        sc = std::ldexp(1.0f, int(sr[g]) - 127);
      else
        sc = bf16_to_f32(reinterpret_cast<const uint16_t*>(sr)[g]);
      m.scale[size_t(r * c.cols + k)] = sc;
      // The unscaled value: FP8's own, the others' dequantized value over the scale (exact: a
      // power of two for MXFP4; q * a bf16 scale has at most 16 significant bits).
      m.unscaled[size_t(r * c.cols + k)] =
          c.dtype == WDType::kFp8 ? cpu::fp8_e4m3_value(cr[k]) : out[k] / sc;
    }
  }
  return m;
}

// gemv.cuh's order for a quantized row: per lane its 16-byte units ascending (E columns each),
// a unit's unscaled products added left to right, times the unit's scale, added to the lane's
// sum; the butterfly; segments in order.
float quant_in_gemv_order(const QCase& c, const QMatrix& m, const float* x, int64_t r) {
  const int64_t E = c.dtype == WDType::kInt8 || c.dtype == WDType::kFp8 ? 16 : 32;
  const int64_t row_bytes = c.cols / E * 16;
  const int64_t seg_cols = row_bytes > int64_t(kStageBytes) ? int64_t(kStageBytes) / 16 * E : c.cols;
  float total = 0.0f;
  for (int64_t c0 = 0; c0 < c.cols; c0 += seg_cols) {
    const int64_t nc = std::min(seg_cols, c.cols - c0);
    std::vector<float> lanes(32, 0.0f);
    for (int64_t g = 0; g < nc / E; ++g) {
      float us = 0.0f;
      for (int64_t i = 0; i < E; ++i) {
        const int64_t col = c0 + g * E + i;
        us += m.unscaled[size_t(r * c.cols + col)] * x[col];
      }
      lanes[size_t(g % 32)] = lanes[size_t(g % 32)] + us * m.scale[size_t(r * c.cols + c0 + g * E)];
    }
    const float s = butterfly(lanes);
    total = c0 == 0 ? s : total + s;
  }
  return total;
}

TEST(CudaSimGemv, QuantizedUnitsMatchFloat64AndTheirSummationOrder) {
  const QCase cases[] = {
      {5, 2304, WDType::kInt4, 32, 5},     // kl48's width, groups of 32, two token blocks
      {7, 512, WDType::kInt4, 128, 1},     // several rows a stage
      {3, 2304, WDType::kInt4, 2304, 2},   // one scale a row, not a power of two (a division)
      {6, 2304, WDType::kInt8, 32, 3},
      {4, 1152, WDType::kInt8, 96, 4},     // a group of 3 x 32 columns
      {3, 40960, WDType::kInt8, 128, 2},   // rows wider than a stage: segmented
      {5, 1024, WDType::kFp8, 128, 6},     // subnormals and both signs among the values
      {4, 2304, WDType::kFp8, 2304, 1},    // per-channel scales
      {6, 2304, WDType::kMXFP4, 32, 3},
  };
  uint64_t state = 0x2545f4914f6cdd1dull;
  auto uniform = [&] {  // in [-1, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return float(int64_t(state >> 40) - (int64_t(1) << 23)) / float(1 << 23);
  };
  const char* names[] = {"bf16", "fp32", "mxfp4", "int4", "int8", "fp8"};
  const sim::Config saved = sim::config();
  sim::config().sm_count = 1;
  for (const QCase& c : cases) {
    const std::string what = std::to_string(c.rows) + " x " + std::to_string(c.cols) + " " +
                             names[int(c.dtype)] + " group " + std::to_string(c.group) +
                             ", batch " + std::to_string(c.batch);
    const QMatrix m = make_quant(c, state);
    std::vector<float> x(size_t(c.batch * c.cols));
    for (float& v : x) v = uniform();
    DevWeight dw;
    dw.data = m.codes.data();
    dw.scales = m.scales.data();
    dw.rows = c.rows;
    dw.cols = c.cols;
    dw.dtype = c.dtype;
    dw.group = c.group;
    dw.row_groups = int32_t(c.cols / c.group);
    dw.group_shift = int8_t((c.group & (c.group - 1)) == 0 ? std::countr_zero(uint32_t(c.group)) : -1);
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
          const double p = double(m.deq[size_t(r * c.cols + col)]) * double(xt[col]);
          ref += p;
          mag += std::fabs(p);
        }
        const float got = y[size_t(t * c.rows + r)];
        // Each product passes through at most (unit columns + 1 scale + the lane's units + the
        // butterfly's 5 + segments) roundings, fewer than cols + 8.
        const double bound = double(c.cols + 8) * std::ldexp(1.0, -24) * mag;
        ASSERT_FALSE(std::isnan(got)) << what << ": row " << r << " token " << t << " not written";
        EXPECT_LE(std::fabs(double(got) - ref), bound) << what << ": row " << r << " token " << t;
        EXPECT_EQ(got, quant_in_gemv_order(c, m, xt, r)) << what << ": row " << r << " token " << t;
      }
  }
  sim::config() = saved;
}

}  // namespace
}  // namespace md::cuda
