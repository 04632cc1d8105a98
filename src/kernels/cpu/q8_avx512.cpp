// AVX-512 kernel of int8 weights (int8.h; compiled with AVX-512 F/BW/VL/DQ; entered at the avx512
// and avx512bf16 levels). q8_avx2.cpp's scheme at twice the width, with the weight scale applied
// once per group and the code offset once per group:
//
// Half s (s = 0, 1) of a 32-column sub-group of a row is one 16-byte load, zero-extended into 16
// int32 lanes and converted (exact): lane l = the code c = q + 128 of column 16s + l, the
// activations' natural order. Each output Y[b, r] has one zmm accumulator; over a group's
// sub-groups, in column order,
//   g   = fma(c[16+l], x[16+l], ... fma(c[l], x[l], c[l'] * x[l']) ...) - 128 xs
//   acc = fma(g, scale of the group, acc)
// where lane l of xs is the sum of the group's activations in lane l (per call, in a fixed order:
// it is what turns the codes c back into q, sum (c - 128) x = sum c x - 128 sum x; one rounding
// more, on terms at most twice as large). FP8 bytes decode to their values, without an offset.
// Then a fixed pairwise reduction of the 16 lanes. Tiles share only loads and decodes between these
// sequences, so results do not depend on the tile, row range, batch size or thread.
//
// Why this shape: with 512-bit instructions in flight Intel cores run vector ops on ports 0 and 5
// only, and the zero-extension shares port 5 with half the FMAs. Per 16 weights that leaves the
// extension, the conversion and one FMA; the old form (a 32-byte load, xor 0x80 for q, an extract
// for the high half, a scale broadcast and FMA a sub-group) spent ~2x that, and ran at 14.7 G
// weights/s a core from L2 on the Emerald Rapids host, below a core's share of the memory system
// (bench/RESULTS.md, session 25).
#include <algorithm>
#include <cstdint>

#include "avx512_common.h"
#include "isa_scratch.h"
#include "q8_kernels.h"
#include "tile_prefetch.h"

namespace md::cpu::detail {
namespace {

constexpr int64_t kRowChunkBytes = 256 << 10;  // B > 4: code bytes kept in L2 per row chunk
constexpr int kTileVecs = 4;

// The two code kinds' decode (half s's 16 weights, columns 16s..16s+15 of the sub-group at p, as
// the unscaled values the chain multiplies: int8 codes c, FP8 values / 256) and scale
// (q8_avx2.cpp has the reasoning). kOffset: the value is q + 128 (the tile subtracts 128 xs).
struct Int8Codes {
  static constexpr bool kOffset = true;
  static __m512 decode(const uint8_t* p, int s) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * s));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
  }
  static float scale(const void* s, int64_t i) {
    return bf16_to_f32(static_cast<const bf16*>(s)[i]);
  }
};

struct Fp8Codes {
  static constexpr bool kOffset = false;
  // The fp16 bits of value / 256 (q8_avx2.cpp): ((b << 7) of the sign-extended byte) & 0xbf80,
  // three operations for ((b & 0x80) << 8) | ((b & 0x7f) << 7), the same bits.
  static __m512 decode(const uint8_t* p, int s) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * s));
    const __m256i w = _mm256_cvtepi8_epi16(half);
    const __m256i h =
        _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
    return _mm512_cvtph_ps(h);
  }
  static float scale(const void* s, int64_t i) { return static_cast<const float*>(s)[i] * 256.0f; }
};

// Per-thread buffer for the activations' per-group lane sums (xs).
thread_local IsaScratch t_xsums;

// xs for vectors [0, B) of X: 16 floats per group, vector b's at xs + b * groups * 16.
void lane_sums(const float* X, int B, int64_t ldx, int64_t K, int per, float* xs) {
  const int64_t groups = K / 32 / per;
  for (int b = 0; b < B; ++b)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const float* x = X + b * ldx + gi * per * 32;
      __m512 v = _mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16));
      for (int k = 1; k < per; ++k)
        v = _mm512_add_ps(
            v, _mm512_add_ps(_mm512_loadu_ps(x + 32 * k), _mm512_loadu_ps(x + 32 * k + 16)));
      _mm512_storeu_ps(xs + (b * groups + gi) * 16, v);
    }
}

struct Tile {
  const uint8_t* codes;  // row 0 of the tile
  const void* scales;    // row 0 of the tile (the format's scale type)
  int64_t K, spr;        // codes and scales per row
  int per;               // sub-groups per group
  const float* xs;       // kOffset: the tile's first vector's lane sums (lane_sums)
};

