// int4 (W4A16) matmul: the code table, the run-time dispatch into the 4-bit kernels shared with
// MXFP4 (q4_kernels.h), the reference decode and the load-time quantizer.
#include "megadecode/kernels/cpu/int4.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "q4_kernels.h"

namespace md::cpu {

namespace detail {
constinit const float kInt4Values[16] = {-8.0f, -7.0f, -6.0f, -5.0f, -4.0f, -3.0f, -2.0f, -1.0f,
                                         0.0f,  1.0f,  2.0f,  3.0f,  4.0f,  5.0f,  6.0f,  7.0f};
}  // namespace detail

namespace {

detail::Q4Matrix int4_matrix(const uint8_t* packed, const bf16* scales, int64_t K, int group) {
  detail::Q4Matrix m;
  m.packed = packed;
  m.scales = reinterpret_cast<const uint8_t*>(scales);
  m.K = K;
  m.group = group;
  m.codes = detail::Q4Codes::kInt4;
  return m;
}

}  // namespace

void matmul_int4(const uint8_t* packed, const bf16* scales, int64_t K, int group, int64_t r0,
                 int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || K <= 0) return;
  detail::matmul_q4(int4_matrix(packed, scales, K, group), r0, r1, X, B, ldx, Y, ldy);
}

void int4_zero_points_to_int8_codes(const uint8_t* packed, const int8_t* z, int64_t rows, int64_t K,
                                    int group, uint8_t* out) {
  const int64_t G = K / group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t byte = packed[r * (K / 2) + k / 2];
      const int c = k % 2 ? byte >> 4 : byte & 15;
      out[r * K + k] = static_cast<uint8_t>(c - 8 - z[r * G + k / group] + 128);
    }
}

void dequantize_int4_row(const uint8_t* packed, const bf16* scales, int64_t K, int group,
                         float* out, const int8_t* zero_points) {
  for (int64_t k = 0; k < K; ++k) {
    const uint8_t byte = packed[k / 2];
    const int code = k % 2 ? byte >> 4 : byte & 15;
    const int z = zero_points ? zero_points[k / group] : 0;
    out[k] = float(code - 8 - z) * bf16_to_f32(scales[k / group]);
  }
}

void quantize_int4_row(const bf16* w, int64_t K, int group, uint8_t* packed, bf16* scales,
                       int8_t* zero_points) {
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    // The group's range, widened to hold 0 (compressed-tensors' calculate_qparams: zero must be
    // representable).
    float lo = 0.0f, hi = 0.0f;
    for (int64_t k = g0; k < g0 + group; ++k) {
      lo = std::min(lo, bf16_to_f32(w[k]));
      hi = std::max(hi, bf16_to_f32(w[k]));
    }
    // Symmetric: max|w| over the half range 7.5; asymmetric: the whole range over 15 steps.
    float s = round_bf16(zero_points ? (hi - lo) / 15.0f : std::max(-lo, hi) / 7.5f);
    if (!(s >= FLT_EPSILON))
      s = round_bf16(FLT_EPSILON);  // all-zero group (or a NaN: rejected
                                    // by the caller before this)
    scales[g0 / group] = f32_to_bf16(s);
    // The zero point puts lo at the bottom code: z = round(-8 - lo / s), within [-8, 7] since
    // lo <= 0 <= hi (up to the scale's bf16 rounding, hence the clamp).
    float z = 0.0f;
    if (zero_points) {
      z = std::clamp(std::nearbyint(-8.0f - lo / s), -8.0f, 7.0f);
      zero_points[g0 / group] = static_cast<int8_t>(z);
    }
    for (int64_t k = g0; k < g0 + group; ++k) {
      // compressed-tensors' order: divide, add the zero point, clamp, round half to even.
      const float q = std::nearbyint(std::clamp(bf16_to_f32(w[k]) / s + z, -8.0f, 7.0f));
      const auto code = static_cast<uint8_t>(static_cast<int>(q) + 8);
      uint8_t& byte = packed[k / 2];
      byte = k % 2 ? static_cast<uint8_t>((byte & 0x0F) | (code << 4))
                   : static_cast<uint8_t>((byte & 0xF0) | code);
    }
  }
}

const char* matmul_int4_isa() {
  return detail::matmul_q4_isa();
}

}  // namespace md::cpu
