// FP8 e4m3 matmul (fp8.h): the e4m3 value table and the entry into the 8-bit kernels shared with
// int8 (q8_kernels.h).
#include "megadecode/kernels/cpu/fp8.h"

#include <array>
#include <cmath>
#include <limits>

#include "q4_kernels.h"
#include "q8_kernels.h"

namespace md::cpu {
namespace detail {
namespace {

// e4m3fn: exponent field e (bias 7), mantissa m: e > 0 is 2^(e-7) (1 + m/8), e = 0 is 2^-6 m/8;
// 0x7f / 0xff (e = 15, m = 7) are NaN, there are no infinities.
std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    if ((b & 0x7f) == 0x7f) v = std::numeric_limits<double>::quiet_NaN();
    t[size_t(b)] = static_cast<float>(b & 0x80 ? -v : v);
  }
  return t;
}
const std::array<float, 256> kTable = make_e4m3_table();

}  // namespace

const float kE4m3Values[256] = {
#define MD_E4(i) kTable[i], kTable[i + 1], kTable[i + 2], kTable[i + 3]
#define MD_E16(i) MD_E4(i), MD_E4(i + 4), MD_E4(i + 8), MD_E4(i + 12)
#define MD_E64(i) MD_E16(i), MD_E16(i + 16), MD_E16(i + 32), MD_E16(i + 48)
    MD_E64(0), MD_E64(64), MD_E64(128), MD_E64(192)
#undef MD_E64
#undef MD_E16
#undef MD_E4
};

}  // namespace detail

void matmul_fp8(const uint8_t* values, const float* scales, int64_t K, int group, int64_t r0,
                int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy) {
  detail::Q8Matrix m;
  m.codes = values;
  m.scales = scales;
  m.K = K;
  m.group = group;
  m.kind = detail::Q8Codes::kFp8;
  detail::matmul_q8(m, r0, r1, X, B, ldx, Y, ldy);
}

float fp8_e4m3_value(uint8_t b) {
  return detail::kE4m3Values[b];
}

void dequantize_fp8_row(const uint8_t* values, const float* scales, int64_t K, int group,
                        float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = detail::kE4m3Values[values[k]] * scales[k / group];
}

int64_t fp8_find_nan(const uint8_t* values, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if ((values[i] & 0x7f) == 0x7f) return i;
  return -1;
}

const char* matmul_fp8_isa() {
  return detail::matmul_q4_isa();  // (the same levels map to the same kernel names)
}

}  // namespace md::cpu
