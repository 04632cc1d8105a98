// AVX2 + FMA kernel of int8 weights (int8.h; compiled with -mavx2 -mfma only; entered at the avx2
// level).
//
// A 32-column sub-group of a row is one 32-byte load; xor 0x80 turns the codes c into the signed
// bytes q = c - 128, and step s (s = 0..3) sign-extends bytes 8s..8s+7 into 8 int32 lanes and
// converts them (exact): lane l = q of column 8s + l, the activations' natural order, so they are
// read in place. Each output Y[b, r] has one ymm accumulator:
//   g   = fma(q[24+l], x[24+l], fma(q[16+l], x[16+l], fma(q[8+l], x[8+l], q[l] * x[l])))
//   acc = fma(g, scale of the sub-group's group, acc)
// then a fixed pairwise reduction of its 8 lanes. Tiles share only loads and decodes between these
// sequences, so results do not depend on the tile, row range, batch size or thread.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "avx2_common.h"
#include "q8_kernels.h"
#include "tile_prefetch.h"

namespace md::cpu::detail {
namespace {

constexpr int64_t kRowChunkBytes = 256 << 10;  // B > 4: code bytes kept in L2 per row chunk
constexpr int kTileVecs = 4;

// The two code kinds' decode (step s's 8 weights, columns 8s..8s+7 of the sub-group, from its 32
// bytes as prepared) and scale.
struct Int8Codes {
  // xor 0x80: the codes c become the signed bytes q = c - 128.
  static __m256i prepare(__m256i p) {
    return _mm256_xor_si256(p, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  static __m256 decode(__m256i q, int s) {
    const __m128i half = s < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
    const __m128i part = s % 2 ? _mm_srli_si128(half, 8) : half;
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part));
  }
  static float scale(const void* s, int64_t i) {
    return bf16_to_f32(static_cast<const bf16*>(s)[i]);
  }
};

struct Fp8Codes {
  static __m256i prepare(__m256i p) { return p; }
  // e4m3 byte b as the fp16 bits ((b & 0x80) << 8) | ((b & 0x7f) << 7): the same sign, exponent
  // field and mantissa with fp16's bias 15 for e4m3's 7, i.e. exactly the value / 256 (normal and
  // subnormal alike); vcvtph2ps widens it exactly. The 256 is in the scale. Computed as
  // ((b sign-extended to 16 bits) << 7) & 0xbf80: the extension's bit 8 lands on the sign bit,
  // the byte's own sign bit on bit 14, which the mask clears; the same bits in three operations.
  static __m256 decode(__m256i p, int s) {
    const __m128i half = s < 2 ? _mm256_castsi256_si128(p) : _mm256_extracti128_si256(p, 1);
    const __m128i part = s % 2 ? _mm_srli_si128(half, 8) : half;
    const __m128i w = _mm_cvtepi8_epi16(part);
    const __m128i h =
        _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xbf80)));
    return _mm256_cvtph_ps(h);
  }
  static float scale(const void* s, int64_t i) { return static_cast<const float*>(s)[i] * 256.0f; }
};

struct Tile {
  const uint8_t* codes;  // row 0 of the tile
  const void* scales;    // row 0 of the tile (the format's scale type)
  int64_t K, spr;        // codes and scales per row
  int per;               // sub-groups per group
};

