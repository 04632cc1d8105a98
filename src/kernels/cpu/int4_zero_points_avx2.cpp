// Asymmetric int4's zero-point terms at the avx2 level (int4.h, int4_zero_point_terms): the
// portable path's 16 lanes as two 8-lane registers (lanes 0-7, 8-15), the same halving tree; each
// lane's multiply-add fused. A partial last block of groups goes through zero-padded copies
// (AVX2 has no masked 8- and 16-bit loads).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "q4_kernels.h"

namespace md::cpu::detail {

namespace {

// l[i] += l[i + 8] (the two registers), then + 4, + 2, + 1.
inline float tree16(__m256 lo, __m256 hi) {
  const __m256 h = _mm256_add_ps(lo, hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// 8 bf16 (as bytes) -> fp32.
inline __m256 bf16x8(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 int8x8(const int8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v)));
}

}  // namespace

void int4_group_sums_avx2(const float* X, int B, int64_t ldx, int64_t K, int group, float* xs) {
  const int64_t G = K / group;
  for (int b = 0; b < B; ++b)
    for (int64_t g = 0; g < G; ++g) {
      const float* x = X + b * ldx + g * group;
      __m256 lo = _mm256_loadu_ps(x), hi = _mm256_loadu_ps(x + 8);  // (groups: multiples of 32)
      for (int k = 16; k < group; k += 16) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(x + k));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(x + k + 8));
      }
      xs[b * G + g] = tree16(lo, hi);
    }
}

void int4_zero_point_terms_avx2(const uint8_t* scales, const int8_t* z, int64_t G, int64_t r0,
                                int64_t r1, const float* xs, int B, float* Y, int64_t ldy) {
  const int64_t full = G / 16 * 16, rest = G - full;
  alignas(32) uint8_t sp[32] = {};
  alignas(32) int8_t zpad[16] = {};
  alignas(32) float xp[16] = {};
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* sr = scales + r * G * 2;
    const int8_t* zr = z + r * G;
    if (rest) {
      std::memcpy(sp, sr + 2 * full, size_t(rest) * 2);
      std::memcpy(zpad, zr + full, size_t(rest));
    }
    for (int b = 0; b < B; ++b) {
      const float* x = xs + b * G;
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int64_t g = 0; g < full; g += 16) {
        lo = _mm256_fmadd_ps(_mm256_mul_ps(bf16x8(sr + 2 * g), int8x8(zr + g)),
                             _mm256_loadu_ps(x + g), lo);
        hi = _mm256_fmadd_ps(_mm256_mul_ps(bf16x8(sr + 2 * g + 16), int8x8(zr + g + 8)),
                             _mm256_loadu_ps(x + g + 8), hi);
      }
      if (rest) {
        std::copy(x + full, x + G, xp);
        lo = _mm256_fmadd_ps(_mm256_mul_ps(bf16x8(sp), int8x8(zpad)), _mm256_load_ps(xp), lo);
        hi = _mm256_fmadd_ps(_mm256_mul_ps(bf16x8(sp + 16), int8x8(zpad + 8)),
                             _mm256_load_ps(xp + 8), hi);
      }
      Y[b * ldy + r] -= tree16(lo, hi);
    }
  }
}

}  // namespace md::cpu::detail
