// Small AVX-512 pieces shared by the quantized-weight kernels (q4_avx512.cpp, q8_avx512.cpp,
// qdot_avx512bf16.cpp). Internal linkage on purpose, as in isa_scratch.h: each ISA file compiles
// its own copy with its own flags. Include only from files compiled with at least the avx512
// level's flags (AVX-512 F/BW/VL/DQ).
#pragma once

// GCC 12 reports its own AVX-512 intrinsics (which start from _mm512_undefined_*) as reading
// uninitialised values once they are inlined (GCC PR 105593, fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

namespace md::cpu::detail {
namespace {

// Sum of the 16 lanes in a fixed tree: lane i + lane i+8, then i + i+4, i + i+2, i + i+1.
inline float hsum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4e));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xb1));
  return _mm512_cvtss_f32(v);
}

// 16 bf16 values (the low 16 bits of each dword after widening) -> fp32.
inline __m512 bf16_vec(__m256i halves) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// 16 E8M0 bytes -> 16 fp32 scales, exactly kMxfp4ScaleTable: s << 23 is 2^(s - 127) for
// s = 1..254; s = 0 and 255 (the two values with ((s + 1) & 0xFE) == 0) get bit 22 set, which
// makes 0 the subnormal 2^-127 and 255 << 23 = +inf a quiet NaN.
inline __m512 e8m0_vec(__m128i bytes) {
  const __m512i s = _mm512_cvtepu8_epi32(bytes);
  const __m512i t = _mm512_slli_epi32(s, 23);
  const __mmask16 edge =
      _mm512_testn_epi32_mask(_mm512_add_epi32(s, _mm512_set1_epi32(1)), _mm512_set1_epi32(0xFE));
  return _mm512_castsi512_ps(_mm512_mask_or_epi32(t, edge, t, _mm512_set1_epi32(0x00400000)));
}

// The bf16 group scales of a block of n <= 16 consecutive 32-column sub-groups g.., one lane per
// sub-group, for int4 / int8 rows whose groups are `group` columns (a multiple of 32). map[j] is
// sub-group j's group (32 j / group); a block spans groups first..last, at most 16 of them, which
// are loaded once per row and spread to the sub-groups' lanes with one vpermps. `prepare` runs once
// per block for all the rows of a tile (it depends only on the columns), `row` once per row.
struct GroupScales {
  struct Block {
    int64_t first;
    __mmask16 mask;
    __m512i idx;
  };
  static Block prepare(const int32_t* map, int64_t g, int n) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
    const int32_t first = map[g];
    const int cnt = map[g + n - 1] - first + 1;
    const __m512i idx =
        _mm512_sub_epi32(_mm512_maskz_loadu_epi32(lanes, map + g), _mm512_set1_epi32(first));
    return {first, static_cast<__mmask16>((1u << cnt) - 1), _mm512_maskz_mov_epi32(lanes, idx)};
  }
  // srow: the row's bf16 scales as bytes.
  static __m512 row(const uint8_t* srow, const Block& b) {
    const __m512 v = bf16_vec(_mm256_maskz_loadu_epi16(b.mask, srow + 2 * b.first));
    return _mm512_permutexvar_ps(b.idx, v);
  }
};

// MXFP4's E8M0 scales, one per 32-column sub-group (same interface as GroupScales).
struct E8m0Scales {
  struct Block {
    int64_t g;
    __mmask16 mask;
  };
  static Block prepare(const int32_t*, int64_t g, int n) {
    return {g, static_cast<__mmask16>((1u << n) - 1)};
  }
  static __m512 row(const uint8_t* srow, const Block& b) {
    return e8m0_vec(_mm_maskz_loadu_epi8(b.mask, srow + b.g));
  }
};

// The same halved, for the integer kernels, whose e2m1 operand is 2v (qdot_avx512bf16.cpp).
struct HalfE8m0Scales : E8m0Scales {
  static __m512 row(const uint8_t* srow, const Block& b) {
    return _mm512_mul_ps(E8m0Scales::row(srow, b), _mm512_set1_ps(0.5f));
  }
};

}  // namespace
}  // namespace md::cpu::detail