// NR rows x NB vectors at x (stride ldx): y[j * ldy + i].
template <class C, int NR, int NB, bool kPrefetch>
void tile(const Tile& t, const float* x, int64_t ldx, float* y, int64_t ldy) {
  const int64_t G = t.K / 32;
  __m512 acc[NR][NB];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const TilePrefetch<NR, 32> pf(t.codes, t.K);
  for (int64_t g0 = 0, gi = 0; g0 < G; g0 += t.per, ++gi) {  // group gi: sub-groups [g0, g0 + per)
    const int64_t g1 = std::min<int64_t>(G, g0 + t.per);
    __m512 gs[NR][NB];
    for (int64_t g = g0; g < g1; ++g) {
      if constexpr (kPrefetch) pf.step(g);
      for (int s = 0; s < 2; ++s) {
        __m512 xv[NB];
        for (int j = 0; j < NB; ++j) xv[j] = _mm512_loadu_ps(x + j * ldx + g * 32 + s * 16);
        for (int i = 0; i < NR; ++i) {
          const __m512 wv = C::decode(t.codes + i * t.K + g * 32, s);
          // The group's first product starts each chain, the others add to it.
          for (int j = 0; j < NB; ++j)
            gs[i][j] =
                g == g0 && s == 0 ? _mm512_mul_ps(wv, xv[j]) : _mm512_fmadd_ps(wv, xv[j], gs[i][j]);
        }
      }
    }
    if constexpr (C::kOffset) {
      const __m512 k128 = _mm512_set1_ps(128.0f);
      for (int j = 0; j < NB; ++j) {
        const __m512 xs = _mm512_loadu_ps(t.xs + (j * t.spr + gi) * 16);
        for (int i = 0; i < NR; ++i) gs[i][j] = _mm512_fnmadd_ps(k128, xs, gs[i][j]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      const __m512 scv = _mm512_set1_ps(C::scale(t.scales, i * t.spr + gi));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(gs[i][j], scv, acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NB; ++j) y[j * ldy + i] = hsum(acc[i][j]);
}

// Rows [r, r1): tiles of NR rows, then the rest in tiles of NR/2, .., 1.
template <class C, int NB, bool kPrefetch, int NR>
void row_tiles(const Q8Matrix& m, int64_t r, int64_t r1, const float* x, int64_t ldx,
               const float* xs, float* y, int64_t ldy) {
  const int64_t spr = m.scales_per_row();
  for (; r + NR <= r1; r += NR) {
    const size_t scale_bytes = m.kind == Q8Codes::kFp8 ? sizeof(float) : sizeof(bf16);
    const Tile t{m.codes + r * m.K,
                 static_cast<const uint8_t*>(m.scales) + size_t(r * spr) * scale_bytes,
                 m.K,
                 spr,
                 m.group / 32,
                 xs};
    tile<C, NR, NB, kPrefetch>(t, x, ldx, y + r, ldy);
  }
  if constexpr (NR > 1) row_tiles<C, NB, kPrefetch, NR / 2>(m, r, r1, x, ldx, xs, y, ldy);
}

// Tile heights for the 32 zmm registers (NR x NB chain sums and accumulators, X).
template <class C, bool kPrefetch>
void batch_tile(int nv, const Q8Matrix& m, int64_t r0, int64_t r1, const float* x, int64_t ldx,
                const float* xs, float* y, int64_t ldy) {
  switch (nv) {
    case 1:
      row_tiles<C, 1, kPrefetch, 4>(m, r0, r1, x, ldx, xs, y, ldy);
      break;
    case 2:
      row_tiles<C, 2, kPrefetch, 4>(m, r0, r1, x, ldx, xs, y, ldy);
      break;
    case 3:
      row_tiles<C, 3, kPrefetch, 2>(m, r0, r1, x, ldx, xs, y, ldy);
      break;
    default:
      row_tiles<C, 4, kPrefetch, 2>(m, r0, r1, x, ldx, xs, y, ldy);
      break;
  }
}

template <class C>
void matmul(const Q8Matrix& m, int64_t r0, int64_t r1, const float* X, int B, int64_t ldx,
            float* Y, int64_t ldy) {
  if (r0 >= r1 || B <= 0 || m.K < 32) return;
  const int64_t groups = m.scales_per_row();
  float* xs = nullptr;  // vector b's lane sums at xs + b * groups * 16
  if constexpr (C::kOffset) {
    xs = static_cast<float*>(t_xsums.get(static_cast<size_t>(B * groups * 16) * sizeof(float)));
    lane_sums(X, B, ldx, m.K, m.group / 32, xs);
  }
  if (B <= kTileVecs) {
    batch_tile<C, true>(B, m, r0, r1, X, ldx, xs, Y, ldy);
    return;
  }
  // Larger batches: a chunk of rows stays in L2 while every group of 4 vectors walks it.
  const int64_t row_bytes = m.K + m.scales_per_row() * 2;
  const int64_t chunk_rows = std::max<int64_t>(4, kRowChunkBytes / row_bytes / 4 * 4);
  for (int64_t rc = r0; rc < r1; rc += chunk_rows) {
    const int64_t rce = std::min(r1, rc + chunk_rows);
    for (int j = 0; j < B; j += kTileVecs) {
      const int nv = std::min(kTileVecs, B - j);
      const float* xsj = xs ? xs + j * groups * 16 : nullptr;
      if (j == 0) {
        batch_tile<C, true>(nv, m, rc, rce, X, ldx, xsj, Y, ldy);
      } else {
        batch_tile<C, false>(nv, m, rc, rce, X + j * ldx, ldx, xsj, Y + j * ldy, ldy);
      }
    }
  }
}

}  // namespace

void matmul_q8_avx512(const Q8Matrix& m, int64_t r0, int64_t r1, const float* X, int B,
                      int64_t ldx, float* Y, int64_t ldy) {
  if (m.kind == Q8Codes::kFp8) {
    matmul<Fp8Codes>(m, r0, r1, X, B, ldx, Y, ldy);
  } else {
    matmul<Int8Codes>(m, r0, r1, X, B, ldx, Y, ldy);
  }
}

}  // namespace md::cpu::detail