// NR rows x NB vectors at x (stride ldx): y[j * ldy + i].
template <class C, int NR, int NB, bool kPrefetch>
void tile(const Tile& t, const float* x, int64_t ldx, float* y, int64_t ldy) {
  const int64_t G = t.K / 32;
  __m256 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  const TilePrefetch<NR, 32> pf(t.codes, t.K);
  int64_t gi = 0;  // the group of sub-group g
  int sub = 0;     // g's index inside it
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (kPrefetch) pf.step(g);
    __m256i q[NR];
    for (int i = 0; i < NR; ++i) {
      const uint8_t* wi = t.codes + i * t.K + g * 32;
      q[i] = C::prepare(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi)));
    }
    // Step 0 starts each chain with a product, the others add to it.
    __m256 gs[NR][NB];
    for (int i = 0; i < NR; ++i) {
      const __m256 wv = C::decode(q[i], 0);
      for (int j = 0; j < NB; ++j) gs[i][j] = _mm256_mul_ps(wv, _mm256_loadu_ps(x + j * ldx + g * 32));
    }
    for (int s = 1; s < 4; ++s) {
      __m256 xv[NB];
      for (int j = 0; j < NB; ++j) xv[j] = _mm256_loadu_ps(x + j * ldx + g * 32 + s * 8);
      for (int i = 0; i < NR; ++i) {
        const __m256 wv = C::decode(q[i], s);
        for (int j = 0; j < NB; ++j) gs[i][j] = _mm256_fmadd_ps(wv, xv[j], gs[i][j]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      const __m256 scv = _mm256_set1_ps(C::scale(t.scales, i * t.spr + gi));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(gs[i][j], scv, acc[i][j]);
    }
    if (++sub == t.per) {
      sub = 0;
      ++gi;
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) y[j * ldy + i] = hsum(acc[i][j]);
}

// Rows [r, r1): tiles of NR rows, then the rest in tiles of NR/2, .., 1.
template <class C, int NB, bool kPrefetch, int NR>
void row_tiles(const Q8Matrix& m, int64_t r, int64_t r1, const float* x, int64_t ldx, float* y,
               int64_t ldy) {
  const int64_t spr = m.scales_per_row();
  for (; r + NR <= r1; r += NR) {
    const size_t scale_bytes = m.kind == Q8Codes::kFp8 ? sizeof(float) : sizeof(bf16);
    const Tile t{m.codes + r * m.K,
                 static_cast<const uint8_t*>(m.scales) + size_t(r * spr) * scale_bytes, m.K, spr,
                 m.group / 32};
    tile<C, NR, NB, kPrefetch>(t, x, ldx, y + r, ldy);
  }
  if constexpr (NR > 1) row_tiles<C, NB, kPrefetch, NR / 2>(m, r, r1, x, ldx, y, ldy);
}

// Tile heights for the 16 ymm registers (codes, NR x NB chain sums and accumulators, X).
template <class C, bool kPrefetch>
void batch_tile(int nv, const Q8Matrix& m, int64_t r0, int64_t r1, const float* x, int64_t ldx,
                float* y, int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<C, 1, kPrefetch, 4>(m, r0, r1, x, ldx, y, ldy);
      break;
    case 2:
      row_tiles<C, 2, kPrefetch, 2>(m, r0, r1, x, ldx, y, ldy);
      break;
    case 3:
      row_tiles<C, 3, kPrefetch, 1>(m, r0, r1, x, ldx, y, ldy);
      break;
    default:
      row_tiles<C, 4, kPrefetch, 1>(m, r0, r1, x, ldx, y, ldy);
      break;
  }
}

template <class C>
void matmul(const Q8Matrix& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
            float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || m.K < 32) return;
  if (B <= kTileVecs) {
    batch_tile<C, true>(B, m, r0, r1, X, ldx, Y, ldy);
    return;
  }
  // Larger batches: a chunk of rows stays in L2 while every group of 4 vectors walks it.
  const int64_t row_bytes = m.K + m.scales_per_row() * 2;
  const int64_t chunk_rows = std::max<int64_t>(4, kRowChunkBytes / row_bytes / 4 * 4);
  for (int64_t rc = r0; rc < r1; rc += chunk_rows) {
    const int64_t rce = std::min(r1, rc + chunk_rows);
    for (int j = 0; j < B; j += kTileVecs) {
      const int nv = std::min(kTileVecs, B - j);
      if (j == 0) {
        batch_tile<C, true>(nv, m, rc, rce, X, ldx, Y, ldy);
      } else {
        batch_tile<C, false>(nv, m, rc, rce, X + j * ldx, ldx, Y + j * ldy, ldy);
      }
    }
  }
}

}  // namespace

void matmul_q8_avx2(const Q8Matrix& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
                    float* Y, int64_t ldy) {
  if (m.kind == Q8Codes::kFp8) {
    matmul<Fp8Codes>(m, r0, r1, X, B, ldx, Y, ldy);
  } else {
    matmul<Int8Codes>(m, r0, r1, X, B, ldx, Y, ldy);
  }
}

}  // namespace md::cpu::detail
