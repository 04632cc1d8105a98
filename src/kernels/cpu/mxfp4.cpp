// MXFP4 matmul: the decode tables and the run-time dispatch (the ISA level of cpu_features.h, like
// every kernel family) into the 4-bit kernels that MXFP4 shares with int4 (q4_kernels.h:
// q4_portable.cpp, q4_avx2.cpp, q4_avx512.cpp).
#include "megadecode/kernels/cpu/mxfp4.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "megadecode/kernels/cpu/cpu_features.h"
#include "q4_kernels.h"

namespace md::cpu {
namespace detail {
namespace {

constexpr std::array<float, 256> make_scale_table() {
  std::array<float, 256> t{};
  // s = 0 is 2^-127, an fp32 subnormal (bit 22 set); 1..254 are normal powers of two; 255 is NaN.
  t[0] = std::bit_cast<float>(uint32_t{1} << 22);
  for (uint32_t s = 1; s < 255; ++s) t[s] = std::bit_cast<float>(s << 23);
  t[255] = std::numeric_limits<float>::quiet_NaN();
  return t;
}
constexpr std::array<float, 256> kScaleArray = make_scale_table();

}  // namespace

// A plain array so that the AVX-512 file can broadcast straight from it; constant-initialised.
alignas(64) constinit const float kMxfp4ScaleTable[256] = {
#define MD_S4(i) kScaleArray[i], kScaleArray[i + 1], kScaleArray[i + 2], kScaleArray[i + 3]
#define MD_S16(i) MD_S4(i), MD_S4(i + 4), MD_S4(i + 8), MD_S4(i + 12)
#define MD_S64(i) MD_S16(i), MD_S16(i + 16), MD_S16(i + 32), MD_S16(i + 48)
    MD_S64(0), MD_S64(64), MD_S64(128), MD_S64(192)
#undef MD_S64
#undef MD_S16
#undef MD_S4
};

}  // namespace detail

namespace detail {
// e2m1 code -> value (bit 3 is the sign; -0 for code 8).
constinit const float kE2m1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
}  // namespace detail

void matmul_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0, int64_t r1,
                  const float* X, int B, int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16) {
  if (r0 >= r1 || B <= 0 || K <= 0) return;
  // The AVX-512 kernel uses fp32 FMAs for both X modes (vdpbf16ps was measured slower, mxfp4.h),
  // so the avx512bf16 level runs it too and x_is_bf16 is not needed.
  (void)x_is_bf16;
  detail::Q4Matrix m;
  m.packed = packed;
  m.scales = scales;
  m.K = K;
  m.group = 32;
  m.codes = detail::Q4Codes::kE2m1;
  detail::matmul_q4(m, r0, r1, X, B, ldx, Y, ldy);
}

float mxfp4_value(uint8_t code, uint8_t scale) {
  // The product of an exact e2m1 value and an fp32 power of two (or NaN): one IEEE rounding, which
  // only matters on overflow (scale >= 253).
  return detail::kE2m1Values[code & 15] * detail::kMxfp4ScaleTable[scale];
}

void dequantize_mxfp4_row(const uint8_t* packed, const uint8_t* scales, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    const uint8_t byte = packed[k / 2];
    out[k] = mxfp4_value(static_cast<uint8_t>(k % 2 ? byte >> 4 : byte & 15), scales[k / 32]);
  }
}

namespace {

// The e2m1 code (sign in bit 3) of v, rounded to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 with
// ties to the even code: cast_to_fp4's intervals.
uint8_t e2m1_code(double v) {
  const double a = std::fabs(v);
  uint8_t mag;
  if (a <= 0.25) {
    mag = 0;
  } else if (a < 0.75) {
    mag = 1;
  } else if (a <= 1.25) {
    mag = 2;
  } else if (a < 1.75) {
    mag = 3;
  } else if (a <= 2.5) {
    mag = 4;
  } else if (a < 3.5) {
    mag = 5;
  } else if (a <= 5.0) {
    mag = 6;
  } else {
    mag = 7;
  }
  return mag != 0 && v < 0 ? static_cast<uint8_t>(mag | 8) : mag;
}

}  // namespace

void quantize_mxfp4_row(const uint16_t* w, int64_t K, uint8_t* packed, uint8_t* scales) {
  for (int64_t g0 = 0; g0 < K; g0 += 32) {
    uint16_t amax = 0;  // the largest magnitude's bf16 bits (non-negative: ordered as integers)
    for (int64_t k = g0; k < g0 + 32; ++k) amax = std::max<uint16_t>(amax, w[k] & 0x7fff);
    const int field = ((amax + (1 << 5)) & 0x7f80) >> 7;  // the rounded power's exponent field
    const int s = amax == 0 ? 0 : std::clamp(field - 2, 0, 254);
    scales[g0 / 32] = static_cast<uint8_t>(s);
    for (int64_t k = g0; k < g0 + 32; ++k) {
      const uint32_t bits = uint32_t{w[k]} << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      const uint8_t code = e2m1_code(std::ldexp(double(f), 127 - s));
      uint8_t& byte = packed[k / 2];
      byte = k % 2 ? static_cast<uint8_t>((byte & 0x0F) | (code << 4))
                   : static_cast<uint8_t>((byte & 0xF0) | code);
    }
  }
}

int64_t mxfp4_find_nan_scale(const uint8_t* scales, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (scales[i] == 255) return i;
  }
  return -1;
}

const char* matmul_mxfp4_isa() {
  return detail::matmul_q4_isa();
}

namespace detail {

void matmul_q4(const Q4Matrix& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
               float* Y, int64_t ldy) {
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      matmul_q4_avx512(m, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kAvx2:
      matmul_q4_avx2(m, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kPortable:
      matmul_q4_portable(m, r0, r1, X, B, ldx, Y, ldy);
      break;
  }
}

const char* matmul_q4_isa() {
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kPortable:
      break;
  }
  return "portable";
}

}  // namespace detail

}  // namespace md::cpu
