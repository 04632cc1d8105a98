// MXFP4 matmul: the decode table, the run-time dispatch (the ISA level of cpu_features.h, like
// every kernel family) and the portable path, which must stay within the x86-64 baseline (SSE2)
// because it is what runs when the CPU has neither. The vector kernels are in mxfp4_avx2.cpp and
// mxfp4_avx512.cpp.
#include "megadecode/kernels/cpu/mxfp4.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>

#include "megadecode/kernels/cpu/cpu_features.h"

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

namespace {

// e2m1 code -> value (bit 3 is the sign; -0 for code 8).
constexpr float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// ---- Portable path -------------------------------------------------------------------------
// Per row and vector, 8 fp32 lanes. For each group of 32: lane l forms
//   g_l = ((w[l] x[l] + w[8+l] x[8+l]) + w[16+l] x[16+l]) + w[24+l] x[24+l]
// (separate multiply and add; the baseline has no FMA), then acc_l = acc_l + g_l * scale. After the
// last group the lanes are reduced pairwise as in matmul_bf16's portable path. The decoded weights
// of a tile's group are shared by every vector of the batch chunk.

constexpr int kLanes = 8;
constexpr int kRows = 4;  // rows per tile
constexpr int kVecs = 4;  // vectors per batch chunk

inline void decode_group(const uint8_t* p, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[2 * j] = kE2m1[p[j] & 15];
    w[2 * j + 1] = kE2m1[p[j] >> 4];
  }
}

void portable_matmul(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0,
                     int64_t r1, const float* X, int B, int64_t ldx, float* Y, int64_t ldy) {
  const int64_t G = K / 32, row_bytes = K / 2;
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
          decode_group(packed + (r + i) * row_bytes + g * 16, w[i]);
          sc[i] = detail::kMxfp4ScaleTable[scales[(r + i) * G + g]];
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

}  // namespace

void matmul_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t K, int64_t r0, int64_t r1,
                  const float* X, int B, int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16) {
  if (r0 >= r1 || B <= 0 || K <= 0) return;
  // The AVX-512 kernel uses fp32 FMAs for both X modes (vdpbf16ps was measured slower, mxfp4.h),
  // so the avx512bf16 level runs it too and x_is_bf16 is not needed.
  (void)x_is_bf16;
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      detail::matmul_mxfp4_avx512(packed, scales, K, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kAvx2:
      detail::matmul_mxfp4_avx2(packed, scales, K, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kPortable:
      portable_matmul(packed, scales, K, r0, r1, X, B, ldx, Y, ldy);
      break;
  }
}

float mxfp4_value(uint8_t code, uint8_t scale) {
  // The product of an exact e2m1 value and an fp32 power of two (or NaN): one IEEE rounding, which
  // only matters on overflow (scale >= 253).
  return kE2m1[code & 15] * detail::kMxfp4ScaleTable[scale];
}

void dequantize_mxfp4_row(const uint8_t* packed, const uint8_t* scales, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    const uint8_t byte = packed[k / 2];
    out[k] = mxfp4_value(static_cast<uint8_t>(k % 2 ? byte >> 4 : byte & 15), scales[k / 32]);
  }
}

int64_t mxfp4_find_nan_scale(const uint8_t* scales, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (scales[i] == 255) return i;
  }
  return -1;
}

const char* matmul_mxfp4_isa() {
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

}  // namespace md::cpu
