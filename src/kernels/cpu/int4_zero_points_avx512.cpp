// Asymmetric int4's zero-point terms at the avx512 levels (int4.h, int4_zero_point_terms): 16
// lanes, then the halving tree of the portable path; each lane's multiply-add fused.
#include "avx512_common.h"
#include "q4_kernels.h"

namespace md::cpu::detail {

namespace {

inline __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

}  // namespace

void int4_group_sums_avx512(const float* X, int B, int64_t ldx, int64_t K, int group, float* xs) {
  const int64_t G = K / group;
  for (int b = 0; b < B; ++b)
    for (int64_t g = 0; g < G; ++g) {
      const float* x = X + b * ldx + g * group;
      __m512 l = _mm512_loadu_ps(x);  // (a group is a multiple of 32 columns)
      for (int k = 16; k < group; k += 16) l = _mm512_add_ps(l, _mm512_loadu_ps(x + k));
      xs[b * G + g] = hsum(l);
    }
}

void int4_zero_point_terms_avx512(const uint8_t* scales, const int8_t* z, int64_t G, int64_t r0,
                                  int64_t r1, const float* xs, int B, float* Y, int64_t ldy) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* sr = scales + r * G * 2;
    const int8_t* zr = z + r * G;
    for (int b = 0; b < B; ++b) {
      __m512 l = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 m = first(G - g);
        const __m512 s = bf16_vec(_mm256_maskz_loadu_epi16(m, sr + 2 * g));
        const __m512 zf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, zr + g)));
        l = _mm512_fmadd_ps(_mm512_mul_ps(s, zf), _mm512_maskz_loadu_ps(m, xs + b * G + g), l);
      }
      Y[b * ldy + r] -= hsum(l);
    }
  }
}

}  // namespace md::cpu::detail
