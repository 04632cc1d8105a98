// The portable kernel of the 4-bit formats (q4_kernels.h: MXFP4 and int4), which must stay within
// the x86-64 baseline (SSE2) because it is what runs when the CPU has neither AVX2 nor AVX-512.
//
// Per row and vector, 8 fp32 lanes. For each 32-column sub-group: lane l forms
//   g_l = ((w[l] x[l] + w[8+l] x[8+l]) + w[16+l] x[16+l]) + w[24+l] x[24+l]
// (unscaled code values; separate multiply and add, the baseline has no FMA), then
// acc_l = acc_l + g_l * scale of the sub-group. After the last sub-group the lanes are reduced
// pairwise as in matmul_bf16's portable path. The decoded weights of a tile's sub-group are
// shared by every vector of the batch chunk.
#include <algorithm>
#include <cstring>

#include "megadecode/base/bf16.h"
#include "q4_kernels.h"

namespace md::cpu::detail {
namespace {

constexpr int kLanes = 8;
constexpr int kRows = 4;  // rows per tile
constexpr int kVecs = 4;  // vectors per batch chunk

inline void decode_subgroup(const uint8_t* p, const float* table, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[2 * j] = table[p[j] & 15];
    w[2 * j + 1] = table[p[j] >> 4];
  }
}

}  // namespace

float q4_subgroup_scale(const Q4Matrix& w, const uint8_t* row_scales, int64_t j) {
  if (w.codes == Q4Codes::kE2m1) return kMxfp4ScaleTable[row_scales[j]];
  bf16 s;
  std::memcpy(&s, row_scales + 2 * (32 * j / w.group), sizeof s);
  return bf16_to_f32(s);
}

void matmul_q4_portable(const Q4Matrix& m, int64_t r0, int64_t r1, const float* X, int B,
                        int64_t ldx, float* Y, int64_t ldy) {
  const int64_t K = m.K, G = K / 32, row_bytes = K / 2, sb = m.scale_row_bytes();
  const float* table = m.codes == Q4Codes::kE2m1 ? kE2m1Values : kInt4Values;
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
          decode_subgroup(m.packed + (r + i) * row_bytes + g * 16, table, w[i]);
          sc[i] = q4_subgroup_scale(m, m.scales + (r + i) * sb, g);
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

}  // namespace md::cpu::detail
