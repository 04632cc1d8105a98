// Run-time dispatch between the ISA kernels (matmul_avx2.cpp, matmul_avx512.cpp,
// matmul_avx512bf16.cpp) and the portable path below, which must stay within the x86-64 baseline
// (SSE2) because it is what runs when the CPU has none of them. The level comes from
// cpu_features.h, as for every kernel family.
#include "megadecode/kernels/cpu/matmul.h"

#include <algorithm>

#include "megadecode/kernels/cpu/cpu_features.h"

namespace md::cpu {
namespace {

// ---- Portable path -------------------------------------------------------------------------
// Eight fp32 lanes per output: lane l accumulates elements k with k % 8 == l, in increasing k,
// as separate multiply and add (the baseline has no FMA), then a fixed pairwise reduction. GCC
// vectorises the lane loops into SSE2; the row tile shares each X load across kRows rows.

constexpr int kLanes = 8;
constexpr int kRows = 4;

inline float widen(bf16 v) {
  return bf16_to_f32(v);
}
inline float widen(float v) {
  return v;
}

template <class WT, int NR>
void portable_tile(const WT* w, int64_t K, const float* x, float* y) {
  float acc[NR][kLanes] = {};
  const int64_t kfull = K / kLanes * kLanes;
  for (int64_t k = 0; k < kfull; k += kLanes) {
    for (int i = 0; i < NR; ++i) {
      const WT* wi = w + i * K + k;
      for (int l = 0; l < kLanes; ++l) acc[i][l] += widen(wi[l]) * x[k + l];
    }
  }
  for (int64_t k = kfull; k < K; ++k) {
    for (int i = 0; i < NR; ++i) acc[i][k - kfull] += widen(w[i * K + k]) * x[k];
  }
  for (int i = 0; i < NR; ++i) {
    const float* a = acc[i];
    y[i] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
  }
}

template <class WT>
void portable_matmul(const WT* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                     int64_t ldx, float* Y, int64_t ldy) {
  if (K <= 0) return;
  // Rows outer, vectors inner: a tile's rows (kRows * K weights) stay in L1/L2 while every vector
  // passes over them, so weights are read from memory once per call.
  float y[kRows];
  for (int64_t r = r0; r < r1; r += kRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
    for (int b = 0; b < B; ++b) {
      const WT* w = W + r * K;
      const float* x = X + b * ldx;
      switch (nr) {
        case 4:
          portable_tile<WT, 4>(w, K, x, y);
          break;
        case 3:
          portable_tile<WT, 3>(w, K, x, y);
          break;
        case 2:
          portable_tile<WT, 2>(w, K, x, y);
          break;
        default:
          portable_tile<WT, 1>(w, K, x, y);
          break;
      }
      for (int i = 0; i < nr; ++i) Y[b * ldy + r + i] = y[i];
    }
  }
}

}  // namespace

void matmul_bf16(const bf16* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                 int64_t ldx, float* Y, int64_t ldy, bool x_is_bf16) {
  if (r0 >= r1 || B <= 0) return;
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
      if (x_is_bf16) {
        detail::matmul_bf16_avx512bf16(W, K, r0, r1, X, B, ldx, Y, ldy);
      } else {
        detail::matmul_bf16_avx512(W, K, r0, r1, X, B, ldx, Y, ldy);
      }
      break;
    case Isa::kAvx512:
      detail::matmul_bf16_avx512(W, K, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kAvx2:
      detail::matmul_bf16_avx2(W, K, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kPortable:
      // X values are used exactly in fp32 either way, so x_is_bf16 changes nothing here.
      portable_matmul(W, K, r0, r1, X, B, ldx, Y, ldy);
      break;
  }
}

void matmul_f32(const float* W, int64_t K, int64_t r0, int64_t r1, const float* X, int B,
                int64_t ldx, float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0) return;
  switch (active_isa()) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      detail::matmul_f32_avx512(W, K, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kAvx2:
      detail::matmul_f32_avx2(W, K, r0, r1, X, B, ldx, Y, ldy);
      break;
    case Isa::kPortable:
      portable_matmul(W, K, r0, r1, X, B, ldx, Y, ldy);
      break;
  }
}

const char* matmul_isa() {
  return isa_name(active_isa());
}

}  // namespace md::cpu
