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

}  // namespace
}  // namespace md::cpu::detail
