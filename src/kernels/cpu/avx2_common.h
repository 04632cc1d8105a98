// Small AVX2 pieces shared by the AVX2 kernels (matmul_avx2.cpp, q4_avx2.cpp, q8_avx2.cpp,
// qdot_avx2.cpp). Internal linkage on purpose, as in avx512_common.h: each ISA file compiles its
// own copy with its own flags. Include only from files compiled with at least the avx2 level's
// flags (AVX2, FMA, F16C).
#pragma once
#include <immintrin.h>

namespace md::cpu::detail {
namespace {

// Sum of the 8 lanes in a fixed tree: lane i + lane i+4, then i + i+2, then i + i+1.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

}  // namespace
}  // namespace md::cpu::detail
