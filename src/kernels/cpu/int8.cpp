// int8 (W8A16) matmul: the run-time dispatch of the 8-bit kernels (q8_kernels.h: int8 and FP8), the
// portable kernel, the int8 reference decode and the load-time quantizer.
#include "megadecode/kernels/cpu/int8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "megadecode/kernels/cpu/cpu_features.h"
#include "q4_kernels.h"
#include "q8_kernels.h"

namespace md::cpu {

namespace detail {

// The portable kernel, within the x86-64 baseline (SSE2: no FMA). Per row and vector, 8 fp32
// lanes; for each 32-column sub-group lane l forms (q the integer or the e4m3 value)
//   g_l = ((q[l] x[l] + q[8+l] x[8+l]) + q[16+l] x[16+l]) + q[24+l] x[24+l]
// then acc_l = acc_l + g_l * scale of the sub-group's group; after the last sub-group the lanes
// are reduced pairwise as in the 4-bit portable kernel. A tile's decoded sub-group is shared by
// every vector of its batch chunk.
void matmul_q8_portable(const Q8Matrix& m, int64_t r0, int64_t r1, const float* X, int B,
                        int64_t ldx, float* Y, int64_t ldy) {
  constexpr int kLanes = 8, kRows = 4, kVecs = 4;
  const int64_t K = m.K, G = K / 32, spr = m.scales_per_row();
  const int per = m.group / 32;  // sub-groups per group
  float w[kRows][32];
  float acc[kRows][kVecs][kLanes];
  for (int64_t r = r0; r < r1; r += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
    for (int b0 = 0; b0 < B; b0 += kVecs) {
      const int nb = std::min(kVecs, B - b0);
      std::memset(acc, 0, sizeof(acc));
      for (int64_t g = 0; g < G; ++g) {
        float sc[kRows];
        for (int i = 0; i < nr; ++i) {
          const uint8_t* c = m.codes + (r + i) * K + g * 32;
          const int64_t si = (r + i) * spr + g / per;
          if (m.kind == Q8Codes::kFp8) {
            for (int k = 0; k < 32; ++k) w[i][k] = kE4m3Values[c[k]];
            sc[i] = static_cast<const float*>(m.scales)[si];
          } else {
            for (int k = 0; k < 32; ++k) w[i][k] = static_cast<float>(int(c[k]) - 128);
            sc[i] = bf16_to_f32(static_cast<const bf16*>(m.scales)[si]);
          }
        }
        for (int v = 0; v < nb; ++v) {
          const float* x = X + (b0 + v) * ldx + g * 32;
          for (int i = 0; i < nr; ++i) {
            float gl[kLanes];
            for (int l = 0; l < kLanes; ++l) gl[l] = w[i][l] * x[l];
            for (int q = 1; q < 4; ++q) {
              for (int l = 0; l < kLanes; ++l) gl[l] += w[i][q * 8 + l] * x[q * 8 + l];
            }
            for (int l = 0; l < kLanes; ++l) acc[i][v][l] += gl[l] * sc[i];
          }
        }
      }
      for (int v = 0; v < nb; ++v) {
        for (int i = 0; i < nr; ++i) {
          const float* a = acc[i][v];
          Y[(b0 + v) * ldy + r + i] =
              ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        }
      }
    }
  }
}

void matmul_q8(const Q8Matrix& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
               float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || m.K <= 0) return;
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      matmul_q8_avx512(m, r0, r1, X, B, ldx, Y, ldy);
      return;
    case Isa::kAvx2:
      matmul_q8_avx2(m, r0, r1, X, B, ldx, Y, ldy);
      return;
    case Isa::kPortable:
      break;
  }
  matmul_q8_portable(m, r0, r1, X, B, ldx, Y, ldy);
}

}  // namespace detail

void matmul_int8(const uint8_t* codes, const bf16* scales, int64_t K, int group, int64_t r0,
                 int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy) {
  detail::Q8Matrix m;
  m.codes = codes;
  m.scales = scales;
  m.K = K;
  m.group = group;
  m.kind = detail::Q8Codes::kInt8;
  detail::matmul_q8(m, r0, r1, X, B, ldx, Y, ldy);
}

void dequantize_int8_row(const uint8_t* codes, const bf16* scales, int64_t K, int group,
                         float* out) {
  for (int64_t k = 0; k < K; ++k)
    out[k] = static_cast<float>(int(codes[k]) - 128) * bf16_to_f32(scales[k / group]);
}

void quantize_int8_row(const bf16* w, int64_t K, int group, uint8_t* codes, bf16* scales) {
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    float amax = 0.0f;
    for (int64_t k = g0; k < g0 + group; ++k) amax = std::max(amax, std::fabs(bf16_to_f32(w[k])));
    float s = round_bf16(amax / 127.5f);
    if (!(s >= FLT_EPSILON)) s = round_bf16(FLT_EPSILON);  // an all-zero group
    scales[g0 / group] = f32_to_bf16(s);
    for (int64_t k = g0; k < g0 + group; ++k) {
      const float q = std::clamp(std::nearbyint(bf16_to_f32(w[k]) / s), -128.0f, 127.0f);
      codes[k] = static_cast<uint8_t>(static_cast<int>(q) + 128);
    }
  }
}

const char* matmul_int8_isa() {
  return detail::matmul_q4_isa();  // (the same levels map to the same kernel names)
}

}  // namespace md::cpu
